"""The M-invariant attention as one compiled function (csrc/attend.cpp), in place of invariant.py's
torch ops on the CPU, where it compiles and where it is measured faster on the machine at hand.

Why: the invariant attention does little arithmetic, but in torch ops its fixed summation order
costs a dozen small ops and small batched GEMMs per layer: on an AMD EPYC (bundled model, int4,
caches of ~250 tokens) a fifth of a one-token forward and 40-53% of a forward with 4 requests
(docs/serve.md). The compiled function fixes each query row's arithmetic (csrc/attend.cpp's
header): every score a dot product summed over the head in order, the max over the keys the row
sees, exp by a polynomial of our own, the values summed in key order. Rows share loops in tiles
but never a sum, so a row's result cannot depend on the other rows: it is M-invariant by
construction, for chains, trees and sliding windows alike (tests/test_invariant.py, test_batch.py).

It is another summation order than the torch path, so it is another reference, as a kernel set is:
plain and speculative decoding use the same one in a process, and which one (`name()`, with a hash
of the source) is part of every cache key that depends on it (cost curves, the invariant
calibration).

Parameters and invariants
  * Compiled once per source, CPU model, torch version and flags by torch.utils.cpp_extension
    (g++ and ninja; ~30 s, a progress line on stderr), cached under torch's extensions folder,
    named by a hash of all of these, so a binary built for another CPU is never loaded.
  * -O3 -march=native -ffp-contract=off, no -ffast-math: vector and scalar code round alike and
    no sum is reordered, whatever the compiler vectorises. -fopenmp: its parallel loops use
    torch's threads (the process keeps one OpenMP runtime: torch's, loaded first).
  * HD_FUSED_ATTENTION: 1 uses it wherever it compiles, 0 never; unset (auto), `decide` times both
    attentions on the model's head shape (one token, an 8-node tree and a 16-token chain over 256
    keys, interleaved rounds, least times) and takes the faster. The choice is cached per source,
    CPU, torch, flags, head shape and thread count (HD_CACHE_DIR/attention), so a machine decides
    once. Whole forwards with it and without (benchmarks/fused_attention.py, docs/dtype.md): on an
    AMD EPYC (bundled model, int4, caches of ~250 tokens) 1 token 16.8 ms against 19.1, an 8-node
    tree 27.8 against 35.7, 4 requests of 4-node trees 49.5 against 84.5.
  * Decided once per process (the first model loaded in the invariant mode): every model and run
    of a process has one numerics.
  * Where it does not compile (no compiler or ninja), the model is not on the CPU or its head is
    wider than the function takes, the torch path stays (`decide` says why).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "attend.cpp"
# -fopenmp: at::parallel_for runs on threads only where OpenMP is on in the extension itself; the
# process has one OpenMP runtime all the same (torch's libgomp is loaded first and shares its soname)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]

_module = None        # the compiled extension, once loaded
_failed: str | None = None
_on = False           # whether invariant.py's attention uses it now


def extension_name(source: Path, prefix: str) -> str:
    """A compiled extension's name: prefix + a hash of its source, the CPU, torch and the flags, so
    a binary built for another CPU or source is never loaded."""
    from .costs import cpu_name
    h = hashlib.sha256((source.read_text() + cpu_name() + torch.__version__ + " ".join(FLAGS)).encode())
    return prefix + h.hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def _name() -> str:
    return extension_name(SOURCE, "hd_attend_")


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
        try:   # a build already there loads in a moment: say "compiling" only when it compiles
            folder = Path(cpp_extension._get_build_directory(name, False))
            built = (folder / f"{name}.so").exists()
        except Exception:
            folder, built = None, False
        if folder is not None:
            _wait_for_build_lock(folder, what)
        t0 = time.perf_counter()
        if not quiet and not built:
            print(f"hd: compiling {what} (once per machine, ~30 s)...", file=sys.stderr, flush=True)

        def build():
            return cpp_extension.load(name=name, sources=[str(source)], extra_cflags=FLAGS,
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


STALE_LOCK_SECONDS = 180   # a build takes ~30 s (a minute on a loaded machine); a lock older is dead


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


def load(quiet: bool = False):
    """The compiled module, or None where it cannot be built here (why: `failure()`)."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    _module, _failed = compile_extension(SOURCE, _name(), "the fused attention", quiet)
    if _module is not None:
        from .environment import fused_tile
        _module.set_tile(fused_tile())
    return _module


def failure() -> str | None:
    return _failed


def use(on: bool) -> None:
    global _on
    _on = bool(on) and load(quiet=True) is not None


@contextlib.contextmanager
def pinned(kind: str):
    """Within the block, the process's attention is `kind` ("fused" or "torch") whatever decide
    measured: for tests and benchmarks that compare the two. Raises RuntimeError for "fused" where
    it does not compile here."""
    global _decision
    if kind == "fused" and load(quiet=True) is None:
        raise RuntimeError(f"the fused attention does not compile here: {failure()}")
    saved = _decision, _on
    _decision = {"attention": kind, "by": "pinned"}
    use(kind == "fused")
    try:
        yield
    finally:
        _decision = saved[0]
        use(saved[1])


def require(kind: str) -> None:
    """Make `kind` ("fused" or "torch") the process's attention whatever timing would choose: a
    configuration that records it (DecodingConfig.attention) runs with the numerics it recorded.
    Raises HdError where "fused" does not compile here."""
    global _decision
    from ..errors import HdError
    if kind not in ("fused", "torch"):
        raise HdError(f"--attention must be auto, fused or torch, not '{kind}'")
    if kind == "fused" and load(quiet=False) is None:
        raise HdError(f"--attention fused: the fused attention does not compile here ({failure()}); "
                      "the run it comes from computed with it, so its tokens cannot be repeated here; "
                      "use --attention torch for this machine's own run")
    _decision = {"attention": kind, "by": "configuration"}
    use(kind == "fused")


def enabled() -> bool:
    return _on


def name() -> str:
    """What the invariant attention is now: part of the cache keys that depend on its numerics."""
    return "fused-" + _name()[-12:] if _on else "torch"


KEY_BLOCK = 16       # csrc/attend.cpp's KB: keys a block of the transposed copy


def attend(q: torch.Tensor, k: torch.Tensor, v1: torch.Tensor, vis: torch.Tensor, scaling: float) -> torch.Tensor:
    """One sequence: q [m, hq, d] fp32 contiguous, k [hkv, >= n, d], v1 [hkv, >= n, d + 1],
    vis [m, n] bool. Returns [m, hq, d] fp32."""
    return _module.attend(q, k, v1, vis, float(scaling))


def attend_many(q: torch.Tensor, kvs, viss, scaling: float, owners=None) -> torch.Tensor:
    """Several sequences in one call: q [M, hq, d] fp32 contiguous holds their rows in order,
    kvs[i] = (k, v1) and viss[i] [m_i, n_i] as in attend(). owners[i], where given, is the
    kvcache.InvariantLayer the keys live in: its transposed copy of them (`transposed()`) is read
    and brought up to date in the call, instead of a scratch copy transposed whole."""
    # a layer that stores bf16 hands the torch ops' attention fp32 copies (padded()): its kept copy
    # is not the keys' dtype then, so a scratch copy serves
    kept = [o if o is not None and o.kbuf.dtype == k.dtype else None
            for o, (k, _) in zip(owners or [None] * len(kvs), kvs)]
    kts, froms = [], []
    for owner in kept:
        kt, valid = owner.transposed() if owner is not None else (None, 0)
        kts.append(None if kt is None else kt[0])
        froms.append(valid)
    out = _module.attend_many(q, [k for k, _ in kvs], kts, froms, [v for _, v in kvs], list(viss), float(scaling))
    _transposed_now(kept, viss)
    return out


def _transposed_now(owners, viss) -> None:
    """After a call: each owner's transposed copy holds the keys its sequence read (a layout
    pads one key to two: that second key is not written yet)."""
    for owner, vis in zip(owners, viss):
        if owner is not None:
            owner.kt_len = min(vis.shape[1], owner.length)


def append_attend_many(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, owners, viss,
                       scaling: float) -> torch.Tensor:
    """attend_many on kvcache.InvariantLayer owners, after appending each sequence's new keys and
    values to its layer, in one compiled call: query [1, hq, M, d], key and value [1, hkv, M, d]
    (any float dtype) hold every sequence's rows in order (sequence i's are viss[i]'s rows).
    Returns [1, M, hq, d] in the query's dtype. The per-sequence copies and the conversions a
    layer would make in Python otherwise were a quarter of a 4-request forward's time."""
    starts = [owner.claim(vis.shape[0], key, vis.shape[1]) for owner, vis in zip(owners, viss)]
    out = _module.append_attend_many(query, key, value, starts, [o.kbuf for o in owners], [o.ktbuf for o in owners],
                                     [o.kt_len for o in owners], [o.vbuf for o in owners], viss, float(scaling))
    _transposed_now(owners, viss)
    return out


MAX_HEAD = 271       # csrc/attend.cpp: 16 vectors of 16 and a scalar tail
FORMAT = 1
_decision: dict | None = None


def decide(model, quiet: bool = True) -> dict:
    """Whether the invariant attention uses the compiled function in this process (module
    docstring): {"attention": "fused" or "torch", "by": what decided, "why"/"ms": details}.
    Decided once per process, so that every model and run of a process has one numerics."""
    global _decision
    if _decision is not None:
        return _decision
    from .environment import fused_attention
    asked = fused_attention()
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    hq = getattr(cfg, "num_attention_heads", None)
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or (getattr(cfg, "hidden_size", 0) // hq if hq else None)
    if asked == "0":
        _decision = {"attention": "torch", "by": "HD_FUSED_ATTENTION=0"}
    elif next(model.parameters()).device.type != "cpu":
        _decision = {"attention": "torch", "by": "device", "why": "not a CPU model"}
    elif not (hq and hkv and d) or d > MAX_HEAD:
        _decision = {"attention": "torch", "by": "shape", "why": f"head size {d} (the function takes up to {MAX_HEAD})"}
    elif load(quiet=quiet) is None:
        _decision = {"attention": "torch", "by": "build", "why": failure()}
        if not quiet:
            print(f"hd: the fused attention does not compile here ({failure()}); using torch ops "
                  "(HD_FUSED_ATTENTION=0 skips trying)", file=sys.stderr, flush=True)
    elif asked == "1":
        _decision = {"attention": "fused", "by": "HD_FUSED_ATTENTION=1"}
    else:
        ms = _measured(hq, hkv, d, quiet)
        _decision = {"attention": "fused" if ms["fused"] < ms["torch"] else "torch", "by": "measured", "ms": ms}
    use(_decision["attention"] == "fused")
    return _decision


def _measured(hq: int, hkv: int, d: int, quiet: bool) -> dict:
    """{"fused": ms, "torch": ms}: both attentions timed on this head shape, cached per machine."""
    from . import costs
    key = f"{_name()}|heads {hq}/{hkv}x{d}|threads {torch.get_num_threads()}"
    path = costs.cache_file("attention", key)
    got = costs.read_record(path, key, FORMAT, lambda d: isinstance(d["ms"], dict) and all(
        costs.number(d["ms"][k], 0) for k in ("fused", "torch")), "the attention timing record")
    if got is not None:
        return got["ms"]
    if not quiet:
        print("hd: timing the fused attention against torch ops (once per machine)...", file=sys.stderr, flush=True)
    ms = time_both(hq, hkv, d)
    costs.write_json(path, {"key": key, "format": FORMAT, "ms": ms})
    return ms


def time_both(hq: int, hkv: int, d: int, keys: int = 256, rounds: int = 7, calls: int = 10) -> dict:
    """Least time (ms) of `calls` attention calls, summed over a one-token row, an 8-node tree and
    a 16-token chain over `keys` cached keys, for each path, in interleaved rounds."""
    from . import invariant
    gen = torch.Generator().manual_seed(0)
    cases = []
    for m, tree in ((1, False), (8, True), (16, False)):
        n = keys + m
        vis = torch.ones(m, n, dtype=torch.bool).tril(n - m)
        if tree:   # a binary tree: each node sees the prefix and its ancestors
            vis[:, n - m:] = False
            for r in range(m):
                a = r
                while True:
                    vis[r, n - m + a] = True
                    if a == 0:
                        break
                    a = (a - 1) // 2
        q = torch.randn(1, hq, m, d, generator=gen)
        k, v = torch.randn(1, hkv, n, d, generator=gen), torch.randn(1, hkv, n, d, generator=gen)
        lay = invariant.layout(vis, m, n, hq // hkv, "cpu")
        cases.append((q, *invariant.fp32_kv(k, v, lay.rows), lay))
    was = _on
    best = {"fused": [float("inf")] * len(cases), "torch": [float("inf")] * len(cases)}
    try:
        with torch.inference_mode():
            for r in range(rounds):
                for path in (("fused", "torch") if r % 2 == 0 else ("torch", "fused")):
                    use(path == "fused")
                    for i, (q, k, v1, lay) in enumerate(cases):
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            invariant.attend_kv(q, k, v1, lay, d ** -0.5)
                        best[path][i] = min(best[path][i], time.perf_counter() - t0)
    finally:
        use(was)
    return {path: round(1e3 * sum(ts), 3) for path, ts in best.items()}
