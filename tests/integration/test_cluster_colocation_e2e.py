"""Issue 28 items 4, 5 and 6 end to end ("How it is shown"): the real proxy (the shipped
hooks and rules, metrics with ``kube: true``, qos-manager with no ``evict_mode``) in front
of the fixture containerd, a NodeSLO served by the test API server (``tests/kubeapi.py``,
which validates each NodeSLO against the real CRD), real BE pods on real cgroup v1 under
this run's unique ``/koord-test-<id>/kubepods``. Over time, on the cgroup files and the
API server's requests:

* identity off (item 5): a NodeSLO turning BE group identity off clears the BE pods'
  ``cpu.idle`` and gives back the weight the kernel reset to 1024 in the same step:
  kubelet's 2 for a plain BestEffort pod, batch-resource's 512 for a batch pod;
* a bad NodeSLO (item 6): one field the agent refuses: a ``NodeSLORejected`` Event, and
  the last good NodeSLO stays in force (BE pods stay at ``cpu.idle`` 0 for several
  reconcile passes) and in ``explain``; persisted (0600) in ``state_dir``, so a restart
  while the cluster's NodeSLO is still bad keeps it too;
* a policy switch (item 4): a NodeSLO enabling BE memory eviction (threshold 1 %): with
  ``kube: true`` and no ``evict_mode`` the pod is evicted through the Eviction API (the
  pod object goes, with an ``evictPodSuccess`` Event), not stopped through the CRI.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo.scenario import DEFAULT_CONFIG, kubelet_creates_pod_cgroup
from tests.integration.conftest import http_get
from tests.kubeapi import KubeApiServer
from tests.unit.metrics.kubehelpers import kubeconfig

NODE = "krp-colo-node"
NS = "krp-test"
SPEC = "node.koordinator.sh/extended-resource-spec"
WORK = Path(tempfile.gettempdir(), f"krpt-colo-{uuid.uuid4().hex}")
IDENTITY_OFF = {"resourceQOSStrategy": {"beClass": {"cpuQOS": {"enable": True, "groupIdentity": 0}}}}
#: The CRD allows each value; the agent refuses a minimum above the threshold.
BAD = {**IDENTITY_OFF, "resourceUsedThresholdWithBE": {
    "enable": True, "cpuSuppressThresholdPercent": 50, "cpuSuppressMinPercent": 60}}
EVICT = {**IDENTITY_OFF, "resourceUsedThresholdWithBE": {
    "enable": True, "memoryEvictThresholdPercent": 1, "memoryEvictLowerPercent": 0}}


@pytest.fixture
def api() -> Iterator[KubeApiServer]:
    server = KubeApiServer()
    server.put("nodes", {"metadata": {"name": NODE}, "status": {
        "capacity": {"cpu": "2", "memory": "4Gi"}, "allocatable": {"cpu": "2", "memory": "4Gi"}}})
    server.put("nodeslos", {"metadata": {"name": NODE}, "spec": {}})
    yield server
    server.close()


@pytest.fixture
def work() -> Iterator[Path]:
    WORK.mkdir(mode=0o700)
    yield WORK
    shutil.rmtree(WORK, ignore_errors=True)


def _config(api: KubeApiServer, work: Path, prefix: str, state_dir: Path) -> dict[str, Any]:
    shipped = yaml.safe_load(DEFAULT_CONFIG.read_text())
    return {
        "hooks": shipped["hooks"], "rules": shipped["rules"], "reconcile_interval": "1s",
        "state_dir": str(state_dir),
        "tasks": {
            "metrics": {"db": str(work / "m.db"), "schedlat_source": "off", "cpi": False, "memlat_source": "off",
                        "kube": True, "kubeconfig": str(kubeconfig(work, api.url)), "node_name": NODE,
                        "besteffort_dir": f"{prefix.strip('/')}/kubepods/besteffort",
                        "kubelet_cpu_manager_state": str(work / "cpu_manager_state"),
                        "kubelet_config": str(work / "kubelet-config.yaml")},
            "qos-manager": {},  # no evict_mode: api, since metrics has a cluster
        },
    }


def _wait_for(what: str, check: Callable[[], Any], timeout: float, poll: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _hold(what: str, check: Callable[[], bool], seconds: float, poll: float = 0.05) -> None:
    """``check`` true at every poll for ``seconds`` (a reconcile interval is 1 s)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert check(), f"{what} no longer holds"
        time.sleep(poll)


def test_identity_off_a_bad_nodeslo_a_restart_and_a_policy_switch(
    api: KubeApiServer, work: Path, proxy_factory: Any, pods: Any, cgroup_prefix: str
) -> None:
    state_dir = work / "state"
    config = _config(api, work, cgroup_prefix, state_dir)
    extra = {k: v for k, v in config.items() if k != "hooks"}
    proxy = proxy_factory.start(config["hooks"], extra=extra)
    rt = proxy.runtime()

    # --- BE pods as kubelet starts them (pod cgroup, cpu.shares 2), known to the API server ---
    batch = {"containers": {"app": {"requests": {"kubernetes.io/batch-cpu": "500", "kubernetes.io/batch-memory":
                                                 str(64 << 20)}, "limits": {"kubernetes.io/batch-cpu": "1000"}}}}
    made = {}
    for name, notes in (("plain-be", {}), ("batch-be", {SPEC: json.dumps(batch)})):
        uid = str(uuid.uuid4())
        pod = pods.sandbox(name, qos="besteffort", uid=uid, labels={"koordinator.sh/qosClass": "BE"},
                           annotations=notes)
        kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
        (pods.pod_dir(pod, "cpu") / "cpu.shares").write_text("2")
        api.put("pods", {"metadata": {"name": name, "namespace": NS, "uid": uid}, "spec": {"nodeName": NODE}})
        sid = pods.run(rt, pod)
        pods.start(rt, pods.create(rt, sid, pod, pods.container("app")))
        made[name] = (pod, sid)
    idle = {n: pods.pod_dir(p, "cpu") / "cpu.idle" for n, (p, _) in made.items()}
    shares = {n: pods.pod_dir(p, "cpu") / "cpu.shares" for n, (p, _) in made.items()}

    def values(name: str) -> tuple[str, str]:
        return idle[name].read_text().strip(), shares[name].read_text().strip()

    for name in made:  # the shipped YAML: BE group identity -1, an idle group
        _wait_for(f"{name} cpu.idle 1", lambda name=name: values(name)[0] == "1", timeout=10)

    # --- identity off: cpu.idle 0 and the weight back in the same step (item 5) ---
    repaired = len(proxy.events("reconcile_repaired"))
    api.put("nodeslos", {"metadata": {"name": NODE}, "spec": IDENTITY_OFF})
    want = {"plain-be": "2", "batch-be": "512"}
    seen: dict[str, list[tuple[str, str]]] = {n: [] for n in made}

    def settled() -> bool:
        for name in made:
            seen[name].append(values(name))
        return all(seen[n][-1] == ("0", want[n]) for n in made)

    _wait_for("BE pods at cpu.idle 0 with their weights", settled, timeout=30, poll=0.02)
    for name in made:  # never left at the kernel's 1024: at most one sample between the two writes
        reset = [i for i, v in enumerate(seen[name]) if v == ("0", "1024")]
        assert len(reset) <= 1, seen[name]

    def restored_by_group_identity() -> bool:  # the log line follows the writes
        changes = [c for e in proxy.events("reconcile_repaired")[repaired:] for c in e["changes"]]
        return all(f"group-identity:host:{shares[n]}={want[n]}" in changes for n in made)

    _wait_for("group-identity's weight writes in the log", restored_by_group_identity, timeout=10)

    # --- a bad NodeSLO: rejected, reported, the last good one stays (item 6) ---
    api.put("nodeslos", {"metadata": {"name": NODE}, "spec": BAD})
    event = _wait_for("a NodeSLORejected event", lambda: [
        e for e in api.objects("events") if e.get("reason") == "NodeSLORejected"], timeout=30)[0]
    _hold("BE pods at cpu.idle 0 under the bad NodeSLO",
          lambda: all(values(n) == ("0", want[n]) for n in made), seconds=3.5)
    assert "cpuSuppressMinPercent" in event["message"] and "last good NodeSLO" in event["message"], event
    code, body = http_get(proxy.metrics_port, "/debug/explain")
    nodeslo = json.loads(body)["tasks"]["metrics"]["nodeslo"]
    assert code == 200 and nodeslo["in_force"] == "NodeSLO" and nodeslo["rejected"]["applied"] == "last good NodeSLO"
    saved = state_dir / "nodeslo-last-good.json"
    assert stat.S_IMODE(os.stat(saved).st_mode) == 0o600 and json.loads(saved.read_text()) == IDENTITY_OFF

    # --- a restart while the cluster's NodeSLO is still bad: the persisted one applies ---
    assert proxy.terminate() == 0
    again = proxy_factory.start(config["hooks"], extra=extra)
    again.wait_event("nodeslo_last_good_restored", timeout=10)
    again.wait_event("nodeslo_rejected", timeout=30)
    _hold("BE pods at cpu.idle 0 after the restart", lambda: all(values(n) == ("0", want[n]) for n in made),
          seconds=3.5)

    # --- a policy switch to BE memory eviction: through the Eviction API (item 4) ---
    assert again.events("evict_mode", mode="api")
    evictions = len([r for r in api.requests if r.path.endswith("/eviction")])
    api.put("nodeslos", {"metadata": {"name": NODE}, "spec": EVICT})
    posted = _wait_for("an eviction POST", lambda: [
        r for r in api.requests if r.method == "POST" and r.path.endswith("/eviction")][evictions:], timeout=30)
    victim = posted[0].path.split("/")[-2]
    assert victim in made and api.get("pods", victim, NS) is None  # the pod object was evicted
    _wait_for("an evictPodSuccess event", lambda: [
        e for e in api.objects("events") if e.get("reason") == "evictPodSuccess"
        and e["involvedObject"]["name"] == victim], timeout=10)
    sid = made[victim][1]
    state = again.runtime().PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=sid), timeout=10).status.state
    assert state == cri.SANDBOX_READY  # evicted through the API, not stopped through the CRI
    assert not again.events("pod_eviction_failed")
