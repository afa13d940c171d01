"""Prepacked oneDNN linear layers: faster CPU forwards, and cheaper multi-token verification.

On CPU, `nn.Linear` calls MKL's GEMM, which re-packs the weight matrix on every call. For the few
rows of a decode step that packing is most of the work: a forward over 8 tokens costs ~1.7x one
token in fp32, and one token is slower than it needs to be. oneDNN can reorder a weight once into
its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the op PyTorch's own CPU inference
passes use) and then multiply any number of rows by it. Measured on this 2-core CPU, bundled
SmolLM2-135M (`benchmarks/kernels_bench.py`): fp32 one-token forward 39.6 -> 21.1 ms and an 8-token
forward 1.69x -> 1.36x one token; bf16 one token 23.5 -> 19.5 ms.

Invariants
  * PackedLinear(x) equals nn.Linear(x) up to float rounding (another summation order), so a model
    packed here is the same model, and plain and speculative decoding run on the same packed model:
    the lossless guarantee is stated between those two, as before (docs/dtype.md).
  * The packed weight is the only copy (no doubled memory). Where a plain weight is needed
    (state_dict, deepcopy, int8 drafts) it is recovered exactly by multiplying the identity by it.
  * Only CPU tensors in fp32 or bf16 are packed; anything else stays as it was.

Which kernels: measured, never assumed. Packing won 1.78x on a 2-core AMD EPYC (Zen 5) and lost
(0.82x) on a 2-core Intel Xeon with AMX, whose MKL path is better. `auto` therefore measures both
kernel sets' cost curves on the machine at hand (hdcli/engine/costs.py: the same cached measurement that
caps draft trees) and keeps the faster: by the time of a plain step plus an 8-token verification
(what a speculative run alternates between), or of a plain step alone when nothing is drafted.
"""
from __future__ import annotations

import torch

from ..errors import HdError

PACK_ROWS = 8       # the row count oneDNN tunes the layout for; a decode step verifies ~1-16 rows
KERNELS = ("auto", "onednn", "torch", "int4")


def available() -> bool:
    """oneDNN packed linear ops exist in this torch build and oneDNN is usable."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def int4_usable(source: str | None, device: str, dtype: str) -> bool:
    """The int4 set (hdcli/engine/int4.py) can be tried: a GGUF model on CPU in bf16."""
    from . import int4
    return (device == "cpu" and dtype == "bf16" and available() and int4.available()
            and str(source or "").endswith(".gguf"))


def candidates(source: str | None, device: str, dtype: str) -> tuple[str, ...]:
    """The kernel sets `auto` measures for a model."""
    return ("torch", "onednn") + (("int4",) if int4_usable(source, device, dtype) else ())


def resolve(kernels: str, device: str, dtype: str, source: str | None = None) -> str:
    """`auto`: "measure" (choose() decides) on CPU in fp32/bf16 where oneDNN packing is
    available, else torch's own kernels."""
    if kernels not in KERNELS:
        raise HdError(f"--kernels must be one of {', '.join(KERNELS)}, not '{kernels}'")
    usable = device == "cpu" and dtype in ("fp32", "bf16") and available()
    if kernels == "onednn" and not usable:
        raise HdError("--kernels onednn needs a CPU model in fp32 or bf16 and a torch built with "
                      "oneDNN; use --kernels torch")
    if kernels == "int4" and not int4_usable(source, device, dtype):
        raise HdError("--kernels int4 needs a .gguf model with Q4_0/Q4_1 weights, --dtype bf16 on CPU "
                      "and a torch with the int4 CPU kernel; use --kernels auto")
    if kernels == "auto":
        return "measure" if usable else "torch"
    return kernels


SCORE_WIDTHS = (1, 8)  # a speculative run alternates plain steps and ~8-token verifications


def score(curve, drafting: bool = True) -> float:
    """Seconds that rank kernel sets: t(1) + t(8) for drafting, t(1) for plain decoding."""
    return sum(curve.seconds(w) for w in (SCORE_WIDTHS if drafting else SCORE_WIDTHS[:1]))


def setup(model: torch.nn.Module, kernels: str, source: str | None = None) -> None:
    """Put an unconverted, unpacked-or-packed model into a kernel set, in place: "torch" (nn.Linear),
    "onednn" (PackedLinear) or "int4" (the GGUF's 4-bit layers as Int4Linear, the rest packed).
    Raises HdError for int4 when no layer of the GGUF is 4-bit."""
    from . import int4
    if int4.is_converted(model):
        int4.restore(model)
    if kernels == "torch":
        if is_packed(model):
            unpack(model)
        return
    if not is_packed(model):
        pack(model)
    if kernels == "int4" and int4.convert(model, source)["int4"] == 0:
        raise HdError(f"--kernels int4: no Linear weight of {source} is Q4_0/Q4_1; use --kernels auto")


def choose(model: torch.nn.Module, source: str, dtype: str, device: str, drafting: bool = True,
           quiet: bool = False, invariant: str = "off") -> tuple[str, dict, dict | None]:
    """Pick torch's, oneDNN's or (GGUF 4-bit) int4 kernels for an unpacked CPU model by their measured cost curves
    (cached per model/dtype/device/threads/CPU by hdcli.engine.costs; measured here when missing),
    and leave the model in the winner. invariant "auto"/"on": each set is measured in the
    M-invariant forward (engine/invariant.py) where it holds there, and a set where it holds wins
    over one where it does not. Where everything is cached the model is set up once, for the
    winner. Returns (choice, {kernels: curve}, the winner's invariant info or None)."""
    from . import costs, int4, invariant as inv
    keys = {k: costs.curve_key(source, dtype, device, k) for k in candidates(source, device, dtype)}
    state = {"kernels": "torch"}  # what the model is in now

    def set_up(k: str) -> dict | None:
        inv.disable(model)
        try:
            setup(model, k, source)
        except HdError:     # a GGUF without 4-bit layers: int4 is the oneDNN set, measured as such
            pass
        state["kernels"] = k
        return inv.try_enable(model, invariant, keys[k])

    curves, infos = {}, {}
    for k in keys:
        info = None if invariant == "off" else inv.cached_info(keys[k])
        known = invariant == "off" or info is not None
        curve = costs.cached_curve(costs.curve_key(source, dtype, device, k, inv.holds(info)), None,
                                   measure_missing=False) if known else None
        if curve is None:  # measure it, the model set up in this kernel set
            info = set_up(k)
            on = inv.holds(info)
            curve = costs.cached_curve(costs.curve_key(source, dtype, device, k, on), model, quiet=quiet,
                                       desc=f"measuring {'M-invariant ' if on else ''}{k} kernels ({dtype})")
        curves[k], infos[k] = curve, info

    def rank(k):
        return (invariant != "off" and not inv.holds(infos[k]), score(curves[k], drafting))
    best = min(curves, key=rank)
    if state["kernels"] != best or not inv.is_enabled(model) and inv.holds(infos[best]):
        infos[best] = set_up(best)
    if best == "int4" and int4.is_converted(model):   # the bf16 layers: kept for prefills where that pays
        int4.keep_dense(model, keys[best])
    else:
        int4.drop_originals(model)   # the winner stays: the bf16 copies int4 kept for restore() go
    return best, curves, infos[best]


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
