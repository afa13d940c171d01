"""A GGUF's quantized weights kept in about their own bytes: exact dequantization, and
weight-only GEMMs on the blocks (csrc/qmm.cpp) for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K,
and Q3_K, IQ4_NL, IQ4_XS written in those formats (below). Q2_K is dequantized to bf16.

Why: one decode step reads every weight once, so bytes per weight bound its speed (a CPU's memory
bandwidth, docs/benchmarks.md). Every type is split into integer codes, one scale and (for some) one
low per group of GK weights along K, W = scale * code + low, which csrc/qmm.cpp multiplies by the
bf16 activations with bf16 dot products on the integer codes. The repacked layouts keep the file's
own constants (fp16 d, 6-bit scales) and compute each group's scale and low in the kernel, so they
cost about the file's bytes (a weight, the file's in brackets):

  type   GK  codes            scale          low          kernel format
  Q4_0   32  q in 0..15       d              -8 d         q4z: 4-bit, fp16 d          0.5625 (0.5625)
  Q4_1   32  q in 0..15       d              m            q4h: 4-bit, fp16 d, m       0.625  (0.625)
  Q5_0   32  q - 16, q 0..31  d              -            q8h: int8, fp16 d           1.0625 (0.6875)
  Q5_1   32  q in 0..31       d              m            q8f: int8, fp32 constants   1.25   (0.75)
  Q8_0   32  q in -128..127   d              -            q8h                         1.0625 (1.0625)
  Q4_K   32  q in 0..15       d sc           -dmin m      q4k: 4-bit, fp16 d, dmin a super-block,
                                                               6-bit sc, m a group   0.578  (0.5625)
  Q5_K   32  q in 0..31       d sc           -dmin m      q8f                         1.25   (0.6875)
  Q6_K   16  q in -32..31     d sc           -            q6k: 6-bit, fp16 d a super-block,
                                                               int8 sc a group       0.820  (0.8203)

  Q3_K   16  q in -4..3       d (sc - 32)    -            q6k (codes q + 32)          0.820  (0.4297)
  IQ4_NL 32  kv[q] in -127..113 d            -            q8h (codes kv[q])           1.0625 (0.5625)
                                                          int8: q4n, 4-bit q, fp16 d  0.5625
  IQ4_XS 32  kv[q]            d (ls - 32)    -            q8f (low 0)                 1.25   (0.5312)
                                                          int8: q4x, 4-bit q, fp16 d a
                                                               super-block, int8 ls-32 0.539
  Q2_K   16  q in 0..3        d sc           -dmin m      none: dequantized to bf16   2      (0.3281)

The three written in another type's format hold their exact weights (a wider code holds any
product of their small integers) but take about twice the file's bytes (IQ4_XS 2.4x), said
at load (engine/loader.py). For int8 activations (the GEMM on AVX2, and on AVX512 where it
was measured faster) IQ4_NL and IQ4_XS keep the file's 4-bit indices (q4n, q4x: FORMAT8), looked
up in IQ4_NL's table in the kernel (VPSHUFB), the file's bytes; the bf16-activation GEMM has no
such table yet (it was written on a machine without AVX512-BF16, where it cannot be run).
kv is IQ4_NL's table of 16 int8 values (IQ4NL_VALUES); Q3_K's sc and IQ4_XS's ls are 6-bit.

d, dmin and Q4_1's m are a block's fp16 numbers; a K-quant's sc and m are its sub-blocks' 6-bit
scales and mins (Q6_K's sc: int8). Every scale and low is an exact fp32 product (an fp16 times an
integer of at most 8 bits), so the kernel multiplies by the file's weights exactly; each output is
then a sum over groups of fma(s1, scale) and fma(s0, low) in fp32, rounded once to bf16
(csrc/qmm.cpp's header). Its arithmetic per row does not depend on the row count or the row's
place, so the M-invariant forward (engine/kernels/invariant.py) can use it. (Q6_K's codes are the file's
6-bit q less 32; Q5_0, Q5_1 and Q5_K, rare in the files users have, take int8 codes.)

The repacking is C++ too (qmm.cpp's `pack`), reading the blocks where the file's map has them, one
column block of 16 rows at a time on torch's threads.

int8 activations (QLinear(..., activations="int8"), qmm.cpp's mm8, `--kernels gguf-int8`): the same
bytes with the codes arranged for VPDPBUSD (AVX512-VNNI), each activation row quantized per group
of GK to int8 on its own, llama.cpp's way; exact integer group sums, so 8 verification rows cost
~1.6 one row's time where the bf16 GEMM's cost ~2.5 (benchmarks/gguf_gemm.py). Other numerics than
the bf16 GEMM's, M-invariant all the same (docs/dtype.md); `activation_choice` picks one per machine.
On a CPU with AVX2 and no AVX512 (Zen 1-3, most desktop Intel) mm8 is built on AVX2 (VPMADDUBSW,
its int16 sums added over as many quads as they hold exactly before they are widened; VPDPBUSD
on 256 bits where the CPU has AVX-VNNI, Intel Alder Lake and newer): the same integer sums and
fp32 operations, so the same outputs bit for bit (tests/test_quants.py builds all three and
compares); it is the only GEMM there (no AVX512-BF16), and the GGUF's weights are held in about
the file's bytes there too.

Speed (benchmarks/kernels_bench.py, docs/benchmarks.md): one row reads bytes, so the 4-bit
formats are the fastest there; from 16 rows, where arithmetic bounds it, all are alike.

Dequantization (`dequantize`, `dequantize_f32`) computes each type's weights with the op order of
gguf-py's reference (gguf.quants.dequantize): the fp32 values are equal bit for bit
(tests/test_quants.py), then rounded to bf16 to nearest even, a chunk of rows at a time.

Invariants
  * QLinear.weight_matrix() (I @ W^T through the kernel) equals dequantize()'s bf16 weights as
    values (torch.equal); a zero's sign may differ (the kernel's sums start from +0).
  * A QLinear holds only its packing (and bias): no second copy of the weights.
  * Where the kernel is not built (no compiler, neither AVX512-BF16 nor AVX2: `kernel_available()`;
    for bf16 activations, AVX512-BF16: `bf16_available()`), QLinear raises RuntimeError and the caller keeps dequantized bf16 weights; where a tensor's shape does
    not fit the packing (N % 16, K % the type's block), `pack` returns None and QLinear raises
    ValueError (`fits()` says beforehand).
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from .. import records
from . import build, fused

# The types read here (unpacked, dequantized bit for bit as gguf-py does); FORMAT: those the GEMM
# multiplies (Q2_K has no format: a GK of 16 with a low of its own; it is dequantized to bf16).
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "IQ4_NL", "IQ4_XS", "Q2_K")
FLOATS = ("F32", "F16", "BF16")
QK_K = 256
# weights and bytes of a GGUF block
BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176),
         "Q6_K": (QK_K, 210), "Q3_K": (QK_K, 110), "IQ4_NL": (32, 18), "IQ4_XS": (QK_K, 136), "Q2_K": (QK_K, 84)}
GROUP = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q4_K": 32, "Q5_K": 32, "Q6_K": 16,    # weights a scale
         "Q3_K": 16, "IQ4_NL": 32, "IQ4_XS": 32, "Q2_K": 16}
FORMAT = {"Q4_0": "q4z", "Q4_1": "q4h", "Q5_0": "q8h", "Q5_1": "q8f", "Q8_0": "q8h", "Q4_K": "q4k", "Q5_K": "q8f", "Q6_K": "q6k",
          "Q3_K": "q6k", "IQ4_NL": "q8h", "IQ4_XS": "q8f"}
FORMAT8 = dict(FORMAT, IQ4_NL="q4n", IQ4_XS="q4x")   # packed for int8 activations (mm8)
IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
CHUNK = 1 << 22        # weights dequantized at a time (16 MB in fp32, 8 MB of bf16 output)

SOURCE = Path(__file__).with_name("csrc") / "qmm.cpp"


@functools.lru_cache(maxsize=1)
def module_name() -> str:
    """The compiled GEMM's name: a hash of its source, the CPU, torch and the flags (cache keys)."""
    return build.extension_name(SOURCE, "hd_qmm_")


class GemmKernel(build.OnePerProcess):
    """The process's compiled GEMM (csrc/qmm.cpp, also the compiled row-wise ops): its module once
    built (None until then, or where it cannot be built or this CPU has neither GEMM, the bf16 one
    (AVX512-BF16) nor the int8 one (AVX512-VNNI or AVX2): `failed` says why). One a process (GEMM):
    a module is built and loaded once."""

    def __init__(self):
        self.module = None
        self.compiled = None      # the module as built, also where its GEMM is not (`pack` runs on any CPU)
        self.failed: str | None = None

    def load(self, quiet: bool = True):
        """The compiled module, built on first use, or None (why: `failed`)."""
        if self.module is None and self.failed is None:
            if not build.is_built(module_name()):   # a first start: the fused attention compiles beside
                fused.KERNEL.build_beside()
            self.compiled, self.failed = build.compile_extension(SOURCE, module_name(), "the GGUF GEMM", quiet)
            self.module = self.compiled
            if self.module is not None and not (self.module.supported() or self.module.supported8()):
                self.module, self.failed = None, "this CPU has neither AVX512-BF16 nor AVX2"
        return self.module


GEMM = GemmKernel()


def gemm_module(quiet: bool = True):
    """The compiled GEMM (csrc/qmm.cpp), or None where it cannot be built or this CPU has no GEMM
    of it (why: `failure()`)."""
    return GEMM.load(quiet)


def kernel_available(quiet: bool = True) -> bool:
    """Whether QLinear can be made here, for bf16 or int8 activations (the GEMM compiled and this
    CPU has AVX512-BF16, or AVX512-VNNI or AVX2)."""
    return gemm_module(quiet) is not None


def bf16_available(quiet: bool = True) -> bool:
    """Whether the bf16-activation GEMM (mm) runs here: the extension built with AVX512-BF16."""
    module = gemm_module(quiet)
    return module is not None and module.supported()


def int8_available(quiet: bool = True) -> bool:
    """Whether the int8-activation GEMM (mm8) runs here: the extension built with AVX512-VNNI or AVX2."""
    module = gemm_module(quiet)
    return module is not None and module.supported8()


def gemm_isa() -> str:
    """What the GGUF GEMMs here are built on, for records: "AVX512-BF16 + AVX512-VNNI", "AVX2
    (int8 activations only)", or "none"."""
    module = gemm_module()
    if module is None:
        return "none"
    if not module.supported():
        return f"{module.isa8()} (int8 activations only)"
    return "AVX512-BF16" + (f" + {module.isa8()}" if module.supported8() else "")


CHOICE_FORMAT = 1
CHOICE_ROWS = (1, 8)          # a decode step and a typical verification
CHOICE_SHAPE = (4096, 2048)   # N, K of the probe (Q4_K, random blocks): the GEMMs' compute, in cache
CHOICE_ROUNDS = 9
CHOICE_MARGIN = 0.10          # int8 must be this much slower to lose; times this close decide nothing


def _choice_key() -> str:
    return (f"activations|{module_name()}|{torch.get_num_threads()}|"
            f"{torch.__version__}|{records.cpu_name()}")


def activation_choice(remeasure: bool = False) -> dict:
    """Which activations the GGUF GEMMs take on this machine: {"activations": "int8" | "bf16",
    "us": {kernel: {rows: microseconds}}, "cpu": ...}. int8 where AVX512-VNNI is here unless,
    timed once (a Q4_K probe, CHOICE_ROWS rows, the least of CHOICE_ROUNDS interleaved rounds),
    it is clearly slower (CHOICE_MARGIN) for one row and for a verification's rows. Cached per CPU,
    threads, torch and kernel source under HD_CACHE_DIR/choices (a record that does not read back
    whole is measured again) only when the times differ by more than the margin: a loaded machine
    times both alike, and such a measurement decides nothing (measured again next time). One
    machine keeps one choice: the two round differently (docs/dtype.md)."""
    if not int8_available():
        return {"activations": "bf16", "why": "no int8 GEMM here (AVX512-VNNI or AVX2)"}
    if not bf16_available():
        return {"activations": "int8", "why": f"the only GGUF GEMM here: {gemm_isa()}"}
    key = _choice_key()
    path = records.cache_file("choices", key)
    if not remeasure:
        got = records.read_record(path, key, CHOICE_FORMAT, lambda d: d["activations"] in ("int8", "bf16") and all(
            isinstance(v, dict) and all(records.number(t, 0) for t in v.values()) for v in d["us"].values()),
            "the GGUF activation choice record")
        if got is not None:
            return got
    import time
    rng = np.random.default_rng(0)
    n, k = CHOICE_SHAPE
    raw = rng.integers(0, 256, (n, k // QK_K * BLOCK["Q4_K"][1]), dtype=np.uint8)
    d = (rng.standard_normal((n, k // QK_K, 2)) * 1e-2).astype(np.float16).view(np.uint8)
    raw.reshape(n, k // QK_K, -1)[:, :, :4] = d.reshape(n, k // QK_K, 4)
    layers = {"bf16": QLinear("Q4_K", raw, n, k), "int8": QLinear("Q4_K", raw, n, k, activations="int8")}
    xs = {m: torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16) for m in CHOICE_ROWS}
    best = {a: {m: float("inf") for m in CHOICE_ROWS} for a in layers}
    for r in range(CHOICE_ROUNDS):
        for a in (layers if r % 2 == 0 else reversed(list(layers))):
            for m in CHOICE_ROWS:
                t0 = time.perf_counter()
                layers[a](xs[m])
                best[a][m] = min(best[a][m], time.perf_counter() - t0)
    ratio = {m: best["int8"][m] / best["bf16"][m] for m in CHOICE_ROWS}
    slower = all(r > 1 + CHOICE_MARGIN for r in ratio.values())
    decisive = slower or ratio[CHOICE_ROWS[-1]] < 1 - CHOICE_MARGIN
    record = {"key": key, "format": CHOICE_FORMAT, "activations": "bf16" if slower else "int8",
              "us": {a: {str(m): round(1e6 * t, 1) for m, t in v.items()} for a, v in best.items()},
              "cpu": records.cpu_name(), "measured_at": time.time(), "decisive": decisive}
    if decisive:
        records.write_json(path, record)
    return record


def failure() -> str | None:
    """Why the GEMM is not available (None: available, or not tried yet)."""
    return GEMM.failed


# ------------------------------------------------------------------ the GGUF blocks

def _bytes(raw: np.ndarray, n: int) -> np.ndarray:
    """A tensor's data as bytes [n, bytes a row] (GGUFReader gives F32/F16 as typed arrays)."""
    return np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of each block [..., bytes], as fp32 [...]."""
    return b[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit runs: each 32 bytes [..., c, 32] hold sub-blocks 2c (low nibbles) and 2c + 1
    (high nibbles) of 32 weights, element i in byte i. Returns [..., 2 c, 32]."""
    return np.stack([qs & 0x0F, qs >> 4], -2).reshape(*qs.shape[:-2], -1, 32)


def _scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The K-quants' 12 bytes [..., 12] of 6-bit sub-block scales and mins, each [..., 8]: bytes
    0-3 hold scales 0-3 in their low 6 bits, 4-7 mins 0-3; bytes 8-11 hold the low 4 bits of
    scales 4-7 (low nibble) and mins 4-7 (high nibble), whose top 2 bits are the top bits of bytes
    0-3 (scales) and 4-7 (mins)."""
    a, b, c = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], -1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], -1)
    return sc, mn


def _q4_0(b):   # Q4_0/Q4_1: one run of 16 bytes (element i in byte i's low nibble, i + 16 its high one)
    d = _f16(b, 0)
    return np.concatenate([b[..., 2:] & 0x0F, b[..., 2:] >> 4], -1), d, -8 * d


def _q4_1(b):
    return np.concatenate([b[..., 4:] & 0x0F, b[..., 4:] >> 4], -1), _f16(b, 0), _f16(b, 2)


def _q5(b, at: int):
    """Q5_0/Q5_1 codes 0..31: the 32 high bits (a little-endian uint32 at byte `at`: bit i is
    element i's), then 16 bytes of low nibbles as Q4_0's."""
    high = (b[..., at:at + 4].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    qs = b[..., at + 4:]
    return np.concatenate([qs & 0x0F, qs >> 4], -1) | (high.astype(np.uint8) << 4)


def _q5_0(b):   # d (q - 16): codes q - 16, no low (gguf-py: d * (q - 16))
    return (_q5(b, 2).view(np.int8) - np.int8(16)), _f16(b, 0), None


def _q5_1(b):   # d q + m
    return _q5(b, 4).view(np.int8), _f16(b, 0), _f16(b, 2)


def _q8_0(b):
    return b[..., 2:].view(np.int8), _f16(b, 0), None


def _q4_k(b):
    d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
    sc, mn = _scale_min(b[..., 4:16])
    codes = _nibbles(b[..., 16:144].reshape(*b.shape[:-1], 4, 32))
    return codes, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q5_k(b):
    d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
    sc, mn = _scale_min(b[..., 4:16])
    high = (b[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1   # bit s of byte i: sub-block s, element i
    codes = _nibbles(b[..., 48:176].reshape(*b.shape[:-1], 4, 32)) | (high << 4)
    return codes.view(np.int8), d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q6_k(b):
    lead = b.shape[:-1]
    # low 4 bits: two halves of 128 weights, each 64 bytes: element 64 s + j of a half in byte j, nibble s
    low = (b[..., 0:128].reshape(*lead, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]) & 0x0F
    # high 2 bits: each half 32 bytes: element 32 t + i of a half in byte i, bits 2t and 2t + 1
    high = (b[..., 128:192].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03
    codes = (low.reshape(*lead, QK_K) | (high.reshape(*lead, QK_K) << 4)).view(np.int8) - np.int8(32)
    return codes, _f16(b, 208)[..., None] * b[..., 192:208].view(np.int8).astype(np.float32), None


def _q3_k(b):
    """Q3_K: hmask[32], qs[64], 12 bytes of 6-bit scales, fp16 d. Element e = 128 h + 32 j + l:
    2 low bits at bits 2j of qs[32 h + l], less 4 where bit 4h + j of hmask[l] is clear (q in
    -4..3); group of 16 i = e / 16 scaled by d (sc_i - 32), sc_i a nibble of byte i % 8 (the high
    one from i = 8) and bits 2 (i / 4) of byte 8 + i % 4 on top."""
    lead = b.shape[:-1]
    low = (b[..., None, 32:96].reshape(*lead, 1, 2, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None, None]) & 3   # [j, h, l]
    hbit = (b[..., None, 0:32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1                                     # [4h + j, l]
    q = low.transpose(*range(len(lead)), -2, -3, -1).astype(np.int8) - ((hbit.reshape(*lead, 2, 4, 32) ^ 1) << 2).astype(np.int8)
    s = b[..., 96:108]
    sc = ((s[..., None, 0:8] >> np.array([0, 4], np.uint8)[:, None]) & 0x0F).reshape(*lead, 16) \
        | (((s[..., None, 8:12] >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3).reshape(*lead, 16) << 4)
    return q.reshape(*lead, QK_K), _f16(b, 108)[..., None] * (sc.view(np.int8) - np.int8(32)).astype(np.float32), None


def _q2_k(b):
    """Q2_K: 16 bytes of 4-bit scale (low) and min (high) a group of 16, qs[64], fp16 d, dmin.
    Element e = 128 h + 32 j + l: bits 2j of qs[32 h + l] (0..3); W = d sc q - dmin m."""
    lead = b.shape[:-1]
    q = (b[..., None, 16:80].reshape(*lead, 1, 2, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None, None]) & 3   # [j, h, l]
    q = q.transpose(*range(len(lead)), -2, -3, -1).reshape(*lead, QK_K)
    s = b[..., 0:16]
    return q, _f16(b, 80)[..., None] * (s & 0x0F).astype(np.float32), -(_f16(b, 82)[..., None] * (s >> 4).astype(np.float32))


def _iq4_nl(b):   # fp16 d, 16 bytes: element i a nibble of byte i % 16 into IQ4_NL's table of 16 int8 values
    return IQ4NL_VALUES[np.concatenate([b[..., 2:] & 0x0F, b[..., 2:] >> 4], -1)], _f16(b, 0), None


def _iq4_xs(b):
    """IQ4_XS: fp16 d, scales_h (uint16: bits 2j of group j's scale's top 2 bits), scales_l[4]
    (group j's low 4 bits, a nibble of byte j / 2), qs[128] (group j's 32 as IQ4_NL's 16 bytes);
    W = d (ls - 32) kv[q]."""
    lead = b.shape[:-1]
    high = (b[..., 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3
    low = ((b[..., 4:8, None] >> np.array([0, 4], np.uint8)) & 0x0F).reshape(*lead, 8)
    ls = (low | (high.astype(np.uint8) << 4)).view(np.int8) - np.int8(32)
    qs = b[..., 8:136].reshape(*lead, 8, 16)
    codes = IQ4NL_VALUES[np.concatenate([qs & 0x0F, qs >> 4], -1)]
    return codes.reshape(*lead, QK_K), _f16(b, 0)[..., None] * ls.astype(np.float32), None


_UNPACK = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
           "Q3_K": _q3_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs, "Q2_K": _q2_k}


def _rows_checked(type_name: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """A tensor's bytes [n, bytes a row], ValueError where a row is not K/block blocks of the type."""
    size, nbytes = BLOCK[type_name]
    b = _bytes(raw, n)
    if b.shape[1] != k // size * nbytes:
        raise ValueError(f"{type_name}: {b.shape[1]} bytes a row, not {k // size * nbytes} for K = {k}")
    return b


def unpack(type_name: str, raw: np.ndarray, n: int, k: int):
    """(codes [n, k] uint8 or int8, scale [n, k/GK] fp32, low [n, k/GK] fp32 or None, GK) of a
    tensor's raw GGUF bytes [n rows (outputs), bytes a row]: W = scale * codes + low per group of
    GK along K (the table in the module docstring)."""
    if type_name not in TYPES:
        raise NotImplementedError(f"{type_name} is not one of {', '.join(TYPES)}")
    size, nbytes = BLOCK[type_name]
    if k % size:
        raise ValueError(f"{type_name}: K = {k} is not a whole number of its {size}-weight blocks")
    b = _rows_checked(type_name, raw, n, k)
    codes, scale, low = _UNPACK[type_name](b.reshape(n, k // size, nbytes))
    gk = GROUP[type_name]
    return (codes.reshape(n, k), scale.reshape(n, k // gk),
            None if low is None else low.reshape(n, k // gk), gk)


def _weights(type_name: str, codes, scale, low, gk: int) -> np.ndarray:
    """fp32 weights [n, k] with gguf-py's op order (the same fp32 bits): Q4_0 d (q - 8), Q8_0 and
    Q6_K q d, Q4_1 d q + m, Q4_K and Q5_K d q - dmin m (= d q + low: x - y is x + (-y))."""
    n, k = codes.shape
    c = codes.reshape(n, k // gk, gk).astype(np.float32)
    s = scale[..., None]
    if type_name == "Q4_0":
        w = s * (c - np.float32(8))
    elif low is None:
        w = c * s
    else:
        w = s * c + low[..., None]
    return w.reshape(n, k)


def _rows_of(raw: np.ndarray, n: int, rows) -> np.ndarray:
    b = _bytes(raw, n)
    return b if rows is None else b[np.asarray(rows, dtype=np.int64)]


def dequantize_f32(type_name: str, raw: np.ndarray, n: int, k: int, rows=None) -> np.ndarray:
    """fp32 weights [n or len(rows), k] of a tensor's raw GGUF data (TYPES or F32, F16, BF16), equal
    bit for bit to gguf.quants.dequantize's. rows: only those rows (an index array). All at once:
    for big tensors, `dequantize` goes by chunks."""
    b = _rows_of(raw, n, rows)
    m = b.shape[0]
    if type_name == "F32":   # a copy: the file's map is read-only
        return b.view(np.float32).reshape(m, k).copy()
    if type_name == "F16":
        return b.view(np.float16).reshape(m, k).astype(np.float32)
    if type_name == "BF16":
        return (b.view(np.uint16).reshape(m, k).astype(np.uint32) << 16).view(np.float32)
    if type_name not in TYPES:   # e.g. IQ2_XS: gguf-py's dequantization (`dequantize` goes by chunks)
        import gguf
        if type_name not in gguf.GGMLQuantizationType.__members__:
            raise NotImplementedError(f"dequantizing {type_name} is not implemented (types: {', '.join(TYPES + FLOATS)})")
        return gguf.quants.dequantize(b, gguf.GGMLQuantizationType[type_name]).reshape(m, k)
    codes, scale, low, gk = unpack(type_name, b, m, k)
    return _weights(type_name, codes, scale, low, gk)


def dequantize(type_name: str, raw: np.ndarray, n: int, k: int, rows=None) -> torch.Tensor:
    """bf16 weights [n or len(rows), k]: dequantize_f32's, rounded to nearest even, CHUNK weights
    at a time (a big tensor is never whole in fp32). rows: only those rows (an embedding lookup)."""
    b = _rows_of(raw, n, rows)
    m = b.shape[0]
    out = torch.empty((m, k), dtype=torch.bfloat16)
    if type_name == "BF16":   # already bf16: its bits
        out.view(torch.int16).copy_(torch.from_numpy(np.array(b).view(np.int16).reshape(m, k)))   # a copy: the map is read-only
        return out
    step = max(1, CHUNK // max(k, 1))
    for a in range(0, m, step):
        out[a:a + step] = torch.from_numpy(dequantize_f32(type_name, b[a:a + step], min(step, m - a), k))
    return out


# ------------------------------------------------------------------ the kernel's packing

def fits(type_name: str, n: int, k: int) -> bool:
    """Whether a [n, k] tensor of this type packs for the kernel (N % 16, K a whole number of blocks)."""
    return type_name in FORMAT and n > 0 and k > 0 and n % 16 == 0 and k % BLOCK[type_name][0] == 0


def pack(type_name: str, raw: np.ndarray, n: int, k: int, int8: bool = False, reference: bool = False):
    """(packed [n/16, super-blocks, bytes] uint8 tensor, fmt) for csrc/qmm.cpp's GEMM, or None where
    the shape does not fit (`fits`). The C++ packer reads the file's blocks where they lie (the
    map) on torch's threads: an 8B model's 4.5 GB repack in seconds, not the half minute numpy
    took. RuntimeError where the extension is not built here (it packs on a CPU without the GEMM:
    tests/test_quants.py reads the packing back there). reference: for int8, the arrangement through
    decoded codes also for the types written directly (Q4_0, Q8_0, Q4_K, Q6_K; the tests compare)."""
    return pack_side_by_side(type_name, [raw], [n], k, int8=int8, reference=reference)


def pack_side_by_side(type_name: str, raws: list, ns: list[int], k: int, int8: bool = False, reference: bool = False):
    """(packed, fmt) of tensors of one type and K (raws[t]: [ns[t], bytes a row]) side by side
    along the column blocks, in one buffer: the packing of their rows concatenated, each tensor's
    blocks what `pack` makes of it (q, k and v joined without a copy: QLinear.side_by_side). None where
    one does not fit."""
    if not all(fits(type_name, n, k) for n in ns):
        return None
    GEMM.load()
    module = GEMM.compiled   # plain C++: it packs wherever the extension builds, AVX512 or not
    if module is None:
        raise RuntimeError(f"the GGUF GEMM is not built here ({GEMM.failed})")
    rows = [_rows_checked(type_name, raw, n, k) for raw, n in zip(raws, ns)]
    return module.pack([b.ctypes.data for b in rows], list(ns), [b.shape[1] for b in rows], k, type_name, int8,
                       reference)   # rows stay alive: the call reads them


class QLinear(torch.nn.Module):
    """y = x @ W^T + bias with W a GGUF tensor's blocks, multiplied by csrc/qmm.cpp's GEMM."""

    def __init__(self, type_name: str, raw: np.ndarray, n_out: int, k_in: int, bias: torch.Tensor | None = None,
                 activations: str = "bf16", packing: tuple | None = None):
        """raw: the tensor's GGUF bytes [n_out, bytes a row] (GGUFReader's tensor.data); bias [n_out]
        or None; activations: "bf16" (mm: the activations as they come) or "int8" (mm8: each row's
        groups quantized to int8, llama.cpp's way; `int8_available()`). RuntimeError where the
        kernel is not available here, ValueError where the shape does not fit its packing (`fits`):
        the caller then dequantizes to bf16. packing: (packed, fmt) as `pack` makes them for these
        arguments, made beforehand (model/layouts.py maps them from its cache), else packed here."""
        super().__init__()
        if GEMM.load() is None:
            raise RuntimeError(f"the GGUF GEMM is not available here ({GEMM.failed}): dequantize to bf16 instead")
        if activations not in ("bf16", "int8"):
            raise ValueError(f"activations must be bf16 or int8, not {activations!r}")
        if activations == "int8" and not int8_available():
            raise RuntimeError("the int8-activation GEMM needs AVX512-VNNI or AVX2, which this CPU's build lacks")
        if activations == "bf16" and not bf16_available():
            raise RuntimeError("the bf16-activation GEMM needs AVX512-BF16, which this CPU lacks: take "
                               "activations='int8'")
        self.activations = activations
        got = packing if packing is not None else pack(type_name, raw, n_out, k_in, int8=activations == "int8")
        if got is None:
            raise ValueError(f"a {type_name} tensor [{n_out}, {k_in}] does not fit the GGUF GEMM's packing "
                             f"(N % 16, K % {BLOCK.get(type_name, ('?',))[0]})")
        self.packed, self.fmt = got
        self.names: tuple = ()   # ((the file's tensor name, column blocks), ...): set by its maker, for the layout cache
        self.qtype = type_name
        self.out_features, self.in_features = n_out, k_in
        self.dtype = torch.bfloat16
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16).contiguous()

    @property
    def nbytes(self) -> int:
        """Bytes it holds: the packing and the bias."""
        return self.packed.numel() + (0 if self.bias is None else 2 * self.bias.numel())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = (GEMM.module.mm8 if self.activations == "int8" else GEMM.module.mm)(rows, self.packed, self.fmt)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def narrowed(self, blocks: int) -> "QLinear":
        """The first `blocks` column blocks (16 outputs each) as a QLinear sharing the packing:
        every block runs the same code, so a probe of the kernel's row-count behaviour (the
        M-invariant calibration) need not stream an 8B model's 0.4 GB head."""
        import copy
        out = copy.copy(self)
        out.packed = self.packed[:blocks]
        out.out_features = 16 * out.packed.shape[0]
        out.bias = None if self.bias is None else self.bias[:out.out_features]
        return out

    @classmethod
    def side_by_side(cls, type_name: str, raws: list, ns: list[int], k_in: int, biases: list | None = None,
                     activations: str = "bf16", packing: tuple | None = None) -> "QLinear | None":
        """One QLinear whose outputs are the tensors' side by side (a layer's q, k and v; its gate
        and up): one call and one pass over the weights where there were several, packed into one
        buffer (pack_side_by_side: nothing copied to join them). Each output column's arithmetic
        is its tensor's (columns never share a sum), so the outputs are torch.equal to the
        tensors' own QLinears' concatenated. raws[t]: [ns[t], bytes a row], one type and K;
        biases: one a tensor or None; packing: as pack_side_by_side makes it, made beforehand (the
        layout cache's view). None where a bias is on some only (adding a zero bias could turn a
        -0 into +0); ValueError where one does not fit the packing."""
        biases = biases or [None] * len(raws)
        if len({b is None for b in biases}) > 1:
            return None
        if packing is None and GEMM.load() is not None:
            packing = pack_side_by_side(type_name, raws, ns, k_in, int8=activations == "int8")
            if packing is None:
                raise ValueError(f"{type_name} tensors of {ns} rows and K {k_in} do not fit the GGUF GEMM's packing")
        bias = None if biases[0] is None else torch.cat(biases)
        return cls(type_name, None, sum(ns), k_in, bias=bias, activations=activations, packing=packing)

    def weight_matrix(self) -> torch.Tensor:
        """The bf16 weights [out, in] the kernel multiplies by, exactly: I @ W^T through the bf16
        GEMM (a packing for int8 activations is arranged otherwise: ValueError)."""
        if self.activations != "bf16":
            raise ValueError("weight_matrix reads a packing for bf16 activations")
        eye = torch.eye(self.in_features, dtype=self.dtype)
        return GEMM.module.mm(eye, self.packed, self.fmt).t().contiguous()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, GGUF {self.qtype} "
                f"({self.fmt}, {self.activations} activations, {self.nbytes / (self.in_features * self.out_features):.3f} bytes a weight)")
