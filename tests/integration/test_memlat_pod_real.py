"""Memory allocation latency of real pods: containerd + runc containers made through CRI (the
fixture containerd, no proxy), one with a 32 MiB memory limit churning page cache (busybox dd
writes a 96 MiB file in its rootfs and reads it over and over; this machine has no swap, so
anonymous memory would be OOM-killed instead), one sleeping. The eBPF source maps runc's
cgroups (v1 controllers plus the unified tree on this hybrid host) to the containers: the busy
one stalls in memcg reclaim, the idle one does not."""

from __future__ import annotations

import time
from typing import Any

import pytest

from criapi import cri_v1_pb2 as cri
from hooks.qos import QoSClass
from metrics import model as m
from metrics.collect.memlat import MemLatencyCollector
from runtimeproxy.demo.scenario import kubelet_creates_pod_cgroup
from runtimeproxy.hookapi import HostRoots

pytestmark = pytest.mark.integration

WINDOW = 3.0
CHURN = ("dd if=/dev/zero of=/churn bs=1048576 count=96 2>/dev/null; "
         "while true; do dd if=/churn of=/dev/null bs=1048576 2>/dev/null; done")


def test_limited_pod_stalls_in_memcg_reclaim_idle_pod_does_not(direct_runtime: Any, pods: Any) -> None:
    views: list[m.PodView] = []
    for name, command, limit in (("busy", CHURN, 32 << 20), ("idle", "exec sleep 3600", 0)):
        pod = pods.sandbox(f"memlat-{name}", qos="burstable")
        kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
        sid = pods.run(direct_runtime, pod)
        resources = cri.LinuxContainerResources(memory_limit_in_bytes=limit) if limit else None
        cid = pods.create(direct_runtime, sid, pod, pods.container(name, command=("sh", "-c", command),
                                                                    resources=resources))
        pods.start(direct_runtime, cid)
        parent = pod.linux.cgroup_parent.strip("/")
        views.append(m.PodView(uid=pod.metadata.uid, namespace="krp-test", name=f"memlat-{name}", sandbox_id=sid,
                               qos=QoSClass.LS, priority=0, priority_class="koord-prod", cgroup_dir=parent,
                               containers=(m.ContainerView(id=cid, name=name, cgroup_dir=f"{parent}/{cid}"),)))
    busy_cid, idle_cid = (v.containers[0].id for v in views)
    assert pods.cgroup_value(pods_config(views[0]), busy_cid, "memory", "memory.limit_in_bytes") == str(32 << 20)
    time.sleep(1.0)  # the file is written; the reads churn
    collector = MemLatencyCollector(HostRoots(), prefer="ebpf", interval=WINDOW)
    try:
        collector.collect(0, views)
        if collector.source is None:
            pytest.skip(f"eBPF source unavailable: {collector.reason}")
        time.sleep(WINDOW)
        got = {(s.metric, dict(s.labels)[m.CONTAINER_ID], dict(s.labels)[m.KIND]): s.value
               for s in collector.collect(1, views)}
    finally:
        collector.close()
    stall = m.CONTAINER_MEMORY_ALLOC_STALL
    assert got[(stall, busy_cid, "memcg_reclaim")] > 0, got
    assert got[(m.CONTAINER_MEMORY_ALLOC_LATENCY_P99, busy_cid, "memcg_reclaim")] > 0, got
    for kind in ("direct_reclaim", "memcg_reclaim", "compaction"):
        assert got[(stall, idle_cid, kind)] == 0.0, got


def pods_config(view: m.PodView) -> cri.PodSandboxConfig:
    """Just enough of a sandbox config for ``PodKit.cgroup_value`` (it reads the cgroup parent)."""
    return cri.PodSandboxConfig(linux=cri.LinuxPodSandboxConfig(cgroup_parent="/" + view.cgroup_dir))
