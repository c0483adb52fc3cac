"""The example cpu-shares hook, end to end: proxy process -> containerd -> runc -> cgroupfs.

Every assertion reads the real ``cpu.shares`` file runc wrote for the container
(cgroupfs driver: ``/sys/fs/cgroup/cpu/<cgroup_parent>/<container id>``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from criapi import cri_v1_pb2 as cri

ANNOTATION = "example.koordinator.sh/cpu-shares"
SKIP_LABEL = "runtimeproxy.koordinator.sh/skip-hookserver"
REQUESTED = 512


def shares_hook(policy: str) -> dict[str, Any]:
    return {"name": "shares", "plugin": "example-cpu-shares", "failure_policy": policy, "args": {"cpu_shares": 300}}


@pytest.fixture(scope="module")
def proxy_config(data_plane: dict[str, Any]) -> dict[str, Any]:
    """Through both data planes: with HAProxy the lifecycle calls reach the hooks by its routing."""
    return {"hooks": [shares_hook("Fail")], **data_plane}


def _container(pods: Any) -> cri.ContainerConfig:
    return pods.container("app", resources=cri.LinuxContainerResources(cpu_shares=REQUESTED,
                                                                       memory_limit_in_bytes=64 << 20))


def _create(pods: Any, rt: Any, name: str, **pod_kw: Any) -> tuple[cri.PodSandboxConfig, str, str]:
    pod = pods.sandbox(name, **pod_kw)
    sid = pods.run(rt, pod)
    cid = pods.create(rt, sid, pod, _container(pods))
    return pod, sid, cid


def test_hook_default_lands_in_cgroupfs(proxy: Any, pods: Any) -> None:
    rt = proxy.runtime()
    pod, _, cid = _create(pods, rt, "shares-default")
    pods.start(rt, cid)
    assert pods.cpu_shares(pod, cid) == 300
    # What containerd stored is the patched request; the untouched fields stayed.
    status = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=10).status
    assert status.state == cri.CONTAINER_RUNNING
    assert pods.cgroup_value(pod, cid, "memory", "memory.limit_in_bytes") == str(64 << 20)


def test_pod_annotation_overrides_default(proxy: Any, pods: Any) -> None:
    rt = proxy.runtime()
    pod, _, cid = _create(pods, rt, "shares-annotated", annotations={ANNOTATION: "700"})
    pods.start(rt, cid)
    assert pods.cpu_shares(pod, cid) == 700


def test_skip_label_keeps_requested_value(proxy: Any, pods: Any) -> None:
    rt = proxy.runtime()
    pod, _, cid = _create(pods, rt, "shares-skipped", labels={SKIP_LABEL: "true"},
                          annotations={ANNOTATION: "700"})
    pods.start(rt, cid)
    assert pods.cpu_shares(pod, cid) == REQUESTED


def test_bad_annotation_with_fail_policy_rejects_create(proxy: Any, pods: Any) -> None:
    rt = proxy.runtime()
    pod = pods.sandbox("shares-bad-fail", annotations={ANNOTATION: "abc"})
    sid = pods.run(rt, pod)
    with pytest.raises(grpc.RpcError) as err:
        pods.create(rt, sid, pod, _container(pods))
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    details = err.value.details()
    assert "'shares'" in details and "PreCreateContainer" in details and "'abc'" in details
    # Nothing was forwarded: containerd has no container in that pod.
    listed = rt.ListContainers(cri.ListContainersRequest(filter=cri.ContainerFilter(pod_sandbox_id=sid)), timeout=10)
    assert not listed.containers
    proxy.wait_event("cri_call_rejected", hook="shares", stage="PreCreateContainer", pod_name="shares-bad-fail")


def test_bad_annotation_with_ignore_policy_keeps_requested_value(proxy_factory: Any, pods: Any) -> None:
    ignoring = proxy_factory.start([shares_hook("Ignore")])
    rt = ignoring.runtime()
    pod, _, cid = _create(pods, rt, "shares-bad-ignore", annotations={ANNOTATION: "abc"})
    pods.start(rt, cid)
    assert pods.cpu_shares(pod, cid) == REQUESTED
    failed = ignoring.wait_event("hook_failed", hook="shares", policy="Ignore", pod_name="shares-bad-ignore")
    assert "abc" in failed["reason"]


def test_explain_shows_the_change_and_the_hook(proxy: Any, pods: Any) -> None:
    rt = proxy.runtime()
    pod, sid, cid = _create(pods, rt, "shares-explained")
    pods.start(rt, cid)
    script = Path(sys.executable).with_name("koord-runtime-proxy")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "runtimeproxy.cli"]
    ref = f"{pod.metadata.namespace}/{pod.metadata.name}"
    out = subprocess.run([*cmd, "explain", ref, "--endpoint", proxy.endpoint],
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    assert f"pod {ref} uid={pod.metadata.uid} sandbox={sid[:13]}" in out.stdout
    assert f"cgroup_parent={pod.linux.cgroup_parent}" in out.stdout
    assert (f"[PreCreateContainer] shares: container.resources.cpu_shares: {REQUESTED} -> 300  (example default)"
            in out.stdout), out.stdout
    assert pods.cgroup_value(pod, cid, "cpu", "cpu.shares") == "300"

    missing = subprocess.run([*cmd, "explain", "krp-test/no-such-pod", "--endpoint", proxy.endpoint],
                             capture_output=True, text=True, timeout=30, check=False)
    assert missing.returncode == 1 and "no-such-pod" in missing.stderr
