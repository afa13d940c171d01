"""The context DB layer: n-grams of the current request (prompt lookup decoding)."""
from __future__ import annotations

from typing import Sequence

from ..engine.decode.draft import Draft
from .registry import LayerSpec, register


class ContextDB:
    """An incremental n-gram index over the current request's tokens (prompt lookup decoding).

    Parameters
      min_n, max_n   n-gram sizes used as keys; the longest suffix of the history that occurred
                     before wins, since a longer match predicts its continuation better.
      len_per_key    a match on an n-token key (n < max_n) drafts at most len_per_key * n tokens;
                     a match on the longest key drafts up to max_len. Short keys predict short
                     runs: on Spec-Bench-like prompts this beat a fixed length for every cost
                     profile we measured (benchmarks/tuning/context_tuning.py).
      max_scan       most occurrences of one key examined per query (bounds the query time).
      match_factor   None: a match on the longest key drafts up to max_len. A number: it drafts
                     match_factor x the match's length (how far back the history agrees with the
                     text before that occurrence, up to max_match tokens), as SuffixDecoding sizes
                     its trees: a passage being copied drafts long, a 4-token coincidence short.
      tag_matches    tag each candidate with its match length ('context:2' .. 'context:8+'), so
                     the decoder's tracker (hierarchy.AcceptanceTracker) learns each one's acceptance
                     in the request and the cost cap prices a long match above a short one.
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

    max_match = 32

    def __init__(self, min_n: int = 1, max_n: int = 4, len_per_key: int = 3, max_scan: int = 64,
                 match_factor: float | None = None, tag_matches: bool = False):
        if not 1 <= min_n <= max_n:
            raise ValueError("context DB needs 1 <= min_n <= max_n")
        self.min_n, self.max_n, self.len_per_key, self.max_scan = min_n, max_n, len_per_key, max_scan
        self.match_factor, self.tag_matches = match_factor, tag_matches
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

    def candidates(self, history: Sequence[int], max_len: int, max_candidates: int = 1) -> list[list[int]]:
        # `history` is the indexed history, or (under a draft-model level, hdcli.hsd.stack) the indexed
        # history followed by tokens not yet accepted: those are looked up, not indexed
        h = self.history
        assert len(history) >= len(h), "context DB is out of step with the decode loop"
        if len(history) > len(h):
            h = list(history)
        out: list = []
        seen: list[list[int]] = []   # out's token lists
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
                i, m, take = g[0], n, length
                if n == self.max_n and (self.match_factor is not None or self.tag_matches):
                    while m < self.max_match and i - m >= 0 and h[i - m] == h[-1 - m]:
                        m += 1
                    if self.match_factor is not None:
                        take = min(max_len, max(1, round(self.match_factor * m)))
                cand = h[i + 1:i + 1 + take]
                if not any(c[:len(cand)] == cand for c in seen):  # adds nothing to the tree
                    seen.append(cand)
                    out.append(Draft(tuple(cand), f"{self.name}:{m if m < 8 else '8+'}")
                               if self.tag_matches else cand)
                    if len(out) >= max_candidates:
                        return out
        return out



register(LayerSpec(
    name="context", rank=0, prior=(0.1, 0.5, 0.65, 0.8), style="green", short="ctx",
    help="context DB only (prompt lookup)",
    build=lambda s: [ContextDB(min_n=s.min_n, max_n=s.max_n)],
    in_default=lambda s: True))
