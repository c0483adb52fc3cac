"""End-to-end check of the private containerd used by the proxy tests.

Besides proving the fixture works, this pins down the cgroup layout that
containerd 1.6 + runc produce with the cgroupfs driver, which the proxy's
resource hooks rely on: pod at ``<cgroup_parent>``, each container (and the
sandbox) at ``<cgroup_parent>/<container id>`` in every v1 hierarchy and in
the unified (v2) tree on hybrid hosts.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import grpc

from criapi import cri_v1_pb2
from runtimeproxy.demo.devpods import container_config, kube_cgroup_parent, sandbox_config
from runtimeproxy.demo.embedded import EmbeddedContainerd, runtime_stub

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMORY_LIMIT = 64 * 1024 * 1024


def _read(path: Path) -> str:
    return path.read_text().strip()


def test_pod_lifecycle_and_cgroups(
    containerd: EmbeddedContainerd,
    busybox_image: str,
    cgroup_prefix: str,
    cri_channel_factory: Callable[[Path | str], grpc.Channel],
    tmp_path: Path,
) -> None:
    rt = runtime_stub(cri_channel_factory(containerd.socket))

    version = rt.Version(cri_v1_pb2.VersionRequest(), timeout=5)
    assert version.runtime_name == "containerd"
    assert version.runtime_api_version == "v1"
    conditions = {c.type: c.status for c in rt.Status(cri_v1_pb2.StatusRequest(), timeout=5).status.conditions}
    assert conditions == {"RuntimeReady": True, "NetworkReady": True}

    uid = str(uuid.uuid4())
    parent = kube_cgroup_parent(cgroup_prefix, "besteffort", uid)
    pod = sandbox_config(name="e2e", namespace="default", uid=uid, cgroup_parent=parent,
                         log_dir=str(tmp_path / "logs"))
    sandbox_id = rt.RunPodSandbox(cri_v1_pb2.RunPodSandboxRequest(config=pod), timeout=60).pod_sandbox_id
    try:
        resources = cri_v1_pb2.LinuxContainerResources(cpu_shares=512, memory_limit_in_bytes=MEMORY_LIMIT)
        cfg = container_config(name="sleeper", image=busybox_image, command=["sleep", "3600"],
                               resources=resources, envs={"FOO": "bar"})
        cid = rt.CreateContainer(cri_v1_pb2.CreateContainerRequest(
            pod_sandbox_id=sandbox_id, config=cfg, sandbox_config=pod), timeout=60).container_id
        rt.StartContainer(cri_v1_pb2.StartContainerRequest(container_id=cid), timeout=60)

        status = rt.ContainerStatus(cri_v1_pb2.ContainerStatusRequest(container_id=cid), timeout=10).status
        assert status.state == cri_v1_pb2.CONTAINER_RUNNING

        rel = parent.lstrip("/")
        # cgroupfs driver: cgroupsPath = <cgroup_parent>/<id>, same for the sandbox.
        assert _read(CGROUP_ROOT / "cpu" / rel / cid / "cpu.shares") == "512"
        assert _read(CGROUP_ROOT / "memory" / rel / cid / "memory.limit_in_bytes") == str(MEMORY_LIMIT)
        assert (CGROUP_ROOT / "cpu" / rel / sandbox_id).is_dir()
        # hybrid host: runc also joins the controller-less v2 tree.
        assert (CGROUP_ROOT / "unified" / rel / cid / "cpu.stat").is_file()
        assert (CGROUP_ROOT / "unified" / rel / sandbox_id).is_dir()

        out = rt.ExecSync(cri_v1_pb2.ExecSyncRequest(
            container_id=cid, cmd=["sh", "-c", "echo hi; echo $FOO"], timeout=10), timeout=30)
        assert out.exit_code == 0
        assert out.stdout == b"hi\nbar\n"

        # sleep is PID 1 and ignores SIGTERM: a short grace period ends in SIGKILL.
        rt.StopContainer(cri_v1_pb2.StopContainerRequest(container_id=cid, timeout=1), timeout=30)
        stopped = rt.ContainerStatus(cri_v1_pb2.ContainerStatusRequest(container_id=cid), timeout=10).status
        assert stopped.state == cri_v1_pb2.CONTAINER_EXITED
        rt.RemoveContainer(cri_v1_pb2.RemoveContainerRequest(container_id=cid), timeout=30)
        assert not (CGROUP_ROOT / "cpu" / rel / cid).exists()
    finally:
        rt.StopPodSandbox(cri_v1_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60)
        rt.RemovePodSandbox(cri_v1_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60)
    assert not rt.ListPodSandbox(cri_v1_pb2.ListPodSandboxRequest(), timeout=10).items
    assert not (CGROUP_ROOT / "cpu" / rel / sandbox_id).exists()
