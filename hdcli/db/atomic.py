"""Writing a new DB file atomically: a temporary file beside the output, renamed into place after
its last commit, and removed on any interruption (Ctrl-C, SIGTERM); leftovers of killed builds
swept by the next build. The invariants: hdcli/db/stores.py."""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .. import interrupts
from ..errors import HdError
from . import envs
from .codec import digest_hex, record_hash
from .header import FORMAT_VERSION, write_header


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


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


class StoreWriter:
    """Writes a new store at a temporary path; `commit()` renames it into place.

    Puts are batched into write transactions; when LMDB reports the map full the map is doubled
    and the batch is replayed, so a big build never crashes on the map size."""

    def __init__(self, path: str | Path, overwrite: bool = False, batch: int = 20000):
        lmdb = envs.lmdb_module()
        self.path = Path(path)
        check_output_path(self.path, overwrite)
        self.overwrite = overwrite
        sweep_stale(self.path.parent, self.path.name + ".tmp-")
        if not self.path.exists():  # the lock file of a DB deleted since is an orphan
            Path(str(self.path) + "-lock").unlink(missing_ok=True)
        self.temps: list[Path] = []   # every temporary file made: abort() removes them all
        self.tmp = self._new_temp()
        self.map_size = envs.INITIAL_MAP_SIZE
        try:
            self.env = lmdb.open(str(self.tmp), subdir=False, map_size=self.map_size, lock=False,
                                 sync=False, metasync=False, writemap=False, max_dbs=0)
        except BaseException:   # Ctrl-C or SIGTERM here, before writing() can abort
            self._remove_temps()
            raise
        self.pending: list[tuple[bytes, bytes]] = []
        self.batch, self.keys, self.done = batch, 0, False

    def _new_temp(self) -> Path:
        """An empty `OUT.tmp-PID-*` beside the output, recorded before anything can interrupt
        between its creation and its removal by abort()."""
        fd, name = tempfile.mkstemp(prefix=f"{self.path.name}.tmp-{os.getpid()}-", dir=self.path.parent)
        self.temps.append(Path(name))
        os.close(fd)
        return Path(name)

    def put(self, key: bytes, value: bytes) -> None:
        self.pending.append((key, value))
        if len(self.pending) >= self.batch:
            self.flush()

    def flush(self) -> None:
        lmdb = envs.lmdb_module()
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
        lmdb = envs.lmdb_module()
        name = str(self._new_temp())
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
            self._remove_temps()

    def _remove_temps(self) -> None:
        for tmp in self.temps:   # the packed copy too, wherever commit() was interrupted
            tmp.unlink(missing_ok=True)


@contextmanager
def writing(path: str | Path, overwrite: bool = False) -> Iterator[StoreWriter]:
    """`with writing(out) as w: w.put(...); w.commit(header)`: nothing reaches `out` unless
    commit() ran; any exception (Ctrl-C included) removes the temporary files, and so does SIGTERM
    (raised as KeyboardInterrupt while writing: its default action would end the process with
    no cleanup; under the command line's handler, interrupts.deferred)."""
    with _sigterm_interrupts(), interrupts.deferred():
        w = StoreWriter(path, overwrite=overwrite)
        try:
            yield w
        finally:
            w.abort()


@contextmanager
def _sigterm_interrupts():
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield   # only the main thread may set handlers; a handler someone set is theirs
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
