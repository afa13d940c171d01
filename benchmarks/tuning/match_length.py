"""Draft lengths and prices that follow the match (issue 50, part 3): replayed on recorded answers.

Records plain greedy answers (the run's dtype) to the first turns of `--limit` Spec-Bench
questions per category (common.record; cached in --refs), then replays the context DB with the
settings hd runs (min_n 2, max_n 4, fill-tracked, 4 candidates, the statistics DB where given) under
its draft-length rules (drafting/context.py):
  today          the longest key (4 tokens) drafts up to draft_len (16);
  factor F       it drafts F x the match length (how far back the history agrees), as
                 SuffixDecoding sizes its trees;
  tagged         candidates tagged by match length, so the tracker prices each apart;
  run's answers  the model layer over an index of this run's own earlier answers only (no model
                 DB: what SuffixDecoding's global tree holds);
and SuffixDecoding (the peer, its whole tree sent, its global tree learning over the set). Each is
replayed under two cost curves: this machine's (`hd costs`) and, labelled so, the Zen 5 int8 curve
recorded for the 1.7B Q4_K_M shape (benchmarks/results/gguf/projection.json). Mean accepted tokens
and predicted speedup are deterministic (no timing: the layers' own time is not counted).

    python benchmarks/tuning/match_length.py --stats-db stats.lmdb --refs /tmp/refs.json --out results/match_length.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hdcli import api
from hdcli.bench import specbench
from hdcli.db import stores
from hdcli.drafting import AnswerIndex, ModelLayer, ContextDB, Hierarchy, StatsLayer
from hdcli.drafting.suffix import SuffixDrafter, new_cache
from hdcli.engine.decode import costs

BENCHMARKS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCHMARKS))   # common.py, one folder up
from common import command_line, machine, record, replay, write_result  # noqa: E402

ZEN5 = BENCHMARKS / "results" / "gguf" / "projection.json"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stats-db", help="a statistics DB (hd build-stats), asked after the context DB")
    ap.add_argument("--limit", type=int, default=5, help="questions per Spec-Bench category")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--refs", type=Path, help="cache of the recorded answers (JSON)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lm = api.load_model(dtype="auto", quiet=True)
    curves = {"this machine": costs.curve_for(lm)}
    zen5 = next((m for m in json.loads(ZEN5.read_text())["models"] if m["model"].endswith("1.7b-Q4_K_M.gguf")), None)
    if zen5:
        curves["Zen 5 int8, 1.7B Q4_K_M (recorded)"] = costs.CostCurve(
            {int(k): v for k, v in zen5["cost_curve"]["points"].items()})
    stats = StatsLayer(stores.Store(args.stats_db), min_prob=0.2, min_expected=1.0) if args.stats_db else None
    qs = specbench.select(specbench.load(specbench.find(None)), args.limit)
    refs = record([q["turns"][0] for q in qs], args.max_new_tokens, args.refs, lm=lm)

    def context_then(answers: bool = False, **kw):
        def make():
            index = AnswerIndex() if answers else None   # grows with the answers replayed
            layers = lambda: ([ContextDB(2, 4, **kw)] + ([ModelLayer(index)] if answers else [])
                              + ([stats] if stats else []))
            return (lambda: Hierarchy(layers(), policy="fill-tracked", max_candidates=4)), True
        return make

    def peer():
        cache = new_cache()
        return (lambda: SuffixDrafter(cache)), False   # sent whole, as vLLM does (hd bench too)

    variants = {"today": context_then(), "factor 1": context_then(match_factor=1.0),
                "factor 2": context_then(match_factor=2.0), "factor 3": context_then(match_factor=3.0),
                "tagged": context_then(tag_matches=True),
                "tagged, factor 2": context_then(match_factor=2.0, tag_matches=True),
                "run's answers": context_then(answers=True),
                "suffix (peer)": peer}
    rows = []
    for curve_name, curve in curves.items():
        for label, make in variants.items():
            factory, capped = make()
            r = replay(refs, factory, curve, cap=capped)
            rows.append({"curve": curve_name, "drafter": label, **r})
            print(f"{curve_name:38s} {label:18s} MAT {r['mean_accepted']:.3f} predicted {r['predicted_speedup']:.3f} "
                  f"tree {r['mean_tree']:.2f}", flush=True)
    write_result(args.out, {"command": command_line("tuning/match_length.py", args), "machine": machine(),
                            "model": lm.name, "dtype": lm.dtype, "kernels": lm.kernels,
                            "questions": len(refs), "rows": rows})


if __name__ == "__main__":
    main()
