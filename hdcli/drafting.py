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

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]
    layer: str


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
    A candidate is history[i+1 : i+1+L] for a match ending at i < len(history) - 1; among
    matches of the same key, the most recent comes first (recency predicted better than the
    earliest occurrence, the choice of transformers' prompt lookup), and candidates that repeat
    an earlier candidate are skipped.
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
        h = self.history
        assert len(history) == len(h), "context DB is out of step with the decode loop"
        out: list[list[int]] = []
        last = len(h) - 1
        for n in range(min(self.max_n, len(h)), self.min_n - 1, -1):
            ends = self.positions.get(tuple(h[-n:]))
            if not ends:
                continue
            length = max_len if n == self.max_n else min(max_len, self.len_per_key * n)
            for i in reversed(ends[-self.max_scan:]):
                if i >= last:
                    continue  # the suffix itself
                cand = h[i + 1:i + 1 + length]
                if cand and cand not in out:
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

    def propose(self, history: Sequence[int], max_len: int, max_candidates: int = 1) -> list[list[int]]:
        found = [(c[:max_len], p) for c, p in self._lookup(history) if p >= self.min_prob]
        cands = [c for c, _ in found[:max_candidates]]
        if self.walk and cands:
            best, prob = found[0]
            expected = prob * len(best)
            while len(best) < max_len:
                more = self._lookup(list(history[-self.store.max_n:]) + best)
                if not more or prob * more[0][1] < self.min_prob:
                    break
                prob *= more[0][1]
                best = best + more[0][0][:max_len - len(best)]
                expected += prob * len(more[0][0][:max_len])
            if expected < self.min_expected:
                return []
            cands[0] = best
        return cands


class Hierarchy:
    """Asks layers in order and returns candidates tagged by layer.

    policy `first-hit`: candidates come only from the first layer that proposes anything. (Further
    policies that mix layers belong to the hierarchy-drafting issue.)
    """

    POLICIES = ("first-hit",)

    def __init__(self, layers: Sequence[Layer], policy: str = "first-hit",
                 draft_len: int = 10, max_candidates: int = 1):
        if policy not in self.POLICIES:
            raise ValueError(f"unknown drafting policy {policy!r}")
        self.layers = list(layers)
        self.policy, self.draft_len, self.max_candidates = policy, draft_len, max_candidates

    def reset(self, tokens: Sequence[int]) -> None:
        for layer in self.layers:
            layer.reset(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for layer in self.layers:
            layer.extend(tokens)

    def propose(self, history: Sequence[int], max_len: int | None = None,
                stats=None) -> list[Draft]:
        max_len = self.draft_len if max_len is None else min(max_len, self.draft_len)
        if max_len <= 0:
            return []
        for layer in self.layers:
            cands = layer.propose(history, max_len, self.max_candidates)
            if stats is not None:
                stats.layer(layer.name).record_query(cands)
            if cands:
                return [Draft(tuple(c), layer.name) for c in cands]
        return []
