"""hd's own forward for Gemma 3 text models (GGUF architecture `gemma3`), as transformers'
Gemma3ForCausalLM computes it:

  x = embed(ids) * sqrt(hidden)                       (the scale in the model dtype)
  per block: x += post_attention_norm(o(attention(q_norm(q), k_norm(k), v)))
             x += post_ffw_norm(down(gelu_tanh(gate(h)) * up(h))), h = ffn_norm(x)
  logits = head(output_norm(x))                       (the head is the embedding, tied)

What differs from the llama family:
  * RMSNorm scales by (1 + w), in fp32 (Gemma3RMSNorm). llama.cpp's converter stores 1 + w in the
    file; transformers subtracts the 1 when it loads, in fp32, and keeps w in the model dtype:
    we do the same, so (1 + w) is the same number here. A transformers checkpoint holds w: read
    as it is (norm_weight);
  * sliding-window blocks: five of every six (block i is global when (i + 1) % 6 == 0, the
    pattern llama.cpp and transformers use for Gemma 3), or as a checkpoint's config lists
    them (layer_types); a sliding block's query at position p
    sees keys at positions p - window + 1 .. p, a tree node by its own position (invariant
    layouts take any visibility, so trees and the M-invariant mode work past the window);
  * two ropes: global blocks at the file's rope.freq_base (with its scaling), sliding ones at
    10000 (Gemma 3's rope_local_base_freq; a GGUF does not carry it, a checkpoint's config does);
  * the attention scale is query_pre_attn_scalar ** -0.5 where a checkpoint's config states it;
    in a GGUF head_dim ** -0.5, except the 27B (62 blocks), whose scale is (hidden / heads) ** -0.5,
    as llama.cpp sets it;
  * rotary halves (NeoX), GELU (tanh) in the MLP, no soft-capping (Gemma 3 has none).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .llama import Block, LlamaForward
from .numerics import Numerics
from .rope import Rope
from .parts import RowOps, dequantize

PATTERN = 6             # every 6th block attends globally
LOCAL_ROPE_BASE = 10000.0


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma3RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32, then x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


class GemmaNorms(RowOps):
    """Gemma's row ops: every norm a Gemma3RMSNorm (the heads' q and k norms too), in torch ops."""

    def norm(self, x, weight):
        return gemma_norm(x, weight, self.eps)

    def head_norm(self, y, weight):
        return gemma_norm(y, weight, self.eps)


class GemmaBlock(Block):
    def __init__(self, i: int, gf, cfg, num: Numerics, kind: str, ops: RowOps):
        super().__init__(i, gf, cfg, num, kind, ops)
        p = f"blk.{i}."
        for name, key in (("attn_norm", "attn_norm"), ("ffn_norm", "ffn_norm"), ("post_attn_norm", "post_attention_norm"),
                          ("post_ffn_norm", "post_ffw_norm"), ("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
            setattr(self, name, nn.Parameter(norm_weight(gf, cfg, p + key + ".weight", num), requires_grad=False))

    def forward(self, x: torch.Tensor, step) -> torch.Tensor:
        norm = self.ops.norm
        q, k, v = self.qkv_heads(norm(x, self.attn_norm), step)
        x = x + norm(self.o(step.attend(self, q, k, v)), self.post_attn_norm)
        gate, up = self.gate_and_up(norm(x, self.ffn_norm))
        return x + norm(self.down(nn.functional.gelu(gate, approximate="tanh") * up), self.post_ffn_norm)


def norm_weight(gf, cfg, name: str, num: Numerics) -> torch.Tensor:
    """A Gemma norm weight w in the model dtype. A GGUF holds 1 + w: subtracted in fp32, then the
    model dtype (as transformers loads a GGUF); a transformers checkpoint holds w itself
    (cfg.extra["norm_plus_one"] False): cast as transformers casts it."""
    if not cfg.extra.get("norm_plus_one", True):
        return num.vector(gf, name)
    qtype, raw, shape = gf.raw(name)
    w = dequantize(qtype, raw.reshape(1, -1), 1, shape[-1], torch.float32).reshape(-1)
    return (w - 1).to(num.torch_dtype).to(num.device)


class Gemma3Forward(LlamaForward):
    family = "gemma3"
    block_class = GemmaBlock

    def __init__(self, gf, cfg, num: Numerics, progress=None):
        super().__init__(gf, cfg, num, progress)
        self.norm = nn.Parameter(norm_weight(gf, cfg, "output_norm.weight", num), requires_grad=False)
        local = copy.copy(cfg)
        local.rope_theta, local.rope_scaling = cfg.extra.get("rope_local_base_freq", LOCAL_ROPE_BASE), None
        self.local_rope = Rope(local, num.device)
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5)
        heads = cfg.num_attention_heads
        scalar = cfg.extra.get("query_pre_attn_scalar")   # a checkpoint's config states it
        if scalar:
            self.scaling = float(scalar) ** -0.5
        else:
            self.scaling = ((cfg.hidden_size / heads) ** -0.5 if cfg.num_hidden_layers == 62
                            else cfg.head_dim ** -0.5)

    def block_kind(self, i: int) -> str:
        if not self.config.sliding_window:
            return "full"
        if self.config.extra.get("layer_types"):   # a checkpoint's config lists them
            return super().block_kind(i)
        return "full" if (i + 1) % PATTERN == 0 else "sliding"

    def rope_for(self, kind: str) -> Rope:
        return self.local_rope if kind == "sliding" else self.rope

    def embed_rows(self, ids) -> torch.Tensor:
        x = self.embed(ids)
        return x * self.embed_scale.to(x.dtype)

    def choose_row_ops(self, num: Numerics) -> RowOps:
        return GemmaNorms(self.config.rms_norm_eps)
