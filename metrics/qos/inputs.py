"""What the strategies decide from: the node's state at ``now``, from the store.

Koordlet's strategies read the **last** sample not older than twice the collect
interval (reference §4.1). Anything older is stale: a collector that stopped
must not leave the manager suppressing from a minute-old picture. A missing or
stale metric is *named* in ``NodeInputs.missing``; strategies that need it make
no new decision (they return an empty plan saying so) — never a guess.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from metrics import model
from metrics.model import Labels, MetricReader, NewestView, PodView


@dataclass(frozen=True, slots=True)
class TierUsage:
    """CPU (cores) of all pods and of the BE pods, read from the kubepods and
    besteffort tier cgroups' counters instead of summing every pod's."""

    pods: float
    be: float


@dataclass(frozen=True, slots=True)
class NodeInputs:
    """A plain value: strategies are pure functions of it (tests build it directly)."""

    now: float
    capacity_cores: float
    #: max(kubelet reserved, reservation annotation), in cores.
    reserved_cores: float
    pods: tuple[PodView, ...]
    node_cpu_used: float | None
    node_memory_used: float | None = None
    node_memory_total: float | None = None
    #: Last fresh sample per pod uid; pods with metrics but no PodView are included.
    pod_cpu_used: Mapping[str, float] = field(default_factory=dict)
    pod_memory_used: Mapping[str, float] = field(default_factory=dict)
    container_cpu_used: Mapping[str, float] = field(default_factory=dict)
    container_throttled: Mapping[str, float] = field(default_factory=dict)
    #: Averages over the share-pool window (CPU burst), None/absent when unknown.
    node_cpu_avg: float | None = None
    pod_cpu_avg: Mapping[str, float] = field(default_factory=dict)
    #: Metrics (``name`` or ``name{pod}``) that were missing or stale at ``now``.
    missing: tuple[str, ...] = ()
    #: Where the numbers came from ("tsdb" or "fastpath"), for explain.
    source: str = "tsdb"
    #: When set, the suppress formula uses these sums and ignores ``pod_cpu_used``.
    tiers: TierUsage | None = None

    def missing_for(self, *pods: PodView) -> list[str]:
        """The missing inputs among the node CPU usage and these pods' CPU usage."""
        out = [] if self.node_cpu_used is not None else [model.NODE_CPU_USAGE]
        if self.tiers is not None:
            return out
        out += [f"{model.POD_CPU_USAGE}{{{p.key}}}" for p in pods if p.containers and p.uid not in self.pod_cpu_used]
        return out


def _label(labels: Labels, key: str) -> str:
    for k, v in labels:
        if k == key:
            return v
    return ""


def last_by_label(reader: MetricReader, metric: str, key: str, now: float, max_age: float) -> dict[str, float]:
    """The last value of every series of ``metric`` updated within ``max_age``, by label ``key``."""
    out: dict[str, float] = {}
    for labels, agg in reader.aggregate_all(metric, now - max_age, now).items():
        name = _label(labels, key)
        if name and agg.count > 0 and agg.last_ts >= now - max_age:
            out[name] = agg.last
    return out


def _newest(view: NewestView | None, metric: str, key: str, now: float, max_age: float) -> dict[str, float] | None:
    """The store's in-memory newest values (``NewestView``): one pass over the series of
    ``metric``, no query; None when the reader keeps none (then the file is asked)."""
    if view is not None:
        return view.newest_by_label(metric, key, now - max_age, now)
    return None


def _newest_view(reader: MetricReader) -> NewestView | None:
    # Asked once per round, not per metric: ``isinstance`` against a runtime-checkable
    # protocol walks its attributes each time (~3 µs, four times a round).
    return reader if isinstance(reader, NewestView) else None


def _fresh_pods(reader: MetricReader, metric: str, pods: Sequence[PodView], now: float,
                max_age: float, view: NewestView | None) -> dict[str, float]:
    """Per pod uid, including pods with metrics but no PodView. From the newest view when
    the store keeps one; else known pods through ``last`` plus the flushed others."""
    newest = _newest(view, metric, model.POD_UID, now, max_age)
    if newest is not None:
        return newest
    out = last_by_label(reader, metric, model.POD_UID, now, max_age)
    for pod in pods:
        sample = reader.last(metric, model.labels(pod_uid=pod.uid), max_age, now)
        if sample is not None:
            out[pod.uid] = sample.value
    return out


def _fresh_containers(reader: MetricReader, metric: str, pods: Sequence[PodView], now: float,
                      max_age: float, view: NewestView | None) -> dict[str, float]:
    newest = _newest(view, metric, model.CONTAINER_ID, now, max_age)
    if newest is not None:
        return {c.id: newest[c.id] for p in pods for c in p.containers if c.id in newest}
    out: dict[str, float] = {}
    for pod in pods:
        for ctr in pod.containers:
            sample = reader.last(metric, model.labels(pod_uid=pod.uid, container_id=ctr.id), max_age, now)
            if sample is not None:
                out[ctr.id] = sample.value
    return out


def avg_by_label(reader: MetricReader, metric: str, key: str, start: float, end: float) -> dict[str, float]:
    if isinstance(reader, NewestView):
        found = reader.average_by_label(metric, key, start, end)
        if found is not None:
            return found
    return {_label(lb, key): agg.avg for lb, agg in reader.aggregate_all(metric, start, end).items()
            if _label(lb, key) and agg.count > 0}


def _last(reader: MetricReader, metric: str, now: float, max_age: float, missing: list[str]) -> float | None:
    sample = reader.last(metric, model.NO_LABELS, max_age, now)
    if sample is None:
        missing.append(metric)
        return None
    return sample.value


def build_node_inputs(
    reader: MetricReader,
    pods: Sequence[PodView],
    *,
    now: float,
    capacity_cores: float,
    reserved_cores: float,
    collect_interval: float = 1.0,
    share_pool: bool = True,
) -> NodeInputs:
    """Inputs at ``now``: last samples within 2 x ``collect_interval``; share-pool
    averages over min(5 x interval, 10 s), as koordlet's CPU burst (``share_pool``
    False leaves them out: two window queries of the store only CPU burst reads)."""
    max_age = 2 * collect_interval
    missing: list[str] = []
    node_cpu = _last(reader, model.NODE_CPU_USAGE, now, max_age, missing)
    mem_used = _last(reader, model.NODE_MEMORY_USED, now, max_age, missing)
    mem_total = _last(reader, model.NODE_MEMORY_TOTAL, now, max_age, missing)
    view = _newest_view(reader)
    pod_cpu = _fresh_pods(reader, model.POD_CPU_USAGE, pods, now, max_age, view)
    missing += [f"{model.POD_CPU_USAGE}{{{p.key}}}" for p in pods if p.containers and p.uid not in pod_cpu]
    node_avg, pod_avg = share_pool_averages(reader, now=now, collect_interval=collect_interval) if share_pool \
        else (None, {})
    return NodeInputs(
        now=now,
        capacity_cores=capacity_cores,
        reserved_cores=reserved_cores,
        pods=tuple(pods),
        node_cpu_used=node_cpu,
        node_memory_used=mem_used,
        node_memory_total=mem_total,
        pod_cpu_used=pod_cpu,
        pod_memory_used=_fresh_pods(reader, model.POD_MEMORY_USED, pods, now, max_age, view),
        container_cpu_used=_fresh_containers(reader, model.CONTAINER_CPU_USAGE, pods, now, max_age, view),
        container_throttled=_fresh_containers(reader, model.CONTAINER_CPU_THROTTLED, pods, now, max_age, view),
        node_cpu_avg=node_avg,
        pod_cpu_avg=pod_avg,
        missing=tuple(missing),
    )


def share_pool_averages(reader: MetricReader, *, now: float, collect_interval: float = 1.0
                        ) -> tuple[float | None, dict[str, float]]:
    """The node's and each pod's CPU over min(5 x interval, 10 s) (koordlet's CPU burst
    share-pool window); the node's is None without samples."""
    window = min(5 * collect_interval, 10.0)
    node_avg = reader.aggregate(model.NODE_CPU_USAGE, model.NO_LABELS, now - window, now)
    return (node_avg.avg if node_avg is not None and node_avg.count > 0 else None,
            avg_by_label(reader, model.POD_CPU_USAGE, model.POD_UID, now - window, now))


BE_CPU_SERIES = (model.BE_CPU_USAGE, model.BE_CPU_REQUEST, model.BE_CPU_LIMIT)


@dataclass(frozen=True, slots=True)
class BECPUWindow:
    """The ``node_be`` CPU series over the eviction window (averages and last values, cores)."""

    count: int
    span: float
    usage_avg: float
    request_avg: float
    limit_avg: float
    usage_last: float
    request_last: float
    limit_last: float


class KeptWindows:
    """The window reads a manager's rounds repeat every round, each kept between rounds
    by the store where it can (``metrics.store.tsdbwindow``: only what changed since the
    last round is read), else read whole (``aggregate_many``). One per manager; its
    rounds run one at a time."""

    def __init__(self, reader: MetricReader) -> None:
        self._reader = reader
        self._views: dict[tuple[tuple[str, Labels], ...], model.WindowAggregates | None] = {}

    def aggregate_many(self, series: Sequence[tuple[str, Labels]], start: float, end: float
                       ) -> Mapping[tuple[str, Labels], model.Aggregate]:
        key = tuple(series)
        if key not in self._views:
            reader = self._reader
            self._views[key] = reader.window_view(key) if isinstance(reader, model.WindowViews) else None
        view = self._views[key]
        return view.aggregate(start, end) if view is not None else self._reader.aggregate_many(key, start, end)


_BE_CPU_KEYS = tuple((m, model.NO_LABELS) for m in BE_CPU_SERIES)


def build_be_cpu_window(reader: MetricReader, *, now: float, window: float,
                        kept: KeptWindows | None = None) -> BECPUWindow | None:
    """None when any of the three BE series has no sample in the window. ``kept``: the
    manager's kept windows (the same window a second later reads only what is new)."""
    source: MetricReader | KeptWindows = kept if kept is not None else reader
    found = source.aggregate_many(_BE_CPU_KEYS, now - window, now)
    usage, request, limit = (found.get((m, model.NO_LABELS)) for m in BE_CPU_SERIES)
    if usage is None or request is None or limit is None:
        return None
    return BECPUWindow(
        count=min(a.count for a in (usage, request, limit)),
        span=usage.span,
        usage_avg=usage.avg, request_avg=request.avg, limit_avg=limit.avg,
        usage_last=usage.last, request_last=request.last, limit_last=limit.last,
    )
