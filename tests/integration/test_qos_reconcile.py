"""The reconciler on real cgroups: a manual write to a managed file is repaired.

Runs the shipped chain with a 1 s reconcile interval. The container's CFS quota
(batch-resource) and cpuset (cpuset share pool) are overwritten by hand, as an
operator or another agent might, and must come back without any CRI call.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo.scenario import DEFAULT_CONFIG, kubelet_creates_pod_cgroup

SPEC = "node.koordinator.sh/extended-resource-spec"


@pytest.fixture(scope="module")
def proxy_config() -> dict[str, Any]:
    shipped = yaml.safe_load(DEFAULT_CONFIG.read_text())
    return {"hooks": shipped["hooks"], "rules": shipped["rules"], "reconcile_interval": "1s"}


def _wait_for(read: Any, want: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    value = read()
    while value != want and time.monotonic() < deadline:
        time.sleep(0.1)
        value = read()
    return str(value)


def test_manual_writes_are_repaired(proxy: Any, pods: Any) -> None:
    rt = proxy.runtime()
    spec = {"containers": {"app": {
        "requests": {"kubernetes.io/batch-cpu": "500", "kubernetes.io/batch-memory": str(128 << 20)},
        "limits": {"kubernetes.io/batch-cpu": "1000", "kubernetes.io/batch-memory": str(256 << 20)},
    }}}
    pod = pods.sandbox("drift-be", qos="besteffort", labels={"koordinator.sh/qosClass": "BE"},
                       annotations={SPEC: json.dumps(spec)})
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    sid = pods.run(rt, pod)
    cid = pods.create(rt, sid, pod, pods.container("app", resources=cri.LinuxContainerResources(cpu_shares=2)))
    pods.start(rt, cid)
    quota = pods.pod_dir(pod, "cpu") / cid / "cpu.cfs_quota_us"
    cpuset = pods.pod_dir(pod, "cpuset") / cid / "cpuset.cpus"
    assert quota.read_text().strip() == "100000"
    pool = cpuset.read_text().strip()

    quota.write_text("50000")  # drift: someone halves the BE container's quota
    # The write took, unless the 1 s reconciler already repaired it in between; either
    # way the repair it must log for this very file (asserted below) proves the drift.
    assert quota.read_text().strip() in ("50000", "100000")
    online = Path("/sys/devices/system/cpu/online").read_text().strip()
    narrowed = online.replace("-", ",").split(",")[0]
    cpuset.write_text(narrowed)  # drift: someone pins it to one CPU

    assert _wait_for(lambda: quota.read_text().strip(), "100000") == "100000"
    if pool != narrowed:
        assert _wait_for(lambda: cpuset.read_text().strip(), pool) == pool
    proxy.wait_event("reconcile_repaired", timeout=10)
    changes = [c for event in proxy.events("reconcile_repaired") for c in event["changes"]]
    assert f"batch-resource:host:{quota}=100000" in changes, changes
    # And the repair found the drifted value: the manual write did take.
    explain = f"http://127.0.0.1:{proxy.metrics_port}/debug/explain?pod=krp-test/drift-be"
    with urllib.request.urlopen(explain, timeout=5) as resp:
        recorded = json.loads(resp.read())["changes"]
    repairs = [(c["old"], c["new"]) for c in recorded
               if c["target"] == f"host:{quota}" and c["stage"] == "ReconcileContainer"]
    assert ("50000", "100000") in repairs, recorded
    # No hook keeps failing on these pods (e.g. writing shares to an idle BE group).
    failures = [e for e in proxy.events("hook_failed") if e.get("pod_name") == "drift-be"]
    assert failures == [], failures


def test_rule_change_is_reapplied_to_running_pods(proxy: Any, pods: Any) -> None:
    rt = proxy.runtime()
    pod = pods.sandbox("rule-change-be", qos="besteffort", labels={"koordinator.sh/qosClass": "BE"})
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    pods.run(rt, pod)
    idle = pods.pod_dir(pod, "cpu") / "cpu.idle"
    assert idle.read_text().strip() == "1"
    doc = proxy.config()
    original = json.loads(json.dumps(doc))
    try:
        # BE's group identity -1 -> 0: no longer an idle group. No CRI call: the reload
        # builds a new chain with the new rules and the reconciler re-applies them.
        doc["rules"]["resourceQOSStrategy"]["beClass"]["cpuQOS"]["groupIdentity"] = 0
        proxy.write_config(doc)
        assert _wait_for(lambda: idle.read_text().strip(), "0") == "0"
    finally:
        proxy.write_config(original)
    assert _wait_for(lambda: idle.read_text().strip(), "1") == "1"


def test_clearing_cpu_idle_restores_the_weight_it_replaced(proxy: Any, pods: Any) -> None:
    """Issue 28 item 5 on real cgroups: the kernel resets cpu.shares to 1024 when cpu.idle
    goes 1 -> 0; turning BE group identity off gives a plain BestEffort pod kubelet's 2
    back and a batch pod batch-resource's weight, in group-identity's own write."""
    rt = proxy.runtime()
    plain = pods.sandbox("idle-plain-be", qos="besteffort", labels={"koordinator.sh/qosClass": "BE"})
    spec = {"containers": {"app": {"requests": {"kubernetes.io/batch-cpu": "500"},
                                   "limits": {"kubernetes.io/batch-cpu": "1000"}}}}
    batch = pods.sandbox("idle-batch-be", qos="besteffort", labels={"koordinator.sh/qosClass": "BE"},
                         annotations={SPEC: json.dumps(spec)})
    for pod in (plain, batch):
        kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
        (pods.pod_dir(pod, "cpu") / "cpu.shares").write_text("2")  # kubelet: a BestEffort pod
        pods.run(rt, pod)
        assert (pods.pod_dir(pod, "cpu") / "cpu.idle").read_text().strip() == "1"
    doc = proxy.config()
    original = json.loads(json.dumps(doc))
    repaired = len(proxy.events("reconcile_repaired"))
    try:
        doc["rules"]["resourceQOSStrategy"]["beClass"]["cpuQOS"]["groupIdentity"] = 0
        proxy.write_config(doc)
        for pod in (plain, batch):
            idle = pods.pod_dir(pod, "cpu") / "cpu.idle"
            assert _wait_for(lambda idle=idle: idle.read_text().strip(), "0") == "0"
        shares = {pod.metadata.name: pods.pod_dir(pod, "cpu") / "cpu.shares" for pod in (plain, batch)}
        # batch-cpu requests 500m -> 512 shares (the same pass); 1024 is the kernel's reset.
        assert _wait_for(lambda: shares["idle-plain-be"].read_text().strip(), "2", timeout=3) == "2"
        assert _wait_for(lambda: shares["idle-batch-be"].read_text().strip(), "512", timeout=3) == "512"
        want = {f"group-identity:host:{shares[pod.metadata.name]}={weight}"
                for pod, weight in ((plain, 2), (batch, 512))}

        def missing() -> str:
            changes = {c for e in proxy.events("reconcile_repaired")[repaired:] for c in e["changes"]}
            return repr(sorted(want - changes))

        # The pass logs each repair just after its write (which the waits above saw): on a
        # busy host the line can trail the file, so wait for the lines too.
        assert _wait_for(missing, "[]") == "[]"
    finally:
        proxy.write_config(original)
    for pod in (plain, batch):
        assert _wait_for(lambda pod=pod: (pods.pod_dir(pod, "cpu") / "cpu.idle").read_text().strip(), "1") == "1"
