"""hd's own forward (hdcli/engine/model/) from transformers checkpoints (model/checkpoint.py):
folders saved by save_pretrained run on the forward a GGUF of the same model runs on.

  * tiny random llama (a llama3-scaled rope, tied embeddings), mistral (a sliding window in every
    layer), qwen2 (q/k/v biases), qwen3 (per-head q/k norms) and gemma3 (sliding and full
    layers, its norms, query_pre_attn_scalar) with every norm and bias randomised: logits close
    to transformers' forward in fp32, and greedy tokens equal to transformers' generate;
  * speculative greedy output (oracle drafts, trees) equals plain decoding on them, in bf16 in
    the M-invariant mode;
  * M-invariance in bf16: every verified row torch.equal to its one-token row; the same check
    with the mode off (fp32, torch's kernels, SDPA) finds rows that differ: the check can fail;
  * other architectures (a tiny GPT-2) run on transformers' forward with the mode off, said in
    one line; `--invariant on` refuses them;
  * a bf16 checkpoint loads in about its own size (never a wider copy of the model).
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from hdcli.engine.kernels import dense as kernels
from hdcli.engine import loader
from hdcli.engine.decode.loop import Decoder
from hdcli.errors import HdError

from conftest import VOCAB, load_growth, owned_copy, save_with_tokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_check import Oracle  # noqa: E402
from gpu_owned_check import rows_equal  # noqa: E402


def _randomised(model, scale: float = 4.0):
    """Norm weights and biases away from their initial ones and zeros (a +1 or a dropped bias
    shows), and a sharper head."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
        model.get_output_embeddings().weight.mul_(scale)
    return model.float().eval()


def tiny(family: str):
    """A random 2-layer transformers model of `family`, head_dim 16."""
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=True))
    elif family == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, head_dim=16, sliding_window=8))
    elif family == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=16))
    else:
        cfg = tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=8,
                                  layer_types=["sliding_attention", "full_attention"])
        model = tf.Gemma3ForCausalLM(cfg)
    return _randomised(model, scale=1.0 if family == "llama" else 4.0)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> its tiny model saved as a checkpoint folder."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {f: save_with_tokenizer(tiny(f), root / f) for f in FAMILIES}


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, VOCAB) for _ in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_owned_forward_matches_transformers(folders, family):
    """fp32, torch's kernels: logits close to transformers' forward past the sliding window,
    greedy tokens equal to transformers' generate."""
    ref = loader.load_reference(str(folders[family]), "fp32", "cpu")
    own = loader.load(str(folders[family]), dtype="fp32", device="cpu", kernels="torch", invariant="off", quiet=True)
    assert own.info["forward"] == f"hd ({'gemma3' if family == 'gemma3' else 'llama'})"
    assert own.info["numerics"]["kernels"] == "torch" and own.info["file_types"] == {"F32": own.info["file_types"]["F32"]}
    ids = torch.tensor([_prompt(1, 40)])
    with torch.inference_mode():
        a = ref.model.forward(ids)
        b = own.model.forward(ids)
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), float((a - b).abs().max())
    with torch.inference_mode():
        want = ref.model.module.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
    got = Decoder(own.model, ()).generate(ids[0].tolist(), max_new_tokens=24)
    assert got.tokens == want[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_bf16_weights_load_as_transformers_casts_them(tmp_path, family):
    """A bf16 checkpoint in bf16: the same weights transformers holds (each tensor as the file has
    it), logits within bf16 rounding of transformers' forward."""
    folder = save_with_tokenizer(tiny(family).to(torch.bfloat16), tmp_path / family)
    ref = loader.load_reference(str(folder), "bf16", "cpu")
    own = loader.load(str(folder), dtype="bf16", device="cpu", kernels="torch", invariant="off", quiet=True)
    assert set(own.info["file_types"]) == {"BF16"}
    blk, layer = own.model.blocks[1], ref.model.module.model.layers[1]
    assert torch.equal(blk.q.kernel.weight, layer.self_attn.q_proj.weight)
    assert torch.equal(blk.attn_norm, layer.input_layernorm.weight)
    ids = torch.tensor([_prompt(2, 20)])
    with torch.inference_mode():
        a, b = ref.model.forward(ids).float(), own.model.forward(ids).float()
    assert torch.allclose(a, b, atol=0.1, rtol=0.05), float((a - b).abs().max())


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_bf16_rows_are_m_invariant_and_speculative_equals_plain(folders, family):
    """bf16 with oneDNN-packed layers (auto here), M-invariant: every chain and tree row
    torch.equal to its one-token row (past the window), and speculative greedy output equals
    plain decoding token for token."""
    lm = loader.load(str(folders[family]), dtype="bf16", device="cpu", invariant="on", quiet=True)
    assert lm.invariant and lm.info["numerics"]["invariant"]
    assert lm.kernels == ("onednn" if kernels.available("bf16") else "torch")
    rows = rows_equal(lm.model, VOCAB)
    assert all(rows), f"{rows.count(False)} of {len(rows)} rows differ"
    for i in range(2):
        prompt = _prompt(10 + i, 20 + 9 * i)
        ref = Decoder(lm.model, ()).generate(prompt, max_new_tokens=40).tokens
        oracle = Oracle(ref, len(prompt), k=8, corrupt=0.25, branches=3, vocab=VOCAB, seed=i)
        got = Decoder(lm.model, (), drafter=oracle).generate(prompt, max_new_tokens=40)
        assert got.tokens == ref
        assert max(got.stats.tree_sizes) > 4


def test_the_check_fails_with_the_mode_off(folders):
    """Negative control: the same per-row check, fp32 rows of torch's GEMM (whose kernel depends
    on M) and SDPA over the cache, finds rows that differ."""
    lm = loader.load(str(folders["llama"]), dtype="fp32", device="cpu", kernels="torch", invariant="off", quiet=True)
    assert not lm.model.numerics.invariant
    assert not all(rows_equal(lm.model, VOCAB))


def test_kernels_for_a_checkpoint(folders):
    """gguf multiplies a GGUF's blocks: a checkpoint refuses it in one line; int4 is its alias."""
    for k in ("gguf", "int4"):
        with pytest.raises(HdError, match="--kernels gguf multiplies a GGUF"):
            loader.load(str(folders["llama"]), dtype="fp32", kernels=k, invariant="off", quiet=True)
    with pytest.raises(HdError, match="--kernels must be one of"):
        loader.load(str(folders["llama"]), kernels="fast")
    with pytest.raises(HdError, match="--dtype fp16"):
        loader.load(str(folders["llama"]), dtype="fp16", invariant="off", quiet=True)


def test_other_architectures_run_on_transformers_forward(tmp_path, capfd):
    """A tiny GPT-2: transformers' stock forward, the mode off, said in one line on stderr;
    --invariant on and --kernels gguf are one-line errors."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    folder = save_with_tokenizer(GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2,
                                                            n_positions=128)), tmp_path / "gpt2")
    capfd.readouterr()
    lm = loader.load(str(folder), dtype="auto", device="cpu", quiet=True)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "transformers' forward, M-invariant mode off" in lines[0], err
    assert "model_type gpt2" in lines[0]
    assert lm.info["forward"] == "transformers" and not lm.invariant and lm.dtype == "fp32"
    got = Decoder(lm.model, ()).generate([5, 6, 7], max_new_tokens=5)
    assert len(got.tokens) == 5
    with pytest.raises(HdError, match="--invariant on: .* transformers' forward"):
        loader.load(str(folder), device="cpu", invariant="on", quiet=True)
    with pytest.raises(HdError, match="--kernels gguf: .* transformers' forward"):
        loader.load(str(folder), device="cpu", kernels="int4", quiet=True)


def test_a_checkpoint_hd_cannot_compute_goes_to_transformers(tmp_path, capfd):
    """A llama with an o_proj bias (attention_bias): hd's forward would drop it, so transformers'
    forward runs it, and the line says why."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, attention_bias=True)
    folder = save_with_tokenizer(LlamaForCausalLM(cfg), tmp_path / "biased")
    capfd.readouterr()
    lm = loader.load(str(folder), device="cpu", quiet=True)
    assert lm.info["forward"] == "transformers"
    assert "o_proj.bias" in capfd.readouterr().err


def test_a_bf16_checkpoint_loads_in_about_its_size(tmp_path):
    """Peak memory of loading a ~60 MB bf16 checkpoint in bf16 and running a forward, in a fresh
    process, stays near the file's size: the file is mapped, each tensor copied once in its own
    dtype (an fp32 copy of the model would add 2x the file)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816, num_hidden_layers=3,
                      num_attention_heads=16, num_key_value_heads=4)
    folder = save_with_tokenizer(LlamaForCausalLM(cfg).to(torch.bfloat16), tmp_path / "bf16")
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    grew = load_growth(folder, tmp_path)
    assert grew < 1.5 * size + 100e6, (grew, size)


def test_owned_copy_helper_is_the_checkpoint_path(tmp_path):
    """conftest.owned_copy (the other engine tests' way to a model on hd's forward) loads a
    transformers model through the checkpoint path."""
    lm = owned_copy(tiny("qwen3"), tmp_path / "q3")
    assert lm.info["forward"] == "hd (llama)" and lm.model.blocks[0].q_norm is not None


def test_a_hub_id_runs_from_the_local_hub_cache(folders, tmp_path, monkeypatch):
    """A hub id resolves, offline, to its snapshot in the local Hugging Face cache and runs on hd's
    forward from there; an id the cache does not have is one line."""
    import shutil
    import huggingface_hub.constants as hub
    repo = tmp_path / "hub" / "models--hd-test--tiny-qwen2"
    shutil.copytree(folders["qwen2"], repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm = loader.load("hd-test/tiny-qwen2", dtype="fp32", device="cpu", kernels="torch", invariant="off", quiet=True)
    assert lm.info["forward"] == "hd (llama)" and lm.source == "hd-test/tiny-qwen2"
    assert lm.model.blocks[0].q.kernel.bias is not None   # qwen2's q/k/v biases, read
    with pytest.raises(HdError, match="is unreachable and its cache does not have it"):
        loader.load("hd-test/not-there", device="cpu", quiet=True)
