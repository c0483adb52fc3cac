"""KubeClient (and the informer's watches) against ``tests.kubeapi``, a recording HTTP
endpoint that answers like the API server. Not a cluster: what is checked is what we
send and how we handle the answers."""

from __future__ import annotations

import asyncio
import io
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
import urllib3

from metrics.informer.kubeclient import (
    EvictionRefused,
    Kind,
    KubeApiError,
    KubeClient,
    KubeSettings,
    KubeUnavailable,
)
from metrics.informer.states import StatesInformer
from metrics.model import NODE_CPU_USAGE, Sample
from metrics.report.reporter import NodeMetricReporter
from metrics.store.tsdb import TSDB
from tests.kubeapi import HOLD, KubeApiServer, merge_patch
from tests.unit.metrics.kubehelpers import kubeconfig

NODE = "node-a"
CRD = "/apis/slo.koordinator.sh/v1alpha1"


def test_get_nodemetric_and_missing_nodeslo(api: KubeApiServer, kube: KubeClient) -> None:
    doc = {"apiVersion": "slo.koordinator.sh/v1alpha1", "kind": "NodeMetric", "metadata": {"name": NODE},
           "spec": {"metricCollectPolicy": {"reportIntervalSeconds": 30}}}
    api.routes[("GET", f"{CRD}/nodemetrics/{NODE}")] = (200, doc)
    assert kube.get_nodemetric() == doc
    assert kube.get_nodeslo() is None  # 404
    [req] = api.seen("GET", f"{CRD}/nodemetrics/{NODE}")
    assert req.headers["authorization"] == "Bearer test-token"
    assert api.seen("GET", f"{CRD}/nodeslos/{NODE}")


def test_get_node(api: KubeApiServer, kube: KubeClient) -> None:
    with pytest.raises(KubeApiError) as err:
        kube.get_node()
    assert err.value.status == 404
    api.routes[("GET", f"/api/v1/nodes/{NODE}")] = (200, {"kind": "Node", "metadata": {"name": NODE}})
    assert kube.get_node()["metadata"]["name"] == NODE


def test_patch_status_is_a_merge_patch_of_the_status_subresource(api: KubeApiServer, kube: KubeClient) -> None:
    path = f"{CRD}/nodemetrics/{NODE}/status"
    api.routes[("PATCH", path)] = (200, {"kind": "NodeMetric"})
    status = {"updateTime": "2023-11-14T22:13:20Z", "nodeMetric": {"nodeUsage": {"resources": {"cpu": "1500m"}}},
              "podsMetric": []}
    assert kube.update_nodemetric_status(status) is True
    [req] = api.seen("PATCH", path)
    assert req.headers["content-type"] == "application/merge-patch+json"
    assert req.json() == {"status": status}


def test_missing_nodemetric_is_not_created_and_logged_once(api: KubeApiServer, kube: KubeClient) -> None:
    with structlog.testing.capture_logs() as logs:
        assert kube.update_nodemetric_status({"podsMetric": []}) is False
        assert kube.update_nodemetric_status({"podsMetric": []}) is False
    assert [e["event"] for e in logs] == ["nodemetric_missing"]
    assert not [r for r in api.requests if r.method in ("POST", "PUT")]
    api.routes[("PATCH", f"{CRD}/nodemetrics/{NODE}/status")] = (200, {})
    assert kube.update_nodemetric_status({"podsMetric": []}) is True


def test_server_error_is_raised(api: KubeApiServer, kube: KubeClient) -> None:
    api.routes[("PATCH", f"{CRD}/nodemetrics/{NODE}/status")] = (500, {"message": "etcd is down"})
    with pytest.raises(KubeApiError, match="etcd is down") as err:
        kube.update_nodemetric_status({})
    assert err.value.status == 500


def test_eviction_body_has_uid_precondition(api: KubeApiServer, kube: KubeClient) -> None:
    path = "/api/v1/namespaces/shop/pods/web/eviction"
    api.routes[("POST", path)] = (201, {"kind": "Status", "status": "Success"})
    kube.evict("shop", "web", "uid-1", "BEMemoryEvict")
    [req] = api.seen("POST", path)
    assert req.json() == {
        "apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "web", "namespace": "shop"},
        "deleteOptions": {"preconditions": {"uid": "uid-1"}},
    }


def test_eviction_refused_on_429_and_gone_pod_is_done(api: KubeApiServer, kube: KubeClient) -> None:
    path = "/api/v1/namespaces/shop/pods/web/eviction"
    api.routes[("POST", path)] = (429, {"kind": "Status", "code": 429,
                                        "message": "Cannot evict pod as it would violate the pod's disruption budget."})
    with pytest.raises(EvictionRefused, match="disruption budget"):
        kube.evict("shop", "web", "uid-1", "BECPUEvict")
    api.routes[("POST", path)] = (404, {"kind": "Status", "code": 404, "message": "pods \"web\" not found"})
    kube.evict("shop", "web", "uid-1", "BECPUEvict")
    api.routes[("POST", path)] = (409, {"kind": "Status", "code": 409, "message": "uid precondition failed"})
    kube.evict("shop", "web", "uid-1", "BECPUEvict")
    assert len(api.seen("POST", path)) == 3


def test_unreachable_server_and_missing_config(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = KubeClient.connect(KubeSettings(NODE, kubeconfig=kubeconfig(tmp_path, f"http://127.0.0.1:{port}"),
                                             timeout=2))
    with pytest.raises(KubeUnavailable):
        client.get_nodeslo()
    client.close()
    with pytest.raises(KubeUnavailable, match="no Kubernetes configuration"):
        KubeClient.connect(KubeSettings(NODE, kubeconfig=tmp_path / "absent"))


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="node name"):
        KubeSettings("")
    with pytest.raises(ValueError, match="qps"):
        KubeSettings(NODE, qps=0)
    with pytest.raises(ValueError, match="exclusive"):
        KubeSettings(NODE, kubeconfig=Path("x"), in_cluster=True)


def nodeslo(rv: str, threshold: int) -> dict[str, Any]:
    return {"kind": "NodeSLO", "metadata": {"name": NODE, "resourceVersion": rv},
            "spec": {"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": threshold}}}


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_watch_lists_then_streams_and_relists_on_410(api: KubeApiServer, kube: KubeClient) -> None:
    path = f"{CRD}/nodeslos"
    lists = iter([nodeslo("100", 60), nodeslo("200", 61)])
    api.routes[("GET", path)] = lambda _req: (200, {"kind": "NodeSLOList", "metadata": {"resourceVersion": "100"},
                                                    "items": [next(lists)]})
    api.watch_scripts[path] = [
        [{"type": "MODIFIED", "object": nodeslo("101", 65)},
         {"type": "BOOKMARK", "object": {"kind": "NodeSLO", "metadata": {"resourceVersion": "150"}}},
         b"not json".decode(),
         {"type": "MODIFIED", "object": nodeslo("160", 70)}],
        [{"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}}],
        [HOLD],
    ]
    events: list[tuple[str, int | None]] = []

    def on_event(etype: str, obj: dict[str, Any] | None) -> None:
        value = obj["spec"]["resourceUsedThresholdWithBE"]["cpuSuppressThresholdPercent"] if obj else None
        events.append((etype, value))

    stop = threading.Event()
    thread = threading.Thread(target=kube.watch, args=(Kind.NODESLO, on_event, stop), daemon=True)
    thread.start()
    wait_for(lambda: len(events) >= 4 and len([r for r in api.seen("GET", path) if "watch" in r.query]) >= 3)
    stop.set()
    kube.interrupt_watches()
    thread.join(5)
    assert not thread.is_alive()
    assert events[:4] == [("SYNC", 60), ("MODIFIED", 65), ("MODIFIED", 70), ("SYNC", 61)]
    lists_made = [r for r in api.seen("GET", path) if "watch" not in r.query]
    watches = [r for r in api.seen("GET", path) if "watch" in r.query]
    assert len(lists_made) == 2  # the first list and the relist after 410 Gone
    assert all(r.query["fieldSelector"] == [f"metadata.name={NODE}"] for r in api.seen("GET", path))
    # Watch from the list's version, then resume from the last event (the bookmark counts too).
    assert [w.query.get("resourceVersion") for w in watches[:2]] == [["100"], ["160"]]
    assert watches[0].query["allowWatchBookmarks"][0].lower() == "true"


def test_a_watch_stopped_while_its_request_is_in_flight_ends_at_once(api: KubeApiServer, kube: KubeClient) -> None:
    path = f"{CRD}/nodeslos"
    api.routes[("GET", path)] = (200, {"kind": "NodeSLOList", "metadata": {"resourceVersion": "1"}, "items": []})
    api.watch_scripts[path] = [[HOLD]]
    api.before_watch = gate = threading.Event()
    stop = threading.Event()
    thread = threading.Thread(target=kube.watch, args=(Kind.NODESLO, lambda _t, _o: None, stop), daemon=True)
    thread.start()
    wait_for(lambda: any("watch" in r.query for r in api.seen("GET", path)))
    # Stopped and interrupted before the stream exists: nothing to shut down yet.
    stop.set()
    kube.interrupt_watches()
    gate.set()  # the response arrives; the server then holds the stream open for 10 s
    thread.join(3)
    assert not thread.is_alive()


def test_interrupting_a_stream_its_watch_thread_just_closed_is_not_an_error(kube: KubeClient) -> None:
    # The race CI once hit at teardown: interrupt_watches copied the stream, then the watch
    # thread closed it (urllib3 forgets its socket) before shutdown() ran.
    closed = urllib3.response.HTTPResponse(body=io.BytesIO(b""), preload_content=False)
    closed.close()
    with pytest.raises(ValueError):
        closed.shutdown()  # what interrupt_watches meets
    kube._streams.add(closed)
    kube.interrupt_watches()
    kube.close()


def test_watch_backs_off_while_the_crd_is_missing(api: KubeApiServer, kube: KubeClient) -> None:
    api.missing.add("nodemetrics")
    stop = threading.Event()
    events: list[str] = []
    with structlog.testing.capture_logs() as logs:
        thread = threading.Thread(target=kube.watch, args=(Kind.NODEMETRIC, lambda t, o: events.append(t), stop),
                                  daemon=True)
        thread.start()
        wait_for(lambda: len(api.seen("GET", f"{CRD}/nodemetrics")) >= 3)
        stop.set()
        thread.join(5)
    assert events == []
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["watch_failed"]  # once, not per retry


async def stop_informer(task: asyncio.Task[None]) -> None:
    """Cancel the informer and wait until its watch threads are gone (none may outlive a test)."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 5
    while any(t.name.startswith("watch-") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "watch threads still running after cancellation"
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_informer_gets_nodeslo_and_node_through_watches(api: KubeApiServer, kube: KubeClient) -> None:
    node = {"kind": "Node", "metadata": {"name": NODE, "resourceVersion": "5",
                                         "annotations": {"node.koordinator.sh/reservation": '{"reservedCPUs": "0-2"}'}},
            "status": {"capacity": {"cpu": "8", "memory": "16Gi"}, "allocatable": {"cpu": "7500m", "memory": "15Gi"}}}
    api.routes[("GET", "/api/v1/nodes")] = (200, {"kind": "NodeList", "metadata": {"resourceVersion": "5"},
                                                 "items": [node]})
    api.routes[("GET", f"{CRD}/nodeslos")] = (200, {"kind": "NodeSLOList", "metadata": {"resourceVersion": "1"},
                                                   "items": []})
    api.routes[("GET", f"{CRD}/nodemetrics")] = (200, {"kind": "NodeMetricList", "metadata": {"resourceVersion": "1"},
                                                      "items": [{"metadata": {"name": NODE}, "spec": {
                                                          "metricCollectPolicy": {"reportIntervalSeconds": 30}}}]})
    api.watch_scripts[f"{CRD}/nodeslos"] = [[{"type": "ADDED", "object": nodeslo("2", 55)}, HOLD]]
    informer = StatesInformer(kube, None, sync_interval=0.05)
    task = asyncio.create_task(informer.run())
    deadline = time.monotonic() + 10
    # Three watch threads list independently; wait for all three, not the first two.
    while informer.nodeslo_rules() is None or informer.node_capacity() is None or informer.nodemetric_spec() is None:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    assert informer.nodeslo_rules() == nodeslo("2", 55)["spec"]
    assert informer.nodemetric_spec() == {"metricCollectPolicy": {"reportIntervalSeconds": 30}}
    assert informer.node_capacity() == (8.0, 16 * 1024**3)
    assert informer.node_reserved_cpu() == 3.0  # reservedCPUs 0-2 beats capacity - allocatable = 0.5
    await stop_informer(task)


@pytest.mark.asyncio
async def test_reporter_patches_status_with_the_crs_interval(api: KubeApiServer, kube: KubeClient,
                                                              tmp_path: Path) -> None:
    now = 1_700_000_000.0
    api.routes[("GET", f"{CRD}/nodemetrics")] = (200, {"kind": "NodeMetricList", "metadata": {"resourceVersion": "1"},
                                                      "items": [{"metadata": {"name": NODE}, "spec": {
                                                          "metricCollectPolicy": {"reportIntervalSeconds": 45,
                                                                                  "aggregateDurationSeconds": 60}}}]})
    api.routes[("PATCH", f"{CRD}/nodemetrics/{NODE}/status")] = (200, {"kind": "NodeMetric"})
    informer = StatesInformer(kube, None)
    task = asyncio.create_task(informer.run())
    with TSDB(tmp_path / "m.db", clock=lambda: now) as store:
        reporter = NodeMetricReporter(store, lambda: [], informer, kube, clock=lambda: now)
        assert (await reporter.report_once()).report_interval == 60  # CR not seen yet: default
        assert api.seen("PATCH", f"{CRD}/nodemetrics/{NODE}/status") == []  # empty store: nothing sent
        deadline = time.monotonic() + 10
        while informer.nodemetric_spec() is None:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        store.write([Sample(NODE_CPU_USAGE, 1.0 + k % 2, (), now - k) for k in range(60)]
                    + [Sample(NODE_CPU_USAGE, 9.0, (), now - 100)])  # outside the CR's 60 s window
        store.flush()
        assert (await reporter.report_once()).report_interval == 45
    await stop_informer(task)
    [req] = api.seen("PATCH", f"{CRD}/nodemetrics/{NODE}/status")
    # a merge patch naming what it leaves out as null (no memory samples): nothing stale stays
    assert req.json()["status"]["nodeMetric"]["nodeUsage"] == {"resources": {"cpu": "1500m", "memory": None}}
    assert merge_patch({}, req.json())["status"] == reporter.latest()
    assert reporter.reports_sent == 1


# --- item 10 of issue 14: the NodeSLO is the rules overlay of every hook and task -------------

GI_YAML = {"resourceQOSStrategy": {"lsClass": {"cpuQOS": {"enable": True}},
                                   "beClass": {"cpuQOS": {"enable": True, "groupIdentity": -1}}}}


def slo(rv: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "NodeSLO", "metadata": {"name": NODE, "resourceVersion": rv}, "spec": spec}


@pytest.mark.asyncio
async def test_the_watched_nodeslo_feeds_hooks_and_tasks_through_one_provider(
    api: KubeApiServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hooks.batchresource import BatchResource
    from hooks.groupidentity import GroupIdentity
    from hooks.qos import QoSClass
    from metrics.agent import MetricsAgent, metrics_task
    from runtimeproxy.hookapi import HookInit, HostRoots, PodInfo, PodMeta, RulesProvider, TaskInit, frozen_map

    host = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys", resctrl=tmp_path / "r")
    for controller in ("cpu", "cpuacct", "memory", "cpuset"):
        (host.cgroup / controller).mkdir(parents=True)
    provider = RulesProvider(GI_YAML)
    changes: list[int] = []
    provider.subscribe(lambda: changes.append(1))
    provided: list[object] = []  # what the task hands the tasks built on it: its agent
    init = TaskInit(name="metrics", key_path="tasks.metrics", provide=provided.append,
                    snapshot=lambda: ({}, {}), host=host,
                    rules=GI_YAML, current_rules=provider.current, set_rules_overlay=provider.set_overlay,
                    add_route=lambda _p, _h: None,
                    args={"db": str(tmp_path / "m.db"), "schedlat_source": "off", "cpi": False, "kube": True,
                          "kubeconfig": str(kubeconfig(tmp_path, api.url)), "node_name": NODE})
    metrics_task(init)
    agent = provided[0]
    assert isinstance(agent, MetricsAgent) and agent.informer is not None
    gi = GroupIdentity(HookInit("gi", {}, "hooks[0].args", host, GI_YAML, current_rules=provider.current))
    batch = BatchResource(HookInit("batch", {}, "hooks[1].args", host, GI_YAML, current_rules=provider.current))
    be = PodInfo(PodMeta("job", "ns", "uid-be"), labels=frozen_map({"koordinator.sh/qosClass": "BE"}),
                 cgroup_parent="/kubepods/besteffort/poduid-be")

    # Without a NodeSLO (none listed yet): the YAML rules.
    assert gi.pod_value(be, QoSClass.BE) == (-1, "BE pod: class rule cpuQOS.groupIdentity -1")
    assert not agent.rules().resource_used_threshold_with_be.enable

    be_off = {"resourceQOSStrategy": {"policies": {"cpuPolicy": "groupIdentity"},
                                      "beClass": {"cpuQOS": {"enable": False}, "blkioQOS": {"enable": False}}},
              "resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressPolicy": "cfsQuota",
                                              "memoryAllocatableEvictThresholdPercent": 80},
              "systemStrategy": {"minFreeKbytesFactor": 100}, "hostApplications": []}
    for kind in ("nodes", "nodemetrics"):
        prefix = "/api/v1" if kind == "nodes" else CRD
        api.routes[("GET", f"{prefix}/{kind}")] = (200, {"kind": "List", "metadata": {"resourceVersion": "1"},
                                                        "items": []})
    api.routes[("GET", f"{CRD}/nodeslos")] = (200, {"kind": "NodeSLOList", "metadata": {"resourceVersion": "1"},
                                                   "items": [slo("1", be_off)]})
    bad = {"resourceQOSStrategy": {"beClass": {"cpuQOS": {"enable": "no"}}}}
    api.watch_scripts[f"{CRD}/nodeslos"] = [[{"type": "MODIFIED", "object": slo("2", bad)}, HOLD]]
    api.before_watch = threading.Event()  # hold the watch until the listed NodeSLO was checked
    task = asyncio.create_task(agent.informer.run())
    try:
        deadline = time.monotonic() + 10
        while not changes:
            assert time.monotonic() < deadline, "the NodeSLO never reached the provider"
            await asyncio.sleep(0.01)
        # The NodeSLO (with keys this agent does not model) merged over the YAML: BE cpuQOS
        # off for the hook, the cfsQuota policy for batch-resource and the QoS manager.
        assert gi.pod_value(be, QoSClass.BE) == (0, "BE pod: class cpuQOS disabled, group identity 0")
        assert gi.pod_value(be, QoSClass.LS) == (2, "LS pod: class rule cpuQOS.groupIdentity 2")  # YAML kept
        threshold = agent.rules().resource_used_threshold_with_be
        assert (threshold.enable, threshold.cpu_suppress_policy) == (True, "cfsQuota")
        assert batch.rules.resource_used_threshold_with_be.cpu_suppress_policy == "cfsQuota"

        # A NodeSLO that does not parse is rejected as a whole, naming the field: the last
        # good NodeSLO stays in force (issue 28 item 6), not the YAML.
        api.before_watch.set()
        while agent.nodeslo.explain()["rejected"] is None:
            assert time.monotonic() < deadline, "the bad NodeSLO was not rejected"
            await asyncio.sleep(0.01)
        assert len(changes) == 1
        assert gi.pod_value(be, QoSClass.BE) == (0, "BE pod: class cpuQOS disabled, group identity 0")
        assert agent.rules().resource_used_threshold_with_be.cpu_suppress_policy == "cfsQuota"
        out = capsys.readouterr().out
        assert "nodeslo_rejected" in out and "nodeslo.spec.resourceQOSStrategy.beClass.cpuQOS.enable" in out
        # ... and an Event on the Node (issue 16 §4), as kubectl describe node shows it.
        assert await asyncio.to_thread(agent.events.flush)
        [event] = [e for e in api.objects("events") if e["reason"] == "NodeSLORejected"]
        assert event["involvedObject"]["kind"] == "Node" and event["involvedObject"]["name"] == NODE
        assert event["message"].startswith("nodeslo.spec.resourceQOSStrategy.beClass.cpuQOS.enable='no'")
        assert event["message"].endswith("the last good NodeSLO applies")
    finally:
        await stop_informer(task)
        agent.tsdb.close()
