"""Building the statistics DB: n-gram continuations counted over a corpus, pruned to top-K.

For every position i of every document and every n in [min_n, max_n], the key is the n tokens
ending at i and the continuation is the next up-to-`draft_len` tokens of the same document. The
default draft_len is 1 (next-token counts, drafted by a greedy walk): docs/stats-db.md has the
measurement against stored 8-token continuations. We
count (key, continuation) pairs, then keep per key the `top_k` most frequent continuations with
count >= `min_count` (ties broken by tokens, so every build of the same corpus is identical).

Memory stays bounded for corpora larger than RAM: documents are tokenised into chunks of about
`chunk_tokens` tokens; each chunk is counted with numpy (sort + run-length), and its partial
counts are spilled to `partitions` files on disk by key hash. At the end each partition is loaded
alone, its counts summed across chunks, pruned and written. Peak memory ~ one chunk's arrays or
one partition, whichever is larger. One long document is bounded alike: tokenised in pieces of
PIECE_CHARS characters cut at whitespace, counted in windows of chunk_tokens tokens that overlap
by max_n - 1 and draft_len tokens (exactly the whole document's counts; _token_chunks). Pairs are identified by 64-bit hashes of their tokens
(collision odds ~1e-5 for 10^8 distinct pairs; a collision can only change a draft, never output).

Sharding: `shard=(i, n)` counts the documents whose index % n == i and keeps every continuation
(no pruning, flagged in the header), so `merge()` of all shards sums exact counts and prunes
once: the result equals a single build.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from .. import __version__

from . import atomic, codec, fingerprint, stores
from .header import read_header, write_header
from ..errors import HdError

DEFAULTS = dict(min_n=1, max_n=4, draft_len=1, top_k=4, min_count=2)
CHUNK_TOKENS = 4_000_000  # tokens counted in memory at once (a chunk's arrays bound peak memory)
PIECE_CHARS = 1 << 18     # a longer document is tokenised in pieces of at most this many characters
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _hash_rows(m: np.ndarray, salt: int) -> np.ndarray:
    """64-bit hash of each row of an int array (wrapping multiply-add, then a splitmix finaliser)."""
    with np.errstate(over="ignore"):
        h = np.full(m.shape[0], np.uint64(salt) * _MIX + np.uint64(1), dtype=np.uint64)
        for c in range(m.shape[1]):
            h = h * _MIX + (m[:, c].astype(np.uint64) + np.uint64(2))
        h ^= h >> np.uint64(31)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(29)
    return h


def _reduce(hkey, hcont, count, *cols):
    """Sum counts of equal (hkey, hcont) pairs; keep the first row's other columns."""
    order = np.lexsort((hcont, hkey))
    hkey, hcont, count = hkey[order], hcont[order], count[order]
    new = np.ones(len(hkey), dtype=bool)
    new[1:] = (hkey[1:] != hkey[:-1]) | (hcont[1:] != hcont[:-1])
    starts = np.flatnonzero(new)
    summed = np.add.reduceat(count, starts) if len(starts) else count[:0]
    return (hkey[starts], hcont[starts], summed) + tuple(c[order][starts] for c in cols)


def count_chunk(docs: list[list[int]], min_n: int, max_n: int, draft_len: int):
    """Partial counts of one chunk: arrays (hkey, hcont, count, n, key[max_n], cont[draft_len]),
    tokens as int32 with -1 as padding."""
    from numpy.lib.stride_tricks import sliding_window_view as windows
    parts, context = [], []
    at = 0
    for d in docs:
        if isinstance(d, Window):   # a long document's part: keys end in [lo, hi) only
            context += [(at, at + d.lo), (at + d.hi, at + len(d.tokens))]
            d = d.tokens
        parts.append(np.asarray(d, dtype=np.int64))
        parts.append(np.array([-1], dtype=np.int64))  # document boundary
        at += len(d) + 1
    t = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    size = len(t)
    counted = None
    if context:
        counted = np.ones(size, dtype=bool)
        for a, b in context:
            counted[a:b] = False
    padded = np.concatenate([t, np.full(draft_len + max_n, -1, dtype=np.int64)])
    conts = windows(padded[1:], draft_len)[:size]          # conts[i] = t[i+1 : i+1+draft_len]
    out = []
    for n in range(min_n, max_n + 1):
        if size < n:
            continue
        keys = windows(t, n)                                 # keys[j] = t[j : j+n], ends at j+n-1
        ends = np.arange(n - 1, size)
        ok = (keys.min(axis=1) >= 0) & (conts[ends, 0] >= 0)
        if counted is not None:
            ok &= counted[ends]
        ends = ends[ok]
        k = keys[ends - n + 1].astype(np.int32)
        c = conts[ends].astype(np.int32)
        c[np.maximum.accumulate(c < 0, axis=1)] = -1         # cut at the document boundary
        kpad = np.full((len(k), max_n), -1, dtype=np.int32)
        kpad[:, :n] = k
        hk, hc = _hash_rows(k, n), _hash_rows(c, 0)
        nn = np.full(len(k), n, dtype=np.uint8)
        out.append(_reduce(hk, hc, np.ones(len(k), dtype=np.int64), nn, kpad, c))
    if not out:
        z = np.zeros(0, dtype=np.uint64)
        return (z, z, np.zeros(0, np.int64), np.zeros(0, np.uint8),
                np.zeros((0, max_n), np.int32), np.zeros((0, draft_len), np.int32))
    return tuple(np.concatenate([o[i] for o in out]) for i in range(6))


def _select(hkey, count, cont, top_k: int, min_count: int):
    """Indices of the rows to keep: per key, count >= min_count, the top_k by count then tokens.
    Rows must be grouped by hkey. Returns (kept indices in output order, key totals per row)."""
    if len(hkey) == 0:
        return np.zeros(0, dtype=np.int64), count
    starts = np.flatnonzero(np.r_[True, hkey[1:] != hkey[:-1]])
    totals = np.repeat(np.add.reduceat(count, starts), np.diff(np.r_[starts, len(hkey)]))
    ucont = cont.view(np.uint32)                             # -1 padding sorts last, like PAD
    order = np.lexsort(tuple(ucont[:, j] for j in range(cont.shape[1] - 1, -1, -1)) + (-count, hkey))
    hk = hkey[order]
    first = np.r_[True, hk[1:] != hk[:-1]]
    group_start = np.maximum.accumulate(np.where(first, np.arange(len(hk)), 0))
    rank = np.arange(len(hk)) - group_start
    keep = count[order] >= min_count
    if top_k > 0:
        keep &= rank < top_k
    return order[keep], totals


def _write_rows(writer, hkey, n, key, cont, count, totals, idx, draft_len):
    """Write kept rows `idx` (grouped by key, best first) as one value per key."""
    if len(idx) == 0:
        return
    hk = hkey[idx]
    bounds = np.flatnonzero(np.r_[True, hk[1:] != hk[:-1], True])
    rows = np.full((len(idx), draft_len + 2), codec.PAD, dtype="<u4")
    c = cont[idx]
    rows[:, 0] = count[idx]
    rows[:, 1] = (c >= 0).sum(axis=1)
    rows[:, 2:] = c.view(np.uint32)
    for a, b in zip(bounds[:-1], bounds[1:]):
        i = idx[a]
        kb = key[i, :n[i]].astype("<u4").tobytes()
        writer.put(kb, np.r_[np.uint32(totals[i]), rows[a:b].ravel()].astype("<u4").tobytes())


class _Spill:
    """Partial counts on disk, partitioned by key hash."""

    def __init__(self, parent: Path, partitions: int):
        atomic.sweep_stale(parent, ".hd-spill-")
        self.dir = Path(tempfile.mkdtemp(prefix=f".hd-spill-{os.getpid()}-", dir=parent))
        self.partitions, self.chunks = partitions, 0

    def add(self, arrays) -> None:
        for p, piece in enumerate(_split(arrays, self.partitions)):
            np.savez(self.dir / f"p{p}-c{self.chunks}.npz", *piece)
        self.chunks += 1

    def load(self, p: int):
        files = [np.load(self.dir / f"p{p}-c{c}.npz") for c in range(self.chunks)]
        return _concat([tuple(f[f"arr_{i}"] for i in range(6)) for f in files])

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _split(arrays, partitions: int) -> list[tuple]:
    """Rows of partial counts split by key hash: every key's rows land in one partition (the spill
    files of build() and the map tasks of a cluster build split alike)."""
    part = (arrays[0] % np.uint64(partitions)).astype(np.int64)
    return [tuple(a[part == q] for a in arrays) for q in range(partitions)]


def _concat(pieces: list[tuple]) -> tuple:
    return tuple(np.concatenate([p[i] for p in pieces]) for i in range(6))


def _write_partition(writer, rows: tuple, top_k: int, min_count: int, draft_len: int) -> int:
    """Sum one partition's partial counts, prune them and write one value per key. Returns the
    continuations kept."""
    hkey, hcont, count, n, key, cont = _reduce(*rows)
    idx, totals = _select(hkey, count, cont, top_k, min_count)
    _write_rows(writer, hkey, n, key, cont, count, totals, idx, draft_len)
    return len(idx)


def split_text(text: str, limit: int = PIECE_CHARS) -> Iterator[str]:
    """A long text in pieces of at most `limit` characters, each cut made where a run of
    whitespace starts: the tokenizers hd's models use split words at whitespace first, so the
    pieces tokenise to the tokens of the whole text. A stretch of `limit` characters with no
    whitespace in it is cut at the limit (the only cut that may change a token)."""
    start = 0
    while len(text) - start > limit:
        cut = start + limit
        while cut > start and not (text[cut].isspace() and not text[cut - 1].isspace()):
            cut -= 1
        if cut == start:
            cut = start + limit
        yield text[start:cut]
        start = cut
    yield text[start:]


class Window:
    """Part of a document too long to count at once (more than chunk_tokens tokens): tokens are
    the part with up to max_n - 1 tokens before it (its first keys' context) and up to draft_len
    after it (its last continuations); count_chunk counts only keys that end in [lo, hi), so the
    windows of a document count exactly what the whole document would."""

    def __init__(self, tokens: np.ndarray, lo: int, hi: int, first: bool):
        self.tokens, self.lo, self.hi, self.first = tokens, lo, hi, first

    def __len__(self) -> int:   # the document's own tokens in it
        return self.hi - self.lo


def documents_in(chunk) -> int:
    return sum(1 for d in chunk if not isinstance(d, Window) or d.first)


def _windows(pieces: list, size: int, before: int, after: int):
    """A document read in pieces (token lists): whole where it has at most `size` tokens, else
    as Windows of `size` tokens each."""
    if len(pieces) == 1 and len(pieces[0]) <= size:
        yield pieces[0]
        return
    t = np.concatenate([np.asarray(p, dtype=np.int32) for p in pieces])
    if len(t) <= size:
        yield t
        return
    for a in range(0, len(t), size):
        b = min(a + size, len(t))
        lo = max(0, a - before)
        yield Window(t[lo:min(len(t), b + after)], a - lo, b - lo, a == 0)


def _token_chunks(texts: Iterable[str], tokenizer, chunk_tokens: int, batch: int = 256,
                  num_proc: int = 1, on_batch: Callable[[int, int], None] | None = None,
                  overlap: tuple[int, int] = (DEFAULTS["max_n"] - 1, DEFAULTS["draft_len"])) -> Iterator[list]:
    """Tokenise documents in batches and group them into chunks of about chunk_tokens tokens.
    A document longer than PIECE_CHARS is tokenised in pieces (split_text), each its own batch,
    so one document never holds a tokenizer's memory for millions of tokens and an interrupt
    acts between pieces; one of more than chunk_tokens tokens comes as Windows (overlap: the
    counts' max_n - 1 and draft_len), so its counts are exact and bounded alike."""
    def batches():
        buf, joins, chars = [], [], 0
        for text in texts:
            long = tokenizer is not None and len(text) > PIECE_CHARS
            for j, piece in enumerate(split_text(text, PIECE_CHARS) if long else (text,)):
                buf.append(piece)
                joins.append(j > 0)   # continues the document before it
                chars += len(piece)
                if len(buf) >= batch or chars >= PIECE_CHARS:
                    yield buf, joins
                    buf, joins, chars = [], [], 0
        if buf:
            yield buf, joins

    pool = None
    if num_proc > 1 and tokenizer is not None:
        # forkserver, not fork: a fork copies a process whose other threads (the tokenizer's Rust
        # pool, torch's OpenMP, a progress bar's monitor, pytest-xdist's) may hold a lock, and a
        # worker hung on one (seen once in the suite). The tokenizer goes to each worker once.
        import multiprocessing as mp
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        pool = ctx.Pool(num_proc, initializer=_start_encoder, initargs=(tokenizer,))
        encoded = pool.imap(_encode_in_worker, batches())
    else:   # tokenizer None: the texts are token lists already
        encoded = map(_as_lists if tokenizer is None else _Encoder(tokenizer), batches())

    def docs():
        pending: list = []   # the pieces of the document being read
        for ids, joins in encoded:
            if on_batch:
                on_batch(joins.count(False), sum(map(len, ids)))
            for d, join in zip(ids, joins):
                if not join and pending:
                    yield from _windows(pending, chunk_tokens, *overlap)
                    pending = []
                pending.append(d)
        if pending:
            yield from _windows(pending, chunk_tokens, *overlap)

    chunk, size = [], 0
    try:
        for d in docs():
            chunk.append(d)
            size += len(d)
            if size >= chunk_tokens:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk
    finally:
        if pool is not None:
            pool.terminate()


def _as_lists(batch):
    return list(batch[0]), batch[1]


_WORKER_ENCODER = None   # a tokenizing worker's _Encoder (_start_encoder)


def _start_encoder(tokenizer) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = _Encoder(tokenizer)


def _encode_in_worker(batch):
    return _WORKER_ENCODER(batch)


class _Encoder:
    def __init__(self, tokenizer):
        self.tok = tokenizer

    def __call__(self, batch: tuple[list[str], list[bool]]) -> tuple[list[list[int]], list[bool]]:
        texts, joins = batch
        return self.tok(texts, add_special_tokens=False)["input_ids"], joins


def check_params(min_n: int, max_n: int, draft_len: int, top_k: int, min_count: int) -> None:
    if not 1 <= min_n <= max_n <= codec.MAX_KEY_TOKENS:
        raise HdError(f"n range needs 1 <= --min-n <= --max-n <= {codec.MAX_KEY_TOKENS}, "
                      f"got {min_n}..{max_n}")
    if draft_len > codec.MAX_DRAFT_LEN:
        raise HdError(f"--draft-len is at most {codec.MAX_DRAFT_LEN}")
    if draft_len < 1 or top_k < 0 or min_count < 1:
        raise HdError("--draft-len and --min-count must be >= 1 and --top-k >= 0 (0: keep all)")


def build(texts: Iterable[str], out: str | Path, tokenizer, model_name: str, *,
          min_n: int = 1, max_n: int = 4, draft_len: int = 1, top_k: int = 4, min_count: int = 2,
          shard: tuple[int, int] = (0, 1), chunk_tokens: int = CHUNK_TOKENS, partitions: int = 8,
          num_proc: int = 1, overwrite: bool = False, extra_header: dict | None = None,
          progress: Callable[[int, int], None] | None = None, tokenized: bool = False,
          kind: str = "stats", sequences: Iterable[list[int]] = ()) -> dict:
    """Count n-gram continuations of `texts` into a new store at `out`; returns its header.
    tokenized: `texts` are token-id lists already (the model DB's samples).
    sequences: token lists also kept whole (a model DB's answers, codec.SEQ_PREFIX records).
    progress(documents, tokens) is called after every tokenised batch."""
    check_params(min_n, max_n, draft_len, top_k, min_count)
    sharded = shard[1] > 1
    if sharded:  # shards keep exact counts; merge prunes once
        top_k, min_count = 0, 1
    t0 = time.time()
    out = Path(out)
    with atomic.writing(out, overwrite=overwrite) as writer:
        spill = _Spill(out.parent, partitions)
        try:
            tokens = docs = 0
            for chunk in _token_chunks(texts, None if tokenized else tokenizer, chunk_tokens,
                                       num_proc=num_proc, on_batch=progress, overlap=(max_n - 1, draft_len)):
                docs += documents_in(chunk)
                tokens += sum(map(len, chunk))
                spill.add(count_chunk(chunk, min_n, max_n, draft_len))
            if docs == 0:
                raise HdError("the corpus has no documents (empty files, or every record empty)")
            pairs = sum(_write_partition(writer, spill.load(p), top_k, min_count, draft_len)
                        for p in range(partitions))
        finally:
            spill.remove()
        kept = 0
        for seq in sequences:
            if len(seq):
                writer.put(codec.sequence_key(kept), np.asarray(seq, dtype="<u4").tobytes())
                kept += 1
        if kept:
            extra_header = {**(extra_header or {}), "sequences": kept}
        header = writer.commit(header_for(
            kind=kind, model_name=model_name, tokenizer=tokenizer, min_n=min_n, max_n=max_n,
            draft_len=draft_len, top_k=top_k, min_count=min_count, shard=shard, documents=docs,
            tokens=tokens, continuations=pairs, seconds=time.time() - t0, extra=extra_header))
    return header


def count_partitions(chunks: Iterable[list[list[int]]], partitions: int, *, min_n: int, max_n: int,
                     draft_len: int) -> tuple[list[tuple | None], int, int]:
    """The map step of a distributed build: partial counts of chunks of tokenised documents,
    split by key hash into `partitions` as build() splits its spill files, and summed per
    partition. Returns (arrays per partition, None where empty; documents; tokens)."""
    parts: list[list[tuple]] = [[] for _ in range(partitions)]
    docs = tokens = 0
    for chunk in chunks:
        docs += documents_in(chunk)
        tokens += sum(map(len, chunk))
        for q, piece in enumerate(_split(count_chunk(chunk, min_n, max_n, draft_len), partitions)):
            parts[q].append(piece)
    return [_reduce(*_concat(ps)) if ps else None for ps in parts], docs, tokens


class _Records:
    """A writer stand-in that keeps (key, value) records in memory (one partition's)."""

    def __init__(self):
        self.records: list[tuple[bytes, bytes]] = []

    def put(self, key: bytes, value: bytes) -> None:
        self.records.append((key, value))


def select_partition(pieces: list, *, top_k: int, min_count: int, draft_len: int) -> list[tuple[bytes, bytes]]:
    """The reduce step: one partition's partial counts from every map task, summed and pruned
    exactly as build() does. Returns the partition's records (key bytes, value bytes)."""
    pieces = [p for p in pieces if p is not None and len(p[0])]
    out = _Records()
    if pieces:
        _write_partition(out, _concat(pieces), top_k, min_count, draft_len)
    return out.records


def header_for(*, kind: str, model_name: str, tokenizer, min_n: int, max_n: int, draft_len: int,
               top_k: int, min_count: int, shard: tuple[int, int], documents: int, tokens: int,
               continuations: int, seconds: float, extra: dict | None = None) -> dict:
    """The header of a statistics or model DB (what build() and a cluster build store)."""
    return {"kind": kind, "model": model_name,
            "tokenizer_fingerprint": fingerprint.tokenizer_fingerprint(tokenizer),
            "vocab_size": fingerprint.tokenizer_vocab_size(tokenizer),
            "n_range": [min_n, max_n], "draft_len": draft_len, "top_k": top_k,
            "min_count": min_count, "pruned": shard[1] == 1, "shard": list(shard),
            "documents": documents, "tokens": tokens, "continuations": continuations,
            "build_seconds": round(seconds, 2), "tool_version": __version__, **(extra or {})}


def _prune(counts: dict, top_k: int, min_count: int, draft_len: int) -> list[tuple[list[int], int]]:
    """{continuation: count} -> [(continuation, count)] with count >= min_count, best first, the
    top_k (0: all). Ties by tokens padded with PAD: the order _select gives in a build."""
    pad = lambda c: tuple(c) + (codec.PAD,) * (draft_len - len(c))
    ranked = sorted(((c, k) for c, k in counts.items() if k >= min_count), key=lambda ck: (-ck[1], pad(ck[0])))
    return [(list(c), k) for c, k in (ranked[:top_k] if top_k > 0 else ranked)]


def merge(inputs: list[str | Path], out: str | Path, *, top_k: int | None = None,
          min_count: int | None = None, overwrite: bool = False, extra_header: dict | None = None,
          allow_same_sources: bool = False) -> dict:
    """Sum the counts of several stores key by key and prune again. Merging the shards of one
    build (unpruned) gives exactly the single build; merging pruned DBs sums what they kept;
    model DBs' answers are kept whole, each once (_merge_answers).
    Inputs counted from the same source file (other than distinct shards of one build) are
    refused unless allow_same_sources: their sum counts that file's documents twice."""
    if len(inputs) < 1:
        raise HdError("merge-stats needs at least one input DB")
    t0 = time.time()
    dbs = [stores.Store(p) for p in inputs]
    h0 = dbs[0].header
    meaning = _check_mergeable(dbs)
    if not allow_same_sources:
        _check_sources_apart(dbs)
    shard_k = [db.header.get("top_k", DEFAULTS["top_k"]) for db in dbs if db.header.get("pruned")]
    top_k = top_k if top_k is not None else (min(shard_k) if shard_k else DEFAULTS["top_k"])
    min_count = (min_count if min_count is not None else
                 max([db.header.get("min_count", DEFAULTS["min_count"]) for db in dbs
                      if db.header.get("pruned")] or
                     [DEFAULTS["min_count"]]))
    draft_len = int(h0["draft_len"])
    pairs = 0
    with atomic.writing(out, overwrite=overwrite) as writer:
        # check=True: each input's digest is recomputed as it is read; a damaged input raises
        # before commit, so nothing reaches `out`
        merged = heapq.merge(*(db.items(check=True) for db in dbs), key=lambda kv: kv[0])
        current, total, counts = None, 0, {}

        def flush():
            nonlocal pairs
            if current is None:
                return
            ranked = _prune(counts, top_k, min_count, draft_len)
            if ranked:
                pairs += len(ranked)
                writer.put(current, codec.encode_value(total, ranked, draft_len))
        for key, (tot, entries) in merged:
            if key != current:
                flush()
                current, total, counts = key, 0, {}
            total += tot
            for cont, cnt in entries:
                counts[tuple(cont)] = counts.get(tuple(cont), 0) + cnt
        flush()
        answers = _merge_answers(dbs, writer)
        header = {**h0, **answers, "top_k": top_k, "min_count": min_count, "pruned": True, "shard": [0, 1],
                  "documents": sum(db.header.get("documents", 0) for db in dbs),
                  "tokens": sum(db.header.get("tokens", 0) for db in dbs),
                  "continuations": pairs, "merged_from": [str(p) for p in inputs], "counts": meaning,
                  # shards of one build each list every input: keep one entry per file
                  "sources": list({json.dumps(s, sort_keys=True): s for db in dbs
                                   for s in db.header.get("sources", [])}.values()),
                  "build_seconds": round(time.time() - t0, 2), "tool_version": __version__,
                  **(extra_header or {})}
        header = writer.commit(header)
    for db in dbs:
        db.close()
    return header


def _merge_answers(dbs: list, writer) -> dict:
    """Copy the inputs' answers kept whole (model DBs'): each distinct answer once, the first
    input's first; a tenant's answers under their scope tag (the same answer of two tenants is
    kept for each). Returns the header fields that count them, and the learning figures summed."""
    seen: set = set()
    counts = {"sequences": 0, "scoped_sequences": 0}
    for db in dbs:
        for scope, tokens in db.answer_records():
            ident = (scope, hashlib.blake2b(tokens, digest_size=16).digest())
            if ident in seen:
                continue
            seen.add(ident)
            field = "sequences" if scope is None else "scoped_sequences"
            writer.put(codec.sequence_key(counts[field], scope), tokens)
            counts[field] += 1
    fields = {**counts, "learned_tokens": 0, "learned_updates": 0}
    return {f: counts.get(f, sum(db.header.get(f, 0) for db in dbs)) for f in fields
            if counts.get(f) or any(f in db.header for db in dbs)}


def _check_mergeable(dbs: list) -> str:
    """Refuse inputs whose sum would be wrong counts; return what the merged counts mean."""
    h0, first = dbs[0].header, dbs[0].path
    seen: dict = {}
    for db in dbs:
        h = db.header
        for field in ("tokenizer_fingerprint", "n_range", "draft_len"):
            if h.get(field) != h0.get(field):
                raise HdError(f"cannot merge {db.path} with {first}: their {field} differ")
        if h.get("kind", "stats") != h0.get("kind", "stats"):
            raise HdError(f"cannot merge {db.path} (a {h.get('kind', 'stats')} DB) with {first} (a "
                          f"{h0.get('kind', 'stats')} DB): merge DBs of one kind")
        same = [os.path.realpath(db.path), h.get("content_digest")]
        for ident in same:
            if ident is not None and ident in seen:
                raise HdError(f"{db.path} and {seen[ident]} are the same DB: merging it twice would "
                              "double its counts; pass each input once")
        for ident in same:
            if ident is not None:
                seen[ident] = db.path
    shards = [db for db in dbs if not db.header.get("pruned", True)]
    pruned = [db for db in dbs if db.header.get("pruned", True)]
    if shards and pruned:
        raise HdError(f"cannot merge {pruned[0].path} (pruned to top-K) with {shards[0].path} (an "
                      "unpruned shard): the sum would miss what the pruned DB dropped. Merge the "
                      "shards on their own, then merge that result with other pruned DBs")
    if not shards:
        return "approximate: sums of pruned DBs (continuations a DB dropped are not counted)"
    ns = {tuple(db.header.get("shard", (0, 1)))[1] for db in shards}
    got = sorted(tuple(db.header.get("shard", (0, 1)))[0] for db in shards)
    if len(ns) == 1 and got == list(range(next(iter(ns)))):
        return f"exact: all {len(got)} shards of one build (equals the single build)"
    n = max(ns)
    return (f"exact sums of {len(got)} shards ({', '.join(str(i) for i in got)} of {n}): "
            "not every shard of one build is here")


def _check_sources_apart(dbs: list) -> None:
    """Refuse two inputs counted from one source file (the header's `sources`: path, bytes and
    sha256 per file read), unless they are distinct shards of one build (each shard counts its
    own documents of every file)."""
    seen: dict = {}   # source identity -> (db, its shard)
    for db in dbs:
        h = db.header
        shard = tuple(h.get("shard", (0, 1))) if not h.get("pruned", True) else None
        for src in h.get("sources", []):
            ident = src.get("sha256") or src.get("path")
            if ident is None:
                continue
            other, other_shard = seen.get(ident, (None, None))
            apart = (shard is not None and other_shard is not None and shard[1] == other_shard[1]
                     and shard[0] != other_shard[0])
            if other is not None and other is not db and not apart:
                name = Path(str(src.get("path", "a source"))).name
                raise HdError(f"{other.path} and {db.path} were both counted from {name} (same "
                              "contents): merging them counts its documents twice. Merge the shards "
                              "of one build (hd build-stats --shard I/N), or pass --allow-same-sources "
                              "to sum them anyway")
            seen.setdefault(ident, (db, shard))


def add_counts(store: "stores.Store", docs: Iterable[list[int]], first_end: int = 0,
               answers: list[list[int]] = ()) -> int:
    """Add the n-gram continuations of `docs` (and `answers` whole, stores.put_sequences) to a
    writable store in ONE write transaction (atomic: a generation is learned whole or not at
    all; concurrent writers serialise on LMDB's lock, so no update is lost), re-pruning each
    touched key to the store's top_k. min_count is not applied: one generation rarely repeats an
    n-gram, and learning exists to keep what the model wrote recently. Keys end at positions
    >= first_end of each doc (earlier tokens serve as key context only). Returns keys touched."""
    h = store.header
    min_n, max_n = h["n_range"]
    draft_len, top_k = int(h["draft_len"]), int(h["top_k"])
    counts: dict[tuple, dict[tuple, int]] = {}
    learned = 0
    for d in docs:
        learned += len(d) - (first_end + 1 if first_end > 0 else 0)
        for i in range(max(0, first_end), len(d) - 1):
            cont = tuple(d[i + 1:i + 1 + draft_len])
            for n in range(min_n, min(max_n, i + 1) + 1):
                per = counts.setdefault(tuple(d[i - n + 1:i + 1]), {})
                per[cont] = per.get(cont, 0) + 1

    def write(txn):
        if answers:
            stores.put_sequences(txn, answers)
        header = read_header(txn)
        digest = int(header.get("content_digest", "0"), 16)  # additive: swap each key's share
        new_keys = 0
        for key, conts in counts.items():
            kb = codec.encode_key(key)
            old = txn.get(kb)
            if old is None:
                total, entries = 0, []
                new_keys += 1
            else:
                total, entries = codec.decode_value(old, draft_len)
                digest -= codec.record_hash(kb, old)
            merged = {tuple(c): k for c, k in entries}
            for c, k in conts.items():
                merged[c] = merged.get(c, 0) + k
            value = codec.encode_value(total + sum(conts.values()),
                                        _prune(merged, top_k, 1, draft_len), draft_len)
            txn.put(kb, value)
            digest += codec.record_hash(kb, value)
        if "content_digest" in header:  # DBs built before digests existed get none
            header["content_digest"] = codec.digest_hex(digest)
        header["keys"] = header.get("keys", 0) + new_keys
        header["learned_tokens"] = header.get("learned_tokens", 0) + learned
        header["learned_updates"] = header.get("learned_updates", 0) + 1
        write_header(txn, header)
    try:
        store.update(write)
    except codec.MalformedRecord as exc:   # nothing written: the transaction is aborted
        raise stores.damaged(store.path, exc) from None
    return len(counts)
