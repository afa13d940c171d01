"""A GGUF's weights in the GEMM's layout, kept on disk: a later start maps them instead of repacking.

Why: repacking an 8B Q4_K_M file's blocks into csrc/qmm.cpp's layout (quants.pack) is most of a
later start on a small CPU; mapping the same bytes from a file is far quicker, and
they stay shared with the page cache (resident memory counts them once, as the file's map would).
The price is disk: as many bytes again as the quantized weights, said in one line by the start
that writes them, with how to turn it off (HD_LAYOUT_CACHE=0, engine/environment.py).

Writing: once the model is ready (built and self-checked: copying gigabytes into the page cache
takes a core for seconds a gigabyte, which the build's GEMMs would wait on), on a thread of its
own (`keep`), from the packings the model holds (no second copy in memory); the disk's write-back
bounds it (on a slow disk an 8B model's layouts take longer to write than to pack),
so a first start does not wait for it; the process does, at exit (the thread is not a daemon;
the CLI shows a bar), or `wait()` does.

The file: <cache>/layouts/<GGUF stem>-<key>.hdl
  * the packings, each at a multiple of ALIGN bytes, as the model holds them (a layer's q, k and
    v joined, its gate and up joined: quants.QLinear.side_by_side), the model's order;
  * the index, JSON: {"format", "key", "source", "entries": {tensor name: [offset, shape, fmt,
    digest]}}: each of the file's tensors, the joined ones as their parts' ranges (side by side:
    `packing` views them as one again instead of copying);
  * FOOTER bytes: the index's length (uint64, little-endian) and MAGIC.
Its key is the GGUF's identity (GGUFFile.key(): path, size, modification time), the packing's code
(quants.module_name(): a hash of qmm.cpp, the CPU, torch and the build flags), the activations the
packing is arranged for (bf16, int8) and the digests' hash (DIGEST). `digest` (`_digest`) hashes
every byte of the tensor's packing, begun from its entry's name, offset, shape and fmt: any changed
stretch of a packing, or two entries swapped (each other's bytes under the wrong name), fails it.
Every digest is checked as the file is mapped, before the model is built: the answer is computed
from these bytes, so they are proven whole before use, not sampled (format 1's 256 bytes a MiB let
a zeroed 4 KiB between its samples, or two same-shape entries swapped, through: wrong tokens, exit 0).

Invariants
  * A file under its final name was written whole: it is written under a temporary name and
    renamed after its footer (the digests are in the index, written after every packing). One that
    does not read back (footer, index, key, sizes, every digest) is removed and rebuilt, said in
    one line; its bytes are never used.
  * A packing read from the cache is the one pack() made for the same key; a name the index lacks
    is packed in the process (and the cache left as it is).
  * One file per GGUF path: writing a new one removes the older ones of the same path, those of
    GGUF files that no longer exist, and the temporary files of processes that no longer run.
  * A folder the cache cannot be written to (read-only) is found before the writer starts (`keep`
    makes its temporary file) and said in one line, once per process and folder; the writer's own
    failures (a full disk) are one line too, never a traceback.
"""
from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import sys
import threading
import warnings
from pathlib import Path

import torch
from xxhash import xxh3_64

from ... import interrupts
from ..kernels import quants

MAGIC = b"HDLAYT01"        # the footer's last 8 bytes
FORMAT = 2                # 2: a digest of every byte per entry (1: samples)
ALIGN = 64                # each packing's offset: the GEMM's loads are 64-byte aligned at best
FOOTER = 16               # index length (uint64) + MAGIC
FREE_MARGIN = 1 << 30     # disk left free after the cache is written; else it is not written
_WRITERS: list[tuple[threading.Thread, "LayoutCache"]] = []   # this process's writers still running (`wait`)
_UNWRITABLE: set[str] = set()   # folders said to take no cache in this process (said once: a draft and its target)
DIGEST = "xxh3_64"   # the digests' hash (in the key): xxhash is a dependency of hd (pyproject.toml)


def _digest(name: str, offset: int, shape: list, fmt: str, data) -> int:
    """A 64-bit hash (xxh3) of every byte of one packing, begun from its index entry (name, offset,
    shape, fmt; JSON, so where the entry ends is unambiguous): another entry's bytes, or these bytes
    at another place or under another name, do not match. xxh3 because it is the cheapest complete
    check measured: several times cheaper than zlib.crc32 and blake2b (docs/benchmarks.md)."""
    entry = json.dumps([name, int(offset), [int(s) for s in shape], fmt]).encode()
    h = xxh3_64(entry)
    h.update(data)
    return h.intdigest()


def _mismatch(view: memoryview, entries: list[tuple]) -> str | None:
    """The name of the first entry (name, offset, shape, fmt, digest, bytes) whose bytes in `view` do
    not match its digest, or None. One thread: a second one was measured no faster."""
    for name, offset, shape, fmt, digest, n in entries:
        if _digest(name, offset, shape, fmt, view[offset:offset + n]) != digest:
            return name
    return None


class LayoutCache:
    """The packings of one load: mapped from `path` where it holds them (`hit`), else made by
    quants.pack and, once the model is built, written by `keep(model)`.

    `warnings`: lines always shown (a cache rebuilt or not written); `note`: the line a start that
    writes the cache shows (its size, where, how to turn it off)."""

    def __init__(self, path: Path, key: str, source: str):
        self.path, self.key, self.source = path, key, source
        self.entries: dict = {}
        self.warnings: list[str] = []
        self.note: str | None = None
        self.base: torch.Tensor | None = None  # the mapped file as one uint8 tensor (a hit)
        self._map = None
        self.writing = 0                       # bytes this load is writing (a miss)
        self.written = 0                       # of which on their way to the disk
        self.abandon = threading.Event()       # set: the writer stops at the next tensor, leaving nothing
        self._open()

    @property
    def hit(self) -> bool:
        return self.base is not None

    # ------------------------------------------------------------ reading

    def _open(self) -> None:
        if not self.path.is_file():
            return
        why = self._read()
        if why is not None:
            self._drop_map()
            try:
                self.path.unlink()
                done = "removed, the weights are repacked"
            except OSError as exc:   # a read-only folder: it stays, and is said again at each start
                done = (f"not removed ({exc.strerror or exc}), the weights are repacked; remove it, or set "
                        "HD_CACHE_DIR to a writable folder")
            self.warnings.append(f"hd: the layout cache {self.path} {why}: {done}")

    def _read(self) -> str | None:
        """Map the file and check it; why it cannot be used, or None."""
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                index, data = _index(f, size)
                if index is None:
                    return "is truncated or not a layout file"
                # read-only and populated: the pages come from the page cache now, not at the first
                # forward, and are never copied (a private writable map would copy them)
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                self._map = mmap.mmap(f.fileno(), data, flags=flags, prot=mmap.PROT_READ)
        except (OSError, ValueError, struct.error, UnicodeDecodeError):
            return "cannot be read"
        if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("key") != self.key:
            return "is of another version"
        entries = index.get("entries")
        if not isinstance(entries, dict):
            return "has no index"
        data = len(self._map)
        checks = []
        try:
            for name, (offset, shape, fmt, digest) in entries.items():
                n = int(torch.Size(shape).numel())
                if offset % ALIGN or offset < 0 or n < 0 or offset + n > data:
                    return f"does not match its index at {name}"
                checks.append((name, offset, shape, fmt, digest, n))
            view = memoryview(self._map)
            try:
                wrong = _mismatch(view, checks)
            finally:
                view.release()
        except (TypeError, ValueError):
            return "has a damaged index"
        if wrong is not None:
            return f"does not match its digest at {wrong}"
        with warnings.catch_warnings():   # read-only on purpose: nothing writes a packing
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self.base = torch.frombuffer(self._map, dtype=torch.uint8)
        self.entries = entries
        return None

    def _drop_map(self) -> None:
        self.base = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:   # a tensor still views it: it closes when that goes
                pass
            self._map = None

    # ------------------------------------------------------------ the packings

    def packing(self, names: list[str], type_name: str, raws: list, ns: list[int], k: int, int8: bool):
        """(packed, fmt) of tensors side by side (one, or a layer's q, k, v: quants.pack_side_by_side):
        the cache's view where it holds them all, else packed here (None where a shape does not
        fit, as pack_side_by_side)."""
        got = [self.entries.get(name) for name in names]   # empty unless the file was read (a hit)
        if all(g is not None for g in got):
            views = [self.base[offset:offset + int(torch.Size(shape).numel())].view(shape) for offset, shape, _, _ in got]
            return _side_by_side(views), got[0][2]
        return quants.pack_side_by_side(type_name, raws, ns, k, int8=int8)

    def keep(self, model) -> None:
        """Write the packings `model` holds (its quants.QLinear kernels, in module order) to the
        cache on a thread of its own; nothing where the cache was read (a hit), or there is nothing
        to write, or the disk has no room for it (said)."""
        if self.hit:
            return
        kernels = [m for m in model.modules() if isinstance(m, quants.QLinear) and m.names]
        if not kernels:
            return
        size = sum(k.packed.numel() + ALIGN for k in kernels)
        folder = self.path.parent
        tmp = folder / f".{self.path.name}.tmp-{os.getpid()}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _remove_stale(folder)
            free = shutil.disk_usage(folder).free
        except OSError as exc:
            self._unwritable(folder, exc)
            return
        if free < size + FREE_MARGIN:
            self.warnings.append(f"hd: the layout cache is off for this start: {folder} has {free / 1e9:.1f} GB free, "
                                 f"it would take {size / 1e9:.2f} GB (later starts repack the weights)")
            return
        try:   # made here, not on the writer: a folder that takes no file is one line, not the writer's traceback
            out = open(tmp, "wb")
        except OSError as exc:
            self._unwritable(folder, exc)
            return
        self.writing = size
        self.note = (f"hd: keeping the weights in the GEMM's layout ({size / 1e9:.2f} GB of disk, as much again as "
                     f"they take in the file) in {self.path}: later starts map them instead of repacking; "
                     "HD_LAYOUT_CACHE=0 turns this off (delete the file to free the space)")
        # a signal ends the process without waiting for the writer: its file is removed then
        forget = interrupts.at_exit(lambda: _discard(tmp))
        writer = threading.Thread(target=self._write, args=(kernels, tmp, out, forget), name="hd-layout-writer",
                                  daemon=False)
        _WRITERS.append((writer, self))
        writer.start()

    def _unwritable(self, folder: Path, exc: OSError) -> None:
        """The line of a folder that takes no cache (read-only), once per process and folder: why,
        and what to do. (A file in its place is refused before: environment.check_cache_dir.)"""
        if str(folder) in _UNWRITABLE:
            return
        _UNWRITABLE.add(str(folder))
        self.warnings.append(f"hd: the layout cache is off for this start: {folder} cannot be written "
                             f"({exc.strerror or exc}): later starts repack the weights; make it writable, set "
                             "HD_CACHE_DIR to a writable folder, or HD_LAYOUT_CACHE=0 to stop trying")

    def _write(self, kernels: list, tmp: Path, out, forget=lambda: None) -> None:
        """The packings, the index and the footer into `tmp` (opened as `out`), then renamed to
        `path`. A failure leaves nothing (the temporary file removed): later starts repack, and try
        again."""
        entries = {}
        try:
            with out:
                for kernel in kernels:
                    if self.abandon.is_set():
                        raise _Abandoned
                    out.write(b"\0" * (-out.tell() % ALIGN))
                    at = out.tell()
                    data = memoryview(kernel.packed.contiguous().numpy()).cast("B")
                    out.write(data)
                    self.written += len(data)
                    block, begin = kernel.packed[0].numel(), 0   # bytes of one column block; a part's first
                    for name, blocks in kernel.names:           # the parts side by side (QLinear.side_by_side)
                        shape = [blocks, *kernel.packed.shape[1:]]
                        part = data[begin:begin + blocks * block]
                        entries[name] = [at + begin, shape, kernel.fmt, _digest(name, at + begin, shape, kernel.fmt, part)]
                        begin += blocks * block
                index = json.dumps({"format": FORMAT, "key": self.key, "source": self.source, "entries": entries}).encode()
                out.write(index)
                out.write(struct.pack("<Q8s", len(index), MAGIC))
            self._remove_older()
            os.replace(tmp, self.path)
        except _Abandoned:
            _discard(tmp)
        except OSError as exc:
            _discard(tmp)
            print(f"hd: the layout cache {self.path} could not be written ({exc.strerror or exc}): later starts "
                  "repack the weights", file=sys.stderr, flush=True)
        finally:
            forget()
            if (threading.current_thread(), self) in _WRITERS:
                _WRITERS.remove((threading.current_thread(), self))

    def _remove_older(self) -> None:
        """Other layout files of the same GGUF path (another modification time, another build of the
        kernel): one file per model is kept. And those whose GGUF is gone (a model deleted, a
        checkout removed): nothing would map them again, and an 8B's is 5 GB."""
        for other in self.path.parent.glob("*.hdl"):
            if other == self.path:
                continue
            try:
                source = read_source(other)
                if source == self.source or (source is not None and not os.path.exists(source)):
                    other.unlink()
            except OSError:
                pass


def _side_by_side(packings: list[torch.Tensor]) -> torch.Tensor:
    """The packings one after another along the column blocks: a view where they lie so in the
    map (a joined layer's parts, as `keep` wrote them), else a copy."""
    first = packings[0]
    at = first.storage_offset()
    for p in packings:
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() \
                or p.storage_offset() != at:
            return torch.cat(packings)
        at += p.numel()
    rows = sum(p.shape[0] for p in packings)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _discard(tmp: Path) -> None:
    """A failed write's temporary file removed where the folder lets it be (on a read-only one
    the removal fails too: nothing was left there)."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


class _Abandoned(Exception):
    """The writer was told to stop (`wait`'s Ctrl-C)."""


def wait(progress: bool = False) -> None:
    """Until this process's layout files are written (tests, benchmarks, a second load, the CLI at
    exit). progress: a bar on stderr while they are (the CLI's exit after a first start: an 8B
    model's gigabytes take a while on a slow disk); Ctrl-C there abandons them, leaving no
    file (the next start writes it), and raises KeyboardInterrupt."""
    pending = list(_WRITERS)
    if progress and pending:
        import time
        from ..progress import bar as progress_bar
        total = sum(cache.writing for _, cache in pending)
        with progress_bar(total=total, unit="B", unit_scale=True, desc="hd: writing the layout cache",
                          mininterval=0.5, leave=False) as bar:
            try:
                while any(writer.is_alive() for writer, _ in pending):
                    time.sleep(0.25)
                    bar.update(sum(cache.written for _, cache in pending) - bar.n)
            except KeyboardInterrupt:
                for writer, cache in pending:
                    cache.abandon.set()
                for writer, _ in pending:
                    writer.join()
                raise
    for writer, _ in pending:
        writer.join()


def _remove_stale(folder: Path) -> None:
    """Temporary files of writers whose process no longer runs (killed while writing)."""
    for tmp in folder.glob(".*.hdl.tmp-*"):
        try:
            pid = int(tmp.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except (ValueError, PermissionError, OSError):
            pass


def _index(f, size: int) -> tuple[dict | None, int]:
    """(the index, bytes of packings before it) of an open layout file of `size` bytes, read from
    its footer; (None, 0) where the footer is not one (cut short, not a layout file). ValueError
    where the index is not JSON."""
    if size < FOOTER:
        return None, 0
    f.seek(size - FOOTER)
    length, magic = struct.unpack("<Q8s", f.read(FOOTER))
    if magic != MAGIC or length > size - FOOTER:
        return None, 0
    f.seek(size - FOOTER - length)
    return json.loads(f.read(length)), size - FOOTER - length


def read_source(path: Path) -> str | None:
    """The GGUF path a layout file was made from (its index's "source"), None where unreadable."""
    try:
        with open(path, "rb") as f:
            index, _ = _index(f, path.stat().st_size)
        return index.get("source")
    except (OSError, ValueError, struct.error, AttributeError):
        return None


def for_gguf(gf, folder: Path, int8: bool) -> LayoutCache:
    """The layout cache of an opened GGUF file (model/gguf.GGUFFile) under `folder` (a writer of
    this process still writing it is waited for)."""
    import hashlib
    wait()
    key = f"{gf.key()}|{quants.module_name()}|{'int8' if int8 else 'bf16'}|{FORMAT}|{DIGEST}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return LayoutCache(folder / f"{gf.path.stem}-{digest}.hdl", key, str(gf.path.resolve()))
