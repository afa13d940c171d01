"""The statistics DB end to end: build cost, lookup latency, and speedup on Spec-Bench.

1. build: `hd build-stats` over every jsonl under --corpora with the bundled tokenizer, in a
   subprocess so its peak memory (ru_maxrss) is its own: wall time, tokens/s, peak RSS, file size;
2. lookup: p50/p99 of Store.get over 100k keys (half taken from the corpus, half random tokens);
3. decoding: --questions Spec-Bench questions (round-robin over categories, first turn), each run
   plain, context-only and context+stats, interleaved, in one process: tokens/s, speedup over
   plain (mean of tokens/s ratios' numerator and denominator, as Spec-Bench), mean accepted
   tokens, per-layer hit/acceptance, and how many outputs differ from plain.

    python benchmarks/stats_bench.py --dtype fp32 --out benchmarks/results/stats_fp32.json
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hdcli import api
from hdcli.db import stores

from common import interleaved, load_questions, machine, round_robin, summarize


def build(corpora: str, out: Path) -> dict:
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c",
                        "import resource, sys; from hdcli.cli import main; sys.argv = sys.argv[1:]\n"
                        "try:\n    main()\nfinally:\n"
                        "    print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)",
                        "hd", "build-stats", f"{corpora}/**/*.jsonl", "-o", str(out), "--json"],
                       capture_output=True, text=True)
    wall = time.time() - t0
    if p.returncode:
        raise SystemExit(p.stderr)
    rss = int(p.stderr.rsplit("MAXRSS", 1)[1].split()[0])
    h = json.loads(p.stdout)["header"]
    return {"wall_seconds": wall, "tokens": h["tokens"], "documents": h["documents"],
            "tokens_per_second": h["tokens"] / wall, "peak_rss_mb": rss / 1024,
            "file_mb": out.stat().st_size / 1e6, "keys": h["keys"], "continuations": h["continuations"]}


def lookups(db: stores.Store, n: int = 100_000) -> dict:
    rng = random.Random(0)
    present = []
    for i, (k, _) in enumerate(db.items()):
        if i % 7 == 0:
            present.append([int.from_bytes(k[j:j + 4], "little") for j in range(0, len(k), 4)])
        if len(present) >= n // 2:
            break
    vocab = 49152
    keys = present + [[rng.randrange(vocab) for _ in range(rng.randint(1, db.max_n))]
                      for _ in range(n - len(present))]
    rng.shuffle(keys)
    times = []
    hits = 0
    for k in keys:
        t = time.perf_counter_ns()
        got = db.get(k)
        times.append(time.perf_counter_ns() - t)
        hits += got is not None
    times.sort()
    return {"queries": len(keys), "hits": hits, "p50_us": times[len(times) // 2] / 1000,
            "p99_us": times[int(len(times) * 0.99)] / 1000}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpora", default="../shared/corpora")
    ap.add_argument("--spec-bench", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--db", help="use this DB instead of building one")
    ap.add_argument("--out")
    args = ap.parse_args()
    result = {"dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "machine": machine()}
    tmp = Path(tempfile.mkdtemp())
    db_path = Path(args.db) if args.db else tmp / "stats.lmdb"
    if not args.db:
        result["build"] = build(args.corpora, db_path)
        print("build", json.dumps(result["build"]))
    db = stores.Store(db_path)
    result["lookup"] = lookups(db)
    print("lookup", json.dumps(result["lookup"]))

    lm = api.load_model(dtype=args.dtype)
    api.warm_up(lm)
    cheap = api.cheap_verification(lm)  # picks the drafting defaults (docs/dtype.md)
    dbs = api.open_stats_dbs([str(db_path)], lm)
    methods = {"plain": lambda: None,
               "context": lambda: api.make_drafter(["context"], cheap_verify=cheap),
               "context+stats": lambda: api.make_drafter(["context", "stats"], cheap_verify=cheap, stats_stores=dbs)}

    def run(make):
        return lambda ids: api.generate(lm, prompt_ids=ids, max_new_tokens=args.max_new_tokens, drafter=make())
    qs = round_robin(load_questions(args.spec_bench), args.questions, key="subcategory")
    runs = interleaved([api.encode_prompt(lm.tokenizer, q["turns"][0]) for q in qs],
                       {m: run(make) for m, make in methods.items()})
    result["methods"] = summarize(runs)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
