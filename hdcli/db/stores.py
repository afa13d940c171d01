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
    place only after the last commit (os.replace is atomic on one filesystem);
  * a build never replaces a file it did not expect: without overwrite the rename is a hard link
    that fails if the output appeared during the build (another build racing to the same path);
    an output path that is a folder is refused;
  * a built file is packed: builds insert keys in hash order, which leaves B-tree pages about half
    full, so commit() copies the store in key order with MDB_APPEND into full pages (the DB built
    from ../shared/corpora shrank from 184 MB to 57 MB; the copy took 0.9 s);
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

import hashlib
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import HdError

FORMAT_VERSION = 1
HEADER_KEY = b"__hd_header__"   # 13 bytes: never a multiple of 4
PAD = 0xFFFFFFFF
INITIAL_MAP_SIZE = 1 << 28     # 256 MiB; doubled whenever LMDB reports the map full
DIGEST_MOD = 1 << 128
SEQ_PREFIX = b"__hd_seq__"      # + 8-byte index: 18 bytes, never a multiple of 4
SCOPED_SEQ_PREFIX = b"__hd_sqs__"   # + 8-byte scope tag + 8-byte index: 26 bytes, never a multiple of 4
SCOPE_TAG_BYTES = 8


def sequence_key(index: int, scope: bytes | None = None) -> bytes:
    if scope is None:
        return SEQ_PREFIX + int(index).to_bytes(8, "big")
    if len(scope) != SCOPE_TAG_BYTES:
        raise ValueError(f"a scope tag is {SCOPE_TAG_BYTES} bytes")
    return SCOPED_SEQ_PREFIX + scope + int(index).to_bytes(8, "big")


def is_sequence_key(key) -> bool:
    """An answer kept whole, shared or a tenant's (not an n-gram record)."""
    head = bytes(key[:len(SEQ_PREFIX)])
    return ((len(key) == len(SEQ_PREFIX) + 8 and head == SEQ_PREFIX)
            or (len(key) == len(SCOPED_SEQ_PREFIX) + SCOPE_TAG_BYTES + 8 and head == SCOPED_SEQ_PREFIX))


def record_hash(key, value) -> int:
    """One record's share of the content digest (the key length first: keys have 1..max_n tokens)."""
    key = bytes(key)
    return int.from_bytes(hashlib.blake2b(bytes([len(key)]) + key + bytes(value), digest_size=16).digest(),
                          "little")


def digest_hex(total: int) -> str:
    return f"{total % DIGEST_MOD:032x}"


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def damaged(path, exc: Exception) -> HdError:
    return HdError(f"{path} is damaged ({str(exc).splitlines()[0]}): run `hd db verify {path}`, "
                   "then rebuild it or restore a good copy")


def check_output_path(path: Path, overwrite: bool) -> None:
    """One-line errors for an output path that cannot be a new DB file (checked before any work;
    the commit checks again, atomically, that nothing appeared meanwhile)."""
    if path.is_dir():
        raise HdError(f"{path} is a folder: -o takes a file path for the DB (e.g. {path / 'stats.lmdb'})")
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise HdError(f"{parent} is a file, not a folder: choose an -o path inside a folder")
    if not parent.is_dir():
        raise HdError(f"the output folder {parent} does not exist: create it or choose another -o path")
    if not os.access(parent, os.W_OK):
        raise HdError(f"output folder {parent} is not writable")
    if path.exists() and not overwrite:
        raise HdError(f"{path} already exists: pass --overwrite to replace it")


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the vocabulary and special tokens: a DB is valid only for one tokenization."""
    h = hashlib.sha256()
    for tok, idx in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{tok}\n".encode("utf-8", "surrogatepass"))
    h.update(json.dumps(sorted(map(str, tokenizer.all_special_tokens))).encode())
    return h.hexdigest()[:32]


def encode_key(tokens) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


class MalformedRecord(ValueError):
    """A stored value of a shape no build writes (Store.get/items: `damaged`, naming `hd db verify`)."""


def decode_value(buf, draft_len: int) -> tuple[int, list[tuple[list[int], int]]]:
    """(total, [(continuation tokens, count), ...]) from a stored value; MalformedRecord where its
    length is not 4 bytes times 1 + k * (draft_len + 2)."""
    width = draft_len + 2
    if len(buf) % 4 or not len(buf) or (len(buf) // 4 - 1) % width:
        raise MalformedRecord(f"a record of {len(buf)} bytes is malformed")
    arr = np.frombuffer(buf, dtype="<u4")
    out = []
    for j in range(1, len(arr), width):
        count, length = int(arr[j]), int(arr[j + 1])
        out.append((arr[j + 2:j + 2 + length].tolist(), count))
    return int(arr[0]), out


def encode_value(total: int, entries: list[tuple[list[int], int]], draft_len: int) -> bytes:
    rows = np.full((len(entries), draft_len + 2), PAD, dtype="<u4")
    for r, (cont, count) in enumerate(entries):
        rows[r, 0], rows[r, 1] = count, len(cont)
        rows[r, 2:2 + len(cont)] = cont
    return np.concatenate([np.array([total], dtype="<u4"), rows.ravel()]).tobytes()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(folder: Path, prefix: str) -> None:
    """Remove `PREFIX<pid>-*` leftovers of builds whose process is gone (a SIGKILLed build
    cannot clean up after itself; the next build beside it does)."""
    for p in Path(folder).glob(prefix + "*"):
        pid = p.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _lmdb():
    import lmdb
    return lmdb


class StoreWriter:
    """Writes a new store at a temporary path; `commit()` renames it into place.

    Puts are batched into write transactions; when LMDB reports the map full the map is doubled
    and the batch is replayed, so a big build never crashes on the map size."""

    def __init__(self, path: str | Path, overwrite: bool = False, batch: int = 20000):
        lmdb = _lmdb()
        self.path = Path(path)
        check_output_path(self.path, overwrite)
        self.overwrite = overwrite
        sweep_stale(self.path.parent, self.path.name + ".tmp-")
        if not self.path.exists():  # the lock file of a DB deleted since is an orphan
            Path(str(self.path) + "-lock").unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{self.path.name}.tmp-{os.getpid()}-", dir=self.path.parent)
        os.close(fd)
        self.tmp = Path(tmp)
        self.map_size = INITIAL_MAP_SIZE
        self.env = lmdb.open(str(self.tmp), subdir=False, map_size=self.map_size, lock=False,
                             sync=False, metasync=False, writemap=False, max_dbs=0)
        self.pending: list[tuple[bytes, bytes]] = []
        self.batch, self.keys, self.done = batch, 0, False

    def put(self, key: bytes, value: bytes) -> None:
        self.pending.append((key, value))
        if len(self.pending) >= self.batch:
            self.flush()

    def flush(self) -> None:
        lmdb = _lmdb()
        while self.pending:
            try:
                with self.env.begin(write=True) as txn:
                    for k, v in self.pending:
                        txn.put(k, v)
                self.keys += len(self.pending)
                self.pending = []
            except lmdb.MapFullError:
                self.map_size *= 2
                self.env.set_mapsize(self.map_size)
            except lmdb.Error as exc:
                raise self._write_error(exc) from None

    def commit(self, header: dict) -> dict:
        """Write the header last, sync, and move the complete file into place. Returns the
        header as stored."""
        self.flush()
        header = {**header, "format_version": FORMAT_VERSION, "keys": self.keys,
                  "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        packed = self._packed_copy(header)
        self.env.close()
        self.tmp.unlink()
        self.tmp = packed
        os.chmod(self.tmp, _umask_mode())  # mkstemp made it 0600
        self._move_into_place()
        self.done = True
        return header

    def _move_into_place(self) -> None:
        if self.overwrite:
            if self.path.is_dir():
                raise HdError(f"{self.path} became a folder during the build: nothing was written")
            os.replace(self.tmp, self.path)
            return
        try:  # a hard link never replaces: atomic "create if absent" for a whole file
            os.link(self.tmp, self.path)
        except FileExistsError:
            raise HdError(f"{self.path} appeared during the build (another build to the same path?): "
                          "it was left as it is and this build discarded; pass --overwrite to "
                          "replace it") from None
        except OSError:  # a filesystem without hard links: check, then rename
            if self.path.exists():
                raise HdError(f"{self.path} appeared during the build: it was left as it is; pass "
                              "--overwrite to replace it") from None
            os.replace(self.tmp, self.path)
            return
        self.tmp.unlink()

    def _write_error(self, exc: Exception) -> HdError:
        # LMDB reports a full disk or a file-size limit as an I/O error on commit
        return HdError(f"cannot write {self.path} ({exc}): the disk may be full. Nothing was "
                       "replaced: free space or choose another output path")

    def _packed_copy(self, header: dict) -> Path:
        """Copy the store in key order into full pages (MDB_APPEND) beside it, computing the
        content digest on the way, then add the header (synced and closed; `header` gains the
        digest). Both files carry the temporary prefix, so a kill here leaves only what
        sweep_stale removes."""
        lmdb = _lmdb()
        fd, name = tempfile.mkstemp(prefix=f"{self.path.name}.tmp-{os.getpid()}-", dir=self.path.parent)
        os.close(fd)
        psize = self.env.stat()["psize"]
        used = (self.env.info()["last_pgno"] + 8) * psize  # the copy needs no more, header aside
        dst = lmdb.open(name, subdir=False, map_size=max(used, 1 << 20), lock=False, sync=False,
                        metasync=False, max_dbs=0)
        try:
            total = 0
            with self.env.begin(buffers=True) as src, dst.begin(write=True) as txn:
                for k, v in src.cursor():
                    txn.put(k, v, append=True)
                    total += record_hash(k, v)
                header["content_digest"] = digest_hex(total)
                write_header(txn, header)
            dst.sync(True)
        except lmdb.Error as exc:
            Path(name).unlink(missing_ok=True)
            raise self._write_error(exc) from None
        finally:
            dst.close()
        return Path(name)

    def abort(self) -> None:
        if not self.done:
            try:
                self.env.close()
            except Exception:
                pass
            self.tmp.unlink(missing_ok=True)
            self._drop_lock()

    def _drop_lock(self) -> None:
        Path(str(self.tmp) + "-lock").unlink(missing_ok=True)


@contextmanager
def writing(path: str | Path, overwrite: bool = False) -> Iterator[StoreWriter]:
    """`with writing(out) as w: w.put(...); w.commit(header)`: nothing reaches `out` unless
    commit() ran; any exception (Ctrl-C included) removes the temporary file."""
    w = StoreWriter(path, overwrite=overwrite)
    try:
        yield w
    finally:
        w.abort()


_ENVS: dict = {}  # realpath -> (lmdb.Environment, writable): LMDB allows one open per file per process


def _open_env(path: Path, writable: bool):
    """Readers take LMDB's lock file so a concurrent writer (`--learn`) never reuses pages a
    reader still sees; where no lock file can be made (read-only filesystem) no writer can exist
    either, and we read without one."""
    lmdb = _lmdb()
    real = os.path.realpath(path)
    st = os.stat(real)
    key = (real, st.st_ino)  # a rebuilt file (renamed into place) is a new file
    cached = _ENVS.get(real)
    if cached and cached[0] == key and (cached[2] or not writable):
        return cached[1]
    if cached:
        _ENVS.pop(real)[1].close()
    had_lock = os.path.exists(real + "-lock")

    def drop_new_lock():  # a file refused here must not leave a lock file we created
        if not had_lock:
            Path(real + "-lock").unlink(missing_ok=True)
    try:
        if writable:
            env = lmdb.open(real, subdir=False, map_size=max(INITIAL_MAP_SIZE, 2 * st.st_size),
                            max_readers=512)
        else:
            try:
                env = lmdb.open(real, subdir=False, readonly=True, max_readers=512, readahead=False)
            except lmdb.Error:
                env = lmdb.open(real, subdir=False, readonly=True, lock=False, readahead=False)
    except lmdb.Error as exc:
        drop_new_lock()
        raise HdError(f"{path} is not an hd DB ({str(exc).splitlines()[0]})") from None
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]  # both read from the meta page
    size = os.stat(real).st_size
    if size < need:
        env.close()
        drop_new_lock()
        raise HdError(f"{path} is truncated: {size} bytes, but its pages reach {need} (an interrupted "
                      "copy or a full disk?): rebuild it or restore a good copy")
    _ENVS[real] = (key, env, writable)
    return env


def read_header(txn) -> dict:
    raw = txn.get(HEADER_KEY)
    return None if raw is None else json.loads(bytes(raw))


def write_header(txn, header: dict) -> None:
    txn.put(HEADER_KEY, json.dumps(header).encode())


class Store:
    """A read-only, memory-mapped n-gram store."""

    def __init__(self, path: str | Path, writable: bool = False):
        self.path = Path(path)
        if self.path.is_dir():
            raise HdError(f"{self.path} is a folder, not a DB file: pass the .lmdb file itself")
        if not self.path.is_file():
            raise HdError(f"DB {self.path} does not exist (build one with `hd build-stats` or "
                          "`hd build-model-db`)")
        if writable and not os.access(self.path, os.W_OK):
            raise HdError(f"{self.path} is not writable: --learn needs to write to it")
        self.env = _open_env(self.path, writable)
        self.txn = self.env.begin(buffers=True)
        lmdb = _lmdb()
        try:
            self.header = read_header(self.txn)
        except ValueError:
            raise HdError(f"{self.path}: the header record is not valid JSON") from None
        except lmdb.Error as exc:
            raise damaged(self.path, exc) from None
        if self.header is None:
            raise HdError(f"{self.path} is an LMDB file but not an hd DB (no header record)")
        version = self.header.get("format_version")
        if version != FORMAT_VERSION:
            raise HdError(f"{self.path} has DB format version {version}; this hd reads version "
                          f"{FORMAT_VERSION}: rebuild the DB")
        self.draft_len = int(self.header["draft_len"])
        self.min_n, self.max_n = (int(x) for x in self.header["n_range"])

    def check_tokenizer(self, tokenizer, model_name: str = "") -> None:
        fp = tokenizer_fingerprint(tokenizer)
        if fp != self.header.get("tokenizer_fingerprint"):
            raise HdError(f"{self.path} was built for the tokenizer of '{self.header.get('model')}', "
                          f"which differs from {model_name or 'this model'}'s: rebuild it with "
                          f"--model {model_name or 'NAME'}")

    def refresh(self) -> None:
        """Start a new read snapshot: see what other processes committed since, and stop
        pinning old pages."""
        self.txn.abort()
        self.txn = self.env.begin(buffers=True)

    def update(self, fn):
        """Run fn(write_txn) in one write transaction, growing the map when it is full."""
        lmdb = _lmdb()
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    result = fn(txn)
                break
            except lmdb.MapFullError:
                self.txn.abort()
                self.env.set_mapsize(self.env.info()["map_size"] * 2)
            except lmdb.ReadonlyError:
                raise HdError(f"{self.path} is open read-only") from None
        self.refresh()
        self.header = read_header(self.txn)
        return result

    def get(self, key_tokens) -> tuple[int, list[tuple[list[int], int]]] | None:
        try:
            buf = self.txn.get(encode_key(key_tokens))
            return None if buf is None else decode_value(buf, self.draft_len)
        except (_lmdb().Error, MalformedRecord) as exc:
            raise damaged(self.path, exc) from None

    def items(self, check: bool = False) -> Iterator[tuple[bytes, tuple[int, list]]]:
        """All (key bytes, (total, entries)) in key order, header excluded. check: recompute the
        content digest and key count on the way and raise HdError at the end if either differs
        from the header (a consumer must not commit anything before the iterator is exhausted)."""
        lmdb = _lmdb()
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

    def _content_problem(self, keys: int, digest: str) -> str | None:
        if self.header.get("keys") is not None and keys != self.header["keys"]:
            return f"{keys} records read, the header says {self.header['keys']}"
        stored = self.header.get("content_digest")
        if stored is not None and stored != digest:
            return f"content digest {digest} differs from the header's {stored}"
        return None

    def verify(self) -> dict:
        """Read every record: its shape, the key count and the content digest against the header."""
        lmdb = _lmdb()
        problems, keys, total = [], 0, 0
        width = self.draft_len + 2
        # a pruned statistics DB keeps per key at most top_k continuations, each counted
        # min_count times or more; a model DB learns (counts of 1) and is not checked so
        h = self.header
        pruned = bool(h.get("pruned")) and h.get("kind", "stats") != "model"
        top_k, min_count = int(h.get("top_k") or 0), int(h.get("min_count") or 1)
        try:
            with self.env.begin(buffers=True) as txn:
                for k, v in txn.cursor():
                    if bytes(k) == HEADER_KEY:
                        continue
                    keys += 1
                    total += record_hash(k, v)
                    words = len(v) // 4
                    if is_sequence_key(k):
                        if (len(v) % 4 or not words) and len(problems) < 5:
                            problems.append(f"record {keys} (a stored answer) is malformed")
                        continue
                    if (len(k) % 4 or not self.min_n <= len(k) // 4 <= self.max_n or len(v) % 4
                            or words < 1 or (words - 1) % width) and len(problems) < 5:
                        problems.append(f"record {keys} has a malformed key or value")
                    elif pruned and len(problems) < 5:
                        counts = np.frombuffer(bytes(v), dtype="<u4")[1::width]
                        if (top_k and len(counts) > top_k) or (len(counts) and int(counts.min()) < min_count):
                            problems.append(f"record {keys} holds continuations its header's pruning "
                                            f"(top_k {top_k}, min_count {min_count}) would not keep: "
                                            "the DB was written after it was built")
        except lmdb.Error as exc:
            problems.append(f"reading stopped after {keys} records: {str(exc).splitlines()[0]}")
        digest = digest_hex(total)
        problem = self._content_problem(keys, digest)
        if problem:
            problems.append(problem)
        return {"path": str(self.path), "ok": not problems, "records": keys, "content_digest": digest,
                "header_digest": self.header.get("content_digest"), "problems": problems}

    @property
    def sequence_count(self) -> int:
        return int(self.header.get("sequences", 0) or 0)

    def sequences(self, scope: bytes | None = None) -> Iterator[np.ndarray]:
        """The answers kept whole (a model DB's), oldest first, as <u4 arrays (copies): the
        shared ones, or with scope (a tag) those learned for that tenant only."""
        lmdb = _lmdb()
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
                    yield np.frombuffer(bytes(v), dtype="<u4")
        except lmdb.Error as exc:
            raise damaged(self.path, exc) from None

    def add_sequences(self, seqs, scope: bytes | None = None) -> int:
        """Append answers (token lists) in one write transaction, keeping the header's key count,
        sequence count and content digest current; scope: a tenant's tag (kept apart, see the
        module header). Returns how many were added."""
        seqs = [np.asarray(s, dtype="<u4") for s in seqs if len(s)]
        if not seqs:
            return 0
        counter = "sequences" if scope is None else "scoped_sequences"

        def write(txn):
            header = read_header(txn)
            first = int(header.get(counter, 0) or 0)
            digest = int(header.get("content_digest", "0"), 16)
            for i, arr in enumerate(seqs):
                k, v = sequence_key(first + i, scope), arr.tobytes()
                txn.put(k, v)
                digest += record_hash(k, v)
            if "content_digest" in header:
                header["content_digest"] = digest_hex(digest)
            header[counter] = first + len(seqs)
            header["keys"] = header.get("keys", 0) + len(seqs)
            write_header(txn, header)
        self.update(write)
        return len(seqs)

    def size_info(self) -> dict:
        st = self.env.stat()
        return {"file_bytes": self.path.stat().st_size, "entries": st["entries"] - 1,
                "depth": st["depth"], "leaf_pages": st["leaf_pages"],
                "overflow_pages": st["overflow_pages"]}

    def close(self) -> None:
        """End this reader's transaction (the environment stays open for other readers)."""
        self.txn.abort()
