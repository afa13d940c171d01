"""The recycle layer: the target's own predictions from earlier verification forwards."""
from __future__ import annotations

import heapq
import itertools
from typing import Sequence

from ..engine.decode.draft import Draft
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
      bigram[(a, b)] and unigram[b] hold (tokens, probs) of the most recent forward row whose
      input token was b (after a): its top-k tokens, best first, and under sampling their
      probabilities (verify.top_probs), else None; a newer row replaces an older one.
    """

    # a greedy record's rank-r prediction was the target's next token this often (rank 0 first),
    # where the table had a row for the key: the prior of `rank_rate`, measured by replay
    # (hd bench drafts: the bundled model's Spec-Bench answers, the prompts recorded)
    RANK_PRIOR = (0.35, 0.11, 0.06, 0.035, 0.03, 0.02, 0.02, 0.015)

    def __init__(self, top_k: int = 2, weight: float = 8.0, decay: float = 0.995):
        self.top_k = top_k
        self.bigram: dict[tuple[int, int], tuple] = {}
        self.unigram: dict[int, tuple] = {}
        self.sampled = False   # the last record came with probabilities (a sampled step)
        # per rank: drafted nodes the verification reached and those it kept, decayed a step; kept
        # with the table (across requests: how well the target's rank-r guess holds is the model's)
        self.tested = [0.0] * max(top_k, len(self.RANK_PRIOR))
        self.kept = [0.0] * len(self.tested)
        self.weight, self.decay = weight, decay

    def rank_rate(self, r: int) -> float:
        """Estimated chance that a greedy rank-r prediction is the target's next token."""
        prior = self.RANK_PRIOR[min(r, len(self.RANK_PRIOR) - 1)]
        return (self.kept[r] + prior * self.weight) / (self.tested[r] + self.weight)

    def observe_ranks(self, tested: Sequence[int], kept: Sequence[int]) -> None:
        for r in range(len(self.tested)):
            self.tested[r] = self.tested[r] * self.decay + tested[r]
            self.kept[r] = self.kept[r] * self.decay + kept[r]

    def record(self, before: Sequence[int], tokens: Sequence[int], parents: Sequence[int],
               top: Sequence[Sequence[int]], probs: Sequence[Sequence[float]] | None = None) -> None:
        """tokens/parents: a forward's input nodes (parents[0] = -1: the node follows `before`),
        top: each node's best next tokens by the target, best first (verify.top_tokens of its
        output rows; the decoder computes them once for acceptance and for this), probs: their
        probabilities when the step sampled (None when greedy)."""
        prev0 = before[-1] if before else -1
        k = self.top_k
        self.sampled = probs is not None
        for i, t in enumerate(tokens):
            a = prev0 if parents[i] < 0 else tokens[parents[i]]
            self.bigram[(a, t)] = self.unigram[t] = (tuple(top[i][:k]), None if probs is None else tuple(probs[i][:k]))

    def scored(self, a: int, b: int) -> tuple:
        """(tokens, probs or None) predicted after a, b; ((), None) if b was never an input."""
        return self.bigram.get((a, b)) or self.unigram.get(b, ((), None))

    def next(self, a: int, b: int) -> tuple[int, ...]:
        return self.scored(a, b)[0]


class RecycledLayer:
    """Drafts from a RecycledTable, from the end of the history.

    Greedy records (no probabilities): a walk, the first token being the target's last prediction
    after the same two tokens, and so on (at most max_len tokens, stopping at a token never seen
    as input); further candidates start with the table's next-best first tokens.

    Sampled records (probabilities known) under a bigram key: under sampling a drafted token is
    kept with the target's probability of it, so the tree that pays is the one of the likeliest
    paths, with several children where the target was unsure. The layer grows it best first: the node whose
    path probability (product of the recorded probabilities) is highest is added next, until
    `tree_nodes` nodes or none above `min_path_prob`; each root-to-leaf path is a candidate (at
    most max_candidates, likeliest leaves first) whose tokens carry their probabilities (Draft.p),
    by which the tree is priced and capped (engine/decode/tree.py). Only bigram entries are
    grown: a unigram entry's probabilities were recorded after another context and did not predict
    (bundled model, t0.7, 4 Spec-Bench questions: first tokens recorded at p 0.93 were kept 24% of
    the time, at p 0.32 29%; under a bigram key 73% and 22%); a unigram match is walked as when
    greedy, its tokens priced by the layer's tracked rate.

    A recorded probability was taken after another context, so it is calibrated in the request:
    after every step the layer checks each node it proposed whose parent the output followed
    (whether or not the cap sent it: the target's token there is drawn the same way) and keeps
    calibration = (kept + weight) / (summed probabilities + weight), both decayed by `decay` a step;
    drafts carry min(1, calibration x p). (Bundled model, t0.7: first tokens recorded at p 0.93
    were kept 73% of the time.)

    The token after next (LogitSpec, Liu et al. 2025, arXiv 2507.01449), greedy records: the last
    history token (the root) is the target's best token of the row before it, which the table has
    just recorded under (history[-3], history[-2]); that row's next-best tokens are often the token
    *after* the root, so each starts one more candidate, [alt] + the walk from (root, alt), tagged
    `recycle:next` so the tree prices it by its own tracked acceptance (it shares recycle's
    prior) and the bench reports it apart. Off by default: it did not pay (bundled model, greedy,
    12 Spec-Bench questions, `hd bench spec-bench -n 128 --limit 2`: 1 of its 41 tokens the cap
    sent was kept).

    Parameters
      tree_nodes     most nodes of a sampled tree (the decoder's cost cap cuts it further).
      min_path_prob  a node less likely than this to be reached and kept is not added.
      weight, decay  the calibration's prior weight (prior: 1) and per-step decay.
      next_next      add the LogitSpec candidates (greedy records only).
    """

    name = "recycle"

    def __init__(self, table: RecycledTable | None = None, tree_nodes: int = 16, min_path_prob: float = 0.02,
                 weight: float = 2.0, decay: float = 0.95, next_next: bool = False, greedy_tree: bool = False):
        self.table = RecycledTable() if table is None else table
        self.tree_nodes, self.min_path_prob = tree_nodes, min_path_prob
        self.next_next, self.greedy_tree = next_next, greedy_tree
        self.weight, self.decay = weight, decay
        self.reset(())

    def reset(self, tokens: Sequence[int]) -> None:
        self.kept = self.predicted = 0.0
        self.proposed: list[tuple] = []   # the last sampled tree's nodes: (token, parent, probability)
        self.ranked: list[tuple] = []     # the last greedy tree's nodes: (token, parent, rank)

    @property
    def calibration(self) -> float:
        return (self.kept + self.weight) / (self.predicted + self.weight)

    def extend(self, tokens: Sequence[int]) -> None:
        """Calibrate on the last tree: a node whose parent the output followed was kept iff the
        output's next token is its token."""
        if self.ranked:
            self._observe_ranks(tokens)
        if not self.proposed:
            return
        self.kept *= self.decay
        self.predicted *= self.decay
        followed = {-1: 0}   # node -> its depth, for nodes on the output's path (-1: the root)
        for i, (t, parent, p) in enumerate(self.proposed):
            depth = followed.get(parent)
            if depth is None or depth >= len(tokens):
                continue
            self.predicted += p
            if tokens[depth] == t:
                self.kept += 1.0
                followed[i] = depth + 1
        self.proposed = []

    def _observe_ranks(self, tokens: Sequence[int]) -> None:
        """The greedy tree's nodes the output reached (parent followed), by rank, and those kept."""
        n = len(self.table.tested)
        tested, kept = [0] * n, [0] * n
        followed = {-1: 0}
        for i, (t, parent, r) in enumerate(self.ranked):
            depth = followed.get(parent)
            if depth is None or depth >= len(tokens):
                continue
            tested[r] += 1
            if tokens[depth] == t:
                kept[r] += 1
                followed[i] = depth + 1
        self.table.observe_ranks(tested, kept)
        self.ranked = []

    @property
    def top_k(self) -> int:
        return self.table.top_k

    @property
    def priced(self) -> bool:
        """Whether its drafts carry estimates of the target's probabilities (a sampled step's
        record, or the greedy tree's rank estimates): the hierarchy then gives it no share of the
        slots (Hierarchy.propose); the tree prices its nodes by them (tree.node_estimates)."""
        return self.table.sampled or self.greedy_tree

    def record(self, before, tokens, parents, top, probs=None) -> None:
        self.table.record(before, tokens, parents, top, probs)

    def _walk(self, a: int, b: int, max_len: int) -> list[int]:
        out: list[int] = []
        while len(out) < max_len:
            nxt = self.table.next(a, b)
            if not nxt:
                break
            a, b = b, nxt[0]
            out.append(b)
        return out

    def _best_first(self, a: int, b: int, max_len: int, children) -> list[tuple]:
        """A tree grown best first from the root after (a, b): children(a, b) gives a node's
        (token, factor, tag) choices, a child's path estimate is its parent's times its factor; up
        to tree_nodes nodes, none under min_path_prob, none deeper than max_len. Returns the nodes
        (token, parent, tag, path estimate), a parent before its children."""
        heap: list[tuple] = []   # (-path estimate, order, parent node, a, token, tag, depth)
        order = itertools.count()

        def push(parent: int, a: int, b: int, reach: float, depth: int) -> None:
            if depth > max_len:
                return
            for t, factor, tag in children(a, b):
                if reach * factor >= self.min_path_prob:
                    heapq.heappush(heap, (-reach * factor, next(order), parent, b, t, tag, depth))

        nodes: list[tuple] = []
        push(-1, a, b, 1.0, 1)
        while heap and len(nodes) < self.tree_nodes:
            neg, _, parent, prev, t, tag, depth = heapq.heappop(heap)
            nodes.append((t, parent, tag, -neg))
            push(len(nodes) - 1, prev, t, -neg, depth + 1)
        return nodes

    @staticmethod
    def _paths(nodes: Sequence[tuple]) -> list[list[int]]:
        """Each root-to-leaf path of a _best_first tree (node ids), likeliest leaf first."""
        parents = {parent for _, parent, _, _ in nodes}
        out = []
        for leaf in sorted((i for i in range(len(nodes)) if i not in parents), key=lambda i: -nodes[i][3]):
            path, i = [], leaf
            while i >= 0:
                path.append(i)
                i = nodes[i][1]
            out.append(path[::-1])
        return out

    def _grow_ranked(self, a: int, b: int, max_len: int) -> list[Draft]:
        """Greedy records: the best-first tree of the table's predictions (bigram key, else the
        last token's), a rank-r child estimated at the table's rank_rate(r) times its parent's path
        estimate; each root-to-leaf path a candidate (all of them: the tree_nodes bound sizes it,
        not the hierarchy's slots), carrying its nodes' estimates (Draft.p), by which the tree is
        capped."""
        rates = [self.table.rank_rate(r) for r in range(self.table.top_k)]
        nodes = self._best_first(a, b, max_len, lambda a, b: ((t, rates[r], r) for r, t in enumerate(self.table.next(a, b))))
        self.ranked = [(t, parent, r) for t, parent, r, _ in nodes]
        return [Draft(tuple(nodes[i][0] for i in path), self.name, p=tuple(rates[nodes[i][2]] for i in path))
                for path in self._paths(nodes)]

    def _grow(self, a: int, b: int, max_len: int, max_candidates: int) -> list[Draft]:
        """The best-first tree of the recorded probabilities (see the class), as its paths."""
        def children(a: int, b: int):
            tokens, probs = self.table.bigram.get((a, b), ((), None))   # bigram only: see the class
            return () if probs is None else ((t, p, p) for t, p in zip(tokens, probs))

        nodes = self._best_first(a, b, max_len, children)
        self.proposed = [(t, parent, p) for t, parent, p, _ in nodes]
        scale = self.calibration
        return [Draft(tuple(nodes[i][0] for i in path), self.name, p=tuple(min(1.0, scale * nodes[i][2]) for i in path))
                for path in self._paths(nodes)[:max_candidates]]

    def candidates(self, history: Sequence[int], max_len: int, max_candidates: int = 1) -> list:
        if not history:
            return []
        a, b = (history[-2] if len(history) > 1 else -1), history[-1]
        if self.table.bigram.get((a, b), ((), None))[1] is not None:
            return self._grow(a, b, max_len, max_candidates)
        if self.greedy_tree and not self.table.sampled:
            return self._grow_ranked(a, b, max_len)
        firsts = self.table.next(a, b)
        out: list = [[f] + self._walk(b, f, max_len - 1) for f in firsts[:max_candidates]]
        if self.next_next and len(history) > 2 and len(out) < max_candidates:
            row, probs = self.table.scored(history[-3], a)
            if probs is None and row and row[0] == b:   # b was that row's best token: its next-best follow b
                taken = {c[0] for c in out}
                for alt in row[1:]:
                    if alt not in taken and len(out) < max_candidates:
                        taken.add(alt)
                        out.append(Draft((alt, *self._walk(b, alt, max_len - 1)), self.name + ":next"))
        return out


register(LayerSpec(
    name="recycle", rank=30, prior=(0.1, 0.3, 0.45, 0.55), style="yellow", short="rec",
    help="the target's own recycled predictions only (Token Recycling with bigram keys)",
    # not in the default hierarchy: left out of it, hd ran faster on the tuning set and on the
    # held-out questions alike (hd bench spec-bench --ablate, docs/benchmarks.md)
    build=lambda s: [RecycledLayer(s.recycle_table)], in_default=lambda s: False,
    bench_default=False))
