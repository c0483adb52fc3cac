"""CPU schedule (run-queue) latency per container, from eBPF or from schedstat.

eBPF sees every wait and gives a p99; schedstat only gives a mean but needs nothing
but /proc. ``prefer="auto"`` takes eBPF when it starts and falls back to schedstat;
``"ebpf"`` or ``"schedstat"`` use only that source, so a series never silently
changes meaning. The choice is made on the first ``collect`` (in the agent's worker
thread, since compiling the eBPF program blocks) or by calling ``start()``, and logged
once. Every sample carries ``source``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import structlog

from metrics.collect.base import LatencyStat, ReasonOnce, SourceUnavailable, container_labels, pick_source
from metrics.collect.cgroupfs import CgroupReader
from metrics.collect.ebpf import EbpfSource
from metrics.collect.schedstat import SchedstatSource
from metrics.model import (
    CONTAINER_SCHED_LATENCY,
    CONTAINER_SCHED_LATENCY_P99,
    SOURCE,
    ContainerView,
    PodView,
    Sample,
    labels,
)
from runtimeproxy.hookapi import HostRoots

log = structlog.get_logger("metrics.schedlat")

Prefer = Literal["auto", "ebpf", "schedstat"]
PREFERENCES: tuple[Prefer, ...] = ("auto", "ebpf", "schedstat")


class LatencySource(Protocol):
    name: str

    def start(self) -> None:
        """Raises ``SourceUnavailable`` when the source cannot work on this host."""

    def sample(self, containers: Sequence[tuple[PodView, ContainerView]]) -> dict[str, LatencyStat]:
        """Container id -> latency since the previous call."""

    def close(self) -> None: ...


class SchedLatencyCollector:
    name = "schedlat"

    def __init__(self, host: HostRoots, *, prefer: Prefer = "auto", interval: float = 10.0) -> None:
        if prefer not in PREFERENCES:
            raise ValueError(f"schedlat prefer={prefer!r}: expected one of {', '.join(PREFERENCES)}")
        self.interval = interval
        self.prefer: Prefer = prefer
        self._host = host
        self._reader = CgroupReader(host.cgroup)
        self._source: LatencySource | None = None
        self._started = False
        self._failures = ReasonOnce(log, "schedlat_sample_failed")
        #: Why no source runs (None while one does or before ``start``).
        self.unavailable_reason: str | None = None

    @property
    def source(self) -> str | None:
        """The running source (ebpf or schedstat); None before start or when none is available."""
        return None if self._source is None else self._source.name

    def start(self) -> None:
        """Pick and start the source; idempotent. Never raises for an unavailable source."""
        if self._started:
            return
        self._started = True
        self._source, reason = pick_source(self._candidates(), self.prefer, log, "schedlat_source")
        if self._source is None:
            self.unavailable_reason = reason

    def _candidates(self) -> list[LatencySource]:
        ebpf = EbpfSource(self._host, self._reader)
        schedstat = SchedstatSource(self._host, self._reader)
        if self.prefer == "ebpf":
            return [ebpf]
        if self.prefer == "schedstat":
            return [schedstat]
        return [ebpf, schedstat]

    def collect(self, now: float, pods: Sequence[PodView]) -> list[Sample]:
        self.start()
        source = self._source
        if source is None:
            return []
        containers = [(pod, c) for pod in pods for c in pod.containers]
        try:
            stats = source.sample(containers)
        except SourceUnavailable as exc:
            self._failures.failed(source.name, exc)
            return []
        out: list[Sample] = []
        for pod, container in containers:
            stat = stats.get(container.id)
            if stat is None:
                continue
            lbls = labels(**dict(container_labels(pod, container)), **{SOURCE: source.name})
            out.append(Sample(CONTAINER_SCHED_LATENCY, stat.mean, lbls))
            if stat.p99 is not None:
                out.append(Sample(CONTAINER_SCHED_LATENCY_P99, stat.p99, lbls))
        return out

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
