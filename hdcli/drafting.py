"""Drafting: layers that propose continuations of the token history, and the hierarchy over them.

The drafter interface is deliberately small. A layer sees the whole token history (prompt and
generated tokens) and proposes up to `max_candidates` continuations of up to `max_len` tokens,
best first. Layers are told about every token that becomes part of the history, so an index can
be kept incrementally instead of rescanning.

    class Layer:
        name: str
        def reset(self, tokens: list[int]) -> None          # a new request: the prompt tokens
        def extend(self, tokens: list[int]) -> None         # tokens appended to the history
        def propose(self, history, max_len, max_candidates) -> list[list[int]]

The hierarchy asks its layers in order (most local first: context DB, then the model DB and
the statistics DB) and returns `Draft`s tagged with the layer that made them, so statistics and
colouring can be kept per layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]
    layer: str
    # the distribution each token was drawn from, [len(tokens), V], when a draft model sampled it
    # (hdcli.stack); None for point masses (database layers, greedy)
    q: object = field(default=None, compare=False, repr=False)


class Layer(Protocol):
    name: str

    def reset(self, tokens: Sequence[int]) -> None: ...
    def extend(self, tokens: Sequence[int]) -> None: ...
    def propose(self, history: Sequence[int], max_len: int, max_candidates: int) -> list[list[int]]: ...


class ContextDB:
    """An incremental n-gram index over the current request's tokens (prompt lookup decoding).

    Parameters
      min_n, max_n   n-gram sizes used as keys; the longest suffix of the history that occurred
                     before wins, since a longer match predicts its continuation better.
      len_per_key    a match on an n-token key (n < max_n) drafts at most len_per_key * n tokens;
                     a match on the longest key drafts up to max_len. Short keys predict short
                     runs: on Spec-Bench-like prompts this beat a fixed length for every cost
                     profile we measured (benchmarks/context_tuning.py).
      max_scan       most occurrences of one key examined per query (bounds the query time).
    Invariant
      `positions[key]` lists, oldest first, every index i such that history[i-n+1 : i+1] == key,
      for every i < len(history). Updated in O(max_n) per appended token.
    A candidate is history[i+1 : i+1+L] for a match ending at i < len(history) - 1. Longer keys
    come first; among the matches of one key, continuations are grouped by their first token and
    the groups ranked by count (how often that token followed the key), then by recency, the most
    recent occurrence of a group giving its candidate (recency predicted better than the earliest
    occurrence, the choice of transformers' prompt lookup). A candidate that is a prefix of an
    earlier one adds nothing to the tree and is skipped.
    """

    name = "context"

    def __init__(self, min_n: int = 1, max_n: int = 4, len_per_key: int = 3, max_scan: int = 64):
        if not 1 <= min_n <= max_n:
            raise ValueError("context DB needs 1 <= min_n <= max_n")
        self.min_n, self.max_n, self.len_per_key, self.max_scan = min_n, max_n, len_per_key, max_scan
        self.reset([])

    def reset(self, tokens: Sequence[int]) -> None:
        self.history: list[int] = []
        self.positions: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        h = self.history
        for t in tokens:
            h.append(int(t))
            i = len(h) - 1
            for n in range(self.min_n, min(self.max_n, i + 1) + 1):
                self.positions.setdefault(tuple(h[i - n + 1:i + 1]), []).append(i)

    def propose(self, history: Sequence[int], max_len: int, max_candidates: int = 1) -> list[list[int]]:
        # `history` is the indexed history, or (under a draft-model level, hdcli.stack) the indexed
        # history followed by tokens not yet accepted: those are looked up, not indexed
        h = self.history
        assert len(history) >= len(h), "context DB is out of step with the decode loop"
        if len(history) > len(h):
            h = list(history)
        out: list[list[int]] = []
        last = len(self.history) - 1 if len(h) == len(self.history) else len(h)
        for n in range(min(self.max_n, len(h)), self.min_n - 1, -1):
            ends = self.positions.get(tuple(h[-n:]))
            if not ends:
                continue
            length = max_len if n == self.max_n else min(max_len, self.len_per_key * n)
            # group this key's occurrences by the token that followed; groups rank by count, then
            # by their most recent occurrence, whose continuation represents the group
            groups: dict[int, list[int]] = {}
            for i in reversed(ends[-self.max_scan:]):
                if i < last:  # i == last is the suffix itself
                    groups.setdefault(h[i + 1], []).append(i)
            ranked = sorted(groups.values(), key=lambda g: (-len(g), -g[0]))
            for g in ranked:
                cand = h[g[0] + 1:g[0] + 1 + length]
                if not any(c[:len(cand)] == cand for c in out):  # adds nothing to the tree
                    out.append(cand)
                    if len(out) >= max_candidates:
                        return out
        return out


class StatsDB:
    """Corpus statistics: the top continuations of the longest suffix of the history found in an
    n-gram store built by `hd build-stats` (the same class serves the model DB's store).

    Parameters
      store       an open hdcli.stores.Store (its header fixes the n range and stored length)
      min_prob    draft only while the estimated probability of the whole draft (the product of
                  count / (key total + 1) along it) stays at or above this: a rare continuation
                  is rarely accepted and costs verification.
      walk        when a continuation ends before max_len, look up the history extended by it and
                  continue with the best continuation found (a greedy walk; with draft_len-1
                  stores, next-token counts, this is the whole drafting).
      min_expected  draft only when the expected number of accepted tokens (the sum of the
                  prefix probabilities along the walk) reaches this: a verification forward over
                  a draft costs more than a plain step (fp32 on CPU: ~0.65 of a step more).
    The layer keeps no per-request state: it reads the history it is given.
    """

    def __init__(self, store, name: str = "stats", min_prob: float = 0.0, walk: bool = True,
                 min_expected: float = 0.0):
        self.store, self.name, self.min_prob, self.walk = store, name, min_prob, walk
        self.min_expected = min_expected

    def reset(self, tokens: Sequence[int]) -> None:
        self.store.refresh()  # a new request sees what was learned since

    def extend(self, tokens: Sequence[int]) -> None:
        pass

    def _lookup(self, history: Sequence[int]) -> list[tuple[list[int], float]]:
        """Continuations of the longest suffix found, with their probabilities, best first."""
        st = self.store
        for n in range(min(st.max_n, len(history)), st.min_n - 1, -1):
            got = st.get(history[-n:])
            if got is not None:
                total, entries = got
                # total + 1: a continuation seen once after a key seen once is a coin flip, not a
                # certainty; without this discount the walk drafts 16-token runs from single
                # samples of the model DB (replay: model layer accepted 5% of its tokens in fp32)
                return [(c, count / (total + 1)) for c, count in entries]
        return []

    def _walk(self, history: Sequence[int], cand: list[int], prob: float, max_len: int):
        """Extend a candidate greedily; returns (tokens, expected accepted tokens along it)."""
        expected = prob * len(cand)
        while len(cand) < max_len:
            more = self._lookup(list(history[-self.store.max_n:]) + cand)
            if not more or prob * more[0][1] < self.min_prob:
                break
            prob *= more[0][1]
            step = more[0][0][:max_len - len(cand)]
            cand = cand + step
            expected += prob * len(step)
        return cand, expected

    def propose(self, history: Sequence[int], max_len: int, max_candidates: int = 1) -> list[list[int]]:
        found = [(c[:max_len], p) for c, p in self._lookup(history) if p >= self.min_prob]
        out = []
        for j, (cand, prob) in enumerate(found[:max_candidates]):
            if self.walk:
                cand, expected = self._walk(history, cand, prob, max_len)
                if j == 0 and expected < self.min_expected:
                    return []  # even the best continuation is not worth a forward
            out.append(cand)
        return out


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

    def record(self, before: Sequence[int], tokens: Sequence[int], parents: Sequence[int], logits) -> None:
        """tokens/parents: a forward's input nodes (parents[0] = -1: the node follows `before`),
        logits: its [nodes, V] output rows."""
        top = logits.topk(self.top_k, dim=-1).indices.tolist()
        prev0 = before[-1] if before else -1
        for i, t in enumerate(tokens):
            a = prev0 if parents[i] < 0 else tokens[parents[i]]
            self.bigram[(a, t)] = self.unigram[t] = tuple(top[i])

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

    def record(self, before, tokens, parents, logits) -> None:
        self.table.record(before, tokens, parents, logits)

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


# Prior per-token acceptance of a drafted token once the verification reaches it (its parent
# kept), by layer and by the node's place in the tree: a later sibling (a candidate tried after
# another at the same position), or a first child at depth 1, 2, 3+. Acceptance rises with depth
# (a match that held so far goes on holding) and later siblings are rarely right, so one rate per
# layer misjudges both. Measured by replaying Spec-Bench outputs (docs/engine.md); the static
# estimate of `first-hit` and `fill`, and where `adaptive` starts every request.
PRIOR_RATES = {"context": (0.1, 0.5, 0.65, 0.8), "model": (0.1, 0.4, 0.4, 0.6),
               "stats": (0.1, 0.3, 0.45, 0.55), "recycle": (0.1, 0.3, 0.45, 0.55)}
DEFAULT_PRIOR = (0.1, 0.3, 0.45, 0.55)


def base_name(layer: str | None) -> str:
    """'stats:wiki' -> 'stats' (several statistics DBs share the stats settings)."""
    return (layer or "").split(":", 1)[0]


def bucket(depth: int, first_child: bool) -> int:
    """0: a later sibling; 1, 2, 3: a first child at depth 1, 2, 3 or more."""
    return min(depth, 3) if first_child else 0


class AcceptanceTracker:
    """Online, per-request estimate of each layer's per-token acceptance, per tree place (bucket).

    rate = (accepted + prior * weight) / (tested + weight), where `tested` counts the layer's
    drafted tokens the verification reached (their parent was kept) and `accepted` those it kept.
    Both counts decay by `decay` at every step, so the estimate follows the current stretch of the
    answer, and a layer whose drafts stop being sent drifts back to its prior and is tried again:
    no layer starves for good.
    """

    def __init__(self, priors: dict[str, tuple] | None = None, weight: float = 2.0, decay: float = 0.9):
        self.priors = dict(PRIOR_RATES if priors is None else priors)
        self.weight, self.decay = weight, decay
        self.reset()

    def reset(self) -> None:
        self.tested: dict[tuple, float] = {}
        self.accepted: dict[tuple, float] = {}

    def prior(self, layer: str | None, b: int = 1) -> float:
        p = self.priors.get(layer or "", self.priors.get(base_name(layer), DEFAULT_PRIOR))
        return p if isinstance(p, float) else p[b]

    def rate(self, layer: str | None, b: int = 1) -> float:
        t, a = self.tested.get((layer, b), 0.0), self.accepted.get((layer, b), 0.0)
        return (a + self.prior(layer, b) * self.weight) / (t + self.weight)

    def update(self, tested: dict[tuple, int], accepted: dict[tuple, int]) -> None:
        """tested/accepted: counts keyed by (layer, bucket)."""
        for d in (self.tested, self.accepted):
            for k in d:
                d[k] *= self.decay
        for k, v in tested.items():
            self.tested[k] = self.tested.get(k, 0.0) + v
        for k, v in accepted.items():
            self.accepted[k] = self.accepted.get(k, 0.0) + v


class Hierarchy:
    """Asks the layers in order (most local first) and returns candidates tagged by layer, best first.

    Parameters
      policy          `first-hit`: candidates come only from the first layer that proposes any.
                      `fill`: the C slots are filled in layer order, each layer's best first (the
                      order of the published Hierarchy Drafting method).
                      `adaptive`: every layer is asked; layers are ordered, and given slots and
                      draft length, by their online acceptance in this request (AcceptanceTracker):
                      a layer being accepted now gets more; every layer that matches keeps at
                      least one slot, so none starves.
      draft_len       most tokens per candidate: one int, or {layer: int} (a base name such as
                      'stats' covers 'stats:wiki'; missing layers use `default_len`).
      max_candidates  C, the most candidates per step (1 = single-chain verification).
    `rate(layer)` is the per-token acceptance estimate the verifier uses to cap the tree by cost:
    the prior for `first-hit`/`fill`, the online tracker for `adaptive`.
    """

    POLICIES = ("first-hit", "fill", "adaptive")

    def __init__(self, layers: Sequence[Layer], policy: str = "first-hit",
                 draft_len: int | dict[str, int] = 16, max_candidates: int = 1,
                 priors: dict[str, float] | None = None, default_len: int = 16):
        if policy not in self.POLICIES:
            raise ValueError(f"unknown drafting policy {policy!r}; known: {', '.join(self.POLICIES)}")
        if max_candidates < 1:
            raise ValueError("max_candidates must be >= 1")
        self.layers = list(layers)
        self.policy, self.max_candidates = policy, max_candidates
        if isinstance(draft_len, int):
            self.lengths, self.draft_len = {}, draft_len
        else:
            self.lengths, self.draft_len = dict(draft_len), default_len
        self.tracker = AcceptanceTracker(priors)

    def layer_len(self, name: str) -> int:
        return self.lengths.get(name, self.lengths.get(base_name(name), self.draft_len))

    @property
    def max_len(self) -> int:
        return max([self.layer_len(layer.name) for layer in self.layers] or [self.draft_len])

    def rate(self, layer: str | None, depth: int = 1, first_child: bool = True) -> float:
        b = bucket(depth, first_child)
        if self.policy == "adaptive":
            return self.tracker.rate(layer, b)
        return self.tracker.prior(layer, b)

    def depth_for(self, layer: str, floor: float = 1 / 8) -> int:
        """How deep a first-choice candidate of this layer stays likely: while the chance of
        keeping the whole prefix is >= floor (at least 2 tokens)."""
        p, d = 1.0, 0
        while d < 64:
            p *= min(self.rate(layer, d + 1), 0.97)
            if p < floor:
                break
            d += 1
        return max(2, d)

    def reset(self, tokens: Sequence[int]) -> None:
        self.tracker.reset()
        for layer in self.layers:
            layer.reset(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for layer in self.layers:
            layer.extend(tokens)

    def observe(self, tested: dict[str, int], accepted: dict[str, int]) -> None:
        """What the last verification reached and kept, per layer (feeds `adaptive`)."""
        self.tracker.update(tested, accepted)

    def record(self, before: Sequence[int], tokens: Sequence[int], parents: Sequence[int], logits) -> None:
        """A verification forward's rows (see RecycledTable.record), for layers that learn from them."""
        for layer in self.layers:
            if hasattr(layer, "record"):
                layer.record(before, tokens, parents, logits)

    @property
    def records(self) -> bool:
        return any(hasattr(layer, "record") for layer in self.layers)

    def _ask(self, layer, history, max_len, slots, stats) -> list[Draft]:
        length = min(max_len, self.layer_len(layer.name))
        cands = layer.propose(history, length, slots) if length > 0 and slots > 0 else []
        if stats is not None:
            stats.layer(layer.name).record_query(cands)
        return [Draft(tuple(c), layer.name) for c in cands]

    def propose(self, history: Sequence[int], max_len: int | None = None,
                stats=None) -> list[Draft]:
        max_len = self.max_len if max_len is None else min(max_len, self.max_len)
        if max_len <= 0:
            return []
        C = self.max_candidates
        if self.policy == "first-hit":
            for layer in self.layers:
                got = self._ask(layer, history, max_len, C, stats)
                if got:
                    return got
            return []
        if self.policy == "fill":
            out: list[Draft] = []
            for layer in self.layers:
                out += self._ask(layer, history, max_len, C - len(out), stats)
                if len(out) >= C:
                    break
            return out
        # adaptive: order the layers by how well their first token is accepted now, and let each
        # draft as deep as its candidates stay likely (depth_for)
        ranked = sorted(self.layers, key=lambda l: -self.rate(l.name))
        found: list[list[Draft]] = []
        for layer in ranked:
            found.append(self._ask(layer, history, min(max_len, self.depth_for(layer.name)), C, stats))
        # every layer that matched gets one slot, the slots left go to the best layers' next
        # candidates; the output keeps the ranking (best layer first) as the order children are tried
        quota = [min(1, len(got)) for got in found]
        spare = C - sum(quota)
        while spare < 0:  # more matching layers than slots: the worst matching one goes
            last = max(i for i, q in enumerate(quota) if q)
            quota[last], spare = 0, spare + 1
        for i, got in enumerate(found):
            extra = min(spare, len(got) - quota[i])
            quota[i] += extra
            spare -= extra
        return [d for got, q in zip(found, quota) for d in got[:q]]
