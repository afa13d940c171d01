"""The model DB end to end: sampling throughput by batch size, build time, and speedup.

    # 1. tokens/s of batched sampling for batch sizes 1, 4, 8, 16 (same prompts, same settings)
    python benchmarks/model_db_bench.py throughput --dtype bf16
    # 2. decoding on Spec-Bench questions with context / +model / +model+stats, in one run
    python benchmarks/model_db_bench.py decode --model-db model.lmdb --stats-db stats.lmdb --dtype fp32

The model DB itself is built with the CLI, timed by the shell (the exact command is in
docs/benchmarks.md), from prompts that are not Spec-Bench questions.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from hdcli import api
from hdcli.db import modeldb

from common import interleaved, load_questions, machine, round_robin, summarize


def throughput(args) -> dict:
    lm = api.load_model(dtype=args.dtype)
    prompts, _ = modeldb.load_prompts(None, args.prompts)
    rows = {}
    for bs in args.batch_sizes:
        with tempfile.TemporaryDirectory() as d:
            r = modeldb.sample(lm, prompts, Path(d) / "s.jsonl", max_new_tokens=args.max_new_tokens,
                               batch_size=bs, temperature=0.8, seed=0)
        rows[bs] = {"tokens_per_second": r["tokens_per_second"], "new_tokens": r["new_tokens"],
                    "seconds": r["seconds"]}
        print(f"batch {bs:3d}: {r['tokens_per_second']:7.1f} tok/s ({r['new_tokens']} tokens in {r['seconds']:.1f}s)")
    return {"dtype": lm.dtype, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "machine": machine(), "batch": rows}


def decode(args) -> dict:
    lm = api.load_model(dtype=args.dtype)
    api.warm_up(lm)
    cheap = api.cheap_verification(lm)  # picks the drafting defaults (docs/dtype.md)
    mdb = api.open_stats_dbs([args.model_db], lm)[0]
    sdbs = api.open_stats_dbs([args.stats_db], lm) if args.stats_db else []
    methods = {"plain": None, "context": ["context"], "context+model": ["context", "model"]}
    if sdbs:
        methods["context+model+stats"] = ["context", "model", "stats"]

    def run(layers):
        def one(ids):
            d = api.make_drafter(layers, cheap_verify=cheap, model_db=mdb, stats_stores=sdbs) if layers else None
            return api.generate(lm, prompt_ids=ids, max_new_tokens=args.max_new_tokens, drafter=d)
        return one
    qs = round_robin(load_questions(args.spec_bench), args.questions, key="subcategory")
    runs = interleaved([api.encode_prompt(lm.tokenizer, q["turns"][0]) for q in qs],
                       {m: run(layers) for m, layers in methods.items()})
    return {"dtype": lm.dtype, "questions": args.questions, "max_new_tokens": args.max_new_tokens,
            "machine": machine(), "methods": summarize(runs)}


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--dtype", default="bf16")
    t.add_argument("--prompts", type=int, default=16)
    t.add_argument("--max-new-tokens", type=int, default=128)
    t.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 4, 8, 16])
    d = sub.add_parser("decode")
    d.add_argument("--model-db", required=True)
    d.add_argument("--stats-db")
    d.add_argument("--dtype", default="fp32")
    d.add_argument("--spec-bench", default="../shared/data/spec_bench/question.jsonl")
    d.add_argument("--questions", type=int, default=20)
    d.add_argument("--max-new-tokens", type=int, default=128)
    for p in (t, d):
        p.add_argument("--out")
    args = ap.parse_args()
    result = throughput(args) if args.what == "throughput" else decode(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
