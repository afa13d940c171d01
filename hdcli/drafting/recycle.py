"""The recycle layer: the target's own predictions from earlier verification forwards."""
from __future__ import annotations

from typing import Sequence

from .registry import LayerSpec, register


class RecycledTable:
    """The target's own predictions, recycled: after every verification forward the target's
    top-k next tokens at every tree node are free (the forward computed them); this table keeps
    them, keyed by the node's last two tokens (and its last token alone), so later steps can draft
    what the target predicted the last time it saw the same tokens (Token Recycling, Luo et al.
    2024, with a bigram key). It lives as long as the object: one per run shares it across
    requests.

    Parameters
      top_k   predictions kept per key (the first is followed by the greedy walk; the others
              start further candidates).
    Invariant
      bigram[(a, b)] and unigram[b] hold the top-k of the most recent forward row whose input
      token was b (after a); a newer row replaces an older one.
    """

    def __init__(self, top_k: int = 2):
        self.top_k = top_k
        self.bigram: dict[tuple[int, int], tuple[int, ...]] = {}
        self.unigram: dict[int, tuple[int, ...]] = {}

    def record(self, before: Sequence[int], tokens: Sequence[int], parents: Sequence[int],
               top: Sequence[Sequence[int]]) -> None:
        """tokens/parents: a forward's input nodes (parents[0] = -1: the node follows `before`),
        top: each node's best next tokens by the target, best first (verify.top_tokens of its
        output rows; the decoder computes them once for acceptance and for this)."""
        prev0 = before[-1] if before else -1
        k = self.top_k
        for i, t in enumerate(tokens):
            a = prev0 if parents[i] < 0 else tokens[parents[i]]
            self.bigram[(a, t)] = self.unigram[t] = tuple(top[i][:k])

    def next(self, a: int, b: int) -> tuple[int, ...]:
        return self.bigram.get((a, b)) or self.unigram.get(b, ())


class RecycledLayer:
    """Drafts by walking a RecycledTable from the end of the history: the first token is the
    target's last prediction after the same two tokens, and so on (a greedy walk, at most max_len
    tokens, stopping at a token never seen as input). Further candidates start with the table's
    next-best first tokens."""

    name = "recycle"

    def __init__(self, table: RecycledTable | None = None):
        self.table = RecycledTable() if table is None else table

    def reset(self, tokens: Sequence[int]) -> None:
        pass

    def extend(self, tokens: Sequence[int]) -> None:
        pass

    @property
    def top_k(self) -> int:
        return self.table.top_k

    def record(self, before, tokens, parents, top) -> None:
        self.table.record(before, tokens, parents, top)

    def _walk(self, a: int, b: int, max_len: int) -> list[int]:
        out: list[int] = []
        while len(out) < max_len:
            nxt = self.table.next(a, b)
            if not nxt:
                break
            a, b = b, nxt[0]
            out.append(b)
        return out

    def propose(self, history: Sequence[int], max_len: int, max_candidates: int = 1) -> list[list[int]]:
        if not history:
            return []
        a, b = (history[-2] if len(history) > 1 else -1), history[-1]
        firsts = self.table.next(a, b)[:max_candidates]
        return [[f] + self._walk(b, f, max_len - 1) for f in firsts]



register(LayerSpec(
    name="recycle", prior=(0.1, 0.3, 0.45, 0.55), style="yellow", short="rec",
    help="the target's own recycled predictions only (Token Recycling with bigram keys)",
    build=lambda s: [RecycledLayer(s.recycle_table)], in_default=lambda s: True,
    bench_default=False))
