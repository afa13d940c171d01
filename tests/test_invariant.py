"""The M-invariant forward (hdcli/engine/kernels/invariant.py, a property of hd's own forward): every row
of a k-token verification forward is bit-identical (torch.equal) to the same token's one-token
forward, for chains of every width hd sends and for token trees, after a cached prefix, in fp32
and bf16 (dense torch or oneDNN layers, and bf16 with a GGUF's own blocks: the gguf kernels), on
a tiny llama and a tiny Gemma 3 past its sliding window (checkpoints saved by transformers and
loaded on hd's forward); and greedy output in bf16 equals plain decoding on real questions.

That these tests can fail: `test_the_plain_forward_is_not_invariant` runs the same per-row check
with the mode off and asserts that rows differ there (fp32 with torch's kernels: no row of an
8-token forward equals its one-token forward on the EPYC this was written on; bf16 differs too)."""
from __future__ import annotations

import itertools
import random
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from hdcli.engine.kernels import invariant, dense as kernels, quants
from hdcli.engine import loader
from hdcli.engine.decode.loop import Decoder
from hdcli.engine.decode.tree import Tree
from hdcli.engine.decode import calibrate

from conftest import owned_copy, tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from gpu_check import Oracle  # noqa: E402

V = 64
_FOLDERS = tempfile.TemporaryDirectory(prefix="hd-invariant-")   # models of this module, saved once
_SEQ = itertools.count()


def tiny_gemma3(dtype=torch.float32, head_dim: int = 16):
    """Sliding window 8, then a full-attention layer. head_dim 16: with head_dim 8 the score GEMM
    (K = 8) rounded rows differently by their place in the call on the EPYC, which the self-check
    caught (NotInvariant); real models have head_dim >= 64."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(1)
    cfg = Gemma3TextConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
                           pad_token_id=0)
    return Gemma3ForCausalLM(cfg).to(dtype).eval()


def build(name: str, dtype, kern: str, invariant_mode: str = "off"):
    """hd's own forward of a tiny model in dtype with kernels kern ("torch", "onednn", or "gguf":
    a synthetic GGUF of every supported block type), the M-invariant mode as asked."""
    dt = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    if kern == "onednn" and not kernels.available():
        pytest.skip("torch without oneDNN")
    folder = Path(_FOLDERS.name) / f"{name}-{next(_SEQ)}"
    if kern in kernels.GGUF:
        if kern == "gguf" and not quants.bf16_available():
            pytest.skip("hd's bf16-activation GEMM needs AVX512-BF16")
        if kern == "gguf-int8" and not quants.int8_available():
            pytest.skip("hd's int8-activation GEMM needs AVX512-VNNI or AVX2")
        import synth_gguf
        folder.mkdir()
        synth_gguf.write(folder / "tiny.gguf", "tiny", "all", seed=0)
        return loader.load(str(folder / "tiny.gguf"), dtype=dt, device="cpu", kernels=kern,
                           invariant=invariant_mode, quiet=True).model
    hf = tiny_llama(V, hidden=64, scale=4.0) if name == "llama" else tiny_gemma3()
    return owned_copy(hf, folder, dtype=dt, kernels=kern, invariant=invariant_mode).model


def chain(tokens) -> Tree:
    t = Tree()
    t.add_candidate(tokens, "x")
    return t


def branchy(rng: random.Random, nodes: int) -> Tree:
    t = Tree()
    while len(t.tokens) < nodes:
        parent = rng.randrange(len(t.tokens))
        t.add(parent, rng.randrange(3, V), "x")
    return t


def rows_vs_one_token(model, tree: Tree, prefix: list[int]) -> list[bool]:
    """Per node: is the tree forward's row torch.equal to the node's one-token forward, which runs
    after the node's path token by token on the same prefix cache?"""
    return [equal for equal, _ in calibrate.compare_rows(model, tree, prefix)]


CASES = [("llama", torch.float32, "onednn"), ("llama", torch.float32, "torch"),
         ("llama", torch.bfloat16, "onednn"), ("llama", torch.bfloat16, "gguf"), ("llama", torch.bfloat16, "gguf-int8"),
         ("gemma3", torch.float32, "torch"),
         ("gemma3", torch.bfloat16, "torch")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-{c[2]}")
def invariant_model(request, tmp_path_factory, monkeypatch_module):
    """The torch ops' attention (the fused one: test_fused_attention_rows_equal_one_token_rows)."""
    monkeypatch_module.setenv("HD_CACHE_DIR", str(tmp_path_factory.mktemp("hdcache")))
    name, dtype, kern = request.param
    with invariant.pinned("torch"):
        model = build(name, dtype, kern)
        info = calibrate.enable(model)
        assert info["self_check"][0] == info["self_check"][1]
        yield model


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8, 16, 32])
def test_every_chain_row_equals_its_one_token_forward(invariant_model, k):
    """A chain of k tokens (the root and k - 1 drafts) after prefixes shorter and longer than a
    chunk and than the sliding window."""
    rng = random.Random(k)
    for prefix_len in (5, 40, 75):
        prefix = [rng.randrange(3, V) for _ in range(prefix_len)]
        rows = rows_vs_one_token(invariant_model, chain([rng.randrange(3, V) for _ in range(k - 1)]), prefix)
        assert all(rows), (k, prefix_len, rows)


@pytest.mark.parametrize("nodes", [6, 17, 33])
def test_every_tree_row_equals_its_one_token_forward(invariant_model, nodes):
    rng = random.Random(nodes)
    for prefix_len in (9, 70):
        prefix = [rng.randrange(3, V) for _ in range(prefix_len)]
        tree = branchy(rng, nodes)
        assert not tree.is_chain()
        rows = rows_vs_one_token(invariant_model, tree, prefix)
        assert all(rows), (nodes, prefix_len, rows)


def test_greedy_trees_equal_plain_decoding_bit_for_bit(invariant_model):
    """Speculative decoding with branchy drafts (a quarter of the tokens corrupted) against plain
    decoding in the same mode, token for token."""
    rng = random.Random(3)
    for i in range(3):
        prompt = [rng.randrange(3, V) for _ in range(30)]
        ref = Decoder(invariant_model, eos_ids=()).generate(prompt, max_new_tokens=60).tokens
        oracle = Oracle(ref, len(prompt), k=8, corrupt=0.25, branches=3, vocab=V, seed=i)
        got = Decoder(invariant_model, eos_ids=(), drafter=oracle).generate(prompt, max_new_tokens=60)
        assert got.tokens == ref
        assert max(got.stats.tree_sizes) > 8


@pytest.mark.parametrize("dtype,kern", [(torch.float32, "torch"), (torch.bfloat16, "onednn")])
def test_the_plain_forward_is_not_invariant(dtype, kern):
    """The same check with the mode off fails: so the tests above can fail."""
    model = build("llama", dtype, kern)
    assert not model.invariant
    rng = random.Random(0)
    rows = []
    for prefix_len in (40, 75):
        prefix = [rng.randrange(3, V) for _ in range(prefix_len)]
        rows += rows_vs_one_token(model, chain([rng.randrange(3, V) for _ in range(7)]), prefix)
        rows += rows_vs_one_token(model, branchy(rng, 17), prefix)
    assert not all(rows)


def test_a_linear_whose_rows_depend_on_m_is_padded():
    """Calibration finds the row count from which a layer's rows stop depending on M."""
    lin = torch.nn.Linear(32, 16)

    class RowByRow(torch.nn.Module):  # every row through its own one-row call: invariant
        in_features, out_features = 32, 16

        def forward(self, x):
            return torch.cat([lin(r[None]) for r in x])

    class OneRowDiffers(RowByRow):  # as if M = 1 took a GEMV that rounds differently
        def forward(self, x):
            return super().forward(x) + (1e-3 if x.shape[0] == 1 else 0.0)

    class SmallCallsDiffer(RowByRow):
        def forward(self, x):
            return super().forward(x) * (1.001 if x.shape[0] < 5 else 1.0)
    with torch.inference_mode():
        assert invariant.min_rows_for(RowByRow(), 32, torch.float32, rows_per_m=32) == 1
        assert invariant.min_rows_for(OneRowDiffers(), 32, torch.float32, rows_per_m=32) == 2
        assert invariant.min_rows_for(SmallCallsDiffer(), 32, torch.float32, rows_per_m=32) == 5


def test_enable_refuses_where_the_self_check_fails(monkeypatch, tmp_path, tiny_model_dir):
    """An attention whose rows shift with the number of rows fails the self-check: the mode is
    refused and the model is left out of it; `--invariant on` is a one-line error."""
    from hdcli.errors import HdError
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    real = invariant.attend_kv
    monkeypatch.setattr(invariant, "attend_kv", lambda q, *a: real(q, *a) + 1e-3 * q.shape[2])
    with invariant.pinned("torch"):
        model = build("llama", torch.float32, "torch")
        with pytest.raises(calibrate.NotInvariant, match="self-check"):
            calibrate.enable(model)
    assert not model.invariant and not model.numerics.min_rows
    assert all(lin.min_rows == 1 for lin in model.linears())
    monkeypatch.setattr(calibrate, "try_enable", lambda *a: {"off": "self-check: 3 of 24 verified rows equal"})
    with pytest.raises(HdError, match="--invariant on"):
        loader.load(str(tiny_model_dir), dtype="fp32", device="cpu", kernels="torch", invariant="on", quiet=True)


def spec_bench_questions(rows: slice) -> list[dict]:
    """Spec-Bench questions from ../shared (the test is skipped where they are not there)."""
    import json
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "shared/data/spec_bench/question.jsonl"
    if not path.exists():
        pytest.skip("../shared/data/spec_bench/question.jsonl not found")
    return [json.loads(line) for line in path.read_text().splitlines()[rows]]


def assert_spec_equals_plain(lm, questions: list[dict], max_new_tokens: int = 64) -> list:
    """hd's default drafting equals plain decoding token for token on each question's first turn.
    Returns the speculative generations."""
    from hdcli import api
    from hdcli.config import DecodingConfig
    cfg = DecodingConfig(max_new_tokens=max_new_tokens)
    out = []
    for q in questions:
        ids = api.encode_prompt(lm.tokenizer, q["turns"][0])
        spec = api.generate(lm, prompt_ids=ids, config=cfg)
        plain = api.generate(lm, prompt_ids=ids, config=cfg, drafter=None)
        assert spec.tokens == plain.tokens
        out.append(spec)
    return out


@pytest.mark.bundled
def test_bf16_greedy_output_equals_plain_on_spec_bench_questions(bundled_lm):
    """The bundled model in bf16, M-invariant: hd's default drafting equals plain decoding token
    for token on real questions (without the mode 30 of 39 such answers differed)."""
    from hdcli import api
    kern = "onednn" if kernels.available() else "torch"  # one kernel set: the test needs no choice
    if quants.int8_available():   # the GGUF blocks by int8 activations: what auto takes on such CPUs
        kern = "gguf-int8"
    lm = api.load_model("smollm2-135m", dtype="bf16", device="cpu", kernels=kern, quiet=True)
    assert lm.invariant, lm.info.get("invariant")
    assert_spec_equals_plain(lm, spec_bench_questions(slice(0, 60, 20)))


def rows_and_trees_equal_plain(model) -> random.Random:
    """Chain rows of 1, 4 and 16 tokens and tree rows of 6 and 17 nodes torch.equal their one-token
    forwards, and greedy trees of an oracle drafter equal plain decoding; returns the generator
    the cases drew from, for the caller's controls."""
    rng = random.Random(5)
    for k in (1, 4, 16):
        prefix = [rng.randrange(3, V) for _ in range(75)]
        assert all(rows_vs_one_token(model, chain([rng.randrange(3, V) for _ in range(k - 1)]), prefix)), k
    for nodes in (6, 17):
        prefix = [rng.randrange(3, V) for _ in range(40)]
        assert all(rows_vs_one_token(model, branchy(rng, nodes), prefix)), nodes
    prompt = [rng.randrange(3, V) for _ in range(30)]
    ref = Decoder(model, eos_ids=()).generate(prompt, max_new_tokens=40).tokens
    oracle = Oracle(ref, len(prompt), k=8, corrupt=0.25, branches=3, vocab=V, seed=0)
    assert Decoder(model, eos_ids=(), drafter=oracle).generate(prompt, max_new_tokens=40).tokens == ref
    return rng


@pytest.mark.parametrize("name,dtype,kern", [("llama", torch.float32, "torch"), ("gemma3", torch.bfloat16, "torch"),
                                             ("llama", torch.bfloat16, "gguf")])
def test_fused_attention_rows_equal_one_token_rows(name, dtype, kern, tmp_path, monkeypatch):
    """The fused attention (engine/kernels/fused.py, csrc/attend.cpp): chain and tree rows
    torch.equal their one-token forwards and greedy trees equal plain decoding, with every
    attention call going through the compiled loop; with its result nudged, rows differ."""
    from hdcli.engine.kernels import fused
    if fused.load(quiet=True) is None:
        pytest.skip(f"the fused attention does not compile here: {fused.failure()}")
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    calls = []
    real = {f: getattr(fused.KERNEL, f) for f in ("attend_many", "append_attend_many")}
    for f in real:   # on invariant caches the attention appends the keys too (append_attend_many)
        monkeypatch.setattr(fused.KERNEL, f, lambda *a, f=f: calls.append(f) or real[f](*a))
    model = build(name, dtype, kern)
    model.compiled_layers = False   # the blocks' calls (the compiled layers': test_compiled_layers_*)
    with invariant.pinned("fused"):
        info = calibrate.enable(model)
        assert fused.name().startswith("fused-") and info["self_check"][0] == info["self_check"][1]
        rng = rows_and_trees_equal_plain(model)
        assert "append_attend_many" in calls   # the fused attention appends the keys itself
        # the check can fail: a loop whose result depended on the row count would differ here
        for f in real:
            monkeypatch.setattr(fused.KERNEL, f, lambda q, *a, f=f: real[f](q, *a) * (1 + 1e-2 * (q.shape[-2 if q.dim() == 4 else 0] > 1)))
        prefix = [rng.randrange(3, V) for _ in range(75)]
        assert not all(rows_vs_one_token(model, chain([rng.randrange(3, V) for _ in range(7)]), prefix))
    calibrate.disable(model)


def _compiled_model(kern: str, dtype: str = "bf16", arch: str = "llama"):
    """A model the compiled layers run, the fused attention and the mode on: for the GGUF kernels
    a tiny GGUF of a real mix (Q4_K_M: q/k and v of other types in some layers, so q/k/v join in
    some layers only); for the dense ones ("torch", "onednn") a transformers checkpoint in dtype
    (tiny_llama, or tiny_gemma3 for arch "gemma3"); as_arch then makes it OLMo 2's or Granite's."""
    from hdcli.engine.kernels import fused
    from hdcli.engine.model import compiled
    if fused.load(quiet=True) is None:
        pytest.skip(f"the fused attention does not compile here: {fused.failure()}")
    if kern == "gguf" and not quants.bf16_available():
        pytest.skip("hd's bf16-activation GEMM needs AVX512-BF16")
    if kern == "gguf-int8" and not quants.int8_available():
        pytest.skip("hd's int8-activation GEMM needs AVX512-VNNI or AVX2")
    if kern == "onednn" and not kernels.available(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} weights on this CPU")
    folder = Path(_FOLDERS.name) / f"compiled-{next(_SEQ)}"
    with invariant.pinned("fused"):
        if kern in kernels.GGUF:
            import synth_gguf
            folder.mkdir()
            synth_gguf.write(folder / "tiny.gguf", "tiny", "Q4_K_M", seed=0)
            model = loader.load(str(folder / "tiny.gguf"), dtype=dtype, device="cpu", kernels=kern, invariant="on",
                                quiet=True).model
            blocks = model.blocks
            assert any(b.qkv is None for b in blocks) and any(b.qkv is not None for b in blocks)   # both spellings
        else:
            hf = tiny_gemma3(torch.float32) if arch == "gemma3" else tiny_llama(V, hidden=64, scale=4.0)
            model = owned_copy(hf, folder, dtype=dtype, kernels=kern, invariant="on").model
            assert {lin.kind for lin in model.linears()} == {kern}
    as_arch(model, arch)
    assert compiled.why_not(model) is None, compiled.why_not(model)
    return model


def as_arch(model, arch: str) -> None:
    """The llama model made OLMo 2's (its pre-norms moved after each sublayer, q and k normed over
    their whole width) or Granite's (its residual, embedding and logits multipliers away from 1),
    random norm weights near 1; other arches as they are."""
    gen = torch.Generator().manual_seed(5)

    def weight(n: int):
        return torch.nn.Parameter((1 + 0.5 * torch.rand(n, generator=gen)).to(model.dtype), requires_grad=False)
    for blk in model.blocks:
        if arch == "olmo2":
            blk.post_attn_norm, blk.post_ffn_norm, blk.attn_norm, blk.ffn_norm = blk.attn_norm, blk.ffn_norm, None, None
            blk.q_norm, blk.k_norm = weight(blk.hq * blk.d), weight(blk.hkv * blk.d)
            blk.wide_qk_norm = True
        if arch == "granite":
            blk.residual_scale = 0.5
    if arch == "granite":
        model.embedding_scale, model.logits_scale = 3.0, 4.0


def _forwards(model, rng) -> tuple[list, list]:
    """Logits of a prompt, single tokens, a chain, a tree and a batch of three parts (one a tree),
    then a keys-only prefill; and every cache's stored keys, values and transposed keys after."""
    from hdcli.engine.decode import batch
    caches, logits = [model.new_cache() for _ in range(3)], []
    for c in caches:
        logits.append(model.forward(torch.tensor([[rng.randrange(3, V) for _ in range(21)]]), c))
    for _ in range(3):
        logits.append(model.forward(torch.tensor([[int(logits[-1][-1].argmax())]]), caches[0]))
    logits.append(model.forward(torch.tensor([[rng.randrange(3, V) for _ in range(5)]]), caches[0]))
    trees = [chain([rng.randrange(3, V) for _ in range(3)]), branchy(rng, 9), chain([])]
    logits += batch.forward_many(model, [(t, 7, c) for t, c in zip(trees, caches)])
    model.prefill(torch.tensor([[rng.randrange(3, V) for _ in range(9)]]), caches[1])
    logits.append(model.forward(torch.tensor([[5]]), caches[1]))
    stored = [t[:, :, :layer.length] if t is not layer.ktbuf else t.clone()
              for c in caches for layer in c.layers for t in (layer.kbuf, layer.vbuf)]
    return logits, stored


@pytest.mark.parametrize("kern,dtype,arch", [
    ("gguf", "bf16", "llama"), ("gguf-int8", "bf16", "llama"), ("gguf-int8", "bf16", "olmo2"),
    ("gguf-int8", "bf16", "granite"), ("torch", "fp32", "llama"), ("onednn", "fp32", "llama"),
    ("onednn", "bf16", "llama"), ("torch", "bf16", "llama"), ("torch", "fp32", "olmo2"),
    ("onednn", "fp32", "granite"), ("torch", "fp32", "gemma3")])
def test_compiled_layers_equal_the_blocks(kern, dtype, arch, tmp_path, monkeypatch):
    """The decoder layers, final norm and head in one compiled call (engine/model/compiled.py,
    csrc/qmm.cpp's Layers) against the Python blocks on the same model, on each kernel it calls
    (the GGUF GEMM with bf16 or int8 activations, oneDNN's packed layers, torch's Linear), in bf16
    (the compiled row ops) and fp32 (torch's), the llama family, OLMo 2's and Granite's forwards
    and Gemma 3's, and a Linear padded to a least row count: prompt, single tokens, a chain, a
    token tree and a batch of three parts, and a keys-only prefill give torch.equal logits and
    caches, with the compiled call taken for each. The GGUF llama adds q/k/v biases in two layers,
    as Qwen2's, and per-head q/k norms in one, as Qwen3's. And the comparison can fail: a handle
    built with another norm epsilon than the blocks' gives other logits."""
    from hdcli.engine.model import compiled
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    model = _compiled_model(kern, dtype, arch)
    gen = torch.Generator().manual_seed(0)
    if kern in kernels.GGUF and arch == "llama":
        for lin in (model.blocks[0].qkv or model.blocks[0].q, model.blocks[1].k):   # Qwen2's biases, joined and alone
            if lin is not None:
                lin.kernel.bias = torch.randn(lin.out_features, generator=gen).bfloat16()
        blk = model.blocks[1]   # Qwen3's per-head q and k norms, in one layer
        blk.q_norm, blk.k_norm = (torch.nn.Parameter(1 + torch.rand(blk.d, generator=gen).bfloat16(), requires_grad=False)
                                  for _ in range(2))
    model.blocks[-1].down.min_rows = max(model.blocks[-1].down.min_rows, 3)   # padded to 3 rows, outputs dropped
    runs = []
    real = compiled.CompiledLayers.run
    monkeypatch.setattr(compiled.CompiledLayers, "run", lambda self, x, step, n, head=False: runs.append((n, head))
                        or real(self, x, step, n, head))
    with invariant.pinned("fused"):
        got = {}
        for flag in (True, False):
            model.compiled_layers = flag
            got[flag] = _forwards(model, random.Random(3))
        last = len(model.blocks) - 1
        assert len(runs) == 10 and runs[-2] == (last, False) and runs[-1] == (last + 1, True)   # the prefill's last layer alone
        for a, b in zip(got[True][0] + got[True][1], got[False][0] + got[False][1]):
            assert torch.equal(a, b)
        model.compiled_layers = True
        monkeypatch.setattr(model.config, "rms_norm_eps", model.config.rms_norm_eps * 4 + 1e-3)
        model.__dict__.pop("_compiled")   # rebuilt with the other epsilon
        off = _forwards(model, random.Random(3))[0]
        assert not all(torch.equal(a, b) for a, b in zip(off, got[False][0]))


def test_compiled_layers_pad_rows_as_onednn_does():
    """Layers' oneDNN row padding (csrc/qmm.cpp's padded_rows) is kernels/dense.padded_rows."""
    module = quants.gemm_module()
    if module is None:
        pytest.skip(f"the GGUF GEMM's extension does not build here: {quants.failure()}")
    assert all(module.padded_rows(m) == kernels.padded_rows(m) for m in range(1, 5000))


@pytest.mark.parametrize("kern,dtype", [("gguf-int8" if quants.int8_available() else "gguf", "bf16"), ("torch", "fp32")])
def test_compiled_layers_rows_equal_one_token_rows(kern, dtype, tmp_path, monkeypatch):
    """M-invariance through the compiled layers, on a GGUF and on a checkpoint in fp32: chain and
    tree rows torch.equal their one-token forwards (both through the compiled call) and greedy
    trees equal plain decoding; with the call's result nudged where it has more than one row, rows
    differ."""
    from hdcli.engine.model import compiled
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    model = _compiled_model(kern, dtype)
    runs = []
    real = compiled.CompiledLayers.run
    monkeypatch.setattr(compiled.CompiledLayers, "run", lambda self, x, *a, **kw: runs.append(1) or real(self, x, *a, **kw))
    with invariant.pinned("fused"):
        rng = rows_and_trees_equal_plain(model)
        assert len(runs) > 50
        monkeypatch.setattr(compiled.CompiledLayers, "run",
                            lambda self, x, *a, **kw: real(self, x, *a, **kw) * (1 + 1e-2 * (x.shape[0] > 1)))
        prefix = [rng.randrange(3, V) for _ in range(75)]
        assert not all(rows_vs_one_token(model, chain([rng.randrange(3, V) for _ in range(7)]), prefix))


def test_fused_attention_kernel_on_odd_head_sizes():
    """The compiled function alone, on head sizes with a scalar tail past whole vectors (12, 100 at
    either vector width; 8 and 24 with 16-float vectors), without (80), wider than a chunk of
    value sums (200) and those it is compiled for (64, 128, 256): the softmax attention within
    float rounding, and each row alone torch.equal to it among others."""
    from hdcli.engine.kernels import fused
    if fused.load(quiet=True) is None:
        pytest.skip(f"the fused attention does not compile here: {fused.failure()}")
    gen = torch.Generator().manual_seed(0)
    for d in (8, 12, 24, 64, 80, 100, 128, 200, 256):
        q, k = torch.randn(5, 4, d, generator=gen), torch.randn(2, 40, d, generator=gen)
        v1 = torch.randn(2, 40, d + 1, generator=gen)
        v1[..., d] = 1
        vis = torch.ones(5, 37, dtype=torch.bool).tril(32)
        vis[3, 10:20] = False   # a row that skips keys, as a tree's row does
        out = fused.KERNEL.attend(q, k, v1, vis, 0.3)
        s = torch.einsum("mhd,hnd->hmn", q, k[:, :37].repeat_interleave(2, 0)) * 0.3
        ref = torch.einsum("hmn,hnd->mhd", s.masked_fill(~vis, float("-inf")).softmax(-1),
                           v1[:, :37, :d].repeat_interleave(2, 0))
        assert torch.allclose(out, ref, atol=1e-5), d
        for r in range(5):
            assert torch.equal(fused.KERNEL.attend(q[r:r + 1].contiguous(), k, v1, vis[r:r + 1].contiguous(), 0.3)[0], out[r])


_CROSS_BUILD = """
import sys, torch
from hdcli.engine.kernels import fused
assert fused.load(quiet=True) is not None, fused.failure()
gen = torch.Generator().manual_seed(3)
outs = []
for d, hq, hkv, m, n in ((64, 9, 3, 1, 300), (64, 9, 3, 4, 300), (64, 32, 32, 2, 100), (128, 32, 8, 3, 90), (100, 4, 2, 5, 40)):
    q = torch.randn(m, hq, d, generator=gen)
    k = torch.randn(hkv, n, d, generator=gen).bfloat16()
    v1 = torch.cat([torch.randn(hkv, n, d, generator=gen), torch.ones(hkv, n, 1)], -1).bfloat16()
    vis = torch.ones(m, n, dtype=torch.bool).tril(n - m)
    outs.append(fused.KERNEL.attend(q, k, v1, vis, 0.125))
torch.save(outs, sys.argv[1])
"""


def test_fused_attention_avx2_build_gives_the_native_bits(tmp_path):
    """The attention built for AVX2 (HD_CPU=avx2: -march=x86-64-v3, 8-float vectors) and for an
    AVX-512 machine itself (16-float vectors) give the same bits on the bundled model's, a 1.7B's
    and an 8B's head shapes and a head with a scalar tail: the vector width is how a row's sums
    are laid out, never their order. Runs where the machine has AVX-512 (elsewhere both builds are
    AVX2); the negative control is the reference's own: fp32 keys give other bits than bf16 ones."""
    from conftest import cross_built
    from hdcli.engine.kernels import fused
    if "avx512f" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX-512: its own build is the AVX2 one")
    outs = cross_built(_CROSS_BUILD, (("native", {}), ("avx2", {"HD_CPU": "avx2"})), tmp_path, "the fused attention",
                        timeout=600)
    assert len(outs["native"]) == 5
    for a, b in zip(outs["native"], outs["avx2"]):
        assert torch.equal(a, b)
    if fused.load(quiet=True) is not None:   # the same inputs as fp32 keys: other bits, so equal means equal
        gen = torch.Generator().manual_seed(3)
        q = torch.randn(1, 9, 64, generator=gen)
        k = torch.randn(3, 300, 64, generator=gen)
        v1 = torch.cat([torch.randn(3, 300, 64, generator=gen), torch.ones(3, 300, 1)], -1)
        vis = torch.ones(1, 300, dtype=torch.bool)
        assert not torch.equal(fused.KERNEL.attend(q, k, v1, vis, 0.125), outs["native"][0])


def test_fused_attention_rows_do_not_depend_on_tiles_or_neighbours(monkeypatch):
    """Rows are computed side by side in tiles of 1-4 or 6 rows (set_tile forces a height) and
    sequences share one call: every row is torch.equal whatever the tile height, whichever
    sequences share the call, whether the keys' transposed copy is kept or made afresh, and
    whether keys and values are stored as bf16 or as their fp32 widening. And the comparison can
    fail: a kept copy that is stale (keys changed, kt_len not lowered) gives other rows."""
    from hdcli.engine.kernels import fused
    if fused.load(quiet=True) is None:
        pytest.skip(f"the fused attention does not compile here: {fused.failure()}")
    gen = torch.Generator().manual_seed(1)
    seqs = []
    for m, n in ((1, 37), (5, 50), (3, 20)):
        k, v1 = torch.randn(2, n + 16, 64, generator=gen), torch.randn(2, n + 16, 65, generator=gen)
        v1[..., 64] = 1
        vis = torch.ones(m, n, dtype=torch.bool).tril(n - m)
        vis[-1, n - m:-1] = False   # a tree row: its siblings unseen
        seqs.append((torch.randn(m, 6, 64, generator=gen), k, v1, vis))
    alone = [fused.KERNEL.attend(q, k, v1, vis, 0.125) for q, k, v1, vis in seqs]
    q_all = torch.cat([s[0] for s in seqs]).contiguous()
    for tile in ("1", "2", "3", "4", "6"):
        fused.KERNEL.module.set_tile(int(tile))
        together = fused.KERNEL.module.attend_many(q_all, [s[1] for s in seqs], [None] * 3, [0] * 3,
                                             [s[2] for s in seqs], [s[3] for s in seqs], 0.125)
        assert torch.equal(torch.cat(alone), together), tile
        kts = [torch.full((2, 5, 64, 16), float("nan")) for _ in seqs]   # a kept copy, valid for 0 keys
        kept = fused.KERNEL.module.attend_many(q_all, [s[1] for s in seqs], kts, [0] * 3,
                                         [s[2] for s in seqs], [s[3] for s in seqs], 0.125)
        assert torch.equal(kept, together) and not kts[0].isnan()[:, :3].any()
        again = fused.KERNEL.module.attend_many(q_all, [s[1] for s in seqs], kts, [s[3].shape[1] for s in seqs],
                                          [s[2] for s in seqs], [s[3] for s in seqs], 0.125)
        assert torch.equal(again, together)
        # keys and values stored as bf16 are read as their exact fp32 widening
        halves = [(s[1].bfloat16(), s[2].bfloat16()) for s in seqs]
        as_bf16 = fused.KERNEL.module.attend_many(q_all, [k for k, _ in halves], [None] * 3, [0] * 3,
                                            [v for _, v in halves], [s[3] for s in seqs], 0.125)
        widened = fused.KERNEL.module.attend_many(q_all, [k.float() for k, _ in halves], [None] * 3, [0] * 3,
                                            [v.float() for _, v in halves], [s[3] for s in seqs], 0.125)
        assert torch.equal(as_bf16, widened) and not torch.equal(as_bf16, together)
    fused.KERNEL.module.set_tile(0)   # chosen per call again
    # a stale kept copy (keys changed after it was made, not marked) gives other rows: kt_len matters
    k2 = seqs[1][1].clone()
    k2[:, 10] += 1
    fresh = fused.KERNEL.module.attend_many(seqs[1][0], [k2], [None], [0], [seqs[1][2]], [seqs[1][3]], 0.125)
    stale = fused.KERNEL.module.attend_many(seqs[1][0], [k2], [kts[1]], [seqs[1][3].shape[1]], [seqs[1][2]], [seqs[1][3]], 0.125)
    assert not torch.equal(fresh, stale)


def test_fused_attention_appends_keys_as_the_cache_does():
    """append_attend_many writes each sequence's new keys and values into its kvcache layer in the
    compiled call: the layers end as append() leaves them (fp32 keys, [V | 1], zeros past the
    length, the length), and the attention equals attend_many's on them. Sequences of 1 and 3 new
    rows, on an empty layer and on one with keys, share the call; bf16 keys are widened exactly."""
    from hdcli.engine.kernels import fused
    from hdcli.engine.model.kvcache import InvariantLayer
    if fused.load(quiet=True) is None:
        pytest.skip(f"the fused attention does not compile here: {fused.failure()}")
    gen = torch.Generator().manual_seed(2)
    mine, ref, viss, news = [], [], [], []
    for past, m in ((0, 1), (40, 3), (31, 2)):
        a, b = InvariantLayer(), InvariantLayer()
        if past:
            k0, v0 = torch.randn(1, 2, past, 64, generator=gen), torch.randn(1, 2, past, 64, generator=gen)
            a.append(k0, v0)
            b.append(k0, v0)
        news.append((torch.randn(1, 2, m, 64, generator=gen).bfloat16(), torch.randn(1, 2, m, 64, generator=gen).bfloat16()))
        b.append(*news[-1])
        n = max(past + m, 2)   # a layout pads one key to two
        viss.append(torch.ones(m, n, dtype=torch.bool).tril(n - m))
        mine.append(a)
        ref.append(b)
    query = torch.randn(1, 6, 6, 64, generator=gen)   # [1, hq, M, d], as hd's forward has it
    key = torch.cat([k for k, _ in news], 2)
    value = torch.cat([v for _, v in news], 2)
    out = fused.KERNEL.append_attend_many(query, key, value, mine, viss, 0.125)[0]
    for a, b, vis in zip(mine, ref, viss):
        assert a.length == b.length and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        cap = min(a.kbuf.shape[2], b.kbuf.shape[2])
        assert torch.equal(a.kbuf[:, :, :cap], b.kbuf[:, :, :cap]) and torch.equal(a.vbuf[:, :, :cap], b.vbuf[:, :, :cap])
    kvs = [tuple(t[0] for t in b.padded(vis.shape[1])) for b, vis in zip(ref, viss)]
    expect = fused.KERNEL.attend_many(query[0].transpose(0, 1).contiguous(), kvs, viss, 0.125)
    assert torch.equal(out, expect)


def test_fused_attention_is_chosen_by_measurement_and_cached(tmp_path, monkeypatch):
    """HD_FUSED_ATTENTION unset: decide() takes the faster of the two timed attentions, caches the
    times per machine (a new process reads them without timing), and 0 / 1 override it."""
    from hdcli.engine.kernels import fused
    if fused.load(quiet=True) is None:
        pytest.skip(f"the fused attention does not compile here: {fused.failure()}")
    model = build("llama", torch.float32, "torch")
    timed, answer, real = [], {}, invariant.time_both
    monkeypatch.setattr(invariant, "time_both", lambda hq, hkv, d, kernel: timed.append((hq, hkv, d)) or dict(answer))
    monkeypatch.delenv("HD_FUSED_ATTENTION", raising=False)
    monkeypatch.setattr(fused.KERNEL, "decision", None)
    was = fused.enabled()
    try:
        monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path / "a"))
        answer.update(fused=1.0, torch=2.0)
        got = invariant.decide(model)
        assert got["attention"] == "fused" and got["ms"] == answer and fused.enabled()
        assert timed == [(4, 2, 16)]
        fused.KERNEL.decision = None                      # another process on this machine: from the cache
        answer.update(fused=9.0)
        assert invariant.decide(model)["attention"] == "fused" and len(timed) == 1
        monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path / "b"))   # a machine where torch ops win
        fused.KERNEL.decision = None
        assert invariant.decide(model)["attention"] == "torch" and not fused.enabled() and len(timed) == 2
        for env, kind in (("0", "torch"), ("1", "fused")):
            monkeypatch.setenv("HD_FUSED_ATTENTION", env)
            fused.KERNEL.decision = None
            assert invariant.decide(model)["attention"] == kind and fused.enabled() == (kind == "fused")
        assert len(timed) == 2
    finally:
        fused.KERNEL.use(was)
    ms = real(4, 2, 16, rounds=1, calls=1)   # the real timing runs and times both
    assert set(ms) == {"fused", "torch"} and min(ms.values()) > 0
    calls, attend = [], invariant.attend_kv   # rounds stop early only once one path is clearly faster
    monkeypatch.setattr(invariant, "attend_kv", lambda *a: calls.append(1) or attend(*a))
    real(4, 2, 16, rounds=5, calls=1, clear=1.0, least_rounds=2)
    assert len(calls) == 2 * 3
    calls.clear()
    real(4, 2, 16, rounds=5, calls=1, clear=float("inf"), least_rounds=2)
    assert len(calls) == 5 * 3


@pytest.mark.parametrize("name,attention", [("llama", "torch"), ("gemma3", "torch"), ("llama", "fused"),
                                            ("gemma3", "fused")])
def test_prompt_prefill_takes_causal_sdpa_only_for_a_plain_causal_mask(name, attention, tmp_path, monkeypatch):
    """A prompt wider than a verification on an empty cache, in the mode: SDPA is told the mask is
    causal (it skips the keys above the diagonal) in full-attention layers, and with the fused
    attention on, that attention takes the whole prompt instead. Gemma 3's sliding window layer
    keeps its mask. Logits stay within rounding of a masked SDPA's, and speculative greedy output
    equals plain after such a prompt."""
    from hdcli.engine.kernels import fused
    if attention == "fused" and fused.load(quiet=True) is None:
        pytest.skip(f"the fused attention does not compile here: {fused.failure()}")
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    with invariant.pinned(attention):
        _prompt_prefill(name, attention, monkeypatch)


def _prompt_prefill(name, attention, monkeypatch):
    model = build(name, torch.float32, "torch")
    calibrate.enable(model)
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: seen.append(bool(k.get("is_causal"))) or real(*a, **k))
    rng = random.Random(3)
    prompt = [rng.randrange(3, V) for _ in range(invariant.MAX_ROWS + 20)]
    with torch.inference_mode():
        fast = model.forward(torch.tensor([prompt]))
        causal_calls, seen[:] = list(seen), []

        def masked_sdpa(q, k, v, scaling):   # the same attention given its causal mask
            vis = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
            return real(q, k, v, attn_mask=vis, scale=scaling, enable_gqa=k.shape[1] != q.shape[1]).transpose(1, 2)
        monkeypatch.setattr(invariant, "causal_prompt_sdpa", masked_sdpa)
        masked = model.forward(torch.tensor([prompt]))
    # llama: both layers causal; gemma3: the sliding window layer keeps its mask; the fused
    # attention calls no SDPA
    expect = [] if attention == "fused" else [True, True] if name == "llama" else [False, True]
    assert causal_calls == expect
    assert torch.allclose(fast, masked, atol=1e-4)
    monkeypatch.undo()
    ref = Decoder(model, eos_ids=()).generate(prompt, max_new_tokens=30).tokens
    oracle = Oracle(ref, len(prompt), k=8, corrupt=0.25, branches=3, vocab=V, seed=1)
    assert Decoder(model, eos_ids=(), drafter=oracle).generate(prompt, max_new_tokens=30).tokens == ref
    calibrate.disable(model)
