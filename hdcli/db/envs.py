"""The LMDB environments of the DB files this process opened, one per file (LMDB allows one open
per file per process): lock files, files too short for their pages, and which file was mapped."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import HdError

INITIAL_MAP_SIZE = 1 << 28     # 256 MiB; doubled whenever LMDB reports the map full


def lmdb_module():
    import lmdb   # loaded at first use: a command that opens no DB (`hd --help`) never loads it
    return lmdb


# realpath -> ((realpath, st_dev, st_ino), lmdb.Environment, writable, whether this process made
# its lock file): LMDB allows one open per file per process
ENVS: dict = {}


def open_env(path: Path, writable: bool):
    """Readers take LMDB's lock file so a concurrent writer (`--learn`) never reuses pages a
    reader still sees; where no lock file can be made (read-only filesystem) no writer can exist
    either, and we read without one."""
    real = os.path.realpath(path)
    for _ in range(3):
        st = os.stat(real)
        env = _open_env_of(path, real, (real, st.st_dev, st.st_ino), writable, st.st_size)
        now = os.stat(real)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            return env
        forget_env(path)   # replaced while it was opened: the identity must be the mapped file's
    raise HdError(f"{path} is being replaced again and again (a build writing to it?): try again when it is done")


def file_identity(env) -> tuple:
    """(st_dev, st_ino) of the file an open environment maps."""
    return next(entry[0][1:] for entry in ENVS.values() if entry[1] is env)


def forget_env(path) -> None:
    """Close a file's cached environment, and remove its lock file if this process made it (a
    file refused on open leaves nothing behind)."""
    real = os.path.realpath(path)
    entry = ENVS.pop(real, None)
    if entry is not None:
        entry[1].close()
        if entry[3]:
            Path(real + "-lock").unlink(missing_ok=True)


def _open_env_of(path, real: str, key: tuple, writable: bool, size: int):
    lmdb = lmdb_module()
    cached = ENVS.get(real)
    if cached and cached[0] == key and (cached[2] or not writable):
        return cached[1]
    if cached:
        ENVS.pop(real)[1].close()
    had_lock = os.path.exists(real + "-lock")

    def drop_new_lock():  # a file refused here must not leave a lock file we created
        if not had_lock:
            Path(real + "-lock").unlink(missing_ok=True)
    try:
        if writable:
            env = lmdb.open(real, subdir=False, map_size=max(INITIAL_MAP_SIZE, 2 * size),
                            max_readers=512)
        else:
            try:
                env = lmdb.open(real, subdir=False, readonly=True, max_readers=512, readahead=False)
            except lmdb.Error:
                env = lmdb.open(real, subdir=False, readonly=True, lock=False, readahead=False)
    except lmdb.Error as exc:
        drop_new_lock()
        why = str(exc).splitlines()[0]
        if any(k in why for k in ("No space", "too large", "Disk quota")):   # writing its lock file
            raise HdError(f"cannot open {path} ({why}): the disk may be full or a file-size limit "
                          "reached: free space and try again") from None
        raise HdError(f"{path} is not an hd DB ({why})") from None
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]  # both read from the meta page
    size = os.stat(real).st_size
    if size < need:
        env.close()
        drop_new_lock()
        raise HdError(f"{path} is truncated: {size} bytes, but its pages reach {need} (an interrupted "
                      "copy or a full disk?): rebuild it or restore a good copy")
    ENVS[real] = (key, env, writable, not had_lock and os.path.exists(real + "-lock"))
    return env
