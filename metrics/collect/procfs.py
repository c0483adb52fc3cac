"""Node CPU and memory from /proc and /sys, the way koordlet's noderesource collector does.

CPU usage is a share of jiffies, not jiffies over wall time: ``Δused / Δtotal`` of a
CPU's own counters says how busy it was whatever the tick rate or the collector's
jitter, and times the CPU count gives cores. ``used`` = user + nice + system + irq +
softirq. ``steal`` is *not* used (it is time the hypervisor ran someone else, no work
of this node's) but it is in ``total``, so usage stays a share of wall time on a busy
host; ``guest``/``guest_nice`` are already inside user/nice and are left out of both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from hooks.cpusets import CpuListError, read_online_cpus
from metrics.collect.base import OnceLog, ReadError, os_error, parse_int, read_file
from metrics.collect.topology import NODE_DIR, numa_nodes
from metrics.model import (
    NODE_CPU_CAPACITY,
    NODE_CPU_USAGE,
    NODE_MEMORY_TOTAL,
    NODE_MEMORY_USED,
    NUMA_CPU_USAGE,
    NUMA_MEMORY_USED,
    NUMA_NODE,
    PodView,
    Sample,
    labels,
)
from runtimeproxy.hookapi import HostRoots

log = structlog.get_logger("metrics.procfs")

_USER, _NICE, _SYSTEM, _IDLE, _IOWAIT, _IRQ, _SOFTIRQ, _STEAL = range(8)
_OWNER: Final = "node"

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
        fields = line.split()
        if not fields or not fields[0].startswith("cpu"):
            continue
        name = fields[0]
        if name == "cpu":
            total = _ticks(fields[1:], path)
        else:
            per_cpu[parse_int(name[3:], path, "cpu line name")] = _ticks(fields[1:], path)
    if total is None:
        raise ReadError(path, "no aggregate cpu line")
    return CpuStat(total, per_cpu)


def parse_meminfo(text: str, path: Path) -> dict[str, int]:
    """``/proc/meminfo`` or a node's meminfo (``Node 0 MemTotal: 123 kB``) -> bytes by key."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep:
            continue
        fields = rest.split()
        if not fields:
            continue
        value = parse_int(fields[0], path, key.strip())
        unit = fields[1] if len(fields) > 1 else ""
        out[key.split()[-1]] = value * 1024 if unit == "kB" else value
    return out


def _need(info: Mapping[str, int], keys: Sequence[str], path: Path) -> list[int]:
    missing = [k for k in keys if k not in info]
    if missing:
        raise ReadError(path, f"missing {', '.join(missing)}")
    return [info[k] for k in keys]


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


@dataclass(frozen=True, slots=True)
class NodeUsage:
    """The latest node figures (None until measured), for the BE / system aggregates."""

    cpu: float | None = None  # cores
    memory: float | None = None  # bytes
    capacity: float | None = None  # cores


class NodeCollector:
    """Node and per-NUMA-node CPU / memory usage."""

    name = "node"

    def __init__(self, host: HostRoots, *, interval: float = 1.0) -> None:
        self.interval = interval
        self._proc = host.proc
        self._sys = host.sys
        self._prev: CpuStat | None = None
        self._once = OnceLog(log)
        self._latest = NodeUsage()

    def latest(self) -> NodeUsage:
        return self._latest

    def close(self) -> None:
        self._prev = None

    def collect(self, now: float, pods: Sequence[PodView]) -> list[Sample]:
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

    def _read_stat(self) -> CpuStat | None:
        path = self._proc / "stat"
        try:
            return parse_stat(read_file(path), path)
        except ReadError as exc:
            self._once.skipped(_OWNER, exc)
            return None

    def _capacity(self, stat: CpuStat | None, out: list[Sample]) -> float | None:
        try:
            count = len(read_online_cpus(self._sys))
        except CpuListError as exc:
            self._once.skipped(_OWNER, ReadError(self._sys / "devices/system/cpu/online", str(exc)))
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
                log.info("cpu_counter_reset", path=str(self._proc / "stat"))
            return None  # the new counters are the baseline from here on
        # Ticks are summed over the CPUs listed in /proc/stat, so they are the multiplier.
        cpus = len(stat.per_cpu) or capacity
        if not cpus:
            return None
        usage = share * cpus
        out.append(Sample(NODE_CPU_USAGE, usage))
        return usage

    def _memory(self, out: list[Sample]) -> float | None:
        path = self._proc / "meminfo"
        try:
            total, available = _need(parse_meminfo(read_file(path), path), ("MemTotal", "MemAvailable"), path)
        except ReadError as exc:
            self._once.skipped(_OWNER, exc)
            return None
        used = float(max(total - available, 0))
        out.append(Sample(NODE_MEMORY_USED, used))
        out.append(Sample(NODE_MEMORY_TOTAL, float(total)))
        return used

    def _numa(self, prev: CpuStat | None, stat: CpuStat | None, out: list[Sample]) -> None:
        for node in self._numa_nodes():
            node_labels = labels(**{NUMA_NODE: str(node.id)})
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
        keys = ("MemTotal", "MemFree", "Active(file)", "Inactive(file)", "SReclaimable")
        try:
            info = parse_meminfo(read_file(node.meminfo), node.meminfo)
            total, free, active_file, inactive_file, reclaimable = _need(info, keys, node.meminfo)
        except ReadError as exc:
            self._once.skipped(_OWNER, exc)
            return None
        return float(max(total - (free + active_file + inactive_file + reclaimable), 0))

    def _numa_nodes(self) -> list[NumaNode]:
        return [NumaNode(node, cpus, self._sys / NODE_DIR / f"node{node}" / "meminfo")
                for node, cpus in numa_nodes(self._sys, self._once, _OWNER).items()]


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
