"""A GGUF's 4-bit weights kept 4-bit: weight-only int4 GEMMs on CPU (the `int4` kernel set).

Why: one decode step reads every weight once, so bytes per weight bound the speed. A Q4_0/Q4_1
GGUF holds 4.5-5 bits a weight; hd dequantizes it to fp32 or bf16 (16-32 bits), so llama.cpp,
which multiplies by the 4-bit blocks, reads 3-6x fewer bytes per token than hd on the same file.
PyTorch has a CPU kernel for exactly this layout: `aten._weight_int4pack_mm_for_cpu` (4-bit
weights in groups along K, one scale and one zero per group and output row, bf16 activations),
the op torchao and gpt-fast use for int4 weight-only models. Measured on a 2-core AMD EPYC (Zen 5):
a 576 x 1536 bf16 product with one row in 36 us against 101 us for oneDNN's packed bf16 weight.

The GGUF blocks map onto that layout without re-quantizing: a Q4_1 block of 32 weights is
w = d * q + m (q in 0..15, d and m fp16), a Q4_0 block w = d * (q - 8); the kernel computes
w = (q - 8) * scale + zero per group of 32, so scale = d and zero = m + 8 d (Q4_0: zero = 0).
The kernel takes scale and zero in the activations' dtype (bf16), so they are rounded to bf16:
the weights are the GGUF's 4-bit codes with bf16 block constants, where the bf16 kernel sets use
the GGUF's weights each rounded to bf16. Both are approximations of the file of the same order;
this is another model numerically, as another kernel set is, and the lossless guarantee holds
between plain and speculative decoding on it, as for every kernel set (docs/dtype.md).

Which layers: those whose GGUF tensor is Q4_0 or Q4_1 and whose codes, dequantized, equal the
loaded model's weight exactly (rows permuted as transformers' GGUF loader permutes llama's q/k
rows, or not): anything that does not match stays as it was (oneDNN-packed), so a mapping this
module gets wrong can cost speed but never change which model runs. Other quantisations (Q4_K,
Q6_K, Q8_0: the tied embedding of the bundled model) are not converted.

Prefill. The 4-bit kernel is fastest for the few rows of a decode step, and slow for many: on
the AMD EPYC a 576 x 1536 product took 38 us with 1 row (oneDNN bf16: 47) but 1027 us with 64
rows (oneDNN bf16: 322). A prompt's prefill is such a wide product, so each 4-bit layer can keep
the bf16 layer it replaced (the GGUF's weights each rounded to bf16, oneDNN-packed) and use it
for rows inside `prefill()` (engine/decode.py's Decoder._prefill). Whether it does is measured on
the machine at hand (a prompt-sized product both ways) and cached, so a process never switches
(`keep_dense`); memory for the bf16 copies is the price, so they are not kept where they would
take more than a quarter of the machine's memory.

Exactness: a prompt's cache is then computed with the bf16 weights and every later forward
with the 4-bit ones. Plain decoding, speculative decoding, `hd generate` and `hd serve` all
prefill through the same call, so each is the same function of the prompt; verified rows are
compared with one-token rows of the 4-bit kernel, as before.

hd's GEMM (csrc/int4mm.cpp). torch's kernel dequantizes to fp32 and multiplies with fp32 FMAs:
~340 GFLOP/s from 16 rows up on the AMD EPYC, 88% of what those give on 2 cores, and 64% of a
forward of 4 requests. hd's multiplies the 4-bit codes, turned into bf16 integers in registers,
by the bf16 activations with bf16 dot products (AVX512-BF16), then scales each group of 32 by
the GGUF's d and adds lo times the group's activation sum: the Q4 weights exactly, in fp32. A row's
arithmetic is fixed whatever the row count (the M-invariant forward needs that). On the EPYC, a
576 x 1536 product: 1 row 9.5 us against torch's 16.5, 4 rows 15.4 against 25.3, 16 rows 44.8
against 89.5 (`_time_gemms`). Which one runs is measured once per machine (`gemm()`; HD_INT4_GEMM=torch or hd
forces it) and is part of every cache key that depends on the kernel set's numerics.

Invariants
  * Int4Linear is a PackedLinear to the rest of hd: weight_matrix() (the kernel's bf16 weights,
    exactly: I @ W^T; with hd's GEMM its fp32 weights rounded to bf16), state_dict, deepcopy,
    parameter counts.
  * With hd's GEMM a layer holds its packing (0.625 bytes a weight with the fp16 block constants)
    beside torch's (0.5), which nothing reads while hd's GEMM runs (not yet dropped).
  * convert() keeps each replaced layer (the packed bf16 original) so that restore() puts the
    model back exactly; drop_originals() frees them once the int4 set is kept.
  * CPU, bf16 only: the kernel's fp32 path is a slow reference (0.5 GB/s) and fp16 is not native
    on the CPUs we run on.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from .kernels import PackedLinear

GROUP = 32            # weights per GGUF block = per kernel group
INNER_K_TILES = 2     # the packing's K tiling (the CPU kernel accepts 2, 4 or 8; K % (16 * 2) == 0)
CODES = ("Q4_0", "Q4_1")
PREFILL_ROWS = 128    # rows of the product that decides whether prefills use the bf16 copies
MEMORY_SHARE = 0.25   # the bf16 copies may take at most this share of the machine's memory

_state = threading.local()   # .prefill: inside prefill() in this thread


@contextlib.contextmanager
def prefill():
    """Within: Int4Linear layers that keep their bf16 layer (keep_dense) use it (a prompt's rows)."""
    before = getattr(_state, "prefill", False)
    _state.prefill = True
    try:
        yield
    finally:
        _state.prefill = before


def available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


GEMM_SOURCE = Path(__file__).with_name("csrc") / "int4mm.cpp"
GEMM_ROWS = (1, 4, 16)   # rows of the products that decide the GEMM (a step, a small tree, 4 requests)
_gemm_module = None
_gemm_failed: str | None = None
_gemm_choice: str | None = None   # "hd" or "torch", once decided in this process


def gemm_module(quiet: bool = True):
    """hd's compiled GEMM, or None where it cannot be built or this CPU lacks AVX512-BF16."""
    global _gemm_module, _gemm_failed
    if _gemm_module is None and _gemm_failed is None:
        from . import fused
        name = fused.extension_name(GEMM_SOURCE, "hd_int4mm_")
        _gemm_module, _gemm_failed = fused.compile_extension(GEMM_SOURCE, name, "the 4-bit GEMM", quiet)
        if _gemm_module is not None and not _gemm_module.supported():
            _gemm_module, _gemm_failed = None, "this CPU has no AVX512-BF16"
    return _gemm_module


def hd_pack(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor | None:
    """csrc/int4mm.cpp's packing [N/16, K/32, 320] uint8 of codes [N, K] (0..15), scale and low
    [N, K/32]; None where scale or low is not exactly an fp16 (a GGUF's always are: its d and m are
    fp16 and Q4_0's low is -8 d), since the packing keeps them as fp16."""
    n, k = codes.shape
    consts = torch.stack([scale.float(), low.float()], 1)                        # [n, 2, k/32]
    half = consts.half()
    if not torch.equal(half.float(), consts):
        return None
    c = codes.to(torch.uint8).reshape(n // 16, 16, k // GROUP, 16, 2)          # block, column, group, pair, k
    lanes = c.permute(0, 2, 3, 1, 4).reshape(n // 16, k // GROUP, 16, 32)       # lane = column * 2 + k
    nibbles = (lanes[..., :16] | (lanes[..., 16:] << 4)).reshape(n // 16, k // GROUP, 256)
    half = half.reshape(n // 16, 16, 2, k // GROUP).permute(0, 3, 2, 1)   # block, group, d/lo, column
    return torch.cat([nibbles, half.contiguous().view(torch.uint8).reshape(n // 16, k // GROUP, 64)], -1).contiguous()


@torch.inference_mode()
def _time_gemms(rounds: int = 7) -> dict:
    """Least times (us) of a 576 x 1536 product (the bundled model's MLP) at GEMM_ROWS rows with
    torch's kernel and hd's, interleaved rounds."""
    gen = torch.Generator().manual_seed(0)
    lin = Int4Linear(torch.randint(0, 16, (1536, 576), generator=gen), torch.rand(1536, 18, generator=gen) / 64,
                     -torch.rand(1536, 18, generator=gen) / 8, kernel="torch")
    packed = hd_pack(torch.randint(0, 16, (1536, 576), generator=gen), torch.rand(1536, 18, generator=gen).half().float(),
                     torch.rand(1536, 18, generator=gen).half().float())
    mod = gemm_module()
    xs = [torch.randn(r, 576, generator=gen).bfloat16() for r in GEMM_ROWS]
    calls = {"torch": lambda x: lin(x), "hd": lambda x: mod.mm(x, packed)}
    best = {(k, r): float("inf") for k in calls for r in GEMM_ROWS}
    for _ in range(rounds):
        for x in xs:
            for k, f in calls.items():
                f(x)
                t = time.perf_counter()
                for _ in range(5):
                    f(x)
                best[k, x.shape[0]] = min(best[k, x.shape[0]], (time.perf_counter() - t) / 5 * 1e6)
    return {k: [round(best[k, r], 2) for r in GEMM_ROWS] for k in calls}


def gemm(quiet: bool = True) -> str:
    """Which GEMM Int4Linear layers made from now on use: "hd" or "torch". HD_INT4_GEMM (hd, torch)
    forces it; otherwise hd's where it is built and measures faster (the sum over GEMM_ROWS), decided
    once per machine (cached per source, CPU, torch, flags and thread count). quiet False: the
    compile and the timing say so on stderr."""
    global _gemm_choice
    if _gemm_choice is None:
        asked = os.environ.get("HD_INT4_GEMM", "auto").strip().lower()
        if asked == "torch" or gemm_module(quiet) is None:
            _gemm_choice = "torch"
        elif asked == "hd":
            _gemm_choice = "hd"
        else:
            from . import costs, fused
            key = f"{fused.extension_name(GEMM_SOURCE, 'hd_int4mm_')}|threads {torch.get_num_threads()}"
            path = costs.cache_file("int4_gemm", key)
            record = costs.read_json(path, key)
            if record is None:
                if not quiet:
                    print("hd: timing hd's 4-bit GEMM against torch's (once per machine)...", file=sys.stderr, flush=True)
                record = {"key": key, "rows": list(GEMM_ROWS), "us": _time_gemms()}
                costs.write_json(path, record)
            _gemm_choice = "hd" if sum(record["us"]["hd"]) < sum(record["us"]["torch"]) else "torch"
    return _gemm_choice


def gemm_name() -> str:
    """The GEMM's identity in cache keys: "torch", or "hd-" and a hash of its source and build."""
    if gemm() == "hd":
        from . import fused
        return "hd-" + fused.extension_name(GEMM_SOURCE, "")
    return "torch"


@contextlib.contextmanager
def pinned_gemm(kind: str):
    """Within the block, Int4Linear layers made use `kind` ("hd" or "torch"): for tests and
    benchmarks. Raises RuntimeError for "hd" where it is not built here."""
    global _gemm_choice
    if kind == "hd" and gemm_module() is None:
        raise RuntimeError(f"hd's 4-bit GEMM is not available here: {_gemm_failed}")
    saved, _gemm_choice = _gemm_choice, kind
    try:
        yield
    finally:
        _gemm_choice = saved


class Int4Linear(PackedLinear):
    """y = x @ W^T with W held as 4-bit codes and bf16 (scale, zero) per group of 32 along K."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bias=None,
                 dtype: torch.dtype = torch.bfloat16, kernel: str | None = None):
        """codes [N, K] int (0..15), scale and low [N, K / 32] fp32: W = codes * scale + low.
        kernel: the GEMM, "hd" or "torch" (None: the process's, `gemm()`)."""
        torch.nn.Module.__init__(self)
        kernel = kernel or gemm()
        n, k = codes.shape
        # hd's GEMM and its packing (16 columns a block), or None: torch's kernel
        self.hd = hd_pack(codes, scale, low) if kernel == "hd" and n % 16 == 0 and k % GROUP == 0 else None
        self.out_features, self.in_features = codes.shape
        self.dtype = dtype
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(),
                                                                        INNER_K_TILES)
        s = scale.to(dtype)
        zero = (low + 8 * s.float()).to(dtype)    # (q - 8) * s + zero = q * s + low, up to rounding
        self.scales_zeros = torch.stack([s, zero], -1).transpose(0, 1).contiguous()   # [K / 32, N, 2]
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dense = self.__dict__.get("_hd_dense")
        if dense is not None and getattr(_state, "prefill", False):
            return dense(x)
        rows = x.reshape(-1, self.in_features)
        if self.hd is not None:
            y = _gemm_module.mm(rows, self.hd)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def weight_matrix(self) -> torch.Tensor:
        eye = torch.eye(self.in_features, dtype=self.dtype)
        if self.hd is not None:   # its fp32 weights, rounded to bf16
            return _gemm_module.mm(eye, self.hd).t().contiguous()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scales_zeros).t().contiguous()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, GGUF 4-bit (int4 weight-only, "
                f"{'hd' if self.hd is not None else 'torch'} GEMM)")


class Joined:
    """Int4Linear layers that read the same input (q/k/v, gate/up) as one call of hd's GEMM: their
    packings concatenated along N, each layer's own packing then a view into it (no second copy).
    Every output column's arithmetic is its layer's (csrc/int4mm.cpp), so the outputs are
    torch.equal to the layers' own; one call instead of three or two saves the per-call cost
    (~10 us on the AMD EPYC, 90 calls a forward of the bundled model)."""

    def __init__(self, layers):
        self.layers = tuple(layers)
        self.widths = [l.out_features for l in layers]
        self.hd = torch.cat([l.hd for l in layers])
        at = 0
        for l in layers:
            l.hd = self.hd[at:at + l.out_features // 16]
            at += l.out_features // 16

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        return list(self.all(x).split(self.widths, -1))

    def all(self, x: torch.Tensor) -> torch.Tensor:
        """The layers' outputs side by side [..., sum of widths], in their order."""
        return _gemm_module.mm(x.reshape(-1, x.shape[-1]), self.hd).reshape(*x.shape[:-1], -1)


def joined(owner, names: tuple[str, ...]) -> Joined | None:
    """The Joined of owner's layers `names` where all are Int4Linear on hd's GEMM without a bias
    (made once, kept on owner), else None; None too inside prefill() where they keep bf16 copies
    (those run there instead)."""
    layers = tuple(getattr(owner, n, None) for n in names)
    j = owner.__dict__.get("_hd_joined", {}).get(names)
    if j is None or j.layers != layers:
        if not all(isinstance(l, Int4Linear) and l.hd is not None and l.bias is None
                   and l.in_features == layers[0].in_features for l in layers):
            return None
        j = Joined(layers)
        owner.__dict__.setdefault("_hd_joined", {})[names] = j   # not a submodule: no state_dict entry
    if getattr(_state, "prefill", False) and any("_hd_dense" in l.__dict__ for l in layers):
        return None
    return j


# ------------------------------------------------------------------ reading the GGUF

def blocks(kind: str, raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [n, k] uint8, scale [n, k/32] fp32, low [n, k/32] fp32) of a Q4_0/Q4_1 tensor's raw
    bytes: W = codes * scale + low. Block layout (ggml): fp16 d, (Q4_1: fp16 m,) 16 bytes of codes,
    element j in the low nibble of byte j, element j + 16 in the high nibble."""
    head = 2 if kind == "Q4_0" else 4
    b = np.asarray(raw).reshape(n, k // GROUP, head + GROUP // 2)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    low = (b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if kind == "Q4_1" else -8 * d)
    qs = b[..., head:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], -1).reshape(n, k)
    return codes, d, low


def from_blocks(kind: str, raw: np.ndarray, n: int, k: int, bias=None,
                dtype: torch.dtype = torch.bfloat16) -> Int4Linear:
    """An Int4Linear [n outputs, k inputs] from a Q4_0/Q4_1 tensor's raw bytes."""
    return Int4Linear(*(torch.from_numpy(np.ascontiguousarray(a)) for a in blocks(kind, raw, n, k)),
                      bias=bias, dtype=dtype)


def _llama_qk_rows(n: int, heads: int) -> np.ndarray:
    """transformers' GGUF loader un-permutes llama q/k rows (the GGUF stores rotary halves
    interleaved): HF row r is GGUF row perm[r]."""
    half = n // heads // 2
    return np.arange(n).reshape(heads, half, 2).swapaxes(1, 2).reshape(n)


def _arch(reader) -> str:
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def convert(model: torch.nn.Module, gguf_path: str | Path) -> dict:
    """Replace, in place, every Linear whose GGUF tensor is Q4_0/Q4_1 and matches its weight
    exactly, by an Int4Linear (the replaced module is kept for restore()). Returns
    {"int4": layers converted, "kept": {module name: why not}}."""
    import gguf
    reader = gguf.GGUFReader(str(gguf_path))
    by_name = {t.name: t for t in reader.tensors}
    arch = _arch(reader)
    enum = next((a for a, nm in gguf.MODEL_ARCH_NAMES.items() if nm == arch), None)
    cfg = model.config
    names = gguf.get_tensor_name_map(enum, int(cfg.num_hidden_layers)) if enum is not None else None
    done, kept = 0, {}
    with torch.inference_mode():
        for parent_name, parent in list(model.named_modules()):
            for child_name, child in list(parent.named_children()):
                if not isinstance(child, (torch.nn.Linear, PackedLinear)) or isinstance(child, Int4Linear):
                    continue
                full = f"{parent_name}.{child_name}" if parent_name else child_name
                why, new = _convert_one(child, full, names, by_name, cfg)
                if new is None:
                    kept[full] = why
                    continue
                new.__dict__["_hd_original"] = child   # not a submodule: no state_dict entry
                setattr(parent, child_name, new)
                done += 1
    return {"int4": done, "kept": kept}


def _convert_one(lin, full: str, names, by_name: dict, cfg):
    gg = names.get_name(full, try_suffixes=(".weight",)) if names is not None else None
    t = by_name.get(f"{gg}.weight") if gg else None
    if t is None:
        return "no GGUF tensor", None
    if t.tensor_type.name not in CODES:
        return t.tensor_type.name, None
    dtype = getattr(lin, "dtype", None) or lin.weight.dtype
    if dtype != torch.bfloat16 or lin.in_features % (16 * INNER_K_TILES):
        return f"{dtype}, K = {lin.in_features}", None
    if [int(x) for x in t.shape] != [lin.in_features, lin.out_features]:  # GGUF shapes are [K, N]
        return f"shape {list(t.shape)}", None
    codes, scale, low = blocks(t.tensor_type.name, t.data, lin.out_features, lin.in_features)
    weight = lin.weight_matrix() if isinstance(lin, PackedLinear) else lin.weight.detach()
    rows = [np.arange(codes.shape[0])]
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": getattr(cfg, "num_key_value_heads", None)}
    h = heads.get(full.rsplit(".", 1)[-1])
    if h:
        rows.append(_llama_qk_rows(codes.shape[0], int(h)))
    for perm in rows:
        c, s, lo = (torch.from_numpy(np.ascontiguousarray(a[perm])) for a in (codes, scale, low))
        deq = (c.float().view(c.shape[0], -1, GROUP) * s[..., None] + lo[..., None]).view(c.shape)
        if torch.equal(deq.to(dtype), weight):
            bias = getattr(lin, "bias", None)
            return None, Int4Linear(c, s, lo, None if bias is None else bias.detach(), dtype)
    return "codes do not equal the loaded weights", None


def restore(model: torch.nn.Module) -> int:
    """Put back every layer convert() replaced (still held). Returns how many."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            original = getattr(child, "_hd_original", None)
            if isinstance(child, Int4Linear) and original is not None:
                setattr(parent, name, original)
                n += 1
    return n


def drop_originals(model: torch.nn.Module, keep_for_prefill: bool = False) -> None:
    """Free the layers convert() replaced, or keep them as the bf16 layers prefills use."""
    for m in model.modules():
        if isinstance(m, Int4Linear):
            original = m.__dict__.pop("_hd_original", None)
            if keep_for_prefill and original is not None:
                m.__dict__["_hd_dense"] = original   # not a submodule: no state_dict entry
            else:
                m.__dict__.pop("_hd_dense", None)


@torch.inference_mode()
def _prefill_speedup(model: torch.nn.Module, rows: int = PREFILL_ROWS, rounds: int = 5) -> float | None:
    """Least time of the widest 4-bit layer's product over `rows` rows with 4-bit weights, over
    the same with its bf16 layer (interleaved rounds); None when no layer kept its bf16 one."""
    layers = [m for m in model.modules() if isinstance(m, Int4Linear) and "_hd_original" in m.__dict__]
    if not layers:
        return None
    lin = max(layers, key=lambda m: m.in_features * m.out_features)
    dense = lin.__dict__["_hd_original"]
    x = torch.randn(rows, lin.in_features, generator=torch.Generator().manual_seed(0)).to(lin.dtype)
    best = {"int4": float("inf"), "dense": float("inf")}
    for f in (lin, dense):
        f(x)                                   # first call: kernels are set up
    for _ in range(rounds):
        for name, f in (("int4", lin), ("dense", dense)):
            t = time.perf_counter()
            f(x)
            best[name] = min(best[name], time.perf_counter() - t)
    return best["int4"] / best["dense"]


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def keep_dense(model: torch.nn.Module, cache_key: str | None) -> dict:
    """Decide, once per machine and model (cached under cache_key), whether prefills use the bf16
    layers convert() kept: where they measure faster for a prompt-sized product and fit in
    MEMORY_SHARE of the memory. Then keeps or frees them. Returns the decision record."""
    from . import costs
    path = costs.cache_file("int4_prefill", cache_key) if cache_key else None
    record = costs.read_json(path, cache_key) if path else None
    if record is None:
        speedup = _prefill_speedup(model)
        extra = 2 * sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Int4Linear))
        memory = _memory_bytes()
        fits = memory is None or extra <= MEMORY_SHARE * memory
        record = {"key": cache_key, "rows": PREFILL_ROWS, "speedup": speedup, "bytes": extra,
                  "dense": bool(speedup is not None and speedup > 1.1 and fits)}
        if path and speedup is not None:
            costs.write_json(path, record)
    drop_originals(model, keep_for_prefill=record["dense"])
    model.hd_int4_prefill = {k: record[k] for k in ("dense", "speedup", "bytes", "rows")}
    return model.hd_int4_prefill


def is_converted(model: torch.nn.Module) -> bool:
    return any(isinstance(m, Int4Linear) for m in model.modules())
