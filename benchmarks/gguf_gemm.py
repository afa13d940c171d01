"""hd's GGUF GEMMs by row count: bf16 activations (`gguf`) against int8 activations (`gguf-int8`),
one weight of each type, out of cache (a few layers' worth of rows), in one process, interleaved.

What it answers: how fast the cost of w verification rows grows (cost(w) = time(w) / time(1)),
which bounds what speculation can gain at a model size, and what one row (plain decoding) costs.
On a CPU without AVX512-BF16 (no bf16-activation GEMM: AVX2) the bf16 column is what ran there
before the AVX2 int8 GEMM: the weights dequantized to bf16 on torch's GEMM (`torch-bf16`).
Random blocks in valid formats (tests/test_quants.py's `make`): speed does not depend on values.

    python benchmarks/gguf_gemm.py --out benchmarks/results/gguf/gemm.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import command_line, machine, write_result  # noqa: E402
from test_quants import make  # noqa: E402

from hdcli.engine.kernels import quants  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_0,Q4_K,Q6_K,Q8_0")
    ap.add_argument("--n", type=int, default=65536, help="output columns (65536 x 2048 Q4_0: 75 MB, past any cache)")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not quants.int8_available():
        print(f"the int8-activation GEMM does not run here ({quants.failure() or 'no AVX512-VNNI or AVX2'})")
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    doc = {"command": command_line("gguf_gemm.py", args), "machine": machine(), "shape": [args.n, args.k],
           "gemm": quants.gemm_isa(), "types": {}}
    base = "bf16" if quants.bf16_available() else "torch-bf16"
    print(f"N x K = {args.n} x {args.k}, {torch.get_num_threads()} threads, least of {args.rounds}, "
          f"{doc['machine']['cpu']}: microseconds (cost against one row)")
    for t in args.types.split(","):
        raw = make(t, args.n, args.k)
        layers = {"int8": quants.QLinear(t, raw, args.n, args.k, activations="int8")}
        if base == "bf16":
            layers["bf16"] = quants.QLinear(t, raw, args.n, args.k, activations="bf16")
        else:
            w = quants.dequantize(t, raw, args.n, args.k)
            layers["torch-bf16"] = lambda x, w=w: torch.nn.functional.linear(x, w)
        xs = {m: torch.randn(m, args.k, generator=torch.Generator().manual_seed(m)).bfloat16() for m in rows}
        best = {a: {m: float("inf") for m in rows} for a in layers}
        for r in range(args.rounds):
            for a in ((base, "int8") if r % 2 == 0 else ("int8", base)):
                for m in rows:
                    t0 = time.perf_counter()
                    layers[a](xs[m])
                    best[a][m] = min(best[a][m], time.perf_counter() - t0)
        doc["types"][t] = {a: {str(m): 1e6 * s for m, s in v.items()} for a, v in best.items()}
        for a in (base, "int8"):
            one = best[a][rows[0]]
            print(f"{t:5s} {a:10s} " + "  ".join(f"{m}: {1e6 * best[a][m]:6.0f} ({best[a][m] / one:4.2f})" for m in rows))
    write_result(Path(args.out) if args.out else None, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
