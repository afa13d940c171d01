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
                assert db.candidates(h, max_len, cands) == brute_force(h, db.min_n, db.max_n, max_len, cands)


def test_longest_match_wins_over_recent_short_match():
    db = ContextDB(min_n=1, max_n=3)
    #        a  b  c  X  ...  b  c  Y  ...  a  b  c
    h = [1, 2, 3, 10, 11, 12, 13, 2, 3, 20, 21, 22, 23, 24, 25, 26, 1, 2, 3]
    db.reset(h)
    assert db.candidates(h, 5, 2) == [[10, 11, 12, 13, 2], [20, 21, 22, 23, 24]]
    h += [30]  # a unigram match drafts at most len_per_key = 3 tokens
    db.extend([30])
    assert db.candidates(h, 5, 1) == []
    h += [3]
    db.extend([3])
    assert db.candidates(h, 5, 1) == [[30, 3]]


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


def test_draft_length_and_tag_follow_the_match_length():
    """match_factor: a match on the longest key drafts factor x how far back the history agrees
    with the text before that occurrence; tag_matches names each candidate by that length.
    Controls: without match_factor the same match drafts max_len; a shorter key keeps
    len_per_key x n."""
    #    9  1  2  3  4  A...      5  6  1  2  3  4  B...     7  9  1  2  3  4
    a, b = list(range(20, 30)), list(range(30, 40))
    h = [9, 1, 2, 3, 4] + a + [5, 6, 1, 2, 3, 4] + b + [7, 9, 1, 2, 3, 4]
    db = ContextDB(min_n=2, max_n=4, match_factor=2.0)
    db.reset(h)
    # two occurrences of the key 1 2 3 4, each followed once: the most recent (B, matched 4 back:
    # 6 != 9) ranks first and drafts 2 x 4 = 8; the older (A, matched 5 back: 9 == 9) 2 x 5 = 10
    assert db.candidates(h, 16, 2) == [b[:8], a[:10]]
    plain_db = ContextDB(min_n=2, max_n=4)
    plain_db.reset(h)
    assert plain_db.candidates(h, 16, 2) == [b + [7, 9, 1, 2, 3, 4][:6], a + [5, 6, 1, 2, 3, 4]]
    tagged = ContextDB(min_n=2, max_n=4, match_factor=2.0, tag_matches=True)
    tagged.reset(h)
    got = tagged.candidates(h, 16, 2)
    assert [(list(d.tokens), d.layer) for d in got] == [(b[:8], "context:4"), (a[:10], "context:5")]
    short, h2 = ContextDB(min_n=2, max_n=4, match_factor=2.0), [9, 1, 2, 3, 4] + a + [50, 3, 4]
    short.reset(h2)    # only the 2-token key 3 4 matches: len_per_key x 2 = 6 tokens
    assert short.candidates(h2, 16, 1) == [a[:6]]


def test_tagged_match_lengths_are_tracked_apart_by_the_hierarchy():
    from hdcli.engine.decode.stats import RunStats
    h = [9, 1, 2, 3, 4] + list(range(20, 30)) + [9, 1, 2, 3, 4]
    hier = Hierarchy([ContextDB(2, 4, tag_matches=True)], policy="fill-tracked", max_candidates=2)
    hier.reset(h)
    st = RunStats()
    drafts = hier.propose(h, stats=st)
    assert [d.layer for d in drafts] == ["context:5"] and st.layers["context"].hits == 1
    hier.observe({("context:5", 1): 10}, {("context:5", 1): 0})
    assert hier.rate("context:5") < hier.rate("context:4") == hier.rate("context")
