"""Building hd's C++ kernels (csrc/): compiled once per machine by torch.utils.cpp_extension (g++
and ninja) and cached under torch's extensions folder, named by a hash of the source, the CPU, torch
and the flags, so a binary built for another CPU or source is never loaded.

  * -O3 -march=native -ffp-contract=off, no -ffast-math: vector and scalar code round alike and no
    sum is reordered, whatever the compiler vectorises (the kernels' exactness rests on this).
    -march=x86-64-v3 (AVX2, FMA, F16C) instead where HD_CPU=avx2 asks for the AVX2-only path.
  * A build lock left by a killed build is removed after STALE_LOCK_SECONDS, said in one line.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import torch

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


STALE_LOCK_SECONDS = 180   # a build takes ~30 s (a minute on a loaded machine); a lock older is dead


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
        # a build already there loads in a moment: say "compiling" only when it compiles
        folder, built = _build_folder(name), is_built(name)
        if folder is not None:
            _wait_for_build_lock(folder, what)
        t0 = time.perf_counter()
        if not quiet and not built:
            print(f"hd: compiling {what} (once per machine, ~30 s)...", file=sys.stderr, flush=True)

        def build():
            return cpp_extension.load(name=name, sources=[str(_beside_build(source, folder))], extra_cflags=flags(),
                                      extra_ldflags=["-fopenmp"], verbose=False)
        try:
            module = build()
        except (ImportError, OSError) as exc:
            if not built:
                raise
            # a build that does not load (a truncated or foreign .so in the cache): dropped and
            # built again once, said, so the kernels in use never change without a word
            print(f"warning: {folder / (name + '.so')} does not load ({_why(exc)}); rebuilding {what} (~30 s)",
                  file=sys.stderr, flush=True)
            shutil.rmtree(folder, ignore_errors=True)
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
    other's kernel at every start that alternated, ~30 s each, waiting on each other's lock."""
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


def _wait_for_build_lock(folder: Path, what: str) -> None:
    """torch's build lock (`lock` in the extension's folder) is a file that a process killed while
    compiling leaves behind, and torch waits on it forever, saying nothing: every later hd run
    hung at load. Wait here for another process's build, saying so, and remove a lock older
    than STALE_LOCK_SECONDS, in one line."""
    lock = folder / "lock"
    said = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except OSError:   # no lock (or none left): build or load
            return
        if age > STALE_LOCK_SECONDS:
            print(f"warning: {lock} is {age / 60:.0f} min old, left by a build that was killed: removing "
                  f"it and building {what}", file=sys.stderr, flush=True)
            lock.unlink(missing_ok=True)
            return
        if not said:
            print(f"hd: waiting for another process building {what} ({lock})...", file=sys.stderr, flush=True)
            said = True
        time.sleep(0.5)


def _why(exc: Exception) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:120]}{'...' if len(first) > 120 else ''}"
