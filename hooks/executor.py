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
* **Deadline** — inside a hook call, nothing is written once the call is past
  its deadline (``runtimeproxy.hostwrites.check_deadline``, right before each write).
* **Back-off** — a write the kernel refuses is retried with the same value only
  after an exponential back-off (1 s doubling to 5 min; another value after
  1 s, so a changed desired state is not held up; a parent in a leveled write
  whose children that write has just narrowed at once), and logged once per
  (path, cause): ``host_write_failed`` at warning, then ``repeat=True`` errors
  and at most one ``host_write_still_failing`` reminder per 5 min with
  ``repeats=N``; success logs ``host_write_recovered`` and clears the state.
  The back-off is the process's ``NodeServices.write_backoff``
  (``runtimeproxy.services``), handed to every executor through the hook's or
  task's init object (hooks, the reconciler, the QoS manager and its fast path).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import structlog

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
from runtimeproxy.hostwrites import check_deadline
from runtimeproxy.services import FailureCounter, WriteBackoff

log = structlog.get_logger("hooks.executor")


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
    #: The file's text as the plan read it (its presence check); None: read it again before writing.
    current: str | None = None


#: Directories confined within one batch, by (controller, cgroup).
_Confined = dict[tuple[str | None, PurePosixPath], Path]

def confine(root: Path, relative: PurePosixPath, source: str, real_root: str | None = None) -> Path:
    """``root/relative`` resolved, or PathEscapeError naming ``source`` when it
    leaves the resolved root (``..``, an absolute part, a symlink). The target is
    resolved every time (a cgroup may be replaced by a symlink at any moment); the
    root too unless the caller passes it resolved (``Confinement`` keeps it)."""
    if relative.is_absolute() or ".." in relative.parts:
        raise PathEscapeError(f"{source or relative}: path {str(relative)!r} escapes the cgroup root {root}")
    if real_root is None:
        real_root = os.path.realpath(root)
    target = _resolve(os.path.join(root, relative))
    if target != real_root and not target.startswith(real_root.rstrip("/") + "/"):
        raise PathEscapeError(f"{source or relative}: resolves to {target}, outside the root {real_root}")
    return Path(target)


class Confinement:
    """``confine`` under one configured root (``/sys/fs/cgroup``...), resolved once by
    its owner (an executor, a resctrl view): the root is fixed for the owner's life, and
    resolving it again per file was ~15 µs of the ~55 µs a cgroup file's check took."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._real: str | None = None

    def __call__(self, relative: PurePosixPath, source: str) -> Path:
        if self._real is None:
            self._real = os.path.realpath(self.root)
        return confine(self.root, relative, source, self._real)


def _resolve(joined: str) -> str:
    """``joined`` with every symlink followed, as the kernel resolves it now: an
    ``O_PATH`` open and its ``/proc/self/fd`` link, three syscalls. ``os.path.realpath``
    lstats each component in Python (~10 for a pod cgroup): it was ~40 % of a
    PreRunPodSandbox's hook time. It remains the fallback (a missing path, no /proc)."""
    try:
        fd = os.open(joined, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return os.path.realpath(joined)
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(joined)
    finally:
        os.close(fd)


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


def _cause(exc: BaseException) -> str:
    """The errno name of the OSError behind a failed write (``EINVAL``), else the error type."""
    origin = exc.__cause__ if isinstance(exc.__cause__, OSError) else exc
    if isinstance(origin, OSError) and origin.errno is not None:
        return errno.errorcode.get(origin.errno, str(origin.errno))
    return type(exc).__name__


class WriteBackedOffError(CgroupError):
    """A write was not attempted: writes to that file keep failing and its back-off runs."""

    repeat = True


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

    def __init__(self, layout: CgroupLayout, *, backoff: WriteBackoff | None = None) -> None:
        """``backoff``: the process's (``NodeServices.write_backoff``), shared by every
        executor built from the same services; None: one of this executor's own."""
        self.layout = layout
        self.backoff = WriteBackoff(counter=FailureCounter()) if backoff is None else backoff
        self.confine = Confinement(layout.root)

    def path(self, cgroup: PurePosixPath, resource: Resource, source: str = "") -> Path:
        """The confined file path of ``resource`` in ``cgroup``."""
        return self._path(cgroup, resource, source, {})

    def _path(self, cgroup: PurePosixPath, resource: Resource, source: str,
              confined: _Confined) -> Path:
        """``path``; ``confined`` keeps the directories resolved within one batch (a pod's
        cpu.shares, cfs_quota and memory limit are 2 directories, not 3 resolutions)."""
        controller, name = resource.file(self.layout.version)
        directory = confined.get((controller, cgroup))
        if directory is None:
            relative = PurePosixPath(controller, cgroup) if controller else cgroup
            directory = confined[(controller, cgroup)] = self.confine(relative, source or str(cgroup))
        target = directory / name
        try:
            link = stat.S_ISLNK(os.lstat(target).st_mode)
        except OSError:
            link = False  # missing: reading or writing it reports that, with O_NOFOLLOW
        if link:
            raise PathEscapeError(f"{source or cgroup}: {target} is a symlink; refusing to follow it")
        return target

    def read(self, cgroup: PurePosixPath, resource: Resource, source: str = "") -> str:
        path = self.path(cgroup, resource, source)
        try:
            return _read(path)
        except OSError as exc:
            raise _os_error(exc, path, source or str(cgroup)) from exc

    def _plan(self, update: Update, confined: _Confined) -> _Planned:
        source = update.source or str(update.cgroup)
        try:
            value = update.resource.check(update.value)
        except CgroupError as exc:
            raise CgroupError(f"{source}: {exc}") from exc
        path = self._path(update.cgroup, update.resource, source, confined)
        try:
            current = _read(path)  # the cgroup and the file must exist before anything is written
        except OSError as exc:
            raise _os_error(exc, path, source) from exc
        return _Planned(update, path, value, current)

    def _apply_one(self, planned: _Planned, *, children_narrowed: bool = False, reuse: bool = False) -> Write:
        """Write ``planned`` unless the file already holds its value. ``reuse``: the text
        the plan read is still the file's (nothing of this batch wrote it since)."""
        update, path = planned.update, planned.path
        source = update.source or str(update.cgroup)
        version = self.layout.version
        try:
            old = planned.current if reuse and planned.current is not None else _read(path)
        except OSError as exc:
            raise _os_error(exc, path, source) from exc
        new = update.resource.render(planned.value, version, old)
        try:
            unchanged = update.resource.parse(old, version) == comparable(update.resource, planned.value, version)
        except (ValueError, IndexError):
            unchanged = False
        if unchanged:
            self.backoff.succeeded(path)
            return Write(path, old, new, update.reason, changed=False)
        check_deadline(str(path), new)
        if not children_narrowed:  # else the cause of the last refusal may just have gone
            wait = self.backoff.before(path, new)
            if wait is not None:
                raise WriteBackedOffError(f"{source}: {wait}")
        try:
            _write(path, new, source)
        except CgroupError as exc:
            if self.backoff.failed(path, new, _cause(exc), str(exc)):
                exc.repeat = True  # logged once already: whoever catches it logs below warning
            raise
        self.backoff.succeeded(path)
        return Write(path, old, new, update.reason)

    def apply(self, updates: Sequence[Update]) -> list[Write]:
        """Validate every update (value, confined path, file present), then write in order."""
        confined: _Confined = {}
        planned = [self._plan(u, confined) for u in updates]
        written: set[Path] = set()
        writes = []
        for item in planned:
            writes.append(self._apply_one(item, reuse=item.path not in written))
            written.add(item.path)
        return writes

    def leveled_update(self, levels: Sequence[Sequence[Update]]) -> list[Write]:
        """``levels`` from the top (e.g. kubepods/besteffort) down to containers.

        Pass 1, top-down: where a value must grow (cpuset gains CPUs, quota or
        memory limit rises) write the merged value (union or max of current and new) first.
        Pass 2, bottom-up: write the real values. Parents stay ≥ children at every
        step, so the kernel never refuses a write for that reason. A parent whose
        children this pass has just changed is written even while its back-off runs:
        a refusal recorded before (a child above it, e.g. created between a scan and
        the write) may be gone now, and holding the same value for up to minutes would
        keep e.g. a BE tier unsuppressed. Unchanged children: the back-off applies."""
        confined: _Confined = {}
        planned = [[self._plan(u, confined) for u in level] for level in levels]
        writes: list[Write] = []
        for level in planned:
            for item in level:
                merged = self._merged(item)
                if merged is not None:
                    writes.append(self._apply_one(merged))
        narrowed = False
        for level in reversed(planned):
            done = [self._apply_one(item, children_narrowed=narrowed) for item in level]
            narrowed = narrowed or any(w.changed for w in done)
            writes.extend(done)
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


#: Memory QoS files (hooks.memoryqoscalc): koordlet's leveled update raises them top-down too.
_GROW_FIRST = frozenset({"memory.min", "memory.low", "memory.high"})


def _merge(resource: Resource, current: Value, new: Value) -> Value | None:
    """The value a parent must hold *before* its children get ``new``; None = no widening."""
    if resource in (CPUSET_CPUS, CPUSET_MEMS):
        have, want = parse_cpu_list(str(current)), parse_cpu_list(str(new))
        return None if want <= have else format_cpu_list(have | want)
    if resource in (CPU_CFS_QUOTA, MEMORY_LIMIT) or resource.name in _GROW_FIRST:
        cur, val = int(current), int(new)
        if cur == -1 or (val != -1 and val <= cur):
            return None
        return val
    return None
