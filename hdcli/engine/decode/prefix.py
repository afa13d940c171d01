"""Exact prefix caching (`hd serve --prefix-cache-mb`): the keys and values of prompts and answers
kept after a request, so that a later prompt starting with the same tokens (the next turn of a
chat, a shared system prompt) restores them instead of computing them again.

Exact: a restored prefix is torch.equal to what its prefill would write, so answers are
bit-identical with and without the cache. It rests on the M-invariant mode (invariant.py): a
row's keys and values depend only on its own tokens, never on how many rows its forward had or
where a forward began. Every prefill in the M-invariant mode, cache or not (loop.Decoder._prefill),
goes through the same path, causal pieces
of at most invariant.MAX_ROWS rows on the cache so far (`prefill_pieces`), the widths the mode
calibrates and checks: a prompt wider than that on an empty cache would otherwise take one forward
of all its rows, where the SDPA attention (the fused attention off) and Linear calls over more rows
than the mode probes are not covered by its guarantee. A generation's own rows (verified in tree
forwards, moved next to their parents by tree.keep_path) are those rows too: at the end of a
generation the cache holds history[:-1], as a prefill of those tokens would write it
(tests/test_prefix.py checks both with torch.equal, on the bundled model and on a tiny Gemma 3 past
its sliding window). So the cache is on only for hd's own forward in the M-invariant mode
(`why_not`); elsewhere `hd serve` says so at start and prefills as before.

Layout: per scope (a Request's scope, serve's tenants: requests may reuse only what requests of
the same scope stored; "" is one scope shared by all), a radix tree of token segments, each node holding its
segment's keys and values per block ([1, kv heads, rows, head dim] in the cache's stored dtype,
copies). A prompt shared by several requests (a system prompt) is stored once, each request's
own continuation in a child. Lookup walks the tree comparing token arrays; restore copies the
path's rows into a new kvcache.Cache (`append`: its transposed-key copy for the fused attention
is then written by the attention itself, from kt_len 0).

Bounded: nodes' bytes (keys, values, tokens) count against max_bytes; past it the least recently
used leaves go first (a node is used when a lookup or a store walks through it, and a parent is
touched whenever its children are, so a leaf is always evicted before its ancestors).

Invariants
  * Used from one thread (the server's decode loop); the counters are read from others.
  * A scope never sees another scope's nodes (the lookup's timing would tell what others sent).
  * Stored rows are copies, never views of a live cache.
"""
from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np
import torch

from ..kernels import invariant


def why_not(model) -> str | None:
    """Why the prefix cache cannot serve this model (None: it can)."""
    if model.numerics is None:   # a TargetModel without a Numerics record: transformers' forward
        return "the model runs on transformers' forward, not hd's own"
    if not model.invariant:
        return "the model is not in the M-invariant mode (a prefix's keys could depend on how it was split)"
    return None


@torch.inference_mode()
def prefill_pieces(model, ids: Sequence[int], cache, start: int = 0) -> None:
    """Append the keys and values of ids[start:] to a cache holding ids[:start], in causal pieces
    of at most invariant.MAX_ROWS rows (the split-invariant prefill; module header)."""
    device = model.device
    for a in range(start, len(ids), invariant.MAX_ROWS):
        piece = torch.tensor([list(ids[a:a + invariant.MAX_ROWS])], dtype=torch.long, device=device)
        model.prefill(piece, cache)


class _Node:
    __slots__ = ("tokens", "kv", "children", "parent", "used", "nbytes")

    def __init__(self, tokens: np.ndarray, kv: list, parent: "_Node | None"):
        self.tokens, self.kv, self.parent = tokens, kv, parent
        self.children: dict[int, _Node] = {}
        self.used = 0
        self.nbytes = tokens.nbytes + sum(k.nbytes + v.nbytes for k, v in kv)


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PrefixCache:
    """Prefix keys and values of past requests, by scope, bounded by bytes (module header).
    min_tokens: shorter prefixes are neither stored nor restored (restoring copies every block)."""

    def __init__(self, max_bytes: int, min_tokens: int = 16):
        if max_bytes < 0:
            raise ValueError("the prefix cache's size must be >= 0")
        self.max_bytes, self.min_tokens = int(max_bytes), max(1, int(min_tokens))
        self._roots: dict[str, _Node] = {}
        self._tick = itertools.count(1)
        self.bytes = self._entries = 0
        self.counts = {"lookups": 0, "hits": 0, "hit_tokens": 0, "stored_tokens": 0, "evicted_tokens": 0}

    # ------------------------------------------------------------ the decode loop's calls

    def prefill(self, model, ids: Sequence[int], cache, scope: str = "") -> int:
        """Fill an empty cache with ids: the longest prefix this scope has stored restored, the
        rest computed (prefill_pieces), then the whole stored for later requests. Returns how many
        tokens came from the cache."""
        start = self.restore(model, scope, ids, cache)
        prefill_pieces(model, ids, cache, start)
        self.store(scope, ids, cache)
        return start

    @torch.inference_mode()
    def restore(self, model, scope: str, ids: Sequence[int], cache) -> int:
        """Copy the longest stored prefix of ids (at least min_tokens, at most all of them) into
        the empty cache of `model`; returns its length (0: nothing restored)."""
        self.counts["lookups"] += 1
        arr = np.asarray(ids, dtype=np.int64)
        n, path = self._walk(scope, arr)
        if n < self.min_tokens:
            return 0
        def like(i):   # what a prefill hands block i first: its keys' shape in the model's dtype
            k = path[0][0].kv[i][0]
            return torch.empty(k.shape[:2] + (0, k.shape[3]), dtype=model.dtype, device=k.device)
        k0 = path[0][0].kv[0][0]
        layers = cache.layers
        layers[0].lazy_initialization(like(0))   # the layer as a prefill would begin it
        if layers[0].kbuf.dtype != k0.dtype:   # stored under another attention (invariant.pinned switched it)
            self.clear()
            layers[0].__init__()
            return 0
        tick = next(self._tick)
        for node, _ in path:
            node.used = tick
        for i, layer in enumerate(layers):
            if not layer.is_initialized:
                layer.lazy_initialization(like(i))
            layer._reserve(n)
            for node, k in path:
                layer.append(node.kv[i][0][:, :, :k], node.kv[i][1][:, :, :k])
        self.counts["hits"] += 1
        self.counts["hit_tokens"] += n
        return n

    @torch.inference_mode()
    def store(self, scope: str, tokens: Sequence[int], cache) -> None:
        """Keep the cache's rows of tokens (rows 0..len - 1, as far as the cache holds them):
        only the rows past what this scope already holds are copied."""
        n = min(len(tokens), cache.get_seq_length())
        if n < self.min_tokens or self.max_bytes == 0:
            return
        arr = np.asarray(tokens[:n], dtype=np.int64)
        have, path = self._walk(scope, arr)
        tick = next(self._tick)
        for node, _ in path:
            node.used = tick
        if have < n:
            parent = self._roots.setdefault(scope, _Node(np.zeros(0, dtype=np.int64), [], None))
            if path:
                parent, k = path[-1]
                if k < len(parent.tokens):
                    self._split(parent, k)
            kv = [(layer.keys[:, :, have:n].clone(), layer.values[:, :, have:n].clone()) for layer in cache.layers]
            leaf = _Node(arr[have:].copy(), kv, parent)
            leaf.used = tick
            parent.children[int(arr[have])] = leaf
            self.bytes += leaf.nbytes
            self.counts["stored_tokens"] += n - have
        self._evict()
        self._entries = sum(1 for node in self._nodes() if not node.children)

    # ------------------------------------------------------------ reading

    def summary(self) -> dict:
        """Counters for /metrics and the server's summary."""
        return {"max_bytes": self.max_bytes, "bytes": self.bytes, "entries": self.entries(), **self.counts}

    def entries(self) -> int:
        """Stored sequences (leaves of all scopes' trees), as of the last store (other threads
        read it while the decode loop changes the trees)."""
        return self._entries

    def clear(self) -> None:
        self._roots.clear()
        self.bytes = self._entries = 0

    # ------------------------------------------------------------ the tree

    def _walk(self, scope: str, arr: np.ndarray) -> tuple[int, list[tuple[_Node, int]]]:
        """How many leading tokens of arr this scope holds, and the path: (node, tokens of its
        segment matched), the last possibly matched in part."""
        node, pos, path = self._roots.get(scope), 0, []
        while node is not None and pos < len(arr):
            child = node.children.get(int(arr[pos]))
            if child is None:
                break
            k = _common(child.tokens, arr[pos:pos + len(child.tokens)])
            path.append((child, k))
            pos += k
            if k < len(child.tokens):
                break
            node = child
        return pos, path

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut node's segment after k tokens: the first k stay in it (returned), the rest go to a
        new child holding node's children (copies, so that neither keeps the other's storage)."""
        rest = _Node(node.tokens[k:].copy(), [(a[:, :, k:].clone(), b[:, :, k:].clone()) for a, b in node.kv], node)
        rest.children, rest.used = node.children, node.used
        for c in rest.children.values():
            c.parent = rest
        before = node.nbytes
        node.tokens = node.tokens[:k].copy()
        node.kv = [(a[:, :, :k].clone(), b[:, :, :k].clone()) for a, b in node.kv]
        node.children = {int(rest.tokens[0]): rest}
        node.nbytes = node.tokens.nbytes + sum(a.nbytes + b.nbytes for a, b in node.kv)
        self.bytes += node.nbytes + rest.nbytes - before
        return node

    def _nodes(self):
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _evict(self) -> None:
        """Drop least recently used leaves until the bytes fit."""
        while self.bytes > self.max_bytes:
            leaf = min((n for n in self._nodes() if not n.children), key=lambda n: n.used, default=None)
            if leaf is None:
                break
            del leaf.parent.children[int(leaf.tokens[0])]
            self.bytes -= leaf.nbytes
            self.counts["evicted_tokens"] += len(leaf.tokens)
        for scope in [s for s, root in self._roots.items() if not root.children]:
            del self._roots[scope]
