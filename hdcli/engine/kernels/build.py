"""Building hd's C++ kernels (csrc/): compiled once per machine by torch.utils.cpp_extension (g++
and ninja) and cached under torch's extensions folder, named by a hash of the source, the CPU, torch
and the flags, so a binary built for another CPU or source is never loaded.

  * -O3 -march=native -ffp-contract=off, no -ffast-math: vector and scalar code round alike and no
    sum is reordered, whatever the compiler vectorises (the kernels' exactness rests on this).
    -march=x86-64-v3 (AVX2, FMA, F16C) instead where HD_CPU=avx2 asks for the AVX2-only path.
  * One process builds or loads an extension at a time: it holds `hd.lock` in the extension's
    folder (build_lock), which names the holder (PID, host, when it took it). A waiter says
    whom it waits for; the lock of a process that is gone is free at once (an flock, released
    by the kernel when its holder dies), and a waiter finding a gone holder's name in it says so
    in one line. torch's own `lock` there is then a dead build's: removed, never waited on.
  * No build begins in a process that is ending (interrupts.stopping), and one that is running
    when the process ends is stopped with it: its compiler killed, both locks left free.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import torch

from ... import interrupts
from ..environment import cpu_cap
from ..records import cpu_name


def flags() -> list[str]:
    """The compiler's flags. -fopenmp: at::parallel_for runs on threads only where OpenMP is on in
    the extension itself; the process has one OpenMP runtime all the same (torch's libgomp is
    loaded first and shares its soname)."""
    march = {"avx2": ["-march=x86-64-v3"], "avx2-vnni": ["-march=x86-64-v3", "-mavxvnni"]}.get(cpu_cap(), ["-march=native"])
    return ["-O3", *march, "-ffp-contract=off", "-fopenmp"]
class OnePerProcess:
    """A compiled kernel's state (fused.KERNEL, quants.GEMM): one a process. A copied model (torch.ao's
    quantize_dynamic copies one) shares it: its compiled module cannot be copied."""

    def __deepcopy__(self, memo):
        return self


LOCK_NAME = "hd.lock"        # build_lock's, in the extension's folder
TORCH_LOCK_NAME = "lock"     # torch.utils.cpp_extension's FileBaton there


def extension_name(source: Path, prefix: str) -> str:
    """A compiled extension's name: prefix + a hash of its source, the CPU, torch and the flags, so
    a binary built for another CPU or source is never loaded."""
    h = hashlib.sha256((source.read_text() + cpu_name() + torch.__version__ + " ".join(flags())).encode())
    return prefix + h.hexdigest()[:12]


def _build_folder(name: str) -> Path | None:
    """Extension `name`'s folder in torch's extensions folder, None where torch cannot say."""
    try:
        from torch.utils import cpp_extension
        return Path(cpp_extension._get_build_directory(name, False))
    except Exception:
        return None


def is_built(name: str) -> bool:
    """Whether extension `name` is in torch's extensions folder already (it loads in a moment)."""
    folder = _build_folder(name)
    return folder is not None and (folder / f"{name}.so").exists()


def compile_extension(source: Path, name: str, what: str, quiet: bool = False):
    """(module, None) or (None, why) for a C++ source of csrc/, compiled once per name
    (extension_name) by torch.utils.cpp_extension (g++ and ninja) and cached under torch's
    extensions folder; `what` names it in the progress lines on stderr. A build there that does
    not load is dropped and built again once, in one line on stderr."""
    rebuilt = False
    try:
        from torch.utils import cpp_extension
        if shutil.which("ninja") is None:   # pip's ninja, in a virtual environment not activated
            try:
                import ninja
                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            except (ImportError, AttributeError):
                pass
        folder = _build_folder(name)
        with build_lock(folder, what) if folder is not None else contextlib.nullcontext():
            if interrupts.stopping():   # never a compiler started by a process that is ending
                return None, "hd is stopping"
            # a build already there (maybe the one just waited for) loads in a moment: say
            # "compiling" only when it compiles
            built = is_built(name)
            t0 = time.perf_counter()
            if not quiet and not built:
                print(f"hd: compiling {what} (once per machine, ~30 s)...", file=sys.stderr, flush=True)

            def build():
                return cpp_extension.load(name=name, sources=[str(_beside_build(source, folder))],
                                          extra_cflags=flags(), extra_ldflags=["-fopenmp"], verbose=False)
            try:
                module = build()
            except (ImportError, OSError) as exc:
                if not built:
                    raise
                # a build that does not load (a truncated or foreign .so in the cache): dropped and
                # built again once, said, so the kernels in use never change without a word
                print(f"warning: {folder / (name + '.so')} does not load ({_why(exc)}); rebuilding {what} (~30 s)",
                      file=sys.stderr, flush=True)
                _empty(folder)
                cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)   # else this process skips the build
                built, rebuilt = False, True
                module = build()
            if not quiet and not built:
                print(f"hd: {what} ready ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
            return module, None
    except Exception as exc:   # no compiler, no ninja, a read-only home: the torch path stays
        why = _why(exc)
        if rebuilt:
            print(f"warning: {what} could not be rebuilt ({why})", file=sys.stderr, flush=True)
        return None, why


def _beside_build(source: Path, folder: Path | None) -> Path:
    """The source as the build reads it: a copy in the extension's own folder (whose name holds the
    source's hash, so the copy is the same wherever hd is installed). ninja rebuilds where its
    command changed, and the command names the source's path: two installs of the same hd (two
    virtual environments, a checkout beside a wheel) built from their own paths rebuilt each
    other's kernel at every start that alternated, waiting on each other's lock."""
    if folder is None:
        return source
    copy = folder / source.name
    text = source.read_bytes()
    try:
        if not copy.exists() or copy.read_bytes() != text:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = copy.with_name(f".{copy.name}.{os.getpid()}")
            tmp.write_bytes(text)
            os.replace(tmp, copy)   # whole or not at all: a concurrent build reads one or the other
    except OSError:   # a folder hd cannot write: the build fails there too, and says so
        return source
    return copy


def _empty(folder: Path) -> None:
    """Everything in an extension's folder but the lock this process holds in it (removing the
    lock file would let another process lock a new one beside it)."""
    for p in folder.iterdir():
        if p.name != LOCK_NAME:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def _holder(f) -> dict | None:
    """Who the lock file names (build_lock's record), None where it names no one."""
    f.seek(0)
    try:
        held = json.loads(f.read() or "null")
    except ValueError:
        return None
    return held if isinstance(held, dict) else None


def _who(held: dict | None) -> str:
    if held is None:
        return "another process"
    since = time.strftime("%H:%M:%S", time.localtime(held.get("since", 0)))
    host = held.get("host")
    return f"PID {held.get('pid')}{'' if host in (None, socket.gethostname()) else ' on ' + str(host)} (since {since})"


@contextlib.contextmanager
def build_lock(folder: Path, what: str):
    """Extension `folder`'s build lock, held while it builds or loads. torch's own `lock` is a
    file a killed build leaves behind, which torch waits on forever without a word (every later
    start hung); hd's is an flock, free the moment its holder's process is gone, on a file that
    names the holder. So a waiter waits only for a live holder, says whom, and a holder that is
    gone is said in one line; torch's `lock` found under it is a dead build's and is removed."""
    path, stale = folder / LOCK_NAME, folder / TORCH_LOCK_NAME
    try:
        folder.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+")
    except OSError:   # a folder hd cannot write: the build fails there too, and says so
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"hd: waiting for {_who(_holder(f))}, building {what} ({path})...", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)   # a signal meanwhile ends hd here (interrupts)
        gone = _holder(f)   # a holder that let go emptied the file: a name left is a process killed
        if gone is not None or stale.exists():
            whose = f"{_who(gone)}, which is gone (killed while building)" if gone else "a build that was killed"
            print(f"warning: {path if gone else stale} was left by {whose}: taking it"
                  + (f" and removing {stale}" if gone and stale.exists() else "") + f"; building {what}",
                  file=sys.stderr, flush=True)
            stale.unlink(missing_ok=True)
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}))
        f.flush()

        def release() -> None:   # also as the process ends mid-build: torch's lock is this build's
            stale.unlink(missing_ok=True)
            os.ftruncate(f.fileno(), 0)
        forget = interrupts.at_exit(release)
        try:
            yield
        finally:
            forget()
            release()   # torch's FileBaton removes its own lock as a build ends; one left is this build's


def _why(exc: Exception) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:120]}{'...' if len(first) > 120 else ''}"
