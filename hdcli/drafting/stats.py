"""The statistics DB layer (and a model DB's n-gram table): continuations looked up in an n-gram store (LMDB)."""
from __future__ import annotations

from typing import Sequence

from ..errors import HdError
from .registry import LayerSpec, register


class StatsLayer:
    """Corpus statistics: the top continuations of the longest suffix of the history found in an
    n-gram store built by `hd build-stats` (the same class serves the model DB's store).

    Parameters
      store       an open hdcli.db.stores.Store (its header fixes the n range and stored length)
      min_prob    draft only while the estimated probability of the whole draft (the product of
                  count / (key total + 1) along it) stays at or above this: a rare continuation
                  is rarely accepted and costs verification.
      walk        when a continuation ends before max_len, look up the history extended by it and
                  continue with the best continuation found (a greedy walk; with draft_len-1
                  stores, next-token counts, this is the whole drafting).
      min_expected  draft only when the expected number of accepted tokens (the sum of the
                  prefix probabilities along the walk) reaches this: a verification forward over
                  a draft costs more than a plain step where verifying is dear (the target's cost
                  curve, `hd costs`; the figures are docs/benchmarks.md's).
    memo_size   most store lookups remembered in a request (hits and misses alike): a step's
                walk repeats most of the previous step's lookups, and each is an LMDB read
                transaction, the dearest part of the layer's step (docs/benchmarks.md, "Time
                outside the forward"); cleared when full.
    The layer's only per-request state is that memo, cleared at reset: a request reads the store as
    it was when it began, or at the lookup (a model DB that learns mid-request only changes which
    drafts are offered, never the output). A continuation is cut
    at its first id outside the vocabulary (store.vocab_limit: a damaged record, which `hd db
    verify` reports), so no drafted id can reach the model's embedding out of range.
    """

    def __init__(self, store, name: str = "stats", min_prob: float = 0.0, walk: bool = True,
                 min_expected: float = 0.0, memo_size: int = 4096):
        self.store, self.name, self.min_prob, self.walk = store, name, min_prob, walk
        self.min_expected, self.memo_size = min_expected, memo_size
        self._memo: dict[tuple[int, ...], tuple | None] = {}

    def reset(self, tokens: Sequence[int]) -> None:
        self.store.refresh()  # a new request sees what was learned since
        self._memo.clear()

    def _get(self, key: tuple[int, ...]):
        if self.memo_size <= 0:
            return self.store.get(key)
        try:
            return self._memo[key]
        except KeyError:
            if len(self._memo) >= self.memo_size:
                self._memo.clear()
            got = self._memo[key] = self.store.get(key)
            return got

    def extend(self, tokens: Sequence[int]) -> None:
        pass

    def _lookup(self, history: Sequence[int]) -> list[tuple[list[int], float]]:
        """Continuations of the longest suffix found, with their probabilities, best first."""
        st = self.store
        for n in range(min(st.max_n, len(history)), st.min_n - 1, -1):
            got = self._get(tuple(history[-n:]))
            if got is not None:
                total, entries = got
                # total + 1: a continuation seen once after a key seen once is a coin flip, not a
                # certainty; without this discount the walk drafts 16-token runs from single
                # samples of the model DB (replay: model layer accepted 5% of its tokens in fp32)
                found = [(c, count / (total + 1)) for c, count in entries]
                return found if st.vocab_limit is None else self._in_vocabulary(found, st.vocab_limit)
        return []

    @staticmethod
    def _in_vocabulary(found: list, limit: int) -> list:
        out = []
        for c, p in found:
            cut = next((i for i, t in enumerate(c) if t >= limit), len(c))
            if cut:
                out.append((c[:cut], p))
        return out

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

    def candidates(self, history: Sequence[int], max_len: int, max_candidates: int = 1) -> list[list[int]]:
        found = [(c[:max_len], p) for c, p in self._lookup(history) if p >= self.min_prob]
        out = []
        for j, (cand, prob) in enumerate(found[:max_candidates]):
            if self.walk:
                cand, expected = self._walk(history, cand, prob, max_len)
                if j == 0 and expected < self.min_expected:
                    return []  # even the best continuation is not worth a forward
            out.append(cand)
        return out



NEEDS_STATS_DB = ("stats_dbs", "a statistics DB: pass --stats-db PATH")


def _stats_layers(s) -> list:
    if not s.stats_stores:
        raise HdError(f"layer 'stats' needs {NEEDS_STATS_DB[1]}")
    return [StatsLayer(db, name="stats" if len(s.stats_stores) == 1 else f"stats:{db.path.stem}",
                    min_prob=s.min_prob, min_expected=s.min_expected) for db in s.stats_stores]


register(LayerSpec(
    name="stats", rank=10, prior=(0.1, 0.3, 0.45, 0.55), style="magenta", short="st",
    help="statistics DB only (corpus retrieval, REST-like)",
    # not in the default hierarchy: held out, it added -4% to 0% tok/s to hd, and 0% and -2% on the
    # tuning set, below the 3% a default layer must add (`hd bench spec-bench --ablate`,
    # docs/benchmarks.md); `--layers context,stats` drafts from a statistics DB
    build=_stats_layers, needs=NEEDS_STATS_DB))
