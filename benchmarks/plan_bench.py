"""Predicted vs measured tokens/s of draft-model hierarchies, on questions the planner never saw.

1. `hd plan` calibrates on the first Spec-Bench question of each category (its default) and ranks
   every chain of levels (with its best T per level);
2. this script then runs, interleaved per question, on the next `--questions` Spec-Bench questions
   (first turn, round-robin over categories): the plan's top three chains, the best single-level
   chain, and plain decoding; and prints measured beside predicted tokens/s.

    python benchmarks/plan_bench.py --draft-models self:layers=8,self:int8 --stats-db stats.lmdb \
        --model-db model.lmdb --dtype fp32 --out benchmarks/results/plan_fp32.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hdcli import api, draftmodels, specbench
from hdcli.decode import Decoder


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft-models", required=True)
    ap.add_argument("--stats-db")
    ap.add_argument("--model-db")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--t-max", type=int, default=12)
    ap.add_argument("--out")
    args = ap.parse_args()
    plan_file = Path(tempfile.mkdtemp()) / "plan.json"
    cmd = [sys.executable, "-m", "hdcli.cli", "plan", "--draft-models", args.draft_models, "--dtype", args.dtype,
           "--t-max", str(args.t_max), "--measure-top", "0", "--out", str(plan_file), "--json"]
    cmd += ["--stats-db", args.stats_db] if args.stats_db else []
    cmd += ["--model-db", args.model_db] if args.model_db else []
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    plan = json.loads(plan_file.read_text())
    rows = plan["candidates"]
    single = [r for r in rows if len(r["chain"]["levels"]) + (r["chain"]["bottom"] == "db") == 1][:1]
    plain = [r for r in rows if not r["chain"]["levels"] and r["chain"]["bottom"] == "none"]
    chosen = []
    for r in rows[:3] + single + plain:
        if r not in chosen:
            chosen.append(r)

    lm = api.load_model(dtype=args.dtype)
    api.warm_up(lm)
    cheap = api.cheap_verification(lm)  # picks the drafting defaults (docs/dtype.md)
    dbs = api.open_stats_dbs([args.stats_db] if args.stats_db else [], lm)
    mdb = api.open_stats_dbs([args.model_db], lm)[0] if args.model_db else None
    layers = ["context"] + ["model"] * (mdb is not None) + ["stats"] * bool(dbs)
    loaded = {n: draftmodels.load(n, lm) for n in args.draft_models.split(",")}

    def drafter(chain):
        base = api.make_drafter(layers, cheap_verify=cheap, stats_dbs=dbs, model_db=mdb, candidates=1) \
            if chain["bottom"] == "db" else None
        if not chain["levels"]:
            return base
        return api.make_stack(lm, [lv["model"] for lv in chain["levels"]], [lv["T"] for lv in chain["levels"]],
                              base, loaded=loaded)

    qs = specbench.select(specbench.load(specbench.find(None)), None)
    calib = {q["question_id"] for q in specbench.select(qs, 1)}
    by_cat: dict[str, list] = {}
    for q in qs:
        if q["question_id"] not in calib:
            by_cat.setdefault(q["category"], []).append(q)
    picked, i = [], 0
    while len(picked) < args.questions:
        for c in specbench.CATEGORIES:
            if i < len(by_cat.get(c, [])) and len(picked) < args.questions:
                picked.append(by_cat[c][i])
        i += 1
    tps = {r["hierarchy"]: [] for r in chosen}
    outputs = {r["hierarchy"]: [] for r in chosen}
    for q in picked:
        ids = api.encode_prompt(lm.tokenizer, q["turns"][0])
        for r in chosen:
            g = Decoder(lm.model, lm.eos_ids, drafter(r["chain"])).generate(ids, args.max_new_tokens)
            tps[r["hierarchy"]].append(g.stats.tokens_per_second)
            outputs[r["hierarchy"]].append(g.tokens)
        print(f"{len(tps[chosen[0]['hierarchy']])}/{len(picked)}", flush=True)
    base = statistics.mean(tps[plain[0]["hierarchy"]])
    result = []
    for r in chosen:
        h = r["hierarchy"]
        m = statistics.mean(tps[h])
        result.append({"hierarchy": h, "chain": r["chain"], "predicted_tokens_per_second": r["predicted_tokens_per_second"],
                       "measured_tokens_per_second": m, "measured_speedup": m / base,
                       "differ_from_plain": sum(a != b for a, b in zip(outputs[h], outputs[plain[0]["hierarchy"]]))})
        print(f"{h:60s} predicted {r['predicted_tokens_per_second']:6.1f}  measured {m:6.1f} tok/s  "
              f"{m / base:.2f}x  differ {result[-1]['differ_from_plain']}/{len(picked)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"dtype": args.dtype, "questions": len(picked),
                                              "max_new_tokens": args.max_new_tokens, "plan": plan,
                                              "results": result}, indent=1))


if __name__ == "__main__":
    main()
