"""CPUSet: containers run on the CPUs the scheduler gave them, everyone else on the share pools.

Why: koord-scheduler binds LSE/LSR pods to whole CPUs and writes the binding
into the pod annotation ``scheduling.koordinator.sh/resource-status``
(``{"cpuset": "2-3", ...}``). Kubelet knows nothing of it, so without this hook
the containers would float over every CPU and the binding would be a fiction.
Conversely, LS and BE pods must stay *off* the CPUs bound to latency-critical
pods, or binding buys nothing. This is koordlet's ``CPUSetAllocator`` hook.

* PreCreateContainer / PreUpdateContainerResources — a pod with a
  resource-status cpuset gets ``cpuset_cpus = <that set>`` and ``cpu_quota = -1``
  (a pinned container must not also be throttled; ``args.unset_cpu_quota: false``
  keeps the quota). The set is checked against the node's online CPUs (from the
  injected sys root): a scheduler on another machine can name CPUs this node
  does not have. Unbound LS pods get the LS share pool, unbound BE pods the BE
  share pool within their pod cgroup's CPUs (CPU suppression narrows the besteffort
  tier and everything under it; v1 refuses a container wider than its pod, so a BE
  container created while BE is suppressed would not start). Unbound LSE/LSR/SYSTEM
  pods are left alone (kubelet's CPU manager or another hook owns them).
* PreRunPodSandbox — for bound pods, the pod cgroup (kubelet created it before
  the call) gets its CFS quota unset (v1 ``cpu.cfs_quota_us = -1``, v2 ``cpu.max
  = "max <period>"``) through the executor, reported in ``writes``.
* PostStopPodSandbox / PostRemovePodSandbox — forget the pod's binding.
* ReconcilePodSandbox (the reconciler's pass; it runs over every pod before any
  container) — re-learn the pod's binding from its annotation, so the binding
  map, and with it the computed pools, is whole again after a restart or a
  reload; for bound pods re-apply the pod's unset CFS quota. A bound pod whose
  cgroup is gone is forgotten (its CPUs return to the pools) and reported as a
  HookError.
* ReconcileContainer — the same decision as at PreCreateContainer, written to
  the container cgroup (``<pod cgroup>/<container id>``): ``cpuset.cpus`` = the
  bound set or the current share pool (so pools follow bindings as pods come and
  go), and for bound pods ``cpu.cfs_quota_us = -1``. One leveled update with the
  pod cgroup: the pod is first widened to hold the container's CPUs (it is never
  narrowed, and an empty v2 ``cpuset.cpus``, which inherits, is left alone); a BE
  pod is never widened (its container stays within it, as at PreCreateContainer).

Share pools come from ``args.ls_pool`` / ``args.be_pool`` when given (what
koordlet publishes as the node annotations ``node.koordinator.sh/cpu-shared-pools``
and ``be-cpu-shared-pools``: a CPU list, or that annotation's list of
``{"socket", "node", "cpuset"}`` objects). Otherwise they are computed from the
bindings this hook has seen at PreCreateContainer / PreUpdateContainerResources
(kept in memory, per pod uid): LS pool = online CPUs minus LSE/LSR-bound minus
``args.reserved_cpus``; BE pool = online CPUs minus LSE-bound (as Koordinator
computes its annotations). A pool is never empty: if nothing is left, the pod
gets every online CPU and the reason says so.

The binding map is in memory. After a proxy restart or a reload the computed
pools include CPUs of bound pods until the reconciler's first pass (right after
start-up and after every reload) has re-learned them; pools given in args do
not depend on it.

args: ``ls_pool``, ``be_pool``, ``reserved_cpus`` (CPU lists), ``unset_cpu_quota``
(bool, default true), ``cgroup_driver`` (cgroupfs | systemd), ``cgroup_version``
(auto | 1 | 2), ``dry_run`` (bool, default false: no cgroup file is written, each planned
value reported once, as every hook's dry-run, ``hooks.dryrun``; requests still patched).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Final, Literal

from hooks.annotations import RESOURCE_STATUS, resource_status
from hooks.cgroups import (
    CPU_CFS_QUOTA,
    CPUSET_CPUS,
    CgroupError,
    CgroupGoneError,
    CgroupLayout,
    Driver,
    Version,
    container_cgroup_dir,
    pod_cgroup_dir,
)
from hooks.cpusets import CpuListError, check_on_node, format_cpu_list, parse_cpu_list, read_online_cpus
from hooks.dryrun import DryRunLedger, dry_run_arg, planned_writes
from hooks.executor import CgroupExecutor, Update
from hooks.hookargs import cgroup_args, host_writes, open_executor
from hooks.qos import QoSClass, pod_name
from hooks.rules import LiveRules, Rules
from runtimeproxy.config.configvalues import boolean, reject_unknown
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerPatch,
    HookConfigError,
    HookError,
    HookInit,
    HostWrite,
    LivePods,
    PodContext,
    PodInfo,
    PodPatch,
    ResourcesPatch,
)

_ARGS: Final = frozenset({"ls_pool", "be_pool", "reserved_cpus", "unset_cpu_quota", "cgroup_driver", "cgroup_version",
                          "dry_run"})
_SHOWN: Final = 200


@dataclass(frozen=True, slots=True)
class Binding:
    """A pod's scheduler binding as this hook saw it (``NONE``-class pods count as LSR, as in koordlet)."""

    qos: QoSClass
    cpus: frozenset[int]


def _fmt(cpus: frozenset[int]) -> str:
    return format_cpu_list(cpus) or "none"


def _pool_text(raw: object) -> str:
    """A CPU list, or the node annotation's ``[{"socket": s, "node": n, "cpuset": "..."}]`` form."""
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list | tuple):
        pieces: list[str] = []
        for i, item in enumerate(raw):
            cpuset = item.get("cpuset") if isinstance(item, Mapping) else None
            if not isinstance(cpuset, str):
                raise ValueError(f"item {i}: expected an object with a \"cpuset\" CPU list, got {item!r}")
            pieces.extend(p for p in cpuset.strip().split(",") if p)
        return ",".join(pieces)
    raise ValueError(f"expected a CPU list string like \"0-3,8\" (or a list of {{cpuset: ...}}), got {raw!r}")


def _read_cpus(executor: CgroupExecutor, cgroup: PurePosixPath, source: str) -> frozenset[int]:
    """A cgroup's ``cpuset.cpus``; empty when it does not parse (or is empty: v2 inherits)."""
    try:
        return parse_cpu_list(executor.read(cgroup, CPUSET_CPUS, source))
    except CpuListError:
        return frozenset()


def _within_pod(pool: frozenset[int], reason: str, pod_cpus: frozenset[int]) -> tuple[frozenset[int], str]:
    """An unbound BE container's CPUs: the BE share pool within its pod cgroup's cpuset.
    CPU suppression (policy cpuset) narrows the besteffort tier and every cgroup under it,
    and on cgroup v1 the kernel refuses a cpuset wider than its parent's (EACCES): given
    the whole pool, a BE container created while BE is suppressed would not start (runc's
    write fails), and the reconciler's writes would be refused and back off the
    suppression's own. Koordlet leaves kube-BestEffort containers' cpuset to suppression
    altogether; this keeps them off LSE-bound CPUs too. Unknown or empty (v2: inherited)
    pod cpus, or a pool wholly inside them: the pool as it is. A pool disjoint from them:
    the pod's CPUs (the only ones the kernel allows)."""
    if not pod_cpus or pool <= pod_cpus:
        return pool, reason
    within = pool & pod_cpus or pod_cpus
    return within, f"{reason}, within its pod cgroup's {format_cpu_list(pod_cpus)}: {format_cpu_list(within)}"


class CPUSet:
    """Stages: PreRunPodSandbox, PreCreateContainer, PreUpdateContainerResources,
    PostStopPodSandbox, PostRemovePodSandbox, ReconcilePodSandbox, ReconcileContainer."""

    def __init__(self, init: HookInit) -> None:
        self._rules = LiveRules(init)
        args: dict[str, Any] = dict(init.args)
        path = init.key_path
        reject_unknown(args, _ARGS, f"{path}.")
        self.sys_root: Path = init.host.sys
        self.unset_cpu_quota = boolean(args.get("unset_cpu_quota", True), f"{path}.unset_cpu_quota")
        self.dry_run = dry_run_arg(init, args)
        self._ledger = DryRunLedger("cpuset")
        self.ls_pool = self._cpu_arg(init, args, "ls_pool", allow_empty=False)
        self.be_pool = self._cpu_arg(init, args, "be_pool", allow_empty=False)
        self.reserved = self._cpu_arg(init, args, "reserved_cpus", allow_empty=True) or frozenset()
        driver, version = cgroup_args(init, args)
        self._cgroup: tuple[Path, Version | Literal["auto"], Driver] = (init.host.cgroup, version, driver)
        self._backoff = init.services.write_backoff
        self.executor: CgroupExecutor | None = None
        if self.unset_cpu_quota:  # the only host write of the lifecycle stages
            try:
                self.executor = CgroupExecutor(CgroupLayout(init.host.cgroup, version, driver),
                                                backoff=init.services.write_backoff)
            except CgroupError as exc:
                raise HookConfigError(f"{path}.cgroup_version", version, str(exc)) from exc
        self._lock = threading.Lock()
        self._bindings: dict[str, Binding] = {}

    @property
    def rules(self) -> Rules:
        """The rules in force now: the YAML, with the NodeSLO merged over it when there is one."""
        return self._rules()

    def _cpu_arg(
        self, init: HookInit, args: Mapping[str, Any], key: str, *, allow_empty: bool
    ) -> frozenset[int] | None:
        if args.get(key) is None:
            return None
        where = f"{init.key_path}.{key}"
        raw = args[key]
        try:
            text = _pool_text(raw)
            cpus = parse_cpu_list(text)
        except ValueError as exc:  # CpuListError is a ValueError
            raise HookConfigError(where, raw, str(exc)) from exc
        if not cpus and not allow_empty:
            raise HookConfigError(where, raw, "a share pool must name at least one CPU")
        try:
            online = read_online_cpus(init.host.sys)
        except CpuListError as exc:
            raise HookConfigError(where, raw, f"cannot check it against the node: {exc}") from exc
        try:
            return check_on_node(cpus, online, text)
        except CpuListError as exc:
            raise HookConfigError(where, raw, str(exc)) from exc

    # --- state -----------------------------------------------------------------

    @property
    def bindings(self) -> Mapping[str, Binding]:
        """A snapshot of the bindings seen so far (pod uid → binding)."""
        with self._lock:
            return types.MappingProxyType(dict(self._bindings))

    def _remember(self, pod: PodInfo, binding: Binding | None) -> None:
        key = pod.meta.uid or pod_name(pod)
        with self._lock:
            if binding is None:
                self._bindings.pop(key, None)
            else:
                self._bindings[key] = binding

    def _bound(self, classes: frozenset[QoSClass]) -> frozenset[int]:
        cpus: set[int] = set()
        with self._lock:
            for binding in self._bindings.values():
                if binding.qos in classes:
                    cpus |= binding.cpus
        return frozenset(cpus)

    # --- decisions -------------------------------------------------------------

    def _online(self, pod: PodInfo) -> frozenset[int]:
        try:
            return read_online_cpus(self.sys_root)
        except CpuListError as exc:
            raise HookError(f"pod {pod_name(pod)}: {exc}") from exc

    def _binding(self, pod: PodInfo) -> tuple[QoSClass, Binding | None]:
        """The pod's class and, if the scheduler bound it, its checked binding."""
        qos = self.rules.qos_of(pod)
        status = resource_status(pod)
        if status is None or not status.cpus:
            return qos, None
        try:
            check_on_node(status.cpus, self._online(pod), status.cpuset)
        except CpuListError as exc:
            raw = pod.annotations.get(RESOURCE_STATUS, "")
            shown = raw if len(raw) <= _SHOWN else raw[:_SHOWN] + "..."
            raise HookError(f"pod {pod_name(pod)}: annotation {RESOURCE_STATUS}={shown!r}: cpuset: {exc}") from exc
        return qos, Binding(QoSClass.LSR if qos is QoSClass.NONE else qos, status.cpus)

    def share_pool(self, qos: QoSClass, online: frozenset[int]) -> tuple[frozenset[int], str]:
        """The LS or BE share pool and how it was found."""
        if qos is QoSClass.LS:
            configured, key = self.ls_pool, "ls_pool"
        else:
            configured, key = self.be_pool, "be_pool"
        if configured is not None:
            pool = configured & online
            why = f"from args.{key} {_fmt(configured)}"
            if pool != configured:
                why += f", limited to the online CPUs {_fmt(online)}"
        elif qos is QoSClass.LS:
            bound = self._bound(frozenset({QoSClass.LSE, QoSClass.LSR}))
            pool = online - bound - self.reserved
            why = f"computed: online {_fmt(online)} - LSE/LSR-bound {_fmt(bound)} - reserved {_fmt(self.reserved)}"
        else:
            bound = self._bound(frozenset({QoSClass.LSE}))
            pool = online - bound
            why = f"computed: online {_fmt(online)} - LSE-bound {_fmt(bound)}"
        if not pool:
            pool = online
            why += "; that leaves no CPU, so all online CPUs"
        return pool, why

    def _container_patch(self, ctx: ContainerContext) -> ContainerPatch | None:
        pod = ctx.pod
        qos, binding = self._binding(pod)
        self._remember(pod, binding)
        if binding is not None:
            cpuset = format_cpu_list(binding.cpus)
            reason = f"{qos.value or 'no-class'} pod bound by resource-status cpuset {cpuset}"
            if self.unset_cpu_quota:
                return ContainerPatch(resources=ResourcesPatch(cpuset_cpus=cpuset, cpu_quota=-1),
                                      reason=f"{reason}; CFS quota unset")
            return ContainerPatch(resources=ResourcesPatch(cpuset_cpus=cpuset), reason=reason)
        if qos not in (QoSClass.LS, QoSClass.BE):
            return None
        pool, why = self.share_pool(qos, self._online(pod))
        reason = f"unbound {qos.value} pod gets the {qos.value} share pool {format_cpu_list(pool)} ({why})"
        if qos is QoSClass.BE:
            pool, reason = _within_pod(pool, reason, self._pod_cpus(pod))
        return ContainerPatch(resources=ResourcesPatch(cpuset_cpus=format_cpu_list(pool)), reason=reason)

    def _pod_cpus(self, pod: PodInfo) -> frozenset[int]:
        """The pod cgroup's ``cpuset.cpus``; empty when unknown (no cgroup tree, no
        such file, an empty v2 value that inherits): then nothing is narrowed."""
        try:
            executor = self._writer(pod)
            return _read_cpus(executor, pod_cgroup_dir(pod.cgroup_parent, executor.layout.driver), pod_name(pod))
        except (HookError, CgroupError):
            return frozenset()

    # --- stages ----------------------------------------------------------------

    def _write(self, executor: CgroupExecutor, levels: list[list[Update]], pod: PodInfo) -> tuple[HostWrite, ...]:
        """The writes (leveled: widen the pod before its container), or in dry run the
        ones that would change, reported once (``hooks.dryrun``)."""
        if self.dry_run:
            return self._ledger.report(planned_writes(executor, [u for level in levels for u in level]),
                                       pod=pod_name(pod))
        return host_writes(executor.leveled_update(levels) if len(levels) > 1 else executor.apply(levels[0]))

    def _unset_pod_quota(self, pod: PodInfo, qos: QoSClass, binding: Binding,
                         executor: CgroupExecutor) -> tuple[str, tuple[HostWrite, ...]]:
        try:
            cgroup = pod_cgroup_dir(pod.cgroup_parent, executor.layout.driver)
        except CgroupError as exc:
            raise HookError(f"pod {pod_name(pod)}: {exc}") from exc
        reason = (f"{qos.value or 'no-class'} pod bound by resource-status cpuset {format_cpu_list(binding.cpus)}: "
                  "pod CFS quota unset")
        source = f"pod {pod_name(pod)}: cgroup_parent {pod.cgroup_parent!r}"
        return reason, self._write(executor, [[Update(cgroup, CPU_CFS_QUOTA, -1, reason, source)]], pod)

    def pre_run_pod_sandbox(self, ctx: PodContext) -> PodPatch | None:
        pod = ctx.pod
        qos, binding = self._binding(pod)
        if binding is None or self.executor is None:
            return None
        reason, writes = self._unset_pod_quota(pod, qos, binding, self.executor)
        return PodPatch(reason=reason if writes else f"{reason} (already unset)", writes=writes)

    def pre_create_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        return self._container_patch(ctx)

    def pre_update_container_resources(self, ctx: ContainerContext) -> ContainerPatch | None:
        return self._container_patch(ctx)

    def sweep_orphans(self, live: LivePods) -> list[str]:
        """Bindings of pods that no longer exist (they would keep their CPUs out of the share pools)."""
        with self._lock:
            gone = [key for key in self._bindings if key not in live.uids and "/" not in key]  # "/": keyed by name
            for key in gone:
                del self._bindings[key]
        return [f"cpuset binding of pod {key} dropped (pod no longer exists)" for key in gone]

    def post_stop_pod_sandbox(self, ctx: PodContext) -> None:
        if ctx.result is None or ctx.result.ok:
            self._remember(ctx.pod, None)

    def post_remove_pod_sandbox(self, ctx: PodContext) -> None:
        if ctx.result is None or ctx.result.ok:
            self._remember(ctx.pod, None)

    # --- reconciler ----------------------------------------------------------------

    def _writer(self, pod: PodInfo) -> CgroupExecutor:
        """The executor; built on first use when ``unset_cpu_quota`` is false (the
        lifecycle stages then write nothing, so no cgroup tree was required)."""
        if self.executor is None:
            root, version, driver = self._cgroup
            self.executor = open_executor(root, version, driver, pod, self._backoff)
        return self.executor

    def reconcile_pod_sandbox(self, ctx: PodContext) -> PodPatch | None:
        """Re-learn the pod's binding; for a bound pod keep its pod CFS quota unset."""
        pod = ctx.pod
        qos, binding = self._binding(pod)
        self._remember(pod, binding)
        if binding is None or not self.unset_cpu_quota:
            return None
        try:
            reason, writes = self._unset_pod_quota(pod, qos, binding, self._writer(pod))
        except CgroupGoneError:
            self._remember(pod, None)  # a pod without a cgroup holds no CPUs
            raise
        return PodPatch(reason=f"{reason} (reconciled)", writes=writes) if writes else None

    def reconcile_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        """Write the container's cpuset.cpus (and, bound, its unset quota) as PreCreateContainer decides them."""
        pod, container = ctx.pod, ctx.container
        if not container.id:
            return None
        qos, binding = self._binding(pod)
        self._remember(pod, binding)
        if binding is not None:
            cpus = binding.cpus
            reason = f"{qos.value or 'no-class'} pod bound by resource-status cpuset {format_cpu_list(cpus)}"
        elif qos in (QoSClass.LS, QoSClass.BE):
            cpus, why = self.share_pool(qos, self._online(pod))
            reason = f"unbound {qos.value} pod gets the {qos.value} share pool {format_cpu_list(cpus)} ({why})"
        else:
            return None
        executor = self._writer(pod)
        try:
            pod_cgroup = pod_cgroup_dir(pod.cgroup_parent, executor.layout.driver)
            cgroup = container_cgroup_dir(pod.cgroup_parent, container.id, executor.layout.driver)
        except CgroupError as exc:
            raise HookError(f"pod {pod_name(pod)}: container {container.meta.name}: {exc}") from exc
        pod_source = f"pod {pod_name(pod)}: cgroup_parent {pod.cgroup_parent!r}"
        try:
            have = _read_cpus(executor, pod_cgroup, pod_source)
        except CgroupGoneError:
            self._remember(pod, None)  # as in reconcile_pod_sandbox: a pod without a cgroup holds no CPUs
            raise
        if binding is None and qos is QoSClass.BE:
            cpus, reason = _within_pod(cpus, reason, have)
        source = (f"pod {pod_name(pod)}: container {container.meta.name} ({container.id}): "
                  f"cgroup_parent {pod.cgroup_parent!r}")
        container_level = [Update(cgroup, CPUSET_CPUS, format_cpu_list(cpus), reason, source)]
        if binding is not None and self.unset_cpu_quota:
            container_level.append(Update(cgroup, CPU_CFS_QUOTA, -1, f"{reason}; CFS quota unset", source))
        pod_level: list[Update] = []
        if have and not cpus <= have:  # widen only; empty (v2: inherited) stays as it is
            pod_level.append(Update(pod_cgroup, CPUSET_CPUS, format_cpu_list(have | cpus),
                                    f"{reason}: pod cgroup widened to hold the container's CPUs", source))
        writes = self._write(executor, [pod_level, container_level], pod)
        return ContainerPatch(reason=f"{reason} (reconciled)", writes=writes) if writes else None
