"""The statistics DB: exact counts, top-K, shard + merge, header, atomic builds, the layer.

And every DB's header and contents: one validator for DB headers, used by every reader; `hd db
verify` checks the tokenizer fingerprint, token ids against the vocabulary and entry lengths
against draft_len; drafts never carry ids outside the model's vocabulary; merging two builds of
one corpus is refused unless asked for. DB files as users meet them (another format version, cut
short, damaged, merged wrongly, two builds racing, their file modes): one line each, nothing
half-written left. One long document is tokenised in pieces and counted in windows: the same DB."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import lmdb
import numpy as np
import pytest

from hdcli import api
from hdcli.engine.decode import costs
from hdcli.commands import db as commands
from hdcli.db import atomic, codec, envs, fingerprint, statsdb, stores
from hdcli.db.header import FORMAT_VERSION, HEADER_KEY
from hdcli.drafting import StatsLayer
from hdcli.errors import HdError

from conftest import HD, TEXTS, VOCAB, WORDS, hd_main, hd_sub, one_line_error, stats_db_file, write_corpus
from test_cli import run

DOCS = ["the cat sat on the mat . the cat sat on the red mat",
        "the dog sat on the mat and the cat ran",
        "the cat sat on the mat . the dog ran up",
        "one two three one two four one two three"]

# A forward whose cost does not grow with width: the cost cap keeps every drafted node, so these
# tests exercise the DB drafts whatever this machine's measured cost curve says.
FREE_FORWARD = costs.flat(1.0)


def expected(docs_ids, min_n, max_n, draft_len, top_k, min_count):
    """Brute force: every (key, continuation) pair counted with plain dicts, then pruned."""
    counts = {}
    for d in docs_ids:
        for i in range(len(d) - 1):
            for n in range(min_n, max_n + 1):
                if i - n + 1 < 0:
                    continue
                key, cont = tuple(d[i - n + 1:i + 1]), tuple(d[i + 1:i + 1 + draft_len])
                counts.setdefault(key, {})
                counts[key][cont] = counts[key].get(cont, 0) + 1
    out = {}
    for key, conts in counts.items():
        pad = lambda c: c + (codec.PAD,) * (draft_len - len(c))
        ranked = sorted(((c, k) for c, k in conts.items() if k >= min_count),
                        key=lambda ck: (-ck[1], pad(ck[0])))
        if top_k:
            ranked = ranked[:top_k]
        if ranked:
            out[key] = (sum(conts.values()), [(list(c), k) for c, k in ranked])
    return out


def db_dict(path):
    db = stores.Store(path)
    got = {tuple(int.from_bytes(k[i:i + 4], "little") for i in range(0, len(k), 4)): v
           for k, v in db.items()}
    db.close()
    return got


def tokenize(tok, docs):
    return [tok(d, add_special_tokens=False)["input_ids"] for d in docs]


@pytest.mark.parametrize("params", [dict(min_n=1, max_n=3, draft_len=1, top_k=2, min_count=1),
                                    dict(min_n=1, max_n=4, draft_len=3, top_k=4, min_count=2),
                                    dict(min_n=2, max_n=2, draft_len=5, top_k=0, min_count=1)])
def test_counts_and_top_k_are_exact(tiny_lm, tmp_path, params):
    tok = tiny_lm.tokenizer
    out = tmp_path / "s.lmdb"
    # tiny chunks and several partitions: the spill/merge path is what gets tested
    statsdb.build(DOCS, out, tok, "tiny", chunk_tokens=10, partitions=3, **params)
    assert db_dict(out) == expected(tokenize(tok, DOCS), **params)


def test_shards_merged_equal_single_build(tiny_lm, tmp_path):
    tok = tiny_lm.tokenizer
    docs = DOCS * 3 + ["red blue green red blue", "blue green red blue green"]
    statsdb.build(docs, tmp_path / "all.lmdb", tok, "tiny", top_k=2)
    shards = []
    for i in range(3):
        shards.append(tmp_path / f"s{i}.lmdb")
        statsdb.build([d for j, d in enumerate(docs) if j % 3 == i], shards[-1], tok, "tiny",
                      top_k=2, shard=(i, 3))
        assert stores.Store(shards[-1]).header["pruned"] is False
    statsdb.merge(shards, tmp_path / "merged.lmdb", top_k=2, min_count=2)
    assert db_dict(tmp_path / "merged.lmdb") == db_dict(tmp_path / "all.lmdb")
    assert stores.Store(tmp_path / "merged.lmdb").header["tokens"] == stores.Store(tmp_path / "all.lmdb").header["tokens"]


def test_header_round_trips(tiny_lm, tmp_path):
    out = tmp_path / "s.lmdb"
    statsdb.build(DOCS, out, tiny_lm.tokenizer, "tiny", max_n=3, extra_header={"sources": [{"path": "x"}]})
    h = stores.Store(out).header
    assert h["format_version"] == FORMAT_VERSION and h["model"] == "tiny"
    assert h["n_range"] == [1, 3] and h["draft_len"] == 1 and h["top_k"] == 4 and h["min_count"] == 2
    assert h["tokenizer_fingerprint"] == fingerprint.tokenizer_fingerprint(tiny_lm.tokenizer)
    assert h["documents"] == 4 and h["tokens"] == sum(map(len, tokenize(tiny_lm.tokenizer, DOCS)))
    assert h["sources"] == [{"path": "x"}] and h["tool_version"] and h["built_at"]


def test_map_full_grows_instead_of_crashing(tiny_lm, tmp_path, monkeypatch):
    monkeypatch.setattr(envs, "INITIAL_MAP_SIZE", 32 * 1024)
    docs = [" ".join(f"{a} {b} {c}" for a in ("one", "two", "red", "cat") for b in ("sat", "ran", "up")
                     for c in ("the", "a", "mat", "dog", "sun"))] * 3
    statsdb.build(docs, tmp_path / "s.lmdb", tiny_lm.tokenizer, "tiny", min_count=1, top_k=0, max_n=4)
    assert db_dict(tmp_path / "s.lmdb") == expected(tokenize(tiny_lm.tokenizer, docs), 1, 4, 1, 0, 1)


def test_built_db_is_packed_into_full_pages(tiny_lm, tmp_path):
    """Keys arrive in hash order, which half-fills B-tree pages; commit() must leave the file as
    small as a key-order copy of itself, and hold the same data."""
    import random
    import lmdb
    rng = random.Random(0)
    words = tiny_lm.tokenizer.get_vocab()
    docs = [" ".join(rng.choice(list(words)) for _ in range(3000))]
    out = tmp_path / "s.lmdb"
    statsdb.build(docs, out, tiny_lm.tokenizer, "tiny", min_count=1, max_n=4)
    env = lmdb.open(str(out), subdir=False, readonly=True, lock=False)
    built = env.info()["last_pgno"]
    again = lmdb.open(str(tmp_path / "again"), subdir=False, map_size=1 << 26, lock=False)
    with env.begin() as src, again.begin(write=True) as txn:
        for k, v in src.cursor():
            txn.put(k, v, append=True)
    assert env.stat()["leaf_pages"] > 20  # big enough for half-full pages to show
    assert built == again.info()["last_pgno"]
    assert {x.name for x in tmp_path.iterdir()} == {"s.lmdb", "again"}  # no temporary left


def test_interrupted_build_leaves_nothing(tiny_lm, tmp_path):
    def docs():
        yield from DOCS
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        statsdb.build(docs(), tmp_path / "s.lmdb", tiny_lm.tokenizer, "tiny", chunk_tokens=5)
    assert os.listdir(tmp_path) == []


def test_killed_build_never_leaves_a_db_at_the_output(tiny_model_dir, tmp_path):
    corpus = tmp_path / "c.jsonl"
    with open(corpus, "w") as f:
        for i in range(40000):
            f.write(json.dumps({"text": DOCS[i % 4] + f" {i % 7}"}) + "\n")
    out = tmp_path / "s.lmdb"
    for delay in (0.5, 1.5, 3.0):
        p = subprocess.Popen([sys.executable, "-m", "hdcli.cli", "build-stats", str(corpus), "-o", str(out),
                              "--model", str(tiny_model_dir), "--chunk-tokens", "20000", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert not out.exists() or stores.Store(out).header["documents"] == 40000
        if out.exists():
            out.unlink()
    # what the killed builds left beside the output is swept by the next build
    statsdb.build(DOCS, out, stores_tokenizer(tiny_model_dir), "tiny")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "s.lmdb"]


def stores_tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def test_tokenizer_mismatch_is_refused(tiny_lm, tmp_path):
    out = tmp_path / "s.lmdb"
    statsdb.build(DOCS, out, tiny_lm.tokenizer, "tiny")
    db = stores.Store(out)
    db.check_tokenizer(tiny_lm.tokenizer)

    class Other:
        all_special_tokens = ["<s>"]

        def get_vocab(self):
            return {"a": 0, "b": 1}
    with pytest.raises(HdError, match="rebuild it"):
        db.check_tokenizer(Other(), "other-model")


def test_not_a_db_and_existing_output(tiny_lm, tmp_path):
    bad = tmp_path / "bad.lmdb"
    bad.write_bytes(b"hello" * 100)
    with pytest.raises(HdError, match="not an hd DB"):
        stores.Store(bad)
    with pytest.raises(HdError, match="--overwrite"):
        statsdb.build(DOCS, bad, tiny_lm.tokenizer, "tiny")
    with pytest.raises(HdError, match="does not exist"):
        statsdb.build(DOCS, tmp_path / "missing" / "s.lmdb", tiny_lm.tokenizer, "tiny")
    with pytest.raises(HdError, match="no documents"):
        statsdb.build([], tmp_path / "e.lmdb", tiny_lm.tokenizer, "tiny")
    assert sorted(os.listdir(tmp_path)) == ["bad.lmdb"]


def test_read_only_db_opens(tiny_lm, tmp_path):
    out = tmp_path / "s.lmdb"
    statsdb.build(DOCS, out, tiny_lm.tokenizer, "tiny")
    os.chmod(out, 0o444)
    os.chmod(tmp_path, 0o555)
    try:
        assert stores.Store(out).get(tokenize(tiny_lm.tokenizer, ["the cat"])[0]) is not None
    finally:
        os.chmod(tmp_path, 0o755)


def test_layer_walks_and_respects_min_prob(tiny_lm, tmp_path):
    tok = tiny_lm.tokenizer
    out = tmp_path / "s.lmdb"
    statsdb.build(DOCS, out, tok, "tiny", min_count=1)
    db = stores.Store(out)
    ids = tokenize(tok, ["the dog sat on"])[0]
    draft = StatsLayer(db).candidates(ids, 6, 1)[0]
    assert draft == tokenize(tok, ["the mat . the cat sat"])[0]
    assert StatsLayer(db, min_prob=1.1).candidates(ids, 6, 1) == []
    # the gate compares the sum of prefix probabilities along the walk with min_expected
    assert StatsLayer(db, min_expected=1.0).candidates(ids, 6, 1) == [draft]
    assert StatsLayer(db, min_expected=6.0).candidates(ids, 6, 1) == []


def test_layer_remembers_lookups_within_a_request(tiny_lm, tmp_path):
    """A step's walk repeats the last step's lookups: each is read from the store once a request
    (misses too), the drafts are the memo-less ones, and a new request (reset) reads the store
    again. Control: with memo_size 0 every lookup goes to the store."""
    tok = tiny_lm.tokenizer
    out = tmp_path / "s.lmdb"
    statsdb.build(DOCS, out, tok, "tiny", min_count=1)
    db = stores.Store(out)
    calls = []
    real_get = db.get
    db.get = lambda key: calls.append(tuple(key)) or real_get(key)
    ids = tokenize(tok, ["the dog sat on"])[0]
    plain = StatsLayer(stores.Store(out)).candidates(ids, 6, 1)
    layer = StatsLayer(db, memo_size=64)
    layer.reset(ids)
    assert layer.candidates(ids, 6, 1) == plain
    first = len(calls)
    assert first > 0 and len(set(calls)) == first
    assert layer.candidates(ids, 6, 1) == plain and len(calls) == first
    layer.reset(ids)
    assert layer.candidates(ids, 6, 1) == plain and len(calls) == 2 * first
    control = StatsLayer(db, memo_size=0)
    calls.clear()
    control.candidates(ids, 6, 1), control.candidates(ids, 6, 1)
    assert len(calls) == 2 * first


def test_greedy_with_context_and_stats_equals_plain(tiny_lm, tmp_path):
    """The DB is built from the tiny model's own outputs, so its drafts are often right."""
    prompts = ["the cat sat", "one two three", "red blue", "hello world", "big small fast"]
    refs = {p: api.generate(tiny_lm, p, max_new_tokens=40, drafter=None) for p in prompts}
    corpus = [tiny_lm.tokenizer.decode(refs[p].tokens, skip_special_tokens=True) for p in prompts[:3]]
    out = tmp_path / "s.lmdb"
    statsdb.build(corpus, out, tiny_lm.tokenizer, "tiny", min_count=1)
    dbs = api.open_stats_dbs([str(out)], tiny_lm)
    accepted = 0
    for p in prompts:
        for layers in (["stats"], ["context", "stats"]):
            d = api.make_drafter(layers, stats_stores=dbs, stats_min_prob=0.0, stats_min_expected=0.0)
            got = api.generate(tiny_lm, p, max_new_tokens=40, drafter=d, cost=FREE_FORWARD)
            assert got.tokens == refs[p].tokens
            accepted += got.stats.layers.get("stats").accepted if "stats" in got.stats.layers else 0
    assert accepted > 0


@pytest.mark.bundled
def test_bundled_model_with_stats_equals_plain(bundled_lm, tmp_path):
    from pathlib import Path
    from hdcli.db import corpus
    texts, _ = corpus.read_corpus([str(Path(__file__).parents[1] / "sample_corpora" / "assistant_answers.jsonl")])
    out = tmp_path / "s.lmdb"
    statsdb.build(texts, out, bundled_lm.tokenizer, "smollm2-135m", min_count=1)
    d = api.make_drafter(["context", "stats"], stats_stores=api.open_stats_dbs([str(out)], bundled_lm),
                         stats_min_prob=0.0, stats_min_expected=0.0)
    for p in ["Write a Python function that returns the sum of a list.", "What is photosynthesis?"]:
        ref = api.generate(bundled_lm, p, max_new_tokens=40, drafter=None)
        got = api.generate(bundled_lm, p, max_new_tokens=40, drafter=d, cost=FREE_FORWARD)
        assert got.tokens == ref.tokens
        assert got.stats.layers["stats"].drafted > 0


def test_num_proc_gives_the_same_db(tiny_lm, tmp_path):
    docs = DOCS * 200  # several tokeniser batches
    statsdb.build(docs, tmp_path / "a.lmdb", tiny_lm.tokenizer, "tiny", num_proc=1)
    statsdb.build(docs, tmp_path / "b.lmdb", tiny_lm.tokenizer, "tiny", num_proc=2)
    assert db_dict(tmp_path / "a.lmdb") == db_dict(tmp_path / "b.lmdb")


# --- DB headers and contents ------------------------------------------------------------------

HEADER_DOCS = ["the cat sat on the mat and the dog ran up", "one two three one two three four",
        "the cat sat on the red mat and the cat ran"] * 2
PROMPT = "the cat sat on the"


def _build(tok, path, **kw):
    statsdb.build(HEADER_DOCS, path, tok, "tiny", **{"min_count": 1, **kw})
    return path


def _rewrite(path, header=None, record=None):
    """Change a DB behind hd's back, as a damaged or hostile file would. header: fn(dict) -> the
    new header (any JSON value) or bytes; record: fn(key, <u4 value array) -> the new array or None
    (unchanged). The key count and content digest are recomputed, so only the new checks can tell."""
    env = lmdb.open(str(path), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        h = json.loads(bytes(txn.get(HEADER_KEY)))
        total = keys = 0
        for k, v in list(txn.cursor()):
            if k == HEADER_KEY:
                continue
            new = record(k, np.frombuffer(v, dtype="<u4").copy()) if record else None
            if new is not None:
                v = np.asarray(new, dtype="<u4").tobytes()
                txn.put(k, v)
            total += codec.record_hash(k, v)
            keys += 1
        h.update(keys=keys, content_digest=codec.digest_hex(total))
        new_header = header(h) if header else h
        txn.put(HEADER_KEY, new_header if isinstance(new_header, bytes) else json.dumps(new_header).encode())
    env.close()
    return path


def _without(field):
    return lambda h: {k: v for k, v in h.items() if k != field}


def _with(**fields):
    return lambda h: {**h, **fields}


BAD_HEADERS = {
    "no draft_len": (_without("draft_len"), "draft_len"),
    "draft_len abc": (_with(draft_len="abc"), "draft_len"),
    "draft_len 0": (_with(draft_len=0), "draft_len"),
    "n_range 5": (_with(n_range=5), "n_range"),
    "n_range reversed": (_with(n_range=[3, 1]), "n_range"),
    "a JSON list": (lambda h: [h], "JSON list"),
    "not JSON": (lambda h: b"{draft_len", "JSON"),
    "sequences text": (_with(sequences="many"), "sequences"),
    "digest not hex": (_with(content_digest=12), "content_digest"),
    "vocab_size text": (_with(vocab_size="big"), "vocab_size"),
}


@pytest.mark.parametrize("case", list(BAD_HEADERS))
def test_a_bad_header_is_one_line_for_every_reader_and_damaged_for_verify(tiny_lm, tiny_model_dir, tmp_path, case):
    """Before: KeyError, ValueError or TypeError tracebacks (db info, db query, generate, merge),
    verify included."""
    change, field = BAD_HEADERS[case]
    db = _rewrite(_build(tiny_lm.tokenizer, tmp_path / "s.lmdb"), header=change)
    good = _build(tiny_lm.tokenizer, tmp_path / "good.lmdb")
    m = str(tiny_model_dir)
    for args in (["db", "info", db], ["db", "query", db, "--text", "the cat", "-m", m],
                 ["generate", "-m", m, "-p", PROMPT, "-n", "3", "--stats-db", db],
                 ["merge-stats", good, db, "-o", tmp_path / "m.lmdb"]):
        err = run(*map(str, args))
        assert isinstance(err, HdError), (args, getattr(err, "output", err))
        assert str(db) in str(err) and field in str(err) and "\n" not in str(err), (args, str(err))
    r = run("db", "verify", str(good), str(db))   # the good one is still reported
    assert r.exit_code == 1 and "DAMAGED" in r.output and field in r.output, r.output
    assert "good.lmdb: OK" in r.output.replace("\n", "")
    assert not (tmp_path / "m.lmdb").exists()


def test_a_bad_header_from_the_console_is_one_line(tiny_lm, tiny_model_dir, tmp_path):
    db = _rewrite(_build(tiny_lm.tokenizer, tmp_path / "s.lmdb"), header=lambda h: [h])
    err = one_line_error(hd_main("generate", "-m", tiny_model_dir, "-p", PROMPT, "-n", "3", "--stats-db", db))
    assert str(db) in err and "JSON list" in err
    p = hd_main("db", "verify", db)
    assert p.returncode == 1 and "DAMAGED" in p.stdout and "Traceback" not in p.stderr, (p.stdout, p.stderr)


def _verify(path) -> dict:
    return stores.Store(path).verify()


def test_verify_wants_a_tokenizer_fingerprint(tiny_lm, tmp_path):
    """Before: OK (and generate said "built for the tokenizer of 'tiny', which differs from tiny's")."""
    db = _rewrite(_build(tiny_lm.tokenizer, tmp_path / "s.lmdb"), header=_without("tokenizer_fingerprint"))
    report = _verify(db)
    assert not report["ok"] and "tokenizer_fingerprint" in report["problems"][0], report
    with pytest.raises(HdError, match="records no tokenizer fingerprint") as exc:
        api.open_stats_dbs([str(db)], tiny_lm)
    assert "which differs from" not in str(exc.value)


@pytest.mark.parametrize("where", ["continuation", "key", "answer"])
def test_verify_finds_ids_outside_the_vocabulary(tiny_lm, tmp_path, where):
    """Before: OK. The header records the tokenizer's vocabulary size (vocab_size) since this round."""
    db = _build(tiny_lm.tokenizer, tmp_path / "s.lmdb", sequences=[[5, 6, 7]], kind="model")
    assert stores.Store(db).header["vocab_size"] == VOCAB
    db2 = tmp_path / "bad.lmdb"
    db2.write_bytes(db.read_bytes())

    def change(k, v):
        if where == "answer" and codec.is_sequence_key(k):
            v[1] = 4_000_000_000
            return v
        if where == "continuation" and not codec.is_sequence_key(k) and len(k) == 4:
            v[3] = VOCAB + 7
            return v
    if where == "key":   # a key of one id past the vocabulary, with one continuation
        env = lmdb.open(str(db2), subdir=False, lock=False)
        with env.begin(write=True) as txn:
            txn.put(codec.encode_key([VOCAB + 3]), codec.encode_value(2, [([5], 2)], 1))
        env.close()
    _rewrite(db2, record=change)
    report = _verify(db2)
    assert not report["ok"] and "outside the vocabulary" in " ".join(report["problems"]), report
    assert _verify(db)["ok"]


def test_verify_finds_entries_longer_than_draft_len(tiny_lm, tiny_model_dir, tmp_path):
    """An entry whose length word exceeds draft_len made a lookup read the next entry's words as
    tokens. Before: verify OK; now DAMAGED, and readers say damaged in one line."""
    def change(k, v):
        if len(v) > 4:   # two entries or more (width 3): the first claims 2 tokens
            v[2] = 2
            return v
    db = _rewrite(_build(tiny_lm.tokenizer, tmp_path / "s.lmdb"), record=change)
    report = _verify(db)
    assert not report["ok"] and "draft_len" in " ".join(report["problems"]), report
    with pytest.raises(HdError, match="is damaged"):
        statsdb.merge([db], tmp_path / "m.lmdb")


def test_an_older_db_without_vocab_size_verifies_with_a_note(tiny_lm, tmp_path):
    db = _rewrite(_build(tiny_lm.tokenizer, tmp_path / "s.lmdb"), header=_without("vocab_size"))
    report = _verify(db)
    assert report["ok"] and "vocab_size" in " ".join(report["notes"]), report


def test_fingerprint_message_says_what_differs(tiny_lm, tmp_path):
    """Before: "built for the tokenizer of 'tiny', which differs from tiny's" (names equal)."""
    db = _rewrite(_build(tiny_lm.tokenizer, tmp_path / "s.lmdb"), header=_with(tokenizer_fingerprint="0" * 32))
    with pytest.raises(HdError) as exc:
        stores.Store(db).check_tokenizer(tiny_lm.tokenizer, "tiny")
    msg = str(exc.value)
    assert "which differs from" not in msg and "another version of the tokenizer" in msg and "00000000" in msg, msg
    with pytest.raises(HdError) as exc:
        stores.Store(db).check_tokenizer(tiny_lm.tokenizer, "other")
    assert "'tiny'" in str(exc.value) and "other" in str(exc.value)


def test_a_model_db_answer_holding_a_huge_id_is_not_indexed(tiny_lm, tmp_path):
    """Before: the answer index crashed on id 4,000,000,000 (arctic-inference's int32)."""
    from hdcli.drafting import model
    if not model.available():
        pytest.skip("arctic-inference is not installed")
    ids = tiny_lm.tokenizer(HEADER_DOCS[0], add_special_tokens=False)["input_ids"]
    out = tmp_path / "m.lmdb"
    statsdb.build([ids], out, tiny_lm.tokenizer, "tiny", tokenized=True, min_count=1, kind="model",
                  sequences=[ids[:4] + [4_000_000_000] + ids[4:], ids])
    mdb = api.open_stats_dbs([str(out)], tiny_lm)[0]
    index = model.index_for(mdb)   # before: OverflowError here
    assert index.candidates(ids[:3], 4, 1)
    ref = api.generate(tiny_lm, PROMPT, max_new_tokens=12, drafter=None)
    got = api.generate(tiny_lm, PROMPT, max_new_tokens=12, cost=FREE_FORWARD,
                       drafter=api.make_drafter(["model"], model_db=mdb, answer_index=index))
    assert got.tokens == ref.tokens
    assert not stores.Store(out).verify()["ok"]


def _oov_stats_db(tok, path, header=None):
    """A statistics DB every continuation of which is an id past the vocabulary, digest kept."""
    def change(k, v):
        if not codec.is_sequence_key(k):
            v[3::3] = VOCAB + 11
            return v
    return _rewrite(_build(tok, path), record=change, header=header)


@pytest.mark.parametrize("vocab_in_header", [True, False])
def test_out_of_vocabulary_drafts_never_reach_the_model(tiny_lm, tiny_model_dir, tmp_path, vocab_in_header):
    """Class 3: a statistics DB with out-of-vocabulary continuations made generation raise
    IndexError in the embedding (in `hd serve`, inside the decode loop). Now the layer drops
    them, with or without vocab_size in the header (an older DB): output is plain decoding's."""
    db = _oov_stats_db(tiny_lm.tokenizer, tmp_path / "s.lmdb", None if vocab_in_header else _without("vocab_size"))
    sdb = api.open_stats_dbs([str(db)], tiny_lm)
    ref = api.generate(tiny_lm, PROMPT, max_new_tokens=16, drafter=None)
    d = api.make_drafter(["stats"], stats_stores=sdb, stats_min_prob=0.0, stats_min_expected=0.0)
    got = api.generate(tiny_lm, PROMPT, max_new_tokens=16, drafter=d, cost=FREE_FORWARD)
    assert got.tokens == ref.tokens
    m = str(tiny_model_dir)
    cli = json.loads(run("generate", "-m", m, "-p", PROMPT, "-n", "10", "--stats-db", str(db), "--layers", "stats",
                         "--stats-min-prob", "0", "--stats-min-expected", "0", "--json").stdout)
    plain = json.loads(run("generate", "-m", m, "-p", PROMPT, "-n", "10", "--layers", "none", "--json").stdout)
    assert cli["tokens"] == plain["tokens"]


def test_a_db_whose_vocabulary_exceeds_the_model_is_refused(tiny_lm, tiny_model_dir, tmp_path):
    db = _rewrite(_build(tiny_lm.tokenizer, tmp_path / "s.lmdb"), header=_with(vocab_size=VOCAB + 100))
    err = run("generate", "-m", str(tiny_model_dir), "-p", PROMPT, "-n", "3", "--stats-db", str(db))
    assert isinstance(err, HdError) and str(db) in str(err) and str(VOCAB + 100) in str(err), err


def test_merging_two_builds_of_one_corpus_is_refused(tiny_model_dir, tmp_path):
    """Before: the counts of corpus.jsonl summed twice, silently. Shards of one build still merge."""
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, 12)
    m = str(tiny_model_dir)
    a, b, out = tmp_path / "a.lmdb", tmp_path / "b.lmdb", tmp_path / "m.lmdb"
    commands.build_stats([str(corpus)], a, m, min_count=1)
    commands.build_stats([str(corpus)], b, m, min_count=2)   # another build: another digest
    err = run("merge-stats", str(a), str(b), "-o", str(out))
    assert isinstance(err, HdError) and "corpus.jsonl" in str(err) and "twice" in str(err), err
    assert "--allow-same-sources" in str(err) and not out.exists()
    r = run("merge-stats", str(a), str(b), "-o", str(out), "--allow-same-sources", "--json")
    assert r.exit_code == 0, r.output
    for i in range(2):
        commands.build_stats([str(corpus)], tmp_path / f"s{i}.lmdb", m, shard=(i, 2))
    r = run("merge-stats", str(tmp_path / "s0.lmdb"), str(tmp_path / "s1.lmdb"), "-o", str(tmp_path / "sh.lmdb"))
    assert not isinstance(r, HdError) and r.exit_code == 0, r
    err = run("merge-stats", str(tmp_path / "s0.lmdb"), str(a), "-o", str(tmp_path / "x.lmdb"))
    assert isinstance(err, HdError)   # a shard with a pruned DB: refused as before


# --- DB files: another format, cut short, damaged, merged wrongly, raced, their modes ---------

def test_db_of_another_format_version_is_refused(tiny_lm, tmp_path):
    out = tmp_path / "s.lmdb"
    statsdb.build(TEXTS, out, tiny_lm.tokenizer, "tiny", min_count=1)
    db = stores.Store(out, writable=True)
    db.update(lambda txn: txn.put(HEADER_KEY, json.dumps({**db.header, "format_version": 99}).encode()))
    pass  # the cached LMDB environment sees every committed write
    r = run("db", "info", str(out))
    assert isinstance(r, HdError) and "format" in str(r)


def test_truncated_db_is_one_line_everywhere_and_leaves_no_lock(tiny_model_dir, tmp_path):
    """Half a DB (an interrupted copy) used to kill every reader with SIGBUS (exit 135): LMDB maps
    the file and reads past its end. Now the file size is checked against LMDB's last page first."""
    good = stats_db_file(tiny_model_dir, tmp_path)
    half = tmp_path / "half.lmdb"
    half.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    m = str(tiny_model_dir)
    for args in (["db", "info", half], ["db", "verify", half], ["db", "query", half, "--text", "the", "-m", m],
                 ["generate", "-m", m, "-p", "the cat", "-n", "4", "--stats-db", half],
                 ["merge-stats", half, good, "-o", tmp_path / "m.lmdb"]):
        err = one_line_error(hd_sub(*args))   # a process of its own: the bug was a SIGBUS
        assert "half.lmdb is truncated" in err, (args, err)
    assert not (tmp_path / "half.lmdb-lock").exists() and not (tmp_path / "m.lmdb").exists()


@pytest.mark.parametrize("where", ["structure", "content"])
def test_damaged_db_is_found_by_verify_and_refused_by_merge(tiny_model_dir, tmp_path, where):
    """Flipped bytes: `hd db verify` says DAMAGED (exit 1), merge-stats refuses in one line and
    writes nothing; a good DB verifies OK with the digest of its header."""
    good = stats_db_file(tiny_model_dir, tmp_path)
    ok = hd_main("db", "verify", good, "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"], ok.stdout
    data = bytearray(good.read_bytes())
    psize = 4096
    if where == "structure":  # 64 bytes of the middle page: headers, pointers and data
        mid = (len(data) // psize // 2) * psize
        for i in range(mid, mid + 64):
            data[i] ^= 0xFF
    else:  # one byte of record data: LMDB fills a leaf page from its end
        data[3 * psize - 3] ^= 0x01
    bad = tmp_path / "bad.lmdb"
    bad.write_bytes(bytes(data))
    p = hd_sub("db", "verify", bad, "--json")   # damaged pages must not take the test run down
    report = json.loads(p.stdout)
    assert p.returncode == 1 and not report["ok"] and report["dbs"][0]["problems"], p.stdout
    other = stats_db_file(tiny_model_dir, tmp_path, "other.lmdb")
    err = one_line_error(hd_sub("merge-stats", other, bad, "-o", tmp_path / "m.lmdb"))
    assert "bad.lmdb" in err and "damaged" in err
    assert not (tmp_path / "m.lmdb").exists()
    assert not [x for x in tmp_path.iterdir() if ".tmp-" in x.name]


def test_a_db_value_of_a_wrong_length_is_one_line(tiny_model_dir, tmp_path):
    """A value whose length is not a multiple of 4 gave numpy's ValueError traceback in `hd generate
    --stats-db` and `hd db query` (`db verify` found it). Now: damaged, run `hd db verify`."""
    import lmdb
    db = stats_db_file(tiny_model_dir, tmp_path)
    env = lmdb.open(str(db), subdir=False, lock=True)
    with env.begin(write=True) as txn:
        for k in [bytes(k) for k, _ in txn.cursor() if bytes(k) != HEADER_KEY]:
            txn.put(k, b"\x01\x02\x03")
    env.close()
    m = str(tiny_model_dir)
    for args in (["db", "query", db, "--text", "the cat", "-m", m],
                 ["generate", "-m", m, "-p", "the cat sat on the mat", "-n", "4", "--stats-db", db, "--layers", "context,stats", "--raw"]):
        err = one_line_error(hd_main(*args))
        assert f"{db} is damaged (a record of 3 bytes is malformed): run `hd db verify {db}`" in err, (args, err)
    assert hd_main("db", "verify", db).returncode == 1


def _two_shards(tiny_model_dir, tmp_path):
    """Shards 0/2 and 1/2 of a small corpus at s0.lmdb and s1.lmdb; returns (corpus, model)."""
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 40)
    m = str(tiny_model_dir)
    for i in range(2):
        assert hd_main("build-stats", corpus, "-o", tmp_path / f"s{i}.lmdb", "-m", m, "--shard", f"{i}/2").returncode == 0
    return corpus, m


def test_content_digest_ignores_layout_and_follows_learning(tiny_model_dir, tiny_lm, tmp_path):
    """Shards merged = the single build, digest for digest; --learn keeps the digest current."""
    corpus, m = _two_shards(tiny_model_dir, tmp_path)
    assert hd_main("build-stats", corpus, "-o", tmp_path / "single.lmdb", "-m", m).returncode == 0
    merged = json.loads(hd_main("merge-stats", tmp_path / "s0.lmdb", tmp_path / "s1.lmdb",
                                "-o", tmp_path / "merged.lmdb", "--json").stdout)["header"]
    single = stores.Store(tmp_path / "single.lmdb").header
    assert merged["content_digest"] == single["content_digest"] and merged["counts"].startswith("exact: all 2")
    db = stores.Store(tmp_path / "single.lmdb", writable=True)
    statsdb.add_counts(db, [tiny_lm.tokenizer("the cat sat on the mat", add_special_tokens=False)["input_ids"]])
    report = db.verify()
    assert report["ok"] and report["content_digest"] != single["content_digest"], report


def test_merge_refuses_what_would_give_wrong_counts(tiny_model_dir, tiny_lm, tmp_path):
    corpus, m = _two_shards(tiny_model_dir, tmp_path)
    copy = tmp_path / "copy.lmdb"
    copy.write_bytes((tmp_path / "s0.lmdb").read_bytes())
    pruned = tmp_path / "pruned.lmdb"
    assert hd_main("build-stats", corpus, "-o", pruned, "-m", m).returncode == 0
    model_db = tmp_path / "model.lmdb"
    statsdb.build(TEXTS, model_db, tiny_lm.tokenizer, m, min_count=1, kind="model")
    out = tmp_path / "m.lmdb"
    for inputs, want in (([tmp_path / "s0.lmdb", copy], "are the same DB"),
                         ([tmp_path / "s0.lmdb", tmp_path / "s0.lmdb"], "are the same DB"),
                         ([pruned, model_db], "merge DBs of one kind"),
                         ([pruned, tmp_path / "s0.lmdb"], "unpruned shard")):
        assert want in one_line_error(hd_main("merge-stats", *inputs, "-o", out))
        assert not out.exists()
    partial = json.loads(hd_main("merge-stats", tmp_path / "s1.lmdb", "-o", out, "--json").stdout)
    assert partial["header"]["counts"].startswith("exact sums of 1 shards (1 of 2): not every shard")


def test_a_build_never_replaces_an_output_that_appeared_meanwhile(tmp_path):
    out = tmp_path / "s.lmdb"
    first, second = atomic.StoreWriter(out), atomic.StoreWriter(out)  # both saw no output
    first.put(codec.encode_key([1]), codec.encode_value(1, [([2], 1)], 1))
    first.commit({"kind": "stats", "draft_len": 1, "n_range": [1, 1]})
    digest = stores.Store(out).header["content_digest"]
    with pytest.raises(HdError, match="appeared during the build"):
        second.commit({"kind": "stats", "draft_len": 1, "n_range": [1, 1]})
    second.abort()
    assert stores.Store(out).header["content_digest"] == digest
    assert [x.name for x in tmp_path.iterdir() if not x.name.endswith("-lock")] == ["s.lmdb"]


def test_two_builds_racing_to_one_path_one_wins(tiny_model_dir, tmp_path):
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 200)
    out = tmp_path / "s.lmdb"
    cmd = HD + ["build-stats", str(corpus), "-o", str(out), "--model", str(tiny_model_dir)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    err = [e for rc, e in results if rc == 2][0]
    assert "already exists" in err or "appeared during the build" in err, err
    assert stores.Store(out).verify()["ok"]


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600)])
def test_outputs_follow_the_umask(tiny_model_dir, tmp_path, umask, mode):
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 8)
    out = tmp_path / "s.lmdb"
    for extra in ([], ["--overwrite"]):
        old = os.umask(umask)
        try:
            p = hd_main("build-stats", corpus, "-o", out, "-m", tiny_model_dir, *extra)
        finally:
            os.umask(old)
        assert p.returncode == 0, p.stderr[-1000:]
        assert out.stat().st_mode & 0o777 == mode, (extra, oct(out.stat().st_mode))


# --- one long document: tokenised in pieces (split_text), counted in windows ------------------

def test_split_text_cuts_where_whitespace_starts():
    text = "alpha beta  gamma\n\ndelta " * 50 + "x" * 300
    pieces = list(statsdb.split_text(text, 40))
    assert "".join(pieces) == text and all(len(p) <= 40 for p in pieces)
    for a, b in zip(pieces, pieces[1:]):
        assert not a[-1].isspace() and (b[0].isspace() or len(a) == 40)   # a run of "x" is cut at the limit
    assert list(statsdb.split_text("short", 40)) == ["short"]


@pytest.mark.parametrize("max_n,draft_len", [(4, 1), (3, 4)])
def test_a_long_document_counts_exactly_in_pieces(tiny_lm, tmp_path, monkeypatch, max_n, draft_len):
    """A 50 MB one-line document was tokenised whole (7 GB) and counted whole, deaf to Ctrl-C for
    47 s. Now it is tokenised in pieces of PIECE_CHARS characters cut at whitespace and counted in
    windows of chunk_tokens tokens that overlap by max_n - 1 and draft_len: the same DB."""
    rng = random.Random(0)
    long = " ".join(rng.choice(WORDS[:12]) for _ in range(60_000))
    texts = [long, "the cat sat on the mat", long[:5000]]
    assert 10_000 < len(long) < statsdb.PIECE_CHARS   # whole in the first build, in pieces in the second
    kw = dict(min_n=1, max_n=max_n, draft_len=draft_len, min_count=1)
    whole = statsdb.build(texts, tmp_path / "whole.lmdb", tiny_lm.tokenizer, "tiny", **kw)
    seen = {"text": 0, "tokens": 0}
    real_tok, real_count = tiny_lm.tokenizer.__class__.__call__, statsdb.count_chunk

    def tokenise(self, texts, **k):
        seen["text"] = max(seen["text"], max(map(len, texts)))
        return real_tok(self, texts, **k)

    def count(docs, *a):
        seen["tokens"] = max(seen["tokens"], max(len(getattr(d, "tokens", d)) for d in docs))
        return real_count(docs, *a)
    monkeypatch.setattr(statsdb, "PIECE_CHARS", 10_000)
    monkeypatch.setattr(statsdb, "count_chunk", count)
    monkeypatch.setattr(tiny_lm.tokenizer.__class__, "__call__", tokenise)
    split = statsdb.build(texts, tmp_path / "split.lmdb", tiny_lm.tokenizer, "tiny", chunk_tokens=3_000, **kw)
    monkeypatch.undo()
    assert seen["text"] <= 10_000 and seen["tokens"] <= 3_000 + max_n - 1 + draft_len
    a, b = stores.Store(tmp_path / "whole.lmdb"), stores.Store(tmp_path / "split.lmdb")
    assert list(a.items()) == list(b.items())
    for k in ("documents", "tokens", "keys", "content_digest", "continuations"):
        assert whole.get(k) == split.get(k), k


def test_the_tokenizer_fingerprint_is_hashed_once_and_again_after_a_new_token(monkeypatch):
    """Every Run with a DB checks the fingerprint (api.generate builds one a call): it is kept per
    tokenizer, and a token added or made special since changes it as a fresh hash would."""
    from conftest import word_tokenizer
    tok = word_tokenizer()
    hashed = []
    real = fingerprint._fingerprint
    monkeypatch.setattr(fingerprint, "_fingerprint", lambda t: hashed.append(1) or real(t))
    first = fingerprint.tokenizer_fingerprint(tok)
    assert fingerprint.tokenizer_fingerprint(tok) == first and len(hashed) == 1
    tok.add_tokens(["zzqq"])
    again = fingerprint.tokenizer_fingerprint(tok)
    assert len(hashed) == 2 and again != first and again == real(tok)
    tok.add_special_tokens({"additional_special_tokens": ["zzqq"]})   # no new token: one made special
    special = fingerprint.tokenizer_fingerprint(tok)
    assert len(hashed) == 3 and special != again and special == real(tok)
