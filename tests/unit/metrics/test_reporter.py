"""NodeMetricReporter without a cluster: builds from a real TSDB, serves the loopback route."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from hooks.qos import QoSClass
from metrics.model import NODE_CPU_USAGE, NODE_MEMORY_USED, POD_CPU_USAGE, POD_UID, PodView, Sample, labels
from metrics.report.nodemetric import CollectPolicy, build_status
from metrics.report.reporter import ROUTE_MAX_AGE, NodeMetricReporter
from metrics.store.tsdb import TSDB

NOW = 1_700_000_000.0
WEB = PodView(uid="u1", namespace="ns", name="web", sandbox_id="sb", qos=QoSClass.LS, priority=9500,
              priority_class="koord-prod", cgroup_dir="kubepods/podu1")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TSDB]:
    db = TSDB(tmp_path / "m.db", clock=lambda: NOW)
    db.write([Sample(NODE_CPU_USAGE, 2.0 + (k % 2), (), NOW - k) for k in range(120)]
             + [Sample(NODE_MEMORY_USED, 1e9, (), NOW - k) for k in range(120)]
             + [Sample(POD_CPU_USAGE, 0.5, labels(**{POD_UID: "u1"}), NOW - k) for k in range(120)])
    db.flush()
    yield db
    db.close()


@pytest.mark.asyncio
async def test_route_builds_on_first_request_and_serves_the_report(store: TSDB) -> None:
    clock = [NOW]
    reporter = NodeMetricReporter(store, lambda: [WEB], None, None, clock=lambda: clock[0])
    status, ctype, body = await reporter.route({})
    assert (status, ctype) == (200, "application/json")
    assert json.loads(body) == build_status(store, [WEB], CollectPolicy(), NOW)
    policy = await reporter.report_once()
    assert policy == CollectPolicy()
    status, ctype, body = await reporter.route({})
    assert status == 200
    doc = json.loads(body)
    assert doc == build_status(store, [WEB], CollectPolicy(), NOW) == reporter.latest()
    assert doc["nodeMetric"]["nodeUsage"]["resources"]["cpu"] == "2500m"
    assert [p["name"] for p in doc["podsMetric"]] == ["web"]
    assert reporter.reports_sent == 0  # not connected: nothing sent


@pytest.mark.asyncio
async def test_route_rebuilds_a_stale_document_with_new_pods(store: TSDB) -> None:
    clock = [NOW]
    pods: list[PodView] = []
    reporter = NodeMetricReporter(store, lambda: pods, None, None, clock=lambda: clock[0])
    await reporter.report_once()
    pods.append(WEB)
    _, _, body = await reporter.route({})
    assert json.loads(body)["podsMetric"] == []  # fresh enough: served as built
    clock[0] = NOW + ROUTE_MAX_AGE + 1
    _, _, body = await reporter.route({})
    assert [p["name"] for p in json.loads(body)["podsMetric"]] == ["web"]


@pytest.mark.asyncio
async def test_run_builds_at_once_and_is_cancellable(store: TSDB) -> None:
    reporter = NodeMetricReporter(store, lambda: [], None, None, CollectPolicy(report_interval=3600),
                                  clock=lambda: NOW)
    task = asyncio.create_task(reporter.run())
    for _ in range(500):
        if reporter.latest() is not None:
            break
        await asyncio.sleep(0.01)
    assert reporter.latest() is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.asyncio
async def test_hot_page_cache_noted_once(store: TSDB) -> None:
    policy = CollectPolicy(memory_policy="usageWithHotPageCache")
    reporter = NodeMetricReporter(store, lambda: [], None, None, policy, clock=lambda: NOW)
    with structlog.testing.capture_logs() as logs:
        await reporter.report_once()
        await reporter.report_once()
    assert [e["event"] for e in logs] == ["hot_page_cache_unavailable"]
    assert reporter.latest() is not None
    assert reporter.latest()["nodeMetric"]["nodeUsage"]["resources"]["memory"] == "1000000000"  # type: ignore[index]
