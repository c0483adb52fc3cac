"""Pod and container CPU, memory and throttling from cgroupfs, v1, v2 or hybrid.

Where a file lives depends on the host, and that knowledge is kept in ``CgroupReader``:
v1 has one mount per controller (``<root>/cpuacct/<dir>/cpuacct.usage``, possibly
co-mounted as ``cpu,cpuacct``), v2 one tree (``<root>/<dir>/cpu.stat``), and hybrid
hosts a v1 layout plus a controller-less v2 tree at ``<root>/unified`` that still has
``cpu.stat`` (usage only) and the ``*.pressure`` files.

CPU usage is a counter divided by a monotonic clock read around the counter read, so
a late tick stretches both numerator and denominator instead of inflating the rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from hooks.cgroups import Version, detect_version
from metrics.collect.base import (
    OnceLog,
    ReadError,
    container_labels,
    parse_flat_keyed,
    parse_int,
    pod_labels,
    read_file,
    relative,
)
from metrics.model import (
    CONTAINER_CPU_THROTTLED,
    CONTAINER_CPU_USAGE,
    CONTAINER_MEMORY_CACHE,
    CONTAINER_MEMORY_USED,
    POD_CPU_THROTTLED,
    POD_CPU_USAGE,
    POD_MEMORY_CACHE,
    POD_MEMORY_USED,
    Labels,
    PodView,
    Sample,
)
from runtimeproxy.hookapi import HostRoots

log = structlog.get_logger("metrics.cgroupfs")

Clock = Callable[[], float]
_V1_CONTROLLERS: Final = ("cpu", "cpuacct", "cpuset", "memory", "perf_event")


def _v2_usage_ns(path: Path) -> int:
    stat = path / "cpu.stat"
    text = read_file(stat)
    for line in text.splitlines():
        if line.startswith("usage_usec "):
            return parse_int(line[11:].strip(), stat, "usage_usec") * 1000
    raise ReadError(stat, "no usage_usec line")


def read_cpu_usage_ns(path: Path, version: Version | None = None) -> int:
    """Cumulative CPU time (ns) of the cgroup DIRECTORY ``path``: v1 reads
    ``cpuacct.usage`` (so pass a cpuacct-hierarchy dir, ``CgroupReader.cpuacct_dir``),
    v2 ``cpu.stat`` ``usage_usec`` * 1000. With ``version`` None, v1 is tried first and
    v2 when there is no ``cpuacct.usage`` (the unified dir of a hybrid host works too).
    One open for a known version. Raises ``ReadError``."""
    if version == 2:
        return _v2_usage_ns(path)
    usage = path / "cpuacct.usage"
    try:
        text = read_file(usage)
    except ReadError as exc:
        if version is None and exc.gone and path.is_dir():
            return _v2_usage_ns(path)
        raise
    return parse_int(text.strip(), usage, "cpuacct.usage")


class CgroupReader:
    """Paths of a pod's or container's cgroup in each hierarchy of a host cgroup root.

    ``rel`` is a cgroup dir relative to a hierarchy root (``PodView.cgroup_dir``); a
    leading "/" is ignored."""

    def __init__(self, host_cgroup_root: Path) -> None:
        self.root = host_cgroup_root
        self.version: Version = detect_version(host_cgroup_root)
        self._mounts = self._find_mounts() if self.version == 1 else {}
        unified = host_cgroup_root / "unified"
        if self.version == 2:
            self._unified: Path | None = host_cgroup_root
        else:
            self._unified = unified if (unified / "cgroup.procs").is_file() else None

    def __repr__(self) -> str:
        return f"CgroupReader({str(self.root)!r}, version={self.version}, unified={self._unified})"

    def _find_mounts(self) -> dict[str, Path]:
        """v1 controller -> its mount; co-mounts (``cpu,cpuacct``) serve each of their controllers."""
        mounts: dict[str, Path] = {}
        try:
            entries = sorted(self.root.iterdir())
        except OSError:
            return mounts
        for entry in entries:
            for controller in entry.name.split(","):
                if controller in _V1_CONTROLLERS and entry.is_dir():
                    mounts.setdefault(controller, entry)
        return mounts

    def _v1(self, controller: str, rel: str) -> Path:
        return self._mounts.get(controller, self.root / controller) / relative(rel)

    def _dir(self, controller: str, rel: str) -> Path:
        return self.root / relative(rel) if self.version == 2 else self._v1(controller, rel)

    def cpu_dir(self, rel: str) -> Path:
        """cpu controller: cpu.stat with nr_periods / nr_throttled, quota, shares."""
        return self._dir("cpu", rel)

    def cpuacct_dir(self, rel: str) -> Path:
        """Where ``read_cpu_usage_ns`` finds the usage counter (same as cpu_dir on v2)."""
        return self._dir("cpuacct", rel)

    def memory_dir(self, rel: str) -> Path:
        return self._dir("memory", rel)

    def cpuset_dir(self, rel: str) -> Path:
        return self._dir("cpuset", rel)

    def unified_dir(self, rel: str) -> Path | None:
        """The cgroup in the v2 tree (the root on v2, ``unified/`` on hybrid), None on pure v1."""
        return None if self._unified is None else self._unified / relative(rel)

    def pressure_dir(self, rel: str) -> Path | None:
        """Where ``{cpu,memory,io}.pressure`` live: only v2 trees have PSI files."""
        return self.unified_dir(rel)

    def perf_event_dir(self, rel: str) -> Path | None:
        """The perf_event cgroup: the v1 mount when there is one, else the v2 tree."""
        if self.version == 1 and "perf_event" in self._mounts:
            return self._mounts["perf_event"] / relative(rel)
        return self.unified_dir(rel)

    def cpu_usage_ns(self, rel: str) -> int:
        return read_cpu_usage_ns(self.cpuacct_dir(rel), self.version)


@dataclass(frozen=True, slots=True)
class MemoryUsage:
    used: int  # anon + unevictable, bytes
    cache: int  # page cache, bytes


def read_memory(path: Path, version: Version) -> MemoryUsage:
    """From ``memory.stat`` of the cgroup dir ``path``. v1 prefers the hierarchical
    ``total_*`` counters (they include child cgroups, which a pod dir needs)."""
    stat_path = path / "memory.stat"
    stat = parse_flat_keyed(read_file(stat_path), stat_path)

    def pick(*names: str) -> int:
        for name in names:
            if name in stat:
                return stat[name]
        raise ReadError(stat_path, f"none of {', '.join(names)}")

    if version == 2:
        return MemoryUsage(pick("anon") + pick("unevictable"), pick("file"))
    if all(k in stat for k in ("total_inactive_anon", "total_active_anon", "total_unevictable")):
        used = stat["total_inactive_anon"] + stat["total_active_anon"] + stat["total_unevictable"]
    else:
        used = pick("inactive_anon") + pick("active_anon") + pick("unevictable")
    return MemoryUsage(used, pick("total_cache", "cache"))


def read_throttling(path: Path) -> tuple[int, int]:
    """(nr_periods, nr_throttled) from ``cpu.stat`` of the cgroup dir ``path``."""
    stat_path = path / "cpu.stat"
    stat = parse_flat_keyed(read_file(stat_path), stat_path)
    if "nr_periods" not in stat or "nr_throttled" not in stat:
        raise ReadError(stat_path, "no nr_periods / nr_throttled (cpu controller not enabled?)")
    return stat["nr_periods"], stat["nr_throttled"]


@dataclass(frozen=True, slots=True)
class _Names:
    cpu: str
    memory: str
    cache: str
    throttled: str


_POD: Final = _Names(POD_CPU_USAGE, POD_MEMORY_USED, POD_MEMORY_CACHE, POD_CPU_THROTTLED)
_CONTAINER: Final = _Names(CONTAINER_CPU_USAGE, CONTAINER_MEMORY_USED, CONTAINER_MEMORY_CACHE,
                           CONTAINER_CPU_THROTTLED)


@dataclass(frozen=True, slots=True)
class PodUsage:
    """The latest pod-level figures by pod uid, for the BE / system aggregates.
    ``*_complete`` is false when some pod of the tick has no value (first tick, vanished
    cgroup): a sum over such a tick would be too small."""

    cpu: Mapping[str, float]
    memory: Mapping[str, float]
    cpu_complete: bool = False
    memory_complete: bool = False


@dataclass(frozen=True, slots=True)
class _Target:
    key: tuple[str, str]  # (pod uid, container id or "")
    owner: str
    rel: str
    labels: Labels
    names: _Names


class PodCollector:
    """Per pod and container: CPU cores, memory used / cache, CFS throttling ratio."""

    name = "pods"

    def __init__(self, host: HostRoots, *, interval: float = 1.0, clock: Clock = time.monotonic) -> None:
        self.interval = interval
        self.reader = CgroupReader(host.cgroup)
        self._clock = clock
        self._cpu: dict[tuple[str, str], tuple[int, float]] = {}
        self._throttle: dict[tuple[str, str], tuple[int, int]] = {}
        self._once = OnceLog(log)
        self._latest = PodUsage({}, {})

    def latest(self) -> PodUsage:
        return self._latest

    def close(self) -> None:
        self._cpu.clear()
        self._throttle.clear()

    def collect(self, now: float, pods: Sequence[PodView]) -> list[Sample]:
        targets = list(_targets(pods))
        live = {t.key for t in targets}
        # State of vanished pods / containers is dropped, so a reused key starts fresh.
        self._cpu = {k: v for k, v in self._cpu.items() if k in live}
        self._throttle = {k: v for k, v in self._throttle.items() if k in live}
        self._once.keep_owners(p.uid for p in pods)
        out: list[Sample] = []
        pod_cpu: dict[str, float] = {}
        pod_mem: dict[str, float] = {}
        for target in targets:
            cpu = self._cpu_usage(target)
            if cpu is not None:
                out.append(Sample(target.names.cpu, cpu, target.labels))
            mem = self._memory(target)
            if mem is not None:
                out.append(Sample(target.names.memory, float(mem.used), target.labels))
                out.append(Sample(target.names.cache, float(mem.cache), target.labels))
            ratio = self._throttled(target)
            if ratio is not None:
                out.append(Sample(target.names.throttled, ratio, target.labels))
            if target.names is _POD:
                if cpu is not None:
                    pod_cpu[target.owner] = cpu
                if mem is not None:
                    pod_mem[target.owner] = float(mem.used)
        uids = {p.uid for p in pods}
        self._latest = PodUsage(pod_cpu, pod_mem, set(pod_cpu) == uids, set(pod_mem) == uids)
        return out

    def _cpu_usage(self, target: _Target) -> float | None:
        before = self._clock()
        try:
            usage = self.reader.cpu_usage_ns(target.rel)
        except ReadError as exc:
            self._once.skipped(target.owner, exc)
            return None
        at = (before + self._clock()) / 2
        prev = self._cpu.get(target.key)
        self._cpu[target.key] = (usage, at)
        if prev is None:
            return None
        d_ns, d_t = usage - prev[0], at - prev[1]
        if d_ns < 0:
            log.debug("cpu_counter_reset", cgroup=target.rel)
            return None
        if d_t <= 0:
            return None
        return d_ns / (d_t * 1e9)

    def _memory(self, target: _Target) -> MemoryUsage | None:
        try:
            return read_memory(self.reader.memory_dir(target.rel), self.reader.version)
        except ReadError as exc:
            self._once.skipped(target.owner, exc)
            return None

    def _throttled(self, target: _Target) -> float | None:
        try:
            periods, throttled = read_throttling(self.reader.cpu_dir(target.rel))
        except ReadError as exc:
            self._once.skipped(target.owner, exc)
            return None
        prev = self._throttle.get(target.key)
        self._throttle[target.key] = (periods, throttled)
        if prev is None:
            return None
        d_periods, d_throttled = periods - prev[0], throttled - prev[1]
        if d_periods <= 0 or d_throttled < 0:
            return None  # no CFS period elapsed (no quota, idle) or a counter reset
        return min(d_throttled / d_periods, 1.0)


def _targets(pods: Sequence[PodView]) -> list[_Target]:
    out: list[_Target] = []
    for pod in pods:
        out.append(_Target((pod.uid, ""), pod.uid, pod.cgroup_dir, pod_labels(pod), _POD))
        for c in pod.containers:
            out.append(_Target((pod.uid, c.id), pod.uid, c.cgroup_dir, container_labels(pod, c), _CONTAINER))
    return out
