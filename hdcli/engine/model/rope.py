"""Rotary position embeddings, as transformers computes them, from a table.

transformers computes cos and sin per forward: freqs = inv_freq x position (a K = 1 product: one
fp32 multiplication an element), cos(cat(freqs, freqs)) * attention_scaling, cast to the model
dtype. The table holds the same values for positions 0..n - 1, computed the same way, so a lookup
is bit-equal to transformers' per-forward computation; it grows by doubling.

Two layouts of a head's dimensions, by what the file holds (gguf.py, INTERLEAVED_ROPE):
  halves       dimension j rotates with j + d/2 (transformers' rotate_half; Qwen, Gemma);
  interleaved  dimension 2i rotates with 2i + 1 (llama.cpp's rope for `llama` files, whose q and
               k rows its converter interleaved). Elementwise the same arithmetic as halves on
               the un-permuted rows: x * cos + rotate(x) * sin.
"""
from __future__ import annotations

import torch


def inverse_frequencies(cfg, device) -> tuple[torch.Tensor, float]:
    """(inv_freq [d/2] fp32, attention scaling) of a config: the default rope as transformers
    computes it, or transformers' own function for a scaled one (llama3, linear, yarn)."""
    dim = cfg.head_dim
    if not cfg.rope_scaling:
        base = cfg.rope_theta
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim)), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = dict(cfg.rope_scaling, rope_theta=cfg.rope_theta)
    hf = LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, head_dim=dim,
                     max_position_embeddings=cfg.max_position_embeddings, rope_parameters=params)
    inv, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, device)
    return inv.float(), float(scaling)


class Rope:
    def __init__(self, cfg, device):
        self.inv_freq, self.scaling = inverse_frequencies(cfg, device)
        self.interleaved = cfg.rope_interleaved
        self.cos = self.sin = None
        self._dtype = None

    def _grow(self, n: int, dtype) -> None:
        size = max(256, 1 << (n - 1).bit_length())
        pos = torch.arange(size, device=self.inv_freq.device, dtype=torch.float)
        freqs = pos[:, None] * self.inv_freq[None, :]                      # [size, d/2]
        if self.interleaved:
            emb = freqs.repeat_interleave(2, -1)
        else:
            emb = torch.cat([freqs, freqs], -1)
        self.cos = (emb.cos() * self.scaling).to(dtype)
        self.sin = (emb.sin() * self.scaling).to(dtype)
        self._dtype = dtype

    def __call__(self, positions: torch.Tensor, dtype, top: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [m, d] for positions [m] (long); top: more than the greatest of them, where
        the caller knows it (else read off the positions: a reduction and a sync)."""
        if top is None:
            top = int(positions.max()) + 1 if positions.numel() else 1
        self._reach(top, dtype)
        return self.cos[positions], self.sin[positions]

    def span(self, start: int, stop: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [stop - start, d] for positions start .. stop - 1: rows of the table (views)."""
        self._reach(stop, dtype)
        return self.cos[start:stop], self.sin[start:stop]

    def _reach(self, top: int, dtype) -> None:
        """The table in `dtype` holding positions 0 .. top - 1 at least."""
        if self.cos is None or self.cos.shape[0] < top or self._dtype != dtype:
            self._grow(max(top, 1), dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [heads, m, d] rotated: x * cos + rotate(x) * sin (transformers' apply_rotary_pos_emb)."""
        if self.interleaved:
            pairs = x.unflatten(-1, (-1, 2))
            rot = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
        else:
            half = x.shape[-1] // 2
            rot = torch.cat((-x[..., half:], x[..., :half]), -1)
        return (x * cos) + (rot * sin)
