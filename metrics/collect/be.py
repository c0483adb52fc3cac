"""Best-effort and system aggregates, computed after the node and pod collectors ran.

As koordlet's beresource and sysresource collectors:

* BE usage: the besteffort tier dir's own CPU counter when there is one (it also counts
  BE processes that are not in a known pod), else the sum over pods of class BE.
* BE request: the sum of the pods' batch-cpu requests.
* BE real limit: what the BE tier can actually use = min(CPUs in its cpuset, its CFS
  quota / period when a quota is set).
* System usage: node - sum(pods) - sum(host applications), floored at 0 (kernel threads,
  daemons, page tables...); host applications (``metrics.collect.hostapp``) are the
  services a NodeSLO names, subtracted with what was measured of them this tick.

A figure is only emitted when every input it sums is there: a tick where one pod has
no value yet would understate a sum (and overstate "system"), so it is skipped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import structlog

from hooks.cpusets import CpuListError, parse_cpu_list
from hooks.qos import QoSClass
from metrics.collect.base import OnceLog, ReadError, parse_int
from metrics.collect.cgroupfs import CgroupReader, Clock, PodUsage, parse_cpu_usage_ns
from metrics.collect.hostapp import HostAppUsage
from metrics.collect.openfiles import OpenFiles
from metrics.collect.procfs import NodeUsage
from metrics.model import (
    BE_CPU_LIMIT,
    BE_CPU_REQUEST,
    BE_CPU_USAGE,
    SYSTEM_CPU_USAGE,
    SYSTEM_MEMORY_USED,
    PodView,
    Sample,
)
from runtimeproxy.hookapi import HostRoots

log = structlog.get_logger("metrics.be")

_OWNER = "besteffort"


class BEAggregate:
    """Holds only the previous besteffort-tier counter (for its delta); everything else
    is a function of its inputs."""

    def __init__(
        self, host: HostRoots, *, besteffort_dir: str = "kubepods/besteffort", clock: Clock = time.monotonic
    ) -> None:
        self.be_dir = besteffort_dir
        self.reader = CgroupReader(host.cgroup)
        self._clock = clock
        self._prev: tuple[int, float] | None = None
        self._once = OnceLog(log)
        # Every tick reads these four files: paths built once, descriptors kept open.
        v1 = self.reader.version == 1
        self._files = OpenFiles()
        self._usage = self.reader.cpu_usage_file(besteffort_dir)
        self._cpuset = self.reader.cpuset_dir(besteffort_dir) / ("cpuset.cpus" if v1 else "cpuset.cpus.effective")
        cpu_dir = self.reader.cpu_dir(besteffort_dir)
        self._quota: tuple[Path, ...] = ((cpu_dir / "cpu.cfs_quota_us", cpu_dir / "cpu.cfs_period_us") if v1
                                         else (cpu_dir / "cpu.max",))

    def close(self) -> None:
        self._files.close()

    def _text(self, path: Path) -> str:
        return self._files.read(str(path)).decode("ascii", "replace")

    def samples(self, node: NodeUsage, pod_usage: PodUsage, pods: Sequence[PodView],
                host_apps: HostAppUsage | None = None) -> list[Sample]:
        """BE usage / request / real limit and system usage for this tick. Call it right
        after the pod collector (``pod_usage`` = ``PodCollector.latest()``; ``host_apps`` =
        ``HostAppCollector.latest()`` of the same tick)."""
        out: list[Sample] = []
        apps_cpu = sum(host_apps.cpu.values()) if host_apps is not None else 0.0
        apps_memory = sum(host_apps.memory.values()) if host_apps is not None else 0.0
        usage = self._be_usage(pods, pod_usage)
        if usage is not None:
            out.append(Sample(BE_CPU_USAGE, usage))
        out.append(Sample(BE_CPU_REQUEST, sum(p.batch_cpu_request_milli for p in pods) / 1000))
        limit = self.real_limit()
        if limit is not None:
            out.append(Sample(BE_CPU_LIMIT, limit))
        if node.cpu is not None and pod_usage.cpu_complete:
            out.append(Sample(SYSTEM_CPU_USAGE, max(node.cpu - sum(pod_usage.cpu.values()) - apps_cpu, 0.0)))
        if node.memory is not None and pod_usage.memory_complete:
            out.append(Sample(SYSTEM_MEMORY_USED, max(node.memory - sum(pod_usage.memory.values()) - apps_memory, 0.0)))
        return out

    def _be_usage(self, pods: Sequence[PodView], pod_usage: PodUsage) -> float | None:
        tier = self._tier_usage()
        if tier is not None:
            return tier
        be = [p.uid for p in pods if p.qos is QoSClass.BE]
        if any(uid not in pod_usage.cpu for uid in be):
            return None
        return sum(pod_usage.cpu[uid] for uid in be)

    def _tier_usage(self) -> float | None:
        before = self._clock()
        try:
            usage = parse_cpu_usage_ns(self._files.read(self._usage), self._usage, self.reader.version)
        except ReadError as exc:
            self._prev = None
            if not exc.gone:  # no tier dir is normal (no BE pods yet); garbage is not
                self._once.skipped(_OWNER, exc)
            return None
        at = (before + self._clock()) / 2
        prev, self._prev = self._prev, (usage, at)
        if prev is None or usage < prev[0] or at <= prev[1]:
            return None
        return (usage - prev[0]) / ((at - prev[1]) * 1e9)

    def real_limit(self) -> float | None:
        """min(|cpuset|, quota / period) of the tier, in cores; None when neither is known."""
        limits = [x for x in (self._cpuset_cpus(), self._quota_cores()) if x is not None]
        return min(limits) if limits else None

    def _cpuset_cpus(self) -> float | None:
        path = self._cpuset
        try:
            cpus = parse_cpu_list(self._text(path))
        except ReadError as exc:
            if not exc.gone:
                self._once.skipped(_OWNER, exc)
            return None
        except CpuListError as exc:
            self._once.skipped(_OWNER, ReadError(path, str(exc)))
            return None
        return float(len(cpus)) if cpus else None

    def _quota_cores(self) -> float | None:
        try:
            quota, period = (self._v1_quota() if self.reader.version == 1 else self._v2_quota())
        except ReadError as exc:
            if not exc.gone:
                self._once.skipped(_OWNER, exc)
            return None
        if quota <= 0 or period <= 0:
            return None  # no quota: the cpuset (or nothing) limits BE
        return quota / period

    def _v1_quota(self) -> tuple[int, int]:
        quota_path, period_path = self._quota
        quota = parse_int(self._text(quota_path).strip(), quota_path, "cfs_quota_us")
        period = parse_int(self._text(period_path).strip(), period_path, "cfs_period_us")
        return quota, period

    def _v2_quota(self) -> tuple[int, int]:
        (path,) = self._quota
        fields = self._text(path).split()
        if len(fields) != 2:
            raise ReadError(path, f"expected 'quota period', got {' '.join(fields)[:40]!r}")
        quota = -1 if fields[0] == "max" else parse_int(fields[0], path, "quota")
        return quota, parse_int(fields[1], path, "period")


#: The name the agent imports.
BEAggregator = BEAggregate
