"""What every collector shares: the protocol, the error types, and "log once".

Collectors run every second against files that come and go (a container exits
between the pod snapshot and the read) or that a kernel formats differently. A
problem with one file must cost one sample and one log line, not a log line per
tick and never a made-up number, so reads raise ``ReadError`` and collectors
report each (path, reason) once through ``OnceLog``.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol, TypeVar

import structlog

from metrics.model import CONTAINER_ID, POD_UID, ContainerView, Labels, PodView, Sample, labels
from runtimeproxy.errors import HostError


class Collector(Protocol):
    """A metric source. ``collect`` blocks (the agent runs it in a worker thread, never
    two calls of one collector at once) and keeps previous counters for deltas."""

    name: str
    interval: float  # seconds

    def collect(self, now: float, pods: Sequence[PodView]) -> list[Sample]: ...

    def close(self) -> None: ...


class ReadError(HostError):
    """A host file could not be read or parsed. ``gone`` is true when the file or its
    directory does not exist (a vanished cgroup or process), which is routine."""

    def __init__(self, path: Path, reason: str, *, gone: bool = False) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason
        self.gone = gone


class SourceUnavailable(HostError):
    """A measuring mechanism (eBPF, perf counters) cannot work on this host; says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def os_error(path: Path, exc: OSError) -> ReadError:
    """The ReadError for an OSError: ``gone`` when the file, its directory or its
    process no longer exists (ENOENT, ENODEV, ESRCH, ENOTDIR)."""
    gone = exc.errno in (errno.ENOENT, errno.ENODEV, errno.ESRCH, errno.ENOTDIR)
    return ReadError(path, exc.strerror or str(exc), gone=gone)


def read_file(path: Path) -> str:
    """One file's text; ``ReadError`` instead of OSError."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError as exc:
        raise os_error(path, exc) from exc


_O_READ: Final = os.O_RDONLY | os.O_CLOEXEC
_CHUNK: Final = 8192


def read_bytes(path: str) -> bytes:
    """One (small) file's bytes with a single open/read/close, no Path or text layer:
    the per-tick hot path of the cgroup collectors. ``ReadError`` instead of OSError
    (a directory where a file is expected fails at the read, EISDIR)."""
    try:
        fd = os.open(path, _O_READ)
    except OSError as exc:
        raise os_error(Path(path), exc) from exc
    try:
        data = os.read(fd, _CHUNK)
        if len(data) == _CHUNK:  # larger than expected: read the rest
            chunks = [data]
            while chunk := os.read(fd, _CHUNK):
                chunks.append(chunk)
            data = b"".join(chunks)
        return data
    except OSError as exc:
        raise os_error(Path(path), exc) from exc
    finally:
        os.close(fd)


def bytes_field(data: bytes, key: bytes, path: str, *, first: bool = False) -> int | None:
    """The integer value of the ``key value`` line of ``data`` (memory.stat, cpu.stat)
    without parsing the other lines; ``key`` includes the separator (``b"anon "``,
    ``b"hierarchical_anon="``). The search is anchored at a line start (a preceding
    newline, or the first line), so ``b"cache "`` never matches ``total_cache``.
    ``first``: the value is the line's first token (memory.numa_stat's
    ``key=<total> N0=<n> ...``). None when there is no such line; ``ReadError`` for a
    non-integer."""
    if data.startswith(key):
        start = len(key)
    else:
        i = data.find(b"\n" + key)
        if i < 0:
            return None
        start = i + 1 + len(key)
    end = data.find(b"\n", start)
    raw = data[start:] if end < 0 else data[start:end]
    if first:
        raw = raw.partition(b" ")[0]
    try:
        return int(raw)
    except ValueError:
        name = key.decode("ascii").strip(" =")
        text = raw.decode("ascii", "replace").strip()
        raise ReadError(Path(path), f"{name}: {text[:40]!r} is not an integer") from None


def parse_int(text: str, path: Path, what: str) -> int:
    """A decimal integer token, or a ``ReadError`` naming the file and the field."""
    try:
        return int(text)
    except ValueError:
        raise ReadError(path, f"{what}: {text[:40]!r} is not an integer") from None


def parse_flat_keyed(text: str, path: Path) -> dict[str, int]:
    """``key value`` lines (memory.stat, cpu.stat) -> dict; a non-integer value is an error."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise ReadError(path, f"malformed line {line[:60]!r} (expected 'key value')")
        out[parts[0]] = parse_int(parts[1], path, parts[0])
    return out


def pod_labels(pod: PodView) -> Labels:
    return labels(**{POD_UID: pod.uid})


def container_labels(pod: PodView, container: ContainerView) -> Labels:
    return labels(**{POD_UID: pod.uid, CONTAINER_ID: container.id})


def relative(cgroup_dir: str) -> str:
    """A cgroup dir joined onto a root must never be absolute (``/kubepods`` would
    replace the root instead of extending it)."""
    return cgroup_dir.lstrip("/")


@dataclass(frozen=True, slots=True)
class LatencyStat:
    """Run-queue waits of one container over one interval."""

    mean: float  # seconds per scheduling event
    events: int
    p99: float | None = None  # seconds; only sources with a histogram have it


class OnceLog:
    """Logs each (owner, path, reason) once. ``owner`` (a pod uid, "node") lets the
    collector forget the entries of pods that are gone, so the set stays bounded and a
    pod that comes back is reported again."""

    def __init__(self, logger: structlog.typing.FilteringBoundLogger) -> None:
        self._log = logger
        self._seen: set[tuple[str, str, str]] = set()

    def skipped(self, owner: str, exc: ReadError, event: str = "sample_skipped") -> None:
        key = (owner, str(exc.path), exc.reason)
        if key in self._seen:
            return
        self._seen.add(key)
        if exc.gone:
            self._log.info(event, path=str(exc.path), reason=exc.reason, owner=owner)
        else:
            self._log.warning(event, path=str(exc.path), reason=exc.reason, owner=owner)

    def keep_owners(self, owners: Iterable[str]) -> None:
        live = set(owners)
        self._seen = {k for k in self._seen if k[0] in live}


class Startable(Protocol):
    name: str

    def start(self) -> None:
        """Raises ``SourceUnavailable`` when the source cannot work on this host."""


S = TypeVar("S", bound=Startable)


def pick_source(candidates: Iterable[S], prefer: str, logger: structlog.typing.FilteringBoundLogger,
                event: str) -> tuple[S | None, str]:
    """Start the first candidate that starts; it (None when none does) and why, logged
    once as ``event``: the reasons the earlier ones gave, or ``prefer=`` when the first
    started (a warning naming every reason when none did)."""
    reasons: list[str] = []
    for candidate in candidates:
        try:
            candidate.start()
        except SourceUnavailable as exc:
            reasons.append(f"{candidate.name}: {exc.reason}")
            continue
        reason = "; ".join(reasons) or f"prefer={prefer}"
        logger.info(event, source=candidate.name, reason=reason)
        return candidate, reason
    reason = "; ".join(reasons)
    logger.warning(event, source="none", reason=reason)
    return None, reason


class ReasonOnce:
    """Logs a sampling failure once per reason, not once per tick."""

    def __init__(self, logger: structlog.typing.FilteringBoundLogger, event: str) -> None:
        self._log = logger
        self._event = event
        self._seen: set[str] = set()

    def failed(self, source: str, exc: SourceUnavailable) -> None:
        if exc.reason not in self._seen:
            self._seen.add(exc.reason)
            self._log.warning(self._event, source=source, reason=exc.reason)
