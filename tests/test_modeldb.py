"""The model DB: sampling, resume, indexing, learning (also from two processes at once).

Learned answers are never lost: merging model DBs keeps them, verify compares the header's
answer counts with the records, learning stops (and says so) when its file is replaced, a full
disk during --learn is one line after the answer, learning grows the file by a bounded amount
per token, and interrupted or refused DBs leave no files."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time

import lmdb
import pytest

from conftest import HD, PATIENCE, file_size_limit, hd_main, one_line_error
from hdcli import api
from hdcli.db import atomic, codec, modeldb, statsdb, stores
from hdcli.db.header import HEADER_KEY, read_header, write_header
from hdcli.errors import HdError
from hdcli.serve.learner import Learner

from test_cli import hd
from test_statsdb import FREE_FORWARD, db_dict, expected

PROMPTS = ["the cat sat", "one two three", "red blue green", "hello world", "big small",
           "the dog ran", "yes no yes", "sun moon"]


def samples_of(path):
    return [json.loads(line) for line in open(path)]


def test_index_holds_exactly_the_sampled_ngrams(tiny_lm, tmp_path):
    s = tmp_path / "s.jsonl"
    run = modeldb.sample(tiny_lm, PROMPTS, s, max_new_tokens=12, temperature=0.9, batch_size=3, seed=1)
    assert run["prompts_done"] == len(PROMPTS) and run["new_tokens"] > 0
    recs = samples_of(s)
    assert sorted(r["index"] for r in recs) == list(range(len(PROMPTS)))
    out = tmp_path / "m.lmdb"
    header = modeldb.index(s, out, tiny_lm.tokenizer, "tiny", min_count=1, top_k=3)
    assert header["kind"] == "model" and header["tokens"] == run["new_tokens"]
    docs = [r["tokens"] for r in sorted(recs, key=lambda r: r["index"])]
    assert db_dict(out) == expected(docs, 1, 4, 1, 3, 1)


def test_batched_sampling_matches_one_by_one_greedy(tiny_lm, tmp_path):
    """Left padding must not change what the model writes (greedy, fp32)."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    modeldb.sample(tiny_lm, PROMPTS, a, max_new_tokens=10, temperature=0, batch_size=4)
    modeldb.sample(tiny_lm, PROMPTS, b, max_new_tokens=10, temperature=0, batch_size=1)
    tokens = lambda p: {r["index"]: r["tokens"] for r in samples_of(p)}
    assert tokens(a) == tokens(b)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_resume_after_interruption_equals_uninterrupted(tiny_lm, tmp_path, temperature):
    kw = dict(max_new_tokens=10, temperature=temperature, batch_size=3, seed=7)
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    modeldb.sample(tiny_lm, PROMPTS, full, **kw)
    modeldb.sample(tiny_lm, PROMPTS, part, stop_after=1, **kw)
    with open(part, "a") as f:  # a kill in the middle of the next batch: one line and a torn one
        f.write(json.dumps({"batch": 1, "index": 3, "prompt": PROMPTS[3], "tokens": [1, 2],
                            "settings": samples_of(part)[0]["settings"]}) + "\n")
        f.write('{"batch": 1, "ind')
    with pytest.raises(Exception, match="--resume"):
        modeldb.sample(tiny_lm, PROMPTS, part, **kw)
    modeldb.sample(tiny_lm, PROMPTS, part, resume=True, **kw)
    assert samples_of(part) == samples_of(full)
    modeldb.index(full, tmp_path / "a.lmdb", tiny_lm.tokenizer, "tiny")
    modeldb.index(part, tmp_path / "b.lmdb", tiny_lm.tokenizer, "tiny")
    assert db_dict(tmp_path / "a.lmdb") == db_dict(tmp_path / "b.lmdb")


def test_learn_adds_counts_and_reprunes(tiny_lm, tmp_path):
    out = tmp_path / "m.lmdb"
    statsdb.build([[5, 6, 7], [5, 6, 8]], out, tiny_lm.tokenizer, "tiny", tokenized=True,
                  min_count=1, top_k=2, kind="model")
    db = stores.Store(out, writable=True)
    assert db.get([5, 6]) == (2, [([7], 1), ([8], 1)])
    statsdb.add_counts(db, [[5, 6, 9, 5, 6, 9]])
    assert db.get([5, 6]) == (4, [([9], 2), ([7], 1)])  # top-2 kept, total counts everything
    assert db.header["learned_updates"] == 1


def test_learn_from_two_processes_loses_nothing(tiny_lm, tmp_path):
    out = tmp_path / "m.lmdb"
    statsdb.build([[1, 2, 3]], out, tiny_lm.tokenizer, "tiny", tokenized=True, min_count=1, top_k=0,
                  kind="model")
    script = textwrap.dedent(f"""
        import sys
        from hdcli.db import stores, statsdb
        me = int(sys.argv[1])
        db = stores.Store({str(out)!r}, writable=True)
        for i in range(60):
            statsdb.add_counts(db, [[10 + me, 20 + me, 30 + me], [7, 8]])
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(me)]) for me in (0, 1)]
    assert [p.wait() for p in procs] == [0, 0]
    db = stores.Store(out)
    assert db.get([10, 20]) == (60, [([30], 60)]) and db.get([11, 21]) == (60, [([31], 60)])
    assert db.get([7]) == (120, [([8], 120)])
    assert db.header["learned_updates"] == 120


def test_greedy_with_context_model_and_stats_equals_plain(tiny_lm, tmp_path):
    s = tmp_path / "s.jsonl"
    modeldb.sample(tiny_lm, PROMPTS[:5], s, max_new_tokens=30, temperature=0.0, batch_size=5)
    modeldb.index(s, tmp_path / "m.lmdb", tiny_lm.tokenizer, "tiny", min_count=1)
    statsdb.build(["the cat sat on the mat and the dog ran up"] * 3, tmp_path / "st.lmdb",
                  tiny_lm.tokenizer, "tiny")
    mdb = api.open_stats_dbs([str(tmp_path / "m.lmdb")], tiny_lm, writable=True)[0]
    sdb = api.open_stats_dbs([str(tmp_path / "st.lmdb")], tiny_lm)
    accepted = 0
    for p in PROMPTS:
        ref = api.generate(tiny_lm, p, max_new_tokens=30, drafter=None)
        for layers in (["model"], ["context", "model", "stats"]):
            d = api.make_drafter(layers, model_db=mdb, stats_stores=sdb, stats_min_prob=0.0, stats_min_expected=0.0)
            got = api.generate(tiny_lm, p, max_new_tokens=30, drafter=d, cost=FREE_FORWARD)
            assert got.tokens == ref.tokens
            accepted += got.stats.layers["model"].accepted if "model" in got.stats.layers else 0
        api.learn(mdb, ref.prompt_ids, ref.tokens)  # learning must not break exactness either
    assert accepted > 0


def test_cli_build_model_db_and_learn(tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [p, "second turn"]}) for p in PROMPTS) + "\n")
    out = tmp_path / "m.lmdb"
    m = str(tiny_model_dir)
    r = json.loads(hd("build-model-db", "-o", str(out), "--model", m, "--prompts", str(prompts),
                      "--num-prompts", "4", "-n", "8", "--batch-size", "2", "--json").stdout)
    h = r["header"]
    assert h["prompts"] == 4 and h["sampling"]["temperature"] == 0.0 and h["prompt_source"] == str(prompts)
    assert h["sequences"] == 4  # the answers kept whole, for the model layer's suffix index
    assert r["sampling"]["new_tokens"] == h["tokens"]
    again = tmp_path / "again.lmdb"
    hd("build-model-db", "-o", str(again), "--model", m, "--from-samples", str(out) + ".samples.jsonl")
    assert db_dict(again) == db_dict(out)
    g = json.loads(hd("generate", "--model", m, "-p", "the cat sat", "-n", "12", "--model-db", str(out),
                      "--learn", "--json").stdout)
    assert g["learned_keys"] > 0
    assert stores.Store(out).header["learned_tokens"] == len(g["tokens"])


def test_the_default_prompts_ship_with_the_package(tmp_path):
    """`hd build-model-db -o model.lmdb` with no --prompts reads the 320 prompts hd ships: found where
    the module looks (not under a folder of the repository) and inside the built wheel."""
    import zipfile
    prompts, source = modeldb.load_prompts()
    assert len(prompts) == 320 and all(prompts) and modeldb.DEFAULT_PROMPTS.is_file()
    assert "sample_corpora" not in str(modeldb.DEFAULT_PROMPTS)
    from pathlib import Path
    root = Path(modeldb.__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        pytest.skip("hd is installed from a wheel here: the prompts were found above")
    import shutil
    src = tmp_path / "src"   # the sources alone: a build/ or egg-info left by an install would add the file anyway
    shutil.copytree(root / "hdcli", src / "hdcli", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(root / name, src / name)
    got = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300)
    if got.returncode != 0:
        pytest.skip(f"no wheel could be built here: {got.stderr.strip().splitlines()[-1:]}")
    wheel = next(tmp_path.glob("*.whl"))
    assert "hdcli/data/model_db_prompts.jsonl" in zipfile.ZipFile(wheel).namelist()


def _model_db(lm, tmp_path, prompts, n=30):
    s = tmp_path / "s.jsonl"
    modeldb.sample(lm, prompts, s, max_new_tokens=n, temperature=0.0, batch_size=len(prompts))
    modeldb.index(s, tmp_path / "m.lmdb", lm.tokenizer, "tiny", min_count=1)
    return stores.Store(tmp_path / "m.lmdb", writable=True), [r["tokens"] for r in samples_of(s)]


@pytest.mark.parametrize("index", ["answers", "ngrams"])
def test_model_layer_greedy_equals_plain_and_drafts_a_known_answer(tiny_lm, tmp_path, monkeypatch, index):
    """The model layer drafts from the DB's answers (suffix index) or, without arctic-inference,
    from its n-gram table; either way greedy output is plain decoding's, and a prompt whose answer
    the DB holds is drafted mostly by it."""
    from hdcli.drafting import model
    if index == "answers" and not model.available():
        pytest.skip("arctic-inference is not installed")
    if index == "ngrams":
        monkeypatch.setattr(model, "available", lambda: False)
    mdb, answers = _model_db(tiny_lm, tmp_path, PROMPTS[:4])
    assert mdb.sequence_count == 4 and [a.tolist() for a in mdb.sequences()] == answers
    for p in PROMPTS:
        ref = api.generate(tiny_lm, p, max_new_tokens=30, drafter=None)
        for layers in (["model"], ["context", "model"]):
            d = api.make_drafter(layers, model_db=mdb, stats_min_prob=0.0, stats_min_expected=0.0,
                                 answer_index=model.AnswerIndex(mdb.sequences()) if index == "answers" else None)
            layer = d.layers[-1]
            assert isinstance(layer, model.ModelLayer) == (index == "answers")
            got = api.generate(tiny_lm, p, max_new_tokens=30, drafter=d, cost=FREE_FORWARD)
            assert got.tokens == ref.tokens
            if p in PROMPTS[:4] and layers == ["model"] and index == "answers":
                # its own answer, seen once: drafted mostly by the model layer
                assert got.stats.layers["model"].accepted >= len(ref.tokens) // 2, p


def test_an_answer_is_drafted_for_the_next_request_of_the_process(tiny_lm, tmp_path):
    """The index grows with what this process generates (as SuffixDecoding's global tree): the
    second request for the same prompt is drafted by the model layer; a fresh index (no
    learning) drafts none of it (the control)."""
    from hdcli.drafting import model
    if not model.available():
        pytest.skip("arctic-inference is not installed")
    mdb, _ = _model_db(tiny_lm, tmp_path, PROMPTS[:1], n=8)
    p = PROMPTS[5]
    shared = model.AnswerIndex(mdb.sequences())
    first = api.generate(tiny_lm, p, max_new_tokens=30,
                         drafter=api.make_drafter(["model"], model_db=mdb, answer_index=shared), cost=FREE_FORWARD)
    second = api.generate(tiny_lm, p, max_new_tokens=30,
                          drafter=api.make_drafter(["model"], model_db=mdb, answer_index=shared), cost=FREE_FORWARD)
    fresh = api.generate(tiny_lm, p, max_new_tokens=30,
                         drafter=api.make_drafter(["model"], model_db=mdb, answer_index=model.AnswerIndex(mdb.sequences())),
                         cost=FREE_FORWARD)
    assert first.tokens == second.tokens == fresh.tokens
    got = lambda r: r.stats.layers["model"].accepted if "model" in r.stats.layers else 0
    assert got(second) >= len(second.tokens) // 2 and got(fresh) == got(first) < got(second) / 2


def test_without_a_db_the_default_model_layer_drafts_the_processs_earlier_answers(tiny_lm):
    """No model DB: the default hierarchy's model layer drafts from this process's answers alone
    (SuffixDecoding's global tree). The second request for a prompt is drafted mostly by it, greedy
    output is plain decoding's every time, and a fresh index drafts none of it (the control)."""
    from hdcli import compose
    from hdcli.config import DecodingConfig
    from hdcli.drafting import model
    if not model.available():
        pytest.skip("arctic-inference is not installed")
    p = PROMPTS[6]
    ref = api.generate(tiny_lm, p, max_new_tokens=30, drafter=None)
    shared = model.AnswerIndex(max_answers=model.MEMORY_ANSWERS)
    make = lambda index: compose.build_drafter(DecodingConfig(), tiny_lm, answer_index=index)
    assert [layer.name for layer in make(shared).layers] == ["context", "model"]
    first = api.generate(tiny_lm, p, max_new_tokens=30, drafter=make(shared), cost=FREE_FORWARD)
    second = api.generate(tiny_lm, p, max_new_tokens=30, drafter=make(shared), cost=FREE_FORWARD)
    fresh = api.generate(tiny_lm, p, max_new_tokens=30, drafter=make(model.AnswerIndex()), cost=FREE_FORWARD)
    assert first.tokens == second.tokens == fresh.tokens == ref.tokens
    got = lambda r: r.stats.layers["model"].accepted if "model" in r.stats.layers else 0
    # (the first and the fresh one draft from their own answer's earlier part only, as the context does)
    assert got(first) == got(fresh) < got(second) / 2 and got(second) >= len(ref.tokens) // 2
    # without an index of its own the layer uses the process's (made once, bounded)
    assert compose.build_drafter(DecodingConfig(), tiny_lm).layers[-1].index is model.process_answers()
    assert model.process_answers().cache.max_cached_requests == model.MEMORY_ANSWERS


def test_without_a_db_each_scope_and_each_bench_method_learns_apart(tiny_lm):
    """What the model layer learns in memory is kept per scope in hd serve (no scope drafts
    another's answers: serve/tenants.py), and per method in hd bench (another method's answer to
    the same question would draft this one's whole): each gets an index of its own."""
    from hdcli.bench import runner
    from hdcli.compose import DBs
    from hdcli.config import DecodingConfig
    from hdcli.drafting import model
    from hdcli.serve import tenants
    if not model.available():
        pytest.skip("arctic-inference is not installed")
    t = tenants.Tenants(None, True)
    a, b = t.answers(("key", "a")), t.answers(("key", "b"))
    assert isinstance(a, model.AnswerIndex) and isinstance(b, model.AnswerIndex) and a is not b
    assert a.cache.max_cached_requests == model.SCOPE_ANSWERS   # bounded: up to 256 scopes
    assert t.answers(("key", "a")) is a and t.answers(()) is None   # shared: the process's
    assert tenants.Tenants(None, False).answers(("key", "a")) is None
    cfg = DecodingConfig(max_new_tokens=8)
    indexes = {}
    for name in ("hd", "hd-no-context"):
        factory, _ = runner.drafter_factory(name, tiny_lm, cfg, DBs())
        one, two = factory().layers[-1], factory().layers[-1]
        assert one.name == "model" and one.index is two.index     # one index per method and run
        indexes[name] = one.index
    assert indexes["hd"] is not indexes["hd-no-context"] and indexes["hd"] is not model.process_answers()


def test_learn_keeps_the_answer_and_the_digest(tiny_lm, tmp_path):
    mdb, _ = _model_db(tiny_lm, tmp_path, PROMPTS[:2], n=8)
    api.learn(mdb, [1, 2, 3], [40, 41, 42, 43])
    assert mdb.sequence_count == 3 and list(mdb.sequences())[-1].tolist() == [40, 41, 42, 43]
    assert stores.Store(tmp_path / "m.lmdb").verify()["ok"]
    with mdb.env.begin(write=True) as txn:  # a damaged answer record: verify says so
        txn.put(codec.sequence_key(0), b"\x01\x02\x03")
    mdb.refresh()
    assert not mdb.verify()["ok"]


def test_learn_refuses_a_statistics_db(tiny_lm, tmp_path):
    out = tmp_path / "st.lmdb"
    statsdb.build([[5, 6, 7]], out, tiny_lm.tokenizer, "tiny", tokenized=True, min_count=1)
    db = stores.Store(out, writable=True)
    before = db.verify()["content_digest"]
    with pytest.raises(api.HdError, match="not a model DB"):
        api.learn(db, [1], [5, 6, 7])
    assert db.verify()["content_digest"] == before


def test_verify_catches_counts_a_pruned_statistics_db_would_not_hold(tiny_lm, tmp_path):
    """Issue 40: counts written into a pruned statistics DB after its build (as --learn once did:
    digest kept current, so the digest alone said OK) break what its header states, and verify
    says so; a model DB, which learns counts of 1, is not held to min_count."""
    out = tmp_path / "st.lmdb"
    statsdb.build([[5, 6, 7, 5, 6, 7, 5, 6, 8]], out, tiny_lm.tokenizer, "tiny", tokenized=True, min_count=2)
    assert stores.Store(out).verify()["ok"]
    db = stores.Store(out, writable=True)
    statsdb.add_counts(db, [[1, 2, 3, 4]])          # what learning writes: counts of 1, digest updated
    report = stores.Store(out).verify()
    assert not report["ok"] and "pruning" in report["problems"][0], report


def test_resume_with_other_prompts_or_settings_is_refused(tiny_lm, tmp_path):
    s = tmp_path / "s.jsonl"
    kw = dict(max_new_tokens=6, temperature=0.0, batch_size=2, seed=0)
    modeldb.sample(tiny_lm, PROMPTS, s, stop_after=1, **kw)
    kept = s.read_text()
    with pytest.raises(api.HdError, match="max_new_tokens 6 .now 8.*batch_size 2 .now 5"):
        modeldb.sample(tiny_lm, PROMPTS, s, resume=True, **{**kw, "max_new_tokens": 8, "batch_size": 5})
    with pytest.raises(api.HdError, match="another prompt"):
        modeldb.sample(tiny_lm, PROMPTS[::-1], s, resume=True, **kw)
    assert s.read_text() == kept  # refused before anything was rewritten
    modeldb.sample(tiny_lm, PROMPTS, s, resume=True, **kw)
    assert sorted(r["index"] for r in samples_of(s)) == list(range(len(PROMPTS)))


# --- learned answers never lost ---------------------------------------------------------------

SCOPE_A, SCOPE_B = b"tenant-a", b"tenant-b"


@pytest.fixture(scope="module")
def tok():
    """The tiny model's tokenizer (conftest's), without loading the model."""
    from conftest import word_tokenizer
    return word_tokenizer()


def model_db(tok, path, answers, **kw):
    statsdb.build(answers, path, tok, "tiny", tokenized=True, min_count=1, kind="model",
                  sequences=answers, **kw)
    return path


def answers(seed: int, n: int, length: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 50) for _ in range(length)] for _ in range(n)]   # ids of the tiny vocabulary


# --- merge-stats of model DBs ------------------------------------------------------------------

def test_merging_model_dbs_keeps_their_answers_deduplicated_and_scoped(tok, tmp_path):
    shared = answers(1, 3)
    a = model_db(tok, tmp_path / "a.lmdb", shared + answers(2, 2))
    b = model_db(tok, tmp_path / "b.lmdb", shared + answers(3, 1))
    db_a = stores.Store(a, writable=True)
    db_a.add_sequences([[7, 8, 9]], scope=SCOPE_A)
    db_b = stores.Store(b, writable=True)
    db_b.add_sequences([[7, 8, 9]], scope=SCOPE_A)          # the same tenant's answer twice: kept once
    db_b.add_sequences([[7, 8, 9], [10, 11]], scope=SCOPE_B)  # another tenant's: kept apart
    out = tmp_path / "m.lmdb"
    header = statsdb.merge([a, b], out)
    merged = stores.Store(out)
    got = [s.tolist() for s in merged.sequences()]
    assert got == shared + answers(2, 2) + answers(3, 1)     # first seen first, each once
    assert header["sequences"] == merged.sequence_count == 6
    assert [s.tolist() for s in merged.sequences(SCOPE_A)] == [[7, 8, 9]]
    assert [s.tolist() for s in merged.sequences(SCOPE_B)] == [[7, 8, 9], [10, 11]]
    assert merged.header["scoped_sequences"] == 3
    report = merged.verify()
    assert report["ok"], report


def test_verify_compares_the_headers_answer_counts_with_the_records(tok, tmp_path):
    path = model_db(tok, tmp_path / "m.lmdb", answers(1, 3))
    db = stores.Store(path, writable=True)
    db.add_sequences([[7, 8, 9]], scope=SCOPE_A)
    assert db.verify()["ok"]
    for field, claimed in (("sequences", 5), ("scoped_sequences", 0)):
        def lie(txn):
            h = read_header(txn)
            h[field] = claimed
            write_header(txn, h)    # the header is outside the digest: only a count check sees it
        db.update(lie)
        report = stores.Store(path).verify()
        assert not report["ok"] and any("answer" in p for p in report["problems"]), report
        db.update(lambda txn: write_header(txn, {**read_header(txn), "sequences": 3,
                                                          "scoped_sequences": 1}))
    assert stores.Store(path).verify()["ok"]


# --- a replaced file ---------------------------------------------------------------------------

def test_learning_into_a_replaced_model_db_stops_and_says_so(tok, tmp_path):
    path = model_db(tok, tmp_path / "m.lmdb", answers(1, 3))
    said = []
    learner = Learner(path, on_error=said.append)
    learner.put([1, 2], [20, 21, 22, 23])
    deadline = time.time() + PATIENCE
    while learner.learned < 1:
        assert time.time() < deadline
        time.sleep(0.02)
    model_db(tok, path, answers(2, 3), overwrite=True)   # hd build-model-db -o M --overwrite
    for _ in range(3):
        learner.put([1, 2], [30, 31, 32])
    learner.close()
    assert learner.learned == 1                            # only what landed in the file at M
    assert len(said) == 1 and "replaced" in said[0] and str(path) in said[0], said
    fresh = stores.Store(path)
    assert fresh.sequence_count == 3 and not fresh.header.get("learned_updates")
    assert fresh.verify()["ok"], fresh.verify()["problems"]


def test_api_learn_refuses_a_replaced_file_in_one_line(tok, tmp_path):
    path = model_db(tok, tmp_path / "m.lmdb", answers(1, 3))
    db = stores.Store(path, writable=True)
    model_db(tok, path, answers(2, 3), overwrite=True)
    with pytest.raises(HdError, match="replaced") as exc:
        api.learn(db, [1, 2], [20, 21, 22])
    assert "\n" not in str(exc.value) and str(path) in str(exc.value)
    assert not stores.Store(path).header.get("learned_updates")


# --- a full disk -------------------------------------------------------------------------------

def test_learn_on_a_full_disk_prints_the_answer_then_one_line(tiny_model_dir, tok, tmp_path):
    path = model_db(tok, tmp_path / "m.lmdb", answers(1, 4))
    stores.Store(path).close()                             # its lock file, as after any earlier use
    size = path.stat().st_size                             # a packed DB: any write extends the file
    args = HD + ["generate", "--model", str(tiny_model_dir), "-p", "the cat sat on the", "-n", "16",
                 "--model-db", str(path), "--learn", "--no-color"]
    texts = []
    for as_json in (True, False):
        p = subprocess.run(args + (["--json"] if as_json else []), capture_output=True, text=True,
                           preexec_fn=file_size_limit(size))
        line = one_line_error(p)
        assert line.startswith(f"error: the answer was not learned: could not write to {path} (") and \
            "the disk may be full" in line, line
        texts.append(json.loads(p.stdout)["text"] if as_json else p.stdout)
    assert texts[0] and texts[1].startswith(texts[0])      # the answer, printed all the same
    db = stores.Store(path)
    assert db.verify()["ok"] and not db.header.get("learned_updates")


# --- growth of a learned file ------------------------------------------------------------------

def test_learning_grows_the_file_by_a_bounded_amount_per_token(tok, tmp_path):
    """As `hd serve --model-db M --learn` runs: the decoding side's Store stays open (its answers
    read once into the index) while the learner writes one generation per transaction. 120
    answers of 32 tokens grew the file by ~2.5 KB per token (pages pinned by the decoding Store's
    read snapshot are never reused) where ~0.3 KB of records were added."""
    from hdcli.drafting import model
    path = model_db(tok, tmp_path / "m.lmdb", answers(1, 4))
    before = path.stat().st_size
    decoding = stores.Store(path, writable=True)           # compose.open_dbs with --learn
    if model.available():
        model.index_for(decoding)
    decoding.get([5])
    learner = Learner(path)
    learned = answers(7, 120, length=32)
    for a in learned:
        learner.put([1, 2, 3], a)
    learner.close()
    assert learner.learned == len(learned)
    tokens = stores.Store(path).header["learned_tokens"]
    grown = path.stat().st_size - before
    assert grown <= 800 * tokens, (grown, tokens, grown / tokens)
    info = stores.Store(path).size_info()
    assert info["file_bytes"] == path.stat().st_size
    assert info["used_pages"] + info["free_pages"] == info["pages"] <= info["file_bytes"] // info["page_bytes"]
    assert info["free_pages"] <= info["used_pages"]


def test_db_info_reports_file_size_used_and_free_pages(tok, tmp_path):
    path = model_db(tok, tmp_path / "m.lmdb", answers(1, 4))
    p = hd_main("db", "info", path, "--json")
    assert p.returncode == 0, p.stderr
    size = json.loads(p.stdout)["size"]
    assert size["file_bytes"] == path.stat().st_size and size["used_pages"] > 0 and size["free_pages"] >= 0
    p = hd_main("db", "info", path)
    assert "used_pages" in p.stdout and "free_pages" in p.stdout


# --- leftovers ---------------------------------------------------------------------------------

def leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or p.name.endswith("-lock"))


@pytest.mark.parametrize("where", ["open", "copy"])
def test_an_interrupted_write_removes_its_own_temporary_files(tok, tmp_path, monkeypatch, where):
    """Ctrl-C while the temporary file is opened (before writing() holds the writer) or while
    commit() packs it into a second one."""
    out = model_db(tok, tmp_path / "m.lmdb", answers(1, 4))
    before = out.read_bytes()

    def interrupt(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(*{"open": (lmdb, "open"), "copy": (atomic, "record_hash")}[where], interrupt)
    with pytest.raises(KeyboardInterrupt):
        model_db(tok, out, answers(2, 4), overwrite=True)
    assert leftovers(tmp_path) == [] and out.read_bytes() == before


# The signal arrives from the process itself at the first call of `at` (the temporary files exist
# by then): no timing, and the CLI's own handling of SIGINT (Ctrl-C) and SIGTERM.
SIGNAL_AT = """
import os, signal, sys
# Python's own Ctrl-C handler, as in a terminal: a process started in the background by a shell
# without job control (`cmd &`, as some CI runners do) inherits SIGINT ignored, and never sees it
signal.signal(signal.SIGINT, signal.default_int_handler)
from hdcli.db import atomic
owner, name = (atomic.StoreWriter, "{at}") if hasattr(atomic.StoreWriter, "{at}") else (atomic, "{at}")
def interrupted(*args):
    os.kill(os.getpid(), signal.{sig})
    # the Python handler runs when the main thread next checks for signals: at once as a rule, but
    # a loaded machine may let this function return first (seen once in a full suite), so wait here
    import time
    for _ in range(1000):
        time.sleep(0.01)
setattr(owner, name, interrupted)
sys.argv = ["hd"] + sys.argv[1:]
from hdcli.cli import main
main()
"""


@pytest.mark.parametrize("command,sig,at", [("build-stats", "SIGINT", "record_hash"),   # packing the copy
                                            ("merge-stats", "SIGTERM", "put")])
def test_a_signalled_build_or_merge_leaves_no_temporary_files(tiny_model_dir, tok, tmp_path, command, sig, at):
    old = model_db(tok, tmp_path / "old.lmdb", answers(1, 3))
    out = tmp_path / "out.lmdb"
    out.write_bytes(old.read_bytes())                      # the DB --overwrite would replace
    if command == "build-stats":
        corpus = tmp_path / "c.jsonl"
        corpus.write_text(json.dumps({"text": "the cat sat on the mat"}) + "\n")
        args = [command, str(corpus), "--model", str(tiny_model_dir), "--min-count", "1"]
    else:
        args = [command, str(old), str(model_db(tok, tmp_path / "other.lmdb", answers(2, 3)))]
    before = set(os.listdir(tmp_path))
    p = subprocess.run([sys.executable, "-c", SIGNAL_AT.format(sig=sig, at=at), *args, "-o", str(out),
                        "--overwrite"], capture_output=True, text=True, timeout=PATIENCE)
    code = {"SIGINT": 130, "SIGTERM": 143}[sig]                   # 128 + the signal, as anywhere
    assert p.returncode == code and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1] == f"error: {'interrupted' if code == 130 else 'terminated'} ({sig})"
    readers = {"old.lmdb-lock", "other.lmdb-lock"}             # the inputs', as any reader's
    assert set(os.listdir(tmp_path)) - readers == before     # no OUT.tmp-PID-* left
    assert out.read_bytes() == old.read_bytes()


def refused_files(tmp_path):
    plain = tmp_path / "plain.lmdb"                        # an LMDB file, no hd header
    env = lmdb.open(str(plain), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    env.close()
    yield plain, "not an hd DB"
    for name, raw in (("bad-json.lmdb", b"{not json"), ("future.lmdb", json.dumps({"format_version": 99}).encode())):
        f = tmp_path / name
        env = lmdb.open(str(f), subdir=False, lock=False)
        with env.begin(write=True) as txn:
            txn.put(HEADER_KEY, raw)
        env.close()
        yield f, "JSON" if name == "bad-json.lmdb" else "format version"
    text = tmp_path / "text.lmdb"
    text.write_text("hello\n" * 2000)
    yield text, "not an hd DB"


def test_a_refused_db_leaves_no_lock_file(tmp_path):
    for path, why in list(refused_files(tmp_path)):
        for writable in (False, True):
            with pytest.raises(HdError, match=why):
                stores.Store(path, writable=writable)
            assert not os.path.exists(str(path) + "-lock"), (path.name, writable)
    p = hd_main("db", "verify", tmp_path / "future.lmdb")
    assert "format version" in one_line_error(p) and not (tmp_path / "future.lmdb-lock").exists()
