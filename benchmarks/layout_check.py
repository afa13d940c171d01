"""The cost of proving a layout cache (hdcli/engine/model/layouts.py) before use: the digests of
every byte alone, and a later start's weights phase with the check and with it skipped.

    python benchmarks/synth_gguf.py --shape smollm2-1.7b --mix Q4_K_M -o /tmp/hd-synth-gguf/smollm2-1.7b-Q4_K_M.gguf
    python benchmarks/layout_check.py /tmp/hd-synth-gguf/smollm2-1.7b-Q4_K_M.gguf --cache /tmp/hd-layout-check
    python benchmarks/layout_check.py smollm2-135m --cache /tmp/hd-layout-check   # the bundled model

The first load fills --cache (a fresh folder: the packing and its writing take a minute at 1.7B on
2 cores); the later ones map it, --rounds of them, checked and unchecked interleaved, each an
in-process models.load (bf16, the GGUF GEMM, the M-invariant mode off: what the check adds, without
the calibration's noise). The file is in the page cache throughout (a later start reads it
from the disk either way: the map is populated before the check). "Unchecked" replaces the check by
nothing, for the comparison only: hd never skips it.
"""
from __future__ import annotations

import argparse
import mmap
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a .gguf path or a bundled name")
    ap.add_argument("--cache", required=True, help="HD_CACHE_DIR for the run (a fresh folder)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    os.environ["HD_CACHE_DIR"] = args.cache
    import torch
    from hdcli.engine import loader
    from hdcli.engine.model import layouts

    def load():
        t = time.perf_counter()
        lm = loader.load(args.model, dtype="bf16", device="cpu", kernels="auto", invariant="off", quiet=True)
        layouts.wait()
        return lm, time.perf_counter() - t

    lm, first = load()
    path = lm.info["layout_cache"]["path"]
    print(f"first load {first:.2f} s (cache hit: {lm.info['layout_cache']['hit']}); {path}, "
          f"{os.path.getsize(path) / 1e9:.3f} GB; digests {layouts.DIGEST}", flush=True)
    del lm
    with open(path, "rb") as f:
        index, data = layouts._index(f, os.path.getsize(path))
        m = mmap.mmap(f.fileno(), data, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
    checks = [(n, o, s, fmt, d, int(torch.Size(s).numel())) for n, (o, s, fmt, d) in index["entries"].items()]
    total = sum(c[5] for c in checks)
    view, best = memoryview(m), []
    for _ in range(5):
        t = time.perf_counter()
        assert layouts._mismatch(view, checks) is None
        best.append(time.perf_counter() - t)
    view.release()
    m.close()
    print(f"the check alone: {min(best):.3f} s for {total / 1e9:.3f} GB ({min(best) / total * 1e9:.3f} s a GB; "
          f"best of 5)", flush=True)
    real = layouts._mismatch
    got: dict[str, list] = {"checked": [], "unchecked": []}
    for _ in range(args.rounds):
        for label in got:
            layouts._mismatch = real if label == "checked" else (lambda view, entries: None)
            lm, seconds = load()
            assert lm.info["layout_cache"]["hit"]
            got[label].append((seconds, lm.info["load_phases"]["weights"]))
            del lm
    layouts._mismatch = real
    for label, runs in got.items():
        print(f"later load, {label}: weights phase {sorted(round(w, 3) for _, w in runs)} s, "
              f"whole load {sorted(round(s, 2) for s, _ in runs)} s", flush=True)


if __name__ == "__main__":
    main()
