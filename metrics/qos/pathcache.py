"""Cgroup files a strategy reads every round, confined once and kept open between rounds.

``CgroupExecutor.path`` resolves the directory and checks it stays under the root on
every call (~20 µs), five times the read itself; a file read each second for every
pod needs that once. Its descriptor then stays open and is re-read with ``pread`` at
offset 0 (``metrics.collect.openfiles``: cgroupfs regenerates the text on each read;
after ``rmdir`` the read fails, ENODEV, and the descriptor is dropped). A file is kept
while it is asked for every round and dropped when a read fails (gone, not created
yet): it is resolved and confined again when asked again.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Final

from hooks.cgroups import Resource
from hooks.executor import CgroupExecutor
from metrics.collect.base import ReadError
from metrics.collect.openfiles import OpenFiles, default_limit

#: Descriptors this cache may keep (the pods collector's ``OpenFiles`` has its own share).
MAX_OPEN: Final = 1024


class PathCache:
    def __init__(self, limit: int | None = None) -> None:
        self._paths: dict[tuple[str, str], str] = {}
        self._used: set[tuple[str, str]] = set()
        #: A read failed since the last ``end_round`` (its descriptor may need closing).
        self._dropped = False
        self._files = OpenFiles(min(MAX_OPEN, default_limit() // 4) if limit is None else limit)

    def __len__(self) -> int:
        return len(self._paths)

    def read(self, executor: CgroupExecutor, cgroup: str, resource: Resource) -> str:
        """The file's text; ``CgroupError`` (or ``OSError``) when it cannot be read."""
        key = (cgroup, resource.name)
        self._used.add(key)
        path = self._paths.get(key)
        if path is None:
            path = self._paths[key] = str(executor.path(PurePosixPath(cgroup), resource))
        try:
            return self._files.read(path).decode("utf-8", "replace").strip()
        except ReadError as exc:
            self._paths.pop(key, None)
            self._dropped = True
            raise OSError(str(exc)) from exc

    def end_round(self) -> None:
        """Forget (and close) what was not asked for since the last call (pods gone)."""
        if not self._dropped and self._used.issuperset(self._paths):
            # Every kept file was asked for and none dropped (most rounds): nothing to
            # close, so neither the paths nor the descriptors are rebuilt.
            self._used = set()
            return
        self._paths = {k: v for k, v in self._paths.items() if k in self._used}
        self._used = set()
        self._dropped = False
        self._files.retain(self._paths.values())

    def close(self) -> None:
        self._paths.clear()
        self._files.close()
