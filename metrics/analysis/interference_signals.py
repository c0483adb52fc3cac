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
view (``LatestView``: dict lookups by handles made once per series; no label
encoding, no query), all in one ``newest_many`` call, so the lock collectors write
under is taken once a step, not ~440 times at 110 pods. What a step reads and where
each value goes (a ``_Plan``: handles, pod refs, container names, which pods have a CPU
limit) only changes with the pod list or the index, so it is built once for them. A
reader without that view (not the agent's store) gets ``last`` per series, made only
for the values a step looks at. Throttling is read only for pods with a CPU limit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, runtime_checkable

from hooks.qos import QoSClass
from metrics import model
from metrics.analysis.interference import BEUsage, Observation, PodRef
from metrics.model import Labels, MetricReader, PodView

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
#: The container signals in the order a pod's signals are filled in.
_SIGNAL_ORDER: Final = ("sched_latency_p99", "sched_latency_mean", "cpi", "reclaim_latency", "alloc_stall")
#: Pods with no verdict: BE pods are the culprits, system and unknown ones neither.
_NOT_JUDGED: Final = frozenset({QoSClass.BE, QoSClass.SYSTEM, QoSClass.NONE})


@runtime_checkable
class LatestView(Protocol):
    """The store's record of the newest sample per series (``TSDB.series_handle``,
    ``newest_many``)."""

    def series_handle(self, metric: str, labels: Labels) -> str: ...

    def newest_many(self, handles: Sequence[str]) -> list[tuple[float, float] | None]: ...

    def series_since(self, metric: str, start: float) -> list[Labels] | None: ...


#: A series a step reads: (metric, labels).
_Key = tuple[str, Labels]
#: (ts, value) of a series' newest sample not older than ``max_age``; None: none.
_Found = tuple[float, float] | None


class _Reads(Protocol):
    """A step's reads by slot (``_Plan.keys``)."""

    def __getitem__(self, slot: int, /) -> _Found: ...


@dataclass(frozen=True, slots=True)
class _Series:
    """A container signal of a pod: the slots of its series and the (container id, name)
    of each, in the index's order (the worst series names the container)."""

    signal: str
    slots: tuple[int, ...]
    where: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class _LSPlan:
    uid: str
    series: tuple[_Series, ...]
    #: Slots of the pod's cpu and memory PSI.
    psi: tuple[int, int]
    #: None: no CPU limit, so never throttled and not read.
    throttled: int | None


@dataclass(frozen=True, slots=True)
class _BEPlan:
    ref: PodRef
    cpu: int
    memory: int


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a step reads and where each value goes, for one pod list and one index:
    the same from step to step until either changes, so it is built once for them."""

    pods: tuple[PodView, ...]
    #: ``SignalReader._generation`` of the index it was built from.
    generation: int
    keys: tuple[_Key, ...]
    #: The view's handle of each key (empty without the view).
    handles: tuple[str, ...]
    refs: tuple[PodRef, ...]
    be: tuple[_BEPlan, ...]
    ls: tuple[_LSPlan, ...]
    #: Slots of the node's cpu PSI, memory PSI, memory used, memory total.
    node: tuple[int, int, int, int]


def _psi_labels(resource: str, **extra: str) -> Labels:
    return model.labels(**extra, **{model.RESOURCE: resource, model.KIND: "some", model.WINDOW: "avg10"})


def _get(lbls: Labels, key: str) -> str:
    for k, v in lbls:
        if k == key:
            return v
    return ""


def pod_ref(pod: PodView) -> PodRef:
    return PodRef(pod.uid, pod.namespace, pod.name, pod.qos)


class _Planner:
    """Builds a ``_Plan``: numbers the series a step reads (slots)."""

    def __init__(self, series: Mapping[tuple[str, str], list[_Key]]) -> None:
        self._series = series
        self.keys: list[_Key] = []

    def slot(self, metric: str, lbls: Labels) -> int:
        self.keys.append((metric, lbls))
        return len(self.keys) - 1

    def ls(self, pod: PodView) -> _LSPlan:
        series = tuple(self._container_series(pod, signal) for signal in _SIGNAL_ORDER
                       if (signal, pod.uid) in self._series)
        psi = (self.slot(model.POD_PSI, _psi_labels("cpu", pod_uid=pod.uid)),
               self.slot(model.POD_PSI, _psi_labels("memory", pod_uid=pod.uid)))
        # Only a pod with a CPU limit can be throttled.
        limited = any(c.cpu_quota > 0 for c in pod.containers)
        throttled = self.slot(model.POD_CPU_THROTTLED, model.labels(pod_uid=pod.uid)) if limited else None
        return _LSPlan(pod.uid, series, psi, throttled)

    def _container_series(self, pod: PodView, signal: str) -> _Series:
        names = {c.id: c.name for c in reversed(pod.containers)}  # the first container of an id names it
        slots: list[int] = []
        where: list[tuple[str, str]] = []
        for metric, lbls in self._series[(signal, pod.uid)]:
            slots.append(self.slot(metric, lbls))
            cid = _get(lbls, model.CONTAINER_ID)
            where.append((cid, names.get(cid, "")))
        return _Series(signal, tuple(slots), tuple(where))

    def be(self, pod: PodView) -> _BEPlan:
        lbls = model.labels(pod_uid=pod.uid)
        return _BEPlan(pod_ref(pod), self.slot(model.POD_CPU_USAGE, lbls), self.slot(model.POD_MEMORY_USED, lbls))

    def node(self) -> tuple[int, int, int, int]:
        return (self.slot(model.NODE_PSI, _psi_labels("cpu")), self.slot(model.NODE_PSI, _psi_labels("memory")),
                self.slot(model.NODE_MEMORY_USED, model.NO_LABELS), self.slot(model.NODE_MEMORY_TOTAL, model.NO_LABELS))


class _LastReads:
    """A step's reads without the latest-value view: ``last`` per series, made when the
    step first looks at it, so a query is made only where the reads one by one made one
    (the schedstat mean only for a pod without a p99)."""

    __slots__ = ("_done", "_keys", "_max_age", "_now", "_reader", "reads")

    def __init__(self, reader: MetricReader, keys: Sequence[_Key], max_age: float, now: float) -> None:
        self._reader, self._keys, self._max_age, self._now = reader, keys, max_age, now
        self._done: dict[int, _Found] = {}
        self.reads = 0

    def __getitem__(self, slot: int, /) -> _Found:
        if slot in self._done:
            return self._done[slot]
        metric, lbls = self._keys[slot]
        self.reads += 1
        sample = self._reader.last(metric, lbls, self._max_age, self._now)
        found = self._done[slot] = (sample.ts, sample.value) if sample is not None else None
        return found


class SignalReader:
    """Builds observations from a ``MetricReader`` (worker thread)."""

    def __init__(self, reader: MetricReader, *, max_age: float = 25.0, index_every: float = 10.0) -> None:
        self._reader = reader
        self._view = reader if isinstance(reader, LatestView) else None
        self.max_age = max_age
        self.index_every = index_every
        self._indexed_at = float("-inf")
        #: (signal, pod uid) -> (metric, labels) of that pod's series.
        self._series: dict[tuple[str, str], list[_Key]] = {}
        #: Bumped when the index's content changes: the plan built from it is stale.
        self._generation = 0
        self._plan: _Plan | None = None
        #: (metric, labels) -> the view's handle of the series, made once (kept across
        #: plans: a pod coming or going leaves the other pods' series as they were).
        self._handles: dict[_Key, str] = {}
        #: Store queries made (``last``; the view's lookups are not queries).
        self.reads = 0

    def _index(self, now: float) -> None:
        series: dict[tuple[str, str], list[_Key]] = {}
        start = now - self.max_age - self.index_every
        for src in _CONTAINER_SOURCES:
            found = self._view.series_since(src.metric, start) if self._view is not None else None
            for lbls in found if found is not None else self._reader.aggregate_all(src.metric, start, now):
                uid = _get(lbls, model.POD_UID)
                if uid:
                    series.setdefault((src.signal, uid), []).append((src.metric, lbls))
        if series != self._series:  # mostly the same series: the plan stays
            self._series = series
            self._generation += 1
        self._indexed_at = now

    def _planned(self, pods: Sequence[PodView]) -> _Plan:
        """The plan of these pods and the current index. The agent hands the same list
        of the same views between pod ticks: equal tuples of the same objects compare by
        identity, so checking costs ~1 µs, and views rebuilt alike keep the plan too."""
        views = tuple(pods)
        plan = self._plan
        if plan is not None and plan.generation == self._generation and plan.pods == views:
            return plan
        planner = _Planner(self._series)
        refs = tuple(pod_ref(p) for p in views)
        be = tuple(planner.be(p) for p in views if p.qos is QoSClass.BE)
        ls = tuple(planner.ls(p) for p in views if p.qos not in _NOT_JUDGED)
        node = planner.node()
        keys = tuple(planner.keys)
        plan = self._plan = _Plan(views, self._generation, keys, self._handles_of(keys), refs, be, ls, node)
        return plan

    def _handles_of(self, keys: Sequence[_Key]) -> tuple[str, ...]:
        view = self._view
        if view is None:
            return ()
        if len(self._handles) > 2 * len(keys) + 64:  # gone pods' or containers' series
            self._handles.clear()
        cache = self._handles
        handles: list[str] = []
        for key in keys:
            handle = cache.get(key)
            if handle is None:
                handle = cache[key] = view.series_handle(*key)
            handles.append(handle)
        return tuple(handles)

    def _newest(self, view: LatestView, handles: Sequence[str], now: float) -> list[_Found]:
        """Every series of the step from the view under one lock (``newest_many``). The
        schedstat mean of a pod with a p99 is in the batch although unused: a few more
        dict lookups under the lock cost less than a second read for the fallback."""
        max_age = self.max_age
        # A sample stamped after ``now`` (collected while this step started) is the newest.
        return [hit if hit is not None and now - hit[0] <= max_age else None for hit in view.newest_many(handles)]

    def observe(self, pods: Sequence[PodView], now: float) -> Observation:
        if now - self._indexed_at >= self.index_every or now < self._indexed_at:
            self._index(now)
        plan = self._planned(pods)
        if self._view is not None:
            return _assemble(plan, self._newest(self._view, plan.handles, now), now)
        lazy = _LastReads(self._reader, plan.keys, self.max_age, now)
        obs = _assemble(plan, lazy, now)
        self.reads += lazy.reads
        return obs


def _value(found: _Found) -> float | None:
    return found[1] if found is not None else None


def _worst(series: _Series, found: _Reads) -> tuple[_Found, tuple[str, str]]:
    """The highest value of the signal's series (the first of equals) and its container."""
    top: _Found = None
    where = ("", "")
    for slot, container in zip(series.slots, series.where, strict=True):
        hit = found[slot]
        if hit is not None and (top is None or hit[1] > top[1]):
            top, where = hit, container
    return top, where


def _assemble(plan: _Plan, found: _Reads, now: float) -> Observation:
    cpu_psi, memory_psi, used, total = plan.node
    node_psi = {"cpu_psi": found[cpu_psi], "memory_psi": found[memory_psi]}
    be = tuple(BEUsage(p.ref, _value(found[p.cpu]), _value(found[p.memory])) for p in plan.be)
    signals: dict[str, dict[str, float]] = {}
    sources: dict[str, dict[str, str]] = {}
    stamps: dict[str, dict[str, float]] = {}
    containers: dict[str, dict[str, tuple[str, str]]] = {}
    for pod in plan.ls:
        mine: dict[str, float] = {}
        src: dict[str, str] = {}
        ts: dict[str, float] = {}
        for series in pod.series:
            signal = series.signal
            if signal == "sched_latency_mean" and "sched_latency_p99" in mine:
                continue  # the mean is the fallback of schedstat only
            top, where = _worst(series, found)
            if top is not None:
                mine[signal], src[signal], ts[signal] = top[1], "container", top[0]
                containers.setdefault(pod.uid, {})[signal] = where
        for signal, slot in (("cpu_psi", pod.psi[0]), ("memory_psi", pod.psi[1])):
            if (hit := found[slot]) is not None:
                mine[signal], src[signal], ts[signal] = hit[1], "pod", hit[0]
            elif (node := node_psi[signal]) is not None:
                mine[signal], src[signal], ts[signal] = node[1], "node", node[0]
        if pod.throttled is not None and (hit := found[pod.throttled]) is not None:
            mine["cpu_throttled"], src["cpu_throttled"], ts["cpu_throttled"] = hit[1], "pod", hit[0]
        signals[pod.uid] = mine
        sources[pod.uid] = src
        stamps[pod.uid] = ts
    return Observation(now, plan.refs, signals, sources, be, stamps, node_memory_used=_value(found[used]),
                       node_memory_total=_value(found[total]), containers=containers)


def summary(obs: Observation) -> Mapping[str, object]:
    return {"pods": len(obs.pods), "be": len(obs.be), "measured": sum(1 for s in obs.signals.values() if s)}
