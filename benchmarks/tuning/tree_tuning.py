"""Choose the tree defaults (policy, candidates C, draft length L) by replay.

Under greedy decoding the target keeps exactly the tree path that matches its own output, so a
tree can be scored against recorded plain outputs without running the model (common.py explains
the idea): this replays every policy, C and L with the very tree builder and cost cap of the
decoder (hdcli.engine.decode.tree.build_tree), for the measured cost curves of fp32 and bf16
(benchmarks/results/tree_cost_*.json), on Spec-Bench questions (5 per category by default).

    python benchmarks/tuning/tree_tuning.py --stats-db stats.lmdb --model-db model.lmdb \
        --out benchmarks/results/tree_tuning.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hdcli import api
from hdcli.bench import specbench
from hdcli.engine.decode.costs import CostCurve
from hdcli.drafting import Hierarchy
from hdcli.db.stores import Store

BENCHMARKS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCHMARKS))   # common.py, one folder up
from common import load_questions, record, replay  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=None)
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--stats-db", required=True)
    ap.add_argument("--model-db", required=True)
    ap.add_argument("--refs", default="/tmp/hd_tree_refs.json", help="cache of the recorded plain outputs")
    ap.add_argument("--out")
    args = ap.parse_args()
    questions = specbench.select(load_questions(args.data), args.limit)
    refs = record([q["turns"][0] for q in questions], args.max_new_tokens, cache=args.refs)
    stats, model = Store(args.stats_db), Store(args.model_db)
    results_dir = BENCHMARKS / "results"
    rows = []
    for dtype in ("fp32", "bf16"):
        data = json.loads((results_dir / f"tree_cost_{dtype}.json").read_text())
        cost = CostCurve({int(w): r["chain_cost"] for w, r in data["widths"].items()})
        for policy in Hierarchy.POLICIES:
            for C in (1, 2, 4, 8):
                for L in (8, 16):
                    def make():
                        return api.make_drafter(["context", "model", "stats"], draft_len=L,
                                                cheap_verify=cost.verifies_cheaply(),
                                                stats_stores=[stats], model_db=model, policy=policy,
                                                candidates=C)
                    r = replay(refs, make, cost)
                    rows.append({"dtype": dtype, "policy": policy, "candidates": C, "draft_len": L, **r})
                    print(f"{dtype} {policy:9} C={C} L={L:2}: speedup {r['predicted_speedup']:.3f} "
                          f"accepted {r['mean_accepted']:.2f} tree {r['mean_tree']:.1f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
