"""The shipped default chain (systemd/config.yaml) through the real proxy on cgroup v1.

An LSR pod bound by ``scheduling.koordinator.sh/resource-status`` gets that cpuset
and no CFS limit; a BE pod gets ``cpu.idle = 1`` on its pod cgroup (this upstream
kernel has no bvt); ``explain`` lists every change with its hook and reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo.scenario import kubelet_creates_pod_cgroup

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "systemd" / "config.yaml"
STATUS = "scheduling.koordinator.sh/resource-status"


@pytest.fixture(scope="module")
def proxy_config() -> dict[str, Any]:
    shipped = yaml.safe_load(DEFAULT_CONFIG.read_text())
    return {"hooks": shipped["hooks"], "rules": shipped["rules"], "reconcile_interval": "1s"}




def _last_online_cpu() -> str:
    # "0-1" or "0,2-3": the last number is the highest online CPU.
    return Path("/sys/devices/system/cpu/online").read_text().strip().replace("-", ",").split(",")[-1]


def test_lsr_pod_gets_its_bound_cpuset_and_no_quota(proxy: Any, pods: Any) -> None:
    rt = proxy.runtime()
    bound = _last_online_cpu()
    pod = pods.sandbox("lsr-bound", qos="guaranteed", labels={"koordinator.sh/qosClass": "LSR"},
                       annotations={STATUS: json.dumps({"cpuset": bound})})
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    sid = pods.run(rt, pod)
    resources = cri.LinuxContainerResources(cpu_shares=1024, cpu_quota=100000, cpu_period=100000)
    cid = pods.create(rt, sid, pod, pods.container("app", resources=resources))
    pods.start(rt, cid)
    assert pods.cgroup_value(pod, cid, "cpuset", "cpuset.cpus") == bound
    assert pods.cgroup_value(pod, cid, "cpu", "cpu.cfs_quota_us") == "-1"
    assert (pods.pod_dir(pod, "cpu") / "cpu.cfs_quota_us").read_text().strip() == "-1"


def test_be_pod_gets_cpu_idle(proxy: Any, pods: Any) -> None:
    rt = proxy.runtime()
    pod = pods.sandbox("be-idle", qos="besteffort", labels={"koordinator.sh/qosClass": "BE"})
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    pods.run(rt, pod)
    assert (pods.pod_dir(pod, "cpu") / "cpu.idle").read_text().strip() == "1"
    ls = pods.sandbox("ls-not-idle", qos="burstable", labels={"koordinator.sh/qosClass": "LS"})
    kubelet_creates_pod_cgroup(ls.linux.cgroup_parent)
    pods.run(rt, ls)
    assert (pods.pod_dir(ls, "cpu") / "cpu.idle").read_text().strip() == "0"


def test_explain_lists_request_and_host_changes(proxy: Any, pods: Any) -> None:
    rt = proxy.runtime()
    pod = pods.sandbox("explained", qos="besteffort", labels={"koordinator.sh/qosClass": "BE"})
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    sid = pods.run(rt, pod)
    cid = pods.create(rt, sid, pod, pods.container("app", resources=cri.LinuxContainerResources(cpu_shares=2)))
    pods.start(rt, cid)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        [sys.executable, "-m", "runtimeproxy.cli", "explain", "krp-test/explained", "--endpoint", proxy.endpoint],
        capture_output=True, text=True, timeout=30, env=env, check=False,
    )
    assert out.returncode == 0, out.stderr
    idle = str(pods.pod_dir(pod, "cpu") / "cpu.idle")
    assert f"[PreRunPodSandbox] group-identity: host:{idle}: 0 -> 1" in out.stdout
    assert "[PreCreateContainer] cpuset: container.resources.cpuset_cpus:" in out.stdout
    assert "unbound BE pod gets the BE share pool" in out.stdout, out.stdout


def _cpus_under(top: Path, cpus: str, *, narrowing: bool) -> None:
    """``cpuset.cpus`` of ``top`` and every cgroup under it, as CPU suppression writes them
    (v1: children before their parent when narrowing, EBUSY otherwise; parents first when
    widening, EACCES otherwise)."""
    dirs = [top, *sorted((d for d in top.rglob("*") if d.is_dir()), key=lambda d: len(d.parts))]
    for d in reversed(dirs) if narrowing else dirs:
        (d / "cpuset.cpus").write_text(cpus)


def test_a_be_container_starts_while_be_is_cpuset_suppressed(proxy: Any, pods: Any) -> None:
    """CPU suppression (policy cpuset, Koordinator's default) narrows the besteffort tier
    and every cgroup under it. A BE container created then is given the BE share pool
    within its pod's CPUs: given the whole pool, runc's write of a cpuset wider than its
    pod's was refused (EACCES) and the container did not start while BE was suppressed."""
    rt = proxy.runtime()
    pod = pods.sandbox("be-suppressed", qos="besteffort", labels={"koordinator.sh/qosClass": "BE"})
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    sid = pods.run(rt, pod)
    tier = pods.pod_dir(pod, "cpuset").parent
    online, one = (tier / "cpuset.cpus").read_text().strip(), _last_online_cpu()
    if one == online:
        pytest.skip("a single CPU: nothing to narrow BE to")
    _cpus_under(tier, one, narrowing=True)
    try:
        cid = pods.create(rt, sid, pod, pods.container("app"))
        pods.start(rt, cid)
        assert pods.cgroup_value(pod, cid, "cpuset", "cpuset.cpus") == one
        assert (pods.pod_dir(pod, "cpuset") / "cpuset.cpus").read_text().strip() == one  # not widened
    finally:
        _cpus_under(tier, online, narrowing=False)
