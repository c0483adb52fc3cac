"""The vocabulary shared by collectors, the store, reporters and the QoS manager.

A sample is ``(metric, labels, ts, value)``, as in koordlet's metric cache: the metric
name says what is measured (and its unit), the labels say of what (a pod, a container,
a NUMA node...). Names are ours (``node_cpu_usage_cores``); the Prometheus reporter
maps them to koordlet's exported names. Units are SI base units (cores, bytes,
seconds), never milli, so no consumer has to guess.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple, Protocol, runtime_checkable

from hooks.qos import QoSClass

Labels = tuple[tuple[str, str], ...]
NO_LABELS: Final[Labels] = ()

# --- label keys (koordlet's property labels where one exists) ---------------------
POD_UID: Final = "pod_uid"
CONTAINER_ID: Final = "container_id"
NUMA_NODE: Final = "numa_node_id"
RESOURCE: Final = "resource"  # psi: cpu | memory | io
KIND: Final = "kind"  # psi: some | full; memory stalls: direct_reclaim | memcg_reclaim | compaction
WINDOW: Final = "window"  # psi: avg10 | avg60 | avg300
SOURCE: Final = "source"  # sched latency: ebpf | schedstat
HOST_APP_NAME: Final = "host_app_name"  # host applications (NodeSLO hostApplications[].name)
PRIORITY_CLASS: Final = "priority_class"  # host applications: their priority
QOS: Final = "qos"  # host applications: their QoS class

# --- node -------------------------------------------------------------------------
NODE_CPU_USAGE: Final = "node_cpu_usage_cores"
NODE_CPU_CAPACITY: Final = "node_cpu_capacity_cores"
NODE_MEMORY_USED: Final = "node_memory_used_bytes"  # MemTotal - MemAvailable
NODE_MEMORY_TOTAL: Final = "node_memory_total_bytes"
NUMA_CPU_USAGE: Final = "numa_cpu_usage_cores"  # {numa_node_id}
NUMA_MEMORY_USED: Final = "numa_memory_used_bytes"  # {numa_node_id}
SYSTEM_CPU_USAGE: Final = "system_cpu_usage_cores"  # max(node - sum(pods) - sum(host apps), 0)
SYSTEM_MEMORY_USED: Final = "system_memory_used_bytes"
#: Host applications (non-pod services named by the NodeSLO), {host_app_name, priority_class, qos}.
HOST_APP_CPU_USAGE: Final = "host_app_cpu_usage_cores"
HOST_APP_MEMORY_USED: Final = "host_app_memory_used_bytes"  # anon + unevictable

# --- pods / containers ({pod_uid} / {pod_uid, container_id}) --------------------------
POD_CPU_USAGE: Final = "pod_cpu_usage_cores"
POD_MEMORY_USED: Final = "pod_memory_used_bytes"  # anon + unevictable (no page cache)
POD_MEMORY_CACHE: Final = "pod_memory_cache_bytes"  # page cache, separately
POD_CPU_THROTTLED: Final = "pod_cpu_throttled_ratio"  # d(nr_throttled) / d(nr_periods)
CONTAINER_CPU_USAGE: Final = "container_cpu_usage_cores"
CONTAINER_MEMORY_USED: Final = "container_memory_used_bytes"
CONTAINER_MEMORY_CACHE: Final = "container_memory_cache_bytes"
CONTAINER_CPU_THROTTLED: Final = "container_cpu_throttled_ratio"
#: Mean run-queue wait per scheduling event over the interval, {pod_uid, container_id, source}.
CONTAINER_SCHED_LATENCY: Final = "container_sched_latency_seconds"
#: p99 of run-queue waits over the interval (eBPF histograms only).
CONTAINER_SCHED_LATENCY_P99: Final = "container_sched_latency_p99_seconds"
#: Memory allocation stalls (reclaim, compaction) per container, {pod_uid, container_id, kind, source}
#: (``metrics.collect.memlat``): seconds stalled per second of the interval, summed over the
#: container's tasks (eBPF; 0 when it did not stall) ...
CONTAINER_MEMORY_ALLOC_STALL: Final = "container_memory_alloc_stall_ratio"
#: ... stalls per second (eBPF; counters source: limit hits, kind=memcg_reclaim) ...
CONTAINER_MEMORY_ALLOC_STALLS: Final = "container_memory_alloc_stalls_per_second"
#: ... and, when it stalled, the mean and the p99 (log2 histogram) stall, in seconds.
CONTAINER_MEMORY_ALLOC_LATENCY: Final = "container_memory_alloc_latency_seconds"
CONTAINER_MEMORY_ALLOC_LATENCY_P99: Final = "container_memory_alloc_latency_p99_seconds"
#: Node-wide /proc/vmstat stall counters as rates (the counters source), {kind, source=vmstat}.
NODE_MEMORY_ALLOC_STALLS: Final = "node_memory_alloc_stalls_per_second"
NODE_MEMORY_RECLAIM_SCANNED: Final = "node_memory_direct_reclaim_scanned_pages_per_second"  # {source}
CONTAINER_CPI: Final = "container_cpi"  # cycles / instructions
CONTAINER_CYCLES: Final = "container_cycles"
CONTAINER_INSTRUCTIONS: Final = "container_instructions"

# --- resctrl monitoring ({cache_id} plus qos (class groups) or pod_uid; mb_type for bandwidth) ---
CACHE_ID: Final = "cache_id"  # the L3 domain of mon_data/mon_L3_<id>
MB_TYPE: Final = "mb_type"  # mbm_total_bytes | mbm_local_bytes
RESCTRL_LLC: Final = "resctrl_llc_occupancy_bytes"  # {qos, cache_id}
RESCTRL_MB: Final = "resctrl_memory_bandwidth_bytes_per_second"  # {qos, cache_id, mb_type}: counter rate
RESCTRL_MB_TOTAL: Final = "resctrl_memory_bandwidth_bytes_total"  # {qos, cache_id, mb_type}: the counter
POD_RESCTRL_LLC: Final = "pod_resctrl_llc_occupancy_bytes"
POD_RESCTRL_MB: Final = "pod_resctrl_memory_bandwidth_bytes_per_second"
POD_RESCTRL_MB_TOTAL: Final = "pod_resctrl_memory_bandwidth_bytes_total"

# --- PSI ({resource, kind, window} plus pod_uid / container_id for cgroups) ---------
#: Percentages for avg10/avg60/avg300; ``PSI_TOTAL`` is the stall time counter in seconds.
NODE_PSI: Final = "node_psi_percent"
POD_PSI: Final = "pod_psi_percent"
CONTAINER_PSI: Final = "container_psi_percent"
NODE_PSI_TOTAL: Final = "node_psi_total_seconds"
POD_PSI_TOTAL: Final = "pod_psi_total_seconds"
CONTAINER_PSI_TOTAL: Final = "container_psi_total_seconds"

# --- best-effort aggregate --------------------------------------------------------
BE_CPU_USAGE: Final = "be_cpu_usage_cores"
BE_CPU_REQUEST: Final = "be_cpu_request_cores"  # sum of batch-cpu requests
BE_CPU_LIMIT: Final = "be_cpu_real_limit_cores"  # min(|BE cpuset|, BE CFS quota / period)
#: Written by the QoS manager's suppress strategy after each applied decision (koordlet
#: records the same from its CPUSuppress): the BE limit it set, in cores, by policy.
BE_SUPPRESS_CPU: Final = "be_suppress_cpu_cores"  # {type: cpuset | cfsQuota}
BE_SUPPRESS_LS_USED_CPU: Final = "be_suppress_ls_used_cpu_cores"  # the formula's non-BE usage
BE_SUPPRESS_BE_USED_CPU: Final = "be_suppress_be_used_cpu_cores"  # pods' usage minus the non-BE part
SUPPRESS_TYPE: Final = "type"

# --- static records (key-value) ---------------------------------------------------
KV_NODE_CPU_INFO: Final = "node_cpu_info"
KV_POD_META: Final = "pod_meta"


class Sample(NamedTuple):
    """A tuple, not a dataclass: about a thousand are made every second, and a
    tuple is built (and unpacked by the store) at half the cost."""

    metric: str
    value: float
    labels: Labels = NO_LABELS
    #: Unix time in seconds; 0 means "stamp with the collection time".
    ts: float = 0.0


def labels(**kv: str) -> Labels:
    """Canonical (sorted) label tuple, so the same series always has the same key."""
    return tuple(sorted(kv.items()))


@dataclass(frozen=True, slots=True)
class Aggregate:
    """One series over a window. Percentiles as koordlet computes them: sort
    ascending, index ``int(n * p) - 1`` floored at 0."""

    count: int
    avg: float
    p50: float
    p90: float
    p95: float
    p99: float
    last: float
    first_ts: float
    last_ts: float

    def value(self, agg: str) -> float:
        if agg not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {agg!r} (one of {', '.join(AGGREGATIONS)})")
        return float(getattr(self, agg))

    @property
    def span(self) -> float:
        return self.last_ts - self.first_ts


AGGREGATIONS: Final = ("avg", "p50", "p90", "p95", "p99", "last", "count")


@dataclass(frozen=True, slots=True)
class Mean:
    """One series' count and mean over a window, as ``Aggregate``'s: what a report that
    only averages needs, read without holding the window's samples (a running sum)."""

    count: int
    avg: float
    first_ts: float
    last_ts: float

    def value(self, agg: str) -> float:
        if agg == "avg":
            return self.avg
        if agg == "count":
            return float(self.count)
        raise ValueError(f"a mean has only avg and count (asked for {agg!r})")

    @property
    def span(self) -> float:
        return self.last_ts - self.first_ts


class MetricReader(Protocol):
    """Read side of the time-series store (``metrics.store.tsdb.TSDB`` implements it)."""

    def aggregate(self, metric: str, labels: Labels, start: float, end: float) -> Aggregate | None:
        """The series ``(metric, labels)`` over ``[start, end]``; None without samples."""

    def aggregate_all(self, metric: str, start: float, end: float) -> Mapping[Labels, Aggregate]:
        """Every series of ``metric`` with samples in ``[start, end]``."""

    def aggregate_many(self, series: Iterable[tuple[str, Labels]], start: float, end: float
                       ) -> Mapping[tuple[str, Labels], Aggregate]:
        """Several series at once (cheaper than one ``aggregate`` each); absent: no samples."""

    def last(self, metric: str, labels: Labels, max_age: float, now: float) -> Sample | None:
        """The newest sample not older than ``max_age`` seconds before ``now``."""

    def get_kv(self, key: str) -> object | None:
        """A static record (JSON-decoded), None when absent."""


@runtime_checkable
class NewestView(Protocol):
    """The newest sample of every series a writer wrote, held in memory (the store's
    write path keeps it anyway): a round's inputs read from it, not from the file."""

    def newest_by_label(self, metric: str, key: str, start: float, end: float) -> dict[str, float] | None:
        """Label ``key``'s value -> the newest value of the series of ``metric`` whose
        newest sample is in ``[start, end]``; None: no such view (a read-only store)."""

    def average_by_label(self, metric: str, key: str, start: float, end: float) -> dict[str, float] | None:
        """Label ``key``'s value -> the mean of the series of ``metric`` over ``[start, end]``."""


@runtime_checkable
class MeanReads(Protocol):
    """A store that can average many series over a window without holding their samples
    (the NodeMetric report's pods: 220 series x 300 s at 110 pods, ~1 MiB as arrays)."""

    def means_many(self, series: Iterable[tuple[str, Labels]], start: float, end: float
                   ) -> Mapping[tuple[str, Labels], Mean]:
        """As ``aggregate_many``'s count, avg, first and last times; absent: no samples."""


class WindowAggregates(Protocol):
    """``aggregate_many`` of a fixed list of series, kept between calls."""

    def aggregate(self, start: float, end: float) -> Mapping[tuple[str, Labels], Aggregate]:
        """The series over ``[start, end]``, as ``aggregate_many`` would give them."""


@runtime_checkable
class WindowViews(Protocol):
    """A store that can keep a trailing window's samples between reads (a round reads
    the same window a second later; ``metrics.store.tsdbwindow``)."""

    def window_view(self, series: Sequence[tuple[str, Labels]]) -> WindowAggregates | None:
        """A view of ``series``; None when this store cannot keep one."""


class MetricWriter(Protocol):
    def write(self, samples: Sequence[Sample], now: float | None = None) -> None:
        """Append samples; ``ts == 0`` means ``now`` (default: the writer's clock)."""

    def put_kv(self, key: str, value: object) -> None:
        """Replace a static record (JSON-encodable)."""


@dataclass(frozen=True, slots=True)
class ContainerView:
    """A container as collectors and the QoS manager see it."""

    id: str
    name: str
    #: cgroup directory relative to a hierarchy root (driver applied).
    cgroup_dir: str
    cpu_quota: int = 0  # CRI value (µs per period), 0/-1 = unlimited
    cpu_period: int = 0
    batch_cpu_request_milli: int = 0
    batch_cpu_limit_milli: int = 0


@dataclass(frozen=True, slots=True)
class PodView:
    """A pod as collectors, reporters and the QoS manager see it."""

    uid: str
    namespace: str
    name: str
    sandbox_id: str
    qos: QoSClass
    #: Kubernetes priority value (from kubelet enrichment or the priority-class band default).
    priority: int
    priority_class: str
    cgroup_dir: str
    containers: tuple[ContainerView, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    batch_cpu_request_milli: int = 0
    batch_memory_request: int = 0
    #: Kubernetes QoS tier from the cgroup parent: guaranteed | burstable | besteffort | "".
    kube_qos: str = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"
