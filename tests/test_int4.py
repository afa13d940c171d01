"""The int4 kernel set (hdcli/engine/int4.py): a GGUF's Q4_0/Q4_1 blocks parsed as gguf-py
dequantizes them, multiplied by torch's int4 CPU kernel or hd's own GEMM (csrc/int4mm.cpp,
whichever the machine measures faster; both are tested here), mapped onto the model's layers only where
the codes equal the loaded weights, and put back exactly. Per-row M-invariance and greedy
exactness of this set run with the other sets in tests/test_invariant.py (case llama-bfloat16-int4)
and below on the bundled GGUF."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hdcli.engine import int4, kernels

pytestmark = pytest.mark.skipif(not (int4.available() and kernels.available()),
                                reason="torch without the int4 CPU kernel or oneDNN")


def quantize(w: torch.Tensor, kind: str = "Q4_1") -> np.ndarray:
    """gguf-py's own quantizer: the raw blocks a GGUF file would hold for w [n, k]."""
    from gguf import GGMLQuantizationType, quants
    return quants.quantize(w.float().numpy(), GGMLQuantizationType[kind])


def to_int4(model: torch.nn.Module, kind: str = "Q4_1") -> int:
    """Every Linear of a bf16 model replaced by the Int4Linear of its Q4 quantisation."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (torch.nn.Linear, kernels.PackedLinear)) and not isinstance(child, int4.Int4Linear):
                w = child.weight_matrix() if isinstance(child, kernels.PackedLinear) else child.weight.detach()
                setattr(parent, name, int4.from_blocks(kind, quantize(w, kind), *w.shape))
                n += 1
    return n


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_blocks_dequantize_as_gguf_py_does(kind):
    from gguf import GGMLQuantizationType, quants
    w = torch.randn(96, 128) * torch.rand(96, 1)
    raw = quantize(w, kind)
    codes, scale, low = int4.blocks(kind, raw, 96, 128)
    ours = codes.reshape(96, 4, 32).astype(np.float32) * scale[..., None] + low[..., None]
    theirs = quants.dequantize(raw, GGMLQuantizationType[kind])
    assert np.array_equal(ours.reshape(96, 128), theirs)
    assert codes.min() >= 0 and codes.max() <= 15


def test_int4_linear_multiplies_by_its_weights():
    torch.manual_seed(0)
    w = torch.randn(64, 96)
    lin = int4.from_blocks("Q4_1", quantize(w), 64, 96)
    wm = lin.weight_matrix()
    assert wm.dtype == torch.bfloat16 and wm.shape == (64, 96)
    # the kernel's weights: the codes with bf16 block constants, close to the file's weights
    codes, scale, low = int4.blocks("Q4_1", quantize(w), 64, 96)
    exact = torch.from_numpy(codes.reshape(64, 3, 32) * scale[..., None] + low[..., None]).reshape(64, 96)
    assert (wm.float() - exact).abs().max() < 0.02 * exact.abs().max()
    x = torch.randn(5, 2, 96).bfloat16()
    y = lin(x)
    assert y.shape == (5, 2, 64)
    torch.testing.assert_close(y.float(), x.float() @ wm.float().t(), atol=0.05, rtol=0.02)
    state = lin.state_dict()
    assert torch.equal(state["weight"], wm)


def _hd_gemm_or_skip():
    if int4.gemm_module() is None:
        pytest.skip(f"hd's 4-bit GEMM is not built here: {int4._gemm_failed}")


def test_hd_gemm_rows_do_not_depend_on_the_row_count_and_use_the_gguf_weights():
    """hd's GEMM (csrc/int4mm.cpp): every row of a product of M rows, M = 1..33 at any offset, is
    torch.equal to the same row among 40; the result is the product by the Q4 weights themselves
    (closer to them than torch's kernel with its bf16 block constants); a layer made with either
    GEMM says which. The check can fail: rows of torch's kernel at M = 1 and M = 40 are compared
    the same way and the test only asks them to be close."""
    _hd_gemm_or_skip()
    gen = torch.Generator().manual_seed(0)
    n, k = 96, 160
    codes = torch.randint(0, 16, (n, k), generator=gen)
    # a GGUF's block constants are fp16 (hd's packing keeps them so)
    scale = (torch.rand(n, k // 32, generator=gen) / 16).half().float()
    low = (-torch.rand(n, k // 32, generator=gen) / 2).half().float()
    exact = (codes.float().view(n, k // 32, 32) * scale[..., None] + low[..., None]).view(n, k)
    hd = int4.Int4Linear(codes, scale, low, kernel="hd")
    theirs = int4.Int4Linear(codes, scale, low, kernel="torch")
    assert "hd GEMM" in repr(hd) and "torch GEMM" in repr(theirs)
    # constants that no fp16 holds exactly cannot be packed: such a layer keeps torch's kernel
    assert "torch GEMM" in repr(int4.Int4Linear(codes, scale + 1e-5, low, kernel="hd"))
    x = (torch.randn(40, k, generator=gen) * 2).bfloat16()
    y = hd(x)
    for m in list(range(1, 34)) + [40]:   # one tile of up to 16 rows, then tiles as even as they go
        for start in (0, 5, 40 - m):
            if start + m <= 40:
                assert torch.equal(hd(x[start:start + m]), y[start:start + m]), (m, start)
    ref = x.float() @ exact.t()
    err_hd = (y.float() - ref).abs().max()
    assert err_hd <= ref.abs().max() * 2 ** -8   # one bf16 rounding of the output
    assert err_hd <= (theirs(x).float() - ref).abs().max()
    torch.testing.assert_close(hd.weight_matrix().float(), exact, atol=2 ** -7, rtol=2 ** -8)


def test_joined_layers_give_each_layer_its_own_output_from_one_packing():
    """int4.joined (q/k/v, gate/up in one call of hd's GEMM): each output torch.equal to its
    layer's own at any row count; the layers' packings become views of the joined one (no copy);
    a layer swapped afterwards makes a new join; inside prefill(), with bf16 copies kept, none."""
    _hd_gemm_or_skip()
    gen = torch.Generator().manual_seed(3)

    def layer(n, k=96):
        return int4.Int4Linear(torch.randint(0, 16, (n, k), generator=gen),
                               (torch.rand(n, k // 32, generator=gen) / 16).half().float(),
                               (-torch.rand(n, k // 32, generator=gen) / 2).half().float(), kernel="hd")

    owner = torch.nn.Module()
    owner.q, owner.k, owner.v = layer(64), layer(32), layer(32)
    x = (torch.randn(1, 20, 96, generator=gen) * 2).bfloat16()
    alone = [owner.q(x), owner.k(x), owner.v(x)]
    j = int4.joined(owner, ("q", "k", "v"))
    assert j is not None and int4.joined(owner, ("q", "k", "v")) is j
    assert owner.k.hd.untyped_storage().data_ptr() == j.hd.untyped_storage().data_ptr()
    for m in (1, 3, 16, 20):
        outs = j(x[:, :m])
        assert [o.shape[-1] for o in outs] == [64, 32, 32]
        assert all(torch.equal(o, a[:, :m]) for o, a in zip(outs, alone))
    assert all(torch.equal(f(x), a) for f, a in zip((owner.q, owner.k, owner.v), alone))   # views still right
    owner.v = layer(32)
    j2 = int4.joined(owner, ("q", "k", "v"))
    assert j2 is not j and torch.equal(j2(x)[2], owner.v(x))
    owner.v.__dict__["_hd_dense"] = torch.nn.Identity()
    with int4.prefill():
        assert int4.joined(owner, ("q", "k", "v")) is None
    owner.k = torch.nn.Linear(96, 32)
    assert int4.joined(owner, ("q", "k", "v")) is None


@pytest.mark.parametrize("gemm", ["hd", "torch"])
def test_both_gemms_keep_greedy_trees_exact_on_an_int4_model(gemm, tmp_path, monkeypatch):
    """A tiny llama in the int4 set made with each GEMM: in the M-invariant mode every row of a
    chain and of a tree equals its one-token forward, and greedy decoding with drafted trees gives
    plain decoding's tokens."""
    if gemm == "hd":
        _hd_gemm_or_skip()
    import random
    from test_invariant import branchy, build, chain, rows_vs_one_token
    from hdcli.engine import invariant
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    with int4.pinned_gemm(gemm):
        model = build("llama", torch.bfloat16, "int4")
    layers = [m for m in model.modules() if isinstance(m, int4.Int4Linear)]
    assert layers and all((m.hd is not None) == (gemm == "hd") for m in layers)
    info = invariant.enable(model)
    assert info["self_check"][0] == info["self_check"][1]
    rng = random.Random(7)
    prefix = [rng.randrange(3, 64) for _ in range(50)]
    assert all(rows_vs_one_token(model, chain([rng.randrange(3, 64) for _ in range(9)]), prefix))
    assert all(rows_vs_one_token(model, branchy(rng, 12), prefix))
    # greedy speculative decoding with branchy, partly wrong drafts equals plain, token for token
    from test_invariant import Oracle
    from hdcli.engine.decode import Decoder
    prompt = [rng.randrange(3, 64) for _ in range(30)]
    ref = Decoder(model, eos_ids=()).generate(prompt, max_new_tokens=40).tokens
    oracle = Oracle(ref, len(prompt), k=8, corrupt=0.25, branches=3, vocab=64, seed=2)
    assert Decoder(model, eos_ids=(), drafter=oracle).generate(prompt, max_new_tokens=40).tokens == ref
    invariant.disable(model)


def test_gemm_choice_is_measured_cached_and_forced(tmp_path, monkeypatch):
    """HD_INT4_GEMM unset: the faster of the two timed GEMMs, cached per machine (a new process
    reads it without timing); HD_INT4_GEMM forces either; the choice is in the cost-curve key."""
    _hd_gemm_or_skip()
    from hdcli.engine import costs
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("HD_INT4_GEMM", raising=False)
    timed = []
    answer = {"torch": [1.0, 2.0, 3.0], "hd": [2.0, 3.0, 4.0]}
    monkeypatch.setattr(int4, "_time_gemms", lambda: timed.append(1) or dict(answer))
    monkeypatch.setattr(int4, "_gemm_choice", None)
    assert int4.gemm() == "torch" and timed == [1]
    assert "|int4-torch|" in costs.curve_key("m", "bf16", "cpu", "int4")
    monkeypatch.setattr(int4, "_gemm_choice", None)   # a new process: the cached times decide
    answer["hd"] = [0.1, 0.1, 0.1]
    assert int4.gemm() == "torch" and timed == [1]
    for forced in ("torch", "hd"):
        monkeypatch.setenv("HD_INT4_GEMM", forced)
        monkeypatch.setattr(int4, "_gemm_choice", None)
        assert int4.gemm() == forced
    assert "|int4-hd-" in costs.curve_key("m", "bf16", "cpu", "int4")


def test_int4_needs_a_gguf(tiny_model_dir):
    from hdcli.engine import models
    from hdcli.errors import HdError
    with pytest.raises(HdError, match="--kernels int4 needs a .gguf model"):
        models.load(str(tiny_model_dir), dtype="bf16", device="cpu", kernels="int4")
    with pytest.raises(HdError, match="--kernels int4 needs"):
        models.load(str(tiny_model_dir), dtype="fp32", device="cpu", kernels="int4")


class _Host(torch.nn.Module):
    """One Int4Linear that kept the bf16 layer it replaced, as convert() leaves it."""

    def __init__(self):
        super().__init__()
        dense = torch.nn.Linear(64, 96, bias=False).to(torch.bfloat16)
        self.lin = int4.from_blocks("Q4_1", quantize(dense.weight.detach()), 96, 64)
        self.lin.__dict__["_hd_original"] = kernels.PackedLinear(dense)


def test_prefill_uses_the_kept_bf16_layer_only_inside_prefill(tmp_path, monkeypatch):
    """keep_dense measures once and caches its decision; with the bf16 layer kept, products inside
    int4.prefill() are the bf16 layer's and all others the 4-bit kernel's; a machine where the
    copies would not fit keeps none."""
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    x = torch.randn(5, 64).to(torch.bfloat16)
    host = _Host()
    dense, lin = host.lin.__dict__["_hd_original"], host.lin
    with torch.inference_mode():
        four_bit = lin(x)
        monkeypatch.setattr(int4, "_prefill_speedup", lambda model: 3.0)
        got = int4.keep_dense(host, "key-a")
        assert got["dense"] and "_hd_original" not in lin.__dict__
        assert torch.equal(lin(x), four_bit)
        with int4.prefill():
            assert torch.equal(lin(x), dense(x)) and not torch.equal(dense(x), four_bit)
        assert torch.equal(lin(x), four_bit)
        # cached: a second model is not measured again and decides the same
        monkeypatch.setattr(int4, "_prefill_speedup", lambda model: pytest.fail("measured again"))
        again = _Host()
        assert int4.keep_dense(again, "key-a")["dense"] and "_hd_dense" in again.lin.__dict__
        # where the copies would take more than MEMORY_SHARE of the memory they are not kept
        monkeypatch.setattr(int4, "_prefill_speedup", lambda model: 3.0)
        monkeypatch.setattr(int4, "_memory_bytes", lambda: 1000)
        small = _Host()
        assert not int4.keep_dense(small, "key-b")["dense"]
        outside = small.lin(x)
        with int4.prefill():
            assert torch.equal(small.lin(x), outside)
        assert "_hd_dense" not in small.lin.__dict__ and "_hd_original" not in small.lin.__dict__
