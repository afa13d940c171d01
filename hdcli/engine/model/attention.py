"""How the blocks of one owned forward attend: Step, what a forward over some parts (streams, each
with its own cache) derives once and every block reads, and the attention strategies, one object a
way of attending.

Which strategy runs is chosen once a forward (Step.__init__), from the model's numerics
(Numerics.invariant: calibration turns it on or off after the model is built) and the process's
attention kernel the model holds (kernels/fused.AttentionKernel: tests and benchmarks pin it on a
loaded model to compare the two); never per block:
  PLAIN     the M-invariant mode off: SDPA over each part's cache (no row-count guarantee);
  FUSED     the mode on, the compiled attention: every part in one call, which appends the keys too;
  PROMPT    the mode on, torch ops, one prompt wider than a verification on an empty cache: SDPA
            told it is causal (the keys of a prompt are the same in plain and speculative
            decoding), masked where the block has a window;
  ONE       the mode on, torch ops, one part: invariant.attend_kv;
  MANY      the same for several parts at once: invariant.attend_many.
A block's kind ("full" or "sliding": its window and rope) is its Block's (Block.kind); each part's
visibility and layout per kind is derived once a forward (Step.visible, Step.lays) and shared by
every block of that kind.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from ..kernels import invariant


def attends_fused(model, device) -> bool:
    """Whether a forward of `model` on `device` attends by the fused attention (Step's FUSED: the
    M-invariant mode on, the process's attention kernel running there)."""
    return model.numerics.invariant and model.attention_kernel.runs_on(device)


class Step:
    """What one forward over some parts derives once and every block reads: rows, positions,
    the rope of each attention kind, each part's attention layout by kind, and the attention."""

    def __init__(self, model, parts):
        cfg = model.config
        self.model, self.parts = model, parts
        self.sizes = sizes = [p[0].shape[1] for p in parts]
        self.m = m = sum(sizes)
        self.pasts = pasts = [p[1].get_seq_length() for p in parts]
        self.ids = (parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts], 1))[0]
        # every part at its next positions (none given): the rope table's reach is known, and one
        # part's cos and sin are a slice of it (no position tensor made, reduced or gathered by)
        self.next_positions = all(p[2] is None for p in parts)
        self.top = max(a + k for a, k in zip(pasts, sizes)) if self.next_positions else None
        self.bounds = invariant.row_bounds(sizes)
        self.hq, self.hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.kernel = model.attention_kernel
        wide_prompt = len(parts) == 1 and pasts[0] == 0 and m > invariant.MAX_ROWS
        self.attention = self._attention(model.numerics.invariant, wide_prompt)
        self._rope, self._lays, self._many = {}, {}, {}

    def _attention(self, invariant_mode: bool, wide_prompt: bool):
        if not invariant_mode:
            return PLAIN
        if attends_fused(self.model, self.ids.device):   # it takes a prompt as it is
            return FUSED
        if wide_prompt:
            return PROMPT
        return ONE if len(self.parts) == 1 else MANY

    @functools.cached_property
    def positions(self) -> list[torch.Tensor]:
        """Each part's positions [1, m_j]: as given, else its next ones."""
        return [p[2] if p[2] is not None else torch.arange(past, past + k, device=self.ids.device).unsqueeze(0)
                for p, past, k in zip(self.parts, self.pasts, self.sizes)]

    @functools.cached_property
    def pos(self) -> torch.Tensor:
        """Every row's position [m], the parts' in order."""
        pos = self.positions
        return (pos[0] if len(pos) == 1 else torch.cat(pos, 1))[0]

    def rope(self, kind: str):
        """(rope, cos, sin) of the positions for a block of `kind`."""
        if kind not in self._rope:
            rope = self.model.rope_for(kind)
            if self.next_positions and len(self.parts) == 1:
                cos_sin = rope.span(self.pasts[0], self.pasts[0] + self.m, self.model.dtype)
            else:
                cos_sin = rope(self.pos, self.model.dtype, self.top)
            self._rope[kind] = (rope, *cos_sin)
        return self._rope[kind]

    def layers(self, i: int) -> list:
        """Each part's cache of block i (its cache's layers[i])."""
        return [p[1].layers[i] for p in self.parts]

    def visible(self, j: int, kind: str) -> torch.Tensor | None:
        """Part j's [m_j, past + m_j] bool visibility for a block of `kind` (None: causal, full)."""
        ids, cache, pos, mask = self.parts[j]
        window = self.model.window(kind)
        if mask is None and window is None:
            return None
        m, past = self.sizes[j], self.pasts[j]
        vis = invariant._visible(mask, m, past + m, self.ids.device)
        if window is not None:   # positions of the keys: the cache's are its slots, the part's its own
            kpos = torch.cat([torch.arange(past, device=vis.device), self.positions[j][0]])
            vis = vis & ((self.positions[j][0][:, None] - kpos[None, :]) < window)
        return vis

    def lays(self, kind: str) -> list:
        """Each part's invariant attention layout for a block of `kind`."""
        if kind not in self._lays:
            g = self.hq // self.hkv
            self._lays[kind] = [invariant.layout(self.visible(j, kind), k, past + k, g, self.ids.device)
                                for j, (past, k) in enumerate(zip(self.pasts, self.sizes))]
        return self._lays[kind]

    def many(self, kind: str) -> invariant.Many:
        """How the parts share the torch ops' attention in a block of `kind`."""
        if kind not in self._many:
            self._many[kind] = invariant.Many(self.lays(kind), self.sizes, self.hq, self.hkv, self.ids.device)
        return self._many[kind]

    def attend(self, block, q, k, v) -> torch.Tensor:
        """The block's attention of q [1, hq, m, d] over each part's cache and its new k, v
        (appended here). Returns [m, hq * d]."""
        return self.attention(self, block.index, block.kind, q, k, v).reshape(self.m, -1)

    def store(self, i: int, k, v) -> None:
        """Append each part's rows of k, v [hkv, m, d] to its cache of block i (a prefill's last block)."""
        for layer, (a, b) in zip(self.layers(i), self.bounds):
            layer.append(k[None, :, a:b], v[None, :, a:b])


def plain_attention(step: Step, i: int, kind: str, q, k, v) -> torch.Tensor:
    """Outside the M-invariant mode: SDPA over each part's cache (no row-count guarantee)."""
    outs = []
    for j, (layer, (a, b)) in enumerate(zip(step.layers(i), step.bounds)):
        layer.append(k[:, :, a:b], v[:, :, a:b])
        keys, values = layer.keys, layer.values
        vis = step.visible(j, kind)
        n, mq = keys.shape[2], b - a
        if vis is None:
            vis = torch.ones(mq, n, dtype=torch.bool, device=q.device).tril(n - mq)
        o = nn.functional.scaled_dot_product_attention(
            q[:, :, a:b], keys.to(q.dtype), values.to(q.dtype), attn_mask=vis, scale=step.model.scaling,
            enable_gqa=keys.shape[1] != q.shape[1])
        outs.append(o.transpose(1, 2))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


def fused_attention(step: Step, i: int, kind: str, q, k, v) -> torch.Tensor:
    """The compiled invariant attention: every part's keys appended and attended in one call."""
    return invariant.append_attend(step.kernel, q, k, v, step.layers(i), step.lays(kind), step.model.scaling)


def prompt_attention(step: Step, i: int, kind: str, q, k, v) -> torch.Tensor:
    """A whole prompt on an empty cache: SDPA told it is causal, or masked by the block's window."""
    step.layers(i)[0].append(k, v)
    vis = step.visible(0, kind)
    if vis is None:
        return invariant.causal_prompt_sdpa(q, k, v, step.model.scaling)
    return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=vis, scale=step.model.scaling,
                                                      enable_gqa=k.shape[1] != q.shape[1]).transpose(1, 2)


def one_attention(step: Step, i: int, kind: str, q, k, v) -> torch.Tensor:
    """The torch ops' invariant attention of one part."""
    layer, lay = step.layers(i)[0], step.lays(kind)[0]
    layer.append(k, v)
    kk, vv = layer.padded(lay.rows)
    return invariant.attend_kv(q, kk[0], vv[0], lay, step.model.scaling)


def many_attention(step: Step, i: int, kind: str, q, k, v) -> torch.Tensor:
    """The torch ops' invariant attention of several parts at once (chains share their GEMMs)."""
    many, kvs = step.many(kind), []
    for j, (layer, (a, b)) in enumerate(zip(step.layers(i), step.bounds)):
        layer.append(k[:, :, a:b], v[:, :, a:b])
        kk, vv = layer.padded(many.key_rows(j))
        kvs.append((kk[0], vv[0]))
    return invariant.attend_many(q, kvs, many, step.model.scaling)


PLAIN, FUSED, PROMPT, ONE, MANY = plain_attention, fused_attention, prompt_attention, one_attention, many_attention
