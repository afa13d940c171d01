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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hdcli import api, stores


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


def questions(path: str, count: int) -> list[dict]:
    by_cat = {}
    for line in open(path):
        q = json.loads(line)
        by_cat.setdefault(q["category"], []).append(q)
    out, i = [], 0
    while len(out) < count:
        for cat in sorted(by_cat):
            if i < len(by_cat[cat]) and len(out) < count:
                out.append(by_cat[cat][i])
        i += 1
    return out


def summarize(runs: dict) -> dict:
    """runs: method -> list of api.Result, one per question, "plain" among them. Prints a line per
    method and returns Spec-Bench's figures: speedup = mean tokens/s / mean plain tokens/s, mean
    accepted tokens pooled over all steps, per-layer totals, and outputs differing from plain."""
    plain_tps = statistics.mean(r.stats.tokens_per_second for r in runs["plain"])
    out = {}
    for m, rs in runs.items():
        layers = {}
        for r in rs:
            for name, ls in r.stats.layers.items():
                agg = layers.setdefault(name, {"queries": 0, "hits": 0, "drafted": 0, "accepted": 0})
                for f in agg:
                    agg[f] += getattr(ls, f)
        for v in layers.values():
            v["hit_rate"] = v["hits"] / max(1, v["queries"])
            v["acceptance_rate"] = v["accepted"] / max(1, v["drafted"])
        steps = [a for r in rs for a in r.stats.accept_lengths]
        tps = statistics.mean(r.stats.tokens_per_second for r in rs)
        out[m] = {"tokens_per_second": tps, "speedup": tps / plain_tps,
                  "mean_accepted_tokens": sum(steps) / len(steps),
                  "differ_from_plain": sum(r.tokens != p.tokens for r, p in zip(rs, runs["plain"])),
                  "layers": layers}
        print(f"{m:20s} {tps:6.1f} tok/s  {tps / plain_tps:5.2f}x  mean accepted {out[m]['mean_accepted_tokens']:.2f}"
              f"  differ {out[m]['differ_from_plain']}/{len(rs)}  " +
              "  ".join(f"{k}: hit {v['hit_rate']:.0%} acc {v['acceptance_rate']:.0%}" for k, v in layers.items()))
    return out


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
    result = {"dtype": args.dtype, "max_new_tokens": args.max_new_tokens}
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
               "context+stats": lambda: api.make_drafter(["context", "stats"], cheap_verify=cheap, stats_dbs=dbs)}
    runs = {m: [] for m in methods}
    for q in questions(args.spec_bench, args.questions):
        ids = api.encode_prompt(lm.tokenizer, q["turns"][0])
        for m, make in methods.items():
            runs[m].append(api.generate(lm, prompt_ids=ids, max_new_tokens=args.max_new_tokens, drafter=make()))
    result["methods"] = summarize(runs)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
