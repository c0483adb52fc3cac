"""Prometheus exposition under koordlet's names, the dashboard and the docs mapping."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hooks.qos import QoSClass
from metrics.model import (
    BE_CPU_LIMIT,
    CONTAINER_CYCLES,
    CONTAINER_ID,
    CONTAINER_INSTRUCTIONS,
    CONTAINER_PSI,
    CONTAINER_SCHED_LATENCY,
    KIND,
    NODE_CPU_USAGE,
    NODE_MEMORY_USED,
    POD_CPU_USAGE,
    POD_PSI,
    POD_UID,
    RESOURCE,
    SOURCE,
    WINDOW,
    ContainerView,
    PodView,
    Sample,
    labels,
)
from metrics.promexport import (
    BE_SUPPRESS_CPU,
    EXPORTS,
    EXTERNAL_METRICS,
    SUPPRESS_TYPE,
    LatestValues,
    StoreValues,
    exported_names,
    register_exporter,
)

ROOT = Path(__file__).resolve().parents[3]
WEB = PodView(uid="u-web", namespace="shop", name="web", sandbox_id="sb", qos=QoSClass.LS, priority=9500,
              priority_class="koord-prod", cgroup_dir="kubepods/podu-web",
              containers=(ContainerView(id="c1", name="nginx", cgroup_dir="kubepods/podu-web/c1"),))


Scrape = dict[str, list[tuple[dict[str, str], float]]]


def scrape(registry: CollectorRegistry) -> Scrape:
    out: Scrape = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


@pytest.fixture
def setup() -> tuple[CollectorRegistry, LatestValues, list[PodView]]:
    registry, latest, pods = CollectorRegistry(), LatestValues(clock=lambda: 1000.0), [WEB]
    register_exporter(registry, latest, lambda: pods, "node-a")
    return registry, latest, pods


def test_node_series_under_koordlet_names(setup: tuple[CollectorRegistry, LatestValues, list[PodView]]) -> None:
    registry, latest, _ = setup
    latest.update([Sample(NODE_CPU_USAGE, 1.5, ts=10), Sample(NODE_MEMORY_USED, 2048.0, ts=10),
                   Sample(NODE_CPU_USAGE, 9.0, ts=5)])  # older: ignored
    got = scrape(registry)
    assert got["koordlet_node_used_cpu_cores"] == [({"node": "node-a"}, 1.5)]
    assert got["koordlet_node_used_memory_bytes"] == [({"node": "node-a"}, 2048.0)]


def test_pod_and_container_labels(setup: tuple[CollectorRegistry, LatestValues, list[PodView]]) -> None:
    registry, latest, _ = setup
    latest.update([
        Sample(POD_CPU_USAGE, 0.75, labels(**{POD_UID: "u-web"})),
        Sample(POD_CPU_USAGE, 3.0, labels(**{POD_UID: "u-unknown"})),  # not in the pod views: not exported
        Sample(CONTAINER_SCHED_LATENCY, 0.002, labels(**{POD_UID: "u-web", CONTAINER_ID: "c1", SOURCE: "ebpf"})),
        Sample(CONTAINER_CYCLES, 3e9, labels(**{POD_UID: "u-web", CONTAINER_ID: "c1"})),
        Sample(CONTAINER_INSTRUCTIONS, 2e9, labels(**{POD_UID: "u-web", CONTAINER_ID: "c1"})),
    ])
    got = scrape(registry)
    pod_labels = {"node": "node-a", "pod_uid": "u-web", "pod_name": "web", "pod_namespace": "shop"}
    assert got["koord_runtime_proxy_pod_cpu_usage_cores"] == [(pod_labels, 0.75)]
    container = {**pod_labels, "container_id": "c1", "container_name": "nginx"}
    assert got["koord_runtime_proxy_container_sched_latency_seconds"] == [({**container, "source": "ebpf"}, 0.002)]
    cpi = sorted(got["koordlet_container_cpi"], key=lambda s: s[0]["cpi_field"])
    assert cpi == [({**container, "cpi_field": "cycles"}, 3e9), ({**container, "cpi_field": "instructions"}, 2e9)]


def test_psi_uses_koordlet_labels(setup: tuple[CollectorRegistry, LatestValues, list[PodView]]) -> None:
    registry, latest, _ = setup
    pod = {POD_UID: "u-web"}
    latest.update([
        Sample(POD_PSI, 12.5, labels(**pod, **{RESOURCE: "memory", KIND: "some", WINDOW: "avg10"})),
        Sample(POD_PSI, 4.0, labels(**pod, **{RESOURCE: "memory", KIND: "full", WINDOW: "avg10"})),
        Sample(POD_PSI, 1.0, labels(**pod, **{RESOURCE: "cpu", KIND: "some", WINDOW: "avg60"})),
        Sample(CONTAINER_PSI, 2.0, labels(**pod, **{CONTAINER_ID: "c1", RESOURCE: "io", KIND: "some",
                                                    WINDOW: "avg300"})),
    ])
    got = scrape(registry)
    rows = {(lb["psi_resource_type"], lb["psi_degree"], lb["psi_precision"]): (lb["cpu_full_supported"], v)
            for lb, v in got["koordlet_pod_psi"]}
    assert rows == {("mem", "some", "avg10"): ("true", 12.5), ("mem", "full", "avg10"): ("true", 4.0),
                    ("cpu", "some", "avg60"): ("false", 1.0)}
    [(lb, value)] = got["koordlet_container_psi"]
    assert (lb["container_name"], lb["psi_resource_type"], lb["psi_precision"], value) == ("nginx", "io", "avg300", 2.0)


def test_be_and_suppress_series(setup: tuple[CollectorRegistry, LatestValues, list[PodView]]) -> None:
    registry, latest, _ = setup
    latest.update([Sample(BE_CPU_LIMIT, 3.0), Sample(BE_SUPPRESS_CPU, 4.0, labels(**{SUPPRESS_TYPE: "cpuset"}))])
    got = scrape(registry)
    assert got["koord_runtime_proxy_be_cpu_real_limit_cores"] == [({"node": "node-a"}, 3.0)]
    assert got["koordlet_be_suppress_cpu_cores"] == [({"node": "node-a", "type": "cpuset"}, 4.0)]


def test_forget_dead_pods_and_bad_values(setup: tuple[CollectorRegistry, LatestValues, list[PodView]]) -> None:
    registry, latest, _ = setup
    latest.update([Sample(POD_CPU_USAGE, 0.5, labels(**{POD_UID: "u-web"})), Sample(NODE_CPU_USAGE, 2.0),
                   Sample(NODE_MEMORY_USED, math.nan), Sample("not_exported_metric", 1.0)])
    assert len(latest.snapshot()) == 2
    latest.forget(set())
    assert [m for m, _, _ in latest.snapshot()] == [NODE_CPU_USAGE]
    got = scrape(registry)
    assert "koord_runtime_proxy_pod_cpu_usage_cores" not in got
    assert "koordlet_node_used_memory_bytes" not in got


def test_names_clash_is_refused() -> None:
    registry = CollectorRegistry()
    Counter("koordlet_node_used_cpu_cores", "clash", registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        register_exporter(registry, LatestValues(), lambda: [], "n")


def test_export_table_is_consistent() -> None:
    by_name: dict[str, tuple[str, ...]] = {}
    for e in EXPORTS:
        assert e.name.startswith(("koordlet_", "koord_runtime_proxy_")), e.name
        # One family, one label set, even when two of our series share it (cpi cycles/instructions).
        assert by_name.setdefault(e.name, e.label_names) == e.label_names
    assert len({e.metric for e in EXPORTS}) == len(EXPORTS)
    assert not EXTERNAL_METRICS & exported_names()


def _exprs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k in ("expr", "definition") and isinstance(v, str)]
        if isinstance(node.get("query"), str) and node.get("type") == "query":
            found.append(node["query"])
        return found + [e for v in node.values() for e in _exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in _exprs(v)]
    return []


def test_dashboard_references_only_exported_metrics() -> None:
    dashboard = json.loads((ROOT / "dashboards" / "koord-runtime-proxy.json").read_text())
    exprs = _exprs(dashboard)
    assert len(exprs) >= 10
    known = exported_names() | EXTERNAL_METRICS
    used: set[str] = set()
    for expr in exprs:
        names = set(re.findall(r"\b(?:koordlet|koord_runtime_proxy)_[a-z0-9_]+", expr))
        assert names, f"expression uses no exported metric: {expr}"
        assert names <= known, f"unknown metric in {expr}: {names - known}"
        used |= names
    for wanted in ("koordlet_node_used_cpu_cores", "koordlet_pod_psi", "koordlet_pod_eviction_total",
                   "koord_runtime_proxy_be_cpu_real_limit_cores",
                   "koord_runtime_proxy_container_sched_latency_seconds"):
        assert wanted in used
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_docs_map_every_export() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    for e in EXPORTS:
        assert f"`{e.metric}`" in doc and f"`{e.name}`" in doc, e.metric


def test_the_store_as_source_scrapes_like_pushed_values(tmp_path: Path) -> None:
    """The agent's exporter reads the store's newest values: the same scrape as values
    pushed into LatestValues, without metrics the exporter does not know."""
    from metrics.tsdb import TSDB

    samples = [
        Sample(NODE_CPU_USAGE, 9.0, ts=5), Sample(NODE_CPU_USAGE, 1.5, ts=10), Sample(NODE_MEMORY_USED, 2048.0, ts=10),
        Sample(POD_CPU_USAGE, 0.75, labels(**{POD_UID: "u-web"}), ts=10),
        Sample(CONTAINER_SCHED_LATENCY, 0.002, labels(**{POD_UID: "u-web", CONTAINER_ID: "c1", SOURCE: "ebpf"}), ts=10),
        Sample("not_exported_anywhere", 1.0, ts=10),
    ]
    pushed, stored = CollectorRegistry(), CollectorRegistry()
    latest = LatestValues(clock=lambda: 1000.0)
    latest.update(samples)
    register_exporter(pushed, latest, lambda: [WEB], "node-a")
    with TSDB(tmp_path / "m.db", clock=lambda: 1000.0) as db:
        db.write(samples)
        register_exporter(stored, StoreValues(db.newest_values), lambda: [WEB], "node-a")
        got = scrape(stored)
        assert got == scrape(pushed)
        assert got["koordlet_node_used_cpu_cores"] == [({"node": "node-a"}, 1.5)]
        assert ("not_exported_anywhere", (), 1.0) in db.newest_values()
