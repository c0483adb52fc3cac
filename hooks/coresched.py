"""CoreSched: SMT siblings shared only within a group, and BE as SCHED_IDLE tiers.

koordlet's ``CoreSched`` hook (``runtimehooks/hooks/coresched``), with its names:

* **Rules** — nothing happens unless ``policies.cpuPolicy`` is ``coreSched`` (the
  NodeSLO's ``resourceQOSStrategy.policies``, merged over the YAML ``rules:``) and a
  class enables ``cpuQOS``. A pod's class: its ``koordinator.sh/qosClass`` label
  (LSE/LSR → ``lsrClass``, LS, BE); without one, its Kubernetes QoS (Guaranteed →
  ``lsrClass`` if enabled else ``lsClass``, Burstable → ``lsClass``, BestEffort →
  ``beClass``). SYSTEM pods are never touched (they keep the default cookie).
* **Group** — label ``koordinator.sh/core-sched-group-id`` (absent: ``""``, one group
  of every enabled pod without the label); label ``koordinator.sh/core-sched-policy``:
  ``""`` (default), ``exclusive`` (the group is the pod uid), ``none`` (the pod is
  left out); any other value is an error naming the label and value. With the
  class's ``cpuQOS.coreExpeller`` the group gets the suffix ``-expeller``.
* **Cookies** — every process of the container (``cgroup.procs``; the sandbox's too,
  at ``ReconcilePodSandbox``) carries its group's cookie: the first container of a
  group gets a new one (``PR_SCHED_CORE_CREATE`` on its first process, shared to the
  others); later ones take it from a process that still has it (SHARE_FROM it, then
  SHARE_TO them). A process exec'd into the container later, or a group change, is
  fixed at the next pass; a group none of whose processes still holds its cookie
  gets a new one. A pod that is no longer enabled has the cookies this hook gave it
  cleared (only those: a cookie it never set is not touched). The group → cookie
  cache lives in memory; after a restart a group gets a new cookie and its
  containers are moved to it (koordlet instead re-reads the cookies first).
* **cpu.idle** — at ``ReconcilePodSandbox`` the pod's kube-QoS tier directory
  (``kubepods/besteffort``, ``kubepods/burstable``, ``kubepods``) gets
  ``cpu.idle`` = 1 (SCHED_IDLE for the whole tier) when the policy is
  ``coreSched`` and its class says ``cpuQOS.schedIdle: 1`` (Guaranteed: LSR if
  enabled else LS, Burstable: LS, BestEffort: BE), else 0, as koordlet's kube-QoS
  reconciler does; only a value that differs is written, so a node that never had
  it set sees no write. ``cpu.idle`` needs Linux >= 5.15 (cpu controller, v1 and
  v2); without it: logged once (``core_sched_cpu_idle_absent``, only when the
  policy asks for it), then that part does nothing. (koordlet later moved
  cpu.idle to pod cgroups: the kernel refuses ``cpu.shares`` / ``cpu.weight``
  writes to an idle group, which kubelet makes on the tiers.)

Support is detected once, at the first pod that needs a cookie (``detect``: one
``prctl GET``); the result is logged once (``core_sched_detected``). Unsupported
(this kernel answers ``EINVAL``): no cookie is ever touched, and each pod that
would have got one shows it once in ``explain`` (``not applied`` with the reason).

args: ``cgroup_driver``, ``cgroup_version`` (as every cgroup hook), ``dry_run``
(bool, default false: nothing done; each planned change reported once per planned
value, ``(dry-run, not written)`` in ``explain`` and one ``hook_dry_run`` log line, as
every hook's dry-run, ``hooks.dryrun``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Final

import structlog

from hooks.cgroups import CPU_IDLE, CPU_SHARES, CgroupError, NotSupportedError, pod_cgroup_dir
from hooks.coreschedsys import DEFAULT_COOKIE, CookieOps, CoreSchedSys, LibcCoreSched, Support, detect
from hooks.dryrun import DryRunLedger, dry_run_arg, planned_writes
from hooks.executor import CgroupExecutor, Update
from hooks.hookargs import cgroup_layout, host_writes
from hooks.idleweight import tier_weight
from hooks.proctasks import container_procs
from hooks.qos import QOS_LABEL, KubeQoS, QoSClass, kube_qos_from_cgroup_parent, parse_qos_label, pod_name
from hooks.rules import CPUQOS, LiveRules, Rules
from runtimeproxy.config.configvalues import reject_unknown
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerPatch,
    HookError,
    HookInit,
    HostWrite,
    LivePods,
    PodContext,
    PodInfo,
    PodPatch,
)
from runtimeproxy.hostwrites import check_deadline

GROUP_LABEL: Final = "koordinator.sh/core-sched-group-id"
POLICY_LABEL: Final = "koordinator.sh/core-sched-policy"
EXPELLER_SUFFIX: Final = "-expeller"
_POLICIES: Final = ("", "none", "exclusive")
_ARGS: Final = frozenset({"cgroup_driver", "cgroup_version", "dry_run"})
_MAX_ENTRIES: Final = 16384

log = structlog.get_logger("hooks.coresched")


@dataclass(slots=True)
class _Group:
    cookie: int
    pids: set[int] = field(default_factory=set)


def _class_params(rules: Rules, pod: PodInfo) -> CPUQOS | None:
    """The cpuQOS deciding for the pod (koordlet ``IsPodEnabled``); None for SYSTEM pods."""
    raw = pod.labels.get(QOS_LABEL, "")
    try:
        qos = parse_qos_label(raw)
    except ValueError as exc:
        raise HookError(f"pod {pod_name(pod)}: label {QOS_LABEL}={raw!r}: {exc}") from exc
    if qos is QoSClass.SYSTEM:
        return None
    lsr, ls, be = (rules.for_class(c).cpu_qos for c in (QoSClass.LSR, QoSClass.LS, QoSClass.BE))
    by_class = {QoSClass.LSE: lsr, QoSClass.LSR: lsr, QoSClass.LS: ls, QoSClass.BE: be}
    if qos in by_class:
        return by_class[qos]
    return _kube_params(kube_qos_from_cgroup_parent(pod.cgroup_parent), lsr, ls, be)


def _kube_params(kube: KubeQoS | None, lsr: CPUQOS, ls: CPUQOS, be: CPUQOS) -> CPUQOS:
    if kube is KubeQoS.GUARANTEED:
        return lsr if lsr.enable else ls
    if kube is KubeQoS.BURSTABLE:
        return ls
    if kube is KubeQoS.BESTEFFORT:
        return be
    return CPUQOS()


def pod_group(rules: Rules, pod: PodInfo) -> tuple[bool, str] | None:
    """(enabled, group id) of the pod (koordlet ``getPodEnabledAndGroup``); None: SYSTEM, left alone.
    Raises HookError for a bad qosClass or core-sched-policy label."""
    params = _class_params(rules, pod)
    if params is None:
        return None
    policy = pod.labels.get(POLICY_LABEL, "")
    if policy not in _POLICIES:
        raise HookError(f"pod {pod_name(pod)}: label {POLICY_LABEL}={policy!r}: unknown policy "
                        f"(known: \"\", none, exclusive)")
    core_sched = rules.policies.cpu_policy == "coreSched"
    lsr, ls, be = (rules.for_class(c).cpu_qos for c in (QoSClass.LSR, QoSClass.LS, QoSClass.BE))
    node_enabled = core_sched and (lsr.enable or ls.enable or be.enable)
    enabled = node_enabled and params.enable and policy != "none"
    group = pod.meta.uid if policy == "exclusive" else pod.labels.get(GROUP_LABEL, "")
    if core_sched and params.core_expeller:
        group += EXPELLER_SUFFIX
    return enabled, group


def _inputs(rules: Rules, pod: PodInfo) -> str:
    """What decided a pod's group, for explain."""
    params = _class_params(rules, pod)
    shown = " ".join(f"{k}={pod.labels.get(k, '')!r}" for k in (QOS_LABEL, GROUP_LABEL, POLICY_LABEL))
    kube = kube_qos_from_cgroup_parent(pod.cgroup_parent)
    return (f"cpuPolicy coreSched, kube QoS {kube.value if kube is not None else 'unknown'}, "
            f"class cpuQOS.coreExpeller {params.core_expeller if params else None}, labels {shown}")


def tier_idle(rules: Rules, pod: PodInfo) -> int:
    """``cpu.idle`` of the pod's kube-QoS tier (koordlet ``IsKubeQOSCPUIdle``)."""
    if rules.policies.cpu_policy != "coreSched":
        return 0
    lsr, ls, be = (rules.for_class(c).cpu_qos for c in (QoSClass.LSR, QoSClass.LS, QoSClass.BE))
    params = _kube_params(kube_qos_from_cgroup_parent(pod.cgroup_parent), lsr, ls, be)
    return 1 if params.sched_idle == 1 else 0


class CoreSched:
    """Stages: PostStartContainer, ReconcileContainer, ReconcilePodSandbox; and
    ``sweep_orphans`` (the cookies remembered for gone pods)."""

    def __init__(self, init: HookInit, *, sys: CoreSchedSys | None = None) -> None:
        args: dict[str, Any] = dict(init.args)
        reject_unknown(args, _ARGS, f"{init.key_path}.")
        self.dry_run = dry_run_arg(init, args)
        self._rules = LiveRules(init)
        self.layout = cgroup_layout(init, args)
        self.executor = CgroupExecutor(self.layout, backoff=init.services.write_backoff)
        self._sys = sys
        self._ops: CookieOps | None = None
        self._support: Support | None = None
        self._lock = threading.RLock()
        self._groups: OrderedDict[str, _Group] = OrderedDict()
        self._containers: OrderedDict[str, str] = OrderedDict()  # "<pod uid>/<container id>" -> group
        self._noted: OrderedDict[str, None] = OrderedDict()  # pods told "unsupported" in explain
        self._ledger = DryRunLedger("core-sched")
        self._idle_absent = False  # no cpu.idle in the kube-QoS tiers (found at the first try)
        #: tier -> cpu.shares read just before this hook set its cpu.idle 1 (v1).
        self._replaced: dict[PurePosixPath, int] = {}
        self._idle_absent_logged = False

    @property
    def rules(self) -> Rules:
        return self._rules()

    # --- support ------------------------------------------------------------------------

    def support(self) -> Support:
        """Detected once (one log line); the same answer after."""
        with self._lock:
            if self._support is None:
                try:
                    sys = self._sys if self._sys is not None else LibcCoreSched()
                except OSError as exc:
                    self._support = Support(False, f"no C library prctl: {exc}")
                else:
                    self._support = detect(sys)
                    self._ops = CookieOps(sys)
                emit = log.info if self._support.supported else log.warning
                emit("core_sched_detected", supported=self._support.supported, detail=self._support.detail)
            return self._support

    def _unsupported_note(self, pod: PodInfo, support: Support) -> list[HostWrite]:
        with self._lock:
            if pod.meta.uid in self._noted:
                return []
            self._noted[pod.meta.uid] = None
            _bound(self._noted)
        return [HostWrite(f"core-sched cookies of pod {pod_name(pod)}", "", "not applied",
                          f"core scheduling unsupported: {support.detail}")]

    # --- cookies ------------------------------------------------------------------------

    def _container(self, pod: PodInfo, container_id: str, name: str) -> list[HostWrite]:
        decided = pod_group(self.rules, pod)
        if decided is None:
            return []
        enabled, group = decided
        key = f"{pod.meta.uid}/{container_id}"
        with self._lock:
            last = self._containers.get(key)
        if not enabled and last is None:
            return []
        support = self.support()
        if not support.supported or self._ops is None:
            return self._unsupported_note(pod, support) if enabled else []
        try:
            pids = container_procs(self.layout, pod, container_id)
        except CgroupError as exc:
            raise HookError(f"pod {pod_name(pod)} container {name}: {exc}") from exc
        if not pids:
            return []
        what = f"core-sched cookie of pod {pod_name(pod)} container {name}"
        with self._lock:
            if enabled:
                return self._enable(self._ops, key, group, pids, what, _inputs(self.rules, pod))
            return self._disable(self._ops, key, pids, what)

    def _enable(self, ops: CookieOps, key: str, group: str, pids: list[int], what: str,
                inputs: str) -> list[HostWrite]:
        cookies = {pid: ops.get(pid) for pid in pids}
        alive = [pid for pid in pids if cookies[pid] is not None]
        if not alive:
            return []
        last = self._containers.get(key)
        if last is not None and last != group and last in self._groups:
            self._groups[last].pids.difference_update(alive)
        entry = self._groups.get(group)
        reason = f"core-sched group {group!r} ({inputs}): {len(alive)} process(es) share its cookie"
        if entry is not None:
            todo = [pid for pid in alive if cookies[pid] != entry.cookie]
            if not todo:
                entry.pids.update(alive)
                self._remember(key, group)
                return []
            source = self._sibling(ops, entry, cookies)
            if source is not None:
                if self.dry_run:
                    return self._planned(what, f"group {group!r} cookie {entry.cookie:#x} to pids {todo}", reason)
                check_deadline(what, f"cookie {entry.cookie:#x}")
                try:
                    failed = ops.assign(source, todo)
                except OSError:  # the source exited meanwhile: the group starts over below
                    failed = None
                if failed is not None:
                    entry.pids.update(pid for pid in alive if pid not in failed)
                    self._remember(key, group)
                    return self._wrote(what, cookies, todo, failed, entry.cookie, group, reason)
            del self._groups[group]  # no process holds the group's cookie any more: a new one
        if self.dry_run:
            return self._planned(what, f"a new cookie for group {group!r} on pids {alive}", reason)
        check_deadline(what, f"new cookie for group {group!r}")
        try:
            cookie = ops.create(alive[0])
        except OSError as exc:
            raise HookError(f"{what}: creating a cookie for pid {alive[0]} failed: {exc.strerror}") from exc
        try:
            failed = ops.assign(alive[0], alive[1:])
        except OSError:
            failed = alive[1:]  # the first process exited after getting the cookie: the rest next pass
        self._groups[group] = _Group(cookie, {pid for pid in alive if pid not in failed})
        _bound(self._groups)
        self._remember(key, group)
        return self._wrote(what, cookies, alive, failed, cookie, group, reason)

    @staticmethod
    def _sibling(ops: CookieOps, entry: _Group, cookies: dict[int, int | None]) -> int | None:
        """A process still holding the group's cookie (dead or moved ones are dropped)."""
        for pid in sorted(entry.pids | {p for p, c in cookies.items() if c == entry.cookie}):
            cookie = cookies[pid] if pid in cookies else ops.get(pid)
            if cookie == entry.cookie:
                return pid
            entry.pids.discard(pid)
        return None

    def _disable(self, ops: CookieOps, key: str, pids: list[int], what: str) -> list[HostWrite]:
        last = self._containers.get(key, "")
        entry = self._groups.get(last)
        cookies = {pid: ops.get(pid) for pid in pids}
        targets = [pid for pid, cookie in cookies.items() if cookie not in (None, DEFAULT_COOKIE)]
        reason = f"core scheduling no longer enabled for the pod: cookies of group {last!r} cleared"
        if not targets:
            self._forget(key, last, entry, pids)
            return []
        if self.dry_run:
            return self._planned(what, f"the default cookie on pids {targets}", reason)
        check_deadline(what, "default cookie")
        try:
            failed = ops.clear(targets)
        except OSError as exc:
            raise HookError(f"{what}: clearing cookies failed: {exc.strerror}") from exc
        self._forget(key, last, entry, [pid for pid in pids if pid not in failed])
        old = entry.cookie if entry is not None else next(c for c in cookies.values() if c)
        cleared = [pid for pid in targets if pid not in failed]
        if not cleared:
            raise HookError(f"{what}: the kernel refused to clear pids {failed}")
        return [HostWrite(what, f"group {last!r} cookie {old:#x}", f"default cookie on {len(cleared)} process(es)",
                          reason)]

    def _forget(self, key: str, group: str, entry: _Group | None, pids: list[int]) -> None:
        self._containers.pop(key, None)
        if entry is not None:
            entry.pids.difference_update(pids)
            if not entry.pids:
                self._groups.pop(group, None)

    def _remember(self, key: str, group: str) -> None:
        self._containers[key] = group
        self._containers.move_to_end(key)
        _bound(self._containers)

    def _planned(self, what: str, plan: str, reason: str) -> list[HostWrite]:
        return list(self._ledger.report([HostWrite(what, "", plan, reason)]))

    @staticmethod
    def _wrote(what: str, cookies: dict[int, int | None], done: list[int], failed: list[int], cookie: int,
               group: str, reason: str) -> list[HostWrite]:
        moved = [pid for pid in done if pid not in failed]
        if failed:
            log.warning("core_sched_share_failed", target=what, group=group, failed=failed, of=len(done))
        if not moved:
            raise HookError(f"{what}: the kernel refused cookie {cookie:#x} of group {group!r} for pids {failed}")
        olds = sorted({f"{cookies.get(pid) or 0:#x}" for pid in moved})
        log.info("core_sched_cookie_set", target=what, group=group, cookie=f"{cookie:#x}", processes=len(moved))
        return [HostWrite(what, f"cookie {', '.join(olds)}", f"group {group!r} cookie {cookie:#x} on "
                          f"{len(moved)} process(es)", reason)]

    # --- cpu.idle of the kube-QoS tier -----------------------------------------------------

    def _tier_idle(self, pod: PodInfo) -> list[HostWrite]:
        core_sched = self.rules.policies.cpu_policy == "coreSched"
        if self._idle_absent:
            if core_sched:
                self._say_idle_absent()
            return []
        if kube_qos_from_cgroup_parent(pod.cgroup_parent) is None:
            return []
        value = tier_idle(self.rules, pod)
        try:
            tier = pod_cgroup_dir(pod.cgroup_parent, self.layout.driver).parent
        except CgroupError as exc:
            raise HookError(f"pod {pod_name(pod)}: {exc}") from exc
        if tier == PurePosixPath("."):
            return []
        source = f"pod {pod_name(pod)}: kube-QoS tier of cgroup_parent {pod.cgroup_parent!r}"
        try:
            if int(self.executor.read(tier, CPU_IDLE, source)) == value:
                # In place (every pod of the tier, every reconcile pass): nothing to write and
                # no weight to give back; one read instead of the update's read, a second read
                # and a stat (a third of the reconciler's CPU at 110 pods, issue 29).
                return []
        except (CgroupError, ValueError):
            pass  # absent or unreadable: the update below says which
        reason = (f"cpuPolicy coreSched: kube-QoS tier {tier} cpu.idle {value} (class cpuQOS.schedIdle)"
                  if core_sched else f"cpuPolicy is not coreSched: kube-QoS tier {tier} cpu.idle reset to 0")
        try:
            updates = [Update(tier, CPU_IDLE, value, reason, source),
                       *self._tier_weight(tier, value, kube_qos_from_cgroup_parent(pod.cgroup_parent), source)]
            if self.dry_run:
                return list(self._ledger.report(planned_writes(self.executor, updates), pod=pod_name(pod)))
            return list(host_writes(self.executor.apply(updates)))
        except NotSupportedError:
            self._idle_absent = True
            if core_sched:
                self._say_idle_absent()
            return []

    def _tier_weight(self, tier: PurePosixPath, idle: int, kube: KubeQoS | None, source: str) -> list[Update]:
        """Clearing cpu.idle resets the tier's weight to 1024: write back the one it replaced
        in the same step (kubelet's 2 for the BestEffort tier, else the value read before this
        hook set cpu.idle 1, v1), as group-identity does for pods (``hooks.idleweight``)."""
        try:
            idle_now = self.executor.read(tier, CPU_IDLE, source).strip() == "1"
            has_weight = self.executor.path(tier, CPU_SHARES, source).is_file()
        except CgroupError:
            return []  # no cpu.idle: the idle update reports it
        if idle == 1:
            if not idle_now and has_weight and self.layout.version == 1:
                try:
                    self._replaced[tier] = int(self.executor.read(tier, CPU_SHARES, source))
                except (CgroupError, ValueError):
                    pass
            return []
        if not idle_now or not has_weight:
            return []
        known = tier_weight(kube)
        replaced = self._replaced.pop(tier, None)
        if known is None and replaced is not None:
            known = replaced, "the weight before cpu.idle was set"
        if known is None:
            return []  # kubelet's QoS manager sets the Burstable tier's weight again
        return [Update(tier, CPU_SHARES, known[0], f"cpu.idle cleared: weight restored: {known[1]}", source)]

    def _say_idle_absent(self) -> None:
        with self._lock:
            if self._idle_absent_logged:
                return
            self._idle_absent_logged = True
        log.warning("core_sched_cpu_idle_absent", cgroup_root=str(self.layout.root),
                    cgroup_version=self.layout.version,
                    detail="the kube-QoS tiers have no cpu.idle (needs Linux >= 5.15): schedIdle does nothing")

    # --- stages -------------------------------------------------------------------------

    def _container_patch(self, ctx: ContainerContext) -> ContainerPatch | None:
        writes = self._container(ctx.pod, ctx.container.id, ctx.container.meta.name)
        return ContainerPatch(reason=writes[0].reason, writes=tuple(writes)) if writes else None

    def host_support(self) -> tuple[str, str]:
        """check-config's plan: whether this kernel does core scheduling (prctl)."""
        support = self.support()
        return ("on" if support.supported else "off"), support.detail

    def post_start_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        if ctx.result is not None and not ctx.result.ok:
            return None
        return self._container_patch(ctx)

    def reconcile_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        return self._container_patch(ctx)

    def sweep_orphans(self, live: LivePods) -> list[str]:
        """The cookies remembered for containers of pods that no longer exist (the kernel's
        cookie goes with the last process holding it; what stays is this hook's record of
        it, which would otherwise keep a dead group's cookie for the next pod of that group):
        their entries, and each group no live container is in any more."""
        removed: list[str] = []
        with self._lock:
            for key in [k for k in self._containers if k.partition("/")[0] not in live.uids]:
                removed.append(f"core-sched container {key}: group {self._containers.pop(key)!r} forgotten "
                               "(pod no longer exists)")
            used = set(self._containers.values())
            for group in [g for g in self._groups if g not in used]:
                entry = self._groups.pop(group)
                removed.append(f"core-sched group {group!r} cookie {entry.cookie:#x} forgotten (no live container)")
            for uid in [u for u in self._noted if u not in live.uids]:
                del self._noted[uid]
        return removed

    def reconcile_pod_sandbox(self, ctx: PodContext) -> PodPatch | None:
        """The kube-QoS tier's cpu.idle, and the sandbox (pause) container's cookie."""
        writes = self._tier_idle(ctx.pod)
        if ctx.pod.id:
            writes += self._container(ctx.pod, ctx.pod.id, "sandbox")
        return PodPatch(reason=writes[0].reason, writes=tuple(writes)) if writes else None


def _bound(entries: OrderedDict[Any, Any]) -> None:
    while len(entries) > _MAX_ENTRIES:
        entries.popitem(last=False)


__all__ = ["EXPELLER_SUFFIX", "GROUP_LABEL", "POLICY_LABEL", "CoreSched", "pod_group", "tier_idle"]
