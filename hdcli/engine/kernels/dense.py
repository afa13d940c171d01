"""Prepacked oneDNN linear layers: faster CPU forwards, and cheaper multi-token verification.

On CPU, `nn.Linear` calls MKL's GEMM, which re-packs the weight matrix on every call. For the few
rows of a decode step that packing is most of the work: a forward over 8 tokens costs much more
than one token in fp32, and one token is slower than it needs to be. oneDNN can reorder a weight once into
its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the op PyTorch's own CPU inference
passes use) and then multiply any number of rows by it: both the one-token forward and the
8-token one's cost over it fall (`benchmarks/kernels_bench.py`, docs/dtype.md).

Invariants
  * PackedLinear(x) equals nn.Linear(x) up to float rounding (another summation order), so a model
    packed here is the same model, and plain and speculative decoding run on the same packed model:
    the lossless guarantee is stated between those two, as before (docs/dtype.md).
  * The packed weight is the only copy (no doubled memory). Where a plain weight is needed
    (state_dict, deepcopy, int8 drafts) it is recovered exactly by multiplying the identity by it.
  * Only CPU tensors in fp32 or bf16 are packed; anything else stays as it was.

Which kernels (a Numerics field of hd's own forward, engine/model/numerics.py): `auto` is, for a
GGUF, the file's blocks (engine/kernels/quants.py, where hd has a kernel for their type; the rest
oneDNN-packed) with int8 activations ("gguf-int8", llama.cpp's way: VPDPBUSD, cheap verification
rows) where this CPU has AVX512-VNNI and its once-measured record (quants.activation_choice, cached
per CPU) found them faster, else bf16 activations ("gguf"); the two round differently, so the choice
is the machine's, fixed once, and recorded in the numerics. For a safetensors checkpoint `auto` is
oneDNN-packed dense layers for a safetensors checkpoint where oneDNN is usable; "torch" keeps
torch's own Linear. Packing won on the AMD CPUs measured and lost on an Intel CPU with AMX, whose
MKL path is better: there `--kernels torch` is the faster choice (docs/benchmarks.md).
`int4`, the older name of the GGUF 4-bit set, is accepted as an alias of `gguf`.
"""
from __future__ import annotations

import functools

import torch

from ...errors import HdError

PACK_ROWS = 8       # the row count oneDNN tunes the layout for; a decode step verifies ~1-16 rows
KERNELS = ("auto", "gguf", "gguf-int8", "onednn", "torch", "int4")
GGUF = ("gguf", "gguf-int8")   # the sets that multiply a GGUF's own blocks (engine/kernels/quants.py)
ALIASES = {"int4": "gguf"}   # the older name of the GGUF 4-bit set: scripts and recorded configs keep working


def available(dtype: str = "fp32") -> bool:
    """oneDNN packed linear ops exist in this torch build and pack weights of `dtype` ("fp32" or
    "bf16") on this CPU. bf16 packing needs AVX-512 (bw, vl, dq) or AVX-NE-CONVERT: on an AVX2-only
    CPU (e.g. AMD Zen 3) oneDNN raises at pack time, so the bf16 answer is probed once, not assumed."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return False
    return dtype != "bf16" or _packs_bf16()


@functools.lru_cache(maxsize=None)
def _packs_bf16() -> bool:
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), PACK_ROWS)
            torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16, dtype=torch.bfloat16), packed, None, "none", [], "")
        return True
    except RuntimeError:
        return False


def resolve(kernels: str) -> str:
    """A --kernels value checked, aliases resolved ("int4" is "gguf"); what it means for a model
    is decided where the model loads (engine/loader.py: owned_kernels, _stock)."""
    if kernels not in KERNELS:
        raise HdError(f"--kernels must be one of {', '.join(KERNELS)}, not '{kernels}'")
    return ALIASES.get(kernels, kernels)


def padded_rows(m: int) -> int:
    """The row count a forward over m rows is run at. oneDNN compiles and caches a kernel per
    shape (~0.75 MB each, up to 1024 of them), so feeding every prompt length as is grows the heap
    by megabytes per request until that cache is full. Up to 16 rows (a decode step) run exactly;
    above, rows are padded with zeros to one of 4 sizes per octave (<= 25% more rows, in the
    Linear layers only), so a server sees ~50 sizes per weight shape, whatever its prompts."""
    if m <= 16:
        return m
    step = 1 << max(3, m.bit_length() - 3)
    return -(-m // step) * step


class PackedLinear(torch.nn.Module):
    """An nn.Linear whose weight lives in oneDNN's blocked layout (see the module docstring)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(),
                                                                         requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        m = rows.shape[0]
        padded = padded_rows(m)
        if padded != m:
            rows = torch.cat([rows, rows.new_zeros(padded - m, self.in_features)])
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y[:m].reshape(*x.shape[:-1], self.out_features)

    def weight_matrix(self) -> torch.Tensor:
        """The plain [out, in] weight, exactly: I @ W^T is W^T (products by 1 and 0 are exact)."""
        eye = torch.eye(self.in_features, dtype=self.dtype)
        return torch.ops.mkldnn._linear_pointwise(eye, self.packed, None, "none", [], "").t().contiguous()

    def to_linear(self) -> torch.nn.Linear:
        lin = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                              dtype=self.dtype)
        with torch.no_grad():
            lin.weight.copy_(self.weight_matrix())
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin.eval()

    def __deepcopy__(self, memo):  # the packed tensor is opaque: copy through a plain Linear
        return PackedLinear(self.to_linear())

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight_matrix()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias.detach()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN packed"


def _replace(model: torch.nn.Module, want, make) -> int:
    n = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if want(child):
                setattr(module, name, make(child))
                n += 1
    return n


def pack(model: torch.nn.Module) -> int:
    """Replace the model's CPU fp32/bf16 nn.Linear layers by PackedLinear, in place. Returns how
    many were replaced."""
    def packable(m):
        return (type(m) is torch.nn.Linear and m.weight.device.type == "cpu"
                and m.weight.dtype in (torch.float32, torch.bfloat16))
    with torch.inference_mode():
        return _replace(model, packable, PackedLinear)


def unpack(model: torch.nn.Module) -> int:
    """Turn every PackedLinear back into an nn.Linear with the same weights, in place."""
    return _replace(model, lambda m: isinstance(m, PackedLinear), PackedLinear.to_linear)


def is_packed(model: torch.nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())
