"""The decode loop: draft, verify every drafted token in one target forward, accept, crop, repeat.

Each step the hierarchy proposes candidates; they are merged into a token tree rooted at the
last history token and capped by cost (hdcli/engine/tree.py); one forward over the tree gives the
target's prediction after every node; the acceptance rule (hdcli/engine/verify.py) walks the tree.

KV-cache invariant: at the top of each step the cache holds every history token except the
last one (`last`, the tree's root), which is fed as the first input of the step together with
the tree. After the forward the cache holds history + every tree node; keep_path moves the
accepted path's entries next to `last` and drops the rest, so a rejected token or branch never
stays in the cache. The target's own next token becomes `last` for the next step.

With no drafter this is plain autoregressive decoding with the same model and cache (the `ar`
baseline every speedup is measured against).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from . import invariant
from .draft import Drafter
from .stats import RunStats
from .costs import CostCurve
from .tree import Tree, build_tree, keep_path, new_cache, reached, supports_trees, tree_forward
from .verify import Sampling, accept_chain_q, accept_tree

# on_tokens(tokens, layers): called after each step with the new tokens and, per token, the name
# of the layer that drafted it (None for the target's own token).
TokenCallback = Callable[[list[int], list[str | None]], None]


@dataclass
class Generation:
    tokens: list[int]            # new tokens, EOS included when it ended the generation
    layers: list[str | None]     # per token: the drafting layer, or None for the target's own
    stop_reason: str             # "eos" | "length" | "stop"
    stats: RunStats = field(default_factory=RunStats)


class Decoder:
    """Speculative decoding of one sequence with a target model and a drafting hierarchy.

    cost: the target's forward-cost curve (hdcli.engine.costs) that caps each step's draft tree; None
    sends every drafted node (up to max_nodes)."""

    def __init__(self, model, eos_ids: Sequence[int] = (), drafter: Drafter | None = None,
                 cost: CostCurve | None = None, max_nodes: int = 63):
        self.model = model
        self.eos_ids = set(int(e) for e in eos_ids)
        self.drafter = drafter
        self.cost, self.max_nodes = cost, max_nodes
        if invariant.is_enabled(model) and max_nodes + 1 > invariant.MAX_ROWS:
            raise ValueError(f"the M-invariant forward verifies at most {invariant.MAX_ROWS - 1} nodes a step")
        self.device = next(model.parameters()).device

    def _prefill(self, ids: Sequence[int], cache) -> None:
        """Fill the cache with ids. No logits are needed (the last prompt token is fed with the
        first step), so the head runs on one row only where the model takes `logits_to_keep`, as
        transformers' generate() does: for a 400-token prompt that saves 400 rows of the head."""
        inp = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        try:
            self.model(input_ids=inp, past_key_values=cache, use_cache=True, logits_to_keep=1)
        except TypeError:  # an older model class without logits_to_keep; the cache is untouched
            self.model(input_ids=inp, past_key_values=cache, use_cache=True)

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 256,
                 sampling: Sampling = Sampling(), seed: int | None = None,
                 stop_check: Callable[[list[int]], int | None] | None = None,
                 on_tokens: TokenCallback | None = None) -> Generation:
        """stop_check(tokens) may return a length to cut the output at (a stop string was seen)."""
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        gen = None
        if not sampling.greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed if seed is not None else torch.seed())
        stats = RunStats(prompt_tokens=len(prompt_ids))
        t_start = time.perf_counter()
        cache = new_cache(self.model)
        history = [int(t) for t in prompt_ids]
        if len(history) > 1:
            self._prefill(history[:-1], cache)
        stats.prefill_seconds = time.perf_counter() - t_start
        if self.drafter is not None:
            self.drafter.reset(history)
        step = _Step(cache, supports_trees(cache), sampling, gen, stats)
        out: list[int] = []
        out_layers: list[str | None] = []
        stop_reason = "length"
        while len(out) < max_new_tokens:
            new, new_layers = self._step(step, history, max_new_tokens - len(out) - 1)
            for i, t in enumerate(new):
                if t in self.eos_ids:
                    new, new_layers, stop_reason = new[:i + 1], new_layers[:i + 1], "eos"
                    break
            stats.accept_lengths.append(len(new))
            history.extend(new)
            before = len(out)
            out.extend(new)
            out_layers.extend(new_layers)
            stats.bookkeeping_seconds += time.perf_counter() - step.forward_end
            if stop_check is not None:
                cut = stop_check(out)
                if cut is not None:
                    del out[cut:], out_layers[cut:]
                    stop_reason = "stop"
            if on_tokens is not None and len(out) > before:
                on_tokens(out[before:], out_layers[before:])
            if stop_reason != "length":
                break
            if self.drafter is not None:
                self.drafter.extend(new)
        stats.new_tokens = len(out)
        stats.wall_seconds = time.perf_counter() - t_start
        return Generation(tokens=out, layers=out_layers, stop_reason=stop_reason, stats=stats)

    def _step(self, s: "_Step", history: list[int], room: int) -> tuple[list[int], list[str | None]]:
        """One speculative step: draft at most `room` tokens, verify them all in one forward,
        keep what the target accepts. Returns the new tokens (the accepted drafted ones, then the
        target's own) and per token the layer that drafted it (None for the target's).

        Acceptance (engine/verify.py): greedy keeps the longest path from the root whose every
        token is the target's argmax after its parent, then adds the target's argmax after it.
        Sampling walks the same way: at each node the children are tried in order, a child x
        (a point-mass draft) kept with probability p(x), else p(x) := 0 and renormalise; a draft
        model's chain (x drawn from q) is kept with probability min(1, p(x)/q(x)), else the token
        is drawn from norm(max(0, p - q)). Either way the output has the target's distribution."""
        drafter, stats = self.drafter, s.stats
        t0 = time.perf_counter()
        drafts = drafter.propose(history, room, stats) if drafter else []
        q_rows = drafts[0].q if drafts else None
        if q_rows is not None:  # a draft model's sampled chain: verified with its distribution
            tree = build_tree(drafts[:1], None, None, self.max_nodes)
        else:
            tree = build_tree(drafts, drafter.rate if drafter else None, self.cost, self.max_nodes,
                              s.trees_ok)
        t1 = time.perf_counter()
        past = len(history) - 1            # cache length before this step
        logits = tree_forward(self.model, tree, history[-1], s.cache)
        t2 = time.perf_counter()
        if drafter is not None and getattr(drafter, "records", False):
            # the target's predictions at every node, for layers that recycle them
            drafter.record(history[-2:-1], [history[-1]] + tree.tokens[1:], tree.parents, logits)
        if q_rows is not None and not s.sampling.greedy:
            n, nxt = accept_chain_q(logits, tree.tokens[1:], q_rows, s.sampling, s.gen)
            path = list(range(1, n + 1))
        else:
            path, nxt = accept_tree(logits, tree, s.sampling, s.gen)
        keep_path(s.cache, past, path)     # the root and the accepted path only
        if tree.size():
            self._record(stats, tree, path)
        stats.tree_sizes.append(tree.size())
        stats.draft_seconds += t1 - t0
        stats.forward_seconds += t2 - t1
        s.forward_end = t2  # the caller's bookkeeping after the step counts from here
        return [tree.tokens[i] for i in path] + [nxt], [tree.layers[i] for i in path] + [None]

    def _record(self, stats: RunStats, tree: Tree, path: list[int]) -> None:
        """Per-layer counts of what was sent, kept and which candidate won; feeds `adaptive`."""
        for name in tree.layers[1:]:
            stats.layer(name).drafted += 1
        for i in path:
            stats.layer(tree.layers[i]).accepted += 1
        tested, accepted = reached(tree, path)
        if path:
            stats.layer(tree.layers[path[-1]]).won += 1
        self.drafter.observe(tested, accepted)
        if hasattr(self.drafter, "record_target"):
            self.drafter.record_target(tree.size(), len(path))


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where a and b differ (or where the shorter ends), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class _Step:
    """What every step of one generation shares."""
    cache: object
    trees_ok: bool          # the cache can take a tree (else candidates are verified as one chain)
    sampling: Sampling
    gen: torch.Generator | None
    stats: RunStats
    forward_end: float = 0.0  # when the last step's forward returned
