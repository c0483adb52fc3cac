"""Cgroup files kept open between ticks and re-read with ``pread`` at offset 0.

The pod collector reads two or three small files of every pod and container each
second; opening a cgroupfs path (a walk through kernfs) and closing it again costs
more than generating the few bytes read. seq_file-backed kernel files (cgroupfs,
/proc) regenerate their content when read at offset 0, so one descriptor per file
serves every tick. An open descriptor does not keep a cgroup from being removed:
after ``rmdir`` the read fails with ENODEV, which is "gone" as before, and the
descriptor is dropped. Descriptors are capped at a share of RLIMIT_NOFILE (beyond
it, files are opened per read as before) and closed when their target leaves.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from metrics.collect.base import os_error, read_bytes

_O_READ: Final = os.O_RDONLY | os.O_CLOEXEC
_CHUNK: Final = 8192
#: Descriptors left for everything else the process opens (sockets, the store, logs).
_RESERVE: Final = 256


def default_limit() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max((soft - _RESERVE) // 2, 0)


class OpenFiles:
    def __init__(self, limit: int | None = None) -> None:
        self.limit = default_limit() if limit is None else limit
        self._fds: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._fds)

    def read(self, path: str) -> bytes:
        """The file's bytes; ``ReadError`` (``gone`` for a removed cgroup) instead of OSError."""
        fd = self._fds.get(path)
        if fd is None:
            if len(self._fds) >= self.limit:
                return read_bytes(path)
            try:
                fd = os.open(path, _O_READ)
            except OSError as exc:
                raise os_error(Path(path), exc) from exc
            self._fds[path] = fd
        try:
            data = os.pread(fd, _CHUNK, 0)
        except OSError as exc:
            self._drop(path)
            raise os_error(Path(path), exc) from exc
        if len(data) == _CHUNK:  # larger than a cgroup file should be: read it whole
            return read_bytes(path)
        return data

    def retain(self, paths: Iterable[str]) -> None:
        """Close every descriptor whose path is not in ``paths``."""
        keep = set(paths)
        for path in [p for p in self._fds if p not in keep]:
            self._drop(path)

    def close(self) -> None:
        self.retain(())

    def _drop(self, path: str) -> None:
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)
