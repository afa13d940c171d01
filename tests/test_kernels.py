"""Prepacked oneDNN linear layers: same layer, same model, recoverable weights, exact decoding."""
from __future__ import annotations

import copy

import pytest
import torch

from hdcli import api
from hdcli.hsd import draft_models as draftmodels
from hdcli.engine.kernels import dense as kernels
from hdcli.engine import loader
from hdcli.engine.decode.loop import Decoder
from hdcli.drafting import ContextDB, Hierarchy
from hdcli.errors import HdError

from conftest import tiny_gemma3, tiny_llama
from test_exactness import PROMPTS, ScriptedLayer

pytestmark = pytest.mark.skipif(not kernels.available(), reason="this torch has no oneDNN packed linear")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_packed_linear_is_the_same_layer(dtype, tol):
    if not kernels.available("bf16" if dtype == torch.bfloat16 else "fp32"):
        pytest.skip("oneDNN packs no bf16 weights on this CPU (needs AVX-512 or AVX-NE-CONVERT)")
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 200, dtype=dtype)
    packed = kernels.PackedLinear(lin)
    for shape in [(1, 96), (7, 96), (2, 5, 96), (37, 96), (3, 100, 96)]:  # 37, 300 rows: padded
        x = torch.randn(shape, dtype=dtype)
        torch.testing.assert_close(packed(x), lin(x), atol=tol, rtol=tol)
    assert torch.equal(packed.weight_matrix(), lin.weight.detach())  # recovered bit for bit
    assert torch.equal(packed.to_linear().bias, lin.bias)
    sd = torch.nn.Sequential(packed).state_dict()
    assert set(sd) == {"0.weight", "0.bias"} and torch.equal(sd["0.weight"], lin.weight.detach())
    twin = copy.deepcopy(packed)
    x = torch.randn(3, 96, dtype=dtype)
    assert torch.equal(twin(x), packed(x))


def test_row_counts_are_bounded_and_padding_is_small():
    sizes = {kernels.padded_rows(m) for m in range(1, 8193)}
    assert len(sizes) <= 64 and all(kernels.padded_rows(m) == m for m in range(1, 17))
    assert all(m <= kernels.padded_rows(m) <= 1.25 * m for m in range(32, 8193))


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_packed_model_decodes_exactly(make):
    """Plain and speculative decoding on the packed model agree token for token (chains and trees),
    and its logits are the unpacked model's up to float rounding."""
    model = make(vocab_size=50, seed=3, scale=4.0)
    stock = copy.deepcopy(model)
    assert kernels.pack(model) == 2 * 7 + 1  # q k v o gate up down per layer, and the head
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, stock(ids).logits, atol=1e-4, rtol=1e-4)
    for seed, prompt in enumerate(PROMPTS):
        ref = Decoder(model, ()).generate(prompt, max_new_tokens=40).tokens
        drafter = Hierarchy([ScriptedLayer(len(prompt), ref, corrupt=0.3, seed=seed), ContextDB(1, 3)],
                            policy="fill", draft_len=6, max_candidates=4)
        g = Decoder(model, (), drafter).generate(prompt, max_new_tokens=40)
        assert g.tokens == ref
    assert kernels.unpack(model) == 15 and not kernels.is_packed(model)


def test_onednn_packs_and_torch_opts_out(tiny_model_dir, tiny_lm):
    assert tiny_lm.kernels == "onednn" and kernels.is_packed(tiny_lm.model)  # the suite runs packed
    assert tiny_lm.info["numerics"]["kernels"] == "onednn"
    plain = api.load_model(str(tiny_model_dir), dtype="fp32", kernels="torch")
    assert plain.kernels == "torch" and not kernels.is_packed(plain.model)
    with pytest.raises(HdError, match="--kernels must be one of"):
        kernels.resolve("fast")
    assert kernels.resolve("int4") == "gguf"   # the older name of the GGUF kernels
    assert loader.owned_kernels("auto", "cuda", "bf16", gguf=False) == "torch"
    assert loader.owned_kernels("auto", "cpu", "fp32", gguf=False) == "onednn"
    from hdcli.engine.kernels import quants
    auto = "gguf-int8" if quants.activation_choice()["activations"] == "int8" else "gguf"
    assert loader.owned_kernels("auto", "cpu", "bf16", gguf=True) == auto
    assert loader.owned_kernels("auto", "cpu", "fp32", gguf=True) == "gguf"   # int8 activations: bf16 only
    with pytest.raises(HdError, match="gguf-int8 multiplies a GGUF"):
        loader.owned_kernels("gguf-int8", "cpu", "bf16", gguf=False)
    with pytest.raises(HdError, match="--kernels gguf-int8 needs"):
        loader.owned_kernels("gguf-int8", "cpu", "fp32", gguf=True)
    with pytest.raises(HdError, match="needs a CPU model"):
        loader.owned_kernels("onednn", "cuda", "bf16", gguf=False)


def test_self_drafts_of_a_packed_target(tiny_lm):
    """self:layers shares the packed target's layers; self:int8 still quantises."""
    small = draftmodels.load("self:layers=1", tiny_lm).model
    assert kernels.is_packed(small) and len(small.blocks) == 1
    q = draftmodels.load("self:int8", tiny_lm).model
    assert any("quantized" in type(m).__module__ for m in q.modules())
    assert not kernels.is_packed(q)
    assert small.head is tiny_lm.model.head
