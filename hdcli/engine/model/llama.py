"""hd's own forward for the llama family (Llama 2/3, Vicuna, SmolLM2, Mistral, Qwen2/Qwen3, Phi-3,
OLMo 2, Granite 3), from a GGUF file in the file's own bits, or from a transformers checkpoint.

One decoder block: x += o(attention(rope(q(norm(x))), rope(k(norm(x))), v(norm(x))));
x += down(silu(gate(norm(x))) * up(norm(x))); then the final norm and the head. Qwen2's q/k/v
biases and Qwen3's per-head q/k norms are read where the file has them; Phi-3's fused q/k/v
(attn_qkv) and gate/up (ffn_up: gate rows first) are one Linear each; OLMo 2 norms each
sublayer's output instead of its input (post_attention_norm, post_ffw_norm: x += norm(o(...)),
x += norm(down(...))) and q and k over their whole width (attn_q_norm [heads * d], not a head's
d as Qwen3's) before they are split into heads; Granite scales the embedding, each sublayer's
output before its residual add, the attention scores and the logits by the file's multipliers
(ModelConfig); rope scaling as the
file's metadata states it (transformers' rope functions compute the frequencies); a sliding
window where a checkpoint's config gives its blocks one (Mistral v0.1, Qwen2 with
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
  * Linear layers are whatever kernel holds the file's tensor (engine/kernels/quants.QLinear for the
    GGUF types hd multiplies directly, else a bf16 or fp32 layer dequantized one tensor at a
    time): the kernel is part of the model's numerics, recorded in its Numerics (numerics.py).

It is a TargetModel (model/target.py): the decode loop, tree verification, the batched forward of
hd serve, the cost measurement and the self-check call its `forward` (one stream's new rows),
`forward_many` (several streams'), `prefill` and `new_cache`.

What varies by numerics is chosen as objects, not per call: the row ops (parts.RowOps: torch ops
or the compiled ones) when the model loads, held by every Block; the attention (attention.py: SDPA,
the compiled invariant attention, or its torch ops for one or several streams) once a forward, by
Step from the numerics and the attention kernel the model holds. A Block's forward is its math.

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

from ..kernels import fused, invariant
from . import kvcache
from .attention import FUSED, Step
from .compiled import layers_of
from .parts import Embedding, Linear, RowOps, row_ops
from .numerics import Numerics
from .rope import Rope


class Block(nn.Module):
    """One decoder block: its weights, its attention kind ("full" or "sliding") and the model's
    row ops (parts.RowOps), both chosen when the model loads."""

    def __init__(self, i: int, gf, cfg, num: Numerics, kind: str, ops: RowOps):
        super().__init__()
        p = f"blk.{i}."
        self.index, self.kind, self.ops = i, kind, ops
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.residual_scale = float(getattr(cfg, "residual_multiplier", None) or 1.0)   # Granite's

        def norm(name: str):
            return nn.Parameter(num.vector(gf, p + name), requires_grad=False) if gf.has(p + name) else None
        # OLMo 2: a norm after attention and after the MLP, none before them
        self.attn_norm, self.ffn_norm = norm("attn_norm.weight"), norm("ffn_norm.weight")
        self.post_attn_norm, self.post_ffn_norm = norm("post_attention_norm.weight"), norm("post_ffw_norm.weight")
        self.o = num.linear(gf, p + "attn_output.weight")
        self.down = num.linear(gf, p + "ffn_down.weight")
        self.qkv_sizes = (self.hq * self.d, self.hkv * self.d)
        if gf.has(p + "attn_qkv.weight"):   # Phi-3: q, k, v in one tensor, gate and up in ffn_up
            self.q = self.k = self.v = self.gate = self.up = None
            self.qkv = num.linear(gf, p + "attn_qkv.weight")
            self.gate_up = num.linear(gf, p + "ffn_up.weight")
            self.q_norm = self.k_norm = None
            self.wide_qk_norm = False
            return
        bias = [num.vector(gf, f"{p}attn_{n}.bias") if gf.has(f"{p}attn_{n}.bias") else None for n in "qkv"]
        # q, k, v (and gate, up) in one GEMM where their kernels join: one call, one pass
        qkv, gate_up = [p + f"attn_{n}.weight" for n in "qkv"], [p + "ffn_gate.weight", p + "ffn_up.weight"]
        self.qkv = num.joined(gf, qkv, bias)
        self.q, self.k, self.v = (None,) * 3 if self.qkv else [num.linear(gf, n, b) for n, b in zip(qkv, bias)]
        self.gate_up = num.joined(gf, gate_up)
        self.gate, self.up = (None,) * 2 if self.gate_up else [num.linear(gf, n) for n in gate_up]
        # Qwen3: RMSNorm of each head's q and k before the rotation; OLMo 2: of the whole q and k
        self.q_norm, self.k_norm = norm("attn_q_norm.weight"), norm("attn_k_norm.weight")
        self.wide_qk_norm = self.q_norm is not None and self.q_norm.numel() != self.d

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        if self.post_attn_norm is not None:   # OLMo 2: each sublayer's output normed, then added
            q, k, v = self.qkv_heads(x, step)
            x = x + self.ops.norm(self.o(step.attend(self, q, k, v)), self.post_attn_norm)
            gate, up = self.gate_and_up(x)
            return x + self.ops.norm(self.down(nn.functional.silu(gate) * up), self.post_ffn_norm)
        q, k, v = self.qkv_heads(self.ops.norm(x, self.attn_norm), step)
        x, h = self.ops.add_norm(x, self.scaled(self.o(step.attend(self, q, k, v))), self.ffn_norm)
        gate, up = self.gate_and_up(h)
        return x + self.scaled(self.down(nn.functional.silu(gate) * up))

    def scaled(self, y: torch.Tensor) -> torch.Tensor:
        """A sublayer's output as its residual add takes it: times Granite's residual multiplier,
        in the model dtype as transformers rounds it (elementwise: each row its own)."""
        return y if self.residual_scale == 1.0 else y * self.residual_scale

    def qkv_heads(self, h, step: Step):
        """q [1, hq, m, d], k and v [1, hkv, m, d] of the normed input h, rotated."""
        rope, cos, sin = step.rope(self.kind)
        yq, yk, yv = self.project_qkv(h)
        q_norm, k_norm = self.q_norm, self.k_norm
        if self.wide_qk_norm:
            yq, yk, q_norm, k_norm = self.ops.norm(yq, q_norm), self.ops.norm(yk, k_norm), None, None
        q = self.ops.rotate(yq, self.hq, self.d, q_norm, rope, cos, sin)[None]
        k = self.ops.rotate(yk, self.hkv, self.d, k_norm, rope, cos, sin)[None]
        v = yv.reshape(h.shape[0], self.hkv, self.d).transpose(0, 1)[None]
        return q, k, v

    def keys_only(self, x: torch.Tensor, step: Step) -> None:
        """The last block of a prefill: its keys and values only, appended to each part's cache."""
        h = x if self.attn_norm is None else self.ops.norm(x, self.attn_norm)
        _, yk, yv = self.project_qkv(h)
        rope, cos, sin = step.rope(self.kind)
        k_norm = self.k_norm
        if self.wide_qk_norm:
            yk, k_norm = self.ops.norm(yk, k_norm), None
        k = rope.apply(self.ops.heads(yk, self.hkv, self.d, k_norm), cos, sin)
        v = yv.reshape(h.shape[0], self.hkv, self.d).transpose(0, 1)
        step.store(self.index, k, v)

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


class LlamaForward(nn.Module):
    """The model: embedding, blocks, final norm, head. `numerics` says how it computes."""

    family = "llama"
    block_class = Block
    compiled_layers = True   # the decoder blocks in one compiled call where they fit (compiled.py); False: the blocks

    def __init__(self, gf, cfg, num: Numerics, progress=None):
        super().__init__()
        self.config, self.numerics = cfg, num
        num.resolve_rows()
        self.row_ops = self.choose_row_ops(num)   # and the attention kernel, once: the blocks read them
        self.attention_kernel = fused.KERNEL       # the process's (one numerics a process)
        self.eos_token_id = cfg.eos_token_id
        self.embed = Embedding(gf, "token_embd.weight", num)
        blocks = []
        for i in range(cfg.num_hidden_layers):
            blocks.append(self.block_class(i, gf, cfg, num, self.block_kind(i), self.row_ops))
            gf.release()
            if progress is not None:
                progress(1)
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.Parameter(num.vector(gf, "output_norm.weight"), requires_grad=False)
        self.head = num.linear(gf, "output.weight" if gf.has("output.weight") else "token_embd.weight")
        gf.release()
        self.rope = Rope(cfg, num.device)
        self.scaling = getattr(cfg, "attention_multiplier", None) or cfg.head_dim ** -0.5
        self.embedding_scale = float(getattr(cfg, "embedding_multiplier", None) or 1.0)   # Granite's
        self.logits_scale = float(getattr(cfg, "logits_scaling", None) or 1.0)

    # ------------------------------------------------------------ what the rest of hd reads

    @property
    def dtype(self) -> torch.dtype:
        return self.numerics.torch_dtype

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @property
    def invariant(self) -> bool:
        """Whether it computes in the M-invariant mode (its Numerics say so)."""
        return self.numerics.invariant

    @property
    def module(self) -> nn.Module:
        """The module holding the weights: the model itself (target.TargetModel)."""
        return self

    def new_cache(self) -> kvcache.Cache:
        return kvcache.Cache(self.config.num_hidden_layers)

    def linears(self) -> list:
        return [m for m in self.modules() if isinstance(m, Linear)]

    def truncated(self, k: int) -> "LlamaForward":
        """A model of the first k blocks, the final norm and the head, sharing their weights (the
        `self:blocks=K` draft model): no copy."""
        import copy
        small = copy.copy(self)
        small._modules = dict(self._modules)
        small._parameters = dict(self._parameters)
        small.blocks = nn.ModuleList(list(self.blocks)[:k])
        small.config = copy.copy(self.config)
        small.config.num_hidden_layers = k
        small.numerics = self.numerics.replace(invariant=False)
        return small

    def subset(self, indices: list[int], head_blocks: int | None = None) -> "LlamaForward":
        """A model of the blocks `indices` (in order), the embedding, the final norm and the head,
        sharing their weights and numerics (no copy): the M-invariant self-check runs on the blocks
        that hold every kind of layer (calibrate.covering_blocks), not on all of them. Each block
        is a shallow copy numbered by its place in the subset (its block of the smaller cache).
        head_blocks: a GGUF head's first column blocks only (16 logits each; QLinear.narrowed),
        which run the code all its blocks run: an 8B model's 0.4 GB head is half the time of a
        one-token forward over 3 blocks, and a row whose hidden state differs differs in these
        logits too. Other heads stay whole."""
        import copy
        small = copy.copy(self)
        small._modules = dict(self._modules)
        small._parameters = dict(self._parameters)
        if head_blocks is not None and self.head.kind == "gguf":
            head = copy.copy(self.head)
            head._modules = dict(self.head._modules)   # its own kernel; the model's head keeps its own
            head.kernel = self.head.kernel.narrowed(head_blocks)
            head.out_features = head.kernel.out_features
            small.head = head
        blocks = []
        for place, i in enumerate(indices):
            blk = copy.copy(self.blocks[i])
            blk.index = place
            blocks.append(blk)
        small.blocks = nn.ModuleList(blocks)
        small.config = copy.copy(self.config)
        small.config.num_hidden_layers = len(indices)
        return small

    # ------------------------------------------------------------ forwards

    def forward(self, input_ids, cache=None, position_ids=None, mask=None) -> torch.Tensor:
        """One stream's new rows (input_ids [1, m]) on `cache` (None: a new one): logits [m, V].
        position_ids and mask [1, 1, m, past + m] place a token tree's rows (None: causal)."""
        if cache is None:
            cache = self.new_cache()
        m = input_ids.shape[1]
        if m <= invariant.MAX_ROWS or cache.get_seq_length() == 0:
            return self.forward_many([(input_ids, cache, position_ids, mask)])[0]
        # longer than a verification, on a filled cache: causal pieces in turn
        assert mask is None and position_ids is None, "a wide forward on a filled cache must be causal"
        return torch.cat([self.forward_many([(input_ids[:, a:a + invariant.MAX_ROWS], cache, None, None)])[0]
                          for a in range(0, m, invariant.MAX_ROWS)])

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
        caches and stop; the last block computes its keys and values alone."""
        ctx = Step(self, parts)
        x = self.embed_rows(ctx.ids)
        last = len(self.blocks) - 1
        start = 0   # the first block the Python loop runs
        compiled = layers_of(self) if self.compiled_layers and ctx.attention is FUSED else None
        if compiled is not None and not keys_only:   # the blocks, final norm and head in one call (compiled.py)
            logits = compiled.run(x, ctx, len(self.blocks), head=True)
            return self.scaled_logits(logits, ctx, len(parts))
        if compiled is not None and last > 0:        # a prefill's: the blocks but the last (keys only, below)
            start = last
            x = compiled.run(x, ctx, start)
        for i in range(start, last + 1):
            blk = self.blocks[i]
            if keys_only and i == last:
                blk.keys_only(x, ctx)
                return []
            x = blk(x, ctx)
        return self.scaled_logits(self.head(self.final_norm(x)), ctx, len(parts))

    def scaled_logits(self, logits: torch.Tensor, ctx: Step, parts: int) -> list[torch.Tensor]:
        """The head's logits of a forward, each part's: divided by Granite's logits scaling, as
        transformers does."""
        if self.logits_scale != 1.0:
            logits = logits / self.logits_scale
        if parts == 1:
            return [logits]
        return [logits[a:b] for a, b in ctx.bounds]

    # ------------------------------------------------------------ the family's own parts

    def rope_for(self, kind: str) -> Rope:
        return self.rope

    def window(self, kind: str) -> int | None:
        """The sliding window of a block kind (keys at most window - 1 positions back), or None."""
        return int(self.config.sliding_window) if kind == "sliding" else None

    def embed_rows(self, ids) -> torch.Tensor:
        x = self.embed(ids)
        return x if self.embedding_scale == 1.0 else x * self.embedding_scale

    def choose_row_ops(self, num: Numerics) -> RowOps:
        return row_ops(num, self.config.rms_norm_eps)

    def final_norm(self, x) -> torch.Tensor:
        return self.row_ops.norm(x, self.norm)

    def block_kind(self, i: int) -> str:
        """Which attention block i has: "full", or "sliding" where the config's layer_types say so
        (a checkpoint's Mistral or Qwen2 with a window), or every block of a Phi-3 whose file states
        a window (transformers' Phi3 and llama.cpp's phi3 both slide every block)."""
        types = self.config.extra.get("layer_types")
        if self.config.architecture == "phi3" and self.config.sliding_window:
            return "sliding"
        return "sliding" if types and types[i] == "sliding_attention" else "full"
