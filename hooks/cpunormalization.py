"""CPUNormalization: a CPU limit means the same amount of work on fast and slow nodes.

Why: a cluster mixes CPU models; one core of a new machine does more than one
core of an old one. Koordinator scores each node with a
``node.koordinator.sh/cpu-normalization-ratio`` (> 1 on faster nodes) and
scales allocatable up by it, so a "2 CPU" limit must shrink there by the same
ratio or the pod gets more than it was sold. This is koordlet's
``CPUNormalization`` hook: at PreCreateContainer and PreUpdateContainerResources
a container's CFS quota becomes ``ceil(quota / ratio)`` (kept at the kernel's
1000 µs minimum).

Only pods whose limit is a quota are normalized: LS, LSR, BE and class-less
pods with ``cpu_quota > 0``. LSE and SYSTEM pods, and pods bound to CPUs by
``scheduling.koordinator.sh/resource-status`` (their quota is unset anyway),
are left alone. Run it after the hooks that set quotas (batch-resource, cpuset)
so it sees their values.

The division is exact (the ratio is taken as the decimal it was written as), so
``120000 / 1.2`` is 100000, not the 100001 that binary floating point gives.

ReconcileContainer (the reconciler's pass) keeps the container cgroup's CFS
quota (``<pod cgroup>/<container id>``: v1 ``cpu.cfs_quota_us``, v2 the quota
half of ``cpu.max``) at the normalized value, for the same containers as above.
The value is *not* computed again: ``ctx.container.resources.cpu_quota`` is
what the proxy forwarded to the runtime, i.e. already divided by this hook at
PreCreateContainer / PreUpdateContainerResources (and after a proxy restart
the store relearns it from the runtime, which holds the forwarded request).
Dividing it again would shrink the quota by the ratio on every pass, so the
stored quota is the desired value as it is. (A container created while the
proxy was down was never normalized; its stored quota is kubelet's and is kept
as such: the reconciler cannot tell the two apart, and never dividing twice is
the safe side.)

args: ``ratio`` — the node's ratio (number or string, as the node annotation
carries it), in [1.0, 5.0]; absent, null or 1 disables the hook.
``cgroup_driver`` (cgroupfs | systemd), ``cgroup_version`` (auto | 1 | 2): the
container cgroups the reconciler writes (the tree is looked at on first use, so
the CRI-only stages work without one). ``dry_run`` (bool, default false): the reconciler's
write is only reported, once per planned value (``hooks.dryrun``); requests still patched.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path
from typing import Any, Final, Literal

from hooks.annotations import resource_status
from hooks.cgroups import CPU_CFS_QUOTA, CgroupError, Driver, Version, container_cgroup_dir
from hooks.dryrun import DryRunLedger, dry_run_arg, patch_reason, planned_writes
from hooks.executor import CgroupExecutor, Update
from hooks.hookargs import cgroup_args, host_writes, open_executor
from hooks.qos import QoSClass, pod_name
from hooks.rules import LiveRules, Rules
from runtimeproxy.config.configvalues import reject_unknown
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerPatch,
    HookConfigError,
    HookError,
    HookInit,
    ResourcesPatch,
)

RATIO_ANNOTATION: Final = "node.koordinator.sh/cpu-normalization-ratio"
MIN_RATIO: Final = Fraction(1)
MAX_RATIO: Final = Fraction(5)
MIN_QUOTA: Final = 1000
_ARGS: Final = frozenset({"ratio", "cgroup_driver", "cgroup_version", "dry_run"})
_NORMALIZED: Final = frozenset({QoSClass.LS, QoSClass.LSR, QoSClass.BE, QoSClass.NONE})


def parse_ratio(raw: object) -> Fraction | None:
    """The ratio as an exact fraction (``None`` for null); ValueError when malformed or out of range."""
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise ValueError("expected a number like 1.2")
    text = raw.strip() if isinstance(raw, str) else repr(raw)
    try:
        value = float(text)
    except ValueError:
        raise ValueError("expected a number like 1.2") from None
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    try:
        ratio = Fraction(text)
    except ValueError:
        raise ValueError("expected a number like 1.2") from None
    if not MIN_RATIO <= ratio <= MAX_RATIO:
        raise ValueError(f"must be in [{float(MIN_RATIO)}, {float(MAX_RATIO)}]")
    return ratio


def normalize_quota(quota: int, ratio: Fraction) -> int:
    """``ceil(quota / ratio)``, at least the kernel minimum."""
    return max(MIN_QUOTA, math.ceil(quota / ratio))


class CPUNormalization:
    """Stages: PreCreateContainer, PreUpdateContainerResources, ReconcileContainer."""

    def __init__(self, init: HookInit) -> None:
        self._rules = LiveRules(init)
        args: dict[str, Any] = dict(init.args)
        reject_unknown(args, _ARGS, f"{init.key_path}.")
        try:
            ratio = parse_ratio(args.get("ratio"))
        except ValueError as exc:
            raise HookConfigError(f"{init.key_path}.ratio", args.get("ratio"), str(exc)) from exc
        self.ratio_text = str(args.get("ratio")).strip()
        self.ratio: Fraction | None = ratio if ratio is not None and ratio > 1 else None
        driver, version = cgroup_args(init, args)
        self._cgroup: tuple[Path, Version | Literal["auto"], Driver] = (init.host.cgroup, version, driver)
        self._backoff = init.services.write_backoff
        self._executor: CgroupExecutor | None = None
        self.dry_run = dry_run_arg(init, args)
        self._ledger = DryRunLedger("cpu-normalization")

    @property
    def rules(self) -> Rules:
        """The rules in force now: the YAML, with the NodeSLO merged over it when there is one."""
        return self._rules()

    def _applies(self, ctx: ContainerContext) -> QoSClass | None:
        """The pod's class when its container's quota is normalized, else ``None``."""
        if self.ratio is None or ctx.container.resources.cpu_quota <= 0:
            return None
        qos = self.rules.qos_of(ctx.pod)
        if qos not in _NORMALIZED:
            return None
        status = resource_status(ctx.pod)  # a malformed annotation is a HookError, not a guess
        if status is not None and status.cpus:
            return None
        return qos

    def _patch(self, ctx: ContainerContext) -> ContainerPatch | None:
        qos = self._applies(ctx)
        if qos is None or self.ratio is None:
            return None
        quota = ctx.container.resources.cpu_quota
        new = normalize_quota(quota, self.ratio)
        if new == quota:  # already at the kernel minimum
            return None
        reason = f"{qos.value or 'no-class'} container CFS quota {quota} / cpu-normalization-ratio {self.ratio_text}"
        reason += f" = {new}" if new == math.ceil(quota / self.ratio) else f" (raised to the kernel minimum {new})"
        return ContainerPatch(resources=ResourcesPatch(cpu_quota=new), reason=reason)

    def pre_create_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        return self._patch(ctx)

    def pre_update_container_resources(self, ctx: ContainerContext) -> ContainerPatch | None:
        return self._patch(ctx)

    # --- reconciler ----------------------------------------------------------------

    def _writer(self, ctx: ContainerContext) -> CgroupExecutor:
        if self._executor is None:
            root, version, driver = self._cgroup
            self._executor = open_executor(root, version, driver, ctx.pod, self._backoff)
        return self._executor

    def reconcile_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        """Keep the container cgroup's quota at the forwarded (already normalized) value."""
        qos = self._applies(ctx)
        pod, container = ctx.pod, ctx.container
        if qos is None or not container.id:
            return None
        executor = self._writer(ctx)
        try:
            cgroup = container_cgroup_dir(pod.cgroup_parent, container.id, executor.layout.driver)
        except CgroupError as exc:
            raise HookError(f"pod {pod_name(pod)}: container {container.meta.name}: {exc}") from exc
        quota = container.resources.cpu_quota  # as forwarded: already divided, never divided again
        reason = (f"{qos.value or 'no-class'} container CFS quota {quota} as forwarded "
                  f"(normalized by cpu-normalization-ratio {self.ratio_text} at creation, not divided again)")
        source = (f"pod {pod_name(pod)}: container {container.meta.name} ({container.id}): "
                  f"cgroup_parent {pod.cgroup_parent!r}")
        update = Update(cgroup, CPU_CFS_QUOTA, quota, reason, source)
        if self.dry_run:
            planned = self._ledger.report(planned_writes(executor, [update]), pod=pod_name(pod),
                                          container=container.meta.name)
            return ContainerPatch(reason=patch_reason(reason), writes=planned) if planned else None
        writes = host_writes(executor.apply([update]))
        return ContainerPatch(reason=reason, writes=writes) if writes else None
