"""Numerics: everything that decides the bits an owned forward computes, in one record.

Resolved once when a model loads (engine/loader.py), recorded in `hd generate --json` (the
loaded model's "numerics"), and read by the forward; nothing of it lives in a process global.
Every field changes the numbers a forward gives, so two runs with equal records compute alike:
  dtype       the activations' and dense weights' dtype (bf16, fp32);
  device      cpu or cuda;
  kernels     "gguf": each weight multiplied in the file's own blocks where hd has a kernel for its
              type (engine/kernels/quants.py; the rest dequantized to `dtype`, one tensor at a time),
              by the bf16 activations; "gguf-int8": the same blocks by activations quantized to
              int8 per row and group of 32 (16 for Q6_K), llama.cpp's way (docs/dtype.md),
              "onednn": every weight dequantized to `dtype` and oneDNN-packed, "torch": dense,
              torch's own Linear;
  invariant   the M-invariant mode (engine/kernels/invariant.py): verified rows bit-equal one-token rows;
  attention   which invariant attention (fused.name(): the compiled one, with a hash of its source,
              or torch ops);
  rows        the row-wise ops (norms, residual adds, rope): "compiled" (csrc/qmm.cpp's, bf16 on a
              CPU where the extension builds: one call where torch takes a dozen small ops) or
              "torch"; the rope is bit-equal either way, a norm's sum of squares is in another order;
  min_rows    per Linear shape and kernel, the row count calls are padded to (calibrated);
  layers      per kernel and file type, how many Linear layers use it (what ran, for the record);
  held        per file type, [bytes in the file, bytes held] of its Linear weights: where a type
              is held wider than the file (no GGUF kernel for it here, or none of its own: quants.py),
              the load says so in one line (`widened`).
Prefills use the same kernels as every other forward: no choice made by timing changes them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from ..kernels import quants
from .parts import dequantize
from ..kernels import dense as kernels
from .parts import Linear

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


@dataclass
class Numerics:
    dtype: str = "bf16"
    device: str = "cpu"
    kernels: str = "gguf"
    invariant: bool = True
    attention: str = "torch"
    rows: str = "torch"
    min_rows: dict = field(default_factory=dict)
    layers: dict = field(default_factory=dict)
    held: dict = field(default_factory=dict)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def replace(self, **changes) -> "Numerics":
        return dataclasses.replace(self, **changes)

    def record(self) -> dict:
        return dataclasses.asdict(self)

    def row_ops(self):
        """The compiled row-wise ops (qmm.cpp's module) where `rows` is "compiled", else None."""
        if self.rows != "compiled":
            return None
        return quants.gemm_module()

    def resolve_rows(self) -> None:
        """rows: "compiled" for bf16 on a CPU where the extension builds, else "torch"."""
        self.rows = ("compiled" if self.dtype == "bf16" and self.device == "cpu" and quants.gemm_module() is not None
                     else "torch")

    # ------------------------------------------------------------ building weights

    def vector(self, gf, name: str) -> torch.Tensor:
        """A 1-D tensor (norm weight, bias) in the model dtype: as transformers loads it, the file's
        values cast to the dtype."""
        qtype, raw, shape = gf.raw(name)
        return dequantize(qtype, raw.reshape(1, -1), 1, shape[-1], self.torch_dtype).reshape(-1).to(self.device)

    def linear(self, gf, name: str, bias: torch.Tensor | None = None):
        """The Linear layer of the file's tensor `name` ([N, K] in torch order) by these numerics."""
        qtype, raw, (n, k) = gf.raw(name)
        if self._gguf_gemm(qtype, n, k):
            return self._gguf_layer(gf, [name], qtype, [raw], [n], k, [bias])
        weight = dequantize(qtype, raw, n, k, self.torch_dtype).to(self.device)
        dense = torch.nn.Linear(k, n, bias=bias is not None, device="meta")
        dense.weight = torch.nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            dense.bias = torch.nn.Parameter(bias, requires_grad=False)
        kind = "torch"
        if self.kernels in kernels.GGUF + ("onednn",) and self.device == "cpu" and self.dtype in ("bf16", "fp32") \
                and kernels.available(self.dtype):
            with torch.inference_mode():
                dense, kind = kernels.PackedLinear(dense), "onednn"
        layer = Linear(dense, kind, qtype)
        self._count(layer, qtype, raw.nbytes, weight.numel() * weight.element_size())
        return layer

    def joined(self, gf, names: list[str], biases: list | None = None):
        """One Linear computing the file's tensors `names` side by side (q, k, v; gate, up: one
        GEMM call and one pass over their weights; quants.QLinear.side_by_side, outputs torch.equal
        to the parts'), where all run on hd's GGUF GEMM with one type and K and a bias on all or
        none; else None (the caller builds them one by one)."""
        got = [gf.raw(name) for name in names]
        qtype, k = got[0][0], got[0][2][1]
        biases = biases or [None] * len(names)
        if (any(t != qtype or shape[1] != k or not self._gguf_gemm(t, *shape) for t, _, shape in got)
                or len({b is None for b in biases}) > 1):
            return None
        return self._gguf_layer(gf, names, qtype, [raw for _, raw, _ in got], [shape[0] for _, _, shape in got], k, biases)

    def _gguf_gemm(self, qtype: str, n: int, k: int) -> bool:
        """Whether a [n, k] tensor of this type runs on hd's GGUF GEMM by these numerics."""
        return (self.kernels in kernels.GGUF and self.device == "cpu" and self.dtype == "bf16"
                and qtype in quants.TYPES and quants.fits(qtype, n, k) and self.gemm_here())

    def _gguf_layer(self, gf, names: list[str], qtype: str, raws: list, ns: list[int], k: int, biases: list):
        acts = "int8" if self.kernels == "gguf-int8" else "bf16"
        layouts = getattr(gf, "layouts", None)   # model/layouts.py: the packings kept on disk
        packing = None if layouts is None else layouts.packing(names, qtype, raws, ns, k, int8=acts == "int8")
        q = quants.QLinear.side_by_side(qtype, raws, ns, k, biases=biases, activations=acts, packing=packing)
        q.names = tuple((name, n // 16) for name, n in zip(names, ns))
        layer = Linear(q, "gguf", qtype)
        self._count(layer, qtype, sum(raw.nbytes for raw in raws), q.packed.numel(), len(names))
        return layer

    def _count(self, layer, qtype: str, file_bytes: int, held_bytes: int, tensors: int = 1) -> None:
        """The file's tensors a layer holds, by kernel and type, and their bytes in the file and held."""
        tag = f"{layer.kernel_name}:{qtype}"
        self.layers[tag] = self.layers.get(tag, 0) + tensors
        fb, hb = self.held.get(qtype, (0, 0))
        self.held[qtype] = [fb + file_bytes, hb + held_bytes]

    def gemm_here(self) -> bool:
        """Whether hd's GGUF GEMM for these kernels' activations runs here (int8: AVX512-VNNI or
        AVX2; bf16: AVX512-BF16)."""
        return quants.int8_available() if self.kernels == "gguf-int8" else quants.bf16_available()

    def widened(self) -> str | None:
        """One line where quantized weights are held wider than the file (1.3x or more a type),
        naming the types, how and how much, or None: memory is part of what a user chose a
        quantized file for."""
        wide = {t: fb_hb for t, fb_hb in self.held.items() if t not in ("F32", "F16", "BF16") and fb_hb[1] >= 1.3 * fb_hb[0]}
        if not wide:
            return None
        formats = quants.FORMAT8 if self.kernels == "gguf-int8" else quants.FORMAT
        how = [f"{t} as {'int8 codes (' + formats[t] + ')' if self.layers.get('gguf:' + t) or self.layers.get('gguf-int8:' + t) else self.dtype} "
               f"({hb / fb:.1f}x)" for t, (fb, hb) in sorted(wide.items())]
        fb, hb = sum(v[0] for v in wide.values()), sum(v[1] for v in wide.values())
        why = ("" if self.kernels not in ("gguf", "gguf-int8") or self.gemm_here()
               else f" (hd's GGUF GEMM does not run here: {quants.failure()})" if not quants.kernel_available()
               else " (hd's GGUF GEMM takes int8 activations on this CPU, which has no AVX512-BF16: "
                    "--kernels auto or gguf-int8)")
        return (f"hd: weights held wider than the file: {', '.join(how)}; {hb / 1e9:.2f} GB for their "
                f"{fb / 1e9:.2f} GB in the file{why}")
