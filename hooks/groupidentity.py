"""GroupIdentity: latency-sensitive pods preempt best-effort ones on a shared CPU.

Why: co-location only works if a BE task yields the CPU the moment an LS task
wants it. Alibaba Cloud Linux / Anolis kernels provide this as "group identity":
``cpu.bvt_warp_ns`` per cgroup, 2 = high priority (may preempt), 0 = normal,
-1 = lowest (an "offline" group, preempted and throttled when LS tasks wake).
This is koordlet's ``GroupIdentity`` hook: at PreRunPodSandbox (kubelet has
created the pod cgroup) the pod cgroup gets its class's value from the rules
(``resourceQOSStrategy.<class>.cpuQOS.groupIdentity``; Koordinator defaults
LSE/LSR 2, LS 2, BE -1). As in koordlet a class whose ``cpuQOS.enable`` is false
behaves like the None class (value 0). Nothing is done while
``policies.cpuPolicy`` is not ``groupIdentity``, nor while no class enables
cpuQOS (except for an LS pod whose annotation, below, enables it) — unless the
rules enabled it earlier in this hook's life (the NodeSLO turned it off): then
every pod is reset to 0, as koordlet does once group identity was on.

Upstream kernels have no ``cpu.bvt_warp_ns``. Since 5.15 they have ``cpu.idle``
(a SCHED_IDLE cgroup), which gives the lowest identity without the highest:
with ``args.idle_fallback`` (default true) BE pods get ``cpu.idle = 1`` when
their value is -1 (``0`` otherwise) and other pods are left untouched. What the
kernel offers is detected, not assumed: at the first pod, the files are looked
for in the pod's parent cgroup (the kube-QoS directory, so in the cpu
controller on v1); the result is logged once and named in every reason. With
neither file the hook does nothing.

Clearing ``cpu.idle`` (1 → 0) does not give the pod its weight back: the kernel resets
``cpu.shares`` to 1024 (``cpu.weight`` 100). So the clearing write carries the weight it
replaced in the same step (``hooks.idleweight``: batch-resource's value for a pod with
batch resources, kubelet's 2 for a BestEffort pod, else the value read before this
process set ``cpu.idle`` 1, on v1); a pod whose weight is not known is logged
(``group_identity_weight_unknown``) and left at the kernel's value.

The pod annotation ``koordinator.sh/cpuQOS`` (``{"enable": bool,
"groupIdentity": -1..2}``) overrides the value for LS pods only, as in
koordlet: ``enable`` false or missing means 0, ``enable`` true means its
``groupIdentity`` (the class value when absent). A malformed annotation is a
HookError naming pod, key and value, and nothing is written.

ReconcilePodSandbox (the reconciler's pass, at start-up, periodically and after
a reload) makes the same decision and re-applies it: a manual write, a pod
created while the proxy was down, or a rule change is repaired; only a file
that differs is written and reported.

args: ``idle_fallback`` (bool, default true), ``cgroup_driver`` (cgroupfs |
systemd), ``cgroup_version`` (auto | 1 | 2), ``dry_run`` (bool, default false: nothing
written, each planned value reported once, as every hook's dry-run, ``hooks.dryrun``).
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Final

import structlog

from hooks.annotations import load_object
from hooks.cgroups import (
    CPU_BVT_WARP_NS,
    CPU_IDLE,
    CPU_SHARES,
    CgroupError,
    CgroupGoneError,
    CgroupLayout,
    pod_cgroup_dir,
)
from hooks.dryrun import DryRunLedger, dry_run_arg, planned_writes
from hooks.executor import CgroupExecutor, Update
from hooks.hookargs import (
    PROBE_SOURCE,
    HostSupport,
    cgroup_args,
    host_writes,
    kubepods_probe,
    unknown_until_a_pod,
)
from hooks.idleweight import derived_weight
from hooks.qos import QoSClass, pod_name
from hooks.rules import LiveRules, Rules
from runtimeproxy.config.configvalues import boolean, reject_unknown
from runtimeproxy.hookapi import HookConfigError, HookError, HookInit, HostWrite, PodContext, PodInfo, PodPatch

CPU_QOS_ANNOTATION: Final = "koordinator.sh/cpuQOS"
_ARGS: Final = frozenset({"idle_fallback", "cgroup_driver", "cgroup_version", "dry_run"})
_ANNOTATION_KEYS: Final = frozenset({"enable", "groupIdentity", "schedIdle", "coreExpeller"})
_CLASSES: Final = (QoSClass.LSR, QoSClass.LS, QoSClass.BE)
_SHOWN: Final = 200

log = structlog.get_logger("hooks.groupidentity")


class Mode(enum.Enum):
    """What the kernel offers, as detected."""

    BVT = "cpu.bvt_warp_ns"
    IDLE = "cpu.idle"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class Detection:
    mode: Mode
    where: str  # the cgroup directory looked at

    def describe(self) -> str:
        if self.mode is Mode.BVT:
            return f"kernel has cpu.bvt_warp_ns (detected in {self.where})"
        if self.mode is Mode.IDLE:
            return f"no cpu.bvt_warp_ns, cpu.idle fallback (detected in {self.where})"
        return f"kernel has neither cpu.bvt_warp_ns nor a usable cpu.idle (detected in {self.where})"


def parse_cpu_qos(raw: str) -> tuple[bool, int | None]:
    """``koordinator.sh/cpuQOS`` → (enable, groupIdentity or None). Raises ValueError."""
    data = load_object(raw)  # AnnotationError is a ValueError
    unknown = set(data) - _ANNOTATION_KEYS
    if unknown:
        raise ValueError(f"unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(_ANNOTATION_KEYS))})")
    enable = data.get("enable", False)
    if not isinstance(enable, bool):
        raise ValueError(f"enable: expected true or false, got {enable!r}")
    value = data.get("groupIdentity")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not -1 <= value <= 2):
        raise ValueError(f"groupIdentity: expected an integer in [-1, 2], got {value!r}")
    return enable, value


class GroupIdentity:
    """Stages: PreRunPodSandbox, ReconcilePodSandbox."""

    def __init__(self, init: HookInit) -> None:
        args: dict[str, Any] = dict(init.args)
        reject_unknown(args, _ARGS, f"{init.key_path}.")
        self.idle_fallback = boolean(args.get("idle_fallback", True), f"{init.key_path}.idle_fallback")
        self.dry_run = dry_run_arg(init, args)
        self._ledger = DryRunLedger("group-identity")
        driver, version = cgroup_args(init, args)
        self._rules = LiveRules(init)
        try:
            self.executor = CgroupExecutor(CgroupLayout(init.host.cgroup, version, driver),
                                           backoff=init.services.write_backoff)
        except CgroupError as exc:
            raise HookConfigError(f"{init.key_path}.cgroup_version", version, str(exc)) from exc
        self._lock = threading.Lock()
        self._detection: Detection | None = None
        #: Whether the rules asked for group identity at some point (then values were
        #: set, and turning it off must reset them to 0 rather than leave them).
        self._was_enabled = self.rules_enabled
        #: cgroup -> the cpu.shares read just before this hook set its cpu.idle 1 (v1):
        #: the weight to restore for a pod whose weight cannot be derived.
        self._replaced: dict[PurePosixPath, int] = {}

    @property
    def rules(self) -> Rules:
        """The rules in force now: the YAML, with the NodeSLO merged over it when there is one."""
        return self._rules()

    @property
    def detection(self) -> Detection | None:
        """What was detected at the first pod (``None`` before)."""
        return self._detection

    @property
    def rules_enabled(self) -> bool:
        """Whether the rules ask for group identity at all (koordlet's ``bvtRule.enable``)."""
        if self.rules.policies.cpu_policy != "groupIdentity":
            return False
        return any(self.rules.for_class(c).cpu_qos.enable for c in _CLASSES)

    def pod_value(self, pod: PodInfo, qos: QoSClass) -> tuple[int, str] | None:
        """The pod's group identity and why; ``None`` when the hook has nothing to say."""
        label = qos.value or "no-class"
        enabled = self.rules_enabled
        policy_ok = self.rules.policies.cpu_policy == "groupIdentity"
        if qos is QoSClass.LS and CPU_QOS_ANNOTATION in pod.annotations and policy_ok:
            raw = pod.annotations[CPU_QOS_ANNOTATION]
            try:
                enable, value = parse_cpu_qos(raw)
            except ValueError as exc:
                shown = raw if len(raw) <= _SHOWN else raw[:_SHOWN] + "..."
                raise HookError(f"pod {pod_name(pod)}: annotation {CPU_QOS_ANNOTATION}={shown!r}: {exc}") from exc
            if not enable:
                return 0, f"LS pod annotation {CPU_QOS_ANNOTATION} disables cpuQOS: group identity 0"
            if value is None:
                value = self.rules.for_class(qos).cpu_qos.group_identity
                return value, f"LS pod annotation {CPU_QOS_ANNOTATION} enables cpuQOS: LS class value {value}"
            return value, f"LS pod annotation {CPU_QOS_ANNOTATION} sets group identity {value}"
        if not enabled:
            if not self._was_enabled:
                return None
            return 0, f"{label} pod: group identity turned off by the rules: reset to 0"
        self._was_enabled = True
        cpu_qos = self.rules.for_class(qos).cpu_qos
        if not cpu_qos.enable:
            return 0, f"{label} pod: class cpuQOS disabled, group identity 0"
        return cpu_qos.group_identity, f"{label} pod: class rule cpuQOS.groupIdentity {cpu_qos.group_identity}"

    def _detect(self, cgroup: PurePosixPath, source: str) -> Detection:
        with self._lock:
            if self._detection is not None:
                return self._detection
            probe = cgroup.parent if len(cgroup.parts) > 1 else cgroup
            bvt = self.executor.path(probe, CPU_BVT_WARP_NS, source)
            if not bvt.parent.is_dir():
                raise CgroupGoneError(f"{source}: cgroup {bvt.parent} does not exist (gone or not created yet)")
            idle = self.executor.path(probe, CPU_IDLE, source)
            if bvt.is_file():
                mode = Mode.BVT
            elif self.idle_fallback and idle.is_file():
                mode = Mode.IDLE
            else:
                mode = Mode.NONE
            self._detection = Detection(mode, str(bvt.parent))
            log.info("group_identity_detected", mode=mode.value, where=str(bvt.parent),
                     idle_fallback=self.idle_fallback, detail=self._detection.describe())
            return self._detection

    def _apply(self, pod: PodInfo) -> tuple[Update, tuple[HostWrite, ...]] | None:
        """Decide the pod's value and write it if it differs; ``None`` when there is nothing to do."""
        qos = self.rules.qos_of(pod)
        decided = self.pod_value(pod, qos)
        if decided is None:
            return None
        value, why = decided
        try:
            cgroup = pod_cgroup_dir(pod.cgroup_parent, self.executor.layout.driver)
        except CgroupError as exc:
            raise HookError(f"pod {pod_name(pod)}: {exc}") from exc
        source = f"pod {pod_name(pod)}: cgroup_parent {pod.cgroup_parent!r}"
        detection = self._detect(cgroup, source)
        if detection.mode is Mode.BVT:
            update = Update(cgroup, CPU_BVT_WARP_NS, value, f"{why}; {detection.describe()}", source)
            updates = [update]
        elif detection.mode is Mode.IDLE and qos is QoSClass.BE:
            idle = 1 if value == -1 else 0
            update = Update(cgroup, CPU_IDLE, idle, f"{why}: cpu.idle {idle}; {detection.describe()}", source)
            updates = [update, *self._weight(pod, cgroup, idle, source)]
        else:
            return None
        if self.dry_run:
            return update, self._ledger.report(planned_writes(self.executor, updates), pod=pod_name(pod))
        return update, host_writes(self.executor.apply(updates))

    def _is_idle(self, cgroup: PurePosixPath, source: str) -> bool:
        try:
            return self.executor.read(cgroup, CPU_IDLE, source).strip() == "1"
        except CgroupError:
            return False  # gone: the update above reports it

    def _weight(self, pod: PodInfo, cgroup: PurePosixPath, idle: int, source: str) -> list[Update]:
        """The weight write that goes with this cpu.idle write: after it when clearing
        (the kernel refuses a weight on an idle group, and resets it when cleared)."""
        if idle == 1:
            if not self._is_idle(cgroup, source) and self.executor.layout.version == 1:
                try:
                    self._replaced[cgroup] = int(self.executor.read(cgroup, CPU_SHARES, source))
                except (CgroupError, ValueError):
                    pass
            return []
        if not self._is_idle(cgroup, source):
            return []
        derived = derived_weight(pod)
        replaced = self._replaced.pop(cgroup, None)
        if derived is None and replaced is not None:
            derived = replaced, "the weight before cpu.idle was set"
        if derived is None:
            log.warning("group_identity_weight_unknown", pod=pod_name(pod), cgroup=str(cgroup),
                        detail="cpu.idle cleared: the kernel's default weight stays (1024)")
            return []
        weight, whose = derived
        return [Update(cgroup, CPU_SHARES, weight, f"cpu.idle cleared: weight restored: {whose}", source)]

    def host_support(self) -> HostSupport:
        """check-config's plan: whether this host has cpu.bvt_warp_ns (or cpu.idle)."""
        try:
            detection = self._detect(kubepods_probe(self.executor.layout), PROBE_SOURCE)
        except CgroupError as exc:
            return unknown_until_a_pod(exc)
        return ("off" if detection.mode is Mode.NONE else "on"), detection.describe()

    def pre_run_pod_sandbox(self, ctx: PodContext) -> PodPatch | None:
        done = self._apply(ctx.pod)
        if done is None:
            return None
        update, writes = done
        return PodPatch(reason=update.reason if writes else f"{update.reason} (already set)", writes=writes)

    def reconcile_pod_sandbox(self, ctx: PodContext) -> PodPatch | None:
        """Re-apply the pod's bvt / cpu.idle; a patch only when a file had drifted."""
        done = self._apply(ctx.pod)
        if done is None or not done[1]:
            return None
        update, writes = done
        return PodPatch(reason=f"{update.reason} (reconciled)", writes=writes)
