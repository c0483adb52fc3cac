"""Memory QoS of the kube-QoS tiers (koordlet's CgroupReconcile, reference §4.4): strategy ``memory-qos``.

Why a strategy: a tier's ``memory.min`` / ``memory.low`` is the sum over *all* its
pods, so it belongs to something that sees every pod every round. The hook
``memory-qos`` (``hooks.memoryqos``) keeps the per-pod and per-container values (it
has the container requests from the CRI calls, at the moment the container starts);
this strategy keeps, every round, from the full pod list:

* ``kubepods/burstable`` and ``kubepods/besteffort``: min/low = Σ of their pods';
* the ``kubepods`` root (where Guaranteed pods live): Σ of every pod below it.

A pod's (min, low) is what its cgroup holds (``memory.min`` / ``memory.low`` as the
hook, or kubelet's MemoryQoS gate, wrote them). **Ours:** koordlet recomputes each pod's
values from its spec; the proxy has no pod spec (the requests arrive only in the CRI
calls the hook sees), so the strategy sums what the kernel enforces, which is also what
a tier must cover for its children's protection to take effect. A tier whose last pod
left goes back to 0 (its directory exists, nothing below counts). koordlet also writes
the Anolis ``priority`` / ``use_priority_oom`` / ``oom.group`` on the tiers: not done.

Writes are one ``LeveledWrite`` (root first, then the tiers: widened top-down, lowered
bottom-up). Nothing is planned while no class rule and no pod annotation
(``koordinator.sh/memoryQOS``, policy other than ``none``) enables memory QoS and it
never was; once it was, the sums keep following the pods (whose values the hook resets).

The root is the configured one (``metrics.qos.tierroot``: the parent of ``besteffort_dir``,
never ``/kubepods`` as such) plus those above the pods' cgroups. Support is detected once,
when the ``kubepods`` root exists: ``memory.min`` there
(cgroup v2 upstream; v1 only on Anolis kernels). Without it: one log line
(``memory_qos_tiers_unsupported``) and the strategy plans nothing, ever.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Final

import structlog

from hooks.cgroups import CgroupError
from hooks.executor import CgroupExecutor
from hooks.memoryqoscalc import (
    MEMORY_LOW,
    MEMORY_MIN,
    MEMORY_QOS_ANNOTATION,
    PodProtection,
    parse_pod_memory_qos,
    tier_sums,
    tiers_of,
)
from hooks.qos import KubeQoS, QoSClass
from hooks.rules import Rules
from metrics.model import PodView
from metrics.qos.plan import LeveledWrite, Plan, Priority, SetCgroup
from metrics.qos.podmemo import PodListMemo
from metrics.qos.strategy import Input, RoundContext, RoundInputs, Strategy, StrategyInit
from metrics.qos.tierroot import DEFAULT_BESTEFFORT, configured_root
from runtimeproxy.hookapi import HookConfigError

log = structlog.get_logger("metrics.qos.memoryqos")

NAME: Final = "memory_qos"
_CLASSES: Final = (QoSClass.LSR, QoSClass.LS, QoSClass.BE, QoSClass.SYSTEM)
_TIERS: Final = {"cgroupfs": ("kubepods", "burstable", "besteffort"),
                 "systemd": ("kubepods.slice", "kubepods-burstable.slice", "kubepods-besteffort.slice")}


@dataclass(frozen=True, slots=True)
class PodMemory:
    """One pod's protection as its cgroup holds it."""

    uid: str
    key: str
    cgroup: PurePosixPath
    kube: str  # guaranteed | burstable | besteffort
    min: int
    low: int


@dataclass(frozen=True, slots=True)
class TierState:
    """What one round read: support, the pods' values, the tiers' current values."""

    supported: bool | None  # None: no kubepods cgroup yet, not detected
    pods: tuple[PodMemory, ...] = ()
    #: tier dir -> (memory.min, memory.low) now (None: unreadable).
    current: dict[PurePosixPath, tuple[int, int] | None] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()
    #: Why memory QoS is on for the tiers ("": off, nothing was read).
    why: str = ""

    def describe(self) -> dict[str, Any]:
        return {"supported": self.supported, "why": self.why, "pods": len(self.pods), "skipped": list(self.skipped),
                "current": {str(k): list(v) if v is not None else None for k, v in self.current.items()}}


_KUBE: Final = {"guaranteed": KubeQoS.GUARANTEED, "burstable": KubeQoS.BURSTABLE, "besteffort": KubeQoS.BESTEFFORT}


def tier_dirs(pod: PodMemory) -> tuple[PurePosixPath, PurePosixPath | None]:
    """(kubepods root, burstable/besteffort tier or None) of a pod."""
    return tiers_of(pod.cgroup, _KUBE[pod.kube])


def sums_with_empty(pods: Sequence[PodMemory], tiers: Sequence[PurePosixPath]
                    ) -> dict[PurePosixPath, tuple[int, int]]:
    """``memoryqoscalc.tier_sums`` of the pods, plus every tier in ``tiers`` without pods at 0."""
    sums = {t: (0, 0) for t in tiers}
    sums.update(tier_sums(PodProtection(p.cgroup, _KUBE[p.kube], p.min, p.low) for p in pods))
    return sums


@dataclass(frozen=True, slots=True)
class _PodDir:
    """A pod with a kube-QoS tier: its cgroup and the tier dirs above it (from the pod alone)."""

    pod: PodView
    key: str
    cgroup: PurePosixPath
    #: Its kubepods root, then its burstable/besteffort tier (none for Guaranteed).
    tiers: tuple[PurePosixPath, ...]


def _pod_dirs(pods: Sequence[PodView]) -> tuple[_PodDir, ...]:
    out: list[_PodDir] = []
    for pod in pods:
        if pod.kube_qos not in _KUBE or not pod.cgroup_dir:
            continue
        cgroup = PurePosixPath(pod.cgroup_dir.strip("/"))
        out.append(_PodDir(pod, pod.key, cgroup, tuple(t for t in tiers_of(cgroup, _KUBE[pod.kube_qos]) if t)))
    return tuple(out)


def sums_and_counts(pods: Sequence[PodMemory], tiers: Sequence[PurePosixPath]
                    ) -> tuple[dict[PurePosixPath, tuple[int, int]], dict[PurePosixPath, int]]:
    """``sums_with_empty`` and each tier's pod count, counted in one pass over the pods
    (counting per tier walked every pod's tiers once per tier: issue 29)."""
    sums = sums_with_empty(pods, tiers)
    counts = dict.fromkeys(sums, 0)
    for pod in pods:
        for where in tier_dirs(pod):
            if where is not None:
                counts[where] += 1
    return sums, counts


def _wants_memory_qos(pod: PodView) -> bool:
    raw = pod.annotations.get(MEMORY_QOS_ANNOTATION)
    if raw is None:
        return False
    try:
        policy, _fields = parse_pod_memory_qos(raw)
    except ValueError:
        return False  # the hook refuses the pod naming the field; nothing to sum for it here
    return policy != "none"


def _read_text(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.read(fd, 256).decode("ascii", "replace")
    finally:
        os.close(fd)


class _Pairs:
    """(memory.min, memory.low) of cgroups; the confined paths are resolved once per
    cgroup (two ``resolve`` calls per file cost more than the read), reused while the
    cgroup is asked for each round."""

    def __init__(self) -> None:
        self._paths: dict[PurePosixPath, tuple[str, str]] = {}
        self._used: set[PurePosixPath] = set()

    def read(self, executor: CgroupExecutor, cgroup: PurePosixPath) -> tuple[int, int] | None:
        self._used.add(cgroup)
        version = executor.layout.version
        try:
            paths = self._paths.get(cgroup)
            if paths is None:
                paths = self._paths[cgroup] = (str(executor.path(cgroup, MEMORY_MIN)),
                                               str(executor.path(cgroup, MEMORY_LOW)))
            values = [int(MEMORY_MIN.parse(_read_text(paths[0]), version)),
                      int(MEMORY_LOW.parse(_read_text(paths[1]), version))]
        except (CgroupError, OSError, ValueError):
            self._paths.pop(cgroup, None)  # gone or not there yet: resolved again when asked again
            return None
        if any(v < 0 for v in values):  # "max" protection: not a number to add
            return None
        return values[0], values[1]

    def end_round(self) -> None:
        self._paths = {k: v for k, v in self._paths.items() if k in self._used}
        self._used = set()


class MemoryQoSTiers(Strategy):
    name = "memory-qos"
    #: Nobody else writes the tiers' memory.min/low: between resctrl and burst.
    priority = Priority.RESCTRL + 5

    def __init__(self, driver: str, root: PurePosixPath | None = None) -> None:
        _, burstable, besteffort = _TIERS.get(driver, _TIERS["cgroupfs"])
        self.root = root if root is not None else configured_root(DEFAULT_BESTEFFORT, driver)
        self.defaults = (self.root, self.root / burstable, self.root / besteffort)
        self.supported: bool | None = None
        self.was_active = False
        #: Tiers seen with pods before: they get 0 when their last pod leaves.
        self.known: set[PurePosixPath] = set()
        self.pairs = _Pairs()
        #: The pods' cgroups and tiers, parsed once per pod list (every pod, every round).
        self._dirs = PodListMemo(_pod_dirs)
        self.state: Input[TierState] = Input("memory_qos_tiers", self._read, TierState.describe)
        self.reads = (self.state,)

    def _detect(self, executor: CgroupExecutor, root: PurePosixPath | None = None) -> bool | None:
        if self.supported is not None:
            return self.supported
        try:
            path = executor.path(root or self.root, MEMORY_MIN, "memory-qos: kubepods root")
        except CgroupError:
            return None
        if not path.parent.is_dir():
            return None
        self.supported = path.is_file()
        if self.supported:
            log.info("memory_qos_tiers_detected", where=str(path.parent), version=executor.layout.version)
        else:
            log.info("memory_qos_tiers_unsupported", where=str(path.parent), version=executor.layout.version,
                     detail=f"cgroup v{executor.layout.version} without memory.min: the kube-QoS tiers' "
                            "memory QoS is off (upstream v1 has none; Anolis kernels add it)")
        return self.supported

    def _read(self, ctx: RoundContext) -> TierState:
        supported = self._detect(ctx.executor)
        if supported is None:  # no configured root (yet): the one above the pods, if any
            for root in sorted({tier_dirs(PodMemory("", "", PurePosixPath(p.cgroup_dir.strip("/")), p.kube_qos,
                                                    0, 0))[0]
                                for p in ctx.pods if p.kube_qos in _KUBE and p.cgroup_dir}):
                supported = self._detect(ctx.executor, root)
                if supported is not None:
                    break
        if not supported:
            return TierState(supported)
        why = self._active(ctx.rules, ctx.pods)
        if not why:
            return TierState(True)  # off: no pod file is read
        dirs = self._dirs(ctx.pods)
        pods: list[PodMemory] = []
        skipped: list[str] = []
        tiers: set[PurePosixPath] = set()
        for entry in dirs:
            pair = self.pairs.read(ctx.executor, entry.cgroup)
            if pair is None:
                skipped.append(entry.key)  # gone, not created yet, or unreadable: it counts when it reads
                continue
            pods.append(PodMemory(entry.pod.uid, entry.key, entry.cgroup, entry.pod.kube_qos, pair[0], pair[1]))
            tiers.update(entry.tiers)
        tiers.update(t for t in (*self.defaults, *self.known) if self._exists(ctx.executor, t))
        current = {t: self.pairs.read(ctx.executor, t) for t in sorted(tiers)}
        self.pairs.end_round()
        return TierState(True, tuple(pods), current, tuple(skipped), why)

    @staticmethod
    def _exists(executor: CgroupExecutor, cgroup: PurePosixPath) -> bool:
        try:
            return executor.path(cgroup, MEMORY_MIN).is_file()
        except CgroupError:
            return False

    def _active(self, rules: Rules, pods: Sequence[PodView]) -> str:
        """Why memory QoS is on for the tiers ("" = off)."""
        classes = [c.value for c in _CLASSES if rules.for_class(c).memory_qos.enable]
        if classes:
            return f"resourceQOSStrategy memoryQOS enabled for {', '.join(classes)}"
        opted = [p.key for p in pods if _wants_memory_qos(p)]
        if opted:
            return f"pod annotation {MEMORY_QOS_ANNOTATION} on {len(opted)} pod(s), e.g. {opted[0]}"
        if self.was_active:
            return "memory QoS was enabled: the tiers follow the pods' values (reset by the hook)"
        return ""

    def plan(self, inputs: RoundInputs) -> Plan:
        state = inputs[self.state]
        info: dict[str, Any] = {"supported": state.supported}
        if state.supported is None:
            return Plan(NAME, self.priority, (), info, f"no {self.root} cgroup yet: support not detected")
        if not state.supported:
            return Plan(NAME, self.priority, (), info, "memory QoS off: no memory.min in the kubepods cgroup")
        why = state.why
        if not why:
            return Plan(NAME, self.priority, (), info, "memory QoS not enabled by any class rule or pod annotation")
        self.was_active = True
        sums, counts = sums_and_counts(state.pods, list(state.current))
        self.known.update(t for t in sums if t != self.root and t in state.current)
        info.update({"why": why, "skipped": list(state.skipped),
                     "tiers": {str(t): {"pods": counts[t], "min": v[0], "low": v[1],
                                        "current": list(state.current[t] or ()) or None}
                               for t, v in sorted(sums.items())}})
        top = tuple(t for t in sorted(sums) if not any(o in t.parents for o in sums))  # the kubepods root(s)
        levels: list[tuple[SetCgroup, ...]] = []
        for group in (top, tuple(t for t in sorted(sums) if t not in top)):
            items: list[SetCgroup] = []
            for t in group:
                low_min, low = sums[t]
                reason = f"kube-QoS tier {t}: sum of its {counts[t]} pods' memory.min/low ({why})"
                items.extend((SetCgroup(t, MEMORY_MIN, low_min, reason), SetCgroup(t, MEMORY_LOW, low, reason)))
            if items:
                levels.append(tuple(items))
        action = LeveledWrite(tuple(levels), "kube-QoS tiers: memory.min/low = Σ of their pods'")
        return Plan(NAME, self.priority, (action,) if levels else (), info,
                    f"{len(sums)} kube-QoS tier(s) from {len(state.pods)} pod(s)")

    def enabled(self, rules: Rules) -> bool:
        return self.supported is not False

    def off_reason(self, rules: Rules) -> str:
        return "" if self.enabled(rules) else "memory.min/memory.low are not supported by this kernel's cgroups"


def memory_qos(init: StrategyInit) -> MemoryQoSTiers:
    if init.args:
        raise HookConfigError(init.key_path, dict(init.args), "memory-qos takes no args")
    driver = init.executor.layout.driver
    strategy = MemoryQoSTiers(driver, configured_root(init.config.suppress.besteffort_dir, driver))
    strategy._detect(init.executor)
    return strategy
