"""Prometheus exposition under koordlet's names, the dashboard and the docs mapping."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hooks.qos import QoSClass
from metrics.model import (
    BE_CPU_LIMIT,
    BE_SUPPRESS_CPU,
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
    SUPPRESS_TYPE,
    WINDOW,
    ContainerView,
    PodView,
    Sample,
    labels,
)
from metrics.report.promexport import (
    EXPORTS,
    EXTERNAL_METRICS,
    Exporter,
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


@dataclass(frozen=True)
class Exposed:
    """A registry with the exporter's names reserved, and the exporter: what the
    core's ``/metrics`` serves is the registry's text followed by ``render()``."""

    registry: CollectorRegistry
    exporter: Exporter

    def text(self) -> str:
        return (generate_latest(self.registry) + self.exporter.render()).decode()


def expose(latest: LatestValues | StoreValues, pods: Callable[[], list[PodView]]) -> Exposed:
    registry = CollectorRegistry()
    return Exposed(registry, register_exporter(registry, latest, pods, "node-a"))


def scrape(exposed: Exposed) -> Scrape:
    out: Scrape = {}
    for family in text_string_to_metric_families(exposed.text()):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


@pytest.fixture
def setup() -> tuple[Exposed, LatestValues, list[PodView]]:
    latest, pods = LatestValues(clock=lambda: 1000.0), [WEB]
    return expose(latest, lambda: pods), latest, pods


def test_node_series_under_koordlet_names(setup: tuple[Exposed, LatestValues, list[PodView]]) -> None:
    exposed, latest, _ = setup
    latest.update([Sample(NODE_CPU_USAGE, 1.5, ts=10), Sample(NODE_MEMORY_USED, 2048.0, ts=10),
                   Sample(NODE_CPU_USAGE, 9.0, ts=5)])  # older: ignored
    got = scrape(exposed)
    assert got["koordlet_node_used_cpu_cores"] == [({"node": "node-a"}, 1.5)]
    assert got["koordlet_node_used_memory_bytes"] == [({"node": "node-a"}, 2048.0)]


def test_pod_and_container_labels(setup: tuple[Exposed, LatestValues, list[PodView]]) -> None:
    exposed, latest, _ = setup
    latest.update([
        Sample(POD_CPU_USAGE, 0.75, labels(**{POD_UID: "u-web"})),
        Sample(POD_CPU_USAGE, 3.0, labels(**{POD_UID: "u-unknown"})),  # not in the pod views: not exported
        Sample(CONTAINER_SCHED_LATENCY, 0.002, labels(**{POD_UID: "u-web", CONTAINER_ID: "c1", SOURCE: "ebpf"})),
        Sample(CONTAINER_CYCLES, 3e9, labels(**{POD_UID: "u-web", CONTAINER_ID: "c1"})),
        Sample(CONTAINER_INSTRUCTIONS, 2e9, labels(**{POD_UID: "u-web", CONTAINER_ID: "c1"})),
    ])
    got = scrape(exposed)
    pod_labels = {"node": "node-a", "pod_uid": "u-web", "pod_name": "web", "pod_namespace": "shop"}
    assert got["koord_runtime_proxy_pod_cpu_usage_cores"] == [(pod_labels, 0.75)]
    container = {**pod_labels, "container_id": "c1", "container_name": "nginx"}
    assert got["koord_runtime_proxy_container_sched_latency_seconds"] == [({**container, "source": "ebpf"}, 0.002)]
    cpi = sorted(got["koordlet_container_cpi"], key=lambda s: s[0]["cpi_field"])
    assert cpi == [({**container, "cpi_field": "cycles"}, 3e9), ({**container, "cpi_field": "instructions"}, 2e9)]


def test_psi_uses_koordlet_labels(setup: tuple[Exposed, LatestValues, list[PodView]]) -> None:
    exposed, latest, _ = setup
    pod = {POD_UID: "u-web"}
    latest.update([
        Sample(POD_PSI, 12.5, labels(**pod, **{RESOURCE: "memory", KIND: "some", WINDOW: "avg10"})),
        Sample(POD_PSI, 4.0, labels(**pod, **{RESOURCE: "memory", KIND: "full", WINDOW: "avg10"})),
        Sample(POD_PSI, 1.0, labels(**pod, **{RESOURCE: "cpu", KIND: "some", WINDOW: "avg60"})),
        Sample(CONTAINER_PSI, 2.0, labels(**pod, **{CONTAINER_ID: "c1", RESOURCE: "io", KIND: "some",
                                                    WINDOW: "avg300"})),
    ])
    got = scrape(exposed)
    rows = {(lb["psi_resource_type"], lb["psi_degree"], lb["psi_precision"]): (lb["cpu_full_supported"], v)
            for lb, v in got["koordlet_pod_psi"]}
    assert rows == {("mem", "some", "avg10"): ("true", 12.5), ("mem", "full", "avg10"): ("true", 4.0),
                    ("cpu", "some", "avg60"): ("false", 1.0)}
    [(lb, value)] = got["koordlet_container_psi"]
    assert (lb["container_name"], lb["psi_resource_type"], lb["psi_precision"], value) == ("nginx", "io", "avg300", 2.0)


def test_be_and_suppress_series(setup: tuple[Exposed, LatestValues, list[PodView]]) -> None:
    exposed, latest, _ = setup
    latest.update([Sample(BE_CPU_LIMIT, 3.0), Sample(BE_SUPPRESS_CPU, 4.0, labels(**{SUPPRESS_TYPE: "cpuset"}))])
    got = scrape(exposed)
    assert got["koord_runtime_proxy_be_cpu_real_limit_cores"] == [({"node": "node-a"}, 3.0)]
    assert got["koordlet_be_suppress_cpu_cores"] == [({"node": "node-a", "type": "cpuset"}, 4.0)]


def test_forget_dead_pods_and_bad_values(setup: tuple[Exposed, LatestValues, list[PodView]]) -> None:
    exposed, latest, _ = setup
    latest.update([Sample(POD_CPU_USAGE, 0.5, labels(**{POD_UID: "u-web"})), Sample(NODE_CPU_USAGE, 2.0),
                   Sample(NODE_MEMORY_USED, math.nan), Sample("not_exported_metric", 1.0)])
    assert len(latest.snapshot()) == 2
    latest.forget(set())
    assert [m for m, _, _ in latest.snapshot()] == [NODE_CPU_USAGE]
    got = scrape(exposed)
    assert "koord_runtime_proxy_pod_cpu_usage_cores" not in got
    assert "koordlet_node_used_memory_bytes" not in got


def test_names_clash_is_refused() -> None:
    registry = CollectorRegistry()
    Counter("koordlet_node_used_cpu_cores", "clash", registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        register_exporter(registry, LatestValues(), lambda: [], "n")
    # And the other way round: the exporter's names are reserved although it renders them itself.
    registry = CollectorRegistry()
    register_exporter(registry, LatestValues(), lambda: [], "n")
    with pytest.raises(ValueError, match="Duplicated"):
        Counter("koordlet_pod_psi", "clash", registry=registry)


class _Reference:
    """prometheus_client's own rendering of parsed families: the format we must match."""

    def __init__(self, text: str) -> None:
        self.families = list(text_string_to_metric_families(text))

    def collect(self) -> Iterator[Any]:
        yield from self.families


def test_render_matches_prometheus_client_byte_for_byte() -> None:
    """Escaping, label order, float formatting, HELP/TYPE once per family with its
    samples together (cpi's two series share one family), empty families included."""
    odd = replace(WEB, name='we"b\\x\ny', containers=(ContainerView(id="c1", name="ng inx", cgroup_dir="x"),))
    latest = LatestValues(clock=lambda: 1000.0)
    latest.update([
        Sample(NODE_CPU_USAGE, 1234567.0), Sample(NODE_MEMORY_USED, 1e20),
        Sample(POD_CPU_USAGE, 0.1, labels(**{POD_UID: "u-web"})),
        Sample(CONTAINER_CYCLES, 3e9, labels(**{POD_UID: "u-web", CONTAINER_ID: "c1"})),
        Sample(POD_PSI, 4.0, labels(**{POD_UID: "u-web", RESOURCE: "memory", KIND: "full", WINDOW: "avg10"})),
        Sample(CONTAINER_INSTRUCTIONS, 2e9, labels(**{POD_UID: "u-web", CONTAINER_ID: "c1"})),
        Sample(BE_CPU_LIMIT, -0.5),
    ])
    exposed = expose(latest, lambda: [odd])
    ours = exposed.exporter.render().decode()
    reference = CollectorRegistry()
    reference.register(_Reference(ours))
    assert ours == generate_latest(reference).decode()
    assert 'pod_name="we\\"b\\\\x\\ny"' in ours  # the odd name, escaped
    assert "koordlet_node_used_memory_bytes{node=\"node-a\"} 1e+20\n" in ours
    assert ours.count("# TYPE koordlet_container_cpi gauge") == 1
    assert len({e.name for e in EXPORTS}) == ours.count("# TYPE ")


def test_render_follows_pod_changes_and_forgets_series() -> None:
    """Labels follow a pod's new name and koordlet's cpu_full_supported as soon as the
    kernel gives a "full" line; series gone from the source leave the output."""
    pods, latest = [WEB], LatestValues(clock=lambda: 1000.0)
    exposed = expose(latest, lambda: pods)
    some = labels(**{POD_UID: "u-web", RESOURCE: "cpu", KIND: "some", WINDOW: "avg10"})
    latest.update([Sample(POD_PSI, 1.0, some), Sample(POD_CPU_USAGE, 0.5, labels(**{POD_UID: "u-web"}))])
    [(lb, _)] = scrape(exposed)["koordlet_pod_psi"]
    assert (lb["pod_name"], lb["cpu_full_supported"]) == ("web", "false")
    pods[0] = replace(WEB, name="web-2")
    latest.update([Sample(POD_PSI, 2.0, labels(**{POD_UID: "u-web", RESOURCE: "cpu", KIND: "full", WINDOW: "avg10"}))])
    got = scrape(exposed)
    assert {(lb["pod_name"], lb["psi_degree"], lb["cpu_full_supported"]) for lb, _ in got["koordlet_pod_psi"]} == {
        ("web-2", "some", "true"), ("web-2", "full", "true")}
    assert [lb["pod_name"] for lb, _ in got["koord_runtime_proxy_pod_cpu_usage_cores"]] == ["web-2"]
    latest.forget(set())
    pods.clear()
    got = scrape(exposed)
    assert "koordlet_pod_psi" not in got and "koord_runtime_proxy_pod_cpu_usage_cores" not in got


def test_export_table_is_consistent() -> None:
    by_name: dict[str, tuple[str, ...]] = {}
    for e in EXPORTS:
        assert e.name.startswith(("koordlet_", "koord_runtime_proxy_", "koordetector_")), e.name
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
    from metrics.store.tsdb import TSDB

    samples = [
        Sample(NODE_CPU_USAGE, 9.0, ts=5), Sample(NODE_CPU_USAGE, 1.5, ts=10), Sample(NODE_MEMORY_USED, 2048.0, ts=10),
        Sample(POD_CPU_USAGE, 0.75, labels(**{POD_UID: "u-web"}), ts=10),
        Sample(CONTAINER_SCHED_LATENCY, 0.002, labels(**{POD_UID: "u-web", CONTAINER_ID: "c1", SOURCE: "ebpf"}), ts=10),
        Sample("not_exported_anywhere", 1.0, ts=10),
    ]
    latest = LatestValues(clock=lambda: 1000.0)
    latest.update(samples)
    pushed = expose(latest, lambda: [WEB])
    with TSDB(tmp_path / "m.db", clock=lambda: 1000.0) as db:
        db.write(samples)
        stored = expose(StoreValues(db.newest_values), lambda: [WEB])
        got = scrape(stored)
        assert got == scrape(pushed)
        assert got["koordlet_node_used_cpu_cores"] == [({"node": "node-a"}, 1.5)]
        assert ("not_exported_anywhere", (), 1.0) in db.newest_values()
