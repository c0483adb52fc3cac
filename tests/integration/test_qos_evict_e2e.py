"""Issue 5 on a real node: BE memory eviction through the proxy and a real containerd.

The memory threshold is set below what this node always uses, so the manager must
evict: the BE pod's containers are stopped through the runtime (StopContainer), the
LS pod is left alone, the eviction is logged with its reason and counted on /metrics.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo import kubelet_creates_pod_cgroup

#: Made by ``_remove_db_dir`` (not at import: a module collected but not run left it behind).
DB_DIR = Path(tempfile.gettempdir(), f"krpt-evict-{uuid.uuid4().hex}")
SPEC = "node.koordinator.sh/extended-resource-spec"


@pytest.fixture(scope="module")
def proxy_config(cgroup_prefix: str) -> dict[str, Any]:
    return {
        "rules": {"resourceUsedThresholdWithBE": {
            "enable": True, "cpuSuppressPolicy": "cfsQuota",
            "memoryEvictThresholdPercent": 1, "memoryEvictLowerPercent": 0}},
        "tasks": {
            "metrics": {"db": str(DB_DIR / "m.db"), "schedlat_source": "off", "cpi": False},
            "qos-manager": {"besteffort_dir": f"{cgroup_prefix.strip('/')}/kubepods/besteffort"},
        },
    }


@pytest.fixture(scope="module", autouse=True)
def _remove_db_dir() -> Iterator[None]:
    DB_DIR.mkdir(mode=0o700)
    yield
    shutil.rmtree(DB_DIR, ignore_errors=True)


def _state(rt: Any, cid: str) -> int:
    state: int = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=10).status.state
    return state


def test_memory_pressure_evicts_the_be_pod_not_the_ls_pod(proxy: Any, pods: Any) -> None:
    rt = proxy.runtime()
    batch = {"containers": {"be": {"requests": {"kubernetes.io/batch-cpu": "500",
                                                "kubernetes.io/batch-memory": str(64 << 20)}}}}
    ls_pod = pods.sandbox("ls-keep", qos="burstable", labels={"koordinator.sh/qosClass": "LS"})
    kubelet_creates_pod_cgroup(ls_pod.linux.cgroup_parent)
    ls_sid = pods.run(rt, ls_pod)
    ls_cid = pods.create(rt, ls_sid, ls_pod, pods.container("ls"))
    pods.start(rt, ls_cid)
    be_pod = pods.sandbox("be-victim", qos="besteffort", labels={"koordinator.sh/qosClass": "BE"},
                          annotations={SPEC: json.dumps(batch)})
    kubelet_creates_pod_cgroup(be_pod.linux.cgroup_parent)
    be_sid = pods.run(rt, be_pod)
    be_cid = pods.create(rt, be_sid, be_pod, pods.container("be"))
    pods.start(rt, be_cid)

    event = proxy.wait_event("pod_evicted", timeout=20)
    assert event["pod"] == "krp-test/be-victim"
    assert "memory" in event["reason"], event
    deadline = time.monotonic() + 10
    while _state(rt, be_cid) != cri.CONTAINER_EXITED and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _state(rt, be_cid) == cri.CONTAINER_EXITED
    assert _state(rt, ls_cid) == cri.CONTAINER_RUNNING
    assert not proxy.events("pod_evicted", pod="krp-test/ls-keep")
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    counted = [line for line in text.splitlines() if line.startswith("koordlet_pod_eviction_total{")]
    assert counted and float(counted[0].rsplit(" ", 1)[1]) >= 1, counted
