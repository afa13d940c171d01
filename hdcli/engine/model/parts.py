"""The parts an owned forward is made of (its blocks, the transformer layers, are llama.py's and
gemma3.py's): Linear (whichever kernel holds a weight, padded to its least row count in the
M-invariant mode), the embedding (rows dequantized as they are looked up),
RMSNorm (transformers' LlamaRMSNorm, op for op), and a block's row-wise ops (RowOps: torch ops, or
CompiledRowOps: csrc/qmm.cpp's), chosen once when a model loads."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn
from ..kernels import quants


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward: in fp32, then the input dtype times the weight."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RowOps:
    """The row-wise ops of a block (norms, the residual add, splitting heads, the rotation) in
    torch ops, transformers' op order. A model picks its row ops once when it loads
    (LlamaForward.row_ops: this, CompiledRowOps, or Gemma's norms)."""

    def __init__(self, eps: float):
        self.eps = eps

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps)

    def add_norm(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor):
        """(x + y, norm(x + y))."""
        x = x + y
        return x, self.norm(x, weight)

    def head_norm(self, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A head's q or k norm (Qwen3)."""
        return rms_norm(y, weight, self.eps)

    def heads(self, y: torch.Tensor, heads: int, d: int, norm) -> torch.Tensor:
        """[m, heads * d] -> [heads, m, d], each head's norm first where the model has one."""
        y = y.view(y.shape[0], heads, d)
        if norm is not None:
            y = self.head_norm(y, norm)
        return y.transpose(0, 1)

    def rotate(self, y: torch.Tensor, heads: int, d: int, norm, rope, cos, sin) -> torch.Tensor:
        """A q or k projection [m, heads * d] as rotated heads [heads, m, d]."""
        return rope.apply(self.heads(y, heads, d, norm), cos, sin)


class CompiledRowOps(RowOps):
    """csrc/qmm.cpp's row-wise ops (Numerics.rows "compiled"): one call where torch takes a dozen
    small ops. The rotation is bit-equal to the torch ops'; a norm's sum of squares is in another
    order. Heads with a norm of their own go through the torch ops."""

    def __init__(self, ops, eps: float):
        super().__init__(eps)
        self.ops = ops

    def norm(self, x, weight):
        return self.ops.add_rms_norm(x, None, weight, self.eps)[1]

    def add_norm(self, x, y, weight):
        return self.ops.add_rms_norm(x, y, weight, self.eps)

    def rotate(self, y, heads, d, norm, rope, cos, sin):
        if norm is not None:
            return super().rotate(y, heads, d, norm, rope, cos, sin)
        return self.ops.rope(y, cos, sin, heads, rope.interleaved)


def row_ops(num, eps: float) -> RowOps:
    """The row ops a model's numerics (Numerics.rows) say."""
    ops = num.row_ops()
    return RowOps(eps) if ops is None else CompiledRowOps(ops, eps)


def dequantize(qtype: str, raw, n: int, k: int, dtype: torch.dtype, rows=None) -> torch.Tensor:
    """A tensor of the file (or some of its rows) in `dtype`: the values gguf-py's dequantize
    gives, rounded to bf16 or kept in fp32 (quants.py, chunk by chunk; a type quants.py does not
    read by gguf-py itself)."""
    if dtype == torch.bfloat16:
        return quants.dequantize(qtype, raw, n, k, rows=rows)
    values = quants.dequantize_f32(qtype, raw, n, k, rows=rows)
    if not values.flags.writeable:   # F32 data straight from the file's map: torch wants its own
        values = values.copy()
    return torch.from_numpy(values).to(dtype)


class Linear(nn.Module):
    """y = x W^T (+ b) by one kernel: a quants.QLinear (the file's blocks), a kernels/dense.PackedLinear
    (oneDNN, dense) or an nn.Linear (torch, dense).

    min_rows: the least row count the kernel's rows stop depending on the row count from
    (measured per shape and kernel, invariant.min_rows_for); a call with fewer rows is padded
    with zero rows, whose outputs are dropped. 1 for kernels whose per-row arithmetic is fixed."""

    def __init__(self, kernel: nn.Module, kind: str, qtype: str):
        super().__init__()
        self.kernel = kernel
        self.kind = kind                  # "gguf" | "onednn" | "torch"
        self.qtype = qtype                # the file's tensor type (Q4_K, F32, ...)
        self.in_features, self.out_features = kernel.in_features, kernel.out_features
        self.min_rows = 1

    @property
    def dtype(self) -> torch.dtype:
        return getattr(self.kernel, "dtype", None) or self.kernel.weight.dtype

    @property
    def kernel_name(self) -> str:
        """gguf (bf16 activations), gguf-int8, onednn or torch."""
        if self.kind == "gguf" and getattr(self.kernel, "activations", "bf16") == "int8":
            return "gguf-int8"
        return self.kind

    def shape_key(self) -> str:
        """What a calibration is per: shape, dtype and kernel."""
        kernel = f"{self.kernel_name}-{self.qtype}" if self.kind == "gguf" else self.kind
        return f"{self.in_features}x{self.out_features} {str(self.dtype).replace('torch.', '')} {kernel}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m < self.min_rows:
            x = torch.cat([x, x.new_zeros(self.min_rows - m, x.shape[1])])
            return self.kernel(x)[:m]
        return self.kernel(x)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.kernel_name} ({self.qtype}), min_rows={self.min_rows}"


class Embedding(nn.Module):
    """The token embedding, left in the file: a lookup dequantizes the rows it needs (exactly as
    quants.dequantize does the whole tensor), so an 8B model's 0.5-1 GB table costs no memory.

    Rows looked up are kept, up to CACHE_BYTES of them (then the kept ones are dropped and it
    starts again): a decode step looks up a few tokens, mostly ones it met before, and
    dequantizing one row through numpy cost a measurable share of a small model's forward (its
    caches cold from the forward before) where a kept row is a dictionary read. A kept row is
    the dequantized one, so a lookup gives the same bits either way."""

    CACHE_BYTES = 16 << 20

    def __init__(self, gf, name: str, num):
        super().__init__()
        self.qtype, self.raw, shape = gf.raw(name)
        self.rows, self.dim = shape
        self.num = num
        self._kept: dict[int, torch.Tensor] = {}   # token id -> its row [dim], model dtype and device
        self._most = max(1, self.CACHE_BYTES // (self.dim * torch.empty(0, dtype=num.torch_dtype).element_size()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [m] -> [m, dim] in the model dtype, on the model device."""
        idx = ids.detach().reshape(-1).tolist()
        if min(idx, default=0) < 0 or max(idx, default=0) >= self.rows:
            raise IndexError(f"token id out of range 0..{self.rows - 1}")
        kept = self._kept
        new = list(dict.fromkeys(i for i in idx if i not in kept))
        if not idx:
            return torch.empty(0, self.dim, dtype=self.num.torch_dtype, device=self.num.device)
        if len(new) > self._most:   # a long prompt's: looked up, not kept
            return self._dequantized(idx)
        got = dict(zip(new, self._dequantized(new).unbind(0))) if new else {}
        if got:
            if len(kept) + len(new) > self._most:
                kept.clear()
            kept.update(got)
        rows = [got[i] if i in got else kept.get(i) for i in idx]
        if any(r is None for r in rows):   # dropped meanwhile by another thread's lookup
            return self._dequantized(idx)
        return torch.stack(rows)

    def _dequantized(self, idx: list[int]) -> torch.Tensor:
        return dequantize(self.qtype, self.raw, self.rows, self.dim, self.num.torch_dtype,
                          rows=np.asarray(idx, dtype=np.int64)).to(self.num.device)

    def extra_repr(self) -> str:
        return f"{self.rows} x {self.dim}, {self.qtype}, read from the file"
