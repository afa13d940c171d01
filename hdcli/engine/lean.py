"""A lean decode forward for llama-family models in the M-invariant mode: the same ops as
transformers' forward, without the machinery around them.

Why: with 4-bit weights (hdcli/engine/int4.py) the GEMMs of a one-token forward of the bundled
135M model take ~6.5 ms and the forward ~19 ms; the rest is eager work around them: output
dataclasses and kwargs plumbing per module, a causal mask built and then decoded back into
visible keys in each of 30 layers, the attention layout found again per layer. This forward runs
what a decode step needs (embedding, per layer norm -> q/k/v -> rotary -> cache -> attention ->
o -> norm -> MLP, final norm, head) as plain calls of the model's own modules and functions, and
derives the attention layout once per forward.

Same numerics: every op is the one transformers' LlamaModel runs, in the same order and dtype (the
rotary module, `rotate_half` and `apply_rotary_pos_emb` are transformers' own; the norms run as
_rms_norm, LlamaRMSNorm.forward op for op without the module call, where enable() finds it
torch.equal to the modules' own), so its logits are torch.equal to the model's M-invariant
forward (tests/test_lean.py); the M-invariant self-check runs through it. With hd's 4-bit GEMM,
q/k/v and gate/up each run as one call (int4.joined), every output column computed as its own
layer computes it, and the rotary embedding runs once over q and k side by side (elementwise, so
each element is what apply_rotary_pos_emb makes of it). Module calls, attribute lookups and the
second rotary were ~0.4 ms of a 7 ms one-token forward of the bundled model on the AMD EPYC.

Scope (anything else keeps transformers' forward):
  * LlamaForCausalLM (SmolLM2, Llama 2/3 and kin): no sliding windows, no attention bias kept
    out of it (biases go through the Linear modules as they are);
  * forwards of at most invariant.MAX_ROWS tokens on a DynamicCache (decode steps and
    verifications; batches keep transformers' forward), and prefills of any length on an empty
    invariant cache (prefill(): the fused attention takes a whole prompt where it is on, SDPA
    beyond MAX_ROWS tokens elsewhere, as invariant.attention does in the mode);
  * input_ids, optional position_ids and an optional additive mask [1, 1, M, N] (token trees).

Invariants
  * enable() keeps the class forward bound to the model as `_hd_stock_forward`; disable() removes
    the instance attribute, so the model is again exactly transformers' module.
  * The cache stays a transformers DynamicCache (update/crop/get_seq_length), so keep_path, crop
    and everything else that reads it work unchanged. tree.new_cache gives a model in the mode
    one with kvcache.InvariantLayer layers: keys and [V | 1] kept as the attention reads them
    (bf16 where the fused attention reads a bf16 model's, fp32 elsewhere), so no layer copies the
    whole cache (any other DynamicCache works too, converted).
"""
from __future__ import annotations

import types

import torch

from . import int4, invariant
from .kvcache import InvariantLayer, is_invariant_cache

SUPPORTED = ("LlamaForCausalLM",)
# layers that read the same input: one GEMM call each group with hd's 4-bit GEMM (int4.joined)
QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


def supported(model) -> bool:
    cfg = model.config
    return (type(model).__name__ in SUPPORTED and not getattr(cfg, "sliding_window", None)
            and getattr(cfg, "hidden_act", "silu") == "silu" and not getattr(cfg, "mlp_bias", False)
            and getattr(cfg, "pretraining_tp", 1) == 1)


def enable(model) -> bool:
    """Route the model's small forwards through lean_forward; False where the model is not one
    this forward covers."""
    if not supported(model):
        return False
    stock = type(model).forward.__get__(model)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, **kwargs):
        if (input_ids is None or kwargs or input_ids.shape[0] != 1 or input_ids.shape[1] > invariant.MAX_ROWS
                or past_key_values is None or not hasattr(past_key_values, "layers")
                or (attention_mask is not None and attention_mask.dim() != 4)):
            return stock(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, use_cache=use_cache, **kwargs)
        return lean_forward(self, input_ids, past_key_values, position_ids, attention_mask)
    model.forward = types.MethodType(forward, model)
    model._hd_stock_forward = stock
    model._hd_inline_norm = _norm_inlines(model)
    return True


def disable(model) -> None:
    if "_hd_stock_forward" in model.__dict__:
        del model.__dict__["forward"]
        del model.__dict__["_hd_stock_forward"]
        model.__dict__.pop("_hd_inline_norm", None)


def is_enabled(model) -> bool:
    return "_hd_stock_forward" in model.__dict__


@torch.inference_mode()
def lean_forward(model, input_ids, cache, position_ids=None, mask=None):
    """Logits [1, M, V] of M tokens on `cache` (which grows by them), M <= invariant.MAX_ROWS."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    logits = lean_forward_many(model, [(input_ids, cache, position_ids, mask)])[0]
    return CausalLMOutputWithPast(logits=logits[None], past_key_values=cache)


@torch.inference_mode()
def lean_forward_many(model, parts, keys_only: bool = False) -> list[torch.Tensor]:
    """One forward over several sequences' tokens: parts [(input_ids [1, m], cache, position_ids
    [1, m] or None, mask [1, 1, m, past + m] or None)], at most invariant.MAX_ROWS rows in all
    (but a prefill's, below).
    Returns each part's logits [m, V]; each cache grows by its part's tokens.

    The rows of all parts go through every row-wise op (embedding, norms, rotary, every Linear,
    the head) together, and each part's attention runs on its own cache and layout: rows of these
    ops depend only on their own input in the M-invariant mode, so a part's logits are
    torch.equal to its forward alone (tests/test_batch.py).

    keys_only: fill the caches and stop (a prefill, prefill() below): the last layer computes its
    keys and values alone, and [] is returned. A prefill of one part wider than MAX_ROWS on an
    empty cache attends as invariant.attention does a whole prompt in transformers' forward: by
    the fused attention where it is on, else by SDPA told the mask is causal."""
    from transformers.models.llama import modeling_llama as llama   # once a forward, not a layer
    base = model.model
    sizes = [ids.shape[1] for ids, _, _, _ in parts]
    m = sum(sizes)
    pasts = [cache.get_seq_length() for _, cache, _, _ in parts]
    ids = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts], 1)
    device = ids.device
    pos = [p[2] if p[2] is not None else torch.arange(past, past + k, device=device).unsqueeze(0)
           for p, past, k in zip(parts, pasts, sizes)]
    pos = pos[0] if len(parts) == 1 else torch.cat(pos, 1)
    x = base.embed_tokens(ids)
    cos, sin = base.rotary_emb(x, position_ids=pos)
    layers = base.layers[: model.config.num_hidden_layers]
    attn0 = layers[0].self_attn
    hq, hkv, d = model.config.num_attention_heads, model.config.num_key_value_heads, attn0.head_dim
    # prefill() of a prompt wider than a verification: the fused attention takes it as it is, SDPA
    # elsewhere (invariant.attention attends a whole prompt alike)
    whole_prompt = keys_only and len(parts) == 1 and m > invariant.MAX_ROWS and not invariant.fused_on(device)
    lays = [] if whole_prompt else [invariant.layout(p[3], k, past + k, hq // hkv, device)
                                    for p, past, k in zip(parts, pasts, sizes)]
    # the fused attention on invariant caches appends every part's keys in its own call
    appends = invariant.fused_on(device) and all(_owner(p[1], 0) is not None for p in parts)
    many = invariant.Many(lays, sizes, hq, hkv, device) if len(parts) > 1 and not appends else None
    rms = _rms_norm if model.__dict__.get("_hd_inline_norm") else _module_norm
    for i, layer in enumerate(layers):
        mods = layer._modules
        attn, mlp = mods["self_attn"], mods["mlp"]
        h = rms(mods["input_layernorm"], x)
        if keys_only and i == len(layers) - 1:
            k = attn.k_proj(h).view(1, m, hkv, d).transpose(1, 2)
            v = attn.v_proj(h).view(1, m, hkv, d).transpose(1, 2)
            k = llama.apply_rotary_pos_emb(k, k, cos, sin)[1]
            for (_, cache, _, _), (a, b) in zip(parts, invariant.row_bounds(sizes)):
                cache.layers[attn.layer_idx].append(k[:, :, a:b], v[:, :, a:b])
            return []
        q, k, v = _rotated_qkv(attn, h, (m, hq, hkv, d), cos, sin, llama)
        li = attn.layer_idx
        owners = [_owner(p[1], li) for p in parts]
        if whole_prompt:
            owners[0].append(k, v)
            o = invariant.causal_prompt_sdpa(q, k, v, attn.scaling).reshape(1, m, hq * d)
        elif appends:
            o = invariant.append_attend(q, k, v, owners, lays, attn.scaling).reshape(1, m, hq * d)
        elif many is None:
            kv = _cached(parts[0][1], li, k, v, lays[0].rows)
            o = invariant.attend_kv(q, *kv, lays[0], attn.scaling, owners[0]).reshape(1, m, hq * d)
        else:
            kvs = [_cached(cache, li, k[:, :, a:b], v[:, :, a:b], many.key_rows(j))
                   for j, ((_, cache, _, _), (a, b)) in enumerate(zip(parts, many.bounds))]
            o = invariant.attend_many(q, kvs, many, attn.scaling, owners).reshape(1, m, hq * d)
        x = x + attn._modules["o_proj"](o)
        h = rms(mods["post_attention_layernorm"], x)
        mm = mlp._modules
        gate_up = int4.joined(mlp, GATE_UP)
        gate, up = gate_up(h) if gate_up is not None else (mm["gate_proj"](h), mm["up_proj"](h))
        x = x + mm["down_proj"](mlp.act_fn(gate) * up)
    logits = model.lm_head(rms(base.norm, x))[0]
    if len(parts) == 1:
        return [logits]
    return [logits[a:b] for a, b in invariant.row_bounds(sizes)]


@torch.inference_mode()
def prefill(model, input_ids, cache) -> bool:
    """Fill an empty cache with a prompt's keys and values, as transformers' forward fills it, and
    nothing else: False (nothing done) where the model is not in the lean forward or the cache is
    not an empty invariant one. The caller (decode.Decoder._prefill) holds int4.prefill().

    Why: a prefill needs only the cache, so the last layer computes its keys and values alone (no
    q, attention, o_proj, MLP, final norm or head: 1/30 of the bundled model's prefill), and the
    stock forward's machinery (masks, module plumbing, outputs) is skipped: on the AMD EPYC the 16
    Spec-Bench prompts of benchmarks/serve_load.py (40-769 tokens) took 1.39 s instead of 1.48.

    Same numerics: every op is the stock forward's, on the same rows, in the same order: the keys
    and values through the fused attention's append where it is on (any length), else those of up
    to invariant.MAX_ROWS tokens through the invariant attention and longer prompts through SDPA
    told the mask is causal, as invariant.attention does for a whole prompt; so the cache is
    torch.equal to the stock forward's (tests/test_lean.py)."""
    if not is_enabled(model) or not is_invariant_cache(cache) or cache.get_seq_length() or input_ids.shape[0] != 1:
        return False
    lean_forward_many(model, [(input_ids, cache, None, None)], keys_only=True)
    return True


def _owner(cache, layer_idx: int):
    """The layer of an invariant cache (the attention may keep data of its own there), or None."""
    layer = cache.layers[layer_idx]
    return layer if isinstance(layer, InvariantLayer) else None


def _cached(cache, layer_idx: int, k, v, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Append a part's new keys/values to its cache; the attention's fp32 keys and [V | 1] of
    `rows` rows: views of a kvcache.InvariantLayer, or converted from any other cache."""
    layer = cache.layers[layer_idx]
    if isinstance(layer, InvariantLayer):
        layer.append(k, v)
        k32, v32 = layer.padded(rows)
        return k32[0], v32[0]
    k, v = cache.update(k, v, layer_idx)
    return invariant.fp32_kv(k, v, rows)


def _rotated_qkv(attn, h, shape, cos, sin, llama):
    """q, k (rotary applied) and v [1, heads, m, d] of one layer's attention for its input h;
    llama: transformers' modeling_llama, whose rotary functions these are."""
    m, hq, hkv, d = shape
    qkv = int4.joined(attn, QKV)
    if qkv is None:
        am = attn._modules
        q = am["q_proj"](h).view(1, m, hq, d).transpose(1, 2)
        k = am["k_proj"](h).view(1, m, hkv, d).transpose(1, 2)
        v = am["v_proj"](h).view(1, m, hkv, d).transpose(1, 2)
        return (*llama.apply_rotary_pos_emb(q, k, cos, sin), v)
    # q and k are side by side in the joined output: one rotary over both (elementwise, so each
    # element is what apply_rotary_pos_emb makes of it, cos and sin broadcast as it does)
    y = qkv.all(h)
    qk = y[..., :(hq + hkv) * d].view(1, m, hq + hkv, d).transpose(1, 2)
    qk = (qk * cos.unsqueeze(1)) + (llama.rotate_half(qk) * sin.unsqueeze(1))
    return qk[:, :hq], qk[:, hq:], y[..., (hq + hkv) * d:].view(1, m, hkv, d).transpose(1, 2)


def _module_norm(norm, x):
    return norm(x)


@torch.inference_mode()
def _norm_inlines(model) -> bool:
    """Whether _rms_norm may stand in for the model's norm modules: all of one class, transformers'
    LlamaRMSNorm, and torch.equal to its forward on a probe (a forward replaced by a hub kernel,
    or changed in another transformers, keeps the module call)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    base = model.model
    norms = [base.norm] + [n for layer in base.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if any(type(n) is not LlamaRMSNorm for n in norms):
        return False
    w = base.norm.weight
    probe = torch.randn(5, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w.device, base.embed_tokens.weight.dtype) * 3
    return all(torch.equal(n(probe), _rms_norm(n, probe)) for n in (norms[0], norms[1]))


def _rms_norm(norm, x):
    """transformers' LlamaRMSNorm.forward, op for op, without the module call (enable() checks
    that it is torch.equal to the module's own before it is used)."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + norm.variance_epsilon)
    return norm._parameters["weight"] * h.to(x.dtype)
