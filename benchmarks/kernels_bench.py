"""torch's kernels against prepacked oneDNN linear layers (hdcli/engine/kernels/dense.py), in one process.

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
from pathlib import Path

from hdcli import api
from hdcli.engine.decode.loop import first_difference
from hdcli.engine.decode import costs
from hdcli.bench import specbench

from common import interleaved, load_questions, machine, speedups

WIDTHS = (1, 2, 4, 8, 16, 32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out")
    args = ap.parse_args()
    questions = specbench.select(load_questions(), 1)
    lms = {k: api.load_model(dtype=args.dtype, kernels=k) for k in ("torch", "onednn")}
    result = {"dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "machine": machine(), "cost": {},
              "questions": []}
    for k, lm in lms.items():
        c = costs.measure(lm.model, widths=WIDTHS)
        result["cost"][k] = {"one_token_ms": c.one_token_seconds * 1e3, "relative": c.to_dict()}
        print(k, f"one token {c.one_token_seconds * 1e3:.1f} ms", {w: round(c(w), 2) for w in WIDTHS[1:]})
        api.warm_up(lm)

    def run(lm, **kw):  # no drafter given: hd's default one
        return lambda q: api.generate(lm, prompt_ids=api.encode_prompt(lm.tokenizer, q["turns"][0]),
                                      max_new_tokens=args.max_new_tokens, **kw)

    def row(n, q, got):
        r = {"category": q["category"], "torch_tps": got["torch"].stats.tokens_per_second,
             "onednn_tps": got["onednn"].stats.tokens_per_second,
             "onednn_vs_torch_first_difference": first_difference(got["onednn"].tokens, got["torch"].tokens),
             "hd_vs_plain_first_difference": first_difference(got["hd"].tokens, got["onednn"].tokens),
             "hd_tps": got["hd"].stats.tokens_per_second}
        result["questions"].append(r)
        print(json.dumps(r))
    # plain decoding with each kernel set, then hd on the oneDNN model, interleaved per question
    runs = interleaved(questions, {"torch": run(lms["torch"], drafter=None), "onednn": run(lms["onednn"], drafter=None),
                                   "hd": run(lms["onednn"])}, on_item=row)
    tps = speedups({k: [r.stats.tokens_per_second for r in rs] for k, rs in runs.items()}, base="torch")
    qs = result["questions"]
    result["summary"] = {
        "plain_speedup_onednn_over_torch": tps["onednn"]["speedup"],
        "plain_torch_tps": tps["torch"]["tokens_per_second"],
        "plain_onednn_tps": tps["onednn"]["tokens_per_second"],
        "hd_onednn_tps": tps["hd"]["tokens_per_second"],
        "onednn_plain_differs_from_torch_plain": sum(r["onednn_vs_torch_first_difference"] is not None for r in qs),
        "hd_differs_from_plain_same_kernels": sum(r["hd_vs_plain_first_difference"] is not None for r in qs),
        "questions": len(qs),
    }
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
