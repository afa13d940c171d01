"""What a verification forward of w rows costs inside a live speculative run, against the cost
curve that prices it (`hd costs`), in one process (issues 76 and 77).

The tree's cost cap (engine/decode/tree.py) keeps the drafted nodes that pay for the forward at
the curve's cost(w). The curve is measured by forwards timed back to back; a live step's forward
follows the drafting, the tree and the acceptance of the step before it. This times every
verification forward of plain and speculative runs over the same questions (each width apart),
interleaved question by question, then the curve the same way `hd costs` measures it, and writes
both: live cost(w) = the median w-row forward of the speculative runs over the median one-token
forward of the plain runs.

    python benchmarks/live_costs.py --limit 10 --stats-db stats.lmdb --out benchmarks/results/costs/live.json
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from statistics import median_high as median
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, machine, write_result  # noqa: E402

from hdcli import api  # noqa: E402
from hdcli.engine.decode import batch, costs  # noqa: E402
import hdcli.engine.decode.loop as loop  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="benchmarks/prompts/user_questions.jsonl")
    ap.add_argument("--limit", type=int, default=10, help="questions (the first ones)")
    ap.add_argument("--stats-db", action="append", default=[])
    ap.add_argument("-n", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lm = api.load_model(args.model)
    qs = [json.loads(line) for line in open(args.data)][:args.limit]
    configs = {"plain": api.DecodingConfig(max_new_tokens=args.max_new_tokens, layers=[]),
               "context": api.DecodingConfig(max_new_tokens=args.max_new_tokens, layers=["context"])}
    if args.stats_db:
        configs["default"] = api.DecodingConfig(max_new_tokens=args.max_new_tokens, stats_dbs=args.stats_db)
    times: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    current = ["plain"]
    forward_many = batch.forward_many

    def timed(model, items):
        t0 = time.perf_counter()
        out = forward_many(model, items)
        times[(current[0], sum(tree.size() + 1 for tree, _, _ in items))].append(time.perf_counter() - t0)
        return out

    loop.batch.forward_many = timed
    for cfg in configs.values():   # warm-up: kernels, DB pages, the cost curve
        api.generate(lm, "Hello", config=cfg)
    times.clear()
    wall = collections.Counter()
    for n, q in enumerate(qs, 1):
        for name, cfg in configs.items():
            current[0] = name
            t0 = time.perf_counter()
            api.generate(lm, q["turns"][0], config=cfg)
            wall[name] += time.perf_counter() - t0
        print(f"{n}/{len(qs)} questions", file=sys.stderr)
    loop.batch.forward_many = forward_many
    seconds = costs.measure_seconds(lm.model, *costs.budget_for(lm.model), quiet=True)
    one = median(times[("plain", 1)])
    live = {name: {w: {"n": len(v), "ms": 1e3 * median(v), "cost": median(v) / one}
                   for (m, w), v in sorted(times.items()) if m == name and len(v) >= 10}
            for name in configs if name != "plain"}
    curve = {w: s / seconds[1] for w, s in seconds.items()}
    report = {"command": command_line("live_costs.py", args), "machine": machine(), "model": lm.name, "questions": len(qs),
              "plain_one_token_ms": 1e3 * one, "curve_one_token_ms": 1e3 * seconds[1],
              "curve": curve, "live": live, "wall_seconds": dict(wall)}
    print(f"plain one-token forward {1e3 * one:.2f} ms live, {1e3 * seconds[1]:.2f} ms in the curve's measurement")
    print("curve  " + "  ".join(f"{w}:{c:.2f}" for w, c in curve.items() if w <= 16))
    for name, rows in live.items():
        print(f"{name:7s}" + "  ".join(f"{w}:{r['cost']:.2f} ({r['n']})" for w, r in rows.items()))
    print("wall   " + "  ".join(f"{k} {v:.2f} s" for k, v in wall.items()))
    if args.out:
        write_result(args.out, report)


if __name__ == "__main__":
    main()
