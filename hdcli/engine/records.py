"""Measurement records kept under HD_CACHE_DIR: one JSON file per kind and key (cost curves, the
invariant calibration, the attention timing, the activation choice), written whole or not at all,
read back only under the same key and format, dropped with one line when damaged.

Every record carries the key it was measured under (which includes the CPU's model name, cpu_name):
measurements do not travel between machines.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import sys
from pathlib import Path

from .environment import cache_dir, cpu_cap


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The first processor's flags in /proc/cpuinfo (none where there is no such file)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
    """The CPU model (lscpu's 'Model name'), with its family and model numbers where it names an
    x86 CPU, part of every cache key: curves do not travel. The numbers matter where a VM names
    a Zen 3 and a Zen 5 alike ("AMD EPYC"): a kernel built for one's AVX-512 must never load on
    the other. " (as AVX2)" where HD_CPU=avx2 runs hd as on such a CPU (environment.cpu_cap).
    Read once per process: every curve lookup (each api.generate) builds a key."""
    name, numbers = platform.processor() or platform.machine(), {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                name = value.strip()
            elif key in ("cpu family", "model") and key not in numbers:
                numbers[key] = value.strip()
            if key == "flags":   # the first processor's block is read whole by now
                break
    except OSError:
        pass
    if len(numbers) == 2:
        name += f" (family {numbers['cpu family']} model {numbers['model']})"
    return name + {"avx2": " (as AVX2)", "avx2-vnni": " (as AVX2 + AVX-VNNI)"}.get(cpu_cap(), "")


def cache_root() -> Path:
    return cache_dir() / "costs"


def cache_file(kind: str, key: str) -> Path:
    """Where a cache record of one kind (costs, invariant, dtype) for `key` lives: beside the cost
    curves, named by the key's hash (the key itself is stored inside and checked on reading)."""
    return cache_root().parent / kind / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def read_record(path: Path, key: str, fmt, valid, what: str) -> dict | None:
    """The cache record written for `key` in format `fmt` (write_json), checked by valid(record),
    or None: then it is measured again. Missing, another key's or another format's: None, said
    nothing. One for this key that does not parse or that `valid` refuses (a wrong type under the
    right key, an edited or damaged file) is dropped with one line on stderr, so a damaged cache
    costs a measurement and never a run. Every reader of HD_CACHE_DIR's records comes here."""
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict) and (data.get("key") != key or data.get("format") != fmt):
        return None
    try:
        ok = isinstance(data, dict) and bool(valid(data))
    except (TypeError, ValueError, KeyError, AttributeError, IndexError):
        ok = False
    if ok:
        return data
    print(f"warning: {path}: {what} is malformed; re-measuring", file=sys.stderr, flush=True)
    try:
        path.unlink()
    except OSError:
        pass
    return None


def number(x, low: float = float("-inf")) -> bool:
    """A finite JSON number >= low (not a bool): what a measured field must be."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= low


def write_json(path: Path, record: dict) -> None:
    """A cache record, written whole or not at all (a temporary file, then a rename). A read-only
    home is no error: it only costs a measurement next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        pass
