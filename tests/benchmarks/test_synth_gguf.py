"""benchmarks/synth_gguf.py: GGUF files of published shapes with random weights in valid blocks.

Tiny files are written once (mix "all", every type, its vocabulary padded past the bundled
tokenizer's; and mixes Q4_K_M, Q5_K_M, IQ4_XS) and read back with gguf-py's GGUFReader: every tensor in the plan's
order, type and ggml shape, its blocks dequantize to finite weights of std about 1/sqrt(K), norms
ones, the metadata llama.cpp reads; transformers builds the tokenizer from the file. The plans of
the published shapes are checked without writing them (llama.cpp's Q4_K_M rules, file sizes)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import synth_gguf as sg  # noqa: E402
from conftest import PATIENCE, require_bundled  # noqa: E402

pytestmark = pytest.mark.bundled
EXTRA = 40   # dummy tokens past the bundled vocabulary in the "all" file


@pytest.fixture(scope="module", autouse=True)
def _needs_tokenizer_source():
    require_bundled()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    padded = dict(sg.SHAPES["tiny"], vocab=sg.SHAPES["tiny"]["vocab"] + EXTRA, name="tiny-padded")
    out = {}
    for key, shape, mix in (("all", padded, "all"), ("Q4_K_M", "tiny", "Q4_K_M"), ("Q5_K_M", "tiny", "Q5_K_M"),
                            ("IQ4_XS", "tiny", "IQ4_XS")):
        res = sg.write(d / f"tiny_{key}.gguf", shape, mix, seed=1)
        out[key] = (res, shape, mix)
    return out


@pytest.mark.parametrize("key", ["all", "Q4_K_M", "Q5_K_M", "IQ4_XS"])
def test_read_back(files, key):
    res, shape, mix = files[key]
    s = sg._shape(shape)
    path = Path(res["path"])
    assert res["bytes"] == path.stat().st_size > sg.predicted_bytes(shape, mix)
    r = gguf.GGUFReader(str(path))
    plan = sg.plan(shape, mix)
    assert [t.name for t in r.tensors] == [n for n, _, _ in plan]
    counts: dict = {}
    for t, (name, shp, ty) in zip(r.tensors, plan):
        assert t.tensor_type.name == ty, name
        assert list(t.shape) == list(reversed(shp)), name      # ggml order [K, N]
        assert t.data_offset % 32 == 0, name
        counts[ty] = counts.get(ty, 0) + 1
        x = gguf.quants.dequantize(t.data, t.tensor_type)
        assert x.shape == shp and np.isfinite(x).all(), name
        if len(shp) == 1:
            assert (x == 1).all(), name
        else:
            std = float(x.std()) * math.sqrt(shp[1])
            assert 0.7 < std < 1.5, (name, ty, std)
    assert counts == res["types"]
    if mix == "all":
        assert set(counts) == set(sg.ALL_CYCLE)
    elif mix == "IQ4_XS":
        assert counts == {"F32": 5, "IQ4_XS": 15, "Q6_K": 1}
    else:   # tiny: 2 layers, not tied; use_more_bits(i, 2): i >= 7*2//8 = 1 -> layer 1
        assert counts == {"F32": 5, mix[:4]: 13, "Q6_K": 3}
        assert {t.name for t in r.tensors if t.tensor_type.name == "Q6_K"} == {
            "output.weight", "blk.1.attn_v.weight", "blk.1.ffn_down.weight"}

    f = {k: v.contents() for k, v in r.fields.items()
         if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")}
    assert f["general.architecture"] == "llama"
    assert f["llama.block_count"] == s["layers"]
    assert f["llama.context_length"] == s["ctx"]
    assert f["llama.embedding_length"] == s["hidden"]
    assert f["llama.feed_forward_length"] == s["ff"]
    assert f["llama.attention.head_count"] == s["heads"]
    assert f["llama.attention.head_count_kv"] == s["kv_heads"]
    assert f["llama.rope.dimension_count"] == s["head_dim"]
    assert f["llama.rope.freq_base"] == pytest.approx(s["rope_theta"])
    assert f["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert f["llama.vocab_size"] == s["vocab"]
    assert f["general.file_type"] == int(sg.MIXES[mix]["ftype"])
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.eos_token_id"] == 2
    assert "tokenizer.chat_template" in f
    tokens = r.fields["tokenizer.ggml.tokens"]
    types = r.fields["tokenizer.ggml.token_type"]
    assert len(tokens.data) == len(types.data) == s["vocab"]
    src = {k: v for k, v, _, _ in sg.tokenizer_fields()}
    n = len(src["tokenizer.ggml.tokens"])
    if s["vocab"] > n:
        assert tokens.contents(n) == "<|extra_0|>"
        assert tokens.contents(s["vocab"] - 1) == f"<|extra_{EXTRA - 1}|>"
        assert types.contents(n) == int(gguf.TokenType.NORMAL)
    assert tokens.contents(0) == src["tokenizer.ggml.tokens"][0]
    assert len(r.fields["tokenizer.ggml.merges"].data) == len(src["tokenizer.ggml.merges"])


def test_transformers_tokenizer(files):
    """transformers builds the tokenizer from the padded file (dummy tokens included)."""
    from transformers import AutoTokenizer
    res, shape, _ = files["all"]
    p = Path(res["path"])
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    assert len(tok) == shape["vocab"]
    ids = tok("Hello world")["input_ids"]
    assert tok.decode(ids) == "Hello world"


def test_plans_of_published_shapes():
    """llama.cpp's Q4_K_M rules on the real shapes, and file sizes as published (no file written)."""
    plan = {n: t for n, _, t in sg.plan("llama-3.1-8b", "Q4_K_M")}
    n = 32
    more = [i for i in range(n) if i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    for i in range(n):
        want = "Q6_K" if i in more else "Q4_K"
        assert plan[f"blk.{i}.attn_v.weight"] == plan[f"blk.{i}.ffn_down.weight"] == want
        assert plan[f"blk.{i}.attn_q.weight"] == plan[f"blk.{i}.ffn_up.weight"] == "Q4_K"
    assert plan["token_embd.weight"] == "Q4_K" and plan["output.weight"] == "Q6_K"
    tied = {n: t for n, _, t in sg.plan("llama-3.2-3b", "Q4_K_M")}
    assert "output.weight" not in tied and tied["token_embd.weight"] == "Q6_K"   # quantized as the output
    # hidden 960 is no multiple of 256: llama.cpp's fallbacks, as in the published files
    small = {t for _, _, t in sg.plan("smollm2-360m", "Q4_K_M")}
    assert small == {"Q5_0", "Q8_0", "Q4_K", "Q6_K", "F32"}
    for mix in ("Q4_0", "Q8_0"):
        assert {t for _, _, t in sg.plan("llama-3.1-8b", mix)} == {mix, "F32"}
    # Hub GGUF sizes (GB): Llama-3.1-8B Q4_K_M 4.92, Q8_0 8.54; Llama-3.2-3B Q4_K_M 2.02;
    # SmolLM2-1.7B Q4_K_M 1.06 (tensor data is all but the few MB of the header)
    for shape, mix, gb in (("llama-3.1-8b", "Q4_K_M", 4.92), ("llama-3.1-8b", "Q8_0", 8.54),
                           ("llama-3.2-3b", "Q4_K_M", 2.02), ("smollm2-1.7b", "Q4_K_M", 1.06)):
        assert abs(sg.predicted_bytes(shape, mix) / 1e9 - gb) < 0.02, (shape, mix)
    for name, s in sg.SHAPES.items():
        assert s["heads"] * s["head_dim"] == s["hidden"] and s["heads"] % s["kv_heads"] == 0, name


def test_streams_in_chunks(tmp_path, monkeypatch):
    """Data go out in chunks of about _CHUNK_BYTES, never a whole tensor (the 8B file on a small
    machine): with 64 KB chunks no random_rows call makes more than a chunk's worth."""
    monkeypatch.setattr(sg, "_CHUNK_BYTES", 64 << 10)
    sizes = []
    orig = sg.random_rows

    def spy(rng, t, rows, k):
        out = orig(rng, t, rows, k)
        sizes.append(out.nbytes)
        return out

    monkeypatch.setattr(sg, "random_rows", spy)
    res = sg.write(tmp_path / "x.gguf", "tiny", "Q8_0")
    assert max(sizes) <= 64 << 10 and len(sizes) > 100
    assert sum(sizes) == sg.predicted_bytes("tiny", "Q8_0") - 5 * 4 * 256   # all but the norms
    assert res["bytes"] > sum(sizes)


def test_cli(tmp_path):
    out = tmp_path / "c.gguf"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "synth_gguf.py"), "--shape", "tiny",
                        "--mix", "Q4_0", "-o", str(out), "--json"],
                       capture_output=True, text=True, timeout=PATIENCE, check=True)
    res = json.loads(p.stdout)
    assert res["path"] == str(out) and res["bytes"] == out.stat().st_size
    assert res["types"] == {"Q4_0": 16, "F32": 5}
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("[synth_gguf]")]
    assert any(" blk.1 " in ln for ln in lines) and "wrote" in lines[-1]   # progress, not a tty
