"""More cores, on paper and measured where possible: the target's forward time by verification
width at torch thread counts 1 and 2 on GGUFs of published shapes (random weights, synth_gguf.py),
a cost model fitted on the 1-thread figures and checked on the 2-thread ones, its cost curves at 8
and 16 cores, and hd's projected speed-up over hd plain there.

    python benchmarks/synth_gguf.py --shape smollm2-1.7b --mix Q4_K_M -o /tmp/hd-synth-gguf/smollm2-1.7b-Q4_K_M.gguf
    (likewise llama-3.2-3b and llama-3.1-8b)
    python benchmarks/cores.py --models /tmp/hd-synth-gguf/smollm2-1.7b-Q4_K_M.gguf \
        /tmp/hd-synth-gguf/llama-3.2-3b-Q4_K_M.gguf /tmp/hd-synth-gguf/llama-3.1-8b-Q4_K_M.gguf \
        --out benchmarks/results/gguf/cores.json

Kernels. hd's GGUF GEMM (csrc/qmm.cpp) needs AVX512-BF16 (quants.failure()); where it does not run
(this Zen 3 machine: AVX2 only) the loader dequantizes the blocks to bf16 and the GEMMs are torch's
(`layers_of` keys them "dense/bfloat16", B is then 2 bytes a weight). The microbenchmarks time the
layer kind the model actually has.

Threads. torch.set_num_threads sets OpenMP's thread count too (torch's libgomp, which hd's compiled
kernels share: build.py links them with -fopenmp and the process has one OpenMP runtime). The GGUF
GEMM (csrc/qmm.cpp) opens `#pragma omp parallel` without num_threads, so it runs on
omp_get_max_threads() threads; the fused attention (csrc/attend.cpp) asks at::get_num_threads().
Both follow torch.set_num_threads; `threads_check` in the JSON reads omp_get_max_threads() back
from libgomp after each setting.

Measured (per thread count c = 1, 2; least over --rounds interleaved rounds):
  * t(w, c): one forward over a chain of w new tokens on a --context-token cache (as
    hdcli/engine/decode/costs.py measures its cost curve), w = 1, 2, 4, 8, 16;
  * BW(c): read bandwidth, the higher of two probes: the sum of a --bw-mb float32 tensor, and hd's
    one-row GEMM of each quant type on a --stream-mb weight (out of cache), as GB/s of blocks read
    (docs/benchmarks.md, issue 37: torch's sum under-reads this machine, the GEMMs stream faster);
  * g(w, c): hd's GEMM of each quant type the models use, w rows, weights in cache
    (--gemm-n x --gemm-k), seconds per weight: compute alone, no memory stall; its one-row rate
    is reported as GFLOP/s (2 flops a weight a row).
Attention: HD_FUSED_ATTENTION=1 unless set (the compiled attention at both thread counts, where
the auto choice would time it against torch ops per shape and thread count).

Model (`predict`), per shape, c cores:
    t(w, c) = max(B / BW(c), G(w) / c) + a * w / c + s
  B     bytes of the model's GGUF weight blocks a forward reads (QLinear layers; the embedding's
        one row is left out);
  BW(c) = min(c * BW(1), BW_max), BW_max assumed = the measured 2-thread bandwidth (users'
        8-16-core machines have about this machine's memory bandwidth: the assumption);
  G(w)  = sum over the model's layers of (weights) * g_type(w, 1): the GEMMs' compute on one
        core (in-cache microbenchmark), parallel over cores;
  a, s  fitted on the 1-thread measurement (`fit`, least squares of t(w,1) - max(B/BW(1), G(w))
        against w): a the per-row rest (attention, norms, rope: parallel), s the per-forward rest
        (Python and op dispatch: serial).
It is checked against the measured 2-thread times (error %), then gives t(w, 8) and t(w, 16):
"projection (model)".

Speed-up (`speedups`): acceptance is what benchmarks/results/gguf/projection.json recorded on the
bundled model (so "projection": it assumes the large model accepts as the small one). That file
keeps, for each cost curve it capped the recorded trees with, the histogram of capped widths and
the mean accepted tokens (a "cap policy"), and for the uncapped trees the mean node count and mean
accepted tokens. For a cost curve t(., c) a policy's speed is
    mean accepted / mean over its steps of (t(w, c) + o),  o = the capped decoder's measured
    seconds a step outside the forward (single-threaded: not divided by cores),
and its speed-up over plain is that times t(1, c). The projected speed-up is the best capped
policy's (plain, speed-up 1, included); the uncapped trees' figure is given apart and is
optimistic (priced at t(mean width): the model's t is convex in w, so this under-prices it). A
cap re-tuned on the 8/16-core curve may choose other widths than the six recorded policies: the
figure is what those policies reach, not the cap's own optimum. c = 1, 2 use the measured t
(linear between measured widths), 8 and 16 the model.

Other shapes on paper (`shape_projection`, `project_shapes`): where a shape was not loaded (the 3B
and 8B take too long here, dequantized to bf16), the measured entry's constants are scaled to a
synth_gguf.py shape, no model loaded, and added under "shape_projections", every figure labelled
"projection (model, shape-scaled; not measured)" (c = 1, 2 included: the model, not a measurement):

    python benchmarks/cores.py --project-from benchmarks/results/gguf/cores.json \
        --shapes llama-3.2-3b llama-3.1-8b --out benchmarks/results/gguf/cores.json

The scaling's assumptions are in shape_projection's docstring.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# torch, hdcli and common (which imports torch) are imported in the measuring functions: the pure
# model (fit, predict, speedups) is imported by tests/benchmarks/test_cores_model.py without them

WIDTHS = (1, 2, 4, 8, 16)
THREADS = (1, 2)
CORES = (1, 2, 8, 16)


def log(msg: str) -> None:
    print(f"[cores {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the model (pure)

def interp(points: dict, w: float) -> float:
    """points {w: value} linear between widths, beyond the last with the last slope."""
    ws = sorted(points)
    if w <= ws[0]:
        return points[ws[0]]
    for lo, hi in zip(ws, ws[1:]):
        if w <= hi:
            return points[lo] + (w - lo) / (hi - lo) * (points[hi] - points[lo])
    lo, hi = ws[-2], ws[-1]
    return points[hi] + (w - hi) * (points[hi] - points[lo]) / (hi - lo)


def fit(seconds: dict, gemm: dict, bytes_: float, bw1: float) -> dict:
    """The 1-thread constants: least squares of rest(w) = t(w,1) - max(B/BW(1), G(w)) = s + a w.
    seconds, gemm: {w: seconds} at 1 thread (gemm: G(w), the GEMMs' compute). s is kept >= 0
    (a negative serial part is refitted as s = 0, a through the origin). Raises ValueError for
    fewer than two widths, non-positive times, or times below the model's own floor (rest < 0 at
    every width: the inputs do not describe one machine)."""
    ws = sorted(seconds)
    if len(ws) < 2:
        raise ValueError("fit needs at least two widths")
    if any(not (seconds[w] > 0) for w in ws) or bytes_ <= 0 or bw1 <= 0:
        raise ValueError("times, bytes and bandwidth must be positive")
    rest = {w: seconds[w] - max(bytes_ / bw1, interp(gemm, w)) for w in ws}
    if all(r < 0 for r in rest.values()):
        raise ValueError("every measured time is below the bandwidth/compute floor")
    mw, mr = statistics.mean(ws), statistics.mean(rest.values())
    a = sum((w - mw) * (rest[w] - mr) for w in ws) / sum((w - mw) ** 2 for w in ws)
    s = mr - a * mw
    if s < 0:
        s, a = 0.0, sum(w * rest[w] for w in ws) / sum(w * w for w in ws)
    a = max(a, 0.0)
    return {"s": s, "a": a, "bytes": bytes_, "bw1": bw1, "gemm": {int(w): float(g) for w, g in gemm.items()},
            "fit_residual_max_pct": 100 * max(abs(predict_1(w, s, a, gemm, bytes_, bw1) - seconds[w]) / seconds[w]
                                              for w in ws)}


def predict_1(w, s, a, gemm, bytes_, bw1) -> float:
    return max(bytes_ / bw1, interp(gemm, w)) + a * w + s


def predict(consts: dict, w: float, c: int, bw_max: float) -> float:
    """t(w, c) = max(B / min(c BW(1), BW_max), G(w) / c) + a w / c + s."""
    bw = min(c * consts["bw1"], bw_max)
    return max(consts["bytes"] / bw, interp(consts["gemm"], w) / c) + consts["a"] * w / c + consts["s"]


def policy_speedup(hist: dict, accepted: float, t, overhead: float) -> float:
    """Speed-up over plain (one token per t(1)) of a cap policy: `hist` {width: steps}, `accepted`
    mean tokens a step, t(w) seconds of a forward, overhead seconds a step outside it."""
    n = sum(hist.values())
    per_step = sum(k * (t(int(w)) + overhead) for w, k in hist.items()) / n
    return accepted / per_step * t(1)


def speedups(policies: list[dict], t, overhead: float) -> dict:
    """The best capped policy (plain included) and the uncapped trees' optimistic figure for one
    cost curve t. policies: {"name", "histogram", "mean_accepted"} or, uncapped, "mean_width"."""
    best = {"policy": "plain", "speedup": 1.0}
    uncapped = None
    for p in policies:
        if "histogram" in p:
            x = policy_speedup(p["histogram"], p["mean_accepted"], t, overhead)
            if x > best["speedup"]:
                best = {"policy": p["name"], "speedup": x}
        else:
            w = p["mean_width"]
            uncapped = p["mean_accepted"] / (t(w) + overhead) * t(1)
    return {"best_capped": best, "uncapped_optimistic": uncapped}


def policies_from(projection: dict) -> tuple[list[dict], float]:
    """Cap policies and the step overhead (seconds) recorded in projection.json."""
    b = projection["bundled"]
    out = [{"name": "uncapped", "mean_width": b["uncapped"]["mean_nodes"] + 1,
            "mean_accepted": b["uncapped"]["mean_accepted"]}]
    for r in [b["self_replay"]] + projection["models"]:
        out.append({"name": f"cap of {Path(r['source']).name}",
                    "histogram": {int(w): k for w, k in r["cap"]["histogram"].items()},
                    "mean_accepted": r["cap"]["mean_accepted_projection"]})
    return out, b["measured"]["mean_overhead_ms"] / 1000


# ---------------------------------------------------------------- other shapes, on paper

def shape_weights(shape: str) -> int:
    """Weights of the Linear layers a forward runs, as hd loads synth_gguf.py's `shape`: per layer
    q, k, v, o and the three FFN matrices, plus the output head (vocab x hidden), which is one
    Linear whether tied to token_embd or not (tied: it shares the embedding's matrix; untied:
    output.weight, and the embedding then adds only the one row a token looks up, left out as
    layers_of leaves it out). Matches the measured smollm2-1.7b entry's `weights_by_type`."""
    from synth_gguf import SHAPES
    s = SHAPES[shape]
    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    per_layer = q * h + 2 * kv * h + h * q + 3 * s["ff"] * h
    return s["layers"] * per_layer + s["vocab"] * h


def shape_of(entry: dict) -> str:
    """The SHAPES name a measured entry was loaded from (its file name starts with it, and its
    weight count must be that shape's: else ValueError)."""
    from synth_gguf import SHAPES
    name = Path(entry["source"]).name
    hits = [k for k in SHAPES if name.startswith(k + "-") or name.startswith(k + ".")]
    if len(hits) != 1:
        raise ValueError(f"{name}: not one synth_gguf.py shape ({hits})")
    if shape_weights(hits[0]) != sum(entry["weights_by_type"].values()):
        raise ValueError(f"{name}: {sum(entry['weights_by_type'].values())} weights, "
                         f"shape {hits[0]} has {shape_weights(hits[0])}")
    return hits[0]


def shape_projection(entry: dict, shape: str, bw1: float, ref_shape: str | None = None) -> dict:
    """The measured `entry`'s constants (a cores.json "models" row) scaled to another SHAPES name,
    as the model's `consts` (predict's input) plus the scaling ratios. No model is loaded.
    Assumptions (paper, not measured):
      * B: the shape's Linear weights x the entry's bytes a weight (weight_bytes / weights: 2 on
        this machine, dense bf16), the embedding's one row left out (shape_weights);
      * G(w): the shape's weights x the entry's one-core GEMM seconds a weight at width w
        (gemm_compute_ms_1_thread / weights): the per-weight rate of the in-cache microbenchmark
        does not change with the matrices' dimensions;
      * s (serial, per forward: Python and op dispatch) scales with the layer count;
      * a (per row: attention, norms, rope) scales with layers x hidden;
      * bw1, BW_max: the same machine's (the caller passes the recorded ones)."""
    from synth_gguf import SHAPES
    ref_shape = ref_shape or shape_of(entry)
    ref, tgt = SHAPES[ref_shape], SHAPES[shape]
    n_ref, n = sum(entry["weights_by_type"].values()), shape_weights(shape)
    per_weight_bytes = entry["weight_bytes"] / n_ref
    layers = tgt["layers"] / ref["layers"]
    rows = layers * tgt["hidden"] / ref["hidden"]
    fit_ = entry["fit"]
    consts = {"s": fit_["s_ms"] / 1000 * layers, "a": fit_["a_ms_per_row"] / 1000 * rows,
              "bytes": n * per_weight_bytes, "bw1": bw1,
              "gemm": {int(w): float(ms) / 1000 / n_ref * n for w, ms in entry["gemm_compute_ms_1_thread"].items()}}
    return {"consts": consts, "weights": n, "from_shape": ref_shape,
            "ratios": {"weights": n / n_ref, "layers": layers, "layers_x_hidden": rows}}


SHAPE_LABEL = "projection (model, shape-scaled; not measured)"


def project_shapes(doc: dict, shapes: list[str], policies: list[dict], overhead: float) -> dict:
    """doc["shape_projections"]: each shape's scaled constants, cost curves at CORES and speed-up
    (speedups over policies_from's recorded policies), from doc's first "models" entry and its
    recorded bandwidths. Every figure model-only: SHAPE_LABEL."""
    entry = doc["models"][0]
    bw1 = doc["bandwidth_gb_per_s"]["used_BW_c"]["1"] * 1e9
    bw_max = doc["bw_max_gb_per_s_assumed"] * 1e9
    out = {}
    for shape in shapes:
        p = shape_projection(entry, shape, bw1)
        consts = p["consts"]
        curves = {}
        for c in CORES:
            t = (lambda c: lambda w: predict(consts, w, c, bw_max))(c)
            curves[c] = {"label": SHAPE_LABEL, "ms": {w: 1000 * t(w) for w in WIDTHS}, "one_token_ms": 1000 * t(1),
                         "cost": {w: t(w) / t(1) for w in WIDTHS},
                         "speedup_projection": speedups(policies, t, overhead)}
        out[shape] = {"label": SHAPE_LABEL, "from_measured": entry["source"], "from_shape": p["from_shape"],
                      "weights": p["weights"], "weight_bytes": consts["bytes"], "ratios": p["ratios"],
                      "gemm_compute_ms_1_thread": {w: 1000 * g for w, g in consts["gemm"].items()},
                      "s_ms": 1000 * consts["s"], "a_ms_per_row": 1000 * consts["a"],
                      "assumptions": "B = Linear weights x the measured bytes a weight (bf16: 2), embedding row "
                                     "left out, output head counted once (tied or not); G(w) = weights x the "
                                     "measured one-core GEMM seconds a weight; s x layer ratio; a x layers*hidden "
                                     "ratio; this machine's BW(1) and BW_max; acceptance of projection.json",
                      "curves": curves}
    return out


# ---------------------------------------------------------------- measurements

def set_threads(n: int) -> int:
    """torch's (and so OpenMP's) threads; returns omp_get_max_threads() read back from libgomp."""
    import ctypes
    import torch
    torch.set_num_threads(n)
    try:
        libs = {p for p in open("/proc/self/maps").read().split() if "libgomp" in p}
        return int(ctypes.CDLL(sorted(libs)[0]).omp_get_max_threads()) if libs else -1
    except OSError:
        return -1


def bandwidth(mb: int, rounds: int) -> dict:
    """Read bandwidth (GB/s) of summing an mb-MB float32 tensor, least time per thread count."""
    import torch
    x = torch.ones(mb * 2 ** 18)
    best = {c: math.inf for c in THREADS}
    for r in range(rounds + 1):
        for c in (THREADS if r % 2 == 0 else THREADS[::-1]):
            set_threads(c)
            t0 = time.perf_counter()
            x.sum()
            dt = time.perf_counter() - t0
            if r:
                best[c] = min(best[c], dt)
    return {c: x.numel() * 4 / best[c] / 1e9 for c in THREADS}


def gemm_seconds(types: dict, n: int, k: int, rounds: int) -> dict:
    """Seconds per weight of hd's GEMM, {type/activations: {c: {w: s}}}, in cache (n x k)."""
    import torch
    out = {}
    for key in types:
        layer, dt, _ = make_layer(key, n, k)
        xs = {w: torch.randn(w, k, generator=torch.Generator().manual_seed(w)).to(dt) for w in WIDTHS}
        best = {c: {w: math.inf for w in WIDTHS} for c in THREADS}
        for r in range(rounds + 1):
            for c in (THREADS if r % 2 == 0 else THREADS[::-1]):
                set_threads(c)
                for w in WIDTHS:
                    for _ in range(5):
                        t0 = time.perf_counter()
                        layer(xs[w])
                        el = time.perf_counter() - t0
                        if r:
                            best[c][w] = min(best[c][w], el)
        out[key] = {c: {w: best[c][w] / (n * k) for w in WIDTHS} for c in THREADS}
    return out


def gemm_stream(types, stream_mb: int, k: int, rounds: int) -> dict:
    """One-row GEMM out of cache (a weight of ~stream_mb MB): {type/activations: {c: GB/s of blocks}}.
    A bandwidth probe that reads as the model's GEMMs read (torch's sum under-reads this machine:
    docs/benchmarks.md, issue 37)."""
    import torch
    out = {}
    for key in types:
        _, dt, per = make_layer(key, 16, k)   # bytes of 16 output rows
        n = max(16, stream_mb * 2 ** 20 // (per // 16) // 16 * 16)
        layer, dt, nb = make_layer(key, n, k)
        x = torch.randn(1, k).to(dt)
        best = {c: math.inf for c in THREADS}
        for r in range(rounds + 1):
            for c in (THREADS if r % 2 == 0 else THREADS[::-1]):
                set_threads(c)
                for _ in range(3):
                    t0 = time.perf_counter()
                    layer(x)
                    el = time.perf_counter() - t0
                    if r:
                        best[c] = min(best[c], el)
        out[key] = {c: nb / best[c] / 1e9 for c in THREADS}
        del layer
    return out


def layers_of(lm) -> dict:
    """{kernel key: weights}, and bytes of the weights a forward reads, over the model's Linear
    layers: "Q4_K/int8" (a GGUF-kernel QLinear, type/activations) or "dense/bf16" (dequantized
    weights on torch's or oneDNN's GEMM: where the GGUF kernel does not run, e.g. no AVX512-BF16)."""
    from hdcli.engine.kernels import quants
    from hdcli.engine.model.parts import Linear
    weights, nbytes = {}, 0
    for m in lm.model.module.modules():
        if not isinstance(m, Linear):
            continue
        k = m.kernel
        if isinstance(k, quants.QLinear):
            key = f"{k.qtype}/{k.activations}"
            nbytes += k.packed.numel() * k.packed.element_size()
        else:
            dt = m.dtype
            key = f"dense/{str(dt).replace('torch.', '')}"
            nbytes += m.in_features * m.out_features * dt.itemsize
        weights[key] = weights.get(key, 0) + m.in_features * m.out_features
    if not weights:
        raise SystemExit(f"{lm.source}: no Linear layers found")
    return {"weights": weights, "bytes": nbytes}


def make_layer(key: str, n: int, k: int):
    """A layer computing as the model's layers of `key` do (layers_of), random weights."""
    import torch
    t, act = key.split("/")
    if t == "dense":   # torch's GEMM in that dtype (oneDNN-packed layers are timed as torch's)
        lin = torch.nn.Linear(k, n, bias=False, dtype=getattr(torch, act))
        lin.requires_grad_(False)
        return lin, getattr(torch, act), n * k * getattr(torch, act).itemsize
    sys.path.insert(0, str(HERE.parent / "tests"))
    from test_quants import make
    from hdcli.engine.kernels import quants
    layer = quants.QLinear(t, make(t, n, k), n, k, activations=act)
    return layer, torch.bfloat16, layer.packed.numel() * layer.packed.element_size()


def forward_seconds(lm, context: int, rounds: int) -> dict:
    """{c: {w: least seconds}} of a w-token chain forward on a context-token cache, the thread
    counts and widths interleaved in rotated order each round (costs.measure_seconds' method)."""
    import torch
    m = lm.model
    vocab = m.config.vocab_size
    with torch.inference_mode():
        cache = m.new_cache()
        m.forward(torch.arange(context)[None] % vocab, cache)
        base = cache.get_seq_length()
        inputs = {w: (torch.arange(w)[None] * 7 + 11) % vocab for w in WIDTHS}

        def once(w):
            t0 = time.perf_counter()
            m.forward(inputs[w], cache)
            dt = time.perf_counter() - t0
            cache.crop(-(cache.get_seq_length() - base))
            return dt

        best = {c: {w: math.inf for w in WIDTHS} for c in THREADS}
        for c in THREADS:   # warm-up, not timed
            set_threads(c)
            for w in WIDTHS:
                once(w)
        for r in range(rounds):
            for c in (THREADS if r % 2 == 0 else THREADS[::-1]):
                set_threads(c)
                shift = r % len(WIDTHS)
                for w in WIDTHS[shift:] + WIDTHS[:shift]:
                    best[c][w] = min(best[c][w], once(w))
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", help="GGUF files (synth_gguf.py)")
    ap.add_argument("--project-from", help="a recorded cores.json: add shape_projections for --shapes "
                    "(scaled from its measured entry, no model loaded) and write it to --out")
    ap.add_argument("--shapes", nargs="+", default=["llama-3.2-3b", "llama-3.1-8b"],
                    help="synth_gguf.py shapes for --project-from")
    ap.add_argument("--projection", default=str(HERE / "results" / "gguf" / "projection.json"),
                    help="acceptance recorded by projection.py")
    ap.add_argument("--context", type=int, default=64, help="cache length of the timed forwards")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (least time kept)")
    ap.add_argument("--bw-mb", type=int, default=1024, help="MB summed for the bandwidth")
    ap.add_argument("--gemm-n", type=int, default=2048)
    ap.add_argument("--gemm-k", type=int, default=2048)
    ap.add_argument("--stream-mb", type=int, default=256, help="MB of the out-of-cache one-row GEMM")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    if args.project_from:
        return project_main(args)
    if not args.models:
        ap.error("--models or --project-from is needed")

    # the compiled attention at every thread count, not a per-(shape, threads) timed choice: one
    # forward for both thread counts (and no minute of choosing per shape); set it to 0 to compare
    os.environ.setdefault("HD_FUSED_ATTENTION", "1")
    import gc
    from common import command_line, machine, write_result
    from hdcli import api
    from hdcli.engine import records

    threads_check = {c: set_threads(c) for c in THREADS}
    log(f"threads: torch -> omp_get_max_threads {threads_check}")
    bw = bandwidth(args.bw_mb, max(args.rounds, 3))
    log(f"read bandwidth (torch sum) GB/s: {bw}")
    proj = json.loads(Path(args.projection).read_text())
    policies, overhead = policies_from(proj)

    shapes, rows = [], []
    for path in args.models:
        log(f"loading {path}")
        t0 = time.perf_counter()
        lm = api.load_model(path)
        load_s = time.perf_counter() - t0
        lay = layers_of(lm)
        log(f"  loaded in {load_s:.0f}s: {lay['bytes'] / 1e9:.2f} GB of blocks, {lay['weights']}")
        secs = forward_seconds(lm, args.context, args.rounds)
        log("  t(w) ms: " + "; ".join(f"{c} thr " + " ".join(f"{w}:{1000 * s:.1f}" for w, s in v.items())
                                      for c, v in secs.items()))
        shapes.append((path, lm.name, (lm.kernels, (lm.info.get("numerics") or {}).get("attention")), lay, secs, load_s))
        del lm
        gc.collect()

    needed = sorted({k for _, _, _, lay, _, _ in shapes for k in lay["weights"]})
    log(f"GEMM microbenchmark: {needed}")
    g = gemm_seconds(needed, args.gemm_n, args.gemm_k, args.rounds)
    streams = gemm_stream(needed, args.stream_mb, args.gemm_k, args.rounds)
    log(f"  one-row GEMM out of cache, GB/s of blocks: {streams}")
    # BW(c): the higher of torch's sum and the GEMMs' own stream (the data say the sum under-reads)
    bw_eff = {c: max([bw[c]] + [v[c] for v in streams.values()]) for c in THREADS}
    bw_max = bw_eff[2]
    gemm_rates = {k: {c: {"one_row_gflops": 2 / v[c][1] / 1e9,
                          "seconds_per_weight": {w: v[c][w] for w in WIDTHS}} for c in THREADS} for k, v in g.items()}

    for path, name, (kernels, attention), lay, secs, load_s in shapes:
        G = {c: {w: sum(n * g[k][c][w] for k, n in lay["weights"].items()) for w in WIDTHS} for c in THREADS}
        consts = fit(secs[1], G[1], lay["bytes"], bw_eff[1] * 1e9)
        check = {w: {"measured_ms": 1000 * secs[2][w], "predicted_ms": 1000 * predict(consts, w, 2, bw_max * 1e9),
                     "error_pct": 100 * (predict(consts, w, 2, bw_max * 1e9) / secs[2][w] - 1)} for w in WIDTHS}
        curves = {}
        for c in CORES:
            if c in THREADS:
                sec = {w: s for w, s in secs[c].items()}
                t = (lambda sec: lambda w: interp(sec, w))(sec)
                label = "measured"
            else:
                t = (lambda c: lambda w: predict(consts, w, c, bw_max * 1e9))(c)
                label = "projection (model)"
            curves[c] = {"label": label, "one_token_ms": 1000 * t(1),
                         "cost": {w: t(w) / t(1) for w in WIDTHS},
                         "speedup_projection": speedups(policies, t, overhead)}
        model_at_2 = speedups(policies, lambda w: predict(consts, w, 2, bw_max * 1e9), overhead)
        rows.append({"model": name, "source": path, "kernels": kernels, "attention": attention, "load_seconds": load_s,
                     "weight_bytes": lay["bytes"], "weights_by_type": lay["weights"],
                     "measured_ms": {c: {w: 1000 * s for w, s in v.items()} for c, v in secs.items()},
                     "gemm_compute_ms_1_thread": {w: 1000 * v for w, v in G[1].items()},
                     "fit": {"s_ms": 1000 * consts["s"], "a_ms_per_row": 1000 * consts["a"],
                             "bandwidth_floor_ms_1_thread": 1000 * lay["bytes"] / (bw_eff[1] * 1e9),
                             "bandwidth_floor_ms_bw_max": 1000 * lay["bytes"] / (bw_max * 1e9),
                             "fit_residual_max_pct": consts["fit_residual_max_pct"]},
                     "check_2_threads": check, "curves": curves,
                     "speedup_projection_model_at_2": model_at_2})
        log(f"  {Path(path).name}: s {1000 * consts['s']:.1f} ms, a {1000 * consts['a']:.2f} ms/row; 2-thread check "
            + " ".join(f"{w}:{v['error_pct']:+.0f}%" for w, v in check.items()))

    doc = {"command": command_line("cores.py", args), "machine": machine(), "cpu": records.cpu_name(),
           "note": "'projection' figures: t(w, 8/16) from the model fitted on 1 thread (checked on 2); "
                   "acceptance as recorded on the bundled model (projection.json)",
           "model": "t(w,c) = max(B / min(c BW(1), BW_max), G(w)/c) + a w / c + s; BW(c) measured = the higher of "
                    "torch's sum and the one-row out-of-cache GEMM's stream; BW_max = BW(2) (assumed: 8-16-core "
                    "machines with this machine's bandwidth); G from the in-cache GEMM microbenchmark; s, a fitted on 1 thread",
           "speedup_method": "best of projection.json's recorded cap policies: mean accepted / mean (t(w,c) + o) "
                             "x t(1,c), o the capped decoder's step overhead (not divided by cores); uncapped "
                             "trees priced at t(mean width), optimistic",
           "threads_check_omp_get_max_threads": threads_check,
           "bandwidth_gb_per_s": {"torch_sum": bw, "one_row_gemm_stream": streams, "used_BW_c": bw_eff},
           "bw_max_gb_per_s_assumed": bw_max, "step_overhead_ms": 1000 * overhead,
           "gemm": gemm_rates, "models": rows}
    write_result(Path(args.out) if args.out else None, doc)
    if not args.out:
        print(json.dumps(doc, indent=1))
    print(f"{'model':30s} " + " ".join(f"{f'cost(4/8) {c}c':>16s}" for c in CORES) + "  "
          + " ".join(f"{f'x {c}c':>6s}" for c in CORES), file=sys.stderr)
    for r in rows:
        cv = r["curves"]
        print(f"{Path(r['source']).name[:30]:30s} "
              + " ".join(f"{cv[c]['cost'][4]:7.2f}/{cv[c]['cost'][8]:<8.2f}" for c in CORES) + "  "
              + " ".join(f"{cv[c]['speedup_projection']['best_capped']['speedup']:6.2f}" for c in CORES), file=sys.stderr)
    return 0


def project_main(args) -> int:
    """--project-from: the recorded JSON with "shape_projections" added (the measured entries kept)."""
    doc = json.loads(Path(args.project_from).read_text())
    policies, overhead = policies_from(json.loads(Path(args.projection).read_text()))
    doc["shape_projections"] = project_shapes(doc, args.shapes, policies, overhead)
    doc["shape_projections_command"] = ("python benchmarks/cores.py --project-from " + args.project_from
                                        + " --shapes " + " ".join(args.shapes)
                                        + (f" --out {args.out}" if args.out else ""))
    text = json.dumps(doc, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text, end="")
    print(f"{'shape':16s} {'1 tok ms 1/2/8/16c':>28s}  {'cost(4) 2/8/16c':>18s}  {'cost(8) 2/8/16c':>18s}  "
          f"{'x 2/8/16c':>16s}", file=sys.stderr)
    for name, p in doc["shape_projections"].items():
        cv = {int(c): v for c, v in p["curves"].items()}
        print(f"{name:16s} " + " ".join(f"{cv[c]['one_token_ms']:6.0f}" for c in CORES) + "  "
              + " ".join(f"{cv[c]['cost'][4]:5.2f}" for c in (2, 8, 16)) + "  "
              + " ".join(f"{cv[c]['cost'][8]:5.2f}" for c in (2, 8, 16)) + "  "
              + " ".join(f"{cv[c]['speedup_projection']['best_capped']['speedup']:5.2f}" for c in (2, 8, 16)),
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
