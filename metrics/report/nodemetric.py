"""The NodeMetric status document (slo.koordinator.sh/v1alpha1), built from the store.

slo-controller computes batch/mid resources from this document, so the field names
are exactly the CRD's (camelCase) and quantities are Kubernetes quantity strings:
cpu in milli-cores (``"1500m"``), memory in bytes (``"104857600"``).

Memory follows ``nodeMemoryCollectPolicy``:

- ``usageWithoutPageCache`` (default): node = ``NODE_MEMORY_USED`` (MemTotal -
  MemAvailable), pods = ``POD_MEMORY_USED`` (anon + unevictable);
- ``usageWithPageCache``: the same plus page cache where we measure it: pods add
  ``POD_MEMORY_CACHE``, the node adds the sum of its pods' page cache (there is no
  node-wide page-cache series; page cache outside pods is not added);
- ``usageWithHotPageCache``: needs kidled's cold-page data, which no collector
  provides; reported like ``usageWithoutPageCache`` (the reporter logs it once).

``hostApplicationMetric`` lists each host application (NodeSLO ``hostApplications``,
``metrics.collect.hostapp``) with samples in the window; ``systemUsage`` excludes them.
``prodReclaimableMetric`` / ``prodPeakMetric`` come from the peak predictor
(``metrics.analysis.prediction``) and are left out until it has a system model.

Summed statistics (used + cache) add the same statistic of each series (e.g. p90 +
p90): an upper bound of the percentile of the sum, never an under-estimate.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from metrics.analysis.prediction import Reclaimable
from metrics.model import (
    HOST_APP_CPU_USAGE,
    HOST_APP_MEMORY_USED,
    HOST_APP_NAME,
    NO_LABELS,
    NODE_CPU_USAGE,
    NODE_MEMORY_USED,
    NUMA_CPU_USAGE,
    NUMA_MEMORY_USED,
    NUMA_NODE,
    POD_CPU_USAGE,
    POD_MEMORY_CACHE,
    POD_MEMORY_USED,
    POD_UID,
    PRIORITY_CLASS,
    QOS,
    SYSTEM_CPU_USAGE,
    SYSTEM_MEMORY_USED,
    Aggregate,
    Labels,
    Mean,
    MeanReads,
    MetricReader,
    PodView,
    labels,
)
from runtimeproxy.errors import InputError

WITHOUT_PAGE_CACHE: Final = "usageWithoutPageCache"
WITH_PAGE_CACHE: Final = "usageWithPageCache"
WITH_HOT_PAGE_CACHE: Final = "usageWithHotPageCache"
MEMORY_POLICIES: Final = (WITHOUT_PAGE_CACHE, WITH_PAGE_CACHE, WITH_HOT_PAGE_CACHE)
PERCENTILES: Final = ("avg", "p50", "p90", "p95", "p99")
#: Aggregated windows with samples over less than this share of the window are dropped (cold start).
COLD_START_SHARE: Final = 0.5
DEFAULT_DURATIONS: Final = (300, 600, 1800)
#: The node-wide series of every window (the aggregated ones read only these).
_NODE_SERIES: Final = tuple((m, NO_LABELS) for m in (NODE_CPU_USAGE, NODE_MEMORY_USED, SYSTEM_CPU_USAGE,
                                                    SYSTEM_MEMORY_USED))


class NodeMetricSpecError(InputError, ValueError):
    """A NodeMetric spec field is invalid; the message names the field and value."""


# --- Go durations (metav1.Duration is a Go duration string on the wire) -----------------
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s)")
_UNIT_SECONDS: Final = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def parse_go_duration(text: str) -> float:
    """``"5m"``, ``"5m0s"``, ``"1h30m"``, ``"90s"`` -> seconds; ValueError otherwise."""
    if not text or _DURATION_PART.sub("", text) != "":
        raise ValueError(f"not a duration: {text!r} (e.g. 5m0s, 1h)")
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(text))


def format_go_duration(seconds: float) -> str:
    """Whole seconds as Go's ``time.Duration.String()``: 300 -> ``"5m0s"``, 3600 -> ``"1h0m0s"``."""
    total = int(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


# --- policy -------------------------------------------------------------------------------
def _int_field(policy: Mapping[str, Any], key: str, default: int, minimum: int) -> int:
    raw = policy.get(key)
    if raw is None:
        return default
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise NodeMetricSpecError(f"metricCollectPolicy.{key}: not an integer (got {raw!r})")
    if raw < minimum:
        raise NodeMetricSpecError(f"metricCollectPolicy.{key}: must be >= {minimum} (got {raw!r})")
    return raw


def _durations(policy: Mapping[str, Any]) -> tuple[int, ...]:
    where = "metricCollectPolicy.nodeAggregatePolicy.durations"
    node_policy = policy.get("nodeAggregatePolicy")
    if node_policy is None:
        return DEFAULT_DURATIONS
    if not isinstance(node_policy, Mapping):
        raise NodeMetricSpecError(f"metricCollectPolicy.nodeAggregatePolicy: not a mapping (got {node_policy!r})")
    raw = node_policy.get("durations")
    if raw is None:
        return DEFAULT_DURATIONS
    if not isinstance(raw, list) or not raw:
        raise NodeMetricSpecError(f"{where}: not a non-empty list of durations (got {raw!r})")
    out: list[int] = []
    for item in raw:
        try:
            seconds = parse_go_duration(item) if isinstance(item, str) else math.nan
        except ValueError:
            seconds = math.nan
        if not seconds >= 1:
            raise NodeMetricSpecError(f"{where}: not a duration of at least 1s (got {item!r})")
        out.append(int(seconds))
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True, slots=True)
class CollectPolicy:
    """``spec.metricCollectPolicy`` of the NodeMetric, with koordinator's defaults."""

    aggregate_duration: int = 300
    report_interval: int = 60
    durations: tuple[int, ...] = DEFAULT_DURATIONS
    memory_policy: str = WITHOUT_PAGE_CACHE

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any] | None) -> CollectPolicy:
        """From a NodeMetric ``spec`` (None or no policy -> defaults); NodeMetricSpecError."""
        policy = spec.get("metricCollectPolicy") if spec is not None else None
        if policy is None:
            return cls()
        if not isinstance(policy, Mapping):
            raise NodeMetricSpecError(f"metricCollectPolicy: not a mapping (got {policy!r})")
        memory = policy.get("nodeMemoryCollectPolicy") or WITHOUT_PAGE_CACHE
        if memory not in MEMORY_POLICIES:
            known = ", ".join(MEMORY_POLICIES)
            raise NodeMetricSpecError(
                f"metricCollectPolicy.nodeMemoryCollectPolicy: unknown (got {memory!r}; one of {known})"
            )
        return cls(
            aggregate_duration=_int_field(policy, "aggregateDurationSeconds", 300, 60),
            report_interval=_int_field(policy, "reportIntervalSeconds", 60, 30),
            durations=_durations(policy),
            memory_policy=str(memory),
        )


# --- building -----------------------------------------------------------------------------
def cpu_quantity(cores: float) -> str:
    return f"{round(max(cores, 0.0) * 1000)}m"


def memory_quantity(nbytes: float) -> str:
    return str(round(max(nbytes, 0.0)))


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass(frozen=True, slots=True)
class _Usage:
    """Aggregates making up one resource: the summed series (e.g. used + page caches)."""

    parts: tuple[Aggregate | Mean, ...]

    def stat(self, name: str) -> float | None:
        if not self.parts:
            return None
        return _finite(sum(part.value(name) for part in self.parts))


def _resources(cpu: _Usage | None, memory: _Usage | None, stat: str) -> dict[str, str]:
    out: dict[str, str] = {}
    value = cpu.stat(stat) if cpu is not None else None
    if value is not None:
        out["cpu"] = cpu_quantity(value)
    value = memory.stat(stat) if memory is not None else None
    if value is not None:
        out["memory"] = memory_quantity(value)
    return out


class _Window:
    """Reads over ``[now - duration, now]`` with the policy's memory rule."""

    def __init__(self, reader: MetricReader, policy: CollectPolicy, pods: Sequence[PodView], now: float, span: float,
                 series: Sequence[tuple[str, Labels]], means: Sequence[tuple[str, Labels]] = ()):
        """``series``: everything ``one`` will be asked for, read in one pass (a read per
        series would scan the store's newest rows once per pod); ``means``: series only
        averaged (the pods'), summed while read where the store can (``MeanReads``), so
        no pod's window is held as samples (~1 MiB at 110 pods, issue 29's peak RSS)."""
        self.reader, self.policy, self.pods = reader, policy, pods
        self.start, self.end = now - span, now
        self._caches: Mapping[Labels, Aggregate] | None = None
        self._aggs: Mapping[tuple[str, Labels], Aggregate | Mean] = reader.aggregate_many(series, self.start,
                                                                                          self.end)
        if means:
            read = reader.means_many if isinstance(reader, MeanReads) else reader.aggregate_many
            self._aggs = {**self._aggs, **read(means, self.start, self.end)}

    def one(self, metric: str, series: Labels = NO_LABELS) -> _Usage | None:
        agg = self._aggs.get((metric, series))
        return None if agg is None or agg.count == 0 else _Usage((agg,))

    def pod_caches(self) -> Mapping[Labels, Aggregate]:
        if self._caches is None:
            self._caches = self.reader.aggregate_all(POD_MEMORY_CACHE, self.start, self.end)
        return self._caches

    def with_cache(self, used: _Usage | None, caches: Sequence[Aggregate]) -> _Usage | None:
        if used is None or self.policy.memory_policy != WITH_PAGE_CACHE:
            return used
        return _Usage(used.parts + tuple(caches))

    def node_memory(self) -> _Usage | None:
        used = self.one(NODE_MEMORY_USED)
        if used is None or self.policy.memory_policy != WITH_PAGE_CACHE:
            return used
        live = {labels(**{POD_UID: p.uid}) for p in self.pods}
        return self.with_cache(used, [agg for key, agg in self.pod_caches().items() if key in live])

    def pod_memory(self, uid: str) -> _Usage | None:
        key = labels(**{POD_UID: uid})
        cache = self.pod_caches().get(key) if self.policy.memory_policy == WITH_PAGE_CACHE else None
        return self.with_cache(self.one(POD_MEMORY_USED, key), [cache] if cache is not None else [])


def _resource_map(resources: Mapping[str, str]) -> dict[str, Any]:
    return {"resources": dict(resources)}


def _duration_windows(reader: MetricReader, pods: Sequence[PodView], policy: CollectPolicy, now: float,
                      main: _Window) -> dict[int, _Window]:
    """A window per aggregated duration, each reading the node and system series in one
    pass (a read for the node's and another for the system's scanned the store twice).
    The main window's duration (300 s by default) is the main window itself: it read
    those series over the same span already, and it keeps the pods' page caches (with
    ``usageWithPageCache``, an ``aggregate_all`` of every pod's series) for both."""
    return {duration: main if duration == policy.aggregate_duration
            else _Window(reader, policy, pods, now, duration, _NODE_SERIES)
            for duration in policy.durations}


def _aggregated(windows: Mapping[int, _Window], cpu_metric: str, mem_metric: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for duration, window in windows.items():
        cpu = window.one(cpu_metric)
        memory = window.node_memory() if mem_metric == NODE_MEMORY_USED else window.one(mem_metric)
        if cpu is None or memory is None or _cold(cpu, duration) or _cold(memory, duration):
            continue
        usage = {stat: _resource_map(_resources(cpu, memory, stat)) for stat in PERCENTILES}
        out.append({"duration": format_go_duration(duration), "usage": usage})
    return out


def _cold(usage: _Usage, duration: float) -> bool:
    return usage.parts[0].span < COLD_START_SHARE * duration


def _pod_entry(window: _Window, pod: PodView) -> dict[str, Any] | None:
    cpu = window.one(POD_CPU_USAGE, labels(**{POD_UID: pod.uid}))
    resources = _resources(cpu, window.pod_memory(pod.uid), "avg")
    if not resources:
        return None
    entry: dict[str, Any] = {"name": pod.name, "namespace": pod.namespace, "podUsage": _resource_map(resources)}
    # omitempty, as the Go types: an unclassed pod has no priority / qos field.
    if pod.priority_class:
        entry["priority"] = pod.priority_class
    if pod.qos.value:
        entry["qos"] = pod.qos.value
    return entry


def _numa_usages(window: _Window) -> list[dict[str, Any]]:
    """``numaUsages``: each NUMA node's usage (avg over the window). ``systemUsage`` per
    NUMA node is left out: pod usage is not split by NUMA node here."""
    cpu = window.reader.aggregate_all(NUMA_CPU_USAGE, window.start, window.end)
    memory = window.reader.aggregate_all(NUMA_MEMORY_USED, window.start, window.end)
    by_id: dict[int, tuple[_Usage | None, _Usage | None]] = {}
    for key in cpu.keys() | memory.keys():
        raw = dict(key).get(NUMA_NODE, "")
        if not (raw.isascii() and raw.isdigit()):
            continue  # not written by our collector; the CRD's id is an integer
        c, m = cpu.get(key), memory.get(key)
        by_id[int(raw)] = (_Usage((c,)) if c is not None else None, _Usage((m,)) if m is not None else None)
    out: list[dict[str, Any]] = []
    for numa_id in sorted(by_id):
        resources = _resources(*by_id[numa_id], "avg")
        if resources:
            out.append({"numaNodeID": numa_id, "nodeUsage": _resource_map(resources)})
    return out


def _host_applications(window: _Window) -> list[dict[str, Any]]:
    """``hostApplicationMetric``: each host application's usage (avg over the window)."""
    cpu = window.reader.aggregate_all(HOST_APP_CPU_USAGE, window.start, window.end)
    memory = window.reader.aggregate_all(HOST_APP_MEMORY_USED, window.start, window.end)
    out: list[dict[str, Any]] = []
    for key in sorted(cpu.keys() | memory.keys()):
        lbl = dict(key)
        c, m = cpu.get(key), memory.get(key)
        resources = _resources(_Usage((c,)) if c is not None else None, _Usage((m,)) if m is not None else None,
                               "avg")
        if not resources or not lbl.get(HOST_APP_NAME):
            continue
        entry: dict[str, Any] = {"name": lbl[HOST_APP_NAME], "usage": _resource_map(resources)}
        if lbl.get(PRIORITY_CLASS):  # omitempty, as the Go type
            entry["priority"] = lbl[PRIORITY_CLASS]
        if lbl.get(QOS):
            entry["qos"] = lbl[QOS]
        out.append(entry)
    return out


def prediction_fields(result: Reclaimable | None) -> dict[str, Any]:
    """``prodReclaimableMetric`` and ``prodPeakMetric`` (none without a prediction)."""
    if result is None:
        return {}

    def metric(value: tuple[float, float]) -> dict[str, Any]:
        return {"resource": _resource_map({"cpu": cpu_quantity(value[0]), "memory": memory_quantity(value[1])})}

    return {"prodReclaimableMetric": metric(result.reclaimable), "prodPeakMetric": metric(result.peak)}


#: What this agent writes in the status. The report goes out as a JSON merge patch, which
#: keeps every key it does not name: a field left out this time (no prediction yet after a
#: restart, no host applications any more, no NUMA samples, a resource without samples)
#: is sent as null, so the stored status is the one built, as koordlet's UpdateStatus
#: (which replaces the whole status) leaves it. Nothing stale stays for koord-manager.
_STATUS_KEYS: Final = ("updateTime", "nodeMetric", "podsMetric", "hostApplicationMetric", "prodReclaimableMetric",
                       "prodPeakMetric")
_NODE_METRIC_KEYS: Final = ("nodeUsage", "aggregatedNodeUsages", "systemUsage", "aggregatedSystemUsages",
                            "numaUsages")
_RESOURCE_NAMES: Final = ("cpu", "memory")


def _replacing_map(resource_map: Any) -> Any:
    """A ResourceMap whose absent resources are null (removed by the merge patch)."""
    if not isinstance(resource_map, Mapping):
        return resource_map
    resources = resource_map.get("resources")
    resources = resources if isinstance(resources, Mapping) else {}
    return {**resource_map, "resources": {**dict.fromkeys(_RESOURCE_NAMES), **resources}}


def status_merge_patch(status: Mapping[str, Any]) -> dict[str, Any]:
    """``status`` as a merge patch that leaves the stored status equal to it."""
    out: dict[str, Any] = {key: status.get(key) for key in _STATUS_KEYS}
    out.update({k: v for k, v in status.items() if k not in out})
    node_metric = status.get("nodeMetric")
    if isinstance(node_metric, Mapping):
        patched = {key: node_metric.get(key) for key in _NODE_METRIC_KEYS}
        patched.update({k: v for k, v in node_metric.items() if k not in patched})
        for key in ("nodeUsage", "systemUsage"):
            patched[key] = _replacing_map(patched[key])
        out["nodeMetric"] = patched
    for key in ("prodReclaimableMetric", "prodPeakMetric"):
        metric = out[key]
        if isinstance(metric, Mapping):
            out[key] = {**metric, "resource": _replacing_map(metric.get("resource"))}
    return out


def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_status(reader: MetricReader, pods: Sequence[PodView], policy: CollectPolicy, now: float,
                 prediction: Reclaimable | None = None) -> dict[str, Any]:
    """The NodeMetric ``status``: usage averaged over ``aggregate_duration`` (node,
    system, each NUMA node, each host application), the aggregated windows (dropped
    while cold), every pod with samples, and the Prod prediction when there is one."""
    pod_series = [(m, labels(**{POD_UID: p.uid})) for p in pods for m in (POD_CPU_USAGE, POD_MEMORY_USED)]
    window = _Window(reader, policy, pods, now, policy.aggregate_duration, _NODE_SERIES, pod_series)
    windows = _duration_windows(reader, pods, policy, now, window)
    node_usage = _resources(window.one(NODE_CPU_USAGE), window.node_memory(), "avg")
    system_usage = _resources(window.one(SYSTEM_CPU_USAGE), window.one(SYSTEM_MEMORY_USED), "avg")
    pods_metric = [e for e in (_pod_entry(window, p) for p in pods) if e is not None]
    pods_metric.sort(key=lambda e: (e["namespace"], e["name"]))
    node_metric: dict[str, Any] = {
        "nodeUsage": _resource_map(node_usage),
        "aggregatedNodeUsages": _aggregated(windows, NODE_CPU_USAGE, NODE_MEMORY_USED),
        "systemUsage": _resource_map(system_usage),
        "aggregatedSystemUsages": _aggregated(windows, SYSTEM_CPU_USAGE, SYSTEM_MEMORY_USED),
    }
    numa = _numa_usages(window)
    if numa:  # omitempty, as the Go type
        node_metric["numaUsages"] = numa
    status: dict[str, Any] = {"updateTime": rfc3339(now), "nodeMetric": node_metric, "podsMetric": pods_metric}
    host_apps = _host_applications(window)
    if host_apps:
        status["hostApplicationMetric"] = host_apps
    status.update(prediction_fields(prediction))
    return status
