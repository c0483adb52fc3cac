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

import functools
import operator
import os
import re
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
    bytes_field,
    container_labels,
    pod_labels,
    read_bytes,
    relative,
)
from metrics.collect.openfiles import OpenFiles
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
#: Seconds between reads of each target's CFS quota (v1). Without a quota the kernel
#: runs no CFS periods (nr_periods stays put), so there is no throttling ratio to
#: compute and the target's cpu.stat is not read: a new quota is seen within this.
QUOTA_RECHECK: Final = 10.0
PAGE_SIZE: Final = os.sysconf("SC_PAGE_SIZE")
_NUMA_KEYS: Final = (b"hierarchical_anon=", b"hierarchical_unevictable=", b"hierarchical_file=")
#: The kernel's memory.numa_stat: the three hierarchical LRU lines in a row, each total
#: followed by a space (its per-node counts).
_NUMA_RUN: Final = re.compile(rb"hierarchical_file=(\d+) [^\n]*\nhierarchical_anon=(\d+) [^\n]*\n"
                              rb"hierarchical_unevictable=(\d+) ")


def _usage_usec_ns(data: bytes, path: str) -> int:
    usec = bytes_field(data, b"usage_usec ", path)
    if usec is None:
        raise ReadError(Path(path), "no usage_usec line")
    return usec * 1000


def _cpuacct_ns(data: bytes, path: str) -> int:
    try:
        return int(data)
    except ValueError:
        text = data.decode("ascii", "replace").strip()
        raise ReadError(Path(path), f"cpuacct.usage: {text[:40]!r} is not an integer") from None


def parse_cpu_usage_ns(data: bytes, path: str, version: Version) -> int:
    """Cumulative CPU ns from the bytes of ``cpuacct.usage`` (v1) or ``cpu.stat`` (v2)."""
    return _usage_usec_ns(data, path) if version == 2 else _cpuacct_ns(data, path)


def read_cpu_usage_ns(path: Path, version: Version | None = None) -> int:
    """Cumulative CPU time (ns) of the cgroup DIRECTORY ``path``: v1 reads
    ``cpuacct.usage`` (so pass a cpuacct-hierarchy dir, ``CgroupReader.cpuacct_dir``),
    v2 ``cpu.stat`` ``usage_usec`` * 1000. With ``version`` None, v1 is tried first and
    v2 when there is no ``cpuacct.usage`` (the unified dir of a hybrid host works too).
    One open for a known version. Raises ``ReadError``."""
    base = str(path)
    if version == 2:
        stat = base + "/cpu.stat"
        return _usage_usec_ns(read_bytes(stat), stat)
    usage = base + "/cpuacct.usage"
    try:
        data = read_bytes(usage)
    except ReadError as exc:
        if version is None and exc.gone and path.is_dir():
            stat = base + "/cpu.stat"
            return _usage_usec_ns(read_bytes(stat), stat)
        raise
    return _cpuacct_ns(data, usage)


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
        self.numa_stat = self.version == 1 and _has_numa_totals(self._v1("memory", "") / "memory.numa_stat")

    def __repr__(self) -> str:
        return f"CgroupReader({str(self.root)!r}, version={self.version}, unified={self._unified})"

    def memory_file(self, rel: str) -> str:
        """The file pod memory is read from: v1 ``memory.numa_stat`` where the kernel has
        its hierarchical LRU totals (the same anon + unevictable as ``memory.stat`` at
        about 70 % of the kernel's cost, which matters at two reads per pod a second),
        else ``memory.stat``. Parse with ``parse_memory``."""
        return f"{self.memory_dir(rel)}/{self.memory_name}"

    @property
    def memory_name(self) -> str:
        return "memory.numa_stat" if self.numa_stat else "memory.stat"

    def parse_memory(self, data: bytes, path: str) -> tuple[int, int]:
        """(used, page cache) in bytes from the bytes of ``memory_file``."""
        return self.parse_memory_function()(data, path)

    def parse_memory_function(self) -> Callable[[bytes, str], tuple[int, int]]:
        """``parse_memory`` without the per-call choice of parser, for a per-tick loop."""
        if self.numa_stat:
            return _numa_memory
        return functools.partial(_memory_usage, version=self.version)

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

    def cpu_usage_file(self, rel: str) -> str:
        """The cumulative CPU counter's file: v1 ``cpuacct.usage``, v2 ``cpu.stat``
        (parse with ``parse_cpu_usage_ns``). For readers that keep it open."""
        return f"{self.cpuacct_dir(rel)}/{'cpu.stat' if self.version == 2 else 'cpuacct.usage'}"

    def cpu_stat_file(self, rel: str) -> str:
        """The cpu controller's ``cpu.stat`` (nr_periods, nr_throttled; on v2 also the
        usage). For readers that keep it open."""
        return f"{self.cpu_dir(rel)}/cpu.stat"


@dataclass(frozen=True, slots=True)
class MemoryUsage:
    used: int  # anon + unevictable, bytes
    cache: int  # page cache, bytes


def read_memory(path: Path, version: Version) -> MemoryUsage:
    """From ``memory.stat`` of the cgroup dir ``path``. v1 prefers the hierarchical
    ``total_*`` counters (they include child cgroups, which a pod dir needs)."""
    stat_path = str(path) + "/memory.stat"
    return MemoryUsage(*_memory_usage(read_bytes(stat_path), stat_path, version))


def _memory_usage(data: bytes, path: str, version: Version) -> tuple[int, int]:
    """(anon + unevictable, page cache) from memory.stat bytes; only those keys are parsed."""

    def pick(*keys: bytes) -> int:
        for key in keys:
            value = bytes_field(data, key, path)
            if value is not None:
                return value
        raise ReadError(Path(path), f"none of {', '.join(k.decode().strip() for k in keys)}")

    if version == 2:
        return pick(b"anon ") + pick(b"unevictable "), pick(b"file ")
    inactive = bytes_field(data, b"total_inactive_anon ", path)
    active = bytes_field(data, b"total_active_anon ", path)
    unevictable = bytes_field(data, b"total_unevictable ", path)
    if inactive is None or active is None or unevictable is None:
        used = pick(b"inactive_anon ") + pick(b"active_anon ") + pick(b"unevictable ")
    else:
        used = inactive + active + unevictable
    return used, pick(b"total_cache ", b"cache ")


def _has_numa_totals(path: Path) -> bool:
    try:
        data = path.read_bytes()
    except OSError:
        return False
    return all(data.startswith(k) or b"\n" + k in data for k in _NUMA_KEYS)


def _numa_field(data: bytes, key: bytes, path: str) -> int:
    """The total (pages) of a ``key=<total> N0=<n> ...`` line of memory.numa_stat."""
    value = bytes_field(data, key, path, first=True)
    if value is None:
        raise ReadError(Path(path), f"no {key.decode().rstrip('=')} line")
    return value


def _numa_memory(data: bytes, path: str) -> tuple[int, int]:
    """(anon + unevictable, file) bytes from v1 memory.numa_stat's hierarchical LRU totals.
    Used is what ``memory.stat``'s total_{in,}active_anon + total_unevictable give. The
    page cache is the file LRU: unlike ``total_cache`` it leaves out shmem / tmpfs, which
    sit on the anon LRU and so are already in used (``total_cache`` counted them twice)."""
    found = _numa_run(data)
    if found is not None:
        file, anon, unevictable = int(found[1]), int(found[2]), int(found[3])
    else:
        anon, unevictable, file = (_numa_field(data, key, path) for key in _NUMA_KEYS)
    return (anon + unevictable) * PAGE_SIZE, file * PAGE_SIZE


def _numa_run(data: bytes) -> re.Match[bytes] | None:
    """The kernel's three lines, matched in one C call where the first one starts (for
    every pod and container whose file changed); None when the text looks any different:
    then the by-key parse decides."""
    start = data.find(b"\nhierarchical_file=")
    return _NUMA_RUN.match(data, start + 1) if start >= 0 else None


def read_throttling(path: Path) -> tuple[int, int]:
    """(nr_periods, nr_throttled) from ``cpu.stat`` of the cgroup dir ``path``."""
    stat_path = str(path) + "/cpu.stat"
    return parse_throttling(read_bytes(stat_path), stat_path)


def parse_throttling(data: bytes, path: str) -> tuple[int, int]:
    periods = bytes_field(data, b"nr_periods ", path)
    throttled = bytes_field(data, b"nr_throttled ", path)
    if periods is None or throttled is None:
        raise ReadError(Path(path), "no nr_periods / nr_throttled (cpu controller not enabled?)")
    return periods, throttled


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
    usage_path: str  # cpuacct.usage (v1) or cpu.stat (v2)
    memory_path: str  # memory.stat, or memory.numa_stat (CgroupReader.memory_file)
    cpu_stat_path: str  # cpu.stat; the same file as usage_path on v2 (read once)
    quota_path: str  # cpu.cfs_quota_us (v1 only)


@dataclass(frozen=True, slots=True)
class _Plan:
    """The targets of one pod list (the very view objects it held), kept across ticks."""

    pods: tuple[PodView, ...]
    targets: list[_Target]
    uids: frozenset[str]


class PodCollector:
    """Per pod and container: CPU cores, memory used / cache, CFS throttling ratio.

    Each target's file paths and labels are built once (plain ``str``, cached by pod /
    container and cgroup dir) and its files stay open (``OpenFiles``: one pread per
    file and tick); only the needed keys of memory.stat / cpu.stat are parsed: this
    runs every second for every pod and container."""

    name = "pods"

    def __init__(self, host: HostRoots, *, interval: float = 1.0, clock: Clock = time.monotonic) -> None:
        self.interval = interval
        self.reader = CgroupReader(host.cgroup)
        self._clock = clock
        self._cpu: dict[tuple[str, str], tuple[int, float]] = {}
        self._throttle: dict[tuple[str, str], tuple[int, int]] = {}
        #: Each target's last memory file and its (used, cache) bytes: an idle cgroup's
        #: file reads the same from tick to tick, and comparing it costs a tenth of parsing it.
        self._memory: dict[tuple[str, str], tuple[bytes, float, float]] = {}
        self._once = OnceLog(log)
        self._latest = PodUsage({}, {})
        self._targets: dict[tuple[str, str, str], _Target] = {}
        self._last_plan: _Plan | None = None
        self._files = OpenFiles()
        self._v2 = self.reader.version == 2
        self._parse_memory = self.reader.parse_memory_function()
        #: Targets whose CFS quota was -1 at the last check (v1), and when that was.
        self._unlimited: set[tuple[str, str]] = set()
        self._quotas_at = -QUOTA_RECHECK
        if self.reader.version == 1:
            log.info("pod_memory_source", file=self.reader.memory_name)

    def latest(self) -> PodUsage:
        return self._latest

    def close(self) -> None:
        self._cpu.clear()
        self._throttle.clear()
        self._memory.clear()
        self._targets.clear()
        self._last_plan = None
        self._unlimited.clear()
        self._files.close()

    def collect(self, now: float, pods: Sequence[PodView]) -> list[Sample]:
        plan = self._plan(pods)
        if not self._v2 and self._clock() - self._quotas_at >= QUOTA_RECHECK:
            self._check_quotas(plan.targets)
        out: list[Sample] = []
        pod_cpu: dict[str, float] = {}
        pod_mem: dict[str, float] = {}
        one = self._one
        for target in plan.targets:
            cpu, used = one(target, out)
            if target.names is _POD:
                if cpu is not None:
                    pod_cpu[target.owner] = cpu
                if used is not None:
                    pod_mem[target.owner] = used
        uids = plan.uids
        self._latest = PodUsage(pod_cpu, pod_mem, pod_cpu.keys() == uids, pod_mem.keys() == uids)
        return out

    def _plan(self, pods: Sequence[PodView]) -> _Plan:
        """This tick's targets. The pod views are the informer's (frozen, replaced when a
        pod changes), so the same objects as last tick mean the same targets: nothing
        to resolve, no per-target state to prune (it only ever gains live keys)."""
        plan = self._last_plan
        if plan is not None and len(plan.pods) == len(pods) and all(map(operator.is_, plan.pods, pods)):
            return plan
        targets = self._resolve(pods)
        live = {t.key for t in targets}
        # State of vanished pods / containers is dropped, so a reused key starts fresh.
        if len(self._cpu) != len(live) or not live.issuperset(self._cpu):
            self._cpu = {k: v for k, v in self._cpu.items() if k in live}
        if len(self._throttle) != len(live) or not live.issuperset(self._throttle):
            self._throttle = {k: v for k, v in self._throttle.items() if k in live}
        if len(self._memory) != len(live) or not live.issuperset(self._memory):
            self._memory = {k: v for k, v in self._memory.items() if k in live}
        uids = frozenset(p.uid for p in pods)
        self._once.keep_owners(uids)
        self._last_plan = plan = _Plan(tuple(pods), targets, uids)
        return plan

    def _resolve(self, pods: Sequence[PodView]) -> list[_Target]:
        """The targets of ``pods``; paths and labels come from the cache, which keeps only
        the targets of the current pod list."""
        cache = self._targets
        fresh: dict[tuple[str, str, str], _Target] = {}
        out: list[_Target] = []
        for pod in pods:
            key = (pod.uid, "", pod.cgroup_dir)
            t = cache.get(key) or self._target(key, pod_labels(pod), _POD)
            fresh[key] = t
            out.append(t)
            for c in pod.containers:
                key = (pod.uid, c.id, c.cgroup_dir)
                t = cache.get(key) or self._target(key, container_labels(pod, c), _CONTAINER)
                fresh[key] = t
                out.append(t)
        if fresh.keys() != cache.keys():
            self._files.retain(path for t in out for path in (t.usage_path, t.memory_path, t.cpu_stat_path,
                                                               t.quota_path))
            self._quotas_at = -QUOTA_RECHECK  # new targets: look at their quotas now
        self._targets = fresh
        return out

    def _target(self, key: tuple[str, str, str], lbl: Labels, names: _Names) -> _Target:
        uid, cid, rel = key
        reader = self.reader
        return _Target((uid, cid), uid, rel, lbl, names,
                       reader.cpu_usage_file(rel),
                       reader.memory_file(rel),
                       reader.cpu_stat_file(rel),
                       f"{reader.cpu_dir(rel)}/cpu.cfs_quota_us")

    def _check_quotas(self, targets: Sequence[_Target]) -> None:
        """Which targets run without a CFS quota (v1). A quota that cannot be read counts
        as set: cpu.stat is read, as it would be without this check, and its own read
        reports what is wrong."""
        self._quotas_at = self._clock()
        unlimited: set[tuple[str, str]] = set()
        for t in targets:
            try:
                if int(self._files.read(t.quota_path)) < 0:
                    unlimited.add(t.key)
            except (ReadError, ValueError):
                continue
        self._unlimited = unlimited

    def _one(self, t: _Target, out: list[Sample]) -> tuple[float | None, float | None]:
        """One target's samples, appended to ``out``; returns (cores, memory used) for
        the pod sums. A file that fails costs its own samples only. One function for
        the three files: it runs for every pod and container every second."""
        read, names, lbl = self._files.read, t.names, t.labels
        # Samples made as the tuples they are: the NamedTuple's ``__new__`` is a Python
        # function (0.22 against 0.09 µs, for some 700 samples a tick at 110 pods).
        new = tuple.__new__
        cpu = used = None
        stat: bytes | None = None
        clock = self._clock
        before = clock()
        try:
            data = read(t.usage_path)
            at = (before + clock()) / 2
            if self._v2:
                stat = data
                usage = _usage_usec_ns(data, t.usage_path)
            else:
                usage = _cpuacct_ns(data, t.usage_path)
        except ReadError as exc:
            self._once.skipped(t.owner, exc)
        else:
            cpu = self._rate(t, usage, at)
            if cpu is not None:
                out.append(new(Sample, (names.cpu, cpu, lbl, 0.0)))
        try:
            memory = self._memory_of(t, read(t.memory_path))
        except ReadError as exc:
            self._once.skipped(t.owner, exc)
        else:
            used = memory[1]
            out.append(new(Sample, (names.memory, used, lbl, 0.0)))
            out.append(new(Sample, (names.cache, memory[2], lbl, 0.0)))
        if stat is None and t.key in self._unlimited:
            self._throttle.pop(t.key, None)  # a quota set later starts a fresh baseline
            return cpu, used
        try:
            periods, throttled = parse_throttling(read(t.cpu_stat_path) if stat is None else stat, t.cpu_stat_path)
        except ReadError as exc:
            self._once.skipped(t.owner, exc)
        else:
            ratio = self._ratio(t.key, periods, throttled)
            if ratio is not None:
                out.append(new(Sample, (names.throttled, ratio, lbl, 0.0)))
        return cpu, used

    def _memory_of(self, t: _Target, data: bytes) -> tuple[bytes, float, float]:
        """(``data``, used, cache) of the target's memory file; parsed only when it differs
        from the last read (the figures are a function of the bytes alone)."""
        last = self._memory.get(t.key)
        if last is None or last[0] != data:
            used, cache = self._parse_memory(data, t.memory_path)
            last = self._memory[t.key] = (data, float(used), float(cache))
        return last

    def _rate(self, t: _Target, usage: int, at: float) -> float | None:
        """Cores since the previous read of this target; None on the first read or a reset."""
        prev = self._cpu.get(t.key)
        self._cpu[t.key] = (usage, at)
        if prev is None:
            return None
        d_ns, d_t = usage - prev[0], at - prev[1]
        if d_ns < 0:
            log.debug("cpu_counter_reset", cgroup=t.rel)
            return None
        if d_t <= 0:
            return None
        return d_ns / (d_t * 1e9)

    def _ratio(self, key: tuple[str, str], periods: int, throttled: int) -> float | None:
        """Throttled share of the CFS periods since the previous read."""
        prev = self._throttle.get(key)
        self._throttle[key] = (periods, throttled)
        if prev is None:
            return None
        d_periods, d_throttled = periods - prev[0], throttled - prev[1]
        if d_periods <= 0 or d_throttled < 0:
            return None  # no CFS period elapsed (no quota, idle) or a counter reset
        return min(d_throttled / d_periods, 1.0)
