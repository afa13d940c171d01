"""hd's context layer against plain decoding and transformers' prompt lookup, in one process.

For each prompt and repeat, runs interleaved (so machine drift hits all methods alike):
  plain    our decode loop without drafts (the baseline: same model, same KV cache handling)
  hd       our decode loop with the context DB
  hf       transformers generate(), greedy
  hf-pld   transformers generate(prompt_lookup_num_tokens=10), greedy
and reports median tokens/s, speedup over `plain`, mean accepted tokens and whether each output is
token-for-token identical to `plain` (first differing index otherwise).

    python benchmarks/generate_compare.py --dtype bf16 --out benchmarks/results/compare_bf16.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hdcli import api
from hdcli.compose import default_min_n
from hdcli.engine.decode.loop import first_difference

from common import interleaved, machine, speedups

HERE = Path(__file__).parent


def hf_generate(lm, ids, max_new_tokens, **kw):
    inp = torch.tensor([ids], device=lm.device)
    t0 = time.perf_counter()
    out = lm.model.module.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_new_tokens,
                                   do_sample=False, pad_token_id=lm.tokenizer.pad_token_id, **kw)
    wall = time.perf_counter() - t0
    toks = out[0, len(ids):].tolist()
    return toks, len(toks) / wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--prompts", nargs="*", default=[str(HERE / "prompts/summarize.txt"),
                                                     str(HERE / "prompts/code_edit.txt")])
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-len", type=int, default=16)
    ap.add_argument("--min-n", type=int, default=None, help="default: by dtype")
    ap.add_argument("--max-n", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args()

    lm = api.load_model(args.model, dtype=args.dtype)
    api.warm_up(lm)
    cheap = api.cheap_verification(lm)  # picks the drafting defaults (docs/dtype.md)
    results = {"model": args.model, "dtype": lm.dtype, "device": lm.device,
               "machine": machine(), "torch": torch.__version__, "max_new_tokens": args.max_new_tokens,
               "draft_len": args.draft_len,
               "ngram": [args.min_n or default_min_n(cheap), args.max_n], "prompts": {}}

    def ours(make_drafter):  # prompt ids -> (tokens, tokens/s, mean accepted)
        def one(ids):
            r = api.generate(lm, prompt_ids=ids, max_new_tokens=args.max_new_tokens,
                             drafter=make_drafter() if make_drafter else None)
            return r.tokens, r.stats.tokens_per_second, r.stats.mean_accepted
        return one

    def hf(**kw):
        return lambda ids: (*hf_generate(lm, ids, args.max_new_tokens, **kw), None)
    methods = {"plain": ours(None),
               "hd": ours(lambda: api.make_drafter(["context"], args.draft_len, args.min_n, args.max_n,
                                                   cheap_verify=cheap)),
               "hf": hf(),
               "hf-pld": hf(prompt_lookup_num_tokens=10)}
    for path in args.prompts:
        ids = api.encode_prompt(lm.tokenizer, Path(path).read_text())
        runs = interleaved([ids] * args.repeats, methods)
        tps = speedups({m: [r[1] for r in rs] for m, rs in runs.items()}, average=statistics.median)
        toks = {m: rs[-1][0] for m, rs in runs.items()}
        accepted = runs["hd"][-1][2]
        row = {}
        for m in runs:
            ref = toks["hf"] if m == "hf-pld" else toks["plain"]
            row[m] = {**tps[m], "new_tokens": len(toks[m]),
                      "identical_to": "hf" if m == "hf-pld" else "plain",
                      "first_difference": first_difference(toks[m], ref)}
        row["hd"]["mean_accepted_tokens"] = accepted
        row["hf"]["first_difference_vs_plain"] = first_difference(toks["hf"], toks["plain"])
        results["prompts"][Path(path).stem] = row
        print(f"\n{Path(path).stem} ({len(ids)} prompt tokens, {lm.dtype})")
        for m, v in row.items():
            same = "identical" if v["first_difference"] is None else f"differs at {v['first_difference']}"
            extra = f"  mean accepted {v['mean_accepted_tokens']:.2f}" if "mean_accepted_tokens" in v else ""
            print(f"  {m:7s} {v['tokens_per_second']:6.1f} tok/s  {v['speedup']:5.2f}x  "
                  f"{v['new_tokens']} tokens, {same} vs {v['identical_to']}{extra}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
