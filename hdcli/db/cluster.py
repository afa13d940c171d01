"""Statistics DBs built as tasks of a Dask cluster (`hd build-stats ... --cluster ADDRESS`).

A map-reduce over the engine's workers, with the counting code of a local build (hdcli/db/statsdb.py):
  map     task i of N reads the corpus where the worker is (paths, globs, fsspec URLs), keeps the
          documents whose index % N == i, tokenises and counts them, and splits the summed partial
          counts by key hash into P partitions (the same split as a local build's spill files);
  reduce  task p of P sums partition p of every map task and prunes it to top-K, exactly as a
          local build does, and returns that partition's finished records;
  write   the client puts each partition's records into OUT's temporary LMDB as it arrives; the
          commit copies it in key order into packed pages and computes the content digest.

Invariants
  * the DB equals the single-process build of the same corpus record for record (same content
    digest, tested), whatever N and P: counts are sums, and every key's rows meet in one reducer;
  * no process holds the corpus's keys: a map task holds its shard's partial counts, a reducer one
    partition (1/P of the keys), the client one partition's records at a time;
  * a task whose worker dies is run again by the scheduler (RETRIES); the result is the same;
  * OUT appears only complete (StoreWriter renames it into place); a user error on a worker (a
    missing file, a malformed record with --strict) comes back as one line; a cluster that goes away
    or Ctrl-C leaves no OUT and says so in one line;
  * without --cluster none of this is imported.

ADDRESS is `local:N` (a LocalCluster of N single-threaded worker processes on this machine) or a
running scheduler (`tcp://host:8786`); dask-jobqueue or dask-kubernetes start those on real clusters.
"""
from __future__ import annotations

import logging
import os
import pickle
import time
from pathlib import Path
from typing import Sequence

from ..errors import HdError
from . import corpus as corpus_mod
from . import statsdb
from ..engine import loader
from . import atomic

RETRIES = 2  # a task whose worker died is run again this many times (dask reschedules it)


def _peak_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _map_task(corpus: Sequence[str], model: str, shard: tuple[int, int], partitions: int,
              read_opts: dict, count_opts: dict) -> dict:
    """Run on a worker: shard i/N counted and split into partitions. A user's error comes back as
    a value, not an exception: running it again would fail the same way, and the worker would log
    a traceback for it."""
    try:
        texts, report = corpus_mod.read_corpus(list(corpus), shard=shard, **read_opts)
        tok = loader.load_tokenizer(model)
        chunks = statsdb._token_chunks(texts, tok, statsdb.CHUNK_TOKENS,
                                       overlap=(count_opts["max_n"] - 1, count_opts["draft_len"]))
        parts, n_docs, n_tokens = statsdb.count_partitions(chunks, partitions, **count_opts)
    except HdError as exc:
        return {"error": str(exc)}
    return {"parts": parts, "documents": n_docs, "tokens": n_tokens, "read": report.counts(),
            "sources": report.files, "peak_rss_mb": _peak_rss_mb()}


def _summary(result: dict) -> dict:
    """A map result without its counts (what the client needs to know)."""
    return {k: v for k, v in result.items() if k != "parts"}


def _piece(result: dict, q: int):
    """Partition q of a map result (runs where the map result is: no needless transfer)."""
    return result["parts"][q] if "parts" in result else None


def _reduce_task(q: int, pieces: list, count_opts: dict, prune: dict) -> dict:
    records = statsdb.select_partition(pieces, draft_len=count_opts["draft_len"], **prune)
    # one pickled blob: dask serialises a list element by element, which made moving 650k
    # records to the client take minutes instead of a second
    return {"partition": q, "records": pickle.dumps(records, protocol=5), "peak_rss_mb": _peak_rss_mb()}


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
                partitions: int | None = None, overwrite: bool = False, quiet: bool = False,
                field: str = "text", with_prompt: bool = False, strict: bool = False, min_n: int = 1,
                max_n: int = 4, draft_len: int = 1, top_k: int = 4, min_count: int = 2) -> tuple[dict, dict]:
    """The statistics DB of `corpus` at `out`, counted by the tasks of a Dask cluster. Returns
    (header, read report) like commands.build_stats; the header adds `cluster` (tasks, partitions,
    workers, seconds and peak memory per phase)."""
    atomic.check_output_path(Path(out), overwrite)
    statsdb.check_params(min_n, max_n, draft_len, top_k, min_count)
    tok = loader.load_tokenizer(model)  # here too: the header's fingerprint, and a bad name fails fast
    t0 = time.time()
    client, cluster = connect(address)
    try:
        workers = len(client.scheduler_info().get("workers", {})) or 1
        n = tasks or 2 * workers
        p = partitions or n
        if n < 1 or p < 1:
            raise HdError(f"--tasks must be >= 1, not {n}")
        count_opts = dict(min_n=min_n, max_n=max_n, draft_len=draft_len)
        prune = dict(top_k=top_k, min_count=min_count)
        futures = _submit(client, list(corpus), model, n, p, dict(field=field, with_prompt=with_prompt,
                                                                  strict=strict), count_opts, prune)
        with atomic.writing(out, overwrite=overwrite) as writer:
            got = _collect(futures, writer, n, p, workers, draft_len, t0, quiet, f"the cluster at {address}", out)
            done = got["maps"]
            documents = sum(x["documents"] for x in done)
            read = done[0]["read"]  # every map task read every file, so each counted the same
            if documents == 0:
                raise corpus_mod.no_documents(done[0]["sources"], corpus, field, read)
            cluster_info = {"address": address, "workers": workers, "tasks": n, "partitions": p,
                            "count_seconds": round(got["counted"] or 0.0, 2),
                            "map_peak_rss_mb": round(got["peak_map"], 1),
                            "reduce_peak_rss_mb": round(got["peak_reduce"], 1)}
            header = writer.commit(statsdb.header_for(
                kind="stats", model_name=model, tokenizer=tok, shard=(0, 1), documents=documents,
                tokens=sum(x["tokens"] for x in done), continuations=got["pairs"], seconds=time.time() - t0,
                extra={"sources": done[0]["sources"], "field": field, "with_prompt": with_prompt,
                       "cluster": cluster_info}, **count_opts, **prune))
        header["cluster"]["client_peak_rss_mb"] = round(_peak_rss_mb(), 1)  # reported, not stored
        return header, read
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def _submit(client, corpus: list[str], model: str, n: int, p: int, read_opts: dict, count_opts: dict,
            prune: dict) -> list:
    """The build's task graph: n map tasks, a summary of each (what it read), and p reduce tasks
    each fed its partition's piece of every map result. Returns the futures to collect."""
    tag = f"{os.getpid()}-{time.time()}"
    maps = [client.submit(_map_task, corpus, model, (i, n), p, read_opts, count_opts,
                          retries=RETRIES, pure=False, key=f"hd-map-{i}-of-{n}-{tag}") for i in range(n)]
    summaries = [client.submit(_summary, m, key=f"hd-summary-{i}-{tag}") for i, m in enumerate(maps)]
    reduces = [client.submit(_reduce_task, q,
                             [client.submit(_piece, m, q, key=f"hd-piece-{i}-{q}-{tag}")
                              for i, m in enumerate(maps)],
                             count_opts, prune, retries=RETRIES, key=f"hd-reduce-{q}-of-{p}-{tag}")
               for q in range(p)]
    return summaries + reduces


def _collect(futures: list, writer, n: int, p: int, workers: int, draft_len: int, t0: float,
             quiet: bool, where: str, out) -> dict:
    """Write each reduce task's records as it finishes (keys are disjoint across partitions) and
    gather the map summaries; any task's error, or the cluster failing, is one HdError."""
    from dask.distributed import as_completed
    from ..engine.progress import bar as progress_bar
    got = {"maps": [], "pairs": 0, "peak_map": 0.0, "peak_reduce": 0.0, "counted": None}
    bar = progress_bar(total=n + p, unit=" task", desc=f"map {n} + reduce {p} on {workers} workers",
                       disable=quiet, mininterval=0.5)
    try:
        for fut in as_completed(futures):
            r = fut.result()
            fut.release()
            if "error" in r:
                raise HdError(r["error"])
            if "records" in r:
                records = pickle.loads(r["records"])
                for k, v in records:
                    writer.put(k, v)
                got["pairs"] += sum((len(v) // 4 - 1) // (draft_len + 2) for _, v in records)
                got["peak_reduce"] = max(got["peak_reduce"], r["peak_rss_mb"])
            else:
                got["maps"].append(r)
                got["peak_map"] = max(got["peak_map"], r["peak_rss_mb"])
                if len(got["maps"]) == n:
                    got["counted"] = time.time() - t0
                    bar.set_description(f"reduce {p} on {workers} workers")
            bar.update(1)
            bar.set_postfix(tokens=sum(x["tokens"] for x in got["maps"]), refresh=False)
    except HdError:
        raise
    except Exception as exc:  # noqa: BLE001 - scheduler gone, workers lost for good, ...
        detail = str(exc).splitlines()[0] if str(exc) else "no detail"
        raise HdError(f"{where} failed mid-build ({type(exc).__name__}: {detail}): nothing was "
                      f"written to {out}") from None
    finally:
        bar.close()
    return got
