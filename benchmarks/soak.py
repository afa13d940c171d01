"""Soak: many generations back to back in one process with every layer on.

Checks that memory stays flat (RSS at start, after warm-up and at the end) and that every greedy
output equals plain decoding (fp32). Prompts cycle through Spec-Bench questions; the model DB
learns from every generation (--learn), so it grows while being read.

    python benchmarks/soak.py --generations 200 --stats-db stats.lmdb --model-db model.lmdb \
        --out benchmarks/results/soak.json
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import tempfile
import time
from pathlib import Path

from hdcli import api
from hdcli.bench import specbench

from common import load_questions, machine


def rss_mb(kind: str = "VmRSS") -> float:
    """Resident memory in MB: VmRSS (all), RssAnon (heap: what a leak grows) or RssFile (mapped
    files: the model DB's pages count here as learning grows it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(kind + ":"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory() -> dict:
    return {k: round(rss_mb(k), 1) for k in ("VmRSS", "RssAnon", "RssFile")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--generations", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--stats-db", required=True)
    ap.add_argument("--model-db", required=True)
    ap.add_argument("--out")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    mdb_path = work / "model.lmdb"
    shutil.copy(args.model_db, mdb_path)  # learning writes to a copy
    lm = api.load_model(dtype="fp32")
    api.warm_up(lm)
    cheap = api.cheap_verification(lm)  # picks the drafting defaults (docs/dtype.md)
    sdb = api.open_stats_dbs([args.stats_db], lm)
    mdb = api.open_stats_dbs([str(mdb_path)], lm, writable=True)[0]
    qs = specbench.select(load_questions(), None)
    rss = {"start": memory()}
    differ, t0, samples = 0, time.time(), []
    for i in range(args.generations):
        ids = api.encode_prompt(lm.tokenizer, qs[(i * 37) % len(qs)]["turns"][0])
        plain = api.generate(lm, prompt_ids=ids, max_new_tokens=args.max_new_tokens, drafter=None)
        d = api.make_drafter(["context", "model", "stats"], cheap_verify=cheap, stats_stores=sdb, model_db=mdb)
        got = api.generate(lm, prompt_ids=ids, max_new_tokens=args.max_new_tokens, drafter=d)
        differ += got.tokens != plain.tokens
        api.learn(mdb, ids, got.tokens)
        if i == 9:
            rss["after_10"] = memory()
        if (i + 1) % 20 == 0:
            samples.append({"generation": i + 1, **memory()})
            print(f"{i + 1}/{args.generations}  {memory()}  differ {differ}", flush=True)
    rss["end"] = memory()
    result = {"generations": args.generations, "max_new_tokens": args.max_new_tokens, "differ_from_plain": differ,
              "rss_mb": rss, "rss_by_generation": samples, "seconds": time.time() - t0,
              "model_db_learned_updates": mdb.header.get("learned_updates"), "machine": machine()}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
