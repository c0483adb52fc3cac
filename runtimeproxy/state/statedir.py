"""The state directory: one proxy at a time, and private to it.

``claim(state_dir)`` at start (before anything in it is read or written): creates the
directory (0700), takes an exclusive ``flock`` on ``<state_dir>/lock`` for the life of
the process and writes the holder's pid into it. A second proxy pointed at the same
directory (another socket and port, same ``state_dir``) is refused with a
``ConfigError`` naming the directory and the holder's pid (exit 2): two writers of
``metrics.db`` and ``changes.jsonl`` and two QoS managers on the same cgroups would
each undo the other. The kernel drops the lock when the holder exits, however it exits:
no stale lock file to clean up.

Everything the proxy keeps there is its own: the directory 0700, files 0600. ``claim``
tightens what an older version left wider (metrics.db was 0644); new files are created
0600 (``runtimeproxy.ops.privatefiles``; SQLite gives -wal and -shm the database
file's mode).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Final

import structlog

from runtimeproxy.config.configvalues import ConfigError
from runtimeproxy.ops.privatefiles import FILE_MODE, private_dir, tighten

log = structlog.get_logger("runtimeproxy.statedir")

LOCK_NAME: Final = "lock"
class StateDirLock:
    """The held lock: ``release()`` (or the process's exit) frees the directory."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


def claim(state_dir: Path) -> StateDirLock:
    """Lock ``state_dir`` for this process (see the module doc); ConfigError if another holds it."""
    try:
        private_dir(state_dir)
        fd = os.open(state_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as exc:
        raise ConfigError("state_dir", str(state_dir), f"cannot be used: {exc.strerror or exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise ConfigError("state_dir", str(state_dir),
                              f"in use by another koord-runtime-proxy (pid {holder}, holding"
                              f" {state_dir / LOCK_NAME}); give each instance its own state_dir") from exc
        raise ConfigError("state_dir", str(state_dir), f"cannot be locked: {exc.strerror or exc}") from exc
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    os.fchmod(fd, FILE_MODE)
    changed = tighten(state_dir)
    if changed:
        log.info("state_dir_permissions_tightened", path=str(state_dir), files=changed)
    return StateDirLock(state_dir, fd)
