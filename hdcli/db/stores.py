"""The n-gram store: one LMDB file mapping a key of n tokens to its most frequent continuations.

Used by the statistics DB (corpus n-grams) and the model DB (the target's own n-grams).

Layout (one file, LMDB `subdir=False`):
  HEADER_KEY          -> JSON header (format version, tokenizer fingerprint, n range, draft length,
                         K, minimum count, sources, token count, build time, tool version, ...)
  key tokens (n x <u4) -> value: <u4 array [total, e_1, ..., e_m], each entry e_j is `width` =
                         draft_len + 2 words: [count, length, tok_1 .. tok_draft_len], unused token
                         slots PAD. Entries are sorted by count, descending; ties by tokens.
Invariants
  * n-gram keys are 4*n bytes and HEADER_KEY is not a multiple of 4 bytes long, so they never clash;
  * `total` counts every occurrence of the key that had a continuation, including continuations
    that were pruned (so count/total is the continuation's empirical probability);
  * the file at the output path is always complete: builds write `PATH.tmp-*` and rename it into
    place only after the last commit (os.replace is atomic on one filesystem); an interrupted
    build (Ctrl-C, SIGTERM) removes its own `PATH.tmp-*` files, a killed one leaves them to
    sweep_stale;
  * a file refused on open leaves no lock file that was not there before;
  * writes (--learn) go only into the file now at the DB's path: Store.update checks the file's
    identity (st_dev, st_ino) before and after each write transaction (Replaced);
  * a build never replaces a file it did not expect: without overwrite the rename is a hard link
    that fails if the output appeared during the build (another build racing to the same path);
    an output path that is a folder is refused;
  * a built file is packed: builds insert keys in hash order, which leaves B-tree pages about half
    full, so commit() copies the store in key order with MDB_APPEND into full pages (a built DB
    shrinks to about a third, for a copy of about a second);
  * the header's `content_digest` is the sum mod 2**128 of blake2b-128(len(key), key, value) over
    all records (header excluded): independent of page layout and build time, so two builds of the
    same counts have the same digest, and additive, so `--learn` keeps it current key by key.
    `verify()` recomputes it (with the file size, record shapes and key count); `merge` checks
    every input's digest before its output is renamed into place;
  * a file shorter than LMDB's last page (a truncated copy) is refused on open, before any page is
    touched: reading past the end of a memory map is SIGBUS, not an exception;
  * files are created with the mode the umask gives (0666 & ~umask), like any other output;
  * a model DB also holds the target's answers whole (what its suffix index drafts from,
    hdcli/drafting/model.py): SEQ_PREFIX + 8-byte big-endian index -> <u4 tokens. The key is 18
    bytes (not a multiple of 4: never an n-gram key), indices run 0 .. header["sequences"] - 1
    in the order the answers were written, and they count in `keys` and the digest like any record;
  * answers learned for one tenant (`hd serve --learn-scope key|user`, hdcli/serve/tenants.py) are
    kept apart: SCOPED_SEQ_PREFIX + 8-byte scope tag + 8-byte index (26 bytes), indices from
    header["scoped_sequences"]; sequences() never returns them, sequences(scope=tag) only them.
Reads go through LMDB's memory map with `buffers=True`: a lookup parses the mapped bytes in place.
A damaged page found while reading raises HdError (one line naming the file and `hd db verify`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import numpy as np

from .. import inputs
from ..errors import HdError
from .codec import (SCOPED_SEQ_PREFIX, SEQ_PREFIX, MalformedRecord, decode_value, digest_hex, encode_key,
                    is_sequence_key, record_hash, sequence_key)
from .envs import ENVS, file_identity, forget_env, lmdb_module, open_env
from .fingerprint import tokenizer_fingerprint, tokenizer_vocab_size
from .header import FORMAT_VERSION, HEADER_KEY, HeaderError, header_problem, read_header, write_header

VERIFY_BATCH = 4096             # n-gram records whose entries verify checks at once


def damaged(path, exc: Exception) -> HdError:
    return HdError(f"{path} is damaged ({str(exc).splitlines()[0]}): run `hd db verify {path}`, "
                   "then rebuild it or restore a good copy")


class Replaced(HdError):
    """The file a Store opened is no longer the one at its path (Store.update)."""


def _outside(token: int, vocab: int) -> str:
    return f"holds token id {token}, outside the vocabulary (the header's vocab_size is {vocab})"


def verify_file(path: str | Path) -> dict:
    """`hd db verify` of one file: Store(path).verify(), or a DAMAGED report where the header
    itself is unusable (HeaderError: no record can be read without it)."""
    try:
        store = Store(path)
    except HeaderError as exc:
        return {"path": str(path), "ok": False, "records": 0, "content_digest": None, "header_digest": None,
                "problems": [f"its header {exc.problem}"], "notes": []}
    return store.verify()


def put_sequences(txn, seqs, scope: bytes | None = None) -> None:
    """Append answers (token lists) in a write transaction, keeping the header's key count,
    sequence count and content digest current; scope: a tenant's tag (kept apart, see the
    module header)."""
    counter = "sequences" if scope is None else "scoped_sequences"
    header = read_header(txn)
    first = int(header.get(counter, 0) or 0)
    digest = int(header.get("content_digest", "0"), 16)
    for i, seq in enumerate(seqs):
        k, v = sequence_key(first + i, scope), np.asarray(seq, dtype="<u4").tobytes()
        txn.put(k, v)
        digest += record_hash(k, v)
    if "content_digest" in header:
        header["content_digest"] = digest_hex(digest)
    header[counter] = first + len(seqs)
    header["keys"] = header.get("keys", 0) + len(seqs)
    write_header(txn, header)


class Store:
    """A read-only, memory-mapped n-gram store.

    No read snapshot outlives the read that needs it: each lookup (get) reads in a transaction
    of its own (cheap beside a lookup). A snapshot held open keeps every page it sees from reuse, and a
    Store kept one from its opening on (the model DB whose answers a model layer indexes once),
    so that each transaction of `--learn` wrote its pages anew (a model DB grew from 80 KB to
    32 MB in 200 answers, 98.8% of its pages free and never reused)."""

    def __init__(self, path: str | Path, writable: bool = False):
        self._txn = None
        shared = ENVS.get(os.path.realpath(path), (None, None))[1]   # other Stores' environment
        try:
            self._open(path, writable)
        except HdError:
            if ENVS.get(os.path.realpath(path), (None, None))[1] not in (None, shared):
                forget_env(path)   # a refused file keeps no environment and leaves no lock file of ours
            raise
        self.identity = file_identity(self.env)
        self.refresh()

    @property
    def txn(self):
        """The snapshot the header is read from while opening (ended by refresh())."""
        if self._txn is None:
            self._txn = self.env.begin(buffers=True)
        return self._txn

    def _open(self, path: str | Path, writable: bool) -> None:
        self.path = Path(path)
        kind = inputs.kind_of(self.path)   # a symlink loop or a FIFO is no missing file
        if kind == "folder":
            raise HdError(f"{self.path} is a folder, not a DB file: pass the .lmdb file itself")
        if kind == "missing":
            raise HdError(f"DB {self.path} does not exist (build one with `hd build-stats` or "
                          "`hd build-model-db`)")
        if kind != "file":
            what = kind if kind.startswith(("not readable", "a broken symlink")) else f"{kind}, not a regular file or folder"
            raise HdError(f"DB {self.path} is {what}: pass the .lmdb file itself")
        if writable and not os.access(self.path, os.W_OK):
            raise HdError(f"{self.path} is not writable: --learn needs to write to it")
        self.env = open_env(self.path, writable)
        lmdb = lmdb_module()
        try:
            self.header = read_header(self.txn)
        except ValueError:
            raise HeaderError(self.path, "is not valid JSON") from None
        except lmdb.Error as exc:
            raise damaged(self.path, exc) from None
        if self.header is None:
            raise HdError(f"{self.path} is an LMDB file but not an hd DB (no header record)")
        version = self.header.get("format_version") if isinstance(self.header, dict) else None
        if isinstance(self.header, dict) and version != FORMAT_VERSION:
            raise HdError(f"{self.path} has DB format version {version}; this hd reads version "
                          f"{FORMAT_VERSION}: rebuild the DB")
        problem = header_problem(self.header)
        if problem:
            raise HeaderError(self.path, problem)
        self.draft_len = self.header["draft_len"]
        self.min_n, self.max_n = self.header["n_range"]
        # drafts hold only ids below this: the header's vocab_size, lowered to the model's by
        # check_tokenizer (None: neither known, as for an older DB not yet checked)
        self.vocab_limit = self.header.get("vocab_size")

    def check_tokenizer(self, tokenizer, model_name: str = "", embedding_rows: int | None = None) -> None:
        """Refuse a DB built for another tokenizer, or one that may hold ids the model has no
        embedding for (embedding_rows: the model's vocabulary); then set vocab_limit, the bound
        the drafting layers keep their ids under."""
        name = model_name or "this model"
        build = "hd build-model-db" if self.header.get("kind") == "model" else "hd build-stats CORPUS"
        rebuild = f"rebuild it with `{build} -o {self.path} --overwrite --model {model_name or 'NAME'}`"
        stored, fp = self.header.get("tokenizer_fingerprint"), tokenizer_fingerprint(tokenizer)
        built_for = self.header.get("model")
        if stored is None:
            raise HdError(f"{self.path} records no tokenizer fingerprint, so no model can be known to "
                          f"match its token ids (damaged, or not written by hd): {rebuild}")
        if stored != fp:
            differs = (f"another version of the tokenizer of '{built_for}'" if built_for == model_name
                       else f"the tokenizer of '{built_for}', not {name}'s")
            raise HdError(f"{self.path} was built with {differs} (tokenizer fingerprint {stored[:12]}..., "
                          f"this one's {fp[:12]}...): its token ids would mean other text; {rebuild}")
        bound = self.header.get("vocab_size")
        if embedding_rows is not None and bound is not None and bound > embedding_rows:
            raise HdError(f"{self.path} holds token ids below {bound} (its header's vocab_size), but "
                          f"{name} has only {embedding_rows} token embeddings: its drafts could name "
                          "tokens the model does not have; use a model whose embedding covers its "
                          "tokenizer, or a DB built for this one")
        self.vocab_limit = min(x for x in (bound, tokenizer_vocab_size(tokenizer), embedding_rows) if x)

    def refresh(self) -> None:
        """End the opening's snapshot, if any (every lookup reads the last committed state)."""
        if self._txn is not None:
            self._txn.abort()
            self._txn = None

    def update(self, fn):
        """Run fn(write_txn) in one write transaction, growing the map when it is full, on the
        file this Store opened: Replaced where another file is at its path now (rebuilt with
        --overwrite: writing on would land in a file nobody reads); HdError where the commit
        fails (a full disk: nothing was written, the DB keeps its last committed state)."""
        lmdb = lmdb_module()
        self._check_same_file()
        self.env.reader_check()   # the slots of killed readers would pin their pages for good
        while True:
            txn = self.env.begin(write=True)
            try:
                result = fn(txn)
                header = read_header(txn)
            except lmdb.MapFullError:
                txn.abort()
                self.env.set_mapsize(self.env.info()["map_size"] * 2)
                continue
            except lmdb.ReadonlyError:
                txn.abort()
                raise HdError(f"{self.path} is open read-only") from None
            except lmdb.Error as exc:
                txn.abort()
                raise damaged(self.path, exc) from None
            except BaseException:
                txn.abort()
                raise
            try:
                txn.commit()
            except lmdb.Error as exc:   # the pages are written at commit: a full disk shows here
                raise HdError(f"could not write to {self.path} ({str(exc).splitlines()[0]}): the disk may "
                              "be full or a file-size limit reached; nothing was written (the DB keeps "
                              "its last committed state)") from None
            break
        self._check_same_file()   # replaced during the write: it went to the old file
        self.header = header
        return result

    def _check_same_file(self) -> None:
        try:
            st = os.stat(self.path)
            now = (st.st_dev, st.st_ino)
        except OSError:
            now = None
        if now != self.identity:
            raise Replaced(f"{self.path} was {'removed' if now is None else 'replaced'} since hd opened "
                           "it (rebuilt with --overwrite, or moved): nothing more is written to the "
                           "old file; restart hd to use the new one")

    def get(self, key_tokens) -> tuple[int, list[tuple[list[int], int]]] | None:
        try:
            with self.env.begin(buffers=True) as txn:   # a snapshot of its own: see the class's docstring
                buf = txn.get(encode_key(key_tokens))
                return None if buf is None else decode_value(buf, self.draft_len)
        except (lmdb_module().Error, MalformedRecord) as exc:
            raise damaged(self.path, exc) from None

    def items(self, check: bool = False) -> Iterator[tuple[bytes, tuple[int, list]]]:
        """All (key bytes, (total, entries)) in key order, header excluded. check: recompute the
        content digest and key count on the way and raise HdError at the end if either differs
        from the header (a consumer must not commit anything before the iterator is exhausted)."""
        lmdb = lmdb_module()
        total = keys = 0
        try:
            with self.env.begin(buffers=True) as txn:
                for k, v in txn.cursor():
                    k = bytes(k)
                    if k == HEADER_KEY:
                        continue
                    if check:
                        total += record_hash(k, v)
                        keys += 1
                    if is_sequence_key(k):
                        continue  # an answer kept whole, not an n-gram
                    yield k, decode_value(v, self.draft_len)
        except (lmdb.Error, MalformedRecord) as exc:
            raise damaged(self.path, exc) from None
        if check:
            problem = self._content_problem(keys, digest_hex(total))
            if problem:
                raise HdError(f"{self.path} is damaged ({problem}): rebuild it or restore a good copy")

    def _answer_count_problems(self, found: dict) -> list[str]:
        """The header's answer counts against the answer records read: the key count and digest
        cannot see a header that counts answers no record holds (merge-stats once wrote model DBs
        so), and the answer indices run from those counts."""
        out = []
        for prefix, field, what in ((SEQ_PREFIX, "sequences", "answers"),
                                    (SCOPED_SEQ_PREFIX, "scoped_sequences", "tenants' answers")):
            claimed = self.header.get(field) or 0
            if found[prefix] != claimed:
                out.append(f"its header counts {claimed} {what} ({field}) but {found[prefix]} records hold one")
        return out

    def _content_problem(self, keys: int, digest: str) -> str | None:
        if self.header.get("keys") is not None and keys != self.header["keys"]:
            return f"{keys} records read, the header says {self.header['keys']}"
        stored = self.header.get("content_digest")
        if stored is not None and stored != digest:
            return f"content digest {digest} differs from the header's {stored}"
        return None

    def verify(self) -> dict:
        """Read every record: its shape, its entries' lengths (at most draft_len) and token ids
        (below the header's vocab_size), the key count and the content digest against the header;
        and that the header has a tokenizer fingerprint. notes: what could not be checked (the
        header of a DB built before hd recorded vocab_size has none: its ids are not checked here,
        and the drafting layers still drop ids outside the model's vocabulary)."""
        lmdb = lmdb_module()
        problems, notes, keys, total = [], [], 0, 0
        if not self.header.get("tokenizer_fingerprint"):
            problems.append("its header has no tokenizer_fingerprint: no model can be known to match "
                            "its token ids")
        if self.header.get("vocab_size") is None:
            notes.append("token ids not checked against the vocabulary: the header records no "
                         "vocab_size (built by an older hd)")
        pending: list = []   # n-gram records of a valid shape: their entries are checked in batches
        answers = {SEQ_PREFIX: 0, SCOPED_SEQ_PREFIX: 0}   # answer records read, by kind
        try:
            with self.env.begin(buffers=True) as txn:
                for k, v in txn.cursor():
                    if bytes(k) == HEADER_KEY:
                        continue
                    keys += 1
                    total += record_hash(k, v)
                    if is_sequence_key(k):
                        answers[bytes(k[:len(SEQ_PREFIX)])] += 1
                    problem = self._record_problem(keys, k, v, pending) if len(problems) < 5 else None
                    if pending and (problem or len(pending) >= VERIFY_BATCH):   # in record order
                        problems += filter(None, [self._entries_problem(pending)])
                    problems += filter(None, [problem])
            problems += filter(None, [self._entries_problem(pending)])
        except lmdb.Error as exc:
            problems.append(f"reading stopped after {keys} records: {str(exc).splitlines()[0]}")
        digest = digest_hex(total)
        problem = self._content_problem(keys, digest)
        if problem:
            problems.append(problem)
        problems += self._answer_count_problems(answers)
        return {"path": str(self.path), "ok": not problems, "records": keys, "content_digest": digest,
                "header_digest": self.header.get("content_digest"), "problems": problems, "notes": notes}

    def _record_problem(self, number: int, k, v, pending: list) -> str | None:
        """verify's check of one record's shape (an answer's ids too); an n-gram record of a valid
        shape is appended to pending, for _entries_problem."""
        words = len(v) // 4
        if is_sequence_key(k):
            if len(v) % 4 or not words:
                return f"record {number} (a stored answer) is malformed"
            ids = np.frombuffer(v, dtype="<u4")
            vocab = self.header.get("vocab_size")
            return (f"record {number} {_outside(int(ids.max()), vocab)}"
                    if vocab is not None and len(ids) and int(ids.max()) >= vocab else None)
        if (len(k) % 4 or not self.min_n <= len(k) // 4 <= self.max_n or len(v) % 4
                or words < 1 or (words - 1) % (self.draft_len + 2)):
            return f"record {number} has a malformed key or value"
        pending.append((number, bytes(k), bytes(v)))
        return None

    def _entries_problem(self, pending: list) -> str | None:
        """The first problem among n-gram records of valid shapes (pending, emptied): an entry
        longer than draft_len, continuations the header's pruning would not keep, an id outside
        the vocabulary. In batches: numpy a record at a time tripled verify's time."""
        if not pending:
            return None
        h, width, found = self.header, self.draft_len + 2, []
        sizes = np.array([len(v) // 4 for _, _, v in pending])
        rows = np.delete(np.frombuffer(b"".join(v for _, _, v in pending), dtype="<u4"),
                         np.cumsum(sizes) - sizes).reshape(-1, width)   # the entries, totals dropped
        per_record = (sizes - 1) // width
        owner = np.repeat(np.arange(len(pending)), per_record)          # each entry's record
        lengths = rows[:, 1]
        at = np.flatnonzero(lengths > self.draft_len)
        if at.size:
            found.append((owner[at[0]], f"holds a continuation of {int(lengths[at[0]])} tokens, more "
                                        f"than the header's draft_len {self.draft_len}"))
        # a pruned statistics DB keeps per key at most top_k continuations, each counted
        # min_count times or more; a model DB learns (counts of 1) and is not checked so
        top_k, min_count = h.get("top_k") or 0, h.get("min_count") or 1
        if h.get("pruned") and h.get("kind", "stats") != "model":
            over = np.flatnonzero(per_record > top_k) if top_k else np.zeros(0, dtype=int)
            rare = owner[rows[:, 0] < min_count]
            for i in [over[:1], rare[:1]]:
                if len(i):
                    found.append((int(i[0]), f"holds continuations its header's pruning (top_k {top_k}, "
                                             f"min_count {min_count}) would not keep: the DB was "
                                             "written after it was built"))
        vocab = h.get("vocab_size")
        if vocab is not None:
            used = np.arange(self.draft_len) < np.minimum(lengths, self.draft_len)[:, None]
            tokens = np.where(used, rows[:, 2:], 0)
            bad = np.flatnonzero((tokens >= vocab).any(axis=1))
            if bad.size:
                found.append((owner[bad[0]], _outside(int(tokens[bad[0]].max()), vocab)))
            key_ids = np.frombuffer(b"".join(k for _, k, _ in pending), dtype="<u4")
            bad = np.flatnonzero(key_ids >= vocab)
            if bad.size:
                key_of = np.repeat(np.arange(len(pending)), [len(k) // 4 for _, k, _ in pending])
                found.append((key_of[bad[0]], _outside(int(key_ids[bad[0]]), vocab)))
        first = min(found, default=None, key=lambda f: f[0])
        problem = None if first is None else f"record {pending[int(first[0])][0]} {first[1]}"
        pending.clear()
        return problem

    @property
    def sequence_count(self) -> int:
        return int(self.header.get("sequences", 0) or 0)

    def answer_records(self) -> Iterator[tuple[bytes | None, bytes]]:
        """Every answer kept whole, as stored: (scope tag, None for a shared one; its <u4 token
        bytes), the shared ones oldest first, then the tenants', by tag, each oldest first."""
        lmdb = lmdb_module()
        try:
            with self.env.begin() as txn:
                for prefix in (SEQ_PREFIX, SCOPED_SEQ_PREFIX):
                    cur = txn.cursor()
                    if not cur.set_range(prefix):
                        continue
                    for k, v in cur:
                        if not k.startswith(prefix):
                            break
                        if is_sequence_key(k):
                            if len(v) % 4:
                                raise damaged(self.path, MalformedRecord("an answer record is malformed"))
                            yield (None if prefix == SEQ_PREFIX else k[len(prefix):-8]), v
        except lmdb.Error as exc:
            raise damaged(self.path, exc) from None

    def sequences(self, scope: bytes | None = None) -> Iterator[np.ndarray]:
        """The answers kept whole (a model DB's), oldest first, as <u4 arrays (copies): the
        shared ones, or with scope (a tag) those learned for that tenant only. Ids outside the
        vocabulary (vocab_limit; a damaged record, found by `hd db verify`) are dropped where
        they are read: the answer is cut there and its pieces kept, so that no index or draft
        ever holds one."""
        lmdb = lmdb_module()
        prefix = SEQ_PREFIX if scope is None else SCOPED_SEQ_PREFIX + scope
        try:
            with self.env.begin(buffers=True) as txn:
                cur = txn.cursor()
                if not cur.set_range(prefix):
                    return
                for k, v in cur:
                    if not (is_sequence_key(k) and bytes(k[:len(prefix)]) == prefix):
                        break
                    if len(v) % 4:
                        raise HdError(f"{self.path} holds a malformed answer record: run `hd db verify "
                                      f"{self.path}`, then rebuild it")
                    yield from self._in_vocabulary(np.frombuffer(bytes(v), dtype="<u4"))
        except lmdb.Error as exc:
            raise damaged(self.path, exc) from None

    def _in_vocabulary(self, tokens: np.ndarray) -> list[np.ndarray]:
        if self.vocab_limit is None or not len(tokens) or int(tokens.max()) < self.vocab_limit:
            return [tokens]
        pieces = np.split(tokens, np.flatnonzero(tokens >= self.vocab_limit))
        return [p for p in [pieces[0]] + [p[1:] for p in pieces[1:]] if len(p)]

    def add_sequences(self, seqs, scope: bytes | None = None) -> int:
        """Append answers (token lists) in one write transaction (put_sequences). Returns how
        many were added."""
        seqs = [s for s in seqs if len(s)]
        if seqs:
            self.update(lambda txn: put_sequences(txn, seqs, scope))
        return len(seqs)

    def size_info(self) -> dict:
        """Size figures (`hd db info`): pages up to the file's last one, those the records and the
        two meta pages use, and the rest, free (the free list's own few pages among them): free
        pages are reused by later writes, so learning should not make them grow without bound."""
        st, info = self.env.stat(), self.env.info()
        pages = info["last_pgno"] + 1
        used = st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"] + 2
        return {"file_bytes": self.path.stat().st_size, "entries": st["entries"] - 1,
                "depth": st["depth"], "leaf_pages": st["leaf_pages"],
                "overflow_pages": st["overflow_pages"], "page_bytes": st["psize"], "pages": pages,
                "used_pages": used, "free_pages": pages - used}

    def close(self) -> None:
        """End this reader's transaction (the environment stays open for other readers)."""
        self.refresh()
