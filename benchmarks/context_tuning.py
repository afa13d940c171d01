"""How the context DB's settings trade drafted against accepted tokens, per dtype.

1. measures the target's forward cost for 1..24 input tokens on a ~400-token context (dtype given);
2. records plain greedy outputs (fp32, so they are exact) for the two prompts in prompts/ and the
   first two questions of each Spec-Bench category;
3. replays each drafter setting against those outputs (under greedy, the accepted length of a draft
   is its common prefix with the plain output) and predicts speedup = plain cost / drafted cost.

    python benchmarks/context_tuning.py --dtype bf16 --spec-bench ../shared/data/spec_bench/question.jsonl
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hdcli import api
from hdcli.drafting import ContextDB

HERE = Path(__file__).parent
SIZES = [1, 2, 4, 6, 8, 10, 12, 16, 20, 24]


@torch.inference_mode()
def forward_costs(lm, ids, repeats=12):
    m, cache = lm.model, DynamicCache(config=lm.model.config)
    m(input_ids=torch.tensor([ids]), past_key_values=cache)
    med = {}
    for k in SIZES:
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            m(input_ids=torch.tensor([ids[:k]]), past_key_values=cache)
            ts.append(time.perf_counter() - t)
            cache.crop(-k)
        med[k] = sorted(ts)[repeats // 2]
    return {k: v / med[1] for k, v in med.items()}


def replay(refs, make_db, draft_len, cost):
    def c(k):
        return cost[min(s for s in SIZES if s >= k)] if k <= SIZES[-1] else cost[SIZES[-1]]
    spent = plain = steps = 0
    for prompt, ref in refs:
        db, pos, h = make_db(), 0, list(prompt)
        db.reset(h)
        while pos < len(ref):
            left = len(ref) - pos
            cands = db.propose(h, min(draft_len, left - 1), 1) if left > 1 else []
            d = cands[0] if cands else []
            n = 0
            while n < len(d) and d[n] == ref[pos + n]:
                n += 1
            new = ref[pos:pos + n + 1]
            spent += c(1 + len(d))
            steps += 1
            pos += len(new)
            h += new
            db.extend(new)
        plain += len(ref)
    return plain / spent, plain / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--spec-bench", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--out")
    args = ap.parse_args()
    texts = [(HERE / "prompts/summarize.txt").read_text(), (HERE / "prompts/code_edit.txt").read_text()]
    seen = {}
    for line in open(args.spec_bench):
        q = json.loads(line)
        if seen.setdefault(q["category"], 0) < args.per_category:
            seen[q["category"]] += 1
            texts.append(q["turns"][0])
    lm = api.load_model(dtype=args.dtype)
    cost = forward_costs(lm, api.encode_prompt(lm.tokenizer, texts[0]))
    print(args.dtype, "forward cost relative to one token:", {k: round(v, 2) for k, v in cost.items()})
    exact = lm if args.dtype == "fp32" else api.load_model(dtype="fp32")
    refs = []
    for t in texts:
        ids = api.encode_prompt(exact.tokenizer, t)
        refs.append((ids, api.generate(exact, prompt_ids=ids, max_new_tokens=args.max_new_tokens,
                                       drafter=None).tokens))
    rows = []
    for min_n in (1, 2, 3):
        for len_per_key in (2, 3, 4, 99):
            for draft_len in (8, 12, 16, 20):
                speed, acc = replay(refs, lambda: ContextDB(min_n, 4, len_per_key), draft_len, cost)
                rows.append({"min_n": min_n, "len_per_key": len_per_key, "draft_len": draft_len,
                             "predicted_speedup": speed, "mean_accepted": acc})
    rows.sort(key=lambda r: -r["predicted_speedup"])
    for r in rows[:12]:
        print(r)
    if args.out:
        Path(args.out).write_text(json.dumps({"dtype": args.dtype, "cost": cost, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
