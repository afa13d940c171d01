"""Files the user names, read with a bound, and what a path that is no file is.

Each kind of file has a most bytes, declared below with why; read_text reads at most that many
plus one, so a file past it (/dev/zero, a FIFO fed forever, a log given by mistake) is refused
in one line naming the flag and the file, in bounded memory, before anything parses it.

kind_of says what a path is in words (a symlink loop, a FIFO, a broken link), so that a check
for a file never calls such a path missing.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .errors import HdError

MiB = 1 << 20
# a prompt or a prediction: 16 MiB is millions of tokens, past any model's context, which
# refuses it anyway; the bound only keeps a wrong file from filling memory first
TEXT_BYTES = 16 * MiB
# a configuration or plan: hd writes them (any --json output, a bench summary, `hd plan --out`)
# in kilobytes; 16 MiB leaves room for the largest summary that records a configuration
DOCUMENT_BYTES = 16 * MiB
# an API keys file: a key a line; 1 MiB is over 10,000 keys of 64 characters with their names
KEYS_BYTES = 1 * MiB
# a benchmark's questions (--data, --bfcl): Spec-Bench's 480 are 0.5 MB, a BFCL category a few MB
BENCH_BYTES = 64 * MiB


def size_text(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n} bytes"


def read_text(path: str | Path, flag: str, limit: int, hint: str) -> str:
    """The UTF-8 text of the file given with `flag` (a BOM is no part of it), or a one-line
    HdError: `FLAG PATH: over LIMIT; HINT` past `limit` bytes, `cannot read FLAG PATH: why`."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)   # never more: /dev/zero has no end
    except OSError as exc:
        raise HdError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise HdError(f"{flag} {path}: over {size_text(limit)}; {hint}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise HdError(f"cannot read {flag} {path}: not UTF-8 text (byte {exc.start} is "
                      f"{data[exc.start]:#04x}); save it as UTF-8") from None


_SPECIAL = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
            (stat.S_ISBLK, "a block device"))


def kind_of(path: str | Path) -> str:
    """"file" or "folder" (links followed), "missing", or what else the path is, in words:
    "a symlink loop", "a broken symlink (to T)", "a FIFO", "a socket", "a character device",
    "a block device", "not readable (why)"."""
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink loop"
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            if os.path.islink(path):
                try:
                    return f"a broken symlink (to {os.readlink(path)}, which does not exist)"
                except OSError:
                    return "a broken symlink"
            return "missing"
        return f"not readable ({exc.strerror})"
    if stat.S_ISREG(st.st_mode):
        return "file"
    if stat.S_ISDIR(st.st_mode):
        return "folder"
    return next((name for test, name in _SPECIAL if test(st.st_mode)), "not a regular file or folder")
