"""The NodeMetric status on the API server is the one the reporter built, not a merge of it
with an older one: the report is a JSON merge patch, which keeps whatever it does not name.
Seen: after a restart (no prediction yet, memory without samples, host applications gone)
the previous run's ``prodReclaimableMetric`` stayed for koord-manager to use."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from metrics.informer.kubeclient import KubeClient, KubeSettings
from metrics.informer.states import StatesInformer
from metrics.model import NODE_CPU_USAGE, Sample
from metrics.report.nodemetric import status_merge_patch
from metrics.report.reporter import NodeMetricReporter
from metrics.store.tsdb import TSDB
from tests.kubeapi import KubeApiServer, merge_patch
from tests.unit.metrics.kubehelpers import kubeconfig
from tests.unit.metrics.test_kubeclient import NODE, stop_informer

QUANTITIES = {"resources": {"cpu": "4", "memory": "8Gi"}}
STALE: dict[str, Any] = {
    "updateTime": "2026-01-01T00:00:00Z",
    "nodeMetric": {
        "nodeUsage": {"resources": {"cpu": "3", "memory": "6Gi"}},
        "systemUsage": {"resources": {"cpu": "1", "memory": "1Gi"}},
        "aggregatedNodeUsages": [{"duration": "5m0s", "usage": {"avg": QUANTITIES}}],
        "numaUsages": [{"numaNodeID": 0, "nodeUsage": QUANTITIES}],
    },
    "podsMetric": [{"namespace": "ns", "name": "gone", "podUsage": QUANTITIES}],
    "hostApplicationMetric": [{"name": "nginx", "usage": QUANTITIES}],
    "prodReclaimableMetric": {"resource": QUANTITIES},
    "prodPeakMetric": {"resource": QUANTITIES},
}


def test_the_patch_turns_any_stored_status_into_the_built_one() -> None:
    built = {"updateTime": "2026-11-24T00:00:00Z", "podsMetric": [],
             "nodeMetric": {"nodeUsage": {"resources": {"cpu": "1500m"}}, "systemUsage": {"resources": {}},
                            "aggregatedNodeUsages": [], "aggregatedSystemUsages": []}}
    for stored in ({}, {"status": STALE}, {"status": {**STALE, "nodeMetric": {}}}):
        assert merge_patch(stored, {"status": status_merge_patch(built)})["status"] == built
    full = {**STALE, "nodeMetric": {**STALE["nodeMetric"], "aggregatedSystemUsages": []}}
    assert merge_patch({"status": STALE}, {"status": status_merge_patch(full)})["status"] == full


@pytest.mark.asyncio
async def test_a_report_leaves_nothing_of_the_previous_status(tmp_path: Path) -> None:
    now = time.time()
    api = KubeApiServer()
    api.put("nodemetrics", {"metadata": {"name": NODE}, "spec": {"metricCollectPolicy": {
        "reportIntervalSeconds": 30, "aggregateDurationSeconds": 60}}, "status": STALE})
    kube = KubeClient.connect(KubeSettings(NODE, kubeconfig=kubeconfig(tmp_path, api.url), qps=1000, timeout=5))
    informer = StatesInformer(kube, None)
    task = asyncio.create_task(informer.run())
    try:
        with TSDB(tmp_path / "m.db", clock=lambda: now) as store:
            store.write([Sample(NODE_CPU_USAGE, 1.5, (), now - k) for k in range(60)])
            store.flush()
            reporter = NodeMetricReporter(store, lambda: [], informer, kube, clock=lambda: now)
            deadline = time.monotonic() + 10
            while informer.nodemetric_spec() is None:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            await reporter.report_once()
            assert reporter.reports_sent == 1
    finally:
        await stop_informer(task)
        kube.close()
        api.close()
    stored = api.get("nodemetrics", NODE)
    assert stored is not None
    # exactly what was built: no stale prediction, host applications, NUMA usage or memory
    assert stored["status"] == reporter.latest()
    assert "prodReclaimableMetric" not in stored["status"]
    assert stored["status"]["nodeMetric"]["nodeUsage"] == {"resources": {"cpu": "1500m"}}
