"""The analyser's inputs from the store: one ``Observation`` per step.

Per LS-class pod: schedule-latency p99 (eBPF) or mean (schedstat), the worst of its
containers (named: ``Observation.containers``); CPU and memory PSI ``some avg10`` of the
pod's cgroup (v2), else of the node (source ``node``: every LS pod then sees the same
value); CFS throttling of the pod; CPI (worst container) where counters exist; the
memlat collector's reclaim/compaction latency p99 and stalled share (worst container
and kind). BE pods: CPU and memory usage. Values are the newest sample not
older than ``max_age``.

Which series exist (their label sets: schedule latency carries a ``source`` label,
reclaim latency whatever its collector chose) is looked up per metric every
``index_every`` seconds, so absent signals (no CPI counters, no reclaim collector) cost
nothing per step: from the store's in-memory record of what it was written
(``series_since``: the series a step can read), else with ``aggregate_all``. Each step
then reads only those series' newest samples from the store's in-memory latest-value
view (``LatestView``: a dict lookup by a handle made once per series; no label
encoding, no query), so every signal can be read at every step of a 1 s analyser at
110 pods. A reader without that view (not the agent's store) gets ``last`` per
series. Throttling is read only for pods with a CPU limit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, runtime_checkable

from hooks.qos import QoSClass
from metrics import model
from metrics.analysis.interference import BEUsage, Observation, PodRef
from metrics.model import Labels, MetricReader, PodView, Sample

#: The reclaim (memory allocation) latency series: the memlat collector's p99 (eBPF), then
#: those of other collectors (an advisor's, say); the pod's worst series is the signal.
RECLAIM_METRICS: Final = (model.CONTAINER_MEMORY_ALLOC_LATENCY_P99, "container_memory_reclaim_latency_p99_seconds",
                          "container_memory_reclaim_latency_seconds", "pod_memory_reclaim_latency_seconds")


@dataclass(frozen=True, slots=True)
class _Source:
    signal: str
    metric: str
    #: Label values every series must have (beyond pod_uid / container_id).
    match: tuple[tuple[str, str], ...] = ()


_CONTAINER_SOURCES: Final = (
    _Source("sched_latency_p99", model.CONTAINER_SCHED_LATENCY_P99),
    _Source("sched_latency_mean", model.CONTAINER_SCHED_LATENCY),
    _Source("cpi", model.CONTAINER_CPI),
    *(_Source("reclaim_latency", m) for m in RECLAIM_METRICS),
    # Written for every container and kind at every memlat tick (0 when it did not stall),
    # unlike the latencies (only where there were stalls): a baseline is learnt.
    _Source("alloc_stall", model.CONTAINER_MEMORY_ALLOC_STALL),
)
_PSI: Final = {"cpu_psi": "cpu", "memory_psi": "memory"}


@runtime_checkable
class LatestView(Protocol):
    """The store's record of the newest sample per series (``TSDB.series_handle``, ``newest``)."""

    def series_handle(self, metric: str, labels: Labels) -> str: ...

    def newest(self, handle: str) -> tuple[float, float] | None: ...

    def series_since(self, metric: str, start: float) -> list[Labels] | None: ...


def _psi_labels(resource: str, **extra: str) -> Labels:
    return model.labels(**extra, **{model.RESOURCE: resource, model.KIND: "some", model.WINDOW: "avg10"})


def _get(lbls: Labels, key: str) -> str:
    for k, v in lbls:
        if k == key:
            return v
    return ""


def pod_ref(pod: PodView) -> PodRef:
    return PodRef(pod.uid, pod.namespace, pod.name, pod.qos)


class SignalReader:
    """Builds observations from a ``MetricReader`` (worker thread)."""

    def __init__(self, reader: MetricReader, *, max_age: float = 25.0, index_every: float = 10.0) -> None:
        self._reader = reader
        self._view = reader if isinstance(reader, LatestView) else None
        self.max_age = max_age
        self.index_every = index_every
        self._indexed_at = float("-inf")
        #: (signal, pod uid) -> label sets of that pod's series.
        self._series: dict[tuple[str, str], list[tuple[str, Labels]]] = {}
        #: (metric, labels) -> the view's handle of the series, made once.
        self._handles: dict[tuple[str, Labels], str] = {}
        #: pod uid -> its label tuples (pod, cpu PSI, memory PSI), built once.
        self._labels: dict[str, tuple[Labels, Labels, Labels]] = {}
        #: Store queries made (``last``; the view's lookups are not queries).
        self.reads = 0

    def _last(self, metric: str, lbls: Labels, now: float) -> Sample | None:
        view = self._view
        if view is None:
            self.reads += 1
            return self._reader.last(metric, lbls, self.max_age, now)
        key = (metric, lbls)
        handle = self._handles.get(key)
        if handle is None:
            handle = self._handles[key] = view.series_handle(metric, lbls)
        found = view.newest(handle)
        # A sample stamped after ``now`` (collected while this step started) is the newest.
        if found is None or now - found[0] > self.max_age:
            return None
        return Sample(metric, found[1], lbls, found[0])

    def _pod_labels(self, uid: str) -> tuple[Labels, Labels, Labels]:
        found = self._labels.get(uid)
        if found is None:
            found = self._labels[uid] = (model.labels(pod_uid=uid), _psi_labels("cpu", pod_uid=uid),
                                         _psi_labels("memory", pod_uid=uid))
        return found

    def _index(self, now: float) -> None:
        series: dict[tuple[str, str], list[tuple[str, Labels]]] = {}
        start = now - self.max_age - self.index_every
        for src in _CONTAINER_SOURCES:
            found = self._view.series_since(src.metric, start) if self._view is not None else None
            for lbls in found if found is not None else self._reader.aggregate_all(src.metric, start, now):
                uid = _get(lbls, model.POD_UID)
                if uid:
                    series.setdefault((src.signal, uid), []).append((src.metric, lbls))
        self._series = series
        self._indexed_at = now

    def observe(self, pods: Sequence[PodView], now: float) -> Observation:
        if now - self._indexed_at >= self.index_every or now < self._indexed_at:
            self._index(now)
        read = self._last
        node_psi = {sig: read(model.NODE_PSI, _psi_labels(res), now) for sig, res in _PSI.items()}
        present = {p.uid for p in pods}
        if len(self._labels) > 2 * len(present):  # pods gone: their labels go
            self._labels = {u: v for u, v in self._labels.items() if u in present}
        if len(self._handles) > 16 * len(present) + 64:  # ~8 series a pod; more: gone pods' or containers'
            self._handles.clear()
        signals: dict[str, dict[str, float]] = {}
        sources: dict[str, dict[str, str]] = {}
        stamps: dict[str, dict[str, float]] = {}
        containers: dict[str, dict[str, tuple[str, str]]] = {}
        refs: list[PodRef] = []
        be: list[BEUsage] = []
        for pod in pods:
            ref = pod_ref(pod)
            refs.append(ref)
            uid_labels, psi_cpu, psi_memory = self._pod_labels(pod.uid)
            if pod.qos is QoSClass.BE:
                cpu = read(model.POD_CPU_USAGE, uid_labels, now)
                mem = read(model.POD_MEMORY_USED, uid_labels, now)
                be.append(BEUsage(ref, cpu.value if cpu else None, mem.value if mem else None))
                continue
            if ref.qos is QoSClass.SYSTEM or ref.qos is QoSClass.NONE:
                continue
            mine: dict[str, float] = {}
            src: dict[str, str] = {}
            ts: dict[str, float] = {}
            for signal in ("sched_latency_p99", "sched_latency_mean", "cpi", "reclaim_latency", "alloc_stall"):
                if signal == "sched_latency_mean" and "sched_latency_p99" in mine:
                    continue  # the mean is the fallback of schedstat only
                found = [s for metric, lbls in self._series.get((signal, pod.uid), ())
                         if (s := read(metric, lbls, now)) is not None]
                if found:
                    top = max(found, key=lambda s: s.value)
                    mine[signal], src[signal], ts[signal] = top.value, "container", top.ts
                    cid = _get(top.labels, model.CONTAINER_ID)
                    name = next((c.name for c in pod.containers if c.id == cid), "")
                    containers.setdefault(pod.uid, {})[signal] = (cid, name)
            for signal, lbls in (("cpu_psi", psi_cpu), ("memory_psi", psi_memory)):
                sample = read(model.POD_PSI, lbls, now)
                if sample is not None:
                    mine[signal], src[signal], ts[signal] = sample.value, "pod", sample.ts
                elif (node := node_psi[signal]) is not None:
                    mine[signal], src[signal], ts[signal] = node.value, "node", node.ts
            # Only a pod with a CPU limit can be throttled.
            limited = any(c.cpu_quota > 0 for c in pod.containers)
            throttled = read(model.POD_CPU_THROTTLED, uid_labels, now) if limited else None
            if throttled is not None:
                mine["cpu_throttled"], src["cpu_throttled"], ts["cpu_throttled"] = throttled.value, "pod", throttled.ts
            signals[pod.uid] = mine
            sources[pod.uid] = src
            stamps[pod.uid] = ts
        used = read(model.NODE_MEMORY_USED, model.NO_LABELS, now)
        total = read(model.NODE_MEMORY_TOTAL, model.NO_LABELS, now)
        return Observation(now, tuple(refs), signals, sources, tuple(be), stamps,
                           node_memory_used=used.value if used else None,
                           node_memory_total=total.value if total else None, containers=containers)


def summary(obs: Observation) -> Mapping[str, object]:
    return {"pods": len(obs.pods), "be": len(obs.be), "measured": sum(1 for s in obs.signals.values() if s)}
