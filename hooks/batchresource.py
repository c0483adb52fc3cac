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
* ReconcilePodSandbox / ReconcileContainer (the reconciler's pass) — the same
  values are recomputed from the annotation and the rules and re-applied through
  the executor: the pod cgroup as at PreRunPodSandbox, the container cgroup
  (``<pod cgroup>/<container id>``, or ``cri-containerd-<id>.scope`` with
  systemd) with the container's shares, CFS quota and memory limit. The
  container is written in one leveled update with its pod (parents widened
  first, children narrowed first), so a narrower pod quota or memory limit
  never fails because a container still holds the old value. Only drifted files
  are written and reported.

  The container's CFS quota is the one value another hook may change after this
  one in the lifecycle chain (cpu-normalization scales it). So when both the
  recomputed quota and the quota the proxy forwarded (``ctx.container.resources``,
  the lifecycle chain's result) are limits, the forwarded one is the desired
  value, and the two hooks agree instead of rewriting each other every pass.
  When the recomputed quota is -1 (no batch-cpu limit, or the cfsQuota suppress
  policy now on), -1 is written.

  On cgroup v1 a quota above the pod's tier's (the BE tier under cfsQuota suppression,
  say while the suppression is being switched off) would be refused (EINVAL): it is held
  at the tier's until the QoS manager lifts the tier and asks for the next pass.

Formulas (Koordinator ``MilliCPUToShares`` / ``MilliCPUToQuota``):
shares = clamp(milli·1024/1000, 2, 262144); quota = milli·100 (at least 1000,
-1 when unlimited); memory limit = batch-memory limit (unlimited when missing).
With ``resourceUsedThresholdWithBE: {enable: true, cpuSuppressPolicy: cfsQuota}``
quotas are -1: the BE tier as a whole is throttled instead.

args: ``cgroup_driver`` (cgroupfs | systemd, default cgroupfs), ``cgroup_version``
(auto | 1 | 2, default auto), ``dry_run`` (bool, default false: no cgroup file is written,
each planned value reported once, as every hook's dry-run, ``hooks.dryrun``; the
requests' resources are still patched).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Final, Literal

from hooks.annotations import BATCH_CPU, BATCH_MEMORY, ContainerResources, ExtendedResourceSpec, extended_resource_spec
from hooks.cgroups import (
    CPU_CFS_PERIOD,
    CPU_CFS_QUOTA,
    CPU_IDLE,
    CPU_SHARES,
    MAX_SHARES,
    MEMORY_LIMIT,
    MIN_SHARES,
    CgroupError,
    CgroupLayout,
    Driver,
    Version,
    container_cgroup_dir,
    pod_cgroup_dir,
)
from hooks.dryrun import DryRunLedger, dry_run_arg, patch_reason, planned_writes
from hooks.executor import CgroupExecutor, Update, Write
from hooks.hookargs import cgroup_args, host_writes
from hooks.qos import QoSClass, pod_name
from hooks.rules import LiveRules, Rules
from runtimeproxy.config.configvalues import reject_unknown
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerInfo,
    ContainerPatch,
    HookConfigError,
    HookError,
    HookInit,
    HostWrite,
    PodContext,
    PodInfo,
    PodPatch,
    ResourcesPatch,
)

MIN_QUOTA: Final = 1000
#: The CFS period kubelet and these quotas use (µs).
DEFAULT_PERIOD: Final = 100_000
_ARGS: Final = frozenset({"cgroup_driver", "cgroup_version", "dry_run"})


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


def _parse_args(init: HookInit) -> tuple[Driver, Version | Literal["auto"], bool]:
    args: dict[str, Any] = dict(init.args)
    reject_unknown(args, _ARGS, f"{init.key_path}.")
    return (*cgroup_args(init, args), dry_run_arg(init, args))


class BatchResource:
    """Stages: PreRunPodSandbox, PreCreateContainer, PreUpdateContainerResources,
    ReconcilePodSandbox, ReconcileContainer."""

    def __init__(self, init: HookInit) -> None:
        driver, version, self.dry_run = _parse_args(init)
        self._ledger = DryRunLedger("batch-resource")
        self._rules = LiveRules(init)
        try:
            self.layout = CgroupLayout(init.host.cgroup, version, driver)
        except CgroupError as exc:
            raise HookConfigError(f"{init.key_path}.cgroup_version", version, str(exc)) from exc
        self.executor = CgroupExecutor(self.layout, backoff=init.services.write_backoff)
        self.last_writes: list[Write] = []  # the last pod's writes, for debugging and tests

    @property
    def rules(self) -> Rules:
        """The rules in force now: the YAML, with the NodeSLO merged over it when there is one."""
        return self._rules()

    def _write(self, levels: list[list[Update]], pod: PodInfo) -> tuple[HostWrite, ...]:
        """The cgroup writes (leveled: the pod before its container when growing), or in
        dry run the ones that would change, reported once (``hooks.dryrun``)."""
        if self.dry_run:
            return self._ledger.report(planned_writes(self.executor, [u for level in levels for u in level]),
                                       pod=pod_name(pod))
        writes = self.executor.leveled_update(levels) if len(levels) > 1 else self.executor.apply(levels[0])
        self.last_writes = writes
        return host_writes(writes)

    def _reason(self, reason: str) -> str:
        return patch_reason(reason) if self.dry_run else reason

    @property
    def _suppress_quota(self) -> bool:
        threshold = self.rules.resource_used_threshold_with_be
        return threshold.enable and threshold.cpu_suppress_policy == "cfsQuota"

    def _batch_spec(self, pod: PodInfo) -> ExtendedResourceSpec | None:
        if self.rules.qos_of(pod) is not QoSClass.BE:
            return None
        spec = extended_resource_spec(pod)
        if spec is None or not any(_has_batch(res) for res in spec.containers.values()):
            return None
        return spec

    def _pod_updates(self, pod: PodInfo, limits: BatchLimits) -> list[Update]:
        source = f"pod {pod_name(pod)}: cgroup_parent {pod.cgroup_parent!r}"
        try:
            cgroup = pod_cgroup_dir(pod.cgroup_parent, self.layout.driver)
        except CgroupError as exc:
            raise HookError(f"pod {pod_name(pod)}: {exc}") from exc
        reason = _REASON
        quota, quota_why = self._under_tier(cgroup, limits.cpu_quota, "batch-cpu limits")
        updates = [
            Update(cgroup, CPU_CFS_QUOTA, quota, f"{reason}: {quota_why}", source),
            Update(cgroup, MEMORY_LIMIT, limits.memory_limit, f"{reason}: batch-memory limits", source),
        ]
        if not self._idle(cgroup, source):
            updates.insert(0, Update(cgroup, CPU_SHARES, limits.cpu_shares, f"{reason}: batch-cpu requests", source))
        return updates

    def _under_tier(self, pod_cgroup: PurePosixPath, quota: int, why: str) -> tuple[int, str]:
        """``quota`` held at the pod's tier's while that is lower (cgroup v1: a child above
        its parent's quota/period is refused with EINVAL). Switching cfsQuota suppression
        off restores these quotas while the QoS manager may not have lifted the BE tier
        yet: the tier goes first, and the manager asks for a pass once it has (issue 28
        item 8), which writes the full value."""
        if quota <= 0 or self.layout.version != 1 or not pod_cgroup.parent.parts:
            return quota, why
        try:
            tier = int(CPU_CFS_QUOTA.parse(self.executor.read(pod_cgroup.parent, CPU_CFS_QUOTA), 1))
            if tier <= 0:
                return quota, why  # the tier is not limited (the usual case): one read
            period = int(CPU_CFS_PERIOD.parse(self.executor.read(pod_cgroup.parent, CPU_CFS_PERIOD), 1))
        except (CgroupError, ValueError):
            return quota, why  # no readable tier: the write says what is wrong
        if period <= 0:
            return quota, why
        cap = max(tier * DEFAULT_PERIOD // period, MIN_QUOTA)
        if quota <= cap:
            return quota, why
        return cap, f"{why} ({quota}) held at the BE tier's quota {tier} until it is lifted"

    def _idle(self, cgroup: PurePosixPath, source: str) -> bool:
        """An idle (SCHED_IDLE) group's weight belongs to the kernel: writing shares
        there is refused (EINVAL), so group-identity's cpu.idle=1 wins over shares."""
        try:
            return self.executor.read(cgroup, CPU_IDLE, source).strip() == "1"
        except CgroupError:
            return False  # no cpu.idle on this kernel: shares apply as usual

    def pre_run_pod_sandbox(self, ctx: PodContext) -> PodPatch | None:
        spec = self._batch_spec(ctx.pod)
        if spec is None:
            return None
        limits = pod_limits(spec, self._suppress_quota)
        done = self._write([self._pod_updates(ctx.pod, limits)], ctx.pod)
        return PodPatch(resources=limits.patch(), writes=done,
                        reason=self._reason(_REASON if done else f"{_REASON} (pod cgroup already set)"))

    def _container_spec(self, ctx: ContainerContext) -> ContainerResources | None:
        spec = self._batch_spec(ctx.pod)
        if spec is None:
            return None
        res = spec.containers.get(ctx.container.meta.name)
        if res is None or not _has_batch(res):
            return None
        return res

    def _container_patch(self, ctx: ContainerContext) -> ContainerPatch | None:
        res = self._container_spec(ctx)
        if res is None:
            return None
        limits = container_limits(res, self._suppress_quota)
        return ContainerPatch(resources=limits.patch(), reason=_CONTAINER_REASON)

    def pre_create_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        return self._container_patch(ctx)

    def pre_update_container_resources(self, ctx: ContainerContext) -> ContainerPatch | None:
        return self._container_patch(ctx)

    # --- reconciler ----------------------------------------------------------------

    def reconcile_pod_sandbox(self, ctx: PodContext) -> PodPatch | None:
        """Re-apply the pod cgroup values of PreRunPodSandbox; report only what drifted."""
        spec = self._batch_spec(ctx.pod)
        if spec is None:
            return None
        done = self._write([self._pod_updates(ctx.pod, pod_limits(spec, self._suppress_quota))], ctx.pod)
        return PodPatch(reason=self._reason(f"{_REASON} (reconciled)"), writes=done) if done else None

    def reconcile_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        """Write the container's batch values to its cgroup (with its pod, leveled)."""
        if not ctx.container.id:
            return None
        spec = self._batch_spec(ctx.pod)
        res = self._container_spec(ctx)
        if spec is None or res is None:
            return None
        pod, container = ctx.pod, ctx.container
        limits = container_limits(res, self._suppress_quota)
        quota, quota_why = _desired_quota(limits.cpu_quota, container)
        try:
            cgroup = container_cgroup_dir(pod.cgroup_parent, container.id, self.layout.driver)
        except CgroupError as exc:
            raise HookError(f"pod {pod_name(pod)}: container {container.meta.name}: {exc}") from exc
        source = (f"pod {pod_name(pod)}: container {container.meta.name} ({container.id}): "
                  f"cgroup_parent {pod.cgroup_parent!r}")
        reason = _CONTAINER_REASON
        quota, quota_why = self._under_tier(cgroup.parent, quota, quota_why)
        container_updates = [
            Update(cgroup, CPU_SHARES, limits.cpu_shares, f"{reason}: batch-cpu requests", source),
            Update(cgroup, CPU_CFS_QUOTA, quota, f"{reason}: {quota_why}", source),
            Update(cgroup, MEMORY_LIMIT, limits.memory_limit, f"{reason}: batch-memory limits", source),
        ]
        pod_updates = self._pod_updates(pod, pod_limits(spec, self._suppress_quota))
        done = self._write([pod_updates, container_updates], pod)
        return ContainerPatch(reason=self._reason(f"{reason} (reconciled)"), writes=done) if done else None


_REASON: Final = "BE pod batch resources"
_CONTAINER_REASON: Final = "BE container batch resources"


def _desired_quota(computed: int, container: ContainerInfo) -> tuple[int, str]:
    """The container quota to keep at reconcile: see the module docstring."""
    forwarded = container.resources.cpu_quota
    if computed > 0 and forwarded > 0 and forwarded != computed:
        return forwarded, f"batch-cpu limits ({computed}) as forwarded to the runtime ({forwarded})"
    return computed, "batch-cpu limits"
