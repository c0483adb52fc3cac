"""Issue 14, items 10 and 11 on a real node: cfsQuota suppression switched on through the NodeSLO.

The proxy (batch-resource hook, metrics and qos-manager tasks) runs with YAML rules
saying ``cpuSuppressPolicy: cpuset`` and watches a NodeSLO on the test API server (``tests/kubeapi.py``; the
one boundary we cannot create here). Two BE pods carry quotas of their own, as on the
cluster where cfsQuota suppression did nothing: a batch pod whose batch-cpu limit gave
its pod and container cgroups a quota, and a pod whose container has a CPU limit of its
own. The NodeSLO then switches to ``cfsQuota``:

* batch-resource learns the policy (one rules provider) and lifts the batch pod's quotas;
* an LS spike shrinks the besteffort tier below the other pod's container quota: that
  quota is clamped first (cgroup v1 refuses a parent quota below a child's with EINVAL)
  and no quota write fails;
* the NodeSLO switching back to ``cpuset`` lifts the tier quota and restores the clamped one.

The suppress target depends on what the whole machine uses (others' work is "system"
usage), so on a loaded machine the tier may be narrow before the spike; the reaction
time is printed when it was wide (bench/bench_qos_reaction.py measures it properly).

All under this run's unique ``/koord-test-<id>/kubepods`` on real cgroup v1.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo.scenario import kubelet_creates_pod_cgroup
from tests import tmpnames
from tests.kubeapi import KubeApiServer
from tests.unit.metrics.kubehelpers import kubeconfig

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
SPEC = "node.koordinator.sh/extended-resource-spec"
NODE = "krp-test-node"
#: Made by ``_remove_db_dir`` (not at import: a module collected but not run left it behind).
DB_DIR = tmpnames.unique("nodeslo")
SPIN2 = ("sh", "-c", "while :; do :; done & while :; do :; done")
OWN_QUOTA = 100_000  # the second BE pod's container: 1 core of its own


def set_spec(api: KubeApiServer, spec: dict[str, Any]) -> None:
    """A new NodeSLO version (as slo-controller writes it); the agent's watch gets MODIFIED."""
    api.put("nodeslos", {"metadata": {"name": NODE}, "spec": spec})


@pytest.fixture(scope="module")
def api() -> Iterator[KubeApiServer]:
    server = KubeApiServer()  # validates the NodeSLOs put below against the real CRD
    server.put("nodeslos", {"metadata": {"name": NODE}, "spec": {}})
    yield server
    server.close()


@pytest.fixture(scope="module")
def proxy_config(cgroup_prefix: str, api: KubeApiServer) -> dict[str, Any]:
    config = kubeconfig(DB_DIR, api.url)
    return {
        "hooks": [{"name": "batch", "plugin": "batch-resource", "failure_policy": "Ignore"}],
        "rules": {"resourceUsedThresholdWithBE": {
            "enable": True, "cpuSuppressThresholdPercent": 90, "cpuSuppressPolicy": "cpuset"}},
        "tasks": {
            "metrics": {"db": str(DB_DIR / "m.db"), "schedlat_source": "off", "cpi": False, "kube": True,
                        "kubeconfig": str(config), "node_name": NODE, "report_interval": "1h",
                        "memlat_source": "off"},
            "qos-manager": {"besteffort_dir": f"{cgroup_prefix.strip('/')}/kubepods/besteffort",
                            "fast_interval": "100ms"},
        },
    }


@pytest.fixture(scope="module", autouse=True)
def _remove_db_dir() -> Iterator[None]:
    DB_DIR.mkdir(mode=0o700)
    yield
    shutil.rmtree(DB_DIR, ignore_errors=True)


def _quota(path: Path) -> int:
    return int((path / "cpu.cfs_quota_us").read_text())


def _wait_for(what: str, check: Callable[[], bool], timeout: float, poll: float = 0.05) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_nodeslo_switches_to_cfs_quota_and_an_ls_spike_shrinks_the_tier_below_be_quotas(
    proxy: Any, pods: Any, cgroup_prefix: str, api: KubeApiServer
) -> None:
    rt = proxy.runtime()
    tier = CPU_ROOT / cgroup_prefix.strip("/") / "kubepods" / "besteffort"

    # A batch pod (batch-cpu limit 500m: pod and container quota 50000 under the cpuset policy).
    batch = {"containers": {"be": {"requests": {"kubernetes.io/batch-cpu": "500"},
                                   "limits": {"kubernetes.io/batch-cpu": "500"}}}}
    batch_pod = pods.sandbox("be-batch", qos="besteffort", labels={"koordinator.sh/qosClass": "BE"},
                             annotations={SPEC: json.dumps(batch)})
    kubelet_creates_pod_cgroup(batch_pod.linux.cgroup_parent)
    batch_sid = pods.run(rt, batch_pod)
    batch_cid = pods.create(rt, batch_sid, batch_pod, pods.container("be", command=SPIN2))
    pods.start(rt, batch_cid)
    batch_dir = CPU_ROOT / batch_pod.linux.cgroup_parent.strip("/")
    assert _quota(batch_dir) == 50_000 and _quota(batch_dir / batch_cid) == 50_000

    # A BE pod whose container carries a CPU limit of its own (1 core).
    own_pod = pods.sandbox("be-own", qos="besteffort", labels={"koordinator.sh/qosClass": "BE"})
    kubelet_creates_pod_cgroup(own_pod.linux.cgroup_parent)
    own_sid = pods.run(rt, own_pod)
    own_cid = pods.create(rt, own_sid, own_pod, pods.container(
        "own", command=SPIN2, resources=cri.LinuxContainerResources(cpu_period=100_000, cpu_quota=OWN_QUOTA)))
    pods.start(rt, own_cid)
    own_ctr = CPU_ROOT / own_pod.linux.cgroup_parent.strip("/") / own_cid
    assert _quota(own_ctr) == OWN_QUOTA

    ls_pod = pods.sandbox("ls-online", qos="burstable", labels={"koordinator.sh/qosClass": "LS"})
    kubelet_creates_pod_cgroup(ls_pod.linux.cgroup_parent)
    ls_sid = pods.run(rt, ls_pod)
    pods.start(rt, pods.create(rt, ls_sid, ls_pod, pods.container("idle")))
    assert _quota(tier) == -1  # the cpuset policy: no tier quota

    # The NodeSLO switches the policy (slo-controller writes more than we model).
    set_spec(api, {"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": 90,
                                                  "cpuSuppressPolicy": "cfsQuota"},
                  "resourceQOSStrategy": {"beClass": {"blkioQOS": {"enable": False}}},
                  "systemStrategy": {"minFreeKbytesFactor": 100}})
    # batch-resource learned it (item 10): the batch pod's own quotas are lifted.
    _wait_for("batch-resource to lift the batch pod's quotas",
              lambda: _quota(batch_dir) == -1 and _quota(batch_dir / batch_cid) == -1, timeout=30)
    _wait_for("a BE tier quota", lambda: _quota(tier) > 0, timeout=30)
    time.sleep(3)  # let the tier settle (growth is capped at 10 % of capacity a round)
    wide = _quota(tier)

    burner = pods.create(rt, ls_sid, ls_pod, pods.container(
        "burn", command=SPIN2, resources=cri.LinuxContainerResources(cpu_shares=10240)))
    pods.start(rt, burner)
    try:
        half = _wait_for("the tier to halve", lambda: _quota(tier) <= max(wide // 2, 2000), timeout=10, poll=0.005)
        _wait_for("the tier below the BE container's own quota", lambda: 0 < _quota(tier) < OWN_QUOTA, timeout=10)
    except AssertionError as exc:
        detail = {"wide": wide, "tier": _quota(tier), "own": _quota(own_ctr),
                  "failed_writes": proxy.events("qos_write_failed")[-3:]}
        raise AssertionError(f"{exc}: {json.dumps(detail, default=str)[:3000]}") from None
    narrowed = _quota(tier)
    assert _quota(own_ctr) <= narrowed  # clamped to the tier, before the tier was written
    rt.StopContainer(cri.StopContainerRequest(container_id=burner, timeout=0), timeout=30)

    # Back to the cpuset policy: the tier quota is recovered, the clamped quota restored.
    set_spec(api, {"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": 90,
                                                  "cpuSuppressPolicy": "cpuset"}})
    _wait_for("the tier quota lifted and the container's own quota restored",
              lambda: _quota(tier) == -1 and _quota(own_ctr) == OWN_QUOTA, timeout=30)
    failed = [e for e in proxy.events("qos_write_failed") if "cfs_quota" in json.dumps(e)]
    assert not failed, json.dumps({"failed": failed[-3:], "writes": proxy.events("qos_write")[-8:]},
                                  default=str)[:6000]
    replans = proxy.events("suppress_replanned")
    reaction = f"halved_after={half:.3f}s" if wide >= 4 * 2000 else "tier already narrow (machine loaded)"
    print(f"\nnodeslo cfsQuota: wide={wide} narrowed={narrowed} {reaction} fast_replans={len(replans)}")
