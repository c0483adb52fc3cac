"""The executor: the one way hooks write to cgroup files.

Everything that goes wrong with host writes is handled once, here:

* **Confinement** — a target is built from untrusted input (cgroup_parent,
  container id, annotations). It is resolved (following symlinks) and must stay
  under the resolved root; the file is opened with ``O_NOFOLLOW`` and without
  ``O_CREAT``, so a symlink or a missing kernel file never turns into a write
  elsewhere or a new regular file.
* **Validate, then write** — ``apply`` checks every value and path of a batch
  before touching any file, so bad input leaves the host untouched.
* **Idempotence** — the current value is read and compared as a logical value
  (weight vs shares, "max" vs -1, page rounding); unchanged values are not
  rewritten. Every update yields a ``Write(target_path, old, new, reason)``.
* **Errors that say what happened** — missing directory → ``CgroupGoneError``,
  missing file in an existing directory → ``NotSupportedError``, a refused value
  → ``CgroupError`` with the kernel's reason.
* **Order** — ``leveled_update`` widens parents top-down before narrowing
  children bottom-up, as the kernel requires for cpusets (and as koordlet does
  for quota and memory limits).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from hooks.cgroups import (
    CPU_CFS_QUOTA,
    CPUSET_CPUS,
    CPUSET_MEMS,
    MEMORY_LIMIT,
    CgroupError,
    CgroupGoneError,
    CgroupLayout,
    NotSupportedError,
    PathEscapeError,
    Resource,
    Value,
    comparable,
)
from hooks.cpusets import format_cpu_list, parse_cpu_list


@dataclass(frozen=True, slots=True)
class Write:
    """One update as it happened (or was found already true: ``changed=False``)."""

    target_path: Path
    old: str | None
    new: str
    reason: str
    changed: bool = True


@dataclass(frozen=True, slots=True)
class Update:
    """A desired value: ``resource`` = ``value`` in cgroup ``cgroup`` (relative to the root)."""

    cgroup: PurePosixPath
    resource: Resource
    value: Value
    reason: str
    source: str = ""  # the untrusted input the path came from, for error messages


@dataclass(frozen=True, slots=True)
class _Planned:
    update: Update
    path: Path
    value: Value


def confine(root: Path, relative: PurePosixPath, source: str) -> Path:
    """``root/relative`` resolved, or PathEscapeError naming ``source`` when it
    leaves the resolved root (``..``, an absolute part, a symlink)."""
    if relative.is_absolute() or ".." in relative.parts:
        raise PathEscapeError(f"{source or relative}: path {str(relative)!r} escapes the cgroup root {root}")
    real_root = root.resolve()
    target = (root / relative).resolve()
    if not target.is_relative_to(real_root):
        raise PathEscapeError(f"{source or relative}: resolves to {target}, outside the root {real_root}")
    return target


def _read(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        return os.read(fd, 65536).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)


def _write(path: Path, text: str, source: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
    except OSError as exc:
        raise _os_error(exc, path, source) from exc
    try:
        os.write(fd, text.encode())
    except OSError as exc:
        raise CgroupError(f"{source}: writing {text!r} to {path} refused: {exc.strerror}") from exc
    finally:
        os.close(fd)


def _os_error(exc: OSError, path: Path, source: str) -> CgroupError:
    if exc.errno == errno.ENOENT:
        if not path.parent.is_dir():
            return CgroupGoneError(f"{source}: cgroup {path.parent} does not exist (gone or not created yet)")
        return NotSupportedError(f"{source}: {path.name} is not supported here ({path} does not exist)")
    if exc.errno == errno.ELOOP:
        return PathEscapeError(f"{source}: {path} is a symlink; refusing to follow it")
    return CgroupError(f"{source}: cannot access {path}: {exc.strerror}")


class CgroupExecutor:
    """Reads and writes cgroup resources under one ``CgroupLayout``."""

    def __init__(self, layout: CgroupLayout) -> None:
        self.layout = layout

    def path(self, cgroup: PurePosixPath, resource: Resource, source: str = "") -> Path:
        """The confined file path of ``resource`` in ``cgroup``."""
        controller, name = resource.file(self.layout.version)
        relative = PurePosixPath(controller, cgroup) if controller else cgroup
        directory = confine(self.layout.root, relative, source or str(cgroup))
        target = directory / name
        if target.is_symlink():
            raise PathEscapeError(f"{source or cgroup}: {target} is a symlink; refusing to follow it")
        return target

    def read(self, cgroup: PurePosixPath, resource: Resource, source: str = "") -> str:
        path = self.path(cgroup, resource, source)
        try:
            return _read(path)
        except OSError as exc:
            raise _os_error(exc, path, source or str(cgroup)) from exc

    def _plan(self, update: Update) -> _Planned:
        source = update.source or str(update.cgroup)
        try:
            value = update.resource.check(update.value)
        except CgroupError as exc:
            raise CgroupError(f"{source}: {exc}") from exc
        path = self.path(update.cgroup, update.resource, source)
        try:
            _read(path)  # the cgroup and the file must exist before anything is written
        except OSError as exc:
            raise _os_error(exc, path, source) from exc
        return _Planned(update, path, value)

    def _apply_one(self, planned: _Planned) -> Write:
        update, path = planned.update, planned.path
        source = update.source or str(update.cgroup)
        version = self.layout.version
        try:
            old = _read(path)
        except OSError as exc:
            raise _os_error(exc, path, source) from exc
        new = update.resource.render(planned.value, version, old)
        try:
            unchanged = update.resource.parse(old, version) == comparable(update.resource, planned.value, version)
        except (ValueError, IndexError):
            unchanged = False
        if unchanged:
            return Write(path, old, new, update.reason, changed=False)
        _write(path, new, source)
        return Write(path, old, new, update.reason)

    def apply(self, updates: Sequence[Update]) -> list[Write]:
        """Validate every update (value, confined path, file present), then write in order."""
        planned = [self._plan(u) for u in updates]
        return [self._apply_one(p) for p in planned]

    def leveled_update(self, levels: Sequence[Sequence[Update]]) -> list[Write]:
        """``levels`` from the top (e.g. kubepods/besteffort) down to containers.

        Pass 1, top-down: where a value must grow (cpuset gains CPUs, quota or
        memory limit rises) write the merged value (union or max of current and new) first.
        Pass 2, bottom-up: write the real values. Parents stay ≥ children at every
        step, so the kernel never refuses a write for that reason."""
        planned = [[self._plan(u) for u in level] for level in levels]
        writes: list[Write] = []
        for level in planned:
            for item in level:
                merged = self._merged(item)
                if merged is not None:
                    writes.append(self._apply_one(merged))
        for level in reversed(planned):
            writes.extend(self._apply_one(item) for item in level)
        return writes

    def _merged(self, item: _Planned) -> _Planned | None:
        resource, version = item.update.resource, self.layout.version
        try:
            current = resource.parse(_read(item.path), version)
            merged = _merge(resource, current, item.value)
        except OSError as exc:
            raise _os_error(exc, item.path, item.update.source or str(item.update.cgroup)) from exc
        except ValueError:
            return None
        if merged is None or merged == current:
            return None
        reason = f"{item.update.reason} (widened first for a leveled update)"
        return _Planned(Update(item.update.cgroup, resource, merged, reason, item.update.source), item.path, merged)


def _merge(resource: Resource, current: Value, new: Value) -> Value | None:
    """The value a parent must hold *before* its children get ``new``; None = no widening."""
    if resource in (CPUSET_CPUS, CPUSET_MEMS):
        have, want = parse_cpu_list(str(current)), parse_cpu_list(str(new))
        return None if want <= have else format_cpu_list(have | want)
    if resource in (CPU_CFS_QUOTA, MEMORY_LIMIT):
        cur, val = int(current), int(new)
        if cur == -1 or (val != -1 and val <= cur):
            return None
        return val
    return None
