"""hd's own forward for the llama family (Llama 2/3, Vicuna, SmolLM2, Mistral, Qwen2/Qwen3), from a
GGUF file in the file's own bits, or from a transformers checkpoint.

One decoder layer: x += o(attention(rope(q(norm(x))), rope(k(norm(x))), v(norm(x))));
x += down(silu(gate(norm(x))) * up(norm(x))); then the final norm and the head. Qwen2's q/k/v
biases and Qwen3's per-head q/k norms are read where the file has them; rope scaling as the
file's metadata states it (transformers' rope functions compute the frequencies); a sliding
window where a checkpoint's config gives its layers one (Mistral v0.1, Qwen2 with
use_sliding_window). The source is a GGUF file (gguf.GGUFFile) or a transformers checkpoint
(checkpoint.Checkpoint): both answer in GGUF tensor names.

Same numerics as transformers' LlamaModel, op by op, where it matters for the reference tests
(tests/test_owned.py): norms in fp32 then the model dtype times the weight, rope as
x * cos + rotate(x) * sin with the frequencies computed in fp32, attention in fp32 in the
M-invariant mode (engine/kernels/invariant.py). Two things differ by design:
  * q and k stay in the file's row order. llama.cpp's converter interleaves each head's rotary
    halves for `llama`; transformers un-permutes them on load, hd rotates the pairs (2i, 2i + 1)
    instead (the same rotation of the same numbers, elementwise; a score sums the head's
    products in another order). Qwen2/3 files and every transformers checkpoint keep halves and
    rotate halves (ModelConfig.rope_interleaved).
  * Linear layers are whatever kernel holds the file's tensor (engine/quants.QLinear for the
    GGUF types hd multiplies directly, else a bf16 or fp32 layer dequantized one tensor at a
    time): the kernel is part of the model's numerics, recorded in its Numerics (numerics.py).

Call it as `model.forward_many(parts)` (the decode loop, tree verification and the batched
forward of hd serve all do, through engine/decode/tree.py and engine/decode/batch.py) or as transformers
models are called (`model(input_ids=..., past_key_values=..., position_ids=..., attention_mask=...)`,
returning `.logits`), which the cost measurement and the self-check use.

Invariants
  * A forward's rows depend only on their own tokens and path in the M-invariant mode: every
    row-wise op works row by row, every Linear kernel has a fixed per-row arithmetic or is padded
    to its calibrated least row count (Numerics.min_rows), and the attention is invariant.py's.
  * The cache is kvcache.Cache (keys and [V | 1] preallocated, grown by doubling); forward_many
    appends each part's rows to its own cache.
  * Nothing here holds a weight in a wider dtype than the model's dtype, and the quantized ones
    stay as the file's blocks (a repacked copy the kernel streams, of about the file's size).
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels import invariant
from . import kvcache
from .layers import Embedding, Linear, rms_norm
from .numerics import Numerics
from .rope import Rope


class Block(nn.Module):
    """One decoder layer's weights."""

    def __init__(self, i: int, gf, cfg, num: Numerics):
        super().__init__()
        p = f"blk.{i}."
        self.attn_norm = nn.Parameter(num.vector(gf, p + "attn_norm.weight"), requires_grad=False)
        self.ffn_norm = nn.Parameter(num.vector(gf, p + "ffn_norm.weight"), requires_grad=False)
        bias = {n: num.vector(gf, f"{p}attn_{n}.bias") if gf.has(f"{p}attn_{n}.bias") else None for n in "qkv"}
        self.q = num.linear(gf, p + "attn_q.weight", bias["q"])
        self.k = num.linear(gf, p + "attn_k.weight", bias["k"])
        self.v = num.linear(gf, p + "attn_v.weight", bias["v"])
        self.o = num.linear(gf, p + "attn_output.weight")
        self.gate = num.linear(gf, p + "ffn_gate.weight")
        self.up = num.linear(gf, p + "ffn_up.weight")
        self.down = num.linear(gf, p + "ffn_down.weight")
        # Qwen3: RMSNorm of each head's q and k before the rotation
        self.q_norm = (nn.Parameter(num.vector(gf, p + "attn_q_norm.weight"), requires_grad=False)
                       if gf.has(p + "attn_q_norm.weight") else None)
        self.k_norm = (nn.Parameter(num.vector(gf, p + "attn_k_norm.weight"), requires_grad=False)
                       if gf.has(p + "attn_k_norm.weight") else None)
        # q, k, v (and gate, up) in one GEMM where their kernels join: one call, one pass
        self.qkv_sizes = (self.q.out_features, self.k.out_features)
        self.qkv = Linear.joined([self.q, self.k, self.v])
        self.gate_up = Linear.joined([self.gate, self.up])
        if self.qkv is not None:
            self.q = self.k = self.v = None
        if self.gate_up is not None:
            self.gate = self.up = None

    def project_qkv(self, h):
        """q, k, v rows [m, heads * d] of the normed input h."""
        if self.qkv is None:
            return self.q(h), self.k(h), self.v(h)
        y = self.qkv(h)
        nq, nk = self.qkv_sizes
        return y[:, :nq], y[:, nq:nq + nk], y[:, nq + nk:]

    def gate_and_up(self, h):
        if self.gate_up is None:
            return self.gate(h), self.up(h)
        y = self.gate_up(h)
        half = y.shape[-1] // 2
        return y[:, :half], y[:, half:]


class GenerationConfig:
    """What hd reads of a generation config: the end-of-sequence ids."""

    def __init__(self, eos_token_id):
        self.eos_token_id = eos_token_id


class Output:
    def __init__(self, logits, past_key_values):
        self.logits, self.past_key_values = logits, past_key_values


class LlamaForward(nn.Module):
    """The model: embedding, blocks, final norm, head. `numerics` says how it computes."""

    family = "llama"
    block_class = Block

    def __init__(self, gf, cfg, num: Numerics, progress=None):
        super().__init__()
        self.config, self.numerics = cfg, num
        num.resolve_rows()
        self.generation_config = GenerationConfig(cfg.eos_token_id)
        self.embed = Embedding(gf, "token_embd.weight", num)
        blocks = []
        for i in range(cfg.num_hidden_layers):
            blocks.append(self.block_class(i, gf, cfg, num))
            gf.release()
            if progress is not None:
                progress(1)
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.Parameter(num.vector(gf, "output_norm.weight"), requires_grad=False)
        self.head = num.linear(gf, "output.weight" if gf.has("output.weight") else "token_embd.weight")
        gf.release()
        self.rope = Rope(cfg, num.device)
        self.scaling = cfg.head_dim ** -0.5

    # ------------------------------------------------------------ what the rest of hd reads

    @property
    def dtype(self) -> torch.dtype:
        return self.numerics.torch_dtype

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def new_cache(self) -> kvcache.Cache:
        return kvcache.Cache(self.config.num_hidden_layers)

    def linears(self) -> list:
        return [m for m in self.modules() if isinstance(m, Linear)]

    def truncated(self, k: int) -> "LlamaForward":
        """A model of the first k blocks, the final norm and the head, sharing their weights (the
        `self:layers=K` draft model): no copy."""
        import copy
        small = copy.copy(self)
        small._modules = dict(self._modules)
        small._parameters = dict(self._parameters)
        small.blocks = nn.ModuleList(list(self.blocks)[:k])
        small.config = copy.copy(self.config)
        small.config.num_hidden_layers = k
        small.numerics = self.numerics.replace(invariant=False)
        return small

    # ------------------------------------------------------------ forwards

    def forward(self, input_ids=None, past_key_values=None, position_ids=None, attention_mask=None,
                use_cache=True, logits_to_keep=0, **kwargs) -> Output:
        """transformers' calling convention (one sequence): logits [1, M, V]; a cache of another
        kind than kvcache.Cache, or none, is replaced by a new one."""
        if kwargs.get("inputs_embeds") is not None or input_ids.shape[0] != 1:
            raise ValueError("hd's forward takes one sequence of input_ids")
        cache = past_key_values if isinstance(past_key_values, kvcache.Cache) else self.new_cache()
        mask = attention_mask if attention_mask is not None and attention_mask.dim() == 4 else None
        m = input_ids.shape[1]
        if m <= invariant.MAX_ROWS or cache.get_seq_length() == 0:
            logits = self.forward_many([(input_ids, cache, position_ids, mask)])[0]
        else:  # longer than a verification, on a filled cache: causal pieces in turn
            assert mask is None and position_ids is None, "a wide forward on a filled cache must be causal"
            logits = torch.cat([self.forward_many([(input_ids[:, a:a + invariant.MAX_ROWS], cache, None, None)])[0]
                                for a in range(0, m, invariant.MAX_ROWS)])
        if logits_to_keep:
            logits = logits[-logits_to_keep:]
        return Output(logits[None], cache)

    @torch.inference_mode()
    def prefill(self, input_ids, cache) -> None:
        """Fill a cache with a prompt's keys and values, and nothing else (no logits): appended
        to what the cache holds (engine/decode/prefix.py prefills in pieces)."""
        self.forward_many([(input_ids, cache, None, None)], keys_only=True)

    @torch.inference_mode()
    def forward_many(self, parts, keys_only: bool = False) -> list[torch.Tensor]:
        """One forward over several sequences' tokens: parts [(input_ids [1, m], cache,
        position_ids [1, m] or None, mask [1, 1, m, past + m] or None)]. Returns each part's
        logits [m, V]; each cache grows by its part's tokens. A part's logits are torch.equal to
        its forward alone in the M-invariant mode (row-wise ops, invariant attention per part).

        More than invariant.MAX_ROWS rows only as one part on an empty cache (a prompt), which
        attends causally: the fused attention where it is on, else SDPA told it is causal (the
        keys of a prompt are the same in plain and speculative decoding). keys_only: fill the
        caches and stop; the last layer computes its keys and values alone."""
        ctx = Step(self, parts)
        x = self.embed_rows(ctx.ids)
        last = len(self.blocks) - 1
        for i, blk in enumerate(self.blocks):
            if keys_only and i == last:
                self.keys_only(i, blk, x, ctx)
                return []
            x = self.block(i, blk, x, ctx)
        logits = self.head(self.final_norm(x))
        if len(parts) == 1:
            return [logits]
        return [logits[a:b] for a, b in ctx.bounds]

    # ------------------------------------------------------------ the family's own parts

    def rope_for(self, kind: str) -> Rope:
        return self.rope

    def window(self, kind: str) -> int | None:
        """The sliding window of a layer kind (keys at most window - 1 positions back), or None."""
        return int(self.config.sliding_window) if kind == "sliding" else None

    def embed_rows(self, ids) -> torch.Tensor:
        return self.embed(ids)

    def final_norm(self, x) -> torch.Tensor:
        ops = self.numerics.row_ops()
        if ops is not None:
            return ops.add_rms_norm(x, None, self.norm, self.config.rms_norm_eps)[1]
        return rms_norm(x, self.norm, self.config.rms_norm_eps)

    def layer_kind(self, i: int) -> str:
        """Which attention layer i has: "full", or "sliding" where the config's layer types say so
        (a checkpoint's Mistral or Qwen2 with a window; a GGUF of this family states none)."""
        types = self.config.extra.get("layer_types")
        return "sliding" if types and types[i] == "sliding_attention" else "full"

    def qkv(self, i: int, blk, h, ctx):
        """q [1, hq, m, d], k and v [1, hkv, m, d] of layer i, rotated."""
        cfg = self.config
        hq, hkv, d, m = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, h.shape[0]
        rope = self.rope_for(self.layer_kind(i))
        cos, sin = ctx.rope(self.layer_kind(i))
        yq, yk, yv = blk.project_qkv(h)
        ops = ctx.rows
        if ops is not None and blk.q_norm is None:   # one call a projection, the same bits as below
            q = ops.rope(yq, cos, sin, hq, rope.interleaved)[None]
            k = ops.rope(yk, cos, sin, hkv, rope.interleaved)[None]
        else:
            q = rope.apply(self._heads(yq, hq, d, blk.q_norm), cos, sin)[None]
            k = rope.apply(self._heads(yk, hkv, d, blk.k_norm), cos, sin)[None]
        v = yv.reshape(m, hkv, d).transpose(0, 1)[None]
        return q, k, v

    def block(self, i: int, blk, x, ctx) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        ops = ctx.rows
        h = self.attn_input(blk, x)
        if ops is not None:   # the residual add and the norm, one call
            x, h = ops.add_rms_norm(x, blk.o(ctx.attend(i, *self.qkv(i, blk, h, ctx))), blk.ffn_norm, eps)
        else:
            x = x + blk.o(ctx.attend(i, *self.qkv(i, blk, h, ctx)))
            h = rms_norm(x, blk.ffn_norm, eps)
        gate, up = blk.gate_and_up(h)
        return x + blk.down(nn.functional.silu(gate) * up)

    def keys_only(self, i: int, blk, x, ctx) -> None:
        """The last layer of a prefill: its keys and values only."""
        cfg = self.config
        h = self.attn_input(blk, x)
        _, yk, yv = blk.project_qkv(h)
        k = self._heads(yk, cfg.num_key_value_heads, cfg.head_dim, blk.k_norm)
        v = yv.reshape(h.shape[0], cfg.num_key_value_heads, cfg.head_dim).transpose(0, 1)
        k = self.rope_for(self.layer_kind(i)).apply(k, *ctx.rope(self.layer_kind(i)))
        for (_, cache, _, _), (a, b) in zip(ctx.parts, ctx.bounds):
            cache.layers[i].append(k[None, :, a:b], v[None, :, a:b])

    def attn_input(self, blk, x) -> torch.Tensor:
        ops = self.numerics.row_ops()
        if ops is not None:   # block()'s own norm: a prefill's last keys as a forward's
            return ops.add_rms_norm(x, None, blk.attn_norm, self.config.rms_norm_eps)[1]
        return rms_norm(x, blk.attn_norm, self.config.rms_norm_eps)

    def head_norm(self, y, norm) -> torch.Tensor:
        """A head's q or k norm (Qwen3)."""
        return rms_norm(y, norm, self.config.rms_norm_eps)

    def _heads(self, y, heads: int, d: int, norm) -> torch.Tensor:
        """[m, heads * d] -> [heads, m, d], each head's norm first where the model has one."""
        y = y.view(y.shape[0], heads, d)
        if norm is not None:
            y = self.head_norm(y, norm)
        return y.transpose(0, 1)


class Step:
    """What one forward over some parts derives once and every layer reads: rows, positions,
    the rope of each attention kind, each part's attention layout by kind, and the attention."""

    def __init__(self, model: LlamaForward, parts):
        cfg, num = model.config, model.numerics
        self.model, self.parts = model, parts
        self.sizes = sizes = [p[0].shape[1] for p in parts]
        self.m = m = sum(sizes)
        self.pasts = pasts = [p[1].get_seq_length() for p in parts]
        self.ids = (parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts], 1))[0]
        device = self.ids.device
        pos = [p[2] if p[2] is not None else torch.arange(past, past + k, device=device).unsqueeze(0)
               for p, past, k in zip(parts, pasts, sizes)]
        self.positions = pos
        self.pos = (pos[0] if len(parts) == 1 else torch.cat(pos, 1))[0]
        self.bounds = invariant.row_bounds(sizes)
        self.hq, self.hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.inv = num.invariant
        self.rows = num.row_ops()
        self.fused = self.inv and invariant.fused_on(device)
        # a prompt wider than a verification on an empty cache: causal SDPA (the fused attention
        # takes it as it is)
        self.whole = len(parts) == 1 and m > invariant.MAX_ROWS and not self.fused and pasts[0] == 0
        self._rope, self._lays, self._many = {}, {}, {}

    def rope(self, kind: str):
        if kind not in self._rope:
            self._rope[kind] = self.model.rope_for(kind)(self.pos, self.model.dtype)
        return self._rope[kind]

    def visible(self, j: int, kind: str) -> torch.Tensor | None:
        """Part j's [m_j, past + m_j] bool visibility for a layer of `kind` (None: causal, full)."""
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

    def lays(self, kind: str):
        if kind not in self._lays:
            g = self.hq // self.hkv
            self._lays[kind] = [invariant.layout(self.visible(j, kind), k, past + k, g, self.ids.device)
                                for j, (past, k) in enumerate(zip(self.pasts, self.sizes))]
            self._many[kind] = (invariant.Many(self._lays[kind], self.sizes, self.hq, self.hkv, self.ids.device)
                                if len(self.parts) > 1 and not self.fused else None)
        return self._lays[kind], self._many[kind]

    def attend(self, i: int, q, k, v) -> torch.Tensor:
        """Layer i's attention of q [1, hq, m, d] over each part's cache and its new k, v (appended
        here). Returns [m, hq * d]."""
        model, m = self.model, self.m
        kind = model.layer_kind(i)
        layers = [p[1].layers[i] for p in self.parts]
        scaling = model.scaling
        if not self.inv:
            o = self._stock(q, k, v, layers, kind)
        elif self.whole:
            layers[0].append(k, v)
            vis = self.visible(0, kind)
            if vis is None:
                o = invariant.causal_prompt_sdpa(q, k, v, scaling)
            else:
                o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=vis, scale=scaling,
                                                               enable_gqa=k.shape[1] != q.shape[1]).transpose(1, 2)
        else:
            lays, many = self.lays(kind)
            if self.fused:
                o = invariant.append_attend(q, k, v, layers, lays, scaling)
            elif many is None:
                layers[0].append(k, v)
                kk, vv = layers[0].padded(lays[0].rows)
                o = invariant.attend_kv(q, kk[0], vv[0], lays[0], scaling, layers[0])
            else:
                kvs = []
                for j, (layer, (a, b)) in enumerate(zip(layers, self.bounds)):
                    layer.append(k[:, :, a:b], v[:, :, a:b])
                    kk, vv = layer.padded(many.key_rows(j))
                    kvs.append((kk[0], vv[0]))
                o = invariant.attend_many(q, kvs, many, scaling, layers)
        return o.reshape(m, -1)

    def _stock(self, q, k, v, layers, kind) -> torch.Tensor:
        """Outside the M-invariant mode: SDPA over each part's cache (no row-count guarantee)."""
        outs = []
        for j, (layer, (a, b)) in enumerate(zip(layers, self.bounds)):
            layer.append(k[:, :, a:b], v[:, :, a:b])
            keys, values = layer.keys, layer.values
            vis = self.visible(j, kind)
            n, mq = keys.shape[2], b - a
            if vis is None:
                vis = torch.ones(mq, n, dtype=torch.bool, device=q.device).tril(n - mq)
            o = nn.functional.scaled_dot_product_attention(
                q[:, :, a:b], keys.to(q.dtype), values.to(q.dtype), attn_mask=vis, scale=self.model.scaling,
                enable_gqa=keys.shape[1] != q.shape[1])
            outs.append(o.transpose(1, 2))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)
