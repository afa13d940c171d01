"""`hd build-stats --cluster`: shard tasks on a Dask LocalCluster give the single build's DB."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from hdcli.db import stores

pytest.importorskip("distributed")

HD = [sys.executable, "-m", "hdcli.cli"]


def hd_proc(*args):
    """`hd ARGS` in this process (conftest.hd_main); a local cluster's workers are processes all
    the same."""
    from conftest import hd_main
    return hd_main(*args)


def hd_sub(*args, **kw):
    """`hd ARGS` in a process of its own, under a timeout: where a scheduler dies under it."""
    return subprocess.run(HD + [str(a) for a in args], capture_output=True, text=True, **kw)


def corpus(tmp_path, docs=3000, files=2):
    from conftest import WORDS
    rng = random.Random(0)
    paths = []
    for f in range(files):
        p = tmp_path / f"c{f}.jsonl"
        p.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30)))})
                             + "\n" for _ in range(docs // files)))
        paths.append(p)
    return paths


def digest(path):
    return stores.Store(path).header["content_digest"]


def test_cluster_build_equals_the_single_build(tiny_model_dir, tmp_path):
    paths = corpus(tmp_path)
    m = str(tiny_model_dir)
    single = hd_proc("build-stats", *paths, "-o", tmp_path / "single.lmdb", "-m", m, "--json")
    assert single.returncode == 0, single.stderr[-2000:]
    p = hd_proc("build-stats", *paths, "-o", tmp_path / "cluster.lmdb", "-m", m, "--cluster", "local:2",
                "--tasks", "3", "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout)["header"]
    want = json.loads(single.stdout)["header"]
    assert got["content_digest"] == want["content_digest"] and got["keys"] == want["keys"]
    assert got["documents"] == want["documents"] and got["tokens"] == want["tokens"]
    assert got["cluster"]["tasks"] == 3 and got["cluster"]["workers"] == 2
    assert got["sources"] == want["sources"]
    assert stores.Store(tmp_path / "cluster.lmdb").verify()["ok"]
    assert not [x for x in tmp_path.iterdir() if ".hd-cluster-" in x.name or ".tmp-" in x.name]


def test_errors_on_the_workers_are_one_line(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a b c"}\n{"other": 1}\n')
    m = str(tiny_model_dir)
    for args, want in (([tmp_path / "missing.jsonl"], "missing.jsonl does not exist"),
                       ([bad], "bad.jsonl:2: no field 'text'")):
        p = hd_proc("build-stats", *args, "-o", tmp_path / "s.lmdb", "-m", m, "--cluster", "local:1")
        assert p.returncode == 2 and want in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert not (tmp_path / "s.lmdb").exists()
    p = hd_proc("build-stats", bad, "-o", tmp_path / "s.lmdb", "-m", m, "--cluster", "local:x")
    assert p.returncode == 2 and "local:N" in p.stderr
    p = hd_proc("build-stats", bad, "-o", tmp_path / "s.lmdb", "-m", m, "--cluster", "local:1", "--shard", "0/2")
    assert p.returncode == 2 and "drop --shard" in p.stderr


def test_a_killed_worker_is_retried_and_the_db_is_identical(tiny_model_dir, tmp_path):
    """SIGKILL one worker process while tasks run: dask runs its task again elsewhere (the nanny
    restarts the worker); the DB is the single build's, digest for digest."""
    from dask.distributed import Client, LocalCluster
    from hdcli.db import cluster as cluster_mod
    paths = [str(p) for p in corpus(tmp_path, docs=6000)]
    m = str(tiny_model_dir)
    assert hd_proc("build-stats", *paths, "-o", tmp_path / "single.lmdb", "-m", m).returncode == 0
    lc = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    try:
        address = lc.scheduler_address
        watcher = Client(address)
        killed = {}

        def kill_one_busy_worker():
            deadline = time.time() + 120
            while time.time() < deadline and not killed:
                busy = [w for w, keys in watcher.processing().items() if keys]
                if busy:
                    pids = watcher.run(os.getpid, workers=busy[:1])
                    time.sleep(0.5)  # let the task get under way
                    for pid in pids.values():
                        os.kill(pid, signal.SIGKILL)
                        killed["pid"] = pid
                time.sleep(0.1)
        t = threading.Thread(target=kill_one_busy_worker)
        t.start()
        header, _ = cluster_mod.build_stats(paths, tmp_path / "cluster.lmdb", m, address=address,
                                            tasks=4, quiet=True, min_count=2, top_k=4)
        t.join()
        watcher.close()
    finally:
        lc.close()
    assert killed, "no worker was busy: the test did not kill anything"
    assert header["content_digest"] == digest(tmp_path / "single.lmdb")


def test_a_cluster_that_goes_away_leaves_no_output(tiny_model_dir, tmp_path):
    sched = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--port", "0",
                              "--no-dashboard", "--scheduler-file", str(tmp_path / "s.json")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            if (tmp_path / "s.json").exists():
                break
            time.sleep(0.1)
        address = json.loads((tmp_path / "s.json").read_text())["address"]

        # no worker ever joins: hd's tasks wait; once they are on the scheduler (not after a fixed
        # time: a slow start would find no scheduler at all), it dies under hd's client
        def kill_once_tasks_wait():
            from distributed import Client
            with Client(address, timeout="20s") as watcher:
                for _ in range(1200):
                    if watcher.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)):
                        break
                    time.sleep(0.1)
            sched.kill()
        killer = threading.Thread(target=kill_once_tasks_wait)
        killer.start()
        paths = corpus(tmp_path, docs=200)
        p = hd_sub("build-stats", *paths, "-o", tmp_path / "s.lmdb", "-m", str(tiny_model_dir),
                   "--cluster", address, timeout=240)
        killer.join()
        assert p.returncode == 2 and "nothing was written" in p.stderr and "Traceback" not in p.stderr, \
            p.stderr[-3000:]
        assert not (tmp_path / "s.lmdb").exists()
        assert not [x for x in tmp_path.iterdir() if ".hd-cluster-" in x.name]
    finally:
        sched.kill()


def test_without_cluster_dask_is_never_imported(tiny_model_dir, tmp_path):
    paths = corpus(tmp_path, docs=50, files=1)
    code = ("import sys; from hdcli.commands import db as commands; "
            f"commands.build_stats([{str(paths[0])!r}], {str(tmp_path / 's.lmdb')!r}, {str(tiny_model_dir)!r}); "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('dask', 'distributed')], 'imported'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    info = json.loads(hd_proc("db", "info", tmp_path / "s.lmdb", "--json").stdout)
    assert info["content_digest"] == info["header"]["content_digest"] and len(info["content_digest"]) == 32
