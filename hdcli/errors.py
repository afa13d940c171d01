"""The one exception users see: its message is printed as a single line and the CLI exits 2; and
disk_error, the one-line message for a write the disk refused (the CLI prints it the same way)."""
from __future__ import annotations

import errno
import os


class HdError(Exception):
    """A problem with the user's input or environment, with what to do about it."""


# errno values that mean "the disk/file system refused the write": a user-fixable condition
_DISK_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EACCES}


def disk_error(exc: BaseException) -> str | None:
    """A one-line message for a write refused by the disk, or None for anything else."""
    if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
        where = f" ({exc.filename})" if exc.filename else ""
        return (f"cannot write{where}: {os.strerror(exc.errno)}. Nothing was replaced: outputs are "
                "written to a temporary file and renamed only when complete; free space or choose "
                "another output path")
    text = str(exc)
    if type(exc).__module__ == "lmdb" and any(k in text for k in ("No space", "too large", "Read-only", "Disk quota")):
        return (f"cannot write the DB: {text.splitlines()[0]}. Nothing was replaced; free space or "
                "choose another output path")
    return None
