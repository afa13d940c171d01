"""The int8 GGUF GEMM of an earlier commit against the working tree's, on the same packed weights,
interleaved in one process (a kernel change's before and after, free of the machine's drift).

The earlier csrc/qmm.cpp is built as an extension of its own (its pybind class made module-local,
so both load), with the flags this process builds with (HD_CPU=avx2 for the AVX2 path). Every
timed output is first checked torch.equal between the two: a kernel change that moves a bit is
refused here before it is timed. Random blocks in valid formats (tests/test_quants.py's `make`).

    HD_CPU=avx2 python benchmarks/gemm_ab.py --before e0e593c --out benchmarks/results/gguf/gemm_ab.json
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from common import command_line, machine, write_result  # noqa: E402
from test_quants import make  # noqa: E402

from hdcli.engine.kernels import build, quants  # noqa: E402

SOURCE = "hdcli/engine/kernels/csrc/qmm.cpp"


def earlier(commit: str):
    """The GEMM extension of `commit`, built beside the working tree's."""
    from torch.utils import cpp_extension
    text = subprocess.run(["git", "show", f"{commit}:{SOURCE}"], cwd=HERE.parent, capture_output=True, text=True,
                          check=True).stdout
    text = text.replace('(m, "Layers", ', '(m, "LayersBefore", py::module_local(), ')   # both modules load
    folder = Path(tempfile.mkdtemp(prefix="hd-gemm-ab-"))
    (folder / "qmm_before.cpp").write_text(text)
    name = f"hd_qmm_before_{hashlib.sha256((text + ' '.join(build.flags())).encode()).hexdigest()[:12]}"   # built once
    return cpp_extension.load(name=name, sources=[str(folder / "qmm_before.cpp")], extra_cflags=build.flags())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the commit whose GEMM is the baseline")
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_0,Q5_K,IQ4_XS")
    ap.add_argument("--n", type=int, default=28672, help="output columns (an 8B's gate and up: past any cache)")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    now = quants.gemm_module()
    if now is None or not quants.int8_available():
        print(f"the int8-activation GEMM does not run here ({quants.failure()})")
        return 1
    before = earlier(args.before)
    rows = [int(r) for r in args.rows.split(",")]
    doc = {"command": command_line("gemm_ab.py", args), "machine": machine(), "gemm": quants.gemm_isa(),
           "flags": build.flags(), "shape": [args.n, args.k], "types": {}}
    print(f"N x K = {args.n} x {args.k}, {torch.get_num_threads()} threads, least of {args.rounds}, "
          f"{doc['machine']['cpu']}, {doc['gemm']}: microseconds (cost against one row)")
    for t in args.types.split(","):
        lin = quants.QLinear(t, make(t, args.n, args.k), args.n, args.k, activations="int8")
        xs = {m: torch.randn(m, args.k, generator=torch.Generator().manual_seed(m)).bfloat16() for m in rows}
        for m in rows:
            if not torch.equal(before.mm8(xs[m], lin.packed, lin.fmt), now.mm8(xs[m], lin.packed, lin.fmt)):
                print(f"{t}, {m} rows: the two GEMMs give other bits: not timed")
                return 1
        best = {w: {m: float("inf") for m in rows} for w in ("before", "now")}
        for r in range(args.rounds):
            for w, mod in ((("before", before), ("now", now)) if r % 2 == 0 else (("now", now), ("before", before))):
                for m in rows:
                    t0 = time.perf_counter()
                    mod.mm8(xs[m], lin.packed, lin.fmt)
                    best[w][m] = min(best[w][m], time.perf_counter() - t0)
        doc["types"][t] = {w: {m: round(best[w][m] * 1e6, 1) for m in rows} for w in best}
        for w in best:
            print(f"{t:6s} {w:6s} " + "  ".join(f"{m}: {best[w][m] * 1e6:6.0f} ({best[w][m] / best[w][1]:.2f})"
                                                for m in rows))
    write_result(Path(args.out) if args.out else None, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
