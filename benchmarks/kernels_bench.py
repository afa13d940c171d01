"""torch's kernels against prepacked oneDNN linear layers (hdcli/kernels.py), in one process.

For the given dtype, loads the bundled model twice (--kernels torch, --kernels onednn) and reports:
  1. forward cost by width (costs.measure): one-token ms and cost(w) / cost(1);
  2. plain greedy decoding of the first question of every Spec-Bench category with each, runs
     interleaved: tokens/s, the speedup of oneDNN over torch, and whether the two outputs are
     identical (they are the same model up to float rounding; where an argmax is a near-tie the
     rounding can flip it, and this counts how often that happened);
  3. hd (default drafter) on the oneDNN model against plain decoding on the same model: identical?

    python benchmarks/kernels_bench.py --dtype fp32 --out benchmarks/results/kernels_fp32.json
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from hdcli import api, costs, specbench

WIDTHS = (1, 2, 4, 8, 16, 32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out")
    args = ap.parse_args()
    questions = specbench.select(specbench.load(specbench.find(None)), 1)
    lms = {k: api.load_model(dtype=args.dtype, kernels=k) for k in ("torch", "onednn")}
    result = {"dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "cost": {}, "questions": []}
    for k, lm in lms.items():
        c = costs.measure(lm.model, widths=WIDTHS)
        result["cost"][k] = {"one_token_ms": c.one_token_seconds * 1e3, "relative": c.to_dict()}
        print(k, f"one token {c.one_token_seconds * 1e3:.1f} ms", {w: round(c(w), 2) for w in WIDTHS[1:]})
        api.warm_up(lm)
    for q in questions:
        row = {"category": q["category"]}
        outs = {}
        for k, lm in lms.items():
            ids = api.encode_prompt(lm.tokenizer, q["turns"][0])
            r = api.generate(lm, prompt_ids=ids, max_new_tokens=args.max_new_tokens, drafter=None)
            outs[k] = r.tokens
            row[f"{k}_tps"] = r.stats.tokens_per_second
        lm = lms["onednn"]
        spec = api.generate(lm, prompt_ids=api.encode_prompt(lm.tokenizer, q["turns"][0]),
                            max_new_tokens=args.max_new_tokens)
        row["onednn_vs_torch_first_difference"] = api.first_difference(outs["onednn"], outs["torch"])
        row["hd_vs_plain_first_difference"] = api.first_difference(spec.tokens, outs["onednn"])
        row["hd_tps"] = spec.stats.tokens_per_second
        result["questions"].append(row)
        print(json.dumps(row))
    qs = result["questions"]
    result["summary"] = {
        "plain_speedup_onednn_over_torch": statistics.mean(r["onednn_tps"] for r in qs)
        / statistics.mean(r["torch_tps"] for r in qs),
        "plain_torch_tps": statistics.mean(r["torch_tps"] for r in qs),
        "plain_onednn_tps": statistics.mean(r["onednn_tps"] for r in qs),
        "hd_onednn_tps": statistics.mean(r["hd_tps"] for r in qs),
        "onednn_plain_differs_from_torch_plain": sum(r["onednn_vs_torch_first_difference"] is not None for r in qs),
        "hd_differs_from_plain_same_kernels": sum(r["hd_vs_plain_first_difference"] is not None for r in qs),
        "questions": len(qs),
    }
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
