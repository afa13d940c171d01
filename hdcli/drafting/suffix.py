"""SuffixDecoding (Snowflake's arctic-inference; vLLM's `suffix` method) as a peer proposer.

The drafts come from the real library, `arctic_inference.suffix_decoding.SuffixDecodingCache`:
a suffix tree over the current request's prompt and output, and a global suffix tree over the
responses of earlier requests of the same cache. Each step it matches the longest suffix of the
history (up to max_tree_depth tokens) and proposes a token tree whose size is limited by
max_spec_factor * match length + max_spec_offset tokens and whose tokens each have an estimated
probability >= min_token_prob. hd verifies that tree with its own tree verifier (hdcli/engine/decode/tree.py),
so the output is exactly plain decoding's, as for every other method.

Settings are the library's recommended ones (the vLLM defaults): max_tree_depth 24,
max_spec_factor 1.0, max_spec_offset 0, min_token_prob 0.1, tree speculation, at most 24
speculated tokens, no limit on cached requests. The whole tree is verified, as vLLM does: no
cost cap of hd's is applied to it (the runner passes cost=None).

Interface: the one the decode loop asks of a drafter (reset, extend, propose, observe, rate).
Invariant: `reset` starts a new request in the cache (stopping the previous one, whose response
stays in the global tree); `extend` appends accepted tokens to the active request's response.
"""
from __future__ import annotations

import itertools
from typing import Sequence

from ..engine.decode.draft import Draft, Drafter
from ..errors import HdError

INSTALL = ("pip install nanobind==2.9.2 ninja cmake grpcio-tools protobuf wheel && "
           "pip install --no-build-isolation --no-deps arctic-inference==0.3.0 (`make setup` does this)")


def available() -> bool:
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401
        return True
    except ImportError:
        return False


MAX_TREE_DEPTH = 24


def new_cache(max_tree_depth: int = MAX_TREE_DEPTH, max_cached_requests: int = -1):
    """A SuffixDecodingCache (one per benchmark run: its global tree learns across requests)."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError:
        raise HdError(f"method 'suffix' needs arctic-inference, which is not installed: {INSTALL}") from None
    return SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=max_cached_requests)


class SuffixDrafter(Drafter):
    name = "suffix"
    _ids = itertools.count()

    def __init__(self, cache, max_spec_tokens: int = 24, max_spec_factor: float = 1.0,
                 max_spec_offset: float = 0.0, min_token_prob: float = 0.1):
        self.cache = cache
        self.max_spec_tokens, self.max_spec_factor = max_spec_tokens, max_spec_factor
        self.max_spec_offset, self.min_token_prob = max_spec_offset, min_token_prob
        self.req = None

    def settings(self) -> dict:
        return {"max_tree_depth": MAX_TREE_DEPTH, "max_spec_tokens": self.max_spec_tokens,
                "max_spec_factor": self.max_spec_factor, "max_spec_offset": self.max_spec_offset,
                "min_token_prob": self.min_token_prob, "use_tree_spec": True}

    def reset(self, tokens: Sequence[int]) -> None:
        self.finish()
        self.req = f"hd-{next(self._ids)}"
        self.cache.start_request(self.req, [int(t) for t in tokens])

    def finish(self) -> None:
        if self.req is not None and self.req in self.cache.active_requests:
            self.cache.stop_request(self.req)

    def extend(self, tokens: Sequence[int]) -> None:
        self.cache.add_active_response(self.req, [int(t) for t in tokens])

    def propose(self, history: Sequence[int], max_len: int | None = None, stats=None) -> list[Draft]:
        depth = MAX_TREE_DEPTH
        n = self.max_spec_tokens if max_len is None else min(self.max_spec_tokens, max_len)
        cands: list[list[int]] = []
        if n > 0:
            d = self.cache.speculate(self.req, [int(t) for t in history[-depth:]], max_spec_tokens=n,
                                     max_spec_factor=self.max_spec_factor,
                                     max_spec_offset=self.max_spec_offset,
                                     min_token_prob=self.min_token_prob, use_tree_spec=True)
            cands = tree_paths(d.token_ids, d.parents)
        if stats is not None:
            stats.layer(self.name).record_query(cands)
        return [Draft(tuple(c), self.name) for c in cands]

    # the decode loop's bookkeeping hooks: nothing to adapt, the library keeps its own counts
    def observe(self, tested, accepted) -> None:
        pass

    def rate(self, layer, depth: int = 1, first_child: bool = True) -> float:
        return 1.0


def tree_paths(tokens: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """Root-to-leaf token paths of a tree given as parallel lists (parent -1: a child of the
    root), leaves in node order; merging them by prefix (hdcli.engine.decode.tree.build_tree) gives the tree back."""
    has_child = set(p for p in parents if p >= 0)
    out = []
    for i in range(len(tokens)):
        if i in has_child:
            continue
        path, j = [], i
        while j >= 0:
            path.append(int(tokens[j]))
            j = parents[j]
        out.append(path[::-1])
    return out
