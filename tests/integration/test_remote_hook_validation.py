"""A hostile hook server in front of the real containerd: nothing it answers may
reach runc (issue 14, item 2).

The server answers ``cgroup_parent: "/../../etc/evil-<tag>"`` and cpu shares 2**60.
Before the patch validator, runc made ``/sys/fs/cgroup/<controller>/etc/evil-<tag>``;
now the proxy process (``koord-runtime-proxy run``) drops the hook's patch under
Ignore (the pod lands where kubelet asked, with kubelet's shares) and refuses the
call under Fail (containerd never sees the pod). Either way no directory appears
outside the test's cgroup parent.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from criapi import cri_v1_pb2 as cri
from criapi import hook_v1alpha1_pb2 as pb
from criapi import hook_v1alpha1_pb2_grpc as pb_grpc
from runtimeproxy.demo.embeddedcgroup import remove_cgroup_tree

CGROUP_ROOT = Path("/sys/fs/cgroup")
REQUESTED_SHARES = 512


class EvilHookServer(pb_grpc.RuntimeHookServiceServicer):
    def __init__(self, tag: str) -> None:
        self.parent = f"/../../etc/evil-{tag}"
        self.calls: list[str] = []

    def PreRunPodSandboxHook(self, request: Any, context: Any) -> Any:
        self.calls.append("PreRunPodSandboxHook")
        resp = pb.PodSandboxHookResponse(labels=request.labels, annotations=request.annotations)
        resp.cgroup_parent = self.parent
        return resp

    def PreCreateContainerHook(self, request: Any, context: Any) -> Any:
        self.calls.append("PreCreateContainerHook")
        resp = pb.ContainerResourceHookResponse(pod_cgroup_parent=self.parent)
        resp.container_resources.CopyFrom(request.container_resources)
        resp.container_resources.cpu_shares = 2**60
        return resp


@pytest.fixture
def evil_server(proxy_factory: Any) -> Iterator[tuple[EvilHookServer, Path, str]]:
    tag = uuid.uuid4().hex[:12]
    socket = proxy_factory.mkdtemp() / "evil.sock"
    fake = EvilHookServer(tag)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_RuntimeHookServiceServicer_to_server(fake, server)
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    yield fake, socket, tag
    server.stop(None).wait()
    # Only if the validator failed: take away what runc made (the pods are gone by now).
    if evil_dirs(tag):
        remove_cgroup_tree(f"/etc/evil-{tag}", timeout=5.0)
        for hierarchy in [CGROUP_ROOT, *CGROUP_ROOT.iterdir()]:
            with contextlib.suppress(OSError):
                (hierarchy / "etc").rmdir()  # the empty parent runc made too; busy or absent is fine


def evil_dirs(tag: str) -> list[Path]:
    """Any ``etc/evil-<tag>`` that runc could have made, in every hierarchy (or on /etc itself)."""
    candidates = [Path("/etc") / f"evil-{tag}", CGROUP_ROOT / "etc" / f"evil-{tag}"]
    candidates += [hierarchy / "etc" / f"evil-{tag}" for hierarchy in CGROUP_ROOT.iterdir() if hierarchy.is_dir()]
    return [path for path in candidates if path.exists()]


def test_ignore_drops_the_patch_and_runc_stays_under_the_parent(
    proxy_factory: Any, evil_server: Any, pods: Any, direct_runtime: Any
) -> None:
    server, socket, tag = evil_server
    proxy = proxy_factory.start([{"name": "evil", "remote": f"unix://{socket}", "failure_policy": "Ignore",
                                 "stages": ["PreRunPodSandbox", "PreCreateContainer"]}])
    rt = proxy.runtime()
    pod = pods.sandbox("evil-ignore")
    sid = pods.run(rt, pod)
    cid = pods.create(rt, sid, pod, pods.container("app", resources=cri.LinuxContainerResources(
        cpu_shares=REQUESTED_SHARES)))
    pods.start(rt, cid)

    assert server.calls == ["PreRunPodSandboxHook", "PreCreateContainerHook"]
    assert evil_dirs(tag) == []
    assert pods.pod_dir(pod, "cpu").is_dir()  # where kubelet asked
    assert pods.cpu_shares(pod, cid) == REQUESTED_SHARES
    status = direct_runtime.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=sid), timeout=10).status
    assert status.state == cri.SANDBOX_READY
    failed = proxy.events("hook_failed", hook="evil", policy="Ignore")
    assert [e["stage"] for e in failed] == ["PreRunPodSandbox", "PreCreateContainer"]
    assert "pod.cgroup_parent='/../../etc/evil-" in failed[0]["reason"]


def test_fail_rejects_and_containerd_never_sees_the_pod(
    proxy_factory: Any, evil_server: Any, pods: Any, direct_runtime: Any
) -> None:
    server, socket, tag = evil_server
    proxy = proxy_factory.start([{"name": "evil", "remote": f"unix://{socket}", "failure_policy": "Fail"}])
    pod = pods.sandbox("evil-fail")

    with pytest.raises(grpc.RpcError) as err:
        pods.run(proxy.runtime(), pod)

    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "pod.cgroup_parent" in err.value.details()
    assert server.calls == ["PreRunPodSandboxHook"]
    assert evil_dirs(tag) == []
    listed = direct_runtime.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=10).items
    assert pod.metadata.uid not in {item.metadata.uid for item in listed}
