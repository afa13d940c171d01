"""The invariant KV cache (hdcli/engine/model/kvcache.py): it holds what transformers' DynamicCache
holds (hdcli/engine/model/transformers_cache.py: the same KVCache interface over it), through
appends, tree crops (keep_path) and growth past its capacity, rows past its length stay zero, and
hd's forward gives the same logits whether its cache grew on the way or had room from the start."""
from __future__ import annotations

import pytest
import torch

from hdcli.engine.kernels import invariant
from hdcli.engine.model import kvcache
from hdcli.engine.model.transformers_cache import TransformersCache
from hdcli.engine.decode.tree import Tree, keep_path, tree_forward
from hdcli.engine.decode import calibrate

from test_invariant import build

V = 64


@torch.inference_mode()
def test_layer_holds_what_a_dynamic_cache_holds_and_zeros_past_its_length():
    g = torch.Generator().manual_seed(0)
    plain = TransformersCache()
    ours = kvcache.Cache(1)
    layer = ours.layers[0]
    for step in range(60):   # grows past _MIN_CAPACITY (256 rows) and doubles
        m = int(torch.randint(1, 12, (1,), generator=g))
        k = torch.randn(1, 2, m, 8, generator=g).to(torch.bfloat16)
        v = torch.randn(1, 2, m, 8, generator=g).to(torch.bfloat16)
        plain.update(k, v, 0)
        layer.append(k, v)
        if step % 3 == 0 and m > 2:   # a tree step: keep the root and a path, crop the rest
            past = plain.get_seq_length() - m
            path = sorted(torch.randperm(m - 1, generator=g)[: m // 2].add(1).tolist())
            keep_path(plain, past, path)
            keep_path(ours, past, path)
        n = plain.get_seq_length()
        assert ours.get_seq_length() == n == layer.length
        assert torch.equal(layer.keys.to(torch.bfloat16), plain.layers[0].keys)
        assert torch.equal(layer.values.to(torch.bfloat16), plain.layers[0].values)
        assert torch.equal(layer.vbuf[:, :, :n, -1], torch.ones(1, 2, n))
        k_all, v_all = layer.padded(layer.capacity)   # what an attention reads past the length: zeros
        assert not k_all[:, :, n:].any() and not v_all[:, :, n:].any()
        assert layer.kbuf.shape[2] % invariant.CHUNK == 0 and layer.kbuf.shape[2] >= n
    assert layer.kbuf.shape[2] > kvcache._MIN_CAPACITY
    k32, v1 = layer.padded(-(-n // invariant.CHUNK) * invariant.CHUNK)
    assert torch.equal(k32, invariant.fp32_kv(plain.layers[0].keys, plain.layers[0].values, k32.shape[2])[0][None])
    assert torch.equal(v1, invariant.fp32_kv(plain.layers[0].keys, plain.layers[0].values, v1.shape[2])[1][None])


def _steps(model, cache) -> list[torch.Tensor]:
    """A prefill, then chains and trees on `cache` until it is longer than its first capacity."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (1, 300), generator=g)
    out = [model.forward(ids[:, :200], cache)]
    pos = 200
    while pos < 300:
        out.append(model.forward(ids[:, pos:pos + 7], cache))
        t = Tree()
        for cand in ([5, 6, 7], [8, 9], [5, 10, 11, 12]):
            t.add_candidate(cand, "x")
        past = cache.get_seq_length()
        out.append(tree_forward(model, t, int(ids[0, pos + 7]), cache))
        keep_path(cache, past, [4, 5])
        pos += 10
    return out


@pytest.mark.parametrize("dtype,kern,attention", [(torch.float32, "torch", "torch"), (torch.bfloat16, "gguf", "torch"),
                                                 (torch.float32, "torch", "fused"), (torch.bfloat16, "gguf", "fused")])
def test_a_cache_that_grows_gives_the_logits_of_one_that_had_room(dtype, kern, attention, tmp_path, monkeypatch):
    """With the fused attention a bf16 model's cache stores bf16 (the attention widens it as it
    reads): logits torch.equal all the same."""
    from hdcli.engine.kernels import fused
    if attention == "fused" and fused.load(quiet=True) is None:
        pytest.skip(f"the fused attention does not compile here: {fused.failure()}")
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    with invariant.pinned(attention):
        model = build("llama", dtype, kern)
        calibrate.enable(model)
        grows, roomy = model.new_cache(), model.new_cache()
        with torch.inference_mode():
            for layer in roomy.layers:   # room for every step from the start: no growth copies
                layer.lazy_initialization(torch.zeros(1, model.config.num_key_value_heads, 0, model.config.head_dim,
                                                      dtype=dtype))
                layer._reserve(1024)
            ours = _steps(model, grows)
            plain = _steps(model, roomy)
    assert grows.layers[0].kbuf.shape[2] > kvcache._MIN_CAPACITY   # it grew on the way
    assert roomy.layers[0].kbuf.shape[2] == 1024
    stored = torch.bfloat16 if (attention, dtype) == ("fused", torch.bfloat16) else torch.float32
    assert grows.layers[0].kbuf.dtype == stored
    if attention == "fused":
        assert grows.layers[0].ktbuf.dtype == stored
    for a, b in zip(ours, plain):
        assert torch.equal(a, b)
