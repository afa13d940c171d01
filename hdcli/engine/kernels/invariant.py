"""The M-invariant forward: every row of a k-token forward is bit-identical to the same token's
one-token forward (torch.equal on the logits), for chains and token trees on a cached prefix.

Why rows differ otherwise (measured op by op and shape by shape; benchmarks/invariance.py):
  * Linear. A GEMM picks its kernel and blocking by the number of rows M. On one CPU, in fp32:
    torch's (MKL) rows agree only for M in {4, 8} or M >= 12; oneDNN-packed rows agree for every
    M >= 2 but M = 1 (a GEMV) differs at K = 1536. Rows of one kernel configuration never depend
    on the other rows, so padding every call to at least `min_rows` rows fixes it. min_rows is
    measured per weight shape, dtype and kernel on the machine at hand (`enable`, min_rows_for)
    and kept in each layer (model/parts.py: Linear) and in the model's Numerics record.
  * Attention (the first op that differs with packed fp32 Linear layers). SDPA reduces a row's
    softmax and its weighted sum of values in an order that depends on the number of keys and
    where they sit: a tree node's ancestors sit at cache slots past + node id, in its one-token
    forward at past + depth. `attend_kv` below computes each row over its own visible keys in
    their order (the cache, then its ancestors) in fixed chunks of CHUNK keys counted from its
    first visible key:
        scores  one GEMM of the query rows (padded to >= MIN_ROWS) by the keys; a score is one
                dot product over head_dim, the same in any GEMM of >= MIN_ROWS rows and >= 2 keys;
        softmax m = max of the row's visible scores (exact in any order); p = exp(s - m), 0
                where masked;
        values  per chunk one GEMM of p by [V | 1] (the ones column gives the softmax sum by the
                same arithmetic), every chunk the same shape; chunks summed in order by cumsum,
                a sequential scan, so the trailing all-masked chunks of a wider forward add
                exact zeros.
    Chunks wholly inside the prefix every row sees are one batched GEMM for all rows; the rest
    (the row's own ancestors) are gathered per row. Computed in fp32 whatever the model dtype.
  * RMSNorm, rotary embeddings, activations and the embedding lookup work row by row: found
    invariant, and checked with the rest by the per-row test (tests/test_invariant.py).

The mode is a property of hd's own forward (hdcli/engine/model/): its Numerics record says
whether it is on (the model's `invariant`), each of its Linear layers holds its row padding, and its Step
calls the attention here. transformers' models never run in it (engine/loader.py).

Invariants
  * With the mode on, a forward's row for a token depends only on that token's own path (its
    prefix and ancestors), never on the number of rows or the other rows: so speculative greedy
    output equals plain greedy decoding in the same mode, bit for bit, in any dtype where every
    Linear shape calibrated (`enable` says which and refuses where one did not).
  * The mode changes the numerics against the model's stock forward (another summation order, in
    fp32): plain decoding in the mode is the reference; docs/dtype.md compares it with
    transformers' generate.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import time

import torch

from .. import records

from . import fused
from ...errors import HdError
from ..environment import fused_attention

CHUNK = 32      # keys per value-chunk GEMM
MIN_ROWS = 4    # fp32 GEMM rows agree for M >= 4 (measured: M = 1 is a GEMV, 2-3 another kernel)
MAX_ROWS = 64   # the widest verification forward (loop.Decoder's max_nodes + the root)
NAME = "hd_invariant"
PROBE_ROWS = tuple(range(1, 34)) + (40, 48, 63, 64)


# ---------------------------------------------------------------- attention

def _pad_rows(x: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    short = rows - x.shape[dim]
    if short <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = short
    return torch.cat([x, x.new_zeros(shape)], dim)


def _visible(mask: torch.Tensor | None, m: int, n: int, device) -> torch.Tensor:
    """[m, n] bool: which keys each query row sees (no mask: causal, the last m keys are the rows)."""
    if mask is None:
        ones = torch.ones(m, n, dtype=torch.bool, device=device)
        return ones if m == 1 else ones.tril(n - m)   # one row sees every key
    mask = mask[0, 0] if mask.dim() == 4 else mask
    mask = mask[:, -n:] if mask.shape[-1] != n else mask
    return mask if mask.dtype == torch.bool else mask == 0


class _Layout:
    """Where each row's keys are, derived once per mask: every layer of a forward that gets the
    same mask (all full-attention layers, all sliding ones) reuses it. The fused attention reads
    vis alone; what the torch ops' attention reads besides (DERIVED) is worked out when first read:
    a tree's gather plan is some fifteen small torch ops a forward, spent for nothing where the
    fused attention runs."""

    DERIVED = ("prefix_only", "rows", "n_pad", "shared", "t_pad", "idx", "tail_bias")

    def __init__(self, vis: torch.Tensor, g: int):
        if vis.shape[1] < 2:  # a one-key scores GEMM is a GEMV: add a masked key
            vis = _pad_rows(vis, 2, 1)
        self.vis = vis.contiguous()                       # what fused.attend reads
        self._g = g

    def __getattr__(self, name: str):
        # only for what __init__ did not set: the torch ops' fields, derived once
        if name not in _Layout.DERIVED or "prefix_only" in self.__dict__:
            raise AttributeError(name)
        self._derive()
        return getattr(self, name)

    def _derive(self) -> None:
        vis = self.vis
        m, n = vis.shape
        seen = vis.sum(-1)
        prefix = vis.long().cumprod(-1).sum(-1)
        self.rows = n                                     # keys (zero-padded) the attention reads
        if bool((prefix == seen).all()):                  # plain decoding, chains
            # scores GEMMs over few keys (< 16 here) order differently: keys padded to chunks
            self.n_pad = self.rows = -(-n // CHUNK) * CHUNK
            self.prefix_only = True
            return
        self.shared = int(prefix.min()) // CHUNK * CHUNK         # keys 0..S-1: seen by every row
        ranks = vis.long().cumsum(-1) - 1
        self.t_pad = max(CHUNK, -(-(int(seen.max()) - self.shared) // CHUNK) * CHUNK)
        rows_i, cols = (vis & (ranks >= self.shared)).nonzero(as_tuple=True)
        slots = ranks[rows_i, cols] - self.shared
        self.idx = torch.zeros(m, self.t_pad, dtype=torch.long, device=vis.device)
        valid = torch.zeros(m, self.t_pad, dtype=torch.bool, device=vis.device)
        self.idx[rows_i, slots] = cols
        valid[rows_i, slots] = True
        self.tail_bias = torch.zeros(m, self.t_pad, device=vis.device).masked_fill_(~valid, float("-inf"))
        self.prefix_only = False   # last: its presence says the fields are derived

    @functools.cached_property
    def bias(self) -> torch.Tensor:
        """Of a prefix-only layout: the torch ops' additive mask, rows in (head j, query i) order.
        Made when first read: the fused attention reads vis alone (a whole prompt's would be
        g * m * n floats)."""
        bias = torch.zeros(self.vis.shape[0], self.n_pad, device=self.vis.device)
        bias.masked_fill_(~_pad_rows(self.vis, self.n_pad, 1), float("-inf"))
        return bias.repeat(self._g, 1)


def causal_prompt_sdpa(query, key, value, scaling) -> torch.Tensor:
    """SDPA told the mask is causal: a whole prompt's attention where the fused one is off (query
    [1, Hq, M, D], key/value [1, Hkv, M, D]). Returns [1, M, Hq, D]."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                           enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous()


def layout(mask, m: int, n: int, g: int, device) -> _Layout:
    """Where each of m query rows' keys are among n (mask: additive or bool [.., m, n], None:
    causal), for g query heads per kv head: derived once per forward, shared by its layers."""
    return _Layout(_visible(mask, m, n, device), g)


def fp32_kv(key, value, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the attention reads: keys [Hkv, rows, D] and [V | 1] [Hkv, rows, D + 1] (the ones
    column's weighted sum is the softmax sum, by the same arithmetic), fp32, zero rows past the
    N keys. The cache (kvcache.py) keeps them in this form."""
    return _pad_rows(key[0].float(), rows, 1), _values_with_ones(value[0].float(), rows)


def attend_kv(query, k, v1, lay: _Layout, scaling) -> torch.Tensor:
    """The torch ops' attention of one sequence: query [1, Hq, M, D] over keys and [V | 1] already
    in fp32_kv's form (at least lay.rows rows). Returns [1, M, Hq, D] in the query's dtype."""
    dtype = query.dtype
    _, hq, m, d = query.shape
    hkv = k.shape[0]
    g = hq // hkv
    q = query[0].float().reshape(hkv, g, m, d)                   # q head h = kv head h // g
    if lay.prefix_only:   # rank of a key = its index: chunks by index, no gather
        total = _prefix_rows(q, k, v1, lay, scaling)
    else:                 # trees, sliding windows: each row's keys gathered in order
        total = _gathered_rows(q, k, v1, lay, scaling)
    out = total[..., :d] / total[..., d:]                        # [hkv, m, g, d]
    return out.permute(1, 0, 2, 3).reshape(1, m, hq, d).to(dtype)   # head h = kv * g + j


def fused_kv(kernel: fused.AttentionKernel, query, k, v1, lay: _Layout, scaling) -> torch.Tensor:
    """attend_kv's attention by the compiled one (fused.py): query [1, Hq, M, D]. Returns
    [1, M, Hq, D] in the query's dtype."""
    q = query[0].transpose(0, 1).float().contiguous()        # [M, hq, d]
    return kernel.attend_many(q, [(k, v1)], [lay.vis], scaling).to(query.dtype)[None]


def append_attend(kernel: fused.AttentionKernel, query, key, value, owners, lays, scaling) -> torch.Tensor:
    """Append each sequence's new keys and values (key, value [1, Hkv, M, D], rows in the
    sequences' order) to its kvcache.InvariantLayer (owners), then attend as attend_many does:
    the fused attention in one call. Returns [1, M, Hq, D] in the query's dtype."""
    return kernel.append_attend_many(query, key, value, owners, [lay.vis for lay in lays], scaling)


def row_bounds(sizes) -> list[tuple[int, int]]:
    """Each sequence's rows (start, end) among the rows of all, in order."""
    return [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]


class Many:
    """How several sequences' rows share one attention (hdcli/engine/decode/batch.py), derived once per
    forward from their layouts and row counts, used by every layer.

    Sequences whose rows see only a prefix of their keys (chains, single tokens), two or more,
    share one score GEMM batch and one value-chunk GEMM batch: sequence j's query rows (kv head,
    then query head within the group, then token: attend's order) go to batch row j, padded to
    the most rows; its keys are padded with zeros to the longest sequence's chunks (n_pad) and
    masked, so they add exact zeros to the in-order chunk sum. The rest (trees) attend alone.
    A row's result is torch.equal to attend() alone (tests/test_batch.py)."""

    def __init__(self, lays, sizes, hq: int, hkv: int, device):
        self.lays, self.hkv = lays, hkv
        self.bounds = row_bounds(sizes)
        flat = [i for i, lay in enumerate(lays) if lay.prefix_only]
        self.flat = flat if len(flat) >= 2 else []
        if not self.flat:
            return
        g = hq // hkv
        self.rows = max(MIN_ROWS, max(g * sizes[i] for i in self.flat))
        self.n_pad = max(lays[i].n_pad for i in self.flat)
        nb, m_all = len(self.flat), sum(sizes)
        # query row (j, kv, r) <- q[head, token]; padding rows repeat row 0 (rows never mix in a GEMM)
        head = torch.zeros(nb, hkv, self.rows, dtype=torch.long)
        tok = torch.zeros(nb, hkv, self.rows, dtype=torch.long)
        # output (token, head) <- result row (j, kv, r); tokens of other sequences point at row 0
        src = torch.zeros(m_all, hq, dtype=torch.long)
        self.bias = torch.zeros(nb, 1, self.rows, self.n_pad, device=device)
        for j, i in enumerate(self.flat):
            a, m = self.bounds[i][0], sizes[i]
            r = torch.arange(g * m)
            for kv in range(hkv):
                head[j, kv, :g * m] = kv * g + r // m
                tok[j, kv, :g * m] = a + r % m
                src[a:a + m, kv * g:(kv + 1) * g] = ((j * hkv + kv) * self.rows + r).view(g, m).T
            np_i = lays[i].n_pad
            self.bias[j, 0, :g * m, :np_i] = lays[i].bias
            self.bias[j, 0, :g * m, np_i:] = float("-inf")
        self.head, self.tok, self.src = head.to(device), tok.to(device), src.to(device)
        self.all_flat = len(self.flat) == len(lays)

    def key_rows(self, i: int) -> int:
        """Rows of keys and [V | 1] sequence i's attention reads."""
        return self.n_pad if i in self.flat else self.lays[i].rows


def attend_many(query, kvs, many: Many, scaling) -> torch.Tensor:
    """attend_kv() for several sequences at once: query [1, Hq, M, D] holds every sequence's rows
    (in many.bounds), kvs[i] sequence i's keys and [V | 1] (fp32_kv's form, many.key_rows(i)
    rows). Returns [1, M, Hq, D] in the query's dtype."""
    dtype = query.dtype
    _, hq, m_all, d = query.shape
    out = None
    if many.flat:
        nb, hkv, rows, n_pad = len(many.flat), many.hkv, many.rows, many.n_pad
        b = nb * hkv
        q = query[0].float()[many.head, many.tok]                   # [nb, hkv, rows, d]
        k = torch.stack([kvs[i][0] for i in many.flat])
        v1 = torch.stack([kvs[i][1] for i in many.flat])
        s = torch.matmul(q.reshape(b, rows, d), k.reshape(b, n_pad, d).transpose(1, 2))
        s = (s * scaling).reshape(nb, hkv, rows, n_pad) + many.bias
        p = torch.exp(s - s.amax(-1, keepdim=True)).reshape(b, rows, n_pad)
        total = _in_order(_chunk_parts(p, v1.reshape(b, n_pad, d + 1)), 1)   # [b, rows, d + 1]
        o = total[..., :d] / total[..., d:]
        out = o.reshape(b * rows, d)[many.src].to(dtype)             # [M, hq, d]
        if many.all_flat:
            return out[None]
    out = query.new_empty(m_all, hq, d) if out is None else out
    for i, (a, b_) in enumerate(many.bounds):
        if i not in many.flat:
            out[a:b_] = attend_kv(query[:, :, a:b_], *kvs[i], many.lays[i], scaling)[0]
    return out[None]


def _values_with_ones(v: torch.Tensor, n_pad: int) -> torch.Tensor:
    """[hkv, n_pad, d + 1]: the values, a ones column (its weighted sum is the softmax sum, by the
    same arithmetic), zero rows beyond the keys."""
    hkv, n, d = v.shape
    out = v.new_zeros(hkv, n_pad, d + 1)
    out[:, :n] = torch.cat([v, v.new_ones(hkv, n, 1)], -1)
    return out


def _chunk_parts(p: torch.Tensor, v1: torch.Tensor) -> torch.Tensor:
    """p [b, rows, nc * C] by v1 [b, nc * C, d + 1]: one GEMM per chunk of C keys, all of one
    shape (rows padded to MIN_ROWS). [b, nc, rows, d + 1]."""
    b, rows, width = p.shape
    nc = width // CHUNK
    pc = _pad_rows(p.reshape(b, rows, nc, CHUNK).transpose(1, 2), MIN_ROWS, 2)    # [b, nc, R, C]
    return torch.matmul(pc, v1.reshape(b, nc, CHUNK, v1.shape[-1]))[:, :, :rows]


def _in_order(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """The chunks' sum, in order: cumsum is a sequential scan, so all-masked trailing chunks
    (zeros) leave it bit-equal to the sum over the row's own chunks."""
    return torch.cumsum(parts, dim).select(dim, -1)


def _prefix_rows(q, k, v1, lay: _Layout, scaling) -> torch.Tensor:
    """Every row sees keys 0..n_i - 1. [hkv, m, g, d + 1]."""
    hkv, g, m, d = q.shape
    k, v1 = k[:, :lay.n_pad], v1[:, :lay.n_pad]
    s = torch.matmul(_pad_rows(q.reshape(hkv, g * m, d), MIN_ROWS, 1), k.transpose(1, 2))[:, :g * m]
    s = s * scaling + lay.bias
    p = torch.exp(s - s.amax(-1, keepdim=True))
    total = _in_order(_chunk_parts(p, v1), 1)                    # [hkv, g * m, d + 1]
    return total.reshape(hkv, g, m, d + 1).transpose(1, 2)


def _gathered_rows(q, k, v1, lay: _Layout, scaling) -> torch.Tensor:
    """Keys 0..shared - 1 (a multiple of CHUNK) are seen by every row and chunked by index; each
    row's other keys are gathered in order into its own tail chunks. [hkv, m, g, d + 1]."""
    hkv, g, m, d = q.shape
    shared, t_pad, idx = lay.shared, lay.t_pad, lay.idx
    # scores: the shared keys in one GEMM of all rows, each row's tail over its gathered keys
    q_t = _pad_rows(q.permute(0, 2, 1, 3), MIN_ROWS, 2)          # [hkv, m, >=4, d]
    s_t = torch.matmul(q_t, k[:, idx].transpose(-1, -2))[:, :, :g] * scaling   # [hkv, m, g, T]
    s_t = s_t + lay.tail_bias[None, :, None, :]
    mx = s_t.amax(-1)                                            # [hkv, m, g]
    if shared:
        qr = _pad_rows(q.reshape(hkv, g * m, d), MIN_ROWS, 1)
        s_sh = torch.matmul(qr, k[:, :shared].transpose(1, 2))[:, :g * m] * scaling
        s_sh = s_sh.reshape(hkv, g, m, shared).transpose(1, 2)   # [hkv, m, g, S]
        mx = torch.maximum(mx, s_sh.amax(-1))
    v_t = v1[:, idx]                                             # [hkv, m, T, d + 1]
    p_t = torch.exp(s_t - mx[..., None])                         # masked: exp(-inf) = 0
    parts = _chunk_parts(p_t.reshape(hkv * m, g, t_pad), v_t.reshape(hkv * m, t_pad, d + 1))
    parts = parts.reshape(hkv, m, t_pad // CHUNK, g, d + 1)
    if shared:  # the shared chunks first, then the row's own: one scan over all, in order
        p_sh = torch.exp(s_sh - mx[..., None]).transpose(1, 2).reshape(hkv, g * m, shared)
        head = _chunk_parts(p_sh, v1[:, :shared])                # [hkv, ns, g * m, d + 1]
        head = head.reshape(hkv, shared // CHUNK, g, m, d + 1).permute(0, 3, 1, 2, 4)
        parts = torch.cat([head, parts], 2)
    return _in_order(parts, 2)                                   # [hkv, m, g, d + 1]


@torch.inference_mode()
def min_rows_for(layer: torch.nn.Module, in_features: int, dtype: torch.dtype, seed: int = 0,
                 rows_per_m: int = 256) -> int | None:
    """The least row count r such that, called with any M >= r rows, every row equals the same
    row of a 16-row call; None when no r <= 16 holds. bf16 output rounds to 8 bits and hides most
    differences of summation order (an M = 1 call was seen to differ from 16-row calls in one row
    of fifteen), so each M is tried on `rows_per_m` rows, with inputs shaped like activations (a gated
    SiLU: heavy-tailed, many near zero)."""
    gen = torch.Generator().manual_seed(seed)
    n = rows_per_m + 64
    x = torch.nn.functional.silu(3 * torch.randn(n, in_features, generator=gen))
    x = (x * torch.randn(n, in_features, generator=gen)).to(_device(layer), dtype)
    ref = torch.cat([layer(x[s:s + 16]) for s in range(0, n, 16)])
    bad = set()
    for rows in PROBE_ROWS:
        for s in range(0, max(rows_per_m, 4 * rows), rows):
            if s + rows > n:
                break
            if not torch.equal(layer(x[s:s + rows]), ref[s:s + rows]):
                bad.add(rows)
                break
    for r in range(1, 17):
        if not any(b >= r for b in bad):
            return r
    return None


def _device(layer: torch.nn.Module) -> torch.device:
    """Where a layer's weights are (the probe goes there: a CUDA model's too)."""
    for t in list(layer.parameters()) + list(layer.buffers()):
        return t.device
    return torch.device("cpu")


# Which implementation the invariant attention runs in this process: fused.py's compiled function or
# the torch ops above (fused.py's module docstring says how it is decided), kept on the process's
# fused.AttentionKernel (its `decision` and `on`).
ATTENTION_FORMAT = 1


@contextlib.contextmanager
def pinned(kind: str, kernel: fused.AttentionKernel = fused.KERNEL):
    """Within the block, the process's attention is `kind` ("fused" or "torch") whatever decide
    measured: for tests and benchmarks that compare the two. Raises RuntimeError for "fused" where
    it does not compile here."""
    if kind == "fused" and kernel.load(quiet=True) is None:
        raise RuntimeError(f"the fused attention does not compile here: {kernel.failure()}")
    saved = kernel.decision, kernel.on
    kernel.decision = {"attention": kind, "by": "pinned"}
    kernel.use(kind == "fused")
    try:
        yield
    finally:
        kernel.decision = saved[0]
        kernel.use(saved[1])


def require(kind: str, kernel: fused.AttentionKernel = fused.KERNEL) -> None:
    """Make `kind` ("fused" or "torch") the process's attention whatever timing would choose: a
    configuration that records it (DecodingConfig.attention) runs with the numerics it recorded.
    Raises HdError where "fused" does not compile here."""
    if kind not in ("fused", "torch"):
        raise HdError(f"--attention must be auto, fused or torch, not '{kind}'")
    if kind == "fused" and kernel.load(quiet=False) is None:
        raise HdError(f"--attention fused: the fused attention does not compile here ({kernel.failure()}); "
                      "the run it comes from computed with it, so its tokens cannot be repeated here; "
                      "use --attention torch for this machine's own run")
    kernel.decision = {"attention": kind, "by": "configuration"}
    kernel.use(kind == "fused")


def decide(model, quiet: bool = True, kernel: fused.AttentionKernel = fused.KERNEL) -> dict:
    """Whether the invariant attention uses the compiled function in this process (module
    docstring): {"attention": "fused" or "torch", "by": what decided, "why"/"ms": details}.
    Decided once per process, so that every model and run of a process has one numerics."""
    if kernel.decision is None:
        kernel.decision = _decision(model, quiet, kernel)
        kernel.use(kernel.decision["attention"] == "fused")
    return kernel.decision


def _decision(model, quiet: bool, kernel: fused.AttentionKernel) -> dict:
    asked = fused_attention()
    cfg = model.config   # hd's own forward's ModelConfig: only it runs the invariant mode
    hq = getattr(cfg, "num_attention_heads", None)
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or (getattr(cfg, "hidden_size", 0) // hq if hq else None)
    if asked == "0":
        return {"attention": "torch", "by": "HD_FUSED_ATTENTION=0"}
    if next(model.parameters()).device.type != "cpu":
        return {"attention": "torch", "by": "device", "why": "not a CPU model"}
    if not (hq and hkv and d) or d > fused.MAX_HEAD:
        return {"attention": "torch", "by": "shape", "why": f"head size {d} (the function takes up to {fused.MAX_HEAD})"}
    if kernel.load(quiet=quiet) is None:
        if not quiet:
            print(f"hd: the fused attention does not compile here ({kernel.failure()}); using torch ops "
                  "(HD_FUSED_ATTENTION=0 skips trying)", file=sys.stderr, flush=True)
        return {"attention": "torch", "by": "build", "why": kernel.failure()}
    if asked == "1":
        return {"attention": "fused", "by": "HD_FUSED_ATTENTION=1"}
    ms = _measured(hq, hkv, d, quiet, kernel)
    return {"attention": "fused" if ms["fused"] < ms["torch"] else "torch", "by": "measured", "ms": ms}


def _measured(hq: int, hkv: int, d: int, quiet: bool, kernel: fused.AttentionKernel) -> dict:
    """{"fused": ms, "torch": ms}: both attentions timed on this head shape, cached per machine."""
    key = f"{fused._name()}|heads {hq}/{hkv}x{d}|threads {torch.get_num_threads()}"
    path = records.cache_file("attention", key)
    got = records.read_record(path, key, ATTENTION_FORMAT, lambda d: isinstance(d["ms"], dict) and all(
        records.number(d["ms"][k], 0) for k in ("fused", "torch")), "the attention timing record")
    if got is not None:
        return got["ms"]
    if not quiet:
        print("hd: timing the fused attention against torch ops (once per machine)...", file=sys.stderr, flush=True)
    ms = time_both(hq, hkv, d, kernel=kernel)
    records.write_json(path, {"key": key, "format": ATTENTION_FORMAT, "ms": ms})
    return ms


def time_both(hq: int, hkv: int, d: int, keys: int = 256, rounds: int = 7, calls: int = 10,
              kernel: fused.AttentionKernel = fused.KERNEL, clear: float = 1.5, least_rounds: int = 3) -> dict:
    """Least time (ms) of `calls` attention calls, summed over a one-token row, an 8-node tree and
    a 16-token chain over `keys` cached keys, for each path, in interleaved rounds: `rounds`, or
    `least_rounds` where by then one path is `clear` times faster than the other (a first start's
    timing about halves where one path is far faster; a close call takes every round)."""
    gen = torch.Generator().manual_seed(0)
    cases = []
    for m, tree in ((1, False), (8, True), (16, False)):
        n = keys + m
        vis = torch.ones(m, n, dtype=torch.bool).tril(n - m)
        if tree:   # a binary tree: each node sees the prefix and its ancestors
            vis[:, n - m:] = False
            for r in range(m):
                a = r
                while True:
                    vis[r, n - m + a] = True
                    if a == 0:
                        break
                    a = (a - 1) // 2
        q = torch.randn(1, hq, m, d, generator=gen)
        k, v = torch.randn(1, hkv, n, d, generator=gen), torch.randn(1, hkv, n, d, generator=gen)
        lay = layout(vis, m, n, hq // hkv, "cpu")
        cases.append((q, *fp32_kv(k, v, lay.rows), lay))
    best = {"fused": [float("inf")] * len(cases), "torch": [float("inf")] * len(cases)}
    with torch.inference_mode():
        for r in range(rounds):
            for path in (("fused", "torch") if r % 2 == 0 else ("torch", "fused")):
                for i, (q, k, v1, lay) in enumerate(cases):
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        if path == "fused":
                            fused_kv(kernel, q, k, v1, lay, d ** -0.5)
                        else:
                            attend_kv(q, k, v1, lay, d ** -0.5)
                    best[path][i] = min(best[path][i], time.perf_counter() - t0)
            f, t = sum(best["fused"]), sum(best["torch"])
            if r + 1 >= least_rounds and max(f, t) >= clear * min(f, t):
                break
    return {path: round(1e3 * sum(ts), 3) for path, ts in best.items()}
