"""Reliability across subjects: killed processes (learning, sampling), a full disk, several
processes on the same DBs at once, DBs on a read-only file system. Each subject's own bad inputs
and damaged files are tested in that subject's file (docs/reliability.md names them)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from hdcli.db import statsdb, stores

from conftest import HD, TEXTS, file_size_limit, hd_main, one_line_error, write_corpus


# --- a full disk -------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", ["2000", "100000000"])  # with and without spill files
def test_disk_full_gives_a_clean_error_and_keeps_the_previous_db(tiny_model_dir, tmp_path, chunk):
    from conftest import WORDS
    rng = random.Random(0)
    corpus = tmp_path / "c.jsonl"  # random word strings: ~40k distinct n-grams, a DB of ~MBs
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(12))}) + "\n"
                              for _ in range(4000)))
    out = tmp_path / "s.lmdb"
    small = tmp_path / "small.jsonl"
    write_corpus(small, 4)
    assert hd_main("build-stats", small, "-o", out, "--model", tiny_model_dir, "--min-count", "1").returncode == 0
    before = stores.Store(out).header["documents"]
    p = subprocess.run(HD + ["build-stats", str(corpus), "-o", str(out), "--model", str(tiny_model_dir),
                             "--min-count", "1", "--overwrite", "--chunk-tokens", chunk],
                       capture_output=True, text=True, preexec_fn=file_size_limit(150_000))
    assert "cannot write" in one_line_error(p)
    pass  # the cached LMDB environment sees every committed write
    assert stores.Store(out).header["documents"] == before  # the previous complete DB, untouched
    assert sorted(x.name for x in tmp_path.iterdir() if not x.name.endswith("-lock")) == \
        ["c.jsonl", "s.lmdb", "small.jsonl"]


# --- killed processes --------------------------------------------------------------------------

def test_killed_learning_never_corrupts_the_model_db(tiny_model_dir, tiny_lm, tmp_path):
    out = tmp_path / "m.lmdb"
    statsdb.build(TEXTS, out, tiny_lm.tokenizer, str(tiny_model_dir), min_count=1, kind="model")
    rng = random.Random(0)
    updates = 0
    for _ in range(8):
        p = subprocess.Popen(HD + ["generate", "--model", str(tiny_model_dir), "-p", "the cat sat on the",
                                   "-n", "20", "--model-db", str(out), "--learn", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        time.sleep(rng.uniform(1.0, 4.0))
        p.send_signal(signal.SIGKILL)
        p.wait()
        pass  # the cached LMDB environment sees every committed write
        db = stores.Store(out)  # opens, header readable: the previous or the new complete state
        now = db.header.get("learned_updates", 0)
        assert now in (updates, updates + 1)
        updates = now
        assert sum(1 for _ in db.items()) > 0
    assert hd_main("generate", "--model", tiny_model_dir, "-p", "the cat", "-n", "5", "--model-db", out,
                   "--learn", "--json").returncode == 0


def test_killed_sampling_resumes_without_losing_samples(tiny_model_dir, tmp_path):
    N = 120   # enough that three kills, each once a new line is written, land mid-sampling even on a
    # loaded machine (a few batches of 2 between the line and the kill); the final
    # resume samples the rest (400 spent ~10 s there)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{TEXTS[i % 4]} {i}"}) + "\n" for i in range(N)))
    out = tmp_path / "m.lmdb"
    samples = tmp_path / "m.lmdb.samples.jsonl"
    args = HD + ["build-model-db", "-o", str(out), "--model", str(tiny_model_dir), "--prompts", str(prompts),
                 "--num-prompts", str(N), "-n", "48", "--batch-size", "2", "--json"]
    seen = 0

    def complete_lines() -> int:
        if not samples.exists():
            return 0
        return sum(1 for x in samples.read_text().splitlines() if x.endswith("}"))

    for _ in range(3):
        p = subprocess.Popen(args + (["--resume"] if samples.exists() else []),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # kill once this run has written something new: mid-sampling whatever this machine's speed
        deadline = time.monotonic() + 300
        while complete_lines() <= seen and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert not out.exists() or stores.Store(out).header["prompts"] == N
        if samples.exists():
            lines = samples.read_text().splitlines()
            complete = [json.loads(x) for x in lines if x.endswith("}")]
            assert len(complete) >= seen  # nothing already sampled was lost
            seen = len(complete)
    assert 0 < seen < N, "the kills should land mid-sampling"
    r = subprocess.run(args + ["--resume"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    recs = [json.loads(x) for x in samples.read_text().splitlines()]
    assert len(recs) == N and stores.Store(out).header["prompts"] == N


# --- several processes on the same DBs ---------------------------------------------------------

def test_readers_learner_and_merge_at_once(tiny_model_dir, tiny_lm, tmp_path):
    """Readers draft from the model and statistics DBs while a learner adds to the model DB and a
    merge writes a new statistics DB: every process succeeds, every learned update is counted,
    every reader's greedy output equals plain decoding."""
    m = str(tiny_model_dir)
    mdb = tmp_path / "m.lmdb"
    statsdb.build(TEXTS, mdb, tiny_lm.tokenizer, m, min_count=1, kind="model")
    docs = [t + f" {k}" for k in ("one", "two", "red") for t in TEXTS] * 40
    shards = []
    for i in range(2):
        s = tmp_path / f"s{i}.lmdb"
        statsdb.build([d for j, d in enumerate(docs) if j % 2 == i], s, tiny_lm.tokenizer, m, shard=(i, 2))
        shards.append(s)
    stats = tmp_path / "stats.lmdb"
    statsdb.build(TEXTS, stats, tiny_lm.tokenizer, m, min_count=1)
    # the learner: one process running six `hd generate --learn` one after the other, each as a
    # process of its own would (conftest.hd_main: its DB environment closed after each), so the
    # six interpreter starts of a process per run are paid once
    learner = subprocess.Popen(
        [sys.executable, "-c", f"""
import sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from conftest import hd_main
for i in range(6):
    r = hd_main("generate", "--model", {m!r}, "-p", "the dog ran up " + str(i), "-n", "12",
                "--model-db", {str(mdb)!r}, "--learn", "--json")
    assert r.returncode == 0, r.stderr
"""])
    merger = subprocess.Popen(HD + ["merge-stats", *map(str, shards), "-o", str(tmp_path / "merged.lmdb"),
                                    "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    readers = [subprocess.Popen(
        HD + ["generate", "--model", m, "-p", f"the cat sat on the mat {i}", "-n", "16", "--model-db", str(mdb),
              "--stats-db", str(stats), "--compare", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for i in range(3)]
    for r in readers:
        out, err = r.communicate()
        assert r.returncode == 0, err[-2000:]
        assert json.loads(out)["compare"]["identical"]
    assert learner.wait() == 0
    _, err = merger.communicate()
    assert merger.returncode == 0, err[-2000:]
    pass  # the cached LMDB environment sees every committed write
    assert stores.Store(mdb).header["learned_updates"] == 6
    merged = stores.Store(tmp_path / "merged.lmdb")
    single = tmp_path / "single.lmdb"
    statsdb.build(docs, single, tiny_lm.tokenizer, m)
    assert dict(merged.items()) == dict(stores.Store(single).items())


def test_dbs_on_a_read_only_file_system_open_for_drafting(tiny_model_dir, tiny_lm, tmp_path):
    """A real read-only mount (a private mount namespace, so nothing leaks out of the test)."""
    import shutil
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    statsdb.build(TEXTS, src / "s.lmdb", tiny_lm.tokenizer, str(tiny_model_dir), min_count=1)
    statsdb.build(TEXTS, src / "m.lmdb", tiny_lm.tokenizer, str(tiny_model_dir), min_count=1, kind="model")
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare for a private read-only mount")
    gen = " ".join([sys.executable, "-m", "hdcli.cli", "generate", "--model", str(tiny_model_dir), "-p",
                    "'the cat sat on the'", "-n", "12", "--stats-db", str(mnt / "s.lmdb"), "--model-db",
                    str(mnt / "m.lmdb"), "--layers", "context,stats,model", "--compare", "--json"])
    script = (f"mount --bind {src} {mnt} && mount -o remount,ro,bind {mnt} || exit 77; "
              f"touch {mnt}/probe 2>/dev/null && exit 78; exec {gen}")
    p = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True)
    if p.returncode == 77 or "unshare failed" in p.stderr or "Operation not permitted" in p.stderr:
        pytest.skip(f"a private read-only mount is not permitted here: {p.stderr.strip()[:200]}")
    assert p.returncode == 0, p.stderr[-2000:]
    g = json.loads(p.stdout)
    assert g["compare"]["identical"] and {"stats", "model"} <= set(g["stats"]["layers"])
