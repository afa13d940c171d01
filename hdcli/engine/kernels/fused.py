"""The M-invariant attention as one compiled function (csrc/attend.cpp), in place of invariant.py's
torch ops on the CPU, where it compiles and where it is measured faster on the machine at hand.

Why: the invariant attention does little arithmetic, but in torch ops its fixed summation order
costs a dozen small ops and small batched GEMMs per layer: with the bundled model a fifth of a
one-token forward and about half of a forward with 4 requests (docs/serve.md). The compiled function fixes each query row's arithmetic (csrc/attend.cpp's
header): every score a dot product summed over the head in order, the max over the keys the row
sees, exp by a polynomial of our own, the values summed in key order. Rows share loops in tiles
but never a sum, so a row's result cannot depend on the other rows: it is M-invariant by
construction, for chains, trees and sliding windows alike (tests/test_invariant.py, test_batch.py).

It is another summation order than the torch path, so it is another reference, as a kernel set is:
plain and speculative decoding use the same one in a process, and which one (`name()`, with a hash
of the source) is part of every cache key that depends on it (cost curves, the invariant
calibration).

Parameters and invariants
  * Compiled once per source, CPU model, torch version and flags by torch.utils.cpp_extension
    (g++ and ninja; a progress line on stderr while it takes), cached under torch's extensions folder,
    named by a hash of all of these, so a binary built for another CPU is never loaded.
  * -O3 -march=native -ffp-contract=off, no -ffast-math: vector and scalar code round alike and
    no sum is reordered, whatever the compiler vectorises. -fopenmp: its parallel loops use
    torch's threads (the process keeps one OpenMP runtime: torch's, loaded first).
  * HD_FUSED_ATTENTION: 1 uses it wherever it compiles, 0 never; unset (auto), `decide` times both
    attentions on the model's head shape (one token, an 8-node tree and a 16-token chain over 256
    keys, interleaved rounds, least times) and takes the faster. The choice is cached per source,
    CPU, torch, flags, head shape and thread count (HD_CACHE_DIR/attention), so a machine decides
    once. Whole forwards with it and without: benchmarks/fused_attention.py, docs/dtype.md (it
    gains most on trees and on several requests a forward).
  * Decided once per process (the first model loaded in the invariant mode): every model and run
    of a process has one numerics.
  * Where it does not compile (no compiler or ninja), the model is not on the CPU or its head is
    wider than the function takes, the torch path stays (`decide` says why).
"""
from __future__ import annotations

import functools
import sys
import threading
from pathlib import Path

import torch

from .build import OnePerProcess, compile_extension, extension_name, is_built
from ..environment import fused_attention, fused_tile

SOURCE = Path(__file__).with_name("csrc") / "attend.cpp"


@functools.lru_cache(maxsize=1)
def _name() -> str:
    return extension_name(SOURCE, "hd_attend_")


KEY_BLOCK = 16       # csrc/attend.cpp's KB: keys a block of the transposed copy


class AttentionKernel(OnePerProcess):
    """Which invariant attention a process runs, and the compiled one: its module once loaded
    (`failed` says why it did not build), whether the invariant attention uses it now (`on`) and
    what decided that (`decision`, invariant.decide / pinned / require). One a process (KERNEL):
    every model and run of a process has one numerics; an owned model holds it
    (LlamaForward.attention_kernel) and its forward reads it there."""

    def __init__(self):
        self.module = None               # the compiled extension, once loaded
        self.failed: str | None = None
        self.on = False
        self.decision: dict | None = None
        self._beside: threading.Thread | None = None   # a build started beside another (build_beside)

    def build_beside(self) -> None:
        """Start building the function in a thread while another kernel compiles (the GGUF GEMM
        at a first start, quants.GemmKernel.load): g++ compiles one source on one core, so the
        two builds take the longer one's time, not their sum. A first start on a 2-core AVX2
        CPU compiled this long after the GEMM, and then timed it slower than torch ops and did
        not use it. The decision (invariant.decide) waits for the build, as before."""
        if self.module is not None or self.failed is not None or self._beside is not None:
            return
        if fused_attention() == "0" or is_built(_name()):
            return
        self._beside = threading.Thread(target=self._load, kwargs={"quiet": True}, daemon=True,
                                        name="hd-build-fused-attention")
        self._beside.start()

    def load(self, quiet: bool = False):
        """The compiled module, or None where it cannot be built here (why: `failure()`)."""
        beside = self._beside
        if beside is not None and beside is not threading.current_thread():
            if beside.is_alive() and not quiet:
                print("hd: waiting for the fused attention's build...", file=sys.stderr, flush=True)
            beside.join()
        return self._load(quiet)

    def _load(self, quiet: bool):
        if self.module is not None or self.failed is not None:
            return self.module
        self.module, self.failed = compile_extension(SOURCE, _name(), "the fused attention", quiet)
        if self.module is not None:
            self.module.set_tile(fused_tile())
        return self.module

    def failure(self) -> str | None:
        return self.failed

    def use(self, on: bool) -> None:
        self.on = bool(on) and self.load(quiet=True) is not None

    def runs_on(self, device) -> bool:
        """Whether the invariant attention on `device` is this one (on the CPU, where chosen); it
        also appends new keys itself (append_attend_many)."""
        return self.on and (device.type if isinstance(device, torch.device) else torch.device(device).type) == "cpu"

    def name(self) -> str:
        """What the invariant attention is now: part of the cache keys that depend on its numerics."""
        return "fused-" + _name()[-12:] if self.on else "torch"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v1: torch.Tensor, vis: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """One sequence: q [m, hq, d] fp32 contiguous, k [hkv, >= n, d], v1 [hkv, >= n, d + 1],
        vis [m, n] bool. Returns [m, hq, d] fp32."""
        return self.module.attend(q, k, v1, vis, float(scaling))

    def attend_many(self, q: torch.Tensor, kvs, viss, scaling: float, owners=None) -> torch.Tensor:
        """Several sequences in one call: q [M, hq, d] fp32 contiguous holds their rows in order,
        kvs[i] = (k, v1) and viss[i] [m_i, n_i] as in attend(). owners[i], where given, is the
        kvcache.InvariantLayer the keys live in: its transposed copy of them (`transposed()`) is
        read and brought up to date in the call, instead of a scratch copy transposed whole."""
        # a layer that stores bf16 hands the torch ops' attention fp32 copies (padded()): its kept
        # copy is not the keys' dtype then, so a scratch copy serves
        kept = [o if o is not None and o.kbuf.dtype == k.dtype else None
                for o, (k, _) in zip(owners or [None] * len(kvs), kvs)]
        kts, froms = [], []
        for owner in kept:
            kt, valid = owner.transposed() if owner is not None else (None, 0)
            kts.append(None if kt is None else kt[0])
            froms.append(valid)
        out = self.module.attend_many(q, [k for k, _ in kvs], kts, froms, [v for _, v in kvs], list(viss),
                                      float(scaling))
        transposed_now(kept, viss)
        return out

    def append_attend_many(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, owners, viss,
                           scaling: float) -> torch.Tensor:
        """attend_many on kvcache.InvariantLayer owners, after appending each sequence's new keys
        and values to its layer, in one compiled call: query [1, hq, M, d], key and value
        [1, hkv, M, d] (any float dtype) hold every sequence's rows in order (sequence i's are
        viss[i]'s rows). Returns [1, M, hq, d] in the query's dtype. The per-sequence copies and
        the conversions a layer would make in Python otherwise were a quarter of a 4-request
        forward's time."""
        out = self.module.append_attend_many(query, key, value, *claimed(owners, viss, key), viss, float(scaling))
        transposed_now(owners, viss)
        return out


def claimed(owners, viss, like: torch.Tensor) -> tuple[list, list, list, list, list]:
    """Room for each sequence's new rows in its kvcache.InvariantLayer (owner.claim: viss[i]'s
    rows, for reading its keys; like: new keys of the layer's shape and dtype), and what the
    compiled append_attend_many takes of each owner then: (starts, keys, transposed keys, how
    many of those are valid, [V | 1]). owners may be every layer's of a forward (compiled.py, one
    call a forward): the usual case, room already there, is claim's few integer operations, done
    here without the call (a call a layer was a measurable share of a small model's forward)."""
    starts = []
    for owner, vis in zip(owners, viss):
        m, keys = vis.shape
        n = owner.length
        if (owner.ktbuf is None or max(n + m, keys, 2) > owner.capacity
                or (keys > n + m and owner.dirty > n + m)):
            starts.append(owner.claim(m, like, keys))
        else:   # claim's common case, as it does it
            owner.length = n + m
            starts.append(n)
    return (starts, [o.kbuf for o in owners], [o.ktbuf for o in owners], [o.kt_len for o in owners],
            [o.vbuf for o in owners])


def transposed_now(owners, viss) -> None:
    """After a call: each owner's transposed copy holds the keys its sequence read (a layout
    pads one key to two: that second key is not written yet)."""
    for owner, vis in zip(owners, viss):
        if owner is not None:
            owner.kt_len = min(vis.shape[1], owner.length)


KERNEL = AttentionKernel()   # the process's (module docstring: decided once per process)


# what the rest of hd reads of the process's attention kernel
def load(quiet: bool = False):
    return KERNEL.load(quiet)


def failure() -> str | None:
    return KERNEL.failure()


def enabled() -> bool:
    return KERNEL.on


def name() -> str:
    return KERNEL.name()


MAX_HEAD = 271       # csrc/attend.cpp MAX_D: its scores scratch and a scalar tail past whole vectors


