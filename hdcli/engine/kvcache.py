"""The KV cache of the M-invariant lean forward: fp32 keys and values in preallocated buffers, laid
out the way the invariant attention reads them.

Why: the invariant attention (invariant.py) computes in fp32 over keys padded to whole chunks and
over values with a ones column ([V | 1], whose weighted sum is the softmax sum). On transformers'
DynamicCache every layer of every forward concatenated the whole cache with the new tokens, then
converted it to fp32, padded it and appended the ones column again: copies of the whole cache,
per layer, per forward, per request. Measured on an AMD EPYC with the bundled 135M model in bf16
and 4-bit kernels (torch.profiler): with 4 one-token requests on ~250-token caches, a fifth of a
forward's op time was those concatenations and copies; against the DynamicCache, interleaved,
one request's forward on a 1500-token cache took 28 ms instead of 35 (benchmarks/forward_many.py;
with 4 requests the difference was within the machine's noise). Here the cache is kept in the
form the attention reads: a forward writes its new rows, and the attention takes views.

Same numerics: a bf16 key converted to fp32 is exact, so the attention sees the values it saw
before, in the same order; rows are torch.equal to those on a DynamicCache (tests/test_kvcache.py).

Layout per layer (batch b, kv heads h, head dim d, capacity C a multiple of invariant.CHUNK):
  k32 [b, h, C, d]       keys; rows >= length are zero
  v32 [b, h, C, d + 1]   values and a ones column; rows >= length are zero
so the first ceil(n / CHUNK) * CHUNK rows are the zero-padded keys and [V | 1] of an n-token
cache, as the attention wants them, without a copy.

Invariants
  * It is a transformers DynamicCache (update / crop / get_seq_length / layers[i].keys and
    .values, the latter views of the live rows), so keep_path, crop, transformers' stock forward
    (prefills wider than a verification) and everything else that reads a cache work unchanged.
    update() returns the keys and values in the dtype they came in (exact: fp32 holds them).
  * Rows past the length are zero: crop zeroes what it removes, growth copies into zeros.
  * Its tensors are inference tensors (written in torch.inference_mode, as transformers' cache is
    in a no-grad forward); every method that writes them enters the mode itself.
  * Capacity grows by doubling (whole chunks), so a generation copies its cache O(log n) times.
  * The fused attention (fused.py) keeps the keys transposed by blocks in kt32, valid for the
    first kt_len keys; it writes the rest itself on each call. crop and rewritten() lower kt_len:
    whoever writes rows through the views (tree.keep_path) calls rewritten(), else the fused
    attention reads stale keys.
  * With the fused attention the lean forward appends nothing itself: claim() counts the new rows
    and the compiled call writes them (fused.append_attend_many), one call a layer for all
    requests. On the AMD EPYC (bundled model, int4, interleaved) a forward of 4 one-token
    requests took 12.0 ms instead of 14.3, one request 8.6 instead of 9.1: the per-request copies
    in Python had been a sixth of the 4-request forward.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from . import fused, invariant

_MIN_CAPACITY = 256


def _round_up(n: int) -> int:
    return -(-n // invariant.CHUNK) * invariant.CHUNK


class InvariantLayer(DynamicLayer):
    """One layer's keys and values (see the module header); every DynamicLayer method that works
    on the whole cache is overridden."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.k32 = self.v32 = None
        self.length = 0
        self.kt32, self.kt_len = None, 0   # the fused attention's transposed keys (transposed())

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self.k32 = torch.zeros(b, h, 0, d, device=self.device)
        self.v32 = torch.zeros(b, h, 0, d + 1, device=self.device)
        self.is_initialized = True

    @torch.inference_mode()
    def _reserve(self, n: int) -> None:
        """Room for n rows and the zero padding of their last chunk."""
        need = _round_up(max(n, 2))
        cap = self.k32.shape[2]
        if need <= cap:
            return
        cap = _round_up(max(need, 2 * cap, _MIN_CAPACITY))
        b, h, _, d = self.k32.shape
        k32 = self.k32.new_zeros(b, h, cap, d)
        v32 = self.v32.new_zeros(b, h, cap, d + 1)
        k32[:, :, :self.length] = self.k32[:, :, :self.length]
        v32[:, :, :self.length] = self.v32[:, :, :self.length]
        self.k32, self.v32 = k32, v32

    # transformers' view of the cache (DynamicLayer.keys / .values), made when read: a decode
    # step appends to every layer and seldom reads them.
    @property
    def keys(self):
        return None if self.k32 is None else self.k32[:, :, :self.length]

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("InvariantLayer.keys is a view of its fp32 keys: append() to it")

    @property
    def values(self):
        return None if self.v32 is None else self.v32[:, :, :self.length, :-1]

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("InvariantLayer.values is a view of its fp32 values: append() to it")

    def claim(self, m: int, like: torch.Tensor, keys: int = 0) -> int:
        """Room for m new rows, counted in the length, left for the caller to write (the fused
        attention writes them, fused.append_attend_many), and for reading `keys` keys (k32,
        v32 and the transposed copy kt32 cover them); like: new keys [b, h, m', d] (their dtype,
        device and shape are read, not their values). Returns where the m rows start."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
        n = self.length
        self._reserve(max(n + m, keys))
        self.length = n + m
        self.transposed()
        return n

    @torch.inference_mode()
    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write m new rows ([b, h, m, d], any float dtype) after the cached ones."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = self.length, key_states.shape[-2]
        self._reserve(n + m)
        self.k32[:, :, n:n + m] = key_states
        self.v32[:, :, n:n + m, :-1] = value_states
        self.v32[:, :, n:n + m, -1] = 1.0
        self.length = n + m

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' cache update: append, return every key and value in the input dtype."""
        first = not self.is_initialized or self.length == 0
        self.append(key_states, value_states)
        if first:
            return key_states, value_states
        return self.keys.to(key_states.dtype), self.values.to(value_states.dtype)

    def padded(self, n_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [b, h, n_pad, d], [V | 1] [b, h, n_pad, d + 1]) fp32 views, zero past the length;
        n_pad up to the length rounded up to whole chunks."""
        self._reserve(n_pad)
        return self.k32[:, :, :n_pad], self.v32[:, :, :n_pad]

    def transposed(self) -> tuple[torch.Tensor, int]:
        """The fused attention's copy of the keys, transposed by blocks (fused.py, csrc/attend.cpp):
        [b, h, ceil(C / 16), d, 16] fp32, and how many keys in it are valid. The attention writes
        the rest and records it in kt_len; crop lowers kt_len, growth starts a new copy."""
        b, h, cap, d = self.k32.shape
        blocks = -(-cap // fused.KEY_BLOCK)
        if self.kt32 is None or self.kt32.shape[2] < blocks:
            self.kt32, self.kt_len = self.k32.new_zeros(b, h, blocks, d, fused.KEY_BLOCK), 0
        return self.kt32, self.kt_len

    def rewritten(self, start: int) -> None:
        """Rows from `start` on were written through the views (tree.keep_path): the transposed
        copy holds them no longer."""
        self.kt_len = min(self.kt_len, start)

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    @torch.inference_mode()
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last -tokens_to_remove rows (a negative count, as DynamicLayer takes it)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        n = max(0, self.length + tokens_to_remove)
        self.k32[:, :, n:self.length] = 0
        self.v32[:, :, n:self.length] = 0
        self.length = n
        self.kt_len = min(self.kt_len, n)

    def reset(self) -> None:
        self.__init__()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("the invariant cache holds one sequence per generation")

    batch_select_indices = reorder_cache = batch_repeat_interleave


def new_cache(model):
    """An empty cache for a model in the M-invariant mode with the lean forward."""
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    cache.layers = [InvariantLayer() for _ in range(model.config.num_hidden_layers)]
    return cache


def is_invariant_cache(cache) -> bool:
    layers = getattr(cache, "layers", None)
    return bool(layers) and isinstance(layers[0], InvariantLayer)
