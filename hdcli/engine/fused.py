"""The M-invariant attention as one compiled loop per (query row, head) (csrc/attend.cpp), in place
of invariant.py's torch ops, where asked for (HD_FUSED_ATTENTION=1) and where it compiles.

Why: the invariant attention does little arithmetic, but in torch ops its fixed summation order
costs a dozen small ops and small batched GEMMs per layer: on an AMD EPYC (bundled model, int4,
caches of ~250 tokens) a fifth of a one-token forward and 40-53% of a forward with 4 requests
(docs/serve.md). The loop computes each (row, head) alone over its visible keys in index order:
scores by a fixed 16-lane dot product, the max, exp by a polynomial of our own, the weighted sum of
values in key order. A row's result cannot depend on the other rows, so it is M-invariant by
construction, for chains, trees and sliding windows alike (tests/test_invariant.py runs on both).

It is another summation order than the torch path, so it is another reference, as a kernel set is:
plain and speculative decoding use the same one in a process, and which one is part of every cache
key that depends on it (cost curves, the invariant calibration).

Parameters and invariants
  * Compiled once per source, CPU model, torch version and flags by torch.utils.cpp_extension
    (g++ and ninja; ~30 s, a progress line on stderr), cached under torch's extensions folder,
    named by a hash of all of these, so a binary built for another CPU is never loaded.
  * -O3 -march=native -ffp-contract=off, no -ffast-math: vector and scalar code round alike and
    no sum is reordered, whatever the compiler vectorises.
  * Opt-in (HD_FUSED_ATTENTION=1), not the default: measured on the AMD EPYC (bundled model, int4,
    caches of ~250 tokens, whole forwards, interleaved), fused against torch ops: 1 token 16.8 ms
    against 20.3, an 8-node tree 36.2 against 39.2, 4 requests of 1 token 30.2 against 34.0, of
    4-node trees 67.2 against 85.4; but a 16-token chain 55.6 against 47.9 and 4 requests of
    3-token chains 56.2 against 52.7. Each (row, head) reduces its 16 lanes per key by a scalar
    tree, which costs where many rows share the keys; the torch path's batched GEMMs do not.
  * Where it does not compile (no compiler or ninja) or the model is not on the CPU, the torch
    path stays (`decide` says why).
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "attend.cpp"
# -fopenmp: at::parallel_for runs on threads only where OpenMP is on in the extension itself; the
# process has one OpenMP runtime all the same (torch's libgomp is loaded first and shares its soname)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]

_module = None        # the compiled extension, once loaded
_failed: str | None = None
_on = False           # whether invariant.py's attention uses it now


def _name() -> str:
    from .costs import cpu_name
    h = hashlib.sha256((SOURCE.read_text() + cpu_name() + torch.__version__ + " ".join(FLAGS)).encode())
    return "hd_attend_" + h.hexdigest()[:12]


def load(quiet: bool = False):
    """The compiled module, or None where it cannot be built here (why: `failure()`)."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    try:
        from torch.utils.cpp_extension import load as build
        t0 = time.perf_counter()
        if not quiet:
            print("hd: compiling the fused attention (once per machine, ~30 s)...", file=sys.stderr, flush=True)
        _module = build(name=_name(), sources=[str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                        verbose=False)
        if not quiet:
            print(f"hd: fused attention ready ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    except Exception as exc:   # no compiler, no ninja, a read-only home: the torch path stays
        _failed = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return _module


def failure() -> str | None:
    return _failed


def use(on: bool) -> None:
    global _on
    _on = bool(on) and load(quiet=True) is not None


def enabled() -> bool:
    return _on


def name() -> str:
    """What the invariant attention is now: part of the cache keys that depend on its numerics."""
    return "fused" if _on else "torch"


def attend(q: torch.Tensor, k: torch.Tensor, v1: torch.Tensor, vis: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [m, hq, d] fp32 contiguous, k [hkv, >= n, d], v1 [hkv, >= n, d + 1], vis [m, n] bool.
    Returns [m, hq, d] fp32."""
    return _module.attend(q, k, v1, vis, float(scaling))


_decision: dict | None = None


def decide(model, quiet: bool = True) -> dict:
    """Whether the invariant attention uses the fused loop in this process: only where asked for
    (HD_FUSED_ATTENTION=1: not the default, see the module docstring's figures) and where it
    compiles; decided once per process, so that every model and run of a process has one numerics."""
    global _decision
    if _decision is not None:
        return _decision
    if os.environ.get("HD_FUSED_ATTENTION", "0") != "1":
        _decision = {"attention": "torch"}
    elif next(model.parameters()).device.type != "cpu" or load(quiet=quiet) is None:
        _decision = {"attention": "torch", "why": failure() or "not a CPU model"}
    else:
        use(True)
        _decision = {"attention": "fused"}
    return _decision
