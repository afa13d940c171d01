"""hd's 4-bit GEMM (hdcli/engine/csrc/int4mm.cpp) on one forward's shapes: the least time, over
rounds, of the GEMMs of --layers layers at each row count, every layer with weights of its own (so
they come from memory, as in a forward) and the same count on one layer's weights (from cache).

The bundled SmolLM2-135M's shapes are the default: per layer q/k/v joined (960 x 576), o (576 x
576), gate/up joined (3072 x 576) and down (576 x 1536); random codes and constants (the time does
not depend on their values).

    python benchmarks/int4_gemm.py --out benchmarks/results/int4_gemm.json
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from hdcli.engine import int4

from common import command_line, machine, write_result

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))   # (out, in) of one layer's GEMMs


def least_ms(fn, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    mod = int4.gemm_module()
    if mod is None:
        raise SystemExit(f"hd's 4-bit GEMM is not built here: {int4._gemm_failed}")
    gen = torch.Generator().manual_seed(0)

    def pack(n: int, k: int):
        return int4.hd_pack(torch.randint(0, 16, (n, k), generator=gen),
                            torch.rand(n, k // 32, generator=gen).half().float(),
                            torch.rand(n, k // 32, generator=gen).half().float())
    layers = [[pack(n, k) for n, k in SHAPES] for _ in range(args.layers)]
    rows = []
    for m in [int(x) for x in args.rows.split(",")]:
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for _, k in SHAPES}

        def over(packs):
            def run():
                for layer in packs:
                    for (_, k), p in zip(SHAPES, layer):
                        mod.mm(xs[k], p)
            return run
        memory = least_ms(over(layers), args.rounds)
        cached = least_ms(over([layers[0]] * args.layers), args.rounds)
        flop = 2 * m * args.layers * sum(n * k for n, k in SHAPES)
        rows.append({"rows": m, "ms_from_memory": round(memory, 3), "ms_from_cache": round(cached, 3),
                     "gflops_from_memory": round(flop / memory / 1e6, 1)})
        print(f"{m:3} rows: {memory:.2f} ms from memory, {cached:.2f} ms from cache "
              f"({flop / memory / 1e6:.0f} GFLOP/s)", flush=True)
    doc = {"machine": machine(), "shapes": SHAPES, "layers": args.layers, "rows": rows,
           "command": command_line("int4_gemm.py", args)}
    write_result(args.out, doc)


if __name__ == "__main__":
    main()
