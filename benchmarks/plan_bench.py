"""Predicted vs measured tokens/s of draft-model hierarchies, on questions the planner never saw.

1. `hd plan` calibrates on the first Spec-Bench question of each category (its default) and ranks
   every chain of levels (with its best T per level);
2. this script then runs, interleaved per question, on the next `--questions` Spec-Bench questions
   (first turn, round-robin over categories): the plan's top three chains, the best single-level
   chain, and plain decoding; and prints measured beside predicted tokens/s.

    python benchmarks/plan_bench.py --draft-models self:blocks=8,self:int8 --stats-db stats.lmdb \
        --model-db model.lmdb --dtype fp32 --out benchmarks/results/plan_fp32.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from hdcli import api
from hdcli.hsd import draft_models as draftmodels
from hdcli.bench import specbench
from hdcli.engine.decode.loop import Decoder

from common import interleaved, load_questions, machine, round_robin, summarize


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
        base = api.make_drafter(layers, cheap_verify=cheap, stats_stores=dbs, model_db=mdb, candidates=1) \
            if chain["bottom"] == "db" else None
        if not chain["levels"]:
            return base
        return api.make_stack(lm, [lv["model"] for lv in chain["levels"]], [lv["T"] for lv in chain["levels"]],
                              base, loaded=loaded)

    qs = specbench.select(load_questions(), None)
    calib = {q["question_id"] for q in specbench.select(qs, 1)}
    picked = round_robin([q for q in qs if q["question_id"] not in calib], args.questions,
                         order=specbench.CATEGORIES)

    def run(chain):
        return lambda ids: Decoder(lm.model, lm.eos_ids, drafter(chain)).generate(ids, max_new_tokens=args.max_new_tokens)
    runs = interleaved([api.encode_prompt(lm.tokenizer, q["turns"][0]) for q in picked],
                       {r["hierarchy"]: run(r["chain"]) for r in chosen},
                       on_item=lambda n, *_: print(f"{n}/{len(picked)}", flush=True))
    measured = summarize(runs, base=plain[0]["hierarchy"], echo=False)
    result = []
    for r in chosen:
        h = r["hierarchy"]
        m = measured[h]
        result.append({"hierarchy": h, "chain": r["chain"], "predicted_tokens_per_second": r["predicted_tokens_per_second"],
                       "measured_tokens_per_second": m["tokens_per_second"], "measured_speedup": m["speedup"],
                       "differ_from_plain": m["differ_from_plain"]})
        print(f"{h:60s} predicted {r['predicted_tokens_per_second']:6.1f}  measured {m['tokens_per_second']:6.1f} tok/s  "
              f"{m['speedup']:.2f}x  differ {m['differ_from_plain']}/{len(picked)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"dtype": args.dtype, "questions": len(picked), "machine": machine(),
                                              "max_new_tokens": args.max_new_tokens, "plan": plan,
                                              "results": result}, indent=1))


if __name__ == "__main__":
    main()
