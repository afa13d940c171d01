"""The fused attention (hdcli/engine/kernels/csrc/attend.cpp) built for AVX2 (-march=x86-64-v3) and
for the machine itself (-march=native), from this checkout's source and, with --against REV, from
another revision's: every build is loaded in one process, given the same inputs, checked for the
same bits (torch.equal) and timed in interleaved rounds (least of the medians).

Shapes are attention layers of the sizes users run: the bundled SmolLM2-135M (9 query heads, 3 kv
heads, head size 64), SmolLM2-1.7B (32/32/64) and Llama-3.1-8B (32/8/128), one token, 4 rows of a
chain and 4 requests of one token, over caches of 256 and 1024 keys, bf16 keys and values (what a
bf16 model stores). Where the machine has no AVX-512, "native" is AVX2 too.

    python benchmarks/attention_isa.py --against 162ddc3 --out benchmarks/results/gguf/attention_isa_zen5.json
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from hdcli.engine.kernels import build

from common import command_line, machine, write_result

SOURCE = Path(__file__).resolve().parents[1] / "hdcli/engine/kernels/csrc/attend.cpp"
SHAPES = {"135m": (9, 3, 64), "1.7b": (32, 32, 64), "8b": (32, 8, 128)}
CASES = [(1, 1), (4, 1), (1, 4)]   # (requests, rows each)


def compile_variant(source: Path, march: str, tag: str):
    from torch.utils import cpp_extension
    name = f"hd_attend_bench_{tag}_{abs(hash((source.read_text(), march))) % 10**10}"
    return cpp_extension.load(name=name, sources=[str(source)], extra_cflags=["-O3", march, "-ffp-contract=off", "-fopenmp"],
                              extra_ldflags=["-fopenmp"], verbose=False)


def inputs(shape, requests: int, rows: int, keys: int, seed: int = 0):
    hq, hkv, d = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(requests * rows, hq, d, generator=g)
    ks, vs, viss = [], [], []
    for _ in range(requests):
        k = torch.randn(hkv, keys, d, generator=g).bfloat16()
        v1 = torch.cat([torch.randn(hkv, keys, d, generator=g), torch.ones(hkv, keys, 1)], -1).bfloat16()
        vis = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
        ks.append(k), vs.append(v1), viss.append(vis)
    return q, ks, vs, viss


def call(module, args):
    q, ks, vs, viss = args
    return module.attend_many(q, ks, [None] * len(ks), [0] * len(ks), vs, viss, 0.125)


def median_us(module, args, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        call(module, args)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default=None, help="a git revision whose attend.cpp is built beside this one")
    ap.add_argument("--keys", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sources = {"this": SOURCE}
    if args.against:
        old = Path(tempfile.mkdtemp()) / "attend.cpp"
        old.write_text(subprocess.run(["git", "show", f"{args.against}:hdcli/engine/kernels/csrc/attend.cpp"],
                                      check=True, capture_output=True, text=True, cwd=SOURCE.parent).stdout)
        sources[args.against] = old
    variants = {}
    for label, src in sources.items():
        for isa, march in (("avx2", "-march=x86-64-v3"), ("native", "-march=native")):
            print(f"compiling {label} {isa} ...", flush=True)
            variants[f"{label}/{isa}"] = compile_variant(src, march, isa)
    rows = []
    for sname, shape in SHAPES.items():
        for keys in args.keys:
            for requests, each in CASES:
                a = inputs(shape, requests, each, keys)
                outs = {v: call(m, a) for v, m in variants.items()}
                ref = next(iter(outs.values()))
                same = all(torch.equal(ref, o) for o in outs.values())
                best = {v: float("inf") for v in variants}
                for r in range(args.rounds):
                    order = list(variants) if r % 2 == 0 else list(variants)[::-1]
                    for v in order:
                        best[v] = min(best[v], median_us(variants[v], a, args.reps))
                row = {"shape": sname, "keys": keys, "requests": requests, "rows_each": each, "same_bits": same,
                       **{f"{v}_us": round(t, 1) for v, t in best.items()}}
                rows.append(row)
                print(row, flush=True)
    doc = {"machine": machine(), "threads": args.threads, "flags": build.flags(), "rows": rows,
           "command": command_line("attention_isa.py", args)}
    write_result(args.out, doc)


if __name__ == "__main__":
    main()
