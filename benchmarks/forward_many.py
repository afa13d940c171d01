"""What one verification forward costs with several requests in it (hdcli/engine/decode/batch.py): median
ms of batch.forward_many for S streams of k tokens each (a chain, or a tree of k nodes), every
stream on its own cache (--context tokens, +37 a stream), on the bundled model in one dtype and kernel set.

The rows' cost beyond one stream is what `hd serve` pays to decode requests together; the KV
cache (engine/model/kvcache.py) and the batched attention (invariant.Many) are what it measures.

    python benchmarks/forward_many.py --dtype bf16 --kernels int4 --out benchmarks/results/forward_many_int4.json
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from hdcli import api
from hdcli.engine.decode import batch
from hdcli.engine.decode.tree import Tree

from common import command_line, machine, write_result


def caches(model, n: int, context: int) -> list:
    out = []
    with torch.inference_mode():
        for i in range(n):
            c = model.new_cache()
            model.forward(torch.randint(3, 40000, (1, context + 37 * i)), c)
            out.append(c)
    return out


def shape(k: int, kind: str) -> Tree:
    t = Tree()
    if kind == "chain" and k > 1:
        t.add_candidate(list(range(100, 100 + k - 1)), "x")
    elif kind == "tree":   # k nodes: two branches of equal length below the root
        half = (k - 1) // 2
        t.add_candidate(list(range(100, 100 + half)), "x")
        t.add_candidate([200 + j for j in range(k - 1 - half)], "x")
    return t


def median_ms(model, items, cs, base: list[int], reps: int, warmup: int = 0) -> float:
    """Median (ms) of reps batched forwards of items, each on caches cs cropped back to their base
    lengths first; warmup forwards before them are not counted."""
    ts = []
    with torch.inference_mode():
        for r in range(reps + warmup):
            for c, b in zip(cs, base):
                if c.get_seq_length() > b:
                    c.crop(b - c.get_seq_length())
            t = time.perf_counter()
            batch.forward_many(model, items)
            ts.append(time.perf_counter() - t)
    return statistics.median(ts[warmup:]) * 1e3


def forward_ms(model, streams: int, k: int, kind: str, reps: int, context: int) -> float:
    cs = caches(model, streams, context)
    base = [c.get_seq_length() for c in cs]
    return median_ms(model, [(shape(k, kind), 50, c) for c in cs], cs, base, reps, warmup=3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--kernels", default="int4")
    ap.add_argument("--streams", default="1,2,4")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--context", type=int, default=200, help="Tokens in the first stream's cache (+37 each next).")
    ap.add_argument("--shapes", default="chain:1,chain:4,tree:7")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lm = api.load_model(args.model, dtype=args.dtype, kernels=args.kernels, invariant="on", quiet=True)
    rows = []
    for kind, k in [(x.split(":")[0], int(x.split(":")[1])) for x in args.shapes.split(",")]:
        for s in [int(x) for x in args.streams.split(",")]:
            ms = forward_ms(lm.model, s, k, kind, args.reps, args.context)
            rows.append({"streams": s, "tokens_each": k, "shape": kind, "context": args.context, "ms": round(ms, 2)})
            print(f"{kind:5} k={k} streams={s}: {ms:.1f} ms", flush=True)
    doc = {"machine": machine(), "model": args.model, "dtype": lm.dtype, "kernels": lm.kernels,
           "invariant": bool(lm.invariant), "rows": rows,
           "command": command_line("forward_many.py", args)}
    write_result(args.out, doc)


if __name__ == "__main__":
    main()
