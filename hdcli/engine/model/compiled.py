"""A forward's decoder blocks, final norm and head in one compiled call (csrc/qmm.cpp's Layers).

The Python blocks (llama.Block) make a dozen calls a block into torch or hd's kernels: at the
bundled model's size that Python and dispatch was a quarter of a one-token forward
(docs/benchmarks.md). CompiledLayers hands every block of a forward, then the final norm and
the head, to one C++ call that runs the same functions and torch ops the blocks call, in their
order, on the same tensors: the logits and caches are torch.equal to the Python path's
(tests/test_invariant.py, tests/test_owned.py), so whatever the blocks guarantee (M-invariant
rows, exactness) holds through it unchanged.

Where it runs (`why_not` says why not, else None): bf16 or fp32 on the CPU, every block one of
three styles (STYLES): the llama family's (pre-norms; Qwen2's q/k/v biases, Qwen3's per-head q/k
norms, Granite's residual multiplier), OLMo 2's (a norm after each sublayer, none before, q and k
normed over their whole width) or Gemma 3's ((1 + w) norms before and after each sublayer, q/k
norms, GELU), full or sliding-window attention; every Linear on a kernel Layers calls (_kernel: the
GGUF GEMM with bf16 or int8 activations, oneDNN's packed layers, torch's Linear; padded to its
calibrated least row count as Linear pads), so a GGUF and a safetensors checkpoint alike; the row
ops the model's (compiled in bf16, torch's in fp32); the fused attention (Step.attention FUSED, the
M-invariant mode on). Elsewhere (the torch ops' attention, the mode off, the GPU) the blocks run.
Its keys and values go where the Python path's go: each part's kvcache.InvariantLayer, claimed here
before the call, written and attended inside it. A prefill's last block (keys only) stays Python.

A model's handle is built at its first forward and rebuilt when its blocks or head change (subset,
truncated share the weights, not the handle). `LlamaForward.compiled_layers = False` runs the
Python blocks (tests and benchmarks compare the two).
"""
from __future__ import annotations

import torch

from ..kernels import dense, fused, quants
from .parts import CompiledRowOps, RowOps


STYLES = ("llama", "gemma3", "olmo2")   # Layers' block styles, by index (csrc/qmm.cpp's Style)
KINDS = ("full", "sliding")   # a block's attention kind, by its index in Layers


def why_not(model) -> str | None:
    """Why the model's blocks cannot run as one compiled call, or None where they can."""
    num = model.numerics
    if model.family not in ("llama", "gemma3") or num.dtype not in ("bf16", "fp32") or num.device != "cpu":
        return "not a bf16 or fp32 llama-family or Gemma 3 model on the CPU"
    if model.family == "llama" and type(model.row_ops) not in (RowOps, CompiledRowOps):
        return "the row ops are not the llama family's"
    module = quants.gemm_module()
    if module is None or not hasattr(module, "Layers"):
        return "the GGUF GEMM's extension has no Layers"
    if fused.KERNEL.module is None or not hasattr(fused.KERNEL.module, "append_attend_many_address"):
        return "the fused attention is not loaded"
    if not model.blocks:
        return "the model has no blocks"
    style = _style(model)
    for blk in model.blocks:
        if (blk.kind not in KINDS or blk.residual_scale != model.blocks[0].residual_scale
                or not _is_style(blk, style)):
            return f"block {blk.index} is not the {style} block Layers computes"
        for lin in _slots(blk):
            if lin is not None and _kernel(lin) is None:
                return f"block {blk.index} has a linear layer on a kernel Layers does not call ({lin.kind})"
        if (blk.qkv is None and blk.q is None) or (blk.gate_up is None and blk.gate is None):
            return f"block {blk.index} is not the {style} block Layers computes"
    if _kernel(model.head) is None:
        return f"the head is on a kernel Layers does not call ({model.head.kind})"
    return None


def _style(model) -> str:
    """The block style Layers computes a model's blocks in: Gemma 3's, OLMo 2's (a norm after each
    sublayer, none before), or the llama family's."""
    if model.family == "gemma3":
        return "gemma3"
    return "olmo2" if model.blocks and model.blocks[0].attn_norm is None else "llama"


def _is_style(blk, style: str) -> bool:
    """Whether a block is the one Layers computes in that style (the residual multiplier aside)."""
    pre = blk.attn_norm is not None and blk.ffn_norm is not None
    post = blk.post_attn_norm is not None and blk.post_ffn_norm is not None
    qk = blk.q_norm is not None and blk.k_norm is not None
    if style == "olmo2":    # a norm after each sublayer only; q and k normed over their whole width
        return post and not pre and qk and blk.wide_qk_norm and blk.residual_scale == 1.0
    if style == "gemma3":   # norms before and after each sublayer; each head's q and k normed
        return pre and post and qk and not blk.wide_qk_norm and blk.residual_scale == 1.0
    return pre and not post and not blk.wide_qk_norm   # llama: before each; a head's q/k norms or none


def _kernel(lin):
    """(kind, weight, fmt, bias) of a Linear as Layers' Gemm takes it, or None where its kernel is
    not one Layers calls: quants.QLinear, dense.PackedLinear, or a plain nn.Linear."""
    k = lin.kernel
    if lin.kind == "gguf" and isinstance(k, quants.QLinear):
        return lin.kernel_name, k.packed, k.fmt, k.bias
    if lin.kind == "onednn" and isinstance(k, dense.PackedLinear):
        return "onednn", k.packed, "", k.bias
    if lin.kind == "torch" and type(k) is torch.nn.Linear:
        return "torch", k.weight, "", k.bias
    return None


def _slots(blk) -> list:
    """A block's Linear layers in Layers' seven slots: q (or q, k, v joined), k, v, o, gate (or
    gate and up joined), up, down; None for a slot a joined layer covers."""
    q, k, v = (blk.qkv, None, None) if blk.qkv is not None else (blk.q, blk.k, blk.v)
    gate, up = (blk.gate_up, None) if blk.gate_up is not None else (blk.gate, blk.up)
    return [q, k, v, blk.o, gate, up, blk.down]


class CompiledLayers:
    """The handle of one model's blocks, final norm and head (csrc/qmm.cpp's Layers: their norms
    and Linear kernels, the attention's address) and the per-forward bookkeeping around its call."""

    def __init__(self, model):
        blocks = list(model.blocks)
        norms, slots = [], []
        for blk in blocks:
            norms += [None if n is None else n.data for n in (blk.attn_norm, blk.ffn_norm, blk.post_attn_norm,
                                                                blk.post_ffn_norm, blk.q_norm, blk.k_norm)]
            slots += _slots(blk)
        slots.append(model.head)
        got = [("", torch.empty(0), "", None) if lin is None else _kernel(lin) for lin in slots]
        kinds, ws, fmts, biases = (list(field) for field in zip(*got))
        min_rows = [1 if lin is None else lin.min_rows for lin in slots]
        cfg, blk = model.config, blocks[0]
        self.kinds = [b.kind for b in blocks]
        self.handle = quants.gemm_module().Layers(
            norms, kinds, ws, fmts, biases, min_rows, model.norm.data, [KINDS.index(k) for k in self.kinds],
            blk.hq, blk.hkv, blk.d, float(cfg.rms_norm_eps), bool(model.rope.interleaved), STYLES.index(_style(model)),
            model.numerics.rows == "compiled", float(blk.residual_scale),
            int(fused.KERNEL.module.append_attend_many_address()))
        self.like = torch.empty(1, blk.hkv, 0, blk.d, dtype=model.dtype)   # what a new cache layer is made for

    def run(self, x: torch.Tensor, step, n: int, head: bool = False) -> torch.Tensor:
        """x [M, D] (the embedded rows of every part) through blocks 0 .. n - 1, each part's keys
        and values appended to its cache layers as the blocks append them; with head (n every
        block), through the final norm and the head as well: the logits [M, V]."""
        cos, sin, viss = [], [], {}
        for kind in KINDS[:1 + ("sliding" in self.kinds[:n])]:
            _, c, s = step.rope(kind)
            cos.append(c), sin.append(s)
            viss[kind] = [lay.vis for lay in step.lays(kind)]
        caches = [part[1].layers for part in step.parts]
        owners, owner_viss = [], []   # block by block, a part after another
        for i, kind in zip(range(n), self.kinds):
            owners += [layers[i] for layers in caches]
            owner_viss += viss[kind]
        got = fused.claimed(owners, owner_viss, self.like)
        x = self.handle.forward(x, cos, sin, n, *got, [v for k in viss for v in viss[k]],
                                float(step.model.scaling), head)
        fused.transposed_now(owners, owner_viss)
        return x


def layers_of(model) -> CompiledLayers | None:
    """The model's compiled blocks where they run (why_not), else None: decided once per state of
    what why_not reads that can change after a model is built (its blocks and head, the calibration's
    min_rows record, the attention kernel's module), kept on the model."""
    key = (model.blocks, model.head, model.numerics.min_rows, fused.KERNEL.module)
    held = model.__dict__.get("_compiled")
    if held is None or any(a is not b for a, b in zip(held[0], key)):
        held = (key, CompiledLayers(model) if why_not(model) is None else None)
        model.__dict__["_compiled"] = held
    return held[1]
