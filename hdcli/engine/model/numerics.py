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
from .layers import dequantize
from ..kernels import dense as kernels
from .layers import Linear

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
        acts = "int8" if self.kernels == "gguf-int8" else "bf16"
        if (self.kernels in kernels.GGUF and self.device == "cpu" and self.dtype == "bf16"
                and qtype in quants.TYPES and quants.fits(qtype, n, k) and self.gemm_here()):
            layouts = getattr(gf, "layouts", None)   # model/layouts.py: the packings kept on disk
            packing = None if layouts is None else layouts.packing(name, qtype, raw, n, k, int8=acts == "int8")
            q = quants.QLinear(qtype, raw, n, k, bias=bias, activations=acts, packing=packing)
            q.names = ((name, n // 16),)
            held = q.packed.numel()
            layer = Linear(q, "gguf", qtype)
        else:
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
            held = weight.numel() * weight.element_size()
        tag = f"{layer.kernel_name}:{qtype}"
        self.layers[tag] = self.layers.get(tag, 0) + 1
        file_bytes, held_bytes = self.held.get(qtype, (0, 0))
        self.held[qtype] = [file_bytes + raw.nbytes, held_bytes + held]
        return layer

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
        how = [f"{t} as {'int8 codes (' + quants.FORMAT[t] + ')' if self.layers.get('gguf:' + t) or self.layers.get('gguf-int8:' + t) else self.dtype} "
               f"({hb / fb:.1f}x)" for t, (fb, hb) in sorted(wide.items())]
        fb, hb = sum(v[0] for v in wide.values()), sum(v[1] for v in wide.values())
        why = ("" if self.kernels not in ("gguf", "gguf-int8") or self.gemm_here()
               else f" (hd's GGUF GEMM does not run here: {quants.failure()})" if not quants.kernel_available()
               else " (hd's GGUF GEMM takes int8 activations on this CPU, which has no AVX512-BF16: "
                    "--kernels auto or gguf-int8)")
        return (f"hd: weights held wider than the file: {', '.join(how)}; {hb / 1e9:.2f} GB for their "
                f"{fb / 1e9:.2f} GB in the file{why}")
