"""GGUF-quantized weights (hdcli/engine/kernels/quants.py, csrc/qmm.cpp): dequantization equal bit for bit
to gguf-py's reference for every type read (quants.TYPES: Q4_0 ... Q6_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS; F32/F16/BF16),
the packing of every type the GEMM multiplies (quants.FORMAT) in about the file's bytes (the three
written in another type's format: at most 2.36x) and holding its weights exactly (read back by the
layout, on any CPU), and the GEMM on the blocks (AVX512 only): close to the dequantized product, its
weight matrix the dequantized weights exactly, and each row's result independent of the row count
and of the row's place (the M-invariant forward relies on it), with a control that the check can fail."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hdcli.engine.kernels import quants

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants as gq  # noqa: E402

SMALL = {"Q4_0": (48, 64), "Q4_1": (48, 64), "Q5_0": (48, 64), "Q5_1": (48, 64), "Q8_0": (48, 64), "Q4_K": (48, 512), "Q5_K": (48, 512), "Q6_K": (48, 512),
         "Q3_K": (48, 512), "IQ4_NL": (48, 64), "IQ4_XS": (48, 512), "Q2_K": (48, 512)}
REAL = {"Q4_0": (1536, 576), "Q4_1": (1536, 576), "Q5_0": (1536, 576), "Q5_1": (1536, 576), "Q8_0": (1536, 576), "Q4_K": (512, 1024), "Q5_K": (512, 1024),
        "Q6_K": (512, 1024), "Q3_K": (512, 1024), "IQ4_NL": (1536, 576), "IQ4_XS": (512, 1024), "Q2_K": (512, 1024)}
SHAPES = [(t, s) for t in quants.TYPES for s in ("small", "real")]
KERNEL_TYPES = tuple(quants.FORMAT)                      # the types the GEMM multiplies (Q2_K: dequantized)
KERNEL_SHAPES = [(t, s) for t, s in SHAPES if t in quants.FORMAT]
D_AT = {"Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82)}   # where a block's fp16 d (and dmin) lie; else 0 (and 2)


def shape(t: str, size: str) -> tuple[int, int]:
    return (SMALL if size == "small" else REAL)[t]


def make(t: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF bytes [n, bytes a row] of valid blocks: gguf-py's quantizer where it has one (Q4_0,
    Q4_1, Q8_0), else random bytes with small random fp16 d (and dmin)."""
    rng = np.random.default_rng(seed)
    if t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        w = rng.standard_normal((n, k)) * rng.random((n, 1)) + 0.1 * rng.standard_normal((n, 1))
        return gq.quantize(w.astype(np.float32), T[t])
    size, nbytes = quants.BLOCK[t]
    b = rng.integers(0, 256, (n, k // size, nbytes), dtype=np.uint8)
    d = (rng.standard_normal((n, k // size, 2)) * 1e-2).astype(np.float16).view(np.uint8).reshape(n, k // size, 4)
    at = D_AT.get(t, (0, 2))
    for i, a in enumerate(at):
        b[..., a:a + 2] = d[..., 2 * i:2 * i + 2]
    return b.reshape(n, -1)


def reference(t: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    return gq.dequantize(raw, T[t]).reshape(n, k)


def bits(a) -> np.ndarray:
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


# ------------------------------------------------------------------ dequantization

@pytest.mark.parametrize("t,size", SHAPES)
def test_dequantize_equals_gguf_py_bit_for_bit(t, size):
    n, k = shape(t, size)
    raw = make(t, n, k)
    ref = reference(t, raw, n, k)
    ours = quants.dequantize_f32(t, raw, n, k)
    assert ours.dtype == np.float32 and ours.shape == (n, k)
    assert np.array_equal(bits(ours), bits(ref))
    bf = quants.dequantize(t, raw, n, k)
    assert bf.dtype == torch.bfloat16 and bf.shape == (n, k)
    assert np.array_equal(bits(bf.view(torch.int16)), bits(torch.from_numpy(ref).bfloat16().view(torch.int16)))
    rows = np.array([5, 0, n - 1, 5, 17])
    assert np.array_equal(bits(quants.dequantize_f32(t, raw, n, k, rows=rows)), bits(ref[rows]))
    assert torch.equal(quants.dequantize(t, raw, n, k, rows=rows).view(torch.int16), bf[rows].view(torch.int16))
    codes, scale, low, gk = quants.unpack(t, raw, n, k)
    lo, hi = {"Q4_0": (0, 15), "Q4_1": (0, 15), "Q5_0": (-16, 15), "Q5_1": (0, 31), "Q8_0": (-128, 127), "Q4_K": (0, 15), "Q5_K": (0, 31),
              "Q6_K": (-32, 31), "Q3_K": (-4, 3), "IQ4_NL": (-127, 113), "IQ4_XS": (-127, 113), "Q2_K": (0, 3)}[t]
    assert codes.shape == (n, k) and lo <= codes.min() and codes.max() <= hi
    assert scale.shape == (n, k // gk) and (low is None) == (t in ("Q5_0", "Q8_0", "Q6_K", "Q3_K", "IQ4_NL", "IQ4_XS"))


def test_dequantize_goes_by_chunks(monkeypatch):
    t, (n, k) = "Q6_K", REAL["Q6_K"]
    raw = make(t, n, k, seed=1)
    whole = quants.dequantize(t, raw, n, k)
    monkeypatch.setattr(quants, "CHUNK", 3 * k + 5)     # 3 rows a chunk, a last chunk of fewer
    assert torch.equal(quants.dequantize(t, raw, n, k).view(torch.int16), whole.view(torch.int16))
    assert torch.equal(whole.view(torch.int16), torch.from_numpy(reference(t, raw, n, k)).bfloat16().view(torch.int16))


@pytest.mark.parametrize("t", ["F32", "F16", "BF16"])
def test_float_tensors(t):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((24, 40)).astype(np.float32)
    raw = gq.quantize(w, T[t])    # F32, F16 typed arrays as GGUFReader gives them; BF16 bytes
    ref = gq.dequantize(raw, T[t]).reshape(24, 40)
    assert np.array_equal(bits(quants.dequantize_f32(t, raw, 24, 40)), bits(ref))
    assert torch.equal(quants.dequantize(t, raw, 24, 40), torch.from_numpy(ref).bfloat16())
    assert torch.equal(quants.dequantize(t, raw, 24, 40, rows=[3, 1]), torch.from_numpy(ref[[3, 1]]).bfloat16())


# ------------------------------------------------------------------ packing

# bytes a weight of the file's blocks and the most the packing may take (its share of the file)
FILE_BYTES = {t: nbytes / size for t, (size, nbytes) in quants.BLOCK.items()}
PACKED_OVER_FILE = {"Q4_0": 1.0, "Q4_1": 1.0, "Q8_0": 1.0, "Q4_K": 1.03, "Q6_K": 1.001, "Q5_0": 1.55, "Q5_1": 1.67, "Q5_K": 1.82,
                    # written in another type's format (the module docstring of quants.py says why)
                    "Q3_K": 1.91, "IQ4_NL": 1.89, "IQ4_XS": 2.36}
PACKED8_OVER_FILE = dict(PACKED_OVER_FILE, IQ4_NL=1.0, IQ4_XS=1.02)   # int8 activations: their own 4-bit layouts


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
@pytest.mark.parametrize("t", KERNEL_TYPES)
def test_the_packing_takes_about_the_files_bytes(t, int8):
    """One decode step reads every weight once: the repacked layout costs the file's bytes (the
    K-quants' per-column constants a few percent more), not the 0.75-1.25 bytes a weight of the
    fp32-constant layouts it replaced."""
    if not (quants.GEMM.load() or quants.GEMM.compiled):
        pytest.skip(f"the extension does not build here: {quants.failure()}")
    n, k = REAL[t]
    raw = make(t, n, k)
    packed, fmt = quants.pack(t, raw, n, k, int8=int8)
    assert fmt == (quants.FORMAT8 if int8 else quants.FORMAT)[t]
    assert packed.dtype == torch.uint8 and packed.shape[0] == n // 16
    assert packed.numel() <= (PACKED8_OVER_FILE if int8 else PACKED_OVER_FILE)[t] * FILE_BYTES[t] * n * k


# The packings' layouts as csrc/qmm.cpp's header (mm) and mm8's header (int8) state them:
# W bits a code, GK k a group, GS groups a super-block, HEAD and CONSTS bytes.
LAYOUTS = {"q4z": (4, 32, 1, 0, 32), "q4h": (4, 32, 1, 0, 64), "q4k": (4, 32, 8, 64, 32), "q6k": (6, 16, 16, 32, 16),
           "q8h": (8, 32, 1, 0, 32), "q8f": (8, 32, 1, 0, 128), "q4n": (4, 32, 1, 0, 32), "q4x": (4, 32, 8, 32, 16)}


def _f16s(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.float16).astype(np.float64)


def read_packing(packed: torch.Tensor, fmt: str, n: int, k: int, int8: bool) -> np.ndarray:
    """The weights [n, k] (float64) a packing holds, read back by the layout the kernel's comments
    give: each code at its lane, times its group's scale, plus its low. Independent of the packer's
    code, so it checks the packer on any CPU (the GEMM itself needs AVX512)."""
    w_bits, gk, gs, head_bytes, consts_bytes = LAYOUTS[fmt]
    units = gk // 4 if not int8 else gk // 8
    unit_bytes = ({4: 32, 6: 48, 8: 64} if not int8 else {4: 64, 6: 96, 8: 128})[w_bits]
    code_bytes = units * unit_bytes
    p = packed.numpy().reshape(n // 16, -1, head_bytes + gs * (code_bytes + consts_bytes))
    cbs, supers = p.shape[:2]
    grp = p[..., head_bytes:].reshape(cbs, supers, gs, code_bytes + consts_bytes)
    u = grp[..., :code_bytes].reshape(cbs, supers, gs, units, unit_bytes).astype(np.int64)
    half = unit_bytes // 2 if w_bits == 8 else (unit_bytes * 2) // 3 if w_bits == 6 else unit_bytes
    if w_bits == 8:
        a, b = u[..., :half], u[..., half:]
    else:
        a, b = u[..., :half] & 15, u[..., :half] >> 4
        if w_bits == 6:   # the high 2 bits, byte j for lanes j and j + half/2: mm's b in bits 0-3 and
            hi = u[..., half:]   # a in 4-7, mm8's a in bits 0-3 and b in 4-7
            first, second = (np.concatenate([hi & 3, (hi >> 2) & 3], -1) << 4, np.concatenate([(hi >> 4) & 3, (hi >> 6) & 3], -1) << 4)
            a, b = (a | first, b | second) if int8 else (a | second, b | first)
    lanes = np.stack([a, b], -2)   # [cb, super, g, unit, a/b, byte]
    if int8:   # byte j of a quad: column j / 4, k 4 quad + j % 4; a unit is 8 k
        codes = lanes.reshape(cbs, supers, gs, units, 2, 16, 4).transpose(0, 5, 1, 2, 3, 4, 6)
    else:      # lane L of pair h of unit u: column L / 2, k 4 u + 2 h + L % 2
        codes = lanes.reshape(cbs, supers, gs, units, 2, 16, 2).transpose(0, 5, 1, 2, 3, 4, 6)
    codes = codes.reshape(n, k)
    if w_bits == 8:
        codes = codes - 128 if (int8 and fmt == "q8h") else np.where(codes > 127, codes - 256, codes) if not int8 else codes
    elif w_bits == 6:
        codes = codes - 32
    elif fmt in ("q4n", "q4x"):   # indices into IQ4_NL's table
        codes = quants.IQ4NL_VALUES[codes].astype(np.int64)
    c = grp[..., code_bytes:]                       # [cb, super, g, consts]
    head = p[..., :head_bytes]                      # [cb, super, head]
    if fmt == "q4z":
        scale = _f16s(c[..., :32]); low = -8 * scale
    elif fmt == "q4h":
        scale, low = _f16s(c[..., :32]), _f16s(c[..., 32:64])
    elif fmt == "q4k":
        scale = _f16s(head[..., None, :32]) * c[..., :16]
        low = -(_f16s(head[..., None, 32:64]) * c[..., 16:32])
    elif fmt in ("q6k", "q4x"):
        scale, low = _f16s(head[..., None, :32]) * c[..., :16].view(np.int8), 0 * c[..., :16]
    elif fmt in ("q8h", "q4n"):
        scale, low = _f16s(c[..., :32]), 0 * c[..., :16]
    else:
        scale = np.ascontiguousarray(c[..., :64]).view(np.float32).astype(np.float64)
        low = np.ascontiguousarray(c[..., 64:128]).view(np.float32).astype(np.float64)
    scale = scale.transpose(0, 3, 1, 2).reshape(n, k // gk)   # [cb, super, g, column] -> [n, groups]
    low = np.broadcast_to(low, (cbs, supers, gs, 16)).transpose(0, 3, 1, 2).reshape(n, k // gk)
    return (codes.reshape(n, k // gk, gk) * scale[..., None] + low[..., None]).reshape(n, k)


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
@pytest.mark.parametrize("t", KERNEL_TYPES)
def test_the_packing_holds_the_files_weights(t, int8):
    """Every type's packing, for bf16 and for int8 activations, read back by the layouts the
    kernel's comments state, holds exactly the file's weights (unpack's scale x code + low, whose
    fp32 rounding test_dequantize_equals_gguf_py_bit_for_bit checks against gguf-py). Runs
    wherever the extension compiles: the packer is plain C++. Q3_K is written in q6k, IQ4_NL and
    IQ4_XS in q8h and q8f for bf16 activations and in q4n and q4x (their own 4-bit indices) for
    int8 ones; a control shows the check sees a changed byte."""
    if not (quants.GEMM.load() or quants.GEMM.compiled):
        pytest.skip(f"the extension does not build here: {quants.failure()}")
    for n, k in (SMALL[t], REAL[t]):
        raw = make(t, n, k, seed=3)
        packed, fmt = quants.pack(t, raw, n, k, int8=int8)
        assert fmt == (quants.FORMAT8 if int8 else quants.FORMAT)[t]
        codes, scale, low, gk = quants.unpack(t, raw, n, k)   # W = scale codes + low, in float64: no rounding
        want = (codes.reshape(n, -1, gk) * scale[..., None].astype(np.float64)
                + (0 if low is None else low[..., None].astype(np.float64))).reshape(n, k)
        got = read_packing(packed, fmt, n, k, int8)
        assert np.array_equal(got, want), (t, n, k, int(np.sum(got != want)))
    broken = packed.clone()
    broken.view(-1)[7] ^= 0x11
    assert not np.array_equal(read_packing(broken, fmt, n, k, int8), want)


@pytest.mark.parametrize("t", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_the_direct_int8_packers_write_the_decoded_paths_bytes(t):
    """qmm.cpp writes the int8 arrangement of the commonest types straight from the blocks, four
    codes a word: byte for byte what the decoded path (Super::emit8, `reference=True`) writes,
    for both test shapes. Control: a changed byte of the file changes the direct packing."""
    if not (quants.GEMM.load() or quants.GEMM.compiled):
        pytest.skip(f"the extension does not build here: {quants.failure()}")
    for n, k in (SMALL[t], REAL[t]):
        raw = make(t, n, k, seed=11)
        fast, fmt = quants.pack(t, raw, n, k, int8=True)
        slow, fmt2 = quants.pack(t, raw, n, k, int8=True, reference=True)
        assert fmt == fmt2 and torch.equal(fast, slow), (t, n, k, int((fast != slow).sum()))
    raw[5, 17] ^= 0x24
    assert not torch.equal(quants.pack(t, raw, n, k, int8=True)[0], slow)


def test_pack_reads_the_files_map_as_it_lies(tmp_path):
    """The packer reads a read-only map of the file in place (what GGUFFile.raw gives): the same
    bytes as from a copy in memory, also inside inference mode (a model load is)."""
    kernel()
    t, (n, k) = "Q4_K", REAL["Q4_K"]
    raw = make(t, n, k, seed=5)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 64 + raw.tobytes())
    mapped = np.memmap(path, dtype=np.uint8, mode="r", offset=64, shape=raw.shape)
    with torch.inference_mode():
        got = quants.pack(t, mapped, n, k)
    want = quants.pack(t, raw.copy(), n, k)
    assert got[1] == want[1] and torch.equal(got[0], want[0])
    with pytest.raises(ValueError):   # the bytes a row must be the type's for K
        quants.pack(t, raw[:, :-144], n, k)


def test_shapes_that_do_not_fit():
    raw = make("Q4_0", 40, 64)
    assert not quants.fits("Q4_0", 40, 64) and quants.pack("Q4_0", raw, 40, 64) is None
    assert quants.fits("Q4_0", 48, 64) and not quants.fits("Q4_K", 48, 64) and quants.fits("Q3_K", 48, 256) and not quants.fits("Q2_K", 48, 256) and not quants.fits("IQ2_XS", 48, 256)
    if quants.kernel_available():
        with pytest.raises(ValueError):
            quants.QLinear("Q4_0", raw, 40, 64, activations="bf16" if quants.bf16_available() else "int8")


def test_no_kernel_no_qlinear(monkeypatch):
    monkeypatch.setattr(quants.GEMM, "module", None)
    monkeypatch.setattr(quants.GEMM, "failed", "not built (the test)")
    with pytest.raises(RuntimeError):
        quants.QLinear("Q8_0", make("Q8_0", 48, 64), 48, 64)


# ------------------------------------------------------------------ the GEMM

def kernel():
    """The GEMM module built here (pack and the row ops run wherever it builds)."""
    if not quants.kernel_available():
        pytest.skip(f"the GGUF GEMM is not available here: {quants.failure()}")


def kernel16():
    """The bf16-activation GEMM (mm): AVX512-BF16."""
    kernel()
    if not quants.bf16_available():
        pytest.skip("hd's bf16-activation GEMM needs AVX512-BF16")


@pytest.mark.parametrize("t,size", KERNEL_SHAPES)
def test_qlinear_multiplies_by_the_dequantized_weights(t, size):
    kernel16()
    n, k = shape(t, size)
    raw = make(t, n, k)
    lin = quants.QLinear(t, raw, n, k)
    assert (lin.in_features, lin.out_features, lin.dtype, lin.qtype) == (k, n, torch.bfloat16, t)
    assert lin.fmt == quants.FORMAT[t] and lin.nbytes == lin.packed.numel()
    w = torch.from_numpy(quants.dequantize_f32(t, raw, n, k))
    assert torch.equal(lin.weight_matrix(), quants.dequantize(t, raw, n, k))   # the file's weights, rounded once
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, k, generator=gen).bfloat16()
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 5, n)
    ref = x.float() @ w.T
    scale = x.float().abs() @ w.abs().T
    # bf16 output: half an ulp (2^-9 relative) and fp32 sums in another order
    assert ((y.float() - ref).abs() <= ref.abs() / 256 + 1e-4 * scale).all()
    bias = torch.randn(n, generator=gen).bfloat16()
    with_bias = quants.QLinear(t, raw, n, k, bias=bias)
    assert torch.equal(with_bias(x), y + bias) and with_bias.nbytes == lin.nbytes + 2 * n


def first_mismatch(f, x: torch.Tensor, ms=tuple(range(1, 21)) + (32, 48, 64), starts=(0, 7)):
    """(M, start) of the first call f(x[start:start + M]) whose rows are not torch.equal to the same
    rows of one-row calls and of 16-row calls (x[16 j:16 j + 16]), or None."""
    one = torch.cat([f(x[i:i + 1]) for i in range(len(x))])
    sixteen = torch.cat([f(x[i:i + 16]) for i in range(0, len(x), 16)])
    if not torch.equal(one, sixteen):
        return 16, "the 16-row references"
    for s in starts:
        for m in ms:
            if s + m > len(x):
                continue
            y = f(x[s:s + m])
            if not (torch.equal(y, one[s:s + m]) and torch.equal(y, sixteen[s:s + m])):
                return m, s
    return None


@pytest.mark.parametrize("t", KERNEL_TYPES)
def test_rows_do_not_depend_on_the_row_count(t):
    kernel16()
    n, k = REAL[t]
    lin = quants.QLinear(t, make(t, n, k), n, k)
    x = torch.randn(71, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert first_mismatch(lin, x) is None
    small = SMALL[t]
    lin = quants.QLinear(t, make(t, *small), *small)
    assert first_mismatch(lin, x[:, :small[1]].contiguous()) is None


def test_the_row_check_can_fail():
    """Controls for the test above: the same check flags a function whose rows see other rows, and
    torch's matmuls where their rows depend on M on this machine (printed: on the AMD EPYC fp32
    from 2 rows, bf16 not at these shapes); a change in one row's input changes that row's output
    and no other; and another arithmetic (fp32 products rounded to bf16) differs from the kernel's
    somewhere."""
    kernel16()
    t, (n, k) = "Q8_0", REAL["Q8_0"]
    raw = make(t, n, k)
    lin = quants.QLinear(t, raw, n, k)
    w = quants.dequantize(t, raw, n, k)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    caught = {name: first_mismatch(f, x, ms=tuple(range(1, 17))) for name, f in
              (("bf16", lambda a: a @ w.t()), ("fp32", lambda a: a.float() @ w.float().t()))}
    print("torch matmuls whose rows depend on M here:", {k_: v for k_, v in caught.items() if v})
    assert first_mismatch(lambda a: lin(a.roll(1, 0)), x, ms=tuple(range(1, 17))) is not None
    y = lin(x[:16])
    x2 = x[:16].clone()
    x2[5, 3] = x2[5, 3] * 1.5 + 1
    y2 = lin(x2)
    changed = (y2 != y).any(-1)
    assert changed[5] and not changed[:5].any() and not changed[6:].any()
    assert not torch.equal((x[:16].float() @ w.float().t()).bfloat16(), y)


def test_joined_layers_give_the_parts_outputs():
    """q, k, v (gate, up) packed side by side into one GEMM: the outputs are the parts' own
    QLinears' side by side, bit for bit, with and without biases, and the packing is the parts'
    packings concatenated; a bias on some only stays apart."""
    kernel16()
    gen = torch.Generator().manual_seed(3)
    k = 512
    shapes = ((0, 64), (1, 32), (2, 32))
    raws = [make("Q4_K", n, k, seed=s) for s, n in shapes]
    parts = [quants.QLinear("Q4_K", raw, n, k) for raw, (_, n) in zip(raws, shapes)]
    joined = quants.QLinear.side_by_side("Q4_K", raws, [n for _, n in shapes], k)
    x = torch.randn(5, k, generator=gen).bfloat16()
    assert joined.out_features == 128 and torch.equal(joined(x), torch.cat([p(x) for p in parts], -1))
    assert torch.equal(joined.packed, torch.cat([p.packed for p in parts]))
    braws = [make("Q4_K", 32, k, seed=s) for s in (4, 5)]
    bias = [torch.randn(32, generator=gen).bfloat16() for _ in braws]
    biased = [quants.QLinear("Q4_K", raw, 32, k, bias=b) for raw, b in zip(braws, bias)]
    assert torch.equal(quants.QLinear.side_by_side("Q4_K", braws, [32, 32], k, biases=bias)(x),
                       torch.cat([p(x) for p in biased], -1))
    assert quants.QLinear.side_by_side("Q4_K", [raws[0], braws[0]], [64, 32], k, biases=[None, bias[0]]) is None
    # the control: another part's bytes in the second place change exactly its columns
    swapped = quants.QLinear.side_by_side("Q4_K", [raws[0], raws[2], raws[1]], [64, 32, 32], k)(x)
    y = joined(x)
    assert torch.equal(swapped[:, :64], y[:, :64]) and not torch.equal(swapped[:, 64:96], y[:, 64:96])


def test_compiled_row_ops():
    """The owned forward's compiled row ops (bf16, CPU): the rope is torch's Rope.apply bit for bit
    (interleaved and halves); the residual add is torch's; the RMSNorm is transformers' up to its
    sum's order, and each row's result depends on that row only (a changed row changes only its
    own output: the control)."""
    kernel()
    from hdcli.engine.model.parts import rms_norm
    from hdcli.engine.model.rope import Rope
    ops = quants.gemm_module()
    gen = torch.Generator().manual_seed(4)
    for interleaved in (True, False):
        rope = Rope.__new__(Rope)
        rope.interleaved = interleaved
        y = torch.randn(7, 4 * 64, generator=gen).bfloat16()
        cos, sin = torch.randn(7, 64, generator=gen).bfloat16(), torch.randn(7, 64, generator=gen).bfloat16()
        want = rope.apply(y.view(7, 4, 64).transpose(0, 1), cos, sin)
        assert torch.equal(ops.rope(y, cos, sin, 4, interleaved), want)
    x, delta, w = (torch.randn(9, 576, generator=gen).bfloat16(), torch.randn(9, 576, generator=gen).bfloat16(),
                   torch.randn(576, generator=gen).bfloat16())
    added, normed = ops.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(added, x + delta)
    ref = rms_norm(added, w, 1e-5).float()
    assert ((normed.float() - ref).abs() <= ref.abs() / 128 + 1e-6).all()
    for i in range(9):
        assert torch.equal(ops.add_rms_norm(added[i:i + 1], None, w, 1e-5)[1], normed[i:i + 1])
    x2 = added.clone()
    x2[4, 10] += 1
    changed = (ops.add_rms_norm(x2, None, w, 1e-5)[1] != normed).any(-1)
    assert changed[4] and changed.sum() == 1


# ------------------------------------------------------------------ int8 activations (mm8)

def kernel8():
    kernel()
    if not quants.int8_available():
        pytest.skip("hd's int8-activation GEMM needs AVX512-VNNI or AVX2")


def int8_reference(t: str, x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
    """What mm8 computes, in float64: each row's groups of GROUP[t] quantized as the kernel does
    (scale amax / 127, nearest-even codes of x * 127 / amax), times the file's fp32 weights."""
    gk = quants.GROUP[t]
    xg = x.float().reshape(x.shape[0], -1, gk)
    amax = xg.abs().amax(-1, keepdim=True)
    # tensor / tensor: torch computes a scalar over a tensor as the scalar times a reciprocal, off by an ulp
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax.clamp_min(1e-30), torch.zeros_like(amax))
    xq = torch.round(xg * inv)   # round half to even, as VCVTPS2DQ
    return ((xq * (amax / 127.0)).reshape(x.shape).double() @ torch.from_numpy(w).double().T)


@pytest.mark.parametrize("t,size", KERNEL_SHAPES)
def test_int8_activations_multiply_the_rows_as_quantized(t, size):
    """mm8: the file's weights times each row quantized to int8 per group: equal to that product
    up to the bf16 output's rounding (and fp32 sums); the packing is as small as mm's or smaller
    (IQ4_NL, IQ4_XS: their own 4-bit layouts)."""
    kernel8()
    n, k = shape(t, size)
    raw = make(t, n, k)
    lin = quants.QLinear(t, raw, n, k, activations="int8")
    assert lin.activations == "int8" and lin.nbytes <= quants.pack(t, raw, n, k)[0].numel()
    w = quants.dequantize_f32(t, raw, n, k)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, k, generator=gen).bfloat16()
    x[3, :quants.GROUP[t]] = 0   # a zero group quantizes to zeros, not NaN
    y = lin(x)
    ref = int8_reference(t, x, w)
    scale = x.double().abs() @ torch.from_numpy(np.abs(w)).double().T
    assert ((y.double() - ref).abs() <= ref.abs() / 256 + 1e-5 * scale).all()
    bias = torch.randn(n, generator=gen).bfloat16()
    assert torch.equal(quants.QLinear(t, raw, n, k, bias=bias, activations="int8")(x), y + bias)
    with pytest.raises(ValueError):
        lin.weight_matrix()   # the bf16 GEMM's identity trick does not read this arrangement


@pytest.mark.parametrize("t", KERNEL_TYPES)
def test_int8_rows_do_not_depend_on_the_row_count(t):
    kernel8()
    n, k = REAL[t]
    lin = quants.QLinear(t, make(t, n, k), n, k, activations="int8")
    x = torch.randn(71, k, generator=torch.Generator().manual_seed(6)).bfloat16()
    assert first_mismatch(lin, x) is None


_CROSS_BUILD8 = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from test_quants import make, REAL
from hdcli.engine.kernels import quants
assert quants.int8_available(), quants.failure()
outs = {"isa": quants.gemm_isa()}
for t in quants.FORMAT:
    n, k = REAL[t]
    lin = quants.QLinear(t, make(t, n, k), n, k, activations="int8")
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(6)).bfloat16() * 3
    x[4, :quants.GROUP[t]] = 0
    outs[t] = [lin(x[:m]) for m in (1, 2, 3, 4, 5, 8, 9, 19)]
torch.save(outs, sys.argv[1])
"""


def test_int8_gemm_avx2_build_gives_the_native_bits(tmp_path):
    """The int8 GEMM built for AVX2 (HD_CPU=avx2: VPMADDUBSW, its int16 sums added over several
    quads before they are widened, tiles of 4 rows), for AVX2 with AVX-VNNI (HD_CPU=avx2-vnni,
    where this CPU has it: VPDPBUSD on 256 bits) and for an AVX-512 machine itself (VPDPBUSD on
    512, tiles of 8) give the same bits for every format at 1-19 rows: the group sums are exact
    integers however they are formed, and the fp32 operations on them are the same. Runs where the
    machine has AVX512-VNNI (elsewhere both builds are AVX2); the negative control: the bf16
    activations' GEMM of the same weights gives other bits, so equal means equal."""
    from pathlib import Path
    from conftest import cross_built
    if "avx512_vnni" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX512-VNNI: its own build is the AVX2 one")
    builds = [("native", {}), ("avx2", {"HD_CPU": "avx2"})]
    if "avx_vnni" in Path("/proc/cpuinfo").read_text():   # VPDPBUSD on 256 bits, as Intel's newer CPUs
        builds.append(("avx2-vnni", {"HD_CPU": "avx2-vnni"}))
    outs = cross_built(_CROSS_BUILD8, builds, tmp_path, "the GEMM", str(Path(__file__).parent), timeout=900)
    assert outs["native"]["isa"] != outs["avx2"]["isa"] and "AVX2" in outs["avx2"]["isa"]
    assert outs.get("avx2-vnni", {"isa": "AVX2 + AVX-VNNI"})["isa"].startswith("AVX2 + AVX-VNNI")
    for tag in outs:
        for t in quants.FORMAT:
            assert len(outs[tag][t]) == 8
            for a, b in zip(outs["native"][t], outs[tag][t]):
                assert torch.equal(a, b), (tag, t)
    if quants.bf16_available():
        t, (n, k) = "Q4_K", REAL["Q4_K"]
        x = torch.randn(19, k, generator=torch.Generator().manual_seed(6)).bfloat16() * 3
        x[4, :quants.GROUP[t]] = 0
        assert not torch.equal(quants.QLinear(t, make(t, n, k), n, k, activations="bf16")(x), outs["native"][t][-1])


def test_int8_rows_controls():
    """Controls for the int8 path: the row check flags a function whose rows see other rows; a
    change in one row changes only that row; int8 activations are other numerics than the bf16
    GEMM's (plain decoding in the same mode is the reference, docs/dtype.md); joined int8 layers
    equal their parts."""
    kernel8()
    t, (n, k) = "Q4_K", REAL["Q4_K"]
    raw = make(t, n, k)
    lin = quants.QLinear(t, raw, n, k, activations="int8")
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(7)).bfloat16()
    assert first_mismatch(lambda a: lin(a.roll(1, 0)), x, ms=tuple(range(1, 17))) is not None
    y = lin(x[:16])
    x2 = x[:16].clone()
    x2[5, 3] = x2[5, 3] * 1.5 + 1
    changed = (lin(x2) != y).any(-1)
    assert changed[5] and changed.sum() == 1
    raws = [make(t, m, k, seed=s) for s, m in ((1, 64), (2, 32))]
    parts = [quants.QLinear(t, raw, m, k, activations="int8") for raw, m in zip(raws, (64, 32))]
    joined = quants.QLinear.side_by_side(t, raws, [64, 32], k, activations="int8")
    assert torch.equal(joined(x), torch.cat([p(x) for p in parts], -1))
    if quants.bf16_available():
        assert not torch.equal(quants.QLinear(t, raw, n, k)(x[:16]), y)


def test_the_activation_choice_is_measured_once_and_cached(tmp_path, monkeypatch):
    """activation_choice: int8 or bf16 with the times it was chosen by, written under
    HD_CACHE_DIR and read back; a broken record is measured again, never trusted; a measurement
    that does not tell the two apart (a loaded machine) keeps int8 and is not cached."""
    kernel8()
    if not quants.bf16_available():   # AVX2: int8 is the only GEMM, nothing to measure
        assert quants.activation_choice()["activations"] == "int8"
        pytest.skip("one GEMM here (no AVX512-BF16): nothing to choose between")
    monkeypatch.setenv("HD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(quants, "CHOICE_MARGIN", -1.0)   # any times decide (for bf16): cached
    first = quants.activation_choice()
    assert first["activations"] == "bf16" and set(first["us"]) == {"int8", "bf16"} and first["decisive"]
    files = list((tmp_path / "choices").glob("*.json"))
    assert len(files) == 1
    assert quants.activation_choice()["measured_at"] == first["measured_at"]   # read, not measured
    for bad in ('{"key": 5}', "not json", '{"activations": "int4"}'):
        files[0].write_text(bad)
        again = quants.activation_choice()
        assert again["activations"] == "bf16" and again["measured_at"] != first["measured_at"]
    files[0].unlink()
    monkeypatch.setattr(quants, "CHOICE_MARGIN", 1e9)    # no times decide: int8, nothing written
    undecided = quants.activation_choice()
    assert undecided["activations"] == "int8" and not undecided["decisive"]
    assert not list((tmp_path / "choices").glob("*.json"))
