"""The context DB against a brute-force rescan of the history."""
from __future__ import annotations

import random

from hdcli.drafting import ContextDB, Hierarchy


def brute_force(h, min_n, max_n, max_len, max_candidates, len_per_key=3):
    """Longest suffix first; within a key, continuations grouped by their first token, groups
    ranked by count then by their most recent occurrence, which gives the candidate; candidates
    that are a prefix of an earlier one skipped; an n-token key drafts at most len_per_key * n
    tokens unless n is the longest key size."""
    out = []
    for n in range(min(max_n, len(h)), min_n - 1, -1):
        key = h[-n:]
        length = max_len if n == max_n else min(max_len, len_per_key * n)
        ends = [i for i in range(n - 1, len(h) - 1) if h[i - n + 1:i + 1] == key]
        firsts = {h[i + 1] for i in ends}
        groups = [(sum(h[i + 1] == t for i in ends), max(i for i in ends if h[i + 1] == t)) for t in firsts]
        for count, recent in sorted(groups, reverse=True):
            cand = h[recent + 1:recent + 1 + length]
            if not any(c[:len(cand)] == cand for c in out):
                out.append(cand)
                if len(out) >= max_candidates:
                    return out
    return out


def test_incremental_index_equals_rescan():
    rng = random.Random(0)
    for trial in range(30):
        db = ContextDB(min_n=rng.randint(1, 2), max_n=rng.randint(2, 5), max_scan=10**9)
        h = [rng.randrange(6) for _ in range(rng.randint(1, 5))]
        db.reset(h)
        for _ in range(40):
            step = [rng.randrange(6) for _ in range(rng.randint(1, 4))]
            h += step
            db.extend(step)
            for max_len, cands in ((1, 1), (5, 1), (4, 3)):
                assert db.propose(h, max_len, cands) == brute_force(h, db.min_n, db.max_n, max_len, cands)


def test_longest_match_wins_over_recent_short_match():
    db = ContextDB(min_n=1, max_n=3)
    #        a  b  c  X  ...  b  c  Y  ...  a  b  c
    h = [1, 2, 3, 10, 11, 12, 13, 2, 3, 20, 21, 22, 23, 24, 25, 26, 1, 2, 3]
    db.reset(h)
    assert db.propose(h, 5, 2) == [[10, 11, 12, 13, 2], [20, 21, 22, 23, 24]]
    h += [30]  # a unigram match drafts at most len_per_key = 3 tokens
    db.extend([30])
    assert db.propose(h, 5, 1) == []
    h += [3]
    db.extend([3])
    assert db.propose(h, 5, 1) == [[30, 3]]


def test_no_match_no_draft_and_hierarchy_records_queries():
    from hdcli.engine.decode.stats import RunStats
    db = ContextDB(min_n=2, max_n=3)
    h = [1, 2, 3, 4, 5]
    hier = Hierarchy([db], draft_len=4)
    hier.reset(h)
    st = RunStats()
    assert hier.propose(h, stats=st) == []
    hier.extend([1, 2])
    drafts = hier.propose(h + [1, 2], stats=st)
    assert [d.tokens for d in drafts] == [(3, 4, 5, 1)] and drafts[0].layer == "context"
    assert hier.propose(h + [1, 2], max_len=0, stats=st) == []
    ls = st.layers["context"]
    assert (ls.queries, ls.hits, ls.candidates) == (2, 1, 1)
