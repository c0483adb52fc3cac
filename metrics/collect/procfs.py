"""Node CPU and memory from /proc and /sys, the way koordlet's noderesource collector does.

CPU usage is a share of jiffies, not jiffies over wall time: ``Δused / Δtotal`` of a
CPU's own counters says how busy it was whatever the tick rate or the collector's
jitter, and times the CPU count gives cores. ``used`` = user + nice + system + irq +
softirq. ``steal`` is *not* used (it is time the hypervisor ran someone else, no work
of this node's) but it is in ``total``, so usage stays a share of wall time on a busy
host; ``guest``/``guest_nice`` are already inside user/nice and are left out of both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from hooks.cpusets import CpuListError, read_online_cpus
from metrics.collect.base import OnceLog, ReadError, os_error, parse_int
from metrics.collect.openfiles import OpenFiles
from metrics.collect.topology import NODE_DIR, numa_nodes
from metrics.model import (
    NODE_CPU_CAPACITY,
    NODE_CPU_USAGE,
    NODE_MEMORY_TOTAL,
    NODE_MEMORY_USED,
    NUMA_CPU_USAGE,
    NUMA_MEMORY_USED,
    NUMA_NODE,
    Labels,
    PodView,
    Sample,
    labels,
)
from runtimeproxy.hookapi import HostRoots

log = structlog.get_logger("metrics.procfs")

_USER, _NICE, _SYSTEM, _IDLE, _IOWAIT, _IRQ, _SOFTIRQ, _STEAL = range(8)
_OWNER: Final = "node"
#: Seconds between re-reads of the online CPUs and the NUMA nodes' CPU lists, which
#: only change on hotplug: every tick they cost more than the usage figures themselves.
LAYOUT_REFRESH: Final = 10.0

Ticks = tuple[int, int]  # (used, total) jiffies


def _ticks(fields: Sequence[str], path: Path) -> Ticks:
    """``user nice system idle iowait irq softirq steal [guest guest_nice]`` -> (used, total)."""
    if len(fields) < 8:
        raise ReadError(path, f"cpu line has {len(fields)} counters, expected at least 8")
    values = [parse_int(f, path, "cpu ticks") for f in fields[:8]]
    used = values[_USER] + values[_NICE] + values[_SYSTEM] + values[_IRQ] + values[_SOFTIRQ]
    return used, sum(values)


def read_cpu_ticks(proc_root: Path) -> Ticks:
    """(used, total) jiffies of the aggregate ``cpu`` line of ``<proc_root>/stat``.

    One open and one line read: the QoS manager's fast path calls this every tick.
    Raises ``ReadError`` when the file is missing or the line is malformed."""
    path = proc_root / "stat"
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            line = f.readline()
    except OSError as exc:
        raise os_error(path, exc) from exc
    fields = line.split()
    if not fields or fields[0] != "cpu":
        raise ReadError(path, f"first line {line[:40]!r} is not the aggregate cpu line")
    return _ticks(fields[1:], path)


@dataclass(frozen=True, slots=True)
class CpuStat:
    """The cpu lines of /proc/stat: the aggregate and each online CPU."""

    total: Ticks
    per_cpu: Mapping[int, Ticks]


def parse_stat(text: str, path: Path) -> CpuStat:
    total: Ticks | None = None
    per_cpu: dict[int, Ticks] = {}
    for line in text.splitlines():
        # Tested before the split: the ``intr`` line has a field per interrupt (hundreds,
        # thousands on a large host), ``softirq`` a dozen; only cpu lines are wanted.
        if not line.lstrip().startswith("cpu"):
            continue
        fields = line.split()
        name = fields[0]
        if name == "cpu":
            total = _ticks(fields[1:], path)
        else:
            per_cpu[parse_int(name[3:], path, "cpu line name")] = _ticks(fields[1:], path)
    if total is None:
        raise ReadError(path, "no aggregate cpu line")
    return CpuStat(total, per_cpu)


def meminfo_fields(data: bytes, keys: Sequence[bytes], path: Path) -> list[int]:
    """Only ``keys`` (``b"MemTotal"``) of a meminfo file (``/proc/meminfo`` or a node's
    ``Node 0 MemTotal: 123 kB``), in bytes, without parsing the other lines; ReadError
    names what is missing or not a number."""
    out: list[int] = []
    missing: list[str] = []
    for key in keys:
        field = _meminfo_field(data, key, path)
        if field is None:
            missing.append(key.decode("ascii"))
        else:
            out.append(field)
    if missing:
        raise ReadError(path, f"missing {', '.join(missing)}")
    return out


def _meminfo_field(data: bytes, key: bytes, path: Path) -> int | None:
    needle = key + b":"
    at = data.find(needle)
    while at > 0 and data[at - 1] not in b" \n":  # "Active(file)" inside "XActive(file)"
        at = data.find(needle, at + 1)
    if at < 0:
        return None
    end = data.find(b"\n", at)
    fields = (data[at + len(needle):] if end < 0 else data[at + len(needle):end]).split()
    if not fields:
        return None
    value = parse_int(fields[0].decode("ascii", "replace"), path, key.decode("ascii"))
    return value * 1024 if fields[1:2] == [b"kB"] else value


def _share(prev: Ticks, cur: Ticks) -> float | None:
    """Busy share of one counter pair; None when it went backwards (reset) or did not move."""
    d_used, d_total = cur[0] - prev[0], cur[1] - prev[1]
    if d_used < 0 or d_total <= 0 or d_used > d_total:
        return None
    return d_used / d_total


@dataclass(frozen=True, slots=True)
class NumaNode:
    id: int
    cpus: frozenset[int]
    meminfo: Path
    #: The node's series labels and ``meminfo`` as a string, made with the node list (``_numa_node``).
    labels: Labels
    meminfo_path: str


@dataclass(frozen=True, slots=True)
class NodeUsage:
    """The latest node figures (None until measured), for the BE / system aggregates."""

    cpu: float | None = None  # cores
    memory: float | None = None  # bytes
    capacity: float | None = None  # cores


class NodeCollector:
    """Node and per-NUMA-node CPU / memory usage."""

    name = "node"

    def __init__(self, host: HostRoots, *, interval: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._proc = host.proc
        self._sys = host.sys
        # The files of every tick, joined once: pathlib's joins and formatting were a
        # tenth of the tick, which runs first after the worker's second of sleep (cold).
        self._stat = host.proc / "stat"
        self._meminfo = host.proc / "meminfo"
        self._stat_path, self._meminfo_path = str(self._stat), str(self._meminfo)
        self._prev: CpuStat | None = None
        self._once = OnceLog(log)
        self._latest = NodeUsage()
        self._clock = clock
        self._files = OpenFiles()
        #: Online CPU count and NUMA nodes, and when they were read (``LAYOUT_REFRESH``).
        self._online: int | None = None
        self._nodes: list[NumaNode] = []
        self._layout_at = -LAYOUT_REFRESH

    def latest(self) -> NodeUsage:
        return self._latest

    def close(self) -> None:
        self._prev = None
        self._files.close()

    def collect(self, now: float, pods: Sequence[PodView]) -> list[Sample]:
        if self._clock() - self._layout_at >= LAYOUT_REFRESH:
            self._read_layout()
        out: list[Sample] = []
        stat = self._read_stat()
        prev = self._prev
        if stat is not None:
            self._prev = stat
        capacity = self._capacity(stat, out)
        cpu = self._node_cpu(prev, stat, capacity, out)
        memory = self._memory(out)
        self._numa(prev, stat, out)
        self._latest = NodeUsage(cpu=cpu, memory=memory, capacity=capacity)
        return out

    def _read_layout(self) -> None:
        self._layout_at = self._clock()
        try:
            self._online = len(read_online_cpus(self._sys))
        except CpuListError as exc:
            self._once.skipped(_OWNER, ReadError(self._sys / "devices/system/cpu/online", str(exc)))
            self._online = None
        self._nodes = [_numa_node(node, cpus, self._sys / NODE_DIR / f"node{node}" / "meminfo")
                       for node, cpus in numa_nodes(self._sys, self._once, _OWNER).items()]
        self._files.retain([self._stat_path, self._meminfo_path, *(n.meminfo_path for n in self._nodes)])

    def _read_stat(self) -> CpuStat | None:
        path = self._stat
        try:
            return parse_stat(self._files.read(self._stat_path).decode("ascii", "replace"), path)
        except ReadError as exc:
            self._once.skipped(_OWNER, exc)
            return None

    def _capacity(self, stat: CpuStat | None, out: list[Sample]) -> float | None:
        count = self._online
        if count is None:
            if stat is None or not stat.per_cpu:
                return None
            count = len(stat.per_cpu)
        out.append(Sample(NODE_CPU_CAPACITY, float(count)))
        return float(count)

    def _node_cpu(
        self, prev: CpuStat | None, stat: CpuStat | None, capacity: float | None, out: list[Sample]
    ) -> float | None:
        if prev is None or stat is None:
            return None  # first tick (or unreadable): no delta yet
        share = _share(prev.total, stat.total)
        if share is None:
            if stat.total[0] < prev.total[0] or stat.total[1] < prev.total[1]:
                log.info("cpu_counter_reset", path=self._stat_path)
            return None  # the new counters are the baseline from here on
        # Ticks are summed over the CPUs listed in /proc/stat, so they are the multiplier.
        cpus = len(stat.per_cpu) or capacity
        if not cpus:
            return None
        usage = share * cpus
        out.append(Sample(NODE_CPU_USAGE, usage))
        return usage

    def _memory(self, out: list[Sample]) -> float | None:
        path = self._meminfo
        try:
            total, available = meminfo_fields(self._files.read(self._meminfo_path), (b"MemTotal", b"MemAvailable"),
                                              path)
        except ReadError as exc:
            self._once.skipped(_OWNER, exc)
            return None
        used = float(max(total - available, 0))
        out.append(Sample(NODE_MEMORY_USED, used))
        out.append(Sample(NODE_MEMORY_TOTAL, float(total)))
        return used

    def _numa(self, prev: CpuStat | None, stat: CpuStat | None, out: list[Sample]) -> None:
        for node in self._nodes:
            node_labels = node.labels
            if prev is not None and stat is not None:
                cpu = _numa_cpu(node.cpus, prev, stat)
                if cpu is not None:
                    out.append(Sample(NUMA_CPU_USAGE, cpu, node_labels))
            used = self._numa_memory(node)
            if used is not None:
                out.append(Sample(NUMA_MEMORY_USED, used, node_labels))

    def _numa_memory(self, node: NumaNode) -> float | None:
        """MemTotal - (MemFree + Active(file) + Inactive(file) + SReclaimable): page cache
        and reclaimable slab are not "used", as in koordlet."""
        keys = (b"MemTotal", b"MemFree", b"Active(file)", b"Inactive(file)", b"SReclaimable")
        try:
            total, free, active_file, inactive_file, reclaimable = meminfo_fields(
                self._files.read(node.meminfo_path), keys, node.meminfo)
        except ReadError as exc:
            self._once.skipped(_OWNER, exc)
            return None
        return float(max(total - (free + active_file + inactive_file + reclaimable), 0))


def _numa_node(node: int, cpus: frozenset[int], meminfo: Path) -> NumaNode:
    return NumaNode(node, cpus, meminfo, labels(**{NUMA_NODE: str(node)}), str(meminfo))


def _numa_cpu(cpus: frozenset[int], prev: CpuStat, cur: CpuStat) -> float | None:
    """Cores used by a node's CPUs: the sum of each CPU's busy share. A CPU whose
    counters went backwards (hotplug) makes the whole node skip this tick rather than
    report a number that silently leaves that CPU out."""
    total = 0.0
    seen = 0
    for cpu in cpus:
        before, after = prev.per_cpu.get(cpu), cur.per_cpu.get(cpu)
        if before is None or after is None:
            continue  # offline CPU: contributes nothing
        share = _share(before, after)
        if share is None:
            return None
        total += share
        seen += 1
    return total if seen else None
