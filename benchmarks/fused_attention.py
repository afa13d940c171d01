"""Whole forwards with the fused invariant attention (hdcli/engine/kernels/fused.py) against the torch ops'
attention, on the same model, caches and trees, in interleaved rounds (least time of each).

What `hd` picks by itself is `invariant.decide`'s measurement of the attention alone (once per machine);
this script shows what that choice is worth in whole forwards of one and of several requests, and
with --ablate what the attention costs at all (it is replaced by a no-op that returns the queries).

    python benchmarks/fused_attention.py --out benchmarks/results/fused_attention.json
"""
from __future__ import annotations

import argparse
from pathlib import Path

from hdcli import api
from hdcli.engine.kernels import invariant

from common import command_line, machine, write_result
from forward_many import caches, median_ms, shape

CASES = [(1, 1, "chain"), (1, 8, "tree"), (1, 16, "chain"), (4, 1, "chain"), (4, 3, "chain"), (4, 4, "tree")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--kernels", default="int4")
    ap.add_argument("--context", type=int, default=250)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--ablate", action="store_true", help="also time each forward without the attention")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lm = api.load_model(args.model, dtype=args.dtype, kernels=args.kernels, invariant="on", quiet=True)
    model = lm.model
    real = invariant.attend_kv, invariant.attend_many
    paths = ["fused", "torch"] + (["none"] if args.ablate else [])
    rows = []
    for streams, k, kind in CASES:
        cs = caches(model, streams, args.context)
        base = [c.get_seq_length() for c in cs]
        items = [(shape(k, kind), 50, c) for c in cs]
        best = {p: float("inf") for p in paths}
        for r in range(args.rounds):
            for p in (paths if r % 2 == 0 else paths[::-1]):
                if p == "none":   # the attention replaced by a no-op (the fused path's cache work stays)
                    invariant.attend_kv = lambda q, *a: q.transpose(1, 2).contiguous()
                    invariant.attend_many = lambda q, *a: q.transpose(1, 2).contiguous()
                with invariant.pinned("fused" if p != "torch" else "torch"):
                    best[p] = min(best[p], median_ms(model, items, cs, base, args.reps))
                invariant.attend_kv, invariant.attend_many = real
        row = {"requests": streams, "rows_each": k, "shape": kind, **{f"{p}_ms": round(v, 2) for p, v in best.items()}}
        rows.append(row)
        print(row, flush=True)
    doc = {"machine": machine(), "model": args.model, "dtype": lm.dtype, "kernels": lm.kernels,
           "context": args.context, "decision": invariant.decide(model), "forwards": rows,
           "command": command_line("fused_attention.py", args)}
    write_result(args.out, doc)


if __name__ == "__main__":
    main()
