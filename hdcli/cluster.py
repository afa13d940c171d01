"""Statistics DBs built as tasks of a Dask cluster (`hd build-stats ... --cluster ADDRESS`).

The job is the hand-run map-reduce of `--shard i/N` + `merge-stats`, run by an existing engine:
  map     task i of N (on any worker) reads the corpus where the worker is, keeps documents whose
          index % N == i, counts them unpruned into a shard DB in the worker's temp folder and
          returns its bytes (no shared disk needed); the scheduler retries a task whose worker died;
  reduce  the client writes each shard to a temporary folder beside OUT as it arrives, then
          `statsdb.merge` streams a k-way merge of the sorted shard files into OUT, pruning once.

Invariants
  * the result equals the single-process build of the same corpus record for record (same
    content digest): counts are sums, and merging all shards of one build is exact (tested);
  * the merge holds one key's continuations at a time, never the corpus's keys: its memory is the
    LMDB pages the OS maps in, whatever the corpus size; peak client memory is one shard's bytes
    while it is written out;
  * OUT appears only complete (StoreWriter renames it into place); a cluster that goes away, a task
    that fails for good or Ctrl-C leaves no OUT and no shard files, and says so in one line;
  * without --cluster none of this is imported.

ADDRESS is `local:N` (a LocalCluster of N single-threaded worker processes on this machine) or a
running scheduler (`tcp://host:8786`); dask-jobqueue or dask-kubernetes start those on real clusters.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Sequence

from .errors import HdError

RETRIES = 2  # a task whose worker died is run again this many times (dask reschedules it)


def _shard_task(corpus: Sequence[str], model: str, shard: tuple[int, int], opts: dict) -> dict:
    """Run on a worker: one unpruned shard DB, returned as bytes with its read report. A user's
    error (a missing file, a bad record) comes back as a value, not an exception: running it again
    would fail the same way, and the worker would log a traceback for it."""
    import resource
    from . import api
    folder = Path(tempfile.mkdtemp(prefix="hd-shard-"))
    try:
        out = folder / f"s{shard[0]}.lmdb"
        try:
            header, read = api.build_stats(corpus, out, model, shard=shard, **opts)
        except HdError as exc:
            return {"shard": shard, "error": str(exc)}
        return {"shard": shard, "header": header, "read": read, "bytes": out.read_bytes(),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "worker_pid": os.getpid()}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def connect(address: str):
    """A dask Client for ADDRESS, and the LocalCluster to close after (None for a remote one)."""
    try:
        from dask.distributed import Client, LocalCluster
    except ImportError:
        raise HdError("--cluster needs Dask: pip install 'dask[distributed]'") from None
    # dask logs a lost scheduler or a failed task with a traceback; hd says it in one line
    for name in ["distributed"] + [n for n in logging.root.manager.loggerDict if n.startswith("distributed.")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if address.startswith("local:"):
        try:
            n = int(address[len("local:"):])
        except ValueError:
            n = 0
        if n < 1:
            raise HdError(f"--cluster {address}: local:N needs a number of workers N >= 1")
        cluster = LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                               dashboard_address=None, silence_logs=logging.ERROR)
        return Client(cluster), cluster
    try:
        return Client(address, timeout="20s"), None
    except (OSError, TimeoutError, ValueError) as exc:
        raise HdError(f"cannot reach the Dask scheduler at {address} ({str(exc).splitlines()[0]}): "
                      "start one (`dask scheduler`) or pass local:N") from None


def build_stats(corpus: Sequence[str], out, model: str, *, address: str, tasks: int | None = None,
                overwrite: bool = False, quiet: bool = False, field: str = "text",
                with_prompt: bool = False, strict: bool = False, **params) -> tuple[dict, dict]:
    """The statistics DB of `corpus` at `out`, counted by the tasks of a Dask cluster. Returns
    (header, read report) like api.build_stats; the header adds `cluster` (tasks, workers, time
    and peak memory per phase)."""
    from tqdm import tqdm
    from . import stores, statsdb
    out = Path(out)
    stores.check_output_path(out)
    if out.exists() and not overwrite:
        raise HdError(f"{out} already exists: pass --overwrite to replace it")
    t0 = time.time()
    client, cluster = connect(address)
    stores.sweep_stale(out.parent, ".hd-cluster-")
    folder = Path(tempfile.mkdtemp(prefix=f".hd-cluster-{os.getpid()}-", dir=out.parent))
    try:
        workers = len(client.scheduler_info().get("workers", {})) or 1
        n = tasks or 2 * workers
        if n < 1:
            raise HdError(f"--tasks must be >= 1, not {n}")
        opts = dict(field=field, with_prompt=with_prompt, strict=strict, **params)
        bar = tqdm(total=n + 1, unit=" task", desc=f"counting on {workers} workers", disable=quiet,
                   mininterval=0.5)
        futures = [client.submit(_shard_task, list(corpus), model, (i, n), opts, retries=RETRIES,
                                 pure=False, key=f"hd-shard-{i}-of-{n}-{os.getpid()}-{t0}")
                   for i in range(n)]
        from dask.distributed import as_completed
        paths, results = [], []
        try:
            for fut in as_completed(futures):
                r = fut.result()
                if "error" in r:
                    raise HdError(r["error"])
                path = folder / f"s{r['shard'][0]}.lmdb"
                path.write_bytes(r.pop("bytes"))
                paths.append(path)
                results.append(r)
                fut.release()
                bar.update(1)
                bar.set_postfix(tokens=sum(x["header"]["tokens"] for x in results), refresh=False)
        except HdError:
            raise
        except Exception as exc:  # noqa: BLE001 - scheduler gone, workers lost for good, ...
            raise HdError(f"the cluster at {address} failed mid-build ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}): nothing was "
                          f"written to {out}") from None
        counted = time.time() - t0
        bar.set_description("merging shards")
        paths.sort(key=lambda p: int(p.stem[1:]))
        header = statsdb.merge(paths, out, top_k=params.get("top_k", statsdb.DEFAULTS["top_k"]),
                               min_count=params.get("min_count", statsdb.DEFAULTS["min_count"]),
                               overwrite=overwrite, extra_header={
                                   "field": field, "with_prompt": with_prompt,
                                   "merged_from": f"{n} shard tasks on {address}",
                                   "cluster": {"address": address, "workers": workers, "tasks": n,
                                               "count_seconds": round(counted, 2),
                                               "task_peak_rss_mb": round(max(r["peak_rss_mb"] for r in results), 1)}})
        bar.update(1)
        bar.close()
        header["cluster"]["merge_seconds"] = round(time.time() - t0 - counted, 2)  # not in the file
        return header, results[0]["read"]  # every task read every file, so each counted the same
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        client.close()
        if cluster is not None:
            cluster.close()
