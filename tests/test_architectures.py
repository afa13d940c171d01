"""Every architecture hd owns a forward for, checked against llama.cpp itself on the files users make.

A tiny random transformers model of each architecture (llama, mistral, qwen2, qwen3, phi3, gemma3, olmo2,
granite (its four multipliers away from 1);
2 layers, the bundled SmolLM2 tokenizer, the head scaled so the top token leads by a clear margin)
is converted by llama.cpp's own convert_hf_to_gguf.py (from the llama-cpp-python sdist:
benchmarks/llama_cpp_convert.py) to F32 and F16, and quantized by llama.cpp to Q8_0. On each file:
  * F32: hd's greedy tokens equal llama.cpp's (its KV cache in fp32: its default f16 cache rounds
    keys and values, and a tiny random model's near-ties then part) and transformers' on the
    original model; hd's logits are within 1e-4 relative of transformers' and 1e-2 of llama.cpp's.
  * F16 and Q8_0: hd runs the file's exact weights; its top token agrees with llama.cpp's at every
    prompt position (F16), at three in four or more (Q8_0: llama.cpp multiplies its weights by
    activations it rounds to 8 bits, so the logits are close, not equal; 11 of 13 for qwen3).
Skipped with the reason where llama-cpp-python or its sdist is absent (.ci/run installs both).

Every conversion of the module runs in one converter process (the `files` fixture, convert_many:
the same files, byte for byte, as a process per conversion, which spent ~5 s of each ~6 s on its
imports), and llama.cpp runs on one thread (its logits are bit-equal on one and two; on a tiny
model two threads wait on each other, and on a loaded 2-core machine most of the time).

Notes on the harness (the converter itself is not changed): qwen2's tokenizer is read by
transformers as Qwen2's (config.json's model_type), whose pre-tokenizer hash the converter does
not know, so the converter is told it is "smollm" (what the files say); phi3's converter takes a
GPT-2 tokenizer where tokenizer_config.json says GPT2Tokenizer (as Phi-4-mini's does), and
llama.cpp looks up Phi-3's </s>, <unk>, <s> by name, so they are added.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hdcli.bench import llamacpp
from hdcli.engine import loader
from hdcli.engine.decode.loop import Decoder

from conftest import require_bundled

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (pip install -e '.[llama-cpp]') is not installed")
tf = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import llama_cpp_convert  # noqa: E402

pytestmark = pytest.mark.bundled
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "olmo2", "granite"]
NO_GGUF_CONFIG = {"olmo2", "granite"}   # architectures whose GGUF config transformers does not read
IDS = [19556, 216, 905, 216, 33, 34, 35, 1000, 2000, 77, 1451, 28, 4]
NEW = 16


@pytest.fixture(scope="module")
def converter():
    folder = llama_cpp_convert.converter()
    if folder is None:
        pytest.skip("llama.cpp's converter is not here: put the llama-cpp-python sdist in .venv/sdist/ "
                    "(pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36) or set HD_LLAMA_CPP_SDIST")
    pytest.importorskip("sentencepiece", reason="llama.cpp's converter needs sentencepiece (the test extra)")
    return folder


@pytest.fixture(scope="module")
def tokenizer():
    require_bundled()
    return loader.load_tokenizer("smollm2-135m")


def _config(arch: str, vocab: int, tok):
    base = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2,
                tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return {"llama": lambda: tf.LlamaConfig(**base),
            "mistral": lambda: tf.MistralConfig(**base, sliding_window=None),
            "qwen2": lambda: tf.Qwen2Config(**base),
            "qwen3": lambda: tf.Qwen3Config(**base, head_dim=16),
            "phi3": lambda: tf.Phi3Config(**base, pad_token_id=0),
            "gemma3": lambda: tf.Gemma3TextConfig(**base, head_dim=16, sliding_window=64, query_pre_attn_scalar=16),
            "olmo2": lambda: tf.Olmo2Config(**base),
            "granite": lambda: tf.GraniteConfig(**base, embedding_multiplier=6.0, residual_multiplier=0.5,
                                                attention_multiplier=0.1, logits_scaling=4.0)}[arch]()


def tiny_model(arch: str, folder: Path, tokenizer) -> Path:
    """A random 2-layer model of `arch` saved with the bundled tokenizer; its head scaled x10 so
    the top token leads by a margin larger than the forwards' rounding differences."""
    import copy
    tok = copy.deepcopy(tokenizer)
    if arch == "phi3":
        tok.add_tokens(["</s>", "<unk>", "<s>"], special_tokens=True)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_config(arch, len(tok), tok))
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    if arch == "phi3":
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg["tokenizer_class"] = "GPT2Tokenizer"
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def _pre(arch: str) -> str | None:
    return "smollm" if arch == "qwen2" else None


@pytest.fixture(scope="module")
def files(converter, tokenizer, tmp_path_factory):
    """arch -> (its tiny model's folder, {"f32": path, "f16": path}): every conversion of the
    module by llama.cpp's converter in one process (convert_many: the converter run on each as
    on its own; a fresh process a conversion would add ~5 s of imports to each of 16). A model
    the converter fails on holds the RuntimeError convert() raises, raised by its own test."""
    root = tmp_path_factory.mktemp("archs")
    folders = {arch: tiny_model(arch, root / f"tiny-{arch}", tokenizer) for arch in ARCHS}
    jobs = [(folders[arch], root / f"{arch}-{t}.gguf", t, _pre(arch)) for arch in ARCHS for t in ("f32", "f16")]
    got = iter(llama_cpp_convert.convert_many(jobs))
    return {arch: (folders[arch], {t: next(got) for t in ("f32", "f16")}) for arch in ARCHS}


def _file(files, arch: str, outtype: str = "f32") -> tuple[Path, Path]:
    """(the tiny model's folder, its GGUF of outtype), raising the converter's failure on it."""
    hf_dir, paths = files[arch]
    if isinstance(paths[outtype], Exception):
        raise paths[outtype]
    return hf_dir, paths[outtype]


def llama_cpp_run(path: Path, n: int) -> tuple[np.ndarray, list[int]]:
    """llama.cpp's prompt logits and n greedy tokens on the file, its KV cache in fp32."""
    f32 = llama_cpp.GGML_TYPE_F32
    llm = llamacpp.open_model(path, n_ctx=256, n_threads=1, logits_all=True, verbose=False, type_k=f32, type_v=f32)
    try:
        llm.eval(IDS)
        logits = np.array(llm.scores[:len(IDS)], dtype=np.float32)
        out = []
        for t in llm.generate(IDS, temp=0.0, top_k=1, reset=True):
            out.append(int(t))
            if len(out) == n:
                break
    finally:
        llm.close()
    return logits, out


def hd_run(path: Path, n: int, arch: str) -> tuple[np.ndarray, list[int]]:
    lm = loader.load(str(path), dtype="fp32", device="cpu", kernels="torch", invariant="off", quiet=True)
    assert lm.info["forward"] == f"hd ({'gemma3' if arch == 'gemma3' else 'llama'})"
    with torch.inference_mode():
        logits = lm.model.forward(torch.tensor([IDS])).float().numpy()
    return logits, Decoder(lm.model, ()).generate(IDS, max_new_tokens=n).tokens


def same_tokenizer(path: Path, original: Path) -> None:
    """The tokenizer hd builds from a GGUF (gguf.built_tokenizer: the class picked by the file's
    model_type) is the one AutoTokenizer builds: class, vocabulary, special tokens, encoding,
    decoding, chat template. transformers reads no olmo2 or granite GGUF (no GGUF config for them):
    there the reference is the model's own tokenizer (`original`), compared by vocabulary and
    encoding."""
    from hdcli.engine.model.gguf import GGUFFile, built_tokenizer
    gf = GGUFFile(path)
    ours = built_tokenizer(gf)
    text = "Hello world! <|im_start|>user\nWhat's 2+2?<|im_end|> ünïcödé 日本語"
    if gf.arch in NO_GGUF_CONFIG:
        ref = tf.AutoTokenizer.from_pretrained(str(original))
        assert ours.get_vocab() == ref.get_vocab() and ours.encode(text) == ref.encode(text)
        return
    ref = tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert type(ours) is type(ref) and ours.get_vocab() == ref.get_vocab() and len(ours) == len(ref)
    assert ours.all_special_ids == ref.all_special_ids and ours.chat_template == ref.chat_template
    assert [ours.bos_token_id, ours.eos_token_id, ours.pad_token_id] == [ref.bos_token_id, ref.eos_token_id, ref.pad_token_id]
    assert ours.encode(text) == ref.encode(text) and ours.decode(ours.encode(text)) == ref.decode(ref.encode(text))


@pytest.mark.parametrize("arch", ARCHS)
def test_hd_gives_llama_cpps_and_transformers_tokens(arch, files, tmp_path):
    hf_dir, f32 = _file(files, arch, "f32")
    same_tokenizer(f32, hf_dir)
    ours, got = hd_run(f32, NEW, arch)
    theirs, want = llama_cpp_run(f32, NEW)
    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref_logits = model(torch.tensor([IDS])).logits[0].numpy()
        ref = model.generate(torch.tensor([IDS]), attention_mask=torch.ones(1, len(IDS), dtype=torch.long),
                             max_new_tokens=NEW, do_sample=False)[0, len(IDS):].tolist()
    scale = float(np.abs(ref_logits).max())
    assert float(np.abs(ours - ref_logits).max()) <= 1e-4 * scale, arch
    assert float(np.abs(ours - theirs).max()) <= 1e-2 * scale, arch
    assert got == want == ref, (arch, got, want, ref)

    _, f16 = _file(files, arch, "f16")
    q8 = llama_cpp_convert.quantize(f16, tmp_path / "q8_0.gguf", "MOSTLY_Q8_0")
    for path in (f16, q8):
        ours, _ = hd_run(path, 1, arch)
        theirs, _ = llama_cpp_run(path, 1)
        agree = int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        assert agree >= (len(IDS) if path is f16 else 0.75 * len(IDS)), (arch, path.name, agree)


def test_the_token_check_can_fail(files, monkeypatch):
    """Negative control: a forward that reads a llama file's q and k rows as halves (Qwen's rope
    layout) instead of llama.cpp's interleaved pairs is caught: its tokens part from llama.cpp's."""
    from hdcli.engine.model import gguf
    _, path = _file(files, "llama")
    _, theirs = llama_cpp_run(path, NEW)
    assert hd_run(path, NEW, "llama")[1] == theirs
    monkeypatch.setattr(gguf, "INTERLEAVED_ROPE", gguf.INTERLEAVED_ROPE - {"llama"})
    assert hd_run(path, NEW, "llama")[1] != theirs


def test_granite_without_its_multipliers_is_caught(files, monkeypatch):
    """Negative control for Granite: hd's forward ignoring the residual multiplier parts from
    llama.cpp's tokens; ignoring the embedding multiplier, from its logits."""
    from hdcli.engine.model import llama
    _, path = _file(files, "granite")
    theirs, want = llama_cpp_run(path, NEW)
    ours, got = hd_run(path, NEW, "granite")
    assert got == want
    with monkeypatch.context() as m:
        m.setattr(llama.Block, "scaled", lambda self, y: y)
        assert hd_run(path, NEW, "granite")[1] != want
    scale = float(np.abs(theirs).max())
    with monkeypatch.context() as m:
        m.setattr(llama.LlamaForward, "embed_rows", lambda self, ids: self.embed(ids))
        assert float(np.abs(hd_run(path, 1, "granite")[0] - theirs).max()) > 1e-2 * scale


@pytest.mark.parametrize("arch", ["phi3", "olmo2", "granite"])
def test_speculative_greedy_equals_plain(arch, files):
    """The forwards new in the llama family (Phi-3's fused q/k/v and gate/up; OLMo 2's norms after
    the sublayers and over the whole q and k; Granite's multipliers) in the M-invariant mode: drafted token trees, a
    quarter of their tokens corrupted, verified in one forward, give plain greedy decoding's
    tokens."""
    import random
    from gpu_check import Oracle
    _, path = _file(files, arch)
    lm = loader.load(str(path), dtype="bf16", device="cpu", invariant="on", quiet=True)
    vocab = lm.model.config.vocab_size
    rng = random.Random(1)
    for i in range(2):
        prompt = [rng.randrange(3, vocab) for _ in range(20 + 9 * i)]
        ref = Decoder(lm.model, ()).generate(prompt, max_new_tokens=32).tokens
        oracle = Oracle(ref, len(prompt), k=8, corrupt=0.25, branches=3, vocab=vocab, seed=i)
        got = Decoder(lm.model, (), drafter=oracle).generate(prompt, max_new_tokens=32)
        assert got.tokens == ref
        assert max(got.stats.tree_sizes) > 4
