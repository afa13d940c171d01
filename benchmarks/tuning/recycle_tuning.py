"""Recycle-layer priors and drafting defaults, compared on the same greedy outputs.

First turns of `--limit` Spec-Bench questions per category, 128 new tokens, fp32, context + recycle
+ statistics DB (cheap-verification defaults). For each variant it prints tokens per unit of
forward cost (sum of accepted lengths / sum of cost(1 + tree size) with this machine's cost curve:
deterministic for greedy decoding, so small differences are real) and the measured decode tok/s
(noisy). Greedy outputs are identical across variants.

    python benchmarks/tuning/recycle_tuning.py --stats-db stats.lmdb --limit 2
"""
import argparse

from hdcli import api, drafting
from hdcli.engine.decode import costs
from hdcli.bench import specbench
from hdcli.engine.decode.loop import Decoder

ap = argparse.ArgumentParser()
ap.add_argument("--stats-db", required=True)
ap.add_argument("--limit", type=int, default=2)
args = ap.parse_args()

lm = api.load_model("smollm2-135m", dtype="fp32", quiet=True)
dbs = api.open_stats_dbs([args.stats_db], lm)
cost = costs.curve_for(lm)
qs = specbench.select(specbench.load(specbench.find(None)), args.limit, None)
prompts = [api.encode_messages(lm.tokenizer, [{"role": "user", "content": q["turns"][0]}]) for q in qs]
ALL = ["context", "recycle", "stats"]
PRIOR = drafting.PRIOR_RATES["recycle"]
# name -> (layers, recycle priors, make_drafter keywords)
VARIANTS = {
    "no recycle": (["context", "stats"], PRIOR, {}),
    "default": (ALL, PRIOR, {}),
    "priors low": (ALL, (0.05, 0.15, 0.25, 0.35), {}),
    "priors high": (ALL, (0.1, 0.45, 0.6, 0.7), {}),
    "C=8": (ALL, PRIOR, {"candidates": 8}),
    "C=2": (ALL, PRIOR, {"candidates": 2}),
    "draft-len 24": (ALL, PRIOR, {"draft_len": 24}),
    "draft-len 8": (ALL, PRIOR, {"draft_len": 8}),
    "stats min-prob 0.05": (ALL, PRIOR, {"stats_min_prob": 0.05}),
}
for name, (layers, prior, kw) in VARIANTS.items():
    drafting.PRIOR_RATES["recycle"] = prior
    table = drafting.RecycledTable()
    accepted = spent = decode_s = 0.0
    tokens = 0
    for p in prompts:
        d = api.make_drafter(layers, cheap_verify=cost.verifies_cheaply(), stats_stores=dbs,
                             recycle_table=table, **kw)
        g = Decoder(lm.model, lm.eos_ids, d, cost=cost).generate(p, max_new_tokens=128)
        accepted += sum(g.stats.accept_lengths)
        spent += sum(cost(1 + t) for t in g.stats.tree_sizes)
        decode_s += g.stats.wall_seconds - g.stats.prefill_seconds
        tokens += len(g.tokens)
    print(f"{name:22s} tokens/cost {accepted / spent:.3f}   decode {tokens / decode_s:.1f} tok/s", flush=True)
drafting.PRIOR_RATES["recycle"] = PRIOR
