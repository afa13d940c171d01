"""A forward's decoder layers in one compiled call (csrc/qmm.cpp's Layers), llama family and Gemma 3.

The Python blocks (llama.Block) make a dozen calls a layer into torch or hd's kernels: at the
bundled model's size that Python and dispatch was 2-2.5 ms of an 8.4 ms one-token forward (as
AVX2, docs/benchmarks.md). CompiledLayers hands every layer of a forward to one C++ call that
runs the same functions and torch ops the blocks call, in their order, on the same tensors: the
hidden state after each layer is torch.equal to the Python path's (tests/test_invariant.py), so
whatever the blocks guarantee (M-invariant rows, exactness) holds through it unchanged.

Where it runs (`why_not` says why not, else None): every block the plain llama one (pre-norms,
Qwen3's per-head q/k norms or none, no post-sublayer norms, no residual multiplier) or Gemma 3's
((1 + w) norms before and after each sublayer, q/k norms, GELU), full or sliding-window attention,
on bf16 GGUF GEMMs (quants.QLinear, no row padding, Qwen2's biases or none; q/k/v and gate/up
joined into one GEMM where the file's types allow, as the blocks have them), the compiled row ops
(llama) and the fused attention (Step.attention FUSED). Elsewhere (fp32, dense kernels, OLMo 2's
norms, Granite, the torch ops' attention) the blocks run as before. Its keys and values go where
the Python path's go: each part's kvcache.InvariantLayer, claimed here before the call, written
and attended inside it.

A model's handle is built at its first forward and rebuilt when its blocks change (subset,
truncated share the weights, not the handle). `LlamaForward.compiled_layers = False` runs the
Python blocks (tests and benchmarks compare the two).
"""
from __future__ import annotations

import torch

from ..kernels import fused, quants
from .layers import CompiledRowOps


def why_not(model) -> str | None:
    """Why the model's layers cannot run as one compiled call, or None where they can."""
    gemma = model.family == "gemma3"
    if model.family not in ("llama", "gemma3") or model.numerics.dtype != "bf16" or model.numerics.device != "cpu":
        return "not a bf16 llama-family or Gemma 3 model on the CPU"
    if not gemma and not isinstance(model.row_ops, CompiledRowOps):
        return "the row ops are torch's"
    module = quants.gemm_module()
    if module is None or not hasattr(module, "Layers"):
        return "the GGUF GEMM's extension has no Layers"
    if fused.KERNEL.module is None or not hasattr(fused.KERNEL.module, "append_attend_many_address"):
        return "the fused attention is not loaded"
    for blk in model.blocks:
        post = blk.post_attn_norm is not None and blk.post_ffn_norm is not None
        if (blk.kind not in KINDS or blk.wide_qk_norm or blk.attn_norm is None or blk.ffn_norm is None
                or blk.residual_scale != 1.0 or post != gemma or (gemma and (blk.q_norm is None or blk.k_norm is None))):
            return f"layer {blk.index} is not the {model.family} block Layers computes"
        for lin in _slots(blk):
            if lin is not None and (lin.kind != "gguf" or lin.min_rows != 1):
                return f"layer {blk.index} has a linear layer off the GGUF GEMM ({lin.kind}, {lin.qtype})"
        if (blk.qkv is None and blk.q is None) or (blk.gate_up is None and blk.gate is None):
            return f"layer {blk.index} is not the {model.family} block Layers computes"
    return None


KINDS = ("full", "sliding")   # a layer's attention kind, by its index in Layers


def _slots(blk) -> list:
    """A block's Linear layers in Layers' seven slots: q (or q, k, v joined), k, v, o, gate (or
    gate and up joined), up, down; None for a slot a joined layer covers."""
    q, k, v = (blk.qkv, None, None) if blk.qkv is not None else (blk.q, blk.k, blk.v)
    gate, up = (blk.gate_up, None) if blk.gate_up is not None else (blk.gate, blk.up)
    return [q, k, v, blk.o, gate, up, blk.down]


class CompiledLayers:
    """The handle of one model's blocks (csrc/qmm.cpp's Layers: their norms and packings, the
    attention's address) and the per-forward bookkeeping around its call."""

    def __init__(self, model):
        blocks = list(model.blocks)
        norms, packed, fmts, int8, biases = [], [], [], [], []
        for blk in blocks:
            norms += [None if n is None else n.data for n in (blk.attn_norm, blk.ffn_norm, blk.post_attn_norm,
                                                                blk.post_ffn_norm, blk.q_norm, blk.k_norm)]
            for lin in _slots(blk):
                packed.append(torch.empty(0, dtype=torch.uint8) if lin is None else lin.kernel.packed)
                fmts.append("" if lin is None else lin.kernel.fmt)
                int8.append(lin is not None and lin.kernel.activations == "int8")
                biases.append(None if lin is None else lin.kernel.bias)
        cfg, blk = model.config, blocks[0]
        self.kinds = [b.kind for b in blocks]
        self.handle = quants.gemm_module().Layers(
            norms, packed, fmts, int8, biases, [KINDS.index(k) for k in self.kinds], blk.hq, blk.hkv, blk.d,
            float(cfg.rms_norm_eps), bool(model.rope.interleaved), model.family == "gemma3",
            int(fused.KERNEL.module.append_attend_many_address()))
        self.like = torch.empty(1, blk.hkv, 0, blk.d, dtype=model.dtype)   # what a new cache layer is made for

    def run(self, x: torch.Tensor, step, n: int) -> torch.Tensor:
        """x [M, D] (the embedded rows of every part) through layers 0 .. n - 1, each part's keys
        and values appended to its cache layers as the blocks append them."""
        cos, sin, viss = [], [], {}
        for kind in KINDS[:1 + ("sliding" in self.kinds[:n])]:
            _, c, s = step.rope(kind)
            cos.append(c), sin.append(s)
            viss[kind] = [lay.vis for lay in step.lays(kind)]
        owners = [step.layers(i) for i in range(n)]
        starts, ks, kts, kt_lens, vs = [], [], [], [], []   # layer by layer, a part after another
        for layers, kind in zip(owners, self.kinds):
            for got, field in zip(fused.claimed(layers, viss[kind], self.like), (starts, ks, kts, kt_lens, vs)):
                field += got
        x = self.handle.forward(x, cos, sin, n, starts, ks, kts, kt_lens, vs, [v for k in viss for v in viss[k]],
                                float(step.model.scaling))
        for layers, kind in zip(owners, self.kinds):
            fused.transposed_now(layers, viss[kind])
        return x


def layers_of(model) -> CompiledLayers | None:
    """The model's compiled layers where they run (why_not), else None: decided once per state of
    what why_not reads that can change after a model is built (its blocks, the calibration's
    min_rows record, the attention kernel's module), kept on the model."""
    key = (model.blocks, model.numerics.min_rows, fused.KERNEL.module)
    held = model.__dict__.get("_compiled")
    if held is None or any(a is not b for a, b in zip(held[0], key)):
        held = (key, CompiledLayers(model) if why_not(model) is None else None)
        model.__dict__["_compiled"] = held
    return held[1]
