"""Model-free replay of drafters against recorded plain greedy outputs.

Under greedy decoding the tokens a draft gets accepted are exactly its common prefix with the
plain output at that point, so a drafter can be scored without running the model again: record
the plain outputs once (fp32, exact), measure the target's forward cost by number of input tokens
once, then replay any drafter setting in milliseconds. Used by context_tuning.py and stats_tuning.py.
"""
from __future__ import annotations

import json
import time

import torch
from transformers import DynamicCache

from hdcli import api

SIZES = [1, 2, 4, 6, 8, 10, 12, 16, 20, 24]


@torch.inference_mode()
def forward_costs(lm, ids, repeats=12) -> dict:
    """Median time of one forward over k new tokens on a len(ids) context, relative to k = 1."""
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


def spec_bench_texts(path: str, per_category: int) -> list[tuple[str, str]]:
    seen, out = {}, []
    for line in open(path):
        q = json.loads(line)
        if seen.setdefault(q["category"], 0) < per_category:
            seen[q["category"]] += 1
            out.append((q["category"], q["turns"][0]))
    return out


def record(texts: list[str], max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, plain greedy output) per text, in fp32 so the outputs are exact."""
    lm = api.load_model(dtype="fp32")
    refs = []
    for t in texts:
        ids = api.encode_prompt(lm.tokenizer, t)
        refs.append((ids, api.generate(lm, prompt_ids=ids, max_new_tokens=max_new_tokens,
                                       drafter=None).tokens))
    return refs


def replay(refs, make_hierarchy, cost: dict) -> dict:
    """Predicted speedup (plain cost / drafted cost), mean accepted tokens, per-layer counts."""
    def c(k):
        return cost[min([s for s in SIZES if s >= k] or [SIZES[-1]])]
    spent = plain = steps = 0
    layers = {}
    for prompt, ref in refs:
        hier, pos, h = make_hierarchy(), 0, list(prompt)
        hier.reset(h)
        while pos < len(ref):
            drafts = hier.propose(h, len(ref) - pos - 1)
            d = list(drafts[0].tokens) if drafts else []
            n = 0
            while n < len(d) and d[n] == ref[pos + n]:
                n += 1
            if drafts:
                agg = layers.setdefault(drafts[0].layer, [0, 0])
                agg[0] += len(d)
                agg[1] += n
            new = ref[pos:pos + n + 1]
            spent += c(1 + len(d))
            steps += 1
            pos += len(new)
            h += new
            hier.extend(new)
        plain += len(ref)
    return {"predicted_speedup": plain / spent, "mean_accepted": plain / steps,
            "layers": {k: {"drafted": v[0], "accepted": v[1]} for k, v in layers.items()}}
