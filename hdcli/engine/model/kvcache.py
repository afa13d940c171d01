"""The KV cache of hd's own forward (hdcli/engine/model/): keys and values in preallocated
buffers, laid out the way the invariant attention reads them.

Why: the invariant attention (invariant.py) computes in fp32 over keys padded to whole chunks and
over values with a ones column ([V | 1], whose weighted sum is the softmax sum). On transformers'
DynamicCache every block of every forward concatenated the whole cache with the new tokens, then
converted it to fp32, padded it and appended the ones column again: copies of the whole cache,
per block, per forward, per request: with the bundled model and several one-token requests, a
fifth of a forward's op time (torch.profiler), and a long cache's forward was slower than here
(benchmarks/forward_many.py). Here the cache is kept in the
form the attention reads: a forward writes its new rows, and the attention takes views.

Same numerics: a bf16 key converted to fp32 is exact, so the attention sees the values it saw
before, in the same order (tests/test_kvcache.py).
Where the fused attention (fused.py) reads them, a bf16 model's keys and values stay bf16 and are
widened to fp32 as they are read (exact again): half the bytes, and with 4 requests on ~300-token
caches the attention is bound by reading them. Elsewhere they are stored in fp32.

Layout per block (batch b, kv heads h, head dim d, capacity C a multiple of invariant.CHUNK):
  kbuf [b, h, C, d]       keys
  vbuf [b, h, C, d + 1]   values and a ones column
so the first ceil(n / CHUNK) * CHUNK rows are the zero-padded keys and [V | 1] of an n-token
cache, as the attention wants them, without a copy (padded()).

Invariants
  * Cache holds one InvariantLayer per decoder block, and the methods of target.KVCache, the
    interface the decode loop, tree verification and the cost measurement call (get_seq_length,
    append, crop, keep_path, ...); layers[i].keys and .values are views of the live rows. Nothing
    here is transformers': hd's forwards own it.
  * Rows past the length are zero wherever they are read: padded() and claim() zero what crop
    left (crop only lowers the length: `dirty` marks how far rows may be stale); growth copies
    into zeros.
  * Its tensors are inference tensors (written in torch.inference_mode, as transformers' cache is
    in a no-grad forward); every method that writes them enters the mode itself.
  * Capacity grows by doubling (whole chunks), so a generation copies its cache O(log n) times.
  * The fused attention keeps the keys transposed by blocks in ktbuf, valid for the first kt_len
    keys; it writes the rest itself on each call. crop and rewritten() lower kt_len: whoever
    writes rows through the views (Cache.keep_path) calls rewritten(), else the fused attention
    reads stale keys.
  * With the fused attention the forward appends nothing itself: claim() counts the new rows
    and the compiled call writes them (fused.append_attend_many), one call a block for all
    requests: the per-request copies in Python had been a sixth of a 4-request forward of the
    bundled model.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..kernels import fused, invariant

_MIN_CAPACITY = 256


def _round_up(n: int) -> int:
    return -(-n // invariant.CHUNK) * invariant.CHUNK


class InvariantLayer:
    """One block's keys and values (see the module header)."""

    def __init__(self):
        self.is_initialized = False
        self.kbuf = self.vbuf = None
        self.length = 0
        self.capacity = 0                  # rows kbuf and vbuf hold
        self.dirty = 0                     # rows below this past the length may be nonzero (crop)
        self.ktbuf, self.kt_len = None, 0  # the fused attention's transposed keys (transposed())

    def lazy_initialization(self, key_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        # bf16 keys stay bf16 where the fused attention reads them (it widens them exactly as it
        # reads): half the bytes a forward reads (module header)
        store = (torch.bfloat16 if key_states.dtype == torch.bfloat16 and self.device.type == "cpu"
                 and fused.enabled() else torch.float32)
        b, h, _, d = key_states.shape
        self.kbuf = torch.zeros(b, h, 0, d, device=self.device, dtype=store)
        self.vbuf = torch.zeros(b, h, 0, d + 1, device=self.device, dtype=store)
        self.is_initialized = True

    @torch.inference_mode()
    def _reserve(self, n: int) -> None:
        """Room for n rows and the zero padding of their last chunk."""
        need = _round_up(max(n, 2))
        if need <= self.capacity:
            return
        cap = _round_up(max(need, 2 * self.capacity, _MIN_CAPACITY))
        b, h, _, d = self.kbuf.shape
        kbuf = self.kbuf.new_zeros(b, h, cap, d)
        vbuf = self.vbuf.new_zeros(b, h, cap, d + 1)
        kbuf[:, :, :self.length] = self.kbuf[:, :, :self.length]
        vbuf[:, :, :self.length] = self.vbuf[:, :, :self.length]
        self.kbuf, self.vbuf, self.capacity, self.dirty = kbuf, vbuf, cap, self.length
        if self.ktbuf is not None:
            self.transposed()

    @torch.inference_mode()
    def _zero_past(self, end: int) -> None:
        """Rows from the length to `end` zero again (crop leaves them as they were)."""
        end = min(end, self.dirty)
        if end > self.length:
            self.kbuf[:, :, self.length:end] = 0
            self.vbuf[:, :, self.length:end] = 0
            if end == self.dirty:
                self.dirty = self.length

    # the keys and values as they came in (without padding or the ones column), made when read:
    # a decode step appends to every block and seldom reads them.
    @property
    def keys(self):
        return None if self.kbuf is None else self.kbuf[:, :, :self.length]

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("InvariantLayer.keys is a view of its stored keys: append() to it")

    @property
    def values(self):
        return None if self.vbuf is None else self.vbuf[:, :, :self.length, :-1]

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("InvariantLayer.values is a view of its stored values: append() to it")

    def claim(self, m: int, like: torch.Tensor, keys: int = 0) -> int:
        """Room for m new rows, counted in the length, left for the caller to write (the fused
        attention writes them, fused.append_attend_many), and for reading `keys` keys (kbuf,
        vbuf and the transposed copy ktbuf cover them; rows read past the new length are zero);
        like: new keys [b, h, m', d] (their dtype, device and shape are read, not their values).
        Returns where the m rows start. Called per block per forward: the usual case is a few
        integer operations, which fused.claimed does inline for every block of a forward (the
        call a block cost more than they do): a change to this case is a change there too."""
        if not self.is_initialized:
            self.lazy_initialization(like)
        n = self.length
        if max(n + m, keys, 2) > self.capacity:
            self._reserve(max(n + m, keys))
        if self.ktbuf is None:
            self.transposed()
        self.length = n + m
        if keys > n + m and self.dirty > n + m:   # a layout pads one key to two: it reads zeros
            self._zero_past(keys)
        return n

    @torch.inference_mode()
    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write m new rows ([b, h, m, d], any float dtype) after the cached ones."""
        if not self.is_initialized:
            self.lazy_initialization(key_states)
        n, m = self.length, key_states.shape[-2]
        self._reserve(n + m)
        self.kbuf[:, :, n:n + m] = key_states
        self.vbuf[:, :, n:n + m, :-1] = value_states
        self.vbuf[:, :, n:n + m, -1] = 1.0
        self.length = n + m

    def padded(self, n_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [b, h, n_pad, d], [V | 1] [b, h, n_pad, d + 1]) in fp32, zero past the length;
        n_pad up to the length rounded up to whole chunks. Views where the layer stores fp32,
        copies where it stores bf16 (the torch ops' attention reads them: not the fused one)."""
        self._reserve(n_pad)
        self._zero_past(n_pad)
        return self.kbuf[:, :, :n_pad].float(), self.vbuf[:, :, :n_pad].float()

    def transposed(self) -> tuple[torch.Tensor, int]:
        """The fused attention's copy of the keys, transposed by blocks (fused.py, csrc/attend.cpp):
        [b, h, ceil(C / 16), d, 16] in the keys' dtype, and how many keys in it are valid. The
        attention writes the rest and records it in kt_len; crop lowers kt_len, growth starts a
        new copy."""
        b, h, cap, d = self.kbuf.shape
        blocks = -(-cap // fused.KEY_BLOCK)
        if self.ktbuf is None or self.ktbuf.shape[2] < blocks:
            self.ktbuf, self.kt_len = self.kbuf.new_zeros(b, h, blocks, d, fused.KEY_BLOCK), 0
        return self.ktbuf, self.kt_len

    def rewritten(self, start: int) -> None:
        """Rows from `start` on were written through the views (Cache.keep_path): the transposed
        copy holds them no longer."""
        self.kt_len = min(self.kt_len, start)

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last -tokens_to_remove rows (a negative count).
        The rows are zeroed when something reads past the length (padded, claim), not here: a
        verification crops every block of every request, and zeroing there was a third of the
        decode loop's acceptance time at 4 requests (benchmarks/scheduler_widths.py)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        n = max(0, self.length + tokens_to_remove)
        self.dirty = max(self.dirty, self.length)
        self.length = n
        self.kt_len = min(self.kt_len, n)


def keep_rows(layers, nodes: int, want: Sequence[int]) -> None:
    """Within each layer's last `nodes` rows (a tree's, node 0 first), copy rows `want` (node ids,
    increasing) to the first len(want) places, in order; the rest are left for a crop. Rows already
    in place (the first candidate's chain) are not moved. layers: anything whose keys and values
    are [b, h, rows, d] tensors written in place (InvariantLayer's views, transformers' layers)."""
    if list(want) == list(range(len(want))):
        return
    rel = torch.tensor(want, dtype=torch.long, device=layers[0].keys.device)  # one copy per step
    for layer in layers:
        base = layer.keys.shape[-2] - nodes
        idx = rel + base
        layer.keys[..., base:base + len(want), :] = layer.keys.index_select(-2, idx)
        layer.values[..., base:base + len(want), :] = layer.values.index_select(-2, idx)


class Cache:
    """hd's own cache for an owned forward (hdcli/engine/model/): one InvariantLayer a decoder
    block, and target.KVCache's methods for the decode loop. Every block keeps every row, a
    sliding-window block's too: the owned attention applies the window itself (attention.Step)."""

    def __init__(self, n_blocks: int):
        self.layers = [InvariantLayer() for _ in range(n_blocks)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length()

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.layers[layer].append(keys, values)

    def crop(self, max_length: int) -> None:
        """As DynamicCache.crop: to max_length tokens, or remove -max_length tokens when negative."""
        n = self.get_seq_length()
        remove = -max_length if max_length < 0 else n - max_length
        if remove > 0:
            for layer in self.layers:
                layer.crop(-remove)

    @torch.inference_mode()
    def keep_path(self, past: int, path: Sequence[int]) -> None:
        """target.KVCache.keep_path: the rows are moved through the layers' views, so the fused
        attention's transposed copies of them are stale from the tree's first row on (rewritten)."""
        want = [0, *path]
        nodes = self.get_seq_length() - past
        if want != list(range(len(want))):
            keep_rows(self.layers, nodes, want)
            for layer in self.layers:
                layer.rewritten(layer.length - nodes)
        remove = nodes - len(want)
        assert remove >= 0
        if remove:   # (crop(0) would empty it)
            self.crop(-remove)

    def sliding_windows(self) -> list[int | None]:
        return [None] * len(self.layers)   # the attention applies its windows (class docstring)

    def supports_trees(self) -> bool:
        return True
