"""hd's reading of every GGUF type checked against llama.cpp itself (llama-cpp-python, the
`[llama-cpp]` extra; skipped where it is not installed, CI installs it).

  * Dequantization: llama.cpp rewrites a file holding every type hd reads (synth_gguf's "all" mix:
    Q2_K, Q3_K, IQ4_NL, IQ4_XS among them) as F32 with its own C routines; hd's dequantization of
    each tensor equals that file's tensor bit for bit. Control: a tensor set against another of
    the same type and shape differs.
  * Logits: the bundled model re-quantized by llama.cpp to the mixes of real downloads (Q2_K, whose
    tensors here are Q3_K and Q4_0, IQ4_XS with IQ4_NL, Q5_K_M): hd's fp32 forward (the file's exact weights) and llama.cpp's on the
    same file agree on the top token at every prompt position but one, and their logits are as
    close as on the bundled Q4_1 file. Not bit-equal, nor the same greedy tokens throughout:
    llama.cpp multiplies quantized weights by activations it rounds to 8 bits (q8_0/q8_K), hd by
    the activations themselves; on an F16 file, where llama.cpp does not round them so, the two
    are 20x closer (printed).
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hdcli.bench import llamacpp
from hdcli.engine import loader
from hdcli.engine.model.gguf import GGUFFile
from hdcli.engine.model.parts import dequantize

from conftest import require_bundled

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (pip install -e '.[llama-cpp]') is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import synth_gguf  # noqa: E402

PROMPT = "The capital of France is Paris. The capital of Italy is"


def llama_quantize(src: Path, out: Path, ftype: str) -> Path:
    """llama.cpp's own quantizer (llama-quantize's library call) on src, requantizing allowed."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{ftype}")
    params.allow_requantize = True
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) == 0
    return out


def tensor_f32(gf: GGUFFile, name: str) -> torch.Tensor:
    qtype, raw, shape = gf.raw(name)
    n, k = shape if len(shape) == 2 else (1, shape[-1])
    return dequantize(qtype, raw.reshape(n, -1), n, k, torch.float32)


def test_every_type_dequantizes_as_llama_cpp_does(tmp_path):
    require_bundled()   # synth_gguf copies the bundled tokenizer
    src = tmp_path / "all.gguf"
    synth_gguf.write(src, "tiny", "all", seed=2)
    ours = GGUFFile(src)
    theirs = GGUFFile(llama_quantize(src, tmp_path / "all-f32.gguf", "ALL_F32"))
    assert set(theirs.type_counts()) == {"F32"}
    seen = {}
    for name in ours.tensors:
        qtype = ours.qtype(name)
        a, b = tensor_f32(ours, name), tensor_f32(theirs, name)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (name, qtype)
        seen.setdefault((qtype, a.shape), []).append(name)
    assert {t for t, _ in seen} >= {"Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q8_0"}
    pairs = [names for names in seen.values() if len(names) > 1]
    assert pairs, "a control needs two tensors of one type and shape"
    assert not torch.equal(tensor_f32(ours, pairs[0][0]), tensor_f32(theirs, pairs[0][1]))   # the control


def _logits_both(path: Path) -> tuple[np.ndarray, np.ndarray]:
    lm = loader.load(str(path), dtype="fp32", device="cpu", kernels="torch", invariant="off", quiet=True)
    ids = lm.tokenizer(PROMPT).input_ids
    with torch.inference_mode():
        ours = lm.model.forward(torch.tensor([ids])).float().numpy().reshape(len(ids), -1)
    llm = llamacpp.open_model(path, n_ctx=256, n_threads=1, logits_all=True, verbose=False)   # bit-equal on 2
    try:
        llm.eval(ids)
        theirs = np.array(llm.scores[:len(ids)], dtype=np.float32)
    finally:
        llm.close()
    return ours, theirs


@pytest.mark.bundled
def test_the_types_of_real_downloads_give_llama_cpps_logits(tmp_path):
    require_bundled()
    bundled = Path(loader.resolve("smollm2-135m")[1])
    base_ours, base_theirs = _logits_both(bundled)                   # Q4_1, the type hd has owned longest
    base = float(np.abs(base_ours - base_theirs).max())
    f16_ours, f16_theirs = _logits_both(llama_quantize(bundled, tmp_path / "f16.gguf", "MOSTLY_F16"))
    f16 = float(np.abs(f16_ours - f16_theirs).max())
    print(f"max |logit difference| against llama.cpp: Q4_1 {base:.3f}, F16 {f16:.3f}")
    assert f16 < base / 5   # llama.cpp's 8-bit activations make the difference, not the weights
    # llama.cpp's Q2_K mix of this model holds Q3_K (and Q4_0 where a row of 576 does not take a
    # K-quant), no Q2_K: the test above covers Q2_K's weights
    for mix, types in (("Q2_K", {"Q3_K"}), ("IQ4_XS", {"IQ4_XS", "IQ4_NL"}), ("Q5_K_M", {"Q5_K", "Q6_K"})):
        path = llama_quantize(bundled, tmp_path / f"{mix}.gguf", f"MOSTLY_{mix}")
        assert set(GGUFFile(path).type_counts()) >= types, mix   # (a row of 576 falls back to other types)
        ours, theirs = _logits_both(path)
        diff = float(np.abs(ours - theirs).max())
        agree = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
        print(f"{mix}: max |logit difference| {diff:.3f}, top token agrees at {agree:.0%} of {len(ours)} positions")
        assert agree >= 1 - 1.5 / len(ours), mix
        assert diff < 3 * base, mix
