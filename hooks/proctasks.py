"""A container's processes, and per-process files under the injected /proc root.

Shared by the hooks that act on a container's tasks rather than on its cgroup
(``oom-score-adj``, ``core-sched``). koordlet reads the processes of a container
from its cgroup (``ReadCPUProcs``: ``cgroup.procs`` in the cpu controller on v1,
in the unified directory on v2); so does ``container_procs``, confined under the
cgroup root like every other cgroup path.

``ProcFile`` reads and writes ``<proc root>/<pid>/<name>``: the pid is an integer
(no path comes from input), the file is opened with ``O_NOFOLLOW`` and without
``O_CREAT`` (a fixture tree or a vanished process never turns into a new file),
and nothing is written once the hook call is past its deadline.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path, PurePosixPath

from hooks.cgroups import CgroupError, CgroupLayout, PathEscapeError, container_cgroup_dir
from hooks.executor import confine
from runtimeproxy.hookapi import HookError, PodInfo
from runtimeproxy.hostwrites import check_deadline


class ProcessGoneError(HookError):
    """The process exited between listing and acting on it (ESRCH / ENOENT)."""


def parse_ids(text: str) -> list[int]:
    """The positive ids of a ``cgroup.procs`` / ``tasks`` / ``cgroup.threads`` file, sorted."""
    return sorted({int(t) for t in text.split() if t.isdigit() and int(t) > 0})


def read_nofollow(path: Path) -> str:
    """The whole file, never through a symlink at its last component (``OSError`` as is)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    chunks: list[bytes] = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("ascii", "replace")


def container_procs(layout: CgroupLayout, pod: PodInfo, container_id: str) -> list[int] | None:
    """The container's process ids (sorted); ``None`` when its cgroup does not exist.

    Raises ``PathEscapeError`` for a cgroup parent or id that would leave the root and
    ``CgroupError`` when the directory exists but has no ``cgroup.procs``."""
    relative = container_cgroup_dir(pod.cgroup_parent, container_id, layout.driver)
    if layout.version == 1:
        relative = PurePosixPath("cpu", relative)
    source = f"pod {pod.meta.namespace}/{pod.meta.name}: container {container_id!r}"
    directory = confine(layout.root, relative, source)
    if not directory.is_dir():
        return None
    path = directory / "cgroup.procs"
    if path.is_symlink():
        raise PathEscapeError(f"{source}: {path} is a symlink; refusing to follow it")
    try:
        text = read_nofollow(path)
    except FileNotFoundError:
        if not directory.is_dir():
            return None  # removed while we looked
        raise CgroupError(f"{source}: {directory} has no cgroup.procs") from None
    except OSError as exc:
        raise CgroupError(f"{source}: cannot read {path}: {exc.strerror}") from exc
    return parse_ids(text)


class ProcFile:
    """One per-process file (``oom_score_adj``) under a proc root."""

    def __init__(self, root: Path, name: str) -> None:
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"not a /proc/<pid> file name: {name!r}")
        self.root = root
        self.name = name

    def path(self, pid: int) -> Path:
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise HookError(f"invalid pid {pid!r}")
        return self.root / str(pid) / self.name

    def read(self, pid: int) -> str:
        path = self.path(pid)
        try:
            return read_nofollow(path).strip()
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ESRCH):
                raise ProcessGoneError(f"process {pid} is gone ({path})") from exc
            raise HookError(f"cannot read {path}: {exc.strerror}") from exc

    def write(self, pid: int, text: str) -> None:
        path = self.path(pid)
        check_deadline(str(path), text)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ESRCH):
                raise ProcessGoneError(f"process {pid} is gone ({path})") from exc
            raise HookError(f"cannot open {path}: {exc.strerror}") from exc
        try:
            os.write(fd, text.encode())
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                raise ProcessGoneError(f"process {pid} is gone ({path})") from exc
            raise HookError(f"writing {text!r} to {path} refused: {exc.strerror}") from exc
        finally:
            os.close(fd)
