"""Issue 47, class 8 (DB headers and contents) and the DB half of class 3: one validator for DB
headers, used by every reader; `hd db verify` checks the tokenizer fingerprint, token ids against
the vocabulary and entry lengths against draft_len; drafts never carry ids outside the model's
vocabulary; merging two builds of one corpus is refused unless asked for."""
from __future__ import annotations

import json

import lmdb
import numpy as np
import pytest

from hdcli import api
from hdcli.db import codec, commands, statsdb, stores
from hdcli.db.header import HEADER_KEY
from hdcli.errors import HdError

from conftest import VOCAB
from test_cli import run
from test_reliability import hd_proc, one_line_error, write_corpus
from test_statsdb import FREE_FORWARD

DOCS = ["the cat sat on the mat and the dog ran up", "one two three one two three four",
        "the cat sat on the red mat and the cat ran"] * 2
PROMPT = "the cat sat on the"


def _build(tok, path, **kw):
    statsdb.build(DOCS, path, tok, "tiny", **{"min_count": 1, **kw})
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
    err = one_line_error(hd_proc("generate", "-m", tiny_model_dir, "-p", PROMPT, "-n", "3", "--stats-db", db))
    assert str(db) in err and "JSON list" in err
    p = hd_proc("db", "verify", db)
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
    from hdcli.drafting import answer_index as model
    if not model.available():
        pytest.skip("arctic-inference is not installed")
    ids = tiny_lm.tokenizer(DOCS[0], add_special_tokens=False)["input_ids"]
    out = tmp_path / "m.lmdb"
    statsdb.build([ids], out, tiny_lm.tokenizer, "tiny", tokenized=True, min_count=1, kind="model",
                  sequences=[ids[:4] + [4_000_000_000] + ids[4:], ids])
    mdb = api.open_stats_dbs([str(out)], tiny_lm)[0]
    index = model.index_for(mdb)   # before: OverflowError here
    assert index.propose(ids[:3], 4, 1)
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
    d = api.make_drafter(["stats"], stats_dbs=sdb, stats_min_prob=0.0, stats_min_expected=0.0)
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
