"""Which statistics-DB representation drafts best: stored continuations or next-token counts?

Builds (or takes) two DBs from the same corpus, one storing 8-token continuations per key
(--draft-len 8) and one storing next-token counts (--draft-len 1, drafted by a greedy walk), then
replays context+stats against recorded plain outputs of Spec-Bench questions (common.py: replay) for
several min_prob thresholds, with the forward-cost profile of each dtype measured here.

    python benchmarks/tuning/stats_tuning.py --corpora ../shared/corpora --out benchmarks/results/stats_tuning.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from hdcli import api
from hdcli.compose import default_min_n
from hdcli.db import stores
from hdcli.drafting import ContextDB, Hierarchy, StatsLayer

BENCHMARKS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCHMARKS))   # common.py, one folder up
from common import first_per_subcategory, forward_costs, load_questions, record, replay  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpora", default="../shared/corpora")
    ap.add_argument("--spec-bench", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--out")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    dbs = {}
    for length in (8, 1):
        path = tmp / f"L{length}.lmdb"
        subprocess.run([sys.executable, "-m", "hdcli.cli", "build-stats", f"{args.corpora}/**/*.jsonl",
                        "-o", str(path), "--draft-len", str(length), "--json"], check=True,
                       stdout=subprocess.DEVNULL)
        dbs[length] = stores.Store(path)
    texts = [q["turns"][0] for q in first_per_subcategory(load_questions(args.spec_bench), args.per_category)]
    refs = record(texts, args.max_new_tokens)
    rows = []
    for dtype in ("fp32", "bf16"):
        lm = api.load_model(dtype=dtype)
        cost = forward_costs(lm, refs[0][0] * 4)
        min_n = default_min_n(dtype != "fp32")  # replay of torch-kernel runs: bf16 cheap, fp32 not
        base = replay(refs, lambda: Hierarchy([ContextDB(min_n, 4)], draft_len=16), cost, cap=False)
        rows.append({"dtype": dtype, "layers": "context", **base})
        print(dtype, "context only", round(base["predicted_speedup"], 3), round(base["mean_accepted"], 2))
        for length, walk in ((8, False), (8, True), (1, True)):
            for min_prob in (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5):
                r = replay(refs, lambda: Hierarchy([ContextDB(min_n, 4),
                                                    StatsLayer(dbs[length], min_prob=min_prob, walk=walk)],
                                                   draft_len=16), cost, cap=False)
                rows.append({"dtype": dtype, "layers": "context+stats", "stored_len": length, "walk": walk,
                             "min_prob": min_prob, **r})
                print(dtype, f"stored {length} walk {walk} min_prob {min_prob}:",
                      round(r["predicted_speedup"], 3), round(r["mean_accepted"], 2), r["layers"].get("stats"))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
