"""Run-queue latency from ``/proc/<pid>/task/<tid>/schedstat``: the fallback source.

Each thread's schedstat has three counters: time on CPU (ns), time waiting on a run
queue (ns) and the number of times it was scheduled in. Over an interval, a
container's mean wait per scheduling event is Δwait / Δslices summed over its threads.
Only threads seen in both samples count: a thread that appeared has no baseline and
one that vanished took its counters with it, and counting either would skew the
mean. A thread whose counters went backwards (its tid was reused) is left out too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import structlog

from metrics.collect.base import LatencyStat, OnceLog, ReadError, SourceUnavailable, read_file
from metrics.collect.cgroupfs import CgroupReader
from metrics.model import ContainerView, PodView
from runtimeproxy.hookapi import HostRoots

log = structlog.get_logger("metrics.schedstat")

# tid -> (wait ns, timeslices)
Threads = dict[int, tuple[int, int]]


def parse_schedstat(text: str) -> tuple[int, int] | None:
    """(wait ns, timeslices), or None for anything but three integers."""
    fields = text.split()
    if len(fields) != 3 or not all(f.isdigit() for f in fields):
        return None
    return int(fields[1]), int(fields[2])


def _pids(text: str) -> list[int]:
    return [int(line) for line in text.split() if line.isdigit()]


def mean_wait(prev: Threads, cur: Threads) -> LatencyStat | None:
    """Mean wait per scheduling event over the threads present in both samples."""
    waited = slices = 0
    for tid, (wait, count) in cur.items():
        before = prev.get(tid)
        if before is None:
            continue
        d_wait, d_slices = wait - before[0], count - before[1]
        if d_wait < 0 or d_slices < 0:
            continue
        waited += d_wait
        slices += d_slices
    if slices == 0:
        return None  # nothing was scheduled: no latency to report, not zero latency
    return LatencyStat(mean=waited / slices / 1e9, events=slices)


class SchedstatSource:
    """Reads the schedstat of every thread of a container's processes."""

    name = "schedstat"

    def __init__(self, host: HostRoots, reader: CgroupReader | None = None) -> None:
        self._proc = host.proc
        self._reader = reader if reader is not None else CgroupReader(host.cgroup)
        self._prev: dict[str, Threads] = {}
        self._once = OnceLog(log)

    def start(self) -> None:
        """Schedstat needs CONFIG_SCHED_INFO; check it on our own process."""
        path = self._proc / "self" / "schedstat"
        try:
            text = read_file(path)
        except ReadError as exc:
            raise SourceUnavailable(f"cannot read {path}: {exc.reason} (kernel without CONFIG_SCHED_INFO?)") from exc
        if parse_schedstat(text) is None:
            raise SourceUnavailable(f"{path} has an unexpected format: {text[:40]!r}")

    def close(self) -> None:
        self._prev.clear()

    def sample(self, containers: Sequence[tuple[PodView, ContainerView]]) -> dict[str, LatencyStat]:
        """Container id -> mean wait since the previous call (first call: baseline only)."""
        self._once.keep_owners(pod.uid for pod, _ in containers)
        out: dict[str, LatencyStat] = {}
        current: dict[str, Threads] = {}
        for pod, container in containers:
            threads = self._threads(pod.uid, container.cgroup_dir)
            if threads is None:
                continue
            current[container.id] = threads
            prev = self._prev.get(container.id)
            stat = mean_wait(prev, threads) if prev is not None else None
            if stat is not None:
                out[container.id] = stat
        self._prev = current  # containers gone from the list lose their state
        return out

    def _procs_file(self, rel: str) -> list[Path]:
        candidates = [self._reader.cpu_dir(rel) / "cgroup.procs"]
        unified = self._reader.unified_dir(rel)
        if unified is not None and unified != self._reader.cpu_dir(rel):
            candidates.append(unified / "cgroup.procs")
        return candidates

    def _threads(self, owner: str, rel: str) -> Threads | None:
        pids: list[int] | None = None
        error: ReadError | None = None
        for path in self._procs_file(rel):
            try:
                pids = _pids(read_file(path))
                break
            except ReadError as exc:
                error = exc
        if pids is None:
            if error is not None:
                self._once.skipped(owner, error)
            return None
        threads: Threads = {}
        for pid in pids:
            self._read_tasks(owner, pid, threads)
        return threads

    def _read_tasks(self, owner: str, pid: int, into: Threads) -> None:
        task_dir = self._proc / str(pid) / "task"
        try:
            tids = os.listdir(task_dir)
        except OSError:
            return  # the process exited since cgroup.procs was read
        for tid in tids:
            if not tid.isdigit():
                continue
            try:
                parsed = parse_schedstat(read_file(task_dir / tid / "schedstat"))
            except ReadError:
                continue  # the thread exited between listdir and read
            if parsed is None:
                self._once.skipped(owner, ReadError(task_dir, "malformed schedstat (expected 3 integers)"))
                continue
            into[int(tid)] = parsed
