"""llama.cpp's cost of verifying w tokens on a GGUF, beside hd's (`hd costs --json`), so a width's
price on both sides is on one page (issue 77, item 5).

llama.cpp's `llama-bench` (built beside llama-server from the pinned sdist: `make llama-server`
and `make llama-server-avx2` build it too) times prompt processing of w tokens after a cache of
--depth tokens (`-p w -n 0 -d depth`): what a speculative step's verification forward of w rows
is to it. cost(w) = that time over the one-token time at the same depth, as `hd costs` reports
its own. As AVX2 (HD_CPU set) the AVX2 build runs, as hd's GEMMs do; on a CPU with AMX the
native build runs with `--repack 0` (llama.cpp#20824: its AMX path segfaults on these Xeons;
bench/llamacpp.amx_off), which also turns off its CPU repacks for that build. hd's curve is
measured in the same process's run of `hd costs --remeasure --json`, one after the other (never
at once: two cores).

    python benchmarks/peer_costs.py --models BUNDLED,/tmp/hd-synth-gguf/smollm2-1.7b-Q4_K_M.gguf \
        --out benchmarks/results/gguf/peer_costs_native.json
    HD_CPU=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/peer_costs.py ...
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, machine, write_result  # noqa: E402

from hdcli.bench import llamacpp  # noqa: E402
from hdcli.engine import loader  # noqa: E402

HERE = Path(sys.executable).parent


def llama_bench() -> Path:
    """The llama-bench of this CPU path (the AVX2 build where HD_CPU is set)."""
    name = "llama-bench-avx2" if os.environ.get("HD_CPU") else "llama-bench"
    path = Path(os.environ.get("HD_LLAMA_BENCH", HERE / name))
    if not path.is_file():
        raise SystemExit(f"{path}: not found: run `make llama-server{'-avx2' if 'avx2' in name else ''}` "
                         "(it builds llama-bench too) or set HD_LLAMA_BENCH")
    return path


def peer_curve(binary: Path, gguf: str, widths: list[int], depth: int, reps: int, threads: int) -> dict:
    """llama-bench's mean time of a w-token batch after `depth` tokens, per w, and cost(w)."""
    cmd = [str(binary), "-m", gguf, "-p", ",".join(map(str, widths)), "-n", "0", "-d", str(depth),
           "-r", str(reps), "-t", str(threads), "-o", "json"]
    if llamacpp.amx_off() and not os.environ.get("HD_CPU"):
        cmd += ["--repack", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = {int(r["n_prompt"]): r["avg_ns"] / 1e6 for r in json.loads(out)}
    one = rows[1]
    return {"command": " ".join(cmd), "ms": rows, "one_token_ms": one,
            "cost": {w: round(rows[w] / one, 3) for w in widths}}


def hd_curve(gguf: str) -> dict:
    """`hd costs --remeasure --json` on this file: hd's one-token time and cost(w)."""
    out = subprocess.run([sys.executable, "-m", "hdcli", "costs", "--model", gguf, "--remeasure", "--json"],
                         capture_output=True, text=True, check=True).stdout
    doc = json.loads(out)
    kernels = doc["kernels"]
    c = doc["curves"][kernels]
    return {"kernels": kernels, "one_token_ms": c["one_token_ms"], "cost": c["cost"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", required=True, help="comma-separated GGUF paths or bundled names")
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--depth", type=int, default=256, help="tokens in the cache before the batch")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    widths = sorted({1, *(int(w) for w in args.widths.split(","))})
    binary = llama_bench()
    doc = {"command": command_line("benchmarks/peer_costs.py", args), "machine": machine(),
           "as_avx2": bool(os.environ.get("HD_CPU")), "llama_bench": str(binary), "models": {}}
    for name in args.models.split(","):
        kind, gguf = loader.resolve(name)
        if kind != "gguf":
            raise SystemExit(f"{name}: not a GGUF file (llama.cpp reads GGUFs only)")
        peer = peer_curve(binary, gguf, widths, args.depth, args.reps, args.threads)
        ours = hd_curve(gguf)
        doc["models"][Path(gguf).name] = {"llama.cpp": peer, "hd": ours}
        print(f"{Path(gguf).name}: one token llama.cpp {peer['one_token_ms']:.2f} ms, hd {ours['one_token_ms']:.2f} ms")
        for w in widths[1:]:
            print(f"    cost({w}): llama.cpp {peer['cost'][w]:.2f}, hd {ours['cost'].get(str(w), float('nan')):.2f}")
    write_result(Path(args.out) if args.out else None, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
