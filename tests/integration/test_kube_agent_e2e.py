"""Issue 16 end to end ("How it is shown"): the real proxy process (metrics task with
``kube: true``, the QoS manager) in front of the fixture containerd, its kubeconfig pointing
at the local test API server (``tests/kubeapi.py``, a free port), which validates every
object the agent creates or patches against the shipped CRD schemas (a 422 fails the test).

On the API server's stored objects:

* the NodeResourceTopology is created with its koord-scheduler annotations, then not
  written again while nothing changes, and patched when a real LSR pod bound by
  ``scheduling.koordinator.sh/resource-status`` starts (its uid in ``pod-cpu-allocs``);
* NodeMetric status carries ``prodReclaimableMetric``/``prodPeakMetric`` from the peak
  predictor (intervals shortened by config), exported as ``koordlet_node_predicted_*``,
  and the predictor's checkpoint is written;
* a NodeSLO value the agent refuses becomes a ``NodeSLORejected`` Event on the Node, and a
  valid NodeSLO change reaches the rules every hook and task reads (``/debug/explain``).

A NodeSLO change moving real cgroups through hooks and tasks is
``test_qos_nodeslo_cfsquota_e2e.py``.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from runtimeproxy.demo.scenario import kubelet_creates_pod_cgroup
from tests import tmpnames
from tests.integration.conftest import ProxyLauncher, http_get
from tests.kubeapi import KubeApiServer
from tests.unit.metrics.kubehelpers import kubeconfig

NODE = "krp-e2e-node"
NRT_PATH = f"/apis/topology.node.k8s.io/v1alpha1/noderesourcetopologies/{NODE}"
NM_STATUS = f"/apis/slo.koordinator.sh/v1alpha1/nodemetrics/{NODE}/status"
ALLOCS = "node.koordinator.sh/pod-cpu-allocs"
#: Made by ``_workdir`` (not at import: a module collected but not run left it behind).
WORK = tmpnames.unique("kube-e2e")


@pytest.fixture(scope="module")
def api() -> Iterator[KubeApiServer]:
    server = KubeApiServer()
    server.put("nodes", {"metadata": {"name": NODE}, "status": {
        "capacity": {"cpu": "2", "memory": "4Gi"}, "allocatable": {"cpu": "2", "memory": "4Gi"}}})
    server.put("nodeslos", {"metadata": {"name": NODE}, "spec": {}})
    # slo-controller creates the NodeMetric with its spec; the agent only patches status.
    server.put("nodemetrics", {"metadata": {"name": NODE}, "spec": {"metricCollectPolicy": {
        "aggregateDurationSeconds": 60, "reportIntervalSeconds": 1}}})
    yield server
    server.close()


@pytest.fixture(scope="module", autouse=True)
def _workdir() -> Iterator[None]:
    WORK.mkdir(mode=0o700)
    yield
    shutil.rmtree(WORK, ignore_errors=True)


@pytest.fixture(scope="module")
def proxy_config(api: KubeApiServer, _workdir: None) -> dict[str, Any]:
    config = kubeconfig(WORK, api.url)
    return {
        "tasks": {
            "metrics": {
                "db": str(WORK / "m.db"), "schedlat_source": "off", "cpi": False, "memlat_source": "off",
                "kube": True, "kubeconfig": str(config), "node_name": NODE,
                "nrt_interval": "500ms",
                # no kubelet files on this machine: the paths say so rather than /var/lib/kubelet
                "kubelet_cpu_manager_state": str(WORK / "cpu_manager_state"),
                "kubelet_config": str(WORK / "kubelet-config.yaml"),
                "prediction": {"training_interval": "1s", "checkpoint_interval": "2s", "model_ttl": "1m",
                               "cold_start": "1s"},
            },
            "qos-manager": {},
        },
    }


def _wait_for(what: str, check: Callable[[], Any], timeout: float, poll: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _nrt_writes(api: KubeApiServer) -> list[str]:
    return [r.method for r in api.requests if r.path.startswith(NRT_PATH.rsplit("/", 1)[0])
            and r.method in ("POST", "PATCH", "PUT")]


def test_nrt_nodemetric_prediction_events_and_nodeslo_against_the_api_server(
    proxy: Any, pods: Any, api: KubeApiServer
) -> None:
    # --- NodeResourceTopology: created with its annotations (the server validated it) ---
    nrt = _wait_for("the NRT to be created", lambda: api.get("noderesourcetopologies", NODE), timeout=30)
    annotations = nrt["metadata"]["annotations"]
    for key in ("node.koordinator.sh/cpu-topology", "node.koordinator.sh/cpu-shared-pools",
                "node.koordinator.sh/be-cpu-shared-pools", ALLOCS, "kubelet.koordinator.sh/cpu-manager-policy",
                "node.koordinator.sh/cpu-basic-info"):
        assert key in annotations, (key, sorted(annotations))
    assert nrt["zones"] and all(z["type"] == "Node" for z in nrt["zones"])
    assert {r["name"] for r in nrt["zones"][0]["resources"]} >= {"cpu", "memory"}
    # Owned by the Node (also when the first sync ran before the Node was listed).
    node_uid = api.get("nodes", NODE)["metadata"]["uid"]  # type: ignore[index]
    _wait_for("the NRT owned by the Node", lambda: [
        r for r in (api.get("noderesourcetopologies", NODE) or {}).get("metadata", {}).get("ownerReferences", [])
        if r["kind"] == "Node" and r["uid"] == node_uid], timeout=10)
    # Nothing changes: no write for several NRT intervals.
    written = _nrt_writes(api)
    time.sleep(3)
    writes = _nrt_writes(api)
    assert writes == written and writes[0] == "POST" and len(writes) <= 2, writes

    # A real LSR pod bound to CPU 0 by the scheduler: the NRT is patched with its allocation.
    rt = proxy.runtime()
    uid = str(uuid.uuid4())
    lsr = pods.sandbox("lsr", qos="guaranteed", uid=uid, labels={"koordinator.sh/qosClass": "LSR"},
                       annotations={"scheduling.koordinator.sh/resource-status": json.dumps({"cpuset": "0"})})
    kubelet_creates_pod_cgroup(lsr.linux.cgroup_parent)
    sid = pods.run(rt, lsr)
    pods.start(rt, pods.create(rt, sid, lsr, pods.container("app")))

    def allocs() -> list[dict[str, Any]]:
        stored = api.get("noderesourcetopologies", NODE) or {}
        found: list[dict[str, Any]] = json.loads(stored["metadata"]["annotations"][ALLOCS]) or []  # null: none
        return found if any(a["uid"] == uid for a in found) else []

    bound = _wait_for("the NRT patched with the pod's cpus", allocs, timeout=30)
    assert any(a["uid"] == uid and a["cpuset"] == "0" for a in bound), bound
    assert _nrt_writes(api) == [*written, "PATCH"], _nrt_writes(api)

    # --- NodeMetric with the prediction (every PATCH validated by the server) ---
    def predicted() -> dict[str, Any] | None:
        status = (api.get("nodemetrics", NODE) or {}).get("status", {})
        return status if "prodReclaimableMetric" in status else None

    status = _wait_for("a NodeMetric status with prodReclaimableMetric", predicted, timeout=60)
    assert set(status["prodReclaimableMetric"]["resource"]["resources"]) == {"cpu", "memory"}
    assert set(status["prodPeakMetric"]["resource"]["resources"]) == {"cpu", "memory"}
    assert status["nodeMetric"]["nodeUsage"]["resources"]["cpu"]
    assert any(p["name"] == "lsr" for p in status.get("podsMetric", [])), status.get("podsMetric")
    code, body = http_get(proxy.metrics_port, "/metrics")
    assert code == 200
    text = body.decode()
    assert "koordlet_node_predicted_resource_reclaimable{" in text
    assert "koordlet_node_predicted_resource_peak{" in text
    _wait_for("the predictor's checkpoint", lambda: (WORK / "m.db.prediction.json").is_file(), timeout=30)

    # --- a NodeSLO value the agent refuses: an Event on the Node, the YAML rules apply ---
    # (the CRD allows each value; the agent refuses the minimum above the threshold)
    refused = {"enable": True, "cpuSuppressThresholdPercent": 50, "cpuSuppressMinPercent": 60}
    api.put("nodeslos", {"metadata": {"name": NODE}, "spec": {"resourceUsedThresholdWithBE": refused}})
    event = _wait_for("a NodeSLORejected event", lambda: [
        e for e in api.objects("events") if e.get("reason") == "NodeSLORejected"], timeout=30)[0]
    assert event["involvedObject"]["kind"] == "Node" and event["involvedObject"]["name"] == NODE
    assert event["type"] == "Warning" and "cpuSuppressMinPercent" in event["message"]
    assert event["source"] == {"component": "koordlet", "host": NODE}

    # --- a valid NodeSLO change reaches the one rules provider of hooks and tasks ---
    changed = len(proxy.events("rules_changed"))
    api.put("nodeslos", {"metadata": {"name": NODE}, "spec": {
        "resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": 42}}})
    # the proxy re-applies the rules to running pods (hooks) ...
    _wait_for("rules_changed with the NodeSLO", lambda: [
        e for e in proxy.events("rules_changed")[changed:] if "nodeslo" in json.dumps(e)], timeout=30)

    # ... and the QoS manager's suppress strategy plans with the NodeSLO's threshold
    def planned_with_42() -> bool:
        code, body = http_get(proxy.metrics_port, "/debug/explain")
        return code == 200 and '"threshold_percent": 42' in body.decode()

    _wait_for("the suppress plan with threshold 42% in /debug/explain", planned_with_42, timeout=30)


def _allocs_of(doc: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The pod-cpu-allocs a NRT document or patch carries (None: the write leaves it alone)."""
    value = (doc.get("metadata") or {}).get("annotations", {}).get(ALLOCS)
    return None if value is None else (json.loads(value) or [])


def test_a_restart_publishes_nothing_less_informed(
    proxy: Any, pods: Any, api: KubeApiServer, containerd: Any, proxy_config: dict[str, Any]
) -> None:
    """Issue 28 items 2 and 3: after a restart (the checkpointed predictor on disk, an LSR
    pod bound to CPU 0) no NRT write drops the pod's allocation, and the first NodeMetric
    status has the pod and the prediction restored from the checkpoint."""
    rt = proxy.runtime()
    uid = str(uuid.uuid4())
    lsr = pods.sandbox("lsr-restart", qos="guaranteed", uid=uid, labels={"koordinator.sh/qosClass": "LSR"},
                       annotations={"scheduling.koordinator.sh/resource-status": json.dumps({"cpuset": "0"})})
    kubelet_creates_pod_cgroup(lsr.linux.cgroup_parent)
    pods.start(rt, pods.create(rt, pods.run(rt, lsr), lsr, pods.container("app")))
    _wait_for("the NRT with the pod's cpus", lambda: any(
        a["uid"] == uid for a in _allocs_of(api.get("noderesourcetopologies", NODE) or {}) or []), timeout=30)
    _wait_for("a NodeMetric with the pod and the prediction", lambda: any(
        p["name"] == "lsr-restart" for p in (api.get("nodemetrics", NODE) or {}).get("status", {}).get(
            "podsMetric", [])) and "prodReclaimableMetric" in api.get("nodemetrics", NODE)["status"], timeout=60)
    _wait_for("the predictor's checkpoint", lambda: (WORK / "m.db.prediction.json").is_file(), timeout=30)

    assert proxy.terminate() == 0  # its checkpoint is saved at stop
    before = len(api.requests)
    launcher = ProxyLauncher(containerd.socket)
    try:
        again = launcher.start(proxy_config.get("hooks", ()),
                               extra={k: v for k, v in proxy_config.items() if k != "hooks"})
        again.wait_event("store_rebuilt", timeout=30)

        def first_status() -> Any:
            return next((r for r in api.requests[before:] if r.method == "PATCH" and r.path == NM_STATUS), None)

        first = _wait_for("the first NodeMetric after the restart", first_status, timeout=60).json()["status"]
        assert any(p["name"] == "lsr-restart" for p in first.get("podsMetric") or []), first.get("podsMetric")
        assert first.get("prodReclaimableMetric") and first.get("prodPeakMetric"), sorted(first)
        # Several NRT intervals (500 ms) after the store came back: no write dropped the pod.
        time.sleep(3)
        nrt_writes = [r for r in api.requests[before:] if r.path.startswith(NRT_PATH.rsplit("/", 1)[0])
                      and r.method in ("POST", "PATCH", "PUT")]
        for write in nrt_writes:
            allocs = _allocs_of(write.json())
            assert allocs is None or any(a["uid"] == uid for a in allocs), (write.method, allocs)
        assert any(a["uid"] == uid for a in _allocs_of(api.get("noderesourcetopologies", NODE) or {}) or [])
    finally:
        problems = launcher.cleanup()
    assert not problems, "\n".join(problems)
