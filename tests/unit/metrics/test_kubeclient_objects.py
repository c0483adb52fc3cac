"""KubeClient's NodeResourceTopology and Event calls, and garbage from the API server,
against ``tests.kubeapi`` (which validates custom objects against the real CRD schemas)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog

from metrics.informer.kubeclient import Kind, KubeApiError, KubeClient
from tests.kubeapi import KubeApiServer

NODE = "node-a"
NRT_PATH = f"/apis/topology.node.k8s.io/v1alpha1/noderesourcetopologies/{NODE}"


POLICY = {"kubelet.koordinator.sh/cpu-manager-policy": '{"policy":"none"}'}


def nrt(cpus: int) -> dict[str, Any]:
    return {"apiVersion": "topology.node.k8s.io/v1alpha1", "kind": "NodeResourceTopology",
            "metadata": {"name": NODE, "annotations": POLICY},
            "topologyPolicies": ["None"],
            "zones": [{"name": "node-0", "type": "Node", "resources": [
                {"name": "cpu", "capacity": str(cpus), "allocatable": str(cpus), "available": str(cpus)},
                {"name": "memory", "capacity": "8Gi", "allocatable": 8 * 1024**3, "available": "8Gi"}]}]}


def test_nrt_get_create_patch(api: KubeApiServer, kube: KubeClient) -> None:
    assert kube.get_nrt() is None
    created = kube.create_nrt(nrt(4))
    assert created["metadata"]["resourceVersion"] and created["zones"][0]["resources"][0]["capacity"] == "4"
    assert kube.get_nrt() == created
    patched = kube.patch_nrt({"metadata": {"annotations": {"node.koordinator.sh/cpu-basic-info": "{}"}},
                              "zones": nrt(6)["zones"]})
    assert patched["metadata"]["annotations"] == {**POLICY, "node.koordinator.sh/cpu-basic-info": "{}"}
    assert api.get("noderesourcetopologies", NODE) == patched
    [req] = api.seen("PATCH", NRT_PATH)
    assert req.headers["content-type"] == "application/merge-patch+json"
    with pytest.raises(KubeApiError) as err:
        kube.create_nrt(nrt(4))
    assert err.value.status == 409


def test_an_nrt_the_crd_refuses_is_a_422_naming_the_field(api: KubeApiServer, kube: KubeClient) -> None:
    bad = nrt(4)
    bad["zones"][0]["resources"][0]["capacity"] = "four"
    with pytest.raises(KubeApiError, match=r"zones\.0\.resources\.0\.capacity") as err:
        kube.create_nrt(bad)
    assert err.value.status == 422
    del bad["topologyPolicies"]
    with pytest.raises(KubeApiError, match="'topologyPolicies' is a required property"):
        kube.create_nrt(bad)
    kube.create_nrt(nrt(4))
    with pytest.raises(KubeApiError, match=r"Additional properties are not allowed \('zone' was unexpected\)"):
        kube.patch_nrt({"zone": []})
    assert api.get("noderesourcetopologies", NODE) is not None and "zone" not in api.objects(
        "noderesourcetopologies")[0]


def test_create_event_in_its_namespace(api: KubeApiServer, kube: KubeClient) -> None:
    event = {"apiVersion": "v1", "kind": "Event", "metadata": {"generateName": "web.", "namespace": "shop"},
             "involvedObject": {"kind": "Pod", "namespace": "shop", "name": "web", "uid": "u1"},
             "reason": "Evicted", "message": "BE memory", "type": "Warning", "source": {"component": "koordlet"}}
    kube.create_event(event)
    [stored] = api.objects("events")
    assert stored["metadata"]["namespace"] == "shop" and stored["reason"] == "Evicted"
    assert api.seen("POST", "/api/v1/namespaces/shop/events")
    with pytest.raises(KubeApiError, match="reason: Required value"):
        kube.create_event({**event, "reason": ""})


@pytest.mark.parametrize(("body", "message"), [
    (b"<html>proxy error</html>", "get nodeslo: HTTP 200: response is not JSON"),
    (b"[1, 2]", "get nodeslo: HTTP 200: response is not a JSON object but list"),
    (b"[" * 100_000, "get nodeslo: HTTP 200: response is not JSON"),
])
def test_garbage_answers_are_errors_naming_the_request(api: KubeApiServer, kube: KubeClient, body: bytes,
                                                       message: str) -> None:
    api.routes[("GET", f"/apis/slo.koordinator.sh/v1alpha1/nodeslos/{NODE}")] = (200, body)
    with pytest.raises(KubeApiError) as err:
        kube.get_nodeslo()
    assert str(err.value).startswith(message)


def test_a_body_that_is_not_json_is_refused_before_sending(api: KubeApiServer, kube: KubeClient) -> None:
    with pytest.raises(KubeApiError, match="patch noderesourcetopology: HTTP 0: request body is not JSON"):
        kube.patch_nrt({"zones": [{"name": "node-0", "costs": float("nan")}]})
    assert not api.requests


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_garbage_lists_and_events_are_logged_not_raised(api: KubeApiServer, kube: KubeClient) -> None:
    path = "/apis/slo.koordinator.sh/v1alpha1/nodeslos"
    lists = iter([(200, {"kind": "NodeSLOList", "items": "nope"}), (200, b"]]"),
                  (200, {"kind": "NodeSLOList", "metadata": {"resourceVersion": "1"}, "items": None})])
    api.routes[("GET", path)] = lambda _req: next(lists)
    api.watch_scripts[path] = [[["a", "list"], {"type": "ERROR", "object": {"code": "x"}}], ["hold"]]
    events: list[tuple[str, object]] = []
    stop = threading.Event()
    with structlog.testing.capture_logs() as logs:
        thread = threading.Thread(target=kube.watch, args=(Kind.NODESLO, lambda t, o: events.append((t, o)), stop),
                                  daemon=True)
        thread.start()
        wait_for(lambda: len([r for r in api.seen("GET", path) if "watch" in r.query]) >= 2)
        stop.set()
        kube.interrupt_watches()
        api.release.set()
        thread.join(5)
    assert not thread.is_alive()
    assert events[0] == ("SYNC", None)  # "items": null is an empty list
    failures = [e["error"] for e in logs if e["event"] == "watch_failed"]
    assert "list NodeSLO: HTTP 200: items is not a list of objects: nope" in failures
    assert any(f.startswith("list NodeSLO: HTTP 200: response is not JSON") for f in failures)
    assert any(f.startswith("watch NodeSLO: HTTP 0") for f in failures)  # an ERROR without a usable code
    assert [e["line"] for e in logs if e["event"] == "watch_event_garbled"] == ['["a", "list"]']


def test_store_changes_reach_a_watch(api: KubeApiServer, kube: KubeClient) -> None:
    """The server's own watch: list, then ADDED/MODIFIED/DELETED of the node's object only."""
    slo = {"metadata": {"name": NODE}, "spec": {"resourceUsedThresholdWithBE": {"enable": True}}}
    api.put("nodeslos", slo)
    api.put("nodeslos", {"metadata": {"name": "other-node"}, "spec": {}})
    seen: list[tuple[str, Any]] = []
    stop = threading.Event()
    thread = threading.Thread(target=kube.watch, daemon=True, args=(
        Kind.NODESLO, lambda t, o: seen.append((t, o and o["spec"])), stop))
    thread.start()
    wait_for(lambda: len(seen) == 1)
    api.put("nodeslos", {**slo, "spec": {"resourceUsedThresholdWithBE": {"enable": False}}})
    api.put("nodeslos", {"metadata": {"name": "other-node"}, "spec": {"systemStrategy": {}}})
    api.delete("nodeslos", NODE)
    wait_for(lambda: len(seen) == 3)
    stop.set()
    kube.interrupt_watches()
    thread.join(5)
    assert seen == [("SYNC", slo["spec"]), ("MODIFIED", {"resourceUsedThresholdWithBE": {"enable": False}}),
                    ("DELETED", {"resourceUsedThresholdWithBE": {"enable": False}})]
    with pytest.raises(ValueError, match="NodeSLO is invalid"):
        api.put("nodeslos", {"metadata": {"name": NODE}, "spec": {"cpuBurstStrategy": {"policy": 7}}})


@pytest.mark.asyncio
async def test_first_report_waits_for_the_nodemetric_spec_and_the_pods(api: KubeApiServer, kube: KubeClient,
                                                                        tmp_path: Path) -> None:
    """After a restart the first PATCH went out before the NodeMetric was listed (default
    policy) and before the first pod listing (empty podsMetric)."""
    import asyncio

    from metrics.informer.states import StatesInformer
    from metrics.model import NODE_CPU_USAGE, Sample
    from metrics.report.reporter import NodeMetricReporter
    from metrics.store.tsdb import TSDB

    now = time.time()
    api.put("nodemetrics", {"metadata": {"name": NODE}, "spec": {"metricCollectPolicy": {
        "reportIntervalSeconds": 30, "aggregateDurationSeconds": 60}}})
    listed = threading.Event()
    real = api._serve

    def gated(req: Any) -> Any:
        listed.wait(10)
        return real(req)

    api.routes[("GET", "/apis/slo.koordinator.sh/v1alpha1/nodemetrics")] = gated
    pods_listed = False
    informer = StatesInformer(kube, None)
    task = asyncio.create_task(informer.run())
    patch = f"/apis/slo.koordinator.sh/v1alpha1/nodemetrics/{NODE}/status"
    with TSDB(tmp_path / "m.db", clock=lambda: now) as store:
        store.write([Sample(NODE_CPU_USAGE, 2.0, (), now - k) for k in range(30)])
        store.flush()
        reporter = NodeMetricReporter(store, lambda: [], informer, kube, clock=lambda: now,
                                      ready=lambda: pods_listed)
        with structlog.testing.capture_logs() as logs:
            run = asyncio.create_task(reporter.run())
            await asyncio.sleep(0.5)
            assert api.seen("PATCH", patch) == [] and reporter.not_ready() == "NodeMetric spec not read yet"
            listed.set()
            deadline = time.monotonic() + 10
            while reporter.not_ready() != "pods not listed yet":
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            assert api.seen("PATCH", patch) == []
            pods_listed = True
            while not api.seen("PATCH", patch):
                assert time.monotonic() < deadline, "no report once ready"
                await asyncio.sleep(0.01)
            run.cancel()
        assert reporter.policy().report_interval == 30  # the CR's, not the default 60
        stored = api.get("nodemetrics", NODE)
        assert stored is not None and stored["status"]["nodeMetric"]["nodeUsage"] == {"resources": {"cpu": "2000m"}}
    task.cancel()
    for t in (run, task):
        with pytest.raises(asyncio.CancelledError):
            await t
    assert not [e for e in logs if e["log_level"] == "warning"]
