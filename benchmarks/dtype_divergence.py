"""Does speculative output equal plain decoding in this dtype? And what does each dtype cost?

For the first question of every Spec-Bench category, runs plain decoding and hd (context DB) in the
given dtype, both greedy, and reports per prompt: identical or the first differing token, tokens/s
of each, and the speedup. fp32 should show no difference at all; bf16 shows where rounding of
multi-token forwards first flips an argmax.

    python benchmarks/dtype_divergence.py --dtype bf16 --out benchmarks/results/divergence_bf16.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from hdcli import api
from hdcli.engine.decode.loop import first_difference

from common import first_per_subcategory, interleaved, load_questions, machine, speedups


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--spec-bench", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out")
    args = ap.parse_args()
    questions = first_per_subcategory(load_questions(args.spec_bench), 1)
    lm = api.load_model(dtype=args.dtype)
    api.warm_up(lm)
    rows = []

    def run(**kw):  # no drafter given: hd's default one
        return lambda q: api.generate(lm, prompt_ids=api.encode_prompt(lm.tokenizer, q["turns"][0]),
                                      max_new_tokens=args.max_new_tokens, **kw)

    def row(n, q, got):
        plain, spec = got["plain"], got["hd"]
        diff = first_difference(spec.tokens, plain.tokens)
        rows.append({"category": q["subcategory"], "new_tokens": len(plain.tokens), "first_difference": diff,
                     "plain_tps": plain.stats.tokens_per_second, "hd_tps": spec.stats.tokens_per_second,
                     "speedup": spec.stats.tokens_per_second / plain.stats.tokens_per_second,
                     "mean_accepted": spec.stats.mean_accepted})
        print(f"{q['subcategory']:16s} {'identical' if diff is None else f'differs at token {diff}':>22s}  "
              f"plain {rows[-1]['plain_tps']:5.1f} tok/s  hd {rows[-1]['hd_tps']:5.1f} tok/s  "
              f"{rows[-1]['speedup']:.2f}x  accepted {spec.stats.mean_accepted:.2f}")
    runs = interleaved(questions, {"plain": run(drafter=None), "hd": run()}, on_item=row)
    tps = speedups({m: [r.stats.tokens_per_second for r in rs] for m, rs in runs.items()})
    same = sum(r["first_difference"] is None for r in rows)
    summary = {"dtype": lm.dtype, "prompts": len(rows), "identical": same,
               "mean_plain_tps": tps["plain"]["tokens_per_second"],
               "mean_speedup": tps["hd"]["speedup"],
               "first_differences": [r["first_difference"] for r in rows if r["first_difference"] is not None]}
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "machine": machine(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
