"""Is the forward M-invariant, and what does the invariant mode cost? (docs/dtype.md)

For one model, dtype and kernel set, in one process:
  rows       per-row bit-equality (torch.equal) of a k-token verification forward against the
             same tokens' one-token forwards, for chains of k = 2, 3, 4, 8, 16, 32 and for token
             trees of 6, 17 and 33 nodes, after a 70-token cached prefix: stock forward vs the
             M-invariant one (hdcli/engine/kernels/invariant.py);
  linear     each Linear shape's calibrated minimum row count (1: rows agree for every M);
  cost       the least time of a forward over w = 1..64 tokens on a 256-token cache, stock vs
             invariant, interleaved rounds (engine/decode/costs.py's measurement);
  decode     plain greedy decoding tokens/s, stock forward vs invariant vs transformers'
             generate on the stock model, and how many answers differ between them (first
             question of each Spec-Bench category, 128 new tokens, interleaved).

    python benchmarks/invariance.py --dtype fp32 --out benchmarks/results/invariance_fp32.json
    python benchmarks/invariance.py --dtype bf16 --out benchmarks/results/invariance_bf16.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from hdcli import api
from hdcli.bench.baselines import hf_generate, stock_model
from hdcli.engine.decode.loop import first_difference
from hdcli.engine.decode import costs
from hdcli.engine.decode.tree import Tree
from hdcli.engine.decode import calibrate

from common import first_per_subcategory, load_questions, machine

WIDTHS = (1, 2, 4, 8, 16, 32, 64)


def rows_equal(model, tree: Tree, prefix: list[int]) -> tuple[int, int, float]:
    """(rows equal to their one-token forward, rows, max |difference|)."""
    rows = calibrate.compare_rows(model, tree, prefix)
    return sum(eq for eq, _ in rows), len(rows), max(diff for _, diff in rows)


def shapes(vocab: int, rng: random.Random) -> dict[str, Tree]:
    out = {}
    for k in (2, 3, 4, 8, 16, 32):
        t = Tree()
        t.add_candidate([rng.randrange(3, vocab) for _ in range(k - 1)], "x")
        out[f"chain {k}"] = t
    for n in (6, 17, 33):
        t = Tree()
        while len(t.tokens) < n:
            t.add(rng.randrange(len(t.tokens)), rng.randrange(3, vocab), "x")
        out[f"tree {n}"] = t
    return out


def row_table(model, vocab: int) -> dict:
    rng = random.Random(0)
    prefix = [rng.randrange(3, vocab) for _ in range(70)]
    out = {}
    for name, tree in shapes(vocab, rng).items():
        eq, n, worst = rows_equal(model, tree, prefix)
        out[name] = {"equal": eq, "rows": n, "max_abs_diff": worst}
        print(f"  {name:9s} {eq}/{n} rows equal, max |diff| {worst:.3g}", file=sys.stderr, flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--spec-bench", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--out")
    args = ap.parse_args()
    lm = api.load_model(dtype=args.dtype, kernels=args.kernels, invariant="on")
    m, vocab = lm.model, lm.model.config.vocab_size
    key = costs.curve_key(lm.source, lm.dtype, lm.device, lm.kernels)
    result = {"machine": machine(), "dtype": lm.dtype, "kernels": lm.kernels,
              "linear_min_rows": lm.info["invariant"]["linear_min_rows"], "rows": {}, "cost": {}}

    def mode(on: bool):
        if on:
            calibrate.enable(m, cache_key=key)
        else:
            calibrate.disable(m)

    for name, on in (("stock", False), ("invariant", True)):
        print(f"{name} forward:", file=sys.stderr)
        mode(on)
        result["rows"][name] = row_table(m, vocab)
    best = {"stock": {}, "invariant": {}}
    for r in range(3):  # interleaved: each round times both forwards
        for name, on in (("stock", False), ("invariant", True)):
            mode(on)
            sec = costs.measure_seconds(m, rounds=3, widths=WIDTHS, quiet=True)
            for w, t in sec.items():
                best[name][w] = min(best[name].get(w, t), t)
    for name, sec in best.items():
        result["cost"][name] = {"one_token_ms": 1e3 * sec[1], "cost": {str(w): sec[w] / sec[1] for w in WIDTHS},
                                "ms": {str(w): 1e3 * sec[w] for w in WIDTHS}}
        print(f"{name:9s} " + "  ".join(f"w{w} {1e3 * sec[w]:.1f} ms" for w in WIDTHS), file=sys.stderr)
    result["decode"] = decode_table(lm, key, mode, args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("dtype", "kernels", "decode")}, indent=1))


def decode_table(lm, key, mode, args) -> dict:
    questions = first_per_subcategory(load_questions(args.spec_bench), 1)
    stock = stock_model(lm)
    n = args.max_new_tokens
    tps = {"stock": [], "invariant": [], "transformers": []}
    outs = {k: [] for k in tps}
    for i, q in enumerate(questions):
        ids = api.encode_prompt(lm.tokenizer, q["turns"][0])
        for name in ("stock", "invariant"):
            mode(name == "invariant")
            r = api.generate(lm, prompt_ids=ids, max_new_tokens=n, drafter=None)
            tps[name].append(r.stats.tokens_per_second)
            outs[name].append(r.tokens)
        toks, sec = hf_generate(stock, ids, n)
        tps["transformers"].append(len(toks) / sec)
        outs["transformers"].append(toks)
        print(f"  {i + 1}/{len(questions)} " + "  ".join(f"{k} {v[-1]:.1f}" for k, v in tps.items()),
              file=sys.stderr, flush=True)
    mode(True)
    diff = {f"{a}_vs_{b}": sum(first_difference(x, y) is not None for x, y in zip(outs[a], outs[b]))
            for a, b in (("invariant", "stock"), ("invariant", "transformers"), ("stock", "transformers"))}
    return {"questions": len(questions), "new_tokens": n,
            "tokens_per_second": {k: statistics.mean(v) for k, v in tps.items()},
            "answers_differing": diff}


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"{time.time() - t0:.0f} s", file=sys.stderr)
