"""batch-resource through the real proxy, containerd and cgroup v1 (issue 3).

kubelet creates the pod cgroup before RunPodSandbox; the test does the same (under
the run's unique prefix), so the hook's PreRunPodSandbox write lands in a real
cgroup, and the container's values travel in the CRI request to runc.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo.scenario import kubelet_creates_pod_cgroup

SPEC = "node.koordinator.sh/extended-resource-spec"


@pytest.fixture(scope="module")
def proxy_config() -> dict[str, Any]:
    return {"hooks": [{"name": "batch", "plugin": "batch-resource", "failure_policy": "Fail"}]}




def test_be_pod_gets_batch_limits_in_pod_and_container_cgroups(proxy: Any, pods: Any) -> None:
    rt = proxy.runtime()
    spec = {"containers": {"app": {
        "requests": {"kubernetes.io/batch-cpu": "500", "kubernetes.io/batch-memory": str(128 << 20)},
        "limits": {"kubernetes.io/batch-cpu": "1000", "kubernetes.io/batch-memory": str(256 << 20)},
    }}}
    pod = pods.sandbox("batch-be", qos="besteffort", labels={"koordinator.sh/qosClass": "BE"},
                       annotations={SPEC: json.dumps(spec)})
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    sid = pods.run(rt, pod)
    # Pod level, written by the hook at PreRunPodSandbox: 500m -> 512 shares, 1000m -> 100000 us quota.
    assert (pods.pod_dir(pod, "cpu") / "cpu.shares").read_text().strip() == "512"
    assert (pods.pod_dir(pod, "cpu") / "cpu.cfs_quota_us").read_text().strip() == "100000"
    assert (pods.pod_dir(pod, "memory") / "memory.limit_in_bytes").read_text().strip() == str(256 << 20)
    # Container level, carried in the CRI request: runc writes the same values.
    cid = pods.create(rt, sid, pod, pods.container("app", resources=cri.LinuxContainerResources(cpu_shares=2)))
    pods.start(rt, cid)
    assert pods.cgroup_value(pod, cid, "cpu", "cpu.shares") == "512"
    assert pods.cgroup_value(pod, cid, "cpu", "cpu.cfs_quota_us") == "100000"
    assert pods.cgroup_value(pod, cid, "memory", "memory.limit_in_bytes") == str(256 << 20)


def test_bad_batch_annotation_fails_the_sandbox_naming_pod_and_key(proxy: Any, pods: Any) -> None:
    import grpc

    rt = proxy.runtime()
    pod = pods.sandbox("batch-bad", qos="besteffort", labels={"koordinator.sh/qosClass": "BE"},
                       annotations={SPEC: '{"containers": {"app": {"requests": {"kubernetes.io/batch-cpu": "-5"}}}}'})
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    with pytest.raises(grpc.RpcError) as err:
        pods.run(rt, pod)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "batch" in err.value.details() and "batch-bad" in err.value.details() and SPEC in err.value.details()
    # Nothing was written: a new cgroup keeps the kernel's default shares.
    assert (pods.pod_dir(pod, "cpu") / "cpu.shares").read_text().strip() == "1024"
