"""Files only this process's user may read: the state directory's (0600 files, 0700
directories). Used by the core's state and by tasks keeping state (the metrics store,
checkpoints)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Final

FILE_MODE: Final = 0o600
DIR_MODE: Final = 0o700


def private_dir(path: Path) -> None:
    """``path`` (and its missing parents) created 0700; an existing one of ours tightened to 0700."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid == os.geteuid() and st.st_mode & 0o777 != DIR_MODE:
        path.chmod(DIR_MODE)


def private_file(path: Path) -> None:
    """``path`` exists, 0600 if it is ours (created empty if missing)."""
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and st.st_mode & 0o777 & ~FILE_MODE:
            os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` atomically (temporary file 0600, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            os.fchmod(out.fileno(), FILE_MODE)  # an old temporary file kept its mode
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def tighten(state_dir: Path) -> list[str]:
    """Every regular file of ours under ``state_dir`` 0600 and every directory 0700
    (sockets and symlinks left alone); the paths changed."""
    changed: list[str] = []
    for root, dirs, files in os.walk(state_dir):
        for name, mode in [(d, DIR_MODE) for d in dirs] + [(f, FILE_MODE) for f in files]:
            path = os.path.join(root, name)
            with contextlib.suppress(OSError):  # gone meanwhile, or not ours to change
                st = os.lstat(path)
                kind_ok = (mode == DIR_MODE and os.path.isdir(path) and not os.path.islink(path)) or (
                    mode == FILE_MODE and os.path.isfile(path) and not os.path.islink(path))
                if kind_ok and st.st_uid == os.geteuid() and st.st_mode & 0o777 & ~mode:
                    os.chmod(path, st.st_mode & 0o777 & mode, follow_symlinks=False)
                    changed.append(path)
    return changed
