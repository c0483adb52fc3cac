"""NodeMetric status built from a real TSDB filled with known samples."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hooks.qos import QoSClass
from metrics.model import (
    NODE_CPU_USAGE,
    NODE_MEMORY_USED,
    NUMA_CPU_USAGE,
    NUMA_MEMORY_USED,
    NUMA_NODE,
    POD_CPU_USAGE,
    POD_MEMORY_CACHE,
    POD_MEMORY_USED,
    POD_UID,
    SYSTEM_CPU_USAGE,
    SYSTEM_MEMORY_USED,
    PodView,
    Sample,
    labels,
)
from metrics.report.nodemetric import (
    CollectPolicy,
    NodeMetricSpecError,
    build_status,
    format_go_duration,
    parse_go_duration,
)
from metrics.store.tsdb import TSDB

NOW = 1_700_000_000.0
MIB = 1024 * 1024
GIB = 1024 * MIB

# The CRD's field tree (slo.koordinator.sh/v1alpha1 NodeMetricStatus); a list holds its item's tree.
RESOURCE_MAP: dict[str, Any] = {"resources": {"cpu": str, "memory": str}, "devices": list}
AGGREGATED: dict[str, Any] = {"duration": str, "usage": {k: RESOURCE_MAP for k in ("avg", "p50", "p90", "p95", "p99")}}
STATUS_TREE: dict[str, Any] = {
    "updateTime": str,
    "nodeMetric": {
        "nodeUsage": RESOURCE_MAP,
        "aggregatedNodeUsages": [AGGREGATED],
        "systemUsage": RESOURCE_MAP,
        "aggregatedSystemUsages": [AGGREGATED],
        "numaUsages": [{"numaNodeID": int, "nodeUsage": RESOURCE_MAP, "systemUsage": RESOURCE_MAP}],
    },
    "podsMetric": [{"name": str, "namespace": str, "podUsage": RESOURCE_MAP, "priority": str, "qos": str,
                    "extensions": dict}],
    "hostApplicationMetric": [{"name": str, "usage": RESOURCE_MAP, "priority": str, "qos": str}],
    "prodReclaimableMetric": {"resource": RESOURCE_MAP},
    "prodPeakMetric": {"resource": RESOURCE_MAP},
}


def check_fields(doc: object, tree: object, path: str = "status") -> None:
    if isinstance(tree, dict):
        assert isinstance(doc, dict), path
        for key, value in doc.items():
            assert key in tree, f"{path}.{key} is not a NodeMetric CRD field"
            check_fields(value, tree[key], f"{path}.{key}")
    elif isinstance(tree, list):
        assert isinstance(doc, list), path
        for i, item in enumerate(doc):
            check_fields(item, tree[0], f"{path}[{i}]")
    else:
        assert isinstance(tree, type)
        assert isinstance(doc, tree), f"{path}: {doc!r} is not {tree.__name__}"


def pod(uid: str, ns: str, name: str, qos: QoSClass, pclass: str) -> PodView:
    return PodView(uid=uid, namespace=ns, name=name, sandbox_id="sb-" + uid, qos=qos, priority=0,
                   priority_class=pclass, cgroup_dir=f"kubepods/pod{uid}")


WEB = pod("uid-web", "b-ns", "web", QoSClass.LS, "koord-prod")
BATCH = pod("uid-batch", "a-ns", "batch", QoSClass.BE, "koord-batch")
IDLE = pod("uid-idle", "c-ns", "idle", QoSClass.LS, "koord-prod")  # no samples at all

# Node cpu over the last 700 s, one sample per second at half seconds (never on a window edge):
# the last 300 s cycle through 1.00 .. 1.99, older ones are 3.0.
NODE_CPU = [(NOW - 0.5 - k, 1.0 + (k % 100) / 100 if k < 300 else 3.0) for k in range(700)]


def series(metric: str, value: float, seconds: int, **lbls: str) -> Iterator[Sample]:
    for k in range(seconds):
        yield Sample(metric, value, labels(**lbls), NOW - 0.5 - k)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TSDB]:
    db = TSDB(tmp_path / "metrics.db", clock=lambda: NOW)
    samples = [Sample(NODE_CPU_USAGE, v, (), ts) for ts, v in NODE_CPU]
    samples += series(NODE_MEMORY_USED, 4 * GIB, 700)
    samples += series(SYSTEM_CPU_USAGE, 0.25, 400)
    samples += series(SYSTEM_MEMORY_USED, 512 * MIB, 400)
    samples += series(POD_CPU_USAGE, 0.5, 300, **{POD_UID: WEB.uid})
    samples += series(POD_MEMORY_USED, 100 * MIB, 300, **{POD_UID: WEB.uid})
    samples += series(POD_MEMORY_CACHE, 50 * MIB, 300, **{POD_UID: WEB.uid})
    samples += series(POD_CPU_USAGE, 1.25, 300, **{POD_UID: BATCH.uid})
    samples += series(POD_MEMORY_USED, 200 * MIB, 300, **{POD_UID: BATCH.uid})
    # A pod that is gone: its page cache must not count for the node.
    samples += series(POD_MEMORY_CACHE, 7 * GIB, 300, **{POD_UID: "uid-gone"})
    db.write(samples)
    db.flush()
    yield db
    db.close()


def koordlet_percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[max(int(len(ordered) * p) - 1, 0)]


def milli(cores: float) -> str:
    return f"{round(cores * 1000)}m"


def test_status_has_only_crd_fields_and_known_numbers(store: TSDB) -> None:
    status = build_status(store, [WEB, BATCH, IDLE], CollectPolicy(), NOW)
    check_fields(status, STATUS_TREE)
    assert status["updateTime"] == "2023-11-14T22:13:20Z"
    node = status["nodeMetric"]
    last300 = [v for ts, v in NODE_CPU if ts >= NOW - 300]
    assert len(last300) == 300
    assert node["nodeUsage"] == {"resources": {"cpu": "1495m", "memory": str(4 * GIB)}}
    assert milli(statistics.mean(last300)) == "1495m"
    assert node["systemUsage"] == {"resources": {"cpu": "250m", "memory": str(512 * MIB)}}


def test_numa_usages_per_numa_node_only_when_measured(store: TSDB) -> None:
    assert "numaUsages" not in build_status(store, [WEB], CollectPolicy(), NOW)["nodeMetric"]
    numa: list[Sample] = []
    numa += series(NUMA_CPU_USAGE, 0.75, 300, **{NUMA_NODE: "1"})
    numa += series(NUMA_MEMORY_USED, 3 * GIB, 300, **{NUMA_NODE: "1"})
    numa += series(NUMA_CPU_USAGE, 0.5, 300, **{NUMA_NODE: "0"})  # memory unreadable on node 0
    numa += series(NUMA_CPU_USAGE, 9.0, 300, **{NUMA_NODE: "x"})  # not an id: left out
    numa += series(NUMA_CPU_USAGE, 9.0, 10, **{NUMA_NODE: "2"})  # stale: before the 300 s window
    store.write([s._replace(ts=s.ts - 400) if dict(s.labels)[NUMA_NODE] == "2" else s for s in numa])
    store.flush()
    status = build_status(store, [WEB], CollectPolicy(), NOW)
    check_fields(status, STATUS_TREE)
    assert status["nodeMetric"]["numaUsages"] == [
        {"numaNodeID": 0, "nodeUsage": {"resources": {"cpu": "500m"}}},
        {"numaNodeID": 1, "nodeUsage": {"resources": {"cpu": "750m", "memory": str(3 * GIB)}}},
    ]


def test_aggregated_windows_and_cold_start(store: TSDB) -> None:
    node = build_status(store, [WEB, BATCH], CollectPolicy(), NOW)["nodeMetric"]
    # 700 s of node samples: 5m and 10m are warm, 30m (needs >= 900 s) is dropped.
    assert [a["duration"] for a in node["aggregatedNodeUsages"]] == ["5m0s", "10m0s"]
    five, ten = node["aggregatedNodeUsages"]
    last300 = [v for ts, v in NODE_CPU if ts >= NOW - 300]
    assert five["usage"]["p50"]["resources"]["cpu"] == "1490m"  # sorted[149] of 1.00..1.99 x3
    assert five["usage"]["p99"]["resources"]["cpu"] == "1980m"
    for stat, p in (("p50", 0.5), ("p90", 0.9), ("p95", 0.95), ("p99", 0.99)):
        assert five["usage"][stat]["resources"]["cpu"] == milli(koordlet_percentile(last300, p))
    last600 = [v for ts, v in NODE_CPU if ts >= NOW - 600]
    assert ten["usage"]["avg"]["resources"]["cpu"] == milli(statistics.mean(last600))
    assert ten["usage"]["p99"]["resources"]["cpu"] == "3000m"
    assert ten["usage"]["avg"]["resources"]["memory"] == str(4 * GIB)
    # System series cover 400 s: 5m (needs 150 s) and 10m (needs 300 s) are warm.
    assert [a["duration"] for a in node["aggregatedSystemUsages"]] == ["5m0s", "10m0s"]


def test_everything_cold_right_after_start(tmp_path: Path) -> None:
    with TSDB(tmp_path / "cold.db", clock=lambda: NOW) as db:
        db.write(list(series(NODE_CPU_USAGE, 1.0, 60)) + list(series(NODE_MEMORY_USED, GIB, 60)))
        db.flush()
        node = build_status(db, [], CollectPolicy(), NOW)["nodeMetric"]
    assert node["aggregatedNodeUsages"] == []
    assert node["nodeUsage"] == {"resources": {"cpu": "1000m", "memory": str(GIB)}}
    assert node["systemUsage"] == {"resources": {}}


def test_pods_sorted_with_priority_and_qos(store: TSDB) -> None:
    pods = build_status(store, [WEB, IDLE, BATCH], CollectPolicy(), NOW)["podsMetric"]
    assert pods == [
        {"name": "batch", "namespace": "a-ns", "priority": "koord-batch", "qos": "BE",
         "podUsage": {"resources": {"cpu": "1250m", "memory": str(200 * MIB)}}},
        {"name": "web", "namespace": "b-ns", "priority": "koord-prod", "qos": "LS",
         "podUsage": {"resources": {"cpu": "500m", "memory": "104857600"}}},
    ]


def test_memory_with_page_cache(store: TSDB) -> None:
    policy = CollectPolicy.from_spec({"metricCollectPolicy": {"nodeMemoryCollectPolicy": "usageWithPageCache"}})
    status = build_status(store, [WEB, BATCH], policy, NOW)
    web = next(p for p in status["podsMetric"] if p["name"] == "web")
    assert web["podUsage"]["resources"]["memory"] == str(150 * MIB)
    # Node = used + page cache of live pods (the gone pod's 7 GiB is not counted).
    assert status["nodeMetric"]["nodeUsage"]["resources"]["memory"] == str(4 * GIB + 50 * MIB)


def test_hot_page_cache_reports_without_page_cache(store: TSDB) -> None:
    policy = CollectPolicy.from_spec({"metricCollectPolicy": {"nodeMemoryCollectPolicy": "usageWithHotPageCache"}})
    status = build_status(store, [WEB], policy, NOW)
    assert status["nodeMetric"]["nodeUsage"]["resources"]["memory"] == str(4 * GIB)


def test_unclassed_pod_omits_priority_and_qos(store: TSDB) -> None:
    plain = pod(WEB.uid, "b-ns", "web", QoSClass.NONE, "")
    [entry] = build_status(store, [plain], CollectPolicy(), NOW)["podsMetric"]
    assert "priority" not in entry and "qos" not in entry


def test_policy_defaults_and_values() -> None:
    assert CollectPolicy.from_spec(None) == CollectPolicy(300, 60, (300, 600, 1800), "usageWithoutPageCache")
    assert CollectPolicy.from_spec({}) == CollectPolicy()
    policy = CollectPolicy.from_spec({"metricCollectPolicy": {
        "aggregateDurationSeconds": 120, "reportIntervalSeconds": 30,
        "nodeAggregatePolicy": {"durations": ["1m", "1h0m0s", "90s"]},
    }})
    assert policy == CollectPolicy(120, 30, (60, 3600, 90), "usageWithoutPageCache")


@pytest.mark.parametrize(("policy", "field", "value"), [
    ({"aggregateDurationSeconds": 59}, "aggregateDurationSeconds", "59"),
    ({"reportIntervalSeconds": 10}, "reportIntervalSeconds", "10"),
    ({"reportIntervalSeconds": "60"}, "reportIntervalSeconds", "'60'"),
    ({"aggregateDurationSeconds": True}, "aggregateDurationSeconds", "True"),
    ({"nodeAggregatePolicy": {"durations": ["5x"]}}, "nodeAggregatePolicy.durations", "'5x'"),
    ({"nodeAggregatePolicy": {"durations": []}}, "nodeAggregatePolicy.durations", "[]"),
    ({"nodeMemoryCollectPolicy": "all"}, "nodeMemoryCollectPolicy", "'all'"),
])
def test_policy_errors_name_field_and_value(policy: dict[str, Any], field: str, value: str) -> None:
    with pytest.raises(NodeMetricSpecError) as err:
        CollectPolicy.from_spec({"metricCollectPolicy": policy})
    assert f"metricCollectPolicy.{field}" in str(err.value)
    assert value in str(err.value)


@pytest.mark.parametrize(("text", "seconds"), [("5m0s", 300), ("5m", 300), ("1h30m", 5400), ("45s", 45),
                                               ("1h0m0s", 3600), ("1500ms", 1.5)])
def test_go_durations(text: str, seconds: float) -> None:
    assert parse_go_duration(text) == seconds


@pytest.mark.parametrize(("seconds", "text"), [(300, "5m0s"), (600, "10m0s"), (3600, "1h0m0s"), (90, "1m30s"),
                                               (45, "45s"), (5400, "1h30m0s")])
def test_go_duration_format(seconds: int, text: str) -> None:
    assert format_go_duration(seconds) == text
    assert parse_go_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5", "m", "5 m", "-5m", "5d"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_go_duration(text)


def nodemetric_errors(status: dict[str, Any]) -> list[str]:
    from tests.kubeapi import schema_errors

    return schema_errors("nodemetrics", {"apiVersion": "slo.koordinator.sh/v1alpha1", "kind": "NodeMetric",
                                         "metadata": {"name": "node-a"}, "status": status})


def test_every_status_built_validates_against_the_crd_schema(store: TSDB, tmp_path: Path) -> None:
    """The real CRD's openAPIV3Schema (../shared/reference/crds), by a schema validator."""
    numa = [*series(NUMA_CPU_USAGE, 0.75, 300, **{NUMA_NODE: "1"}),
            *series(NUMA_MEMORY_USED, GIB, 300, **{NUMA_NODE: "1"})]
    store.write(numa)
    store.flush()
    plain = pod("uid-plain", "ns", "plain", QoSClass.NONE, "")
    policies = [CollectPolicy(), CollectPolicy.from_spec({"metricCollectPolicy": {
        "nodeMemoryCollectPolicy": "usageWithPageCache", "aggregateDurationSeconds": 120,
        "nodeAggregatePolicy": {"durations": ["5m", "10m", "30m"]}}})]
    for policy in policies:
        status = build_status(store, [WEB, BATCH, IDLE, plain], policy, NOW)
        assert status["podsMetric"] and status["nodeMetric"]["numaUsages"]
        assert nodemetric_errors(status) == []
    with TSDB(tmp_path / "empty.db", clock=lambda: NOW) as db:
        assert nodemetric_errors(build_status(db, [], CollectPolicy(), NOW)) == []
    # The validator is not a rubber stamp: a wrong type and an unknown field are caught.
    status = build_status(store, [WEB], CollectPolicy(), NOW)
    status["nodeMetric"]["numaUsages"][0]["numaNodeID"] = "1"
    status["podsMetric"][0]["cpuUsage"] = "1"
    errors = nodemetric_errors(status)
    assert any("numaNodeID" in e and "integer" in e for e in errors), errors
    assert any("cpuUsage" in e for e in errors), errors
