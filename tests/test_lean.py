"""The lean forward (hdcli/engine/lean.py) runs the same ops as transformers' forward in the
M-invariant mode: its logits are torch.equal to it for a short prefill, a one-token step, a chain
and a token tree, with each kernel set; it is on exactly where the mode is, for llama models."""
from __future__ import annotations

import pytest
import torch

from hdcli.engine import invariant, kernels, lean
from hdcli.engine.tree import Tree, new_cache, tree_forward

from conftest import tiny_llama

V = 64


def steps(model) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (1, 60), generator=g)
    cache = new_cache(model)
    out = [model(input_ids=ids[:, :45], past_key_values=cache, use_cache=True).logits,
           model(input_ids=ids[:, 45:46], past_key_values=cache, use_cache=True).logits,
           model(input_ids=ids[:, 46:54], past_key_values=cache, use_cache=True).logits]
    t = Tree()
    for cand in ([5, 6, 7], [8, 9], [5, 10, 11, 12]):
        t.add_candidate(cand, "x")
    out.append(tree_forward(model, t, 13, cache))
    return out


def tiny_in_the_mode(dtype, kern: str):
    """A tiny llama in dtype with kernel set kern ("torch", "onednn", "int4"), in the M-invariant mode."""
    model = tiny_llama(V, hidden=64, scale=4.0).to(dtype)
    if kern != "torch":
        if not kernels.available():
            pytest.skip("torch without oneDNN")
        kernels.pack(model)
    if kern == "int4":
        from test_int4 import to_int4
        to_int4(model)
    invariant.enable(model)
    return model


@pytest.mark.parametrize("dtype,kern", [(torch.float32, "torch"), (torch.float32, "onednn"),
                                        (torch.bfloat16, "onednn"), (torch.bfloat16, "int4")])
def test_lean_forward_equals_the_transformers_forward_in_the_mode(dtype, kern, tmp_path, monkeypatch):
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    model = tiny_in_the_mode(dtype, kern)
    assert lean.is_enabled(model)
    assert model._hd_inline_norm   # the norms run inlined (lean._rms_norm), checked below
    with torch.inference_mode():
        fast = steps(model)
        lean.disable(model)
        assert "forward" not in model.__dict__
        stock = steps(model)
    for a, b in zip(fast, stock):
        assert torch.equal(a, b)
    invariant.disable(model)
    assert not lean.is_enabled(model)


def test_norm_kept_as_a_module_where_the_inlined_one_differs(tmp_path, monkeypatch):
    """A norm forward unlike transformers' (a hub kernel, another version) is not inlined."""
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    real = lean._rms_norm
    monkeypatch.setattr(lean, "_rms_norm", lambda norm, x: real(norm, x) * 1.001)
    model = tiny_in_the_mode(torch.float32, "torch")
    assert lean.is_enabled(model) and not model._hd_inline_norm
    lean.disable(model)
    assert "_hd_inline_norm" not in model.__dict__


def test_lean_forward_covers_llama_only(tmp_path, monkeypatch):
    from test_invariant import tiny_gemma3
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    model = tiny_gemma3(torch.float32)
    invariant.enable(model)
    assert invariant.is_enabled(model) and not lean.is_enabled(model)


@pytest.mark.parametrize("attention", ["torch", "fused"])
@pytest.mark.parametrize("dtype,kern", [(torch.float32, "torch"), (torch.bfloat16, "onednn"),
                                        (torch.bfloat16, "int4")])
def test_lean_prefill_fills_the_cache_as_the_stock_forward_does(dtype, kern, attention, tmp_path, monkeypatch):
    """lean.prefill (decode.Decoder._prefill's path) skips the last layer's attention, MLP and the
    head, and the stock forward's machinery: every layer's keys and values are torch.equal to those
    transformers' forward leaves, and the next step's logits are too: with the torch ops'
    attention through the invariant attention (<= MAX_ROWS tokens) and SDPA (longer), with the
    fused one through it at every length. It leaves a cache that is not empty to the stock forward."""
    from hdcli.engine import fused
    if attention == "fused" and fused.load(quiet=True) is None:
        pytest.skip(f"the fused attention does not compile here: {fused.failure()}")
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    with fused.pinned(attention):
        _prefill_as_the_stock_forward(tiny_in_the_mode(dtype, kern))


def _prefill_as_the_stock_forward(model):
    from hdcli.engine import int4
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode(), int4.prefill():
        for m in (1, 37, invariant.MAX_ROWS, invariant.MAX_ROWS + 1, 150):
            ids = torch.randint(3, V, (1, m), generator=g)
            mine, stock = new_cache(model), new_cache(model)
            assert lean.prefill(model, ids, mine)
            model(input_ids=ids, past_key_values=stock, use_cache=True)
            for a, b in zip(mine.layers, stock.layers):
                assert a.length == b.length == m
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), m
            step = torch.tensor([[7]])
            assert torch.equal(model(input_ids=step, past_key_values=mine, use_cache=True).logits,
                               model(input_ids=step, past_key_values=stock, use_cache=True).logits), m
            assert not lean.prefill(model, ids, mine)   # a cache with keys: not a prefill
    invariant.disable(model)
