"""How the context DB's settings trade drafted against accepted tokens, per dtype.

Measures the target's forward cost by input length in the given dtype, records plain greedy
outputs for the two prompts in benchmarks/prompts/ and the first questions of every Spec-Bench
category, and replays each setting (common.py: replay; chains, every drafted token sent). Prints
the best settings by predicted speedup.

    python benchmarks/tuning/context_tuning.py --dtype bf16
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hdcli import api
from hdcli.drafting import ContextDB, Hierarchy

BENCHMARKS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCHMARKS))   # common.py, one folder up
from common import first_per_subcategory, forward_costs, load_questions, machine, record, replay  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--spec-bench", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--out")
    args = ap.parse_args()
    texts = [(BENCHMARKS / "prompts/summarize.txt").read_text(), (BENCHMARKS / "prompts/code_edit.txt").read_text()]
    texts += [q["turns"][0] for q in first_per_subcategory(load_questions(args.spec_bench), args.per_category)]
    lm = api.load_model(dtype=args.dtype)
    cost = forward_costs(lm, api.encode_prompt(lm.tokenizer, texts[0]))
    print(args.dtype, "forward cost relative to one token:", {k: round(v, 2) for k, v in cost.items()})
    refs = record(texts, args.max_new_tokens)
    rows = []
    for min_n in (1, 2, 3):
        for len_per_key in (2, 3, 4, 99):
            for draft_len in (8, 12, 16, 20):
                r = replay(refs, lambda: Hierarchy([ContextDB(min_n, 4, len_per_key)], draft_len=draft_len), cost,
                           cap=False)
                rows.append({"min_n": min_n, "len_per_key": len_per_key, "draft_len": draft_len, **r})
    rows.sort(key=lambda r: -r["predicted_speedup"])
    for r in rows[:12]:
        print({k: v for k, v in r.items() if k != "layers"})
    if args.out:
        Path(args.out).write_text(json.dumps({"dtype": args.dtype, "cost": cost, "machine": machine(),
                                                "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
