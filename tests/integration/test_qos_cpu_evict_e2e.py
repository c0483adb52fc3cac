"""Node CPU eviction (``cpu-evict``) on a real node through the proxy and a real containerd.

The threshold is 1 % of the node's CPUs (lower 0): a pod that opted in with
``koordinator.sh/eviction-enabled: "true"`` and burns a CPU must be evicted (its
containers and sandbox stopped through the runtime, reason logged, counted); an LS pod
without the label keeps running. Only cpu-evict is listed, so nothing else evicts.
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo.scenario import kubelet_creates_pod_cgroup

EVICT_TIMEOUT = 45.0  # a few pod ticks, a 10 s window a third full, a flush, a round
BURN = ("sh", "-c", "while :; do :; done")


@pytest.fixture(scope="module")
def proxy_config(cgroup_prefix: str, db_dir: Path) -> dict[str, Any]:
    return {
        "rules": {"resourceUsedThresholdWithBE": {
            "enable": True, "cpuEvictThresholdPercent": 1, "cpuEvictLowerPercent": 0,
            "cpuEvictTimeWindowSeconds": 10}},
        "tasks": {
            "metrics": {"db": str(db_dir / "m.db"), "schedlat_source": "off", "memlat_source": "off", "cpi": False},
            "qos-manager": {"besteffort_dir": f"{cgroup_prefix.strip('/')}/kubepods/besteffort",
                            "fast_path": False, "strategies": ["cpu-evict"]},
        },
    }


def _state(rt: Any, cid: str) -> int:
    state: int = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=10).status.state
    return state


def _sandbox_state(rt: Any, sid: str) -> int:
    state: int = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=sid), timeout=10).status.state
    return state


def test_node_cpu_over_the_threshold_evicts_the_opted_in_pod(proxy: Any, pods: Any) -> None:
    rt = proxy.runtime()
    ls_pod = pods.sandbox("ls-stay", qos="burstable", labels={"koordinator.sh/qosClass": "LS"})
    kubelet_creates_pod_cgroup(ls_pod.linux.cgroup_parent)
    ls_sid = pods.run(rt, ls_pod)
    ls_cid = pods.create(rt, ls_sid, ls_pod, pods.container("ls"))
    pods.start(rt, ls_cid)
    hot = pods.sandbox("be-hot", qos="besteffort",
                       labels={"koordinator.sh/qosClass": "BE", "koordinator.sh/eviction-enabled": "true"})
    kubelet_creates_pod_cgroup(hot.linux.cgroup_parent)
    hot_sid = pods.run(rt, hot)
    hot_cid = pods.create(rt, hot_sid, hot, pods.container("burn", command=BURN))
    pods.start(rt, hot_cid)

    event = proxy.wait_event("pod_evicted", timeout=EVICT_TIMEOUT, pod="krp-test/be-hot")
    assert event["strategy"] == "cpu_evict" and "node cpu" in event["reason"], event
    deadline = time.monotonic() + EVICT_TIMEOUT
    while _sandbox_state(rt, hot_sid) != cri.SANDBOX_NOTREADY and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _state(rt, hot_cid) != cri.CONTAINER_RUNNING
    assert _sandbox_state(rt, hot_sid) == cri.SANDBOX_NOTREADY
    assert _state(rt, ls_cid) == cri.CONTAINER_RUNNING  # not opted in: never a candidate
    assert not proxy.events("pod_evicted", pod="krp-test/ls-stay")
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    counted = [line for line in text.splitlines()
               if line.startswith("koordlet_pod_eviction_total{") and "EvictPodByNodeCPUUsage" in line]
    assert counted and float(counted[0].rsplit(" ", 1)[1]) >= 1, counted
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.metrics_port}/debug/explain", timeout=5) as resp:
        explained = resp.read().decode()
    assert "cpu_evict" in explained and "node_cpu_window" in explained
