"""Confined cgroup file paths kept between rounds, for files a strategy reads every round.

``CgroupExecutor.path`` resolves the directory and checks it stays under the root on
every call (~20 µs), five times the read itself; a file read each second for every
pod needs that once. A path is kept while it is asked for every round and dropped
when a read fails (gone, not created yet, replaced): it is resolved and confined
again when asked again. The read itself refuses a symlink in the last component
(``O_NOFOLLOW``); cgroupfs refuses symlinks anywhere.
"""

from __future__ import annotations

import os
from pathlib import PurePosixPath

from hooks.cgroups import Resource
from hooks.executor import CgroupExecutor

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class PathCache:
    def __init__(self) -> None:
        self._paths: dict[tuple[str, str], str] = {}
        self._used: set[tuple[str, str]] = set()

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
            fd = os.open(path, _FLAGS)
            try:
                return os.read(fd, 4096).decode("utf-8", "replace").strip()
            finally:
                os.close(fd)
        except OSError:
            self._paths.pop(key, None)
            raise

    def end_round(self) -> None:
        """Forget what was not asked for since the last call (pods gone, policy off)."""
        self._paths = {k: v for k, v in self._paths.items() if k in self._used}
        self._used = set()

