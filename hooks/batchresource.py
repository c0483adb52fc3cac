"""BatchResource: cgroup limits for BE pods from their batch resources.

Koordinator schedules BE (best-effort, co-located) pods on reclaimed capacity
and gives them ``kubernetes.io/batch-cpu`` / ``batch-memory`` instead of cpu and
memory. Kubelet knows nothing of these, so it starts BE pods with no limits at
all (kube BestEffort). This hook gives them what they were scheduled for:

* PreRunPodSandbox — the pod cgroup (kubelet has created it before calling
  RunPodSandbox) gets ``cpu.shares`` from the summed batch-cpu requests, a CFS
  quota from the summed limits and a memory limit, written through the executor
  (v1 or v2 files). Each file actually changed is reported in the patch's
  ``writes`` (unchanged files are neither rewritten nor reported); the values
  also go into the returned PodPatch's resources for the record.
* PreCreateContainer / PreUpdateContainerResources — the container's values go
  into the CRI request, so the runtime creates the container with them.

Formulas (Koordinator ``MilliCPUToShares`` / ``MilliCPUToQuota``):
shares = clamp(milli·1024/1000, 2, 262144); quota = milli·100 (at least 1000,
-1 when unlimited); memory limit = batch-memory limit (unlimited when missing).
With ``resourceUsedThresholdWithBE: {enable: true, cpuSuppressPolicy: cfsQuota}``
quotas are -1: the BE tier as a whole is throttled instead.

args: ``cgroup_driver`` (cgroupfs | systemd, default cgroupfs), ``cgroup_version``
(auto | 1 | 2, default auto).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

from hooks.annotations import BATCH_CPU, BATCH_MEMORY, ContainerResources, ExtendedResourceSpec, extended_resource_spec
from hooks.cgroups import (
    CPU_CFS_QUOTA,
    CPU_SHARES,
    MAX_SHARES,
    MEMORY_LIMIT,
    MIN_SHARES,
    CgroupError,
    CgroupLayout,
    Driver,
    Version,
    pod_cgroup_dir,
)
from hooks.executor import CgroupExecutor, Update, Write
from hooks.hookargs import cgroup_args, host_writes, reject_unknown
from hooks.qos import QoSClass, pod_name, pod_qos
from hooks.rules import Rules, parse_rules
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerPatch,
    HookConfigError,
    HookError,
    HookInit,
    PodContext,
    PodInfo,
    PodPatch,
    ResourcesPatch,
)

MIN_QUOTA: Final = 1000
_ARGS: Final = frozenset({"cgroup_driver", "cgroup_version"})


def milli_cpu_to_shares(milli: int) -> int:
    if milli <= 0:
        return MIN_SHARES
    return max(MIN_SHARES, min(MAX_SHARES, milli * 1024 // 1000))


def milli_cpu_to_quota(milli: int | None) -> int:
    if milli is None or milli <= 0:
        return -1
    return max(MIN_QUOTA, milli * 100)


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """What one pod or container gets: shares, quota (-1 = none), memory (-1 = none)."""

    cpu_shares: int
    cpu_quota: int
    memory_limit: int

    def patch(self) -> ResourcesPatch:
        return ResourcesPatch(
            cpu_shares=self.cpu_shares,
            cpu_quota=self.cpu_quota,
            memory_limit_in_bytes=self.memory_limit if self.memory_limit > 0 else None,
        )


def _has_batch(res: ContainerResources) -> bool:
    return any(r in values for values in (res.requests, res.limits) for r in (BATCH_CPU, BATCH_MEMORY))


def container_limits(res: ContainerResources, suppress_quota: bool) -> BatchLimits:
    quota = -1 if suppress_quota else milli_cpu_to_quota(res.limits.get(BATCH_CPU))
    memory = res.limits.get(BATCH_MEMORY, -1)
    return BatchLimits(milli_cpu_to_shares(res.requests.get(BATCH_CPU, 0)), quota, memory if memory > 0 else -1)


def pod_limits(spec: ExtendedResourceSpec, suppress_quota: bool) -> BatchLimits:
    requests = sum(res.requests.get(BATCH_CPU, 0) for res in spec.containers.values())
    cpu_limit = spec.total("limits", BATCH_CPU)
    memory = spec.total("limits", BATCH_MEMORY)
    quota = -1 if suppress_quota else milli_cpu_to_quota(cpu_limit)
    return BatchLimits(milli_cpu_to_shares(requests), quota, memory if memory else -1)



def _parse_args(init: HookInit) -> tuple[Driver, Version | Literal["auto"]]:
    args: dict[str, Any] = dict(init.args)
    reject_unknown(init, args, _ARGS)
    return cgroup_args(init, args)


class BatchResource:
    """Stages: PreRunPodSandbox, PreCreateContainer, PreUpdateContainerResources."""

    def __init__(self, init: HookInit) -> None:
        driver, version = _parse_args(init)
        self.rules: Rules = parse_rules(init.rules)
        try:
            self.layout = CgroupLayout(init.host.cgroup, version, driver)
        except CgroupError as exc:
            raise HookConfigError(f"{init.key_path}.cgroup_version", version, str(exc)) from exc
        self.executor = CgroupExecutor(self.layout)
        self.last_writes: list[Write] = []  # the last pod's writes, for debugging and tests

    @property
    def _suppress_quota(self) -> bool:
        threshold = self.rules.resource_used_threshold_with_be
        return threshold.enable and threshold.cpu_suppress_policy == "cfsQuota"

    def _batch_spec(self, pod: PodInfo) -> ExtendedResourceSpec | None:
        if pod_qos(pod) is not QoSClass.BE:
            return None
        spec = extended_resource_spec(pod)
        if spec is None or not any(_has_batch(res) for res in spec.containers.values()):
            return None
        return spec

    def pre_run_pod_sandbox(self, ctx: PodContext) -> PodPatch | None:
        pod = ctx.pod
        spec = self._batch_spec(pod)
        if spec is None:
            return None
        limits = pod_limits(spec, self._suppress_quota)
        source = f"pod {pod_name(pod)}: cgroup_parent {pod.cgroup_parent!r}"
        try:
            cgroup = pod_cgroup_dir(pod.cgroup_parent, self.layout.driver)
        except CgroupError as exc:
            raise HookError(f"pod {pod_name(pod)}: {exc}") from exc
        reason = "BE pod batch resources"
        writes = self.executor.apply(
            [
                Update(cgroup, CPU_SHARES, limits.cpu_shares, f"{reason}: batch-cpu requests", source),
                Update(cgroup, CPU_CFS_QUOTA, limits.cpu_quota, f"{reason}: batch-cpu limits", source),
                Update(cgroup, MEMORY_LIMIT, limits.memory_limit, f"{reason}: batch-memory limits", source),
            ]
        )
        self.last_writes = writes
        done = host_writes(writes)
        return PodPatch(
            resources=limits.patch(), reason=reason if done else f"{reason} (pod cgroup already set)", writes=done
        )

    def _container_patch(self, ctx: ContainerContext) -> ContainerPatch | None:
        spec = self._batch_spec(ctx.pod)
        if spec is None:
            return None
        res = spec.containers.get(ctx.container.meta.name)
        if res is None or not _has_batch(res):
            return None
        limits = container_limits(res, self._suppress_quota)
        return ContainerPatch(resources=limits.patch(), reason="BE container batch resources")

    def pre_create_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        return self._container_patch(ctx)

    def pre_update_container_resources(self, ctx: ContainerContext) -> ContainerPatch | None:
        return self._container_patch(ctx)
