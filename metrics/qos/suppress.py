"""BE CPU suppression (reference §4.1): how much CPU best-effort pods may use now.

``suppress = capacity x threshold% - Σ used(non-BE pods) - systemUsed`` with
``systemUsed = max(node - Σ pods, reserved)`` (floored at ``capacity x
cpuSuppressMinPercent%`` when set). The result becomes either a cpuset for the
BE tree (whole hyper-thread pairs first, spread over NUMA nodes, never on
reserved or LSE-bound CPUs, growing at most ~10 % of the CPUs per round) or a
CFS quota on ``kubepods/besteffort`` (1 % dead band, ≤ 10 % growth per round).
The knob of the other policy is recovered; with the feature disabled both are.

On cgroup v1 a parent's quota cannot go below a child's (the kernel answers
EINVAL), and BE pods may carry their own quotas (batch-cpu limits, or a kubelet
limit). So a tier quota is written together with its BE children: every pod or
container quota above the new tier quota (compared as quota/period, as the
kernel does) is clamped to it first (containers, then pods, then the tier: one
leveled write), and its original is remembered; when the tier grows back (or is
recovered) the originals are restored, tier first. A child whose quota someone
else changed since (batch-resource's reconcile, kubelet) is not restored over:
its new value becomes the original.

Only the BE tree is written: LS/LSR/LSE pods are never planned here. Planning
is pure (``plan``); reading the current BE state is ``read_be_state``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Final, Protocol

import structlog

from hooks.annotations import RESOURCE_STATUS, AnnotationError, parse_resource_status
from hooks.cgroups import CPU_CFS_PERIOD, CPU_CFS_QUOTA, CPUSET_CPUS, CgroupError
from hooks.cpusets import CpuListError, format_cpu_list, parse_cpu_list
from hooks.executor import CgroupExecutor
from hooks.qos import QoSClass
from hooks.rules import ResourceThresholdStrategy
from metrics.model import (
    BE_SUPPRESS_BE_USED_CPU,
    BE_SUPPRESS_CPU,
    BE_SUPPRESS_LS_USED_CPU,
    NO_LABELS,
    SUPPRESS_TYPE,
    PodView,
    Sample,
    labels,
)
from metrics.qos.inputs import NodeInputs
from metrics.qos.plan import Action, LeveledWrite, Plan, Priority, SetCgroup

log = structlog.get_logger("metrics.qos.suppress")

NAME: Final = "cpu_suppress"
MIN_QUOTA: Final = 2000  # µs: koordlet's floor, so BE pods are throttled, never frozen
MIN_CPUSET: Final = 2
GROWTH_RATIO: Final = 0.1
DEAD_BAND_RATIO: Final = 0.01


class CPULike(Protocol):
    """One logical CPU of the node (``metrics.collect.topology.CPUInfo`` fits)."""

    @property
    def cpu(self) -> int: ...
    @property
    def core(self) -> int: ...
    @property
    def socket(self) -> int: ...
    @property
    def numa(self) -> int: ...


@dataclass(frozen=True, slots=True)
class SuppressConfig:
    besteffort_dir: PurePosixPath = PurePosixPath("kubepods/besteffort")
    cfs_period_us: int = 100_000
    #: kubelet's reserved CPUs (``--reserved-cpus``), never given to BE.
    reserved_cpus: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class ChildQuota:
    """The CFS quota of a cgroup under the tier: a pod (``depth`` 0), a container or the
    sandbox's pause cgroup (1), deeper (2); ``pod_uid`` "" when no known pod owns it."""

    cgroup: PurePosixPath
    quota: int  # -1: none
    period: int
    pod_uid: str
    depth: int


@dataclass(frozen=True, slots=True)
class BEState:
    """The BE tree's current knobs (None: unreadable, so no decision is made)."""

    cpuset: frozenset[int] | None
    quota: int | None
    #: BE pods' and containers' quotas under the tier (cgroup v1 only: v2 takes the
    #: minimum of parent and child itself, so nothing needs clamping there).
    children: tuple[ChildQuota, ...] = ()

    def limit_cores(self, policy: str, capacity: float, period: int) -> float | None:
        """The BE CPU limit in force under ``policy``."""
        if policy == "cpuset":
            return None if self.cpuset is None else float(len(self.cpuset))
        if self.quota is None:
            return None
        return capacity if self.quota <= 0 else self.quota / period


def _child_quota(executor: CgroupExecutor, cgroup: PurePosixPath, default_period: int) -> tuple[int, int] | None:
    """(quota, period) of one cgroup; None when unreadable (gone, not created yet)."""
    version = executor.layout.version
    try:
        quota = int(CPU_CFS_QUOTA.parse(executor.read(cgroup, CPU_CFS_QUOTA), version))
    except (CgroupError, ValueError):
        return None
    if quota <= 0:
        return quota, default_period  # unlimited: its period does not matter
    try:
        period = int(CPU_CFS_PERIOD.parse(executor.read(cgroup, CPU_CFS_PERIOD), version))
    except (CgroupError, ValueError):
        period = default_period
    return quota, period if period > 0 else default_period


#: How deep under the tier quotas are looked for: pods, their containers (and the
#: sandbox's pause cgroup), and one level more for runtimes that nest.
CHILD_DEPTH: Final = 3


def _subdirs(executor: CgroupExecutor, cgroup: PurePosixPath) -> list[PurePosixPath]:
    try:
        directory = executor.path(cgroup, CPU_CFS_QUOTA).parent
        with os.scandir(directory) as entries:
            names = sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
    except (CgroupError, OSError):
        return []  # gone meanwhile: nothing under it to respect
    return [cgroup / name for name in names]


def read_children(executor: CgroupExecutor, cfg: SuppressConfig, pods: Sequence[PodView]) -> tuple[ChildQuota, ...]:
    """The quotas of every cgroup under the tier (v1 only, see ``BEState``), found on the
    filesystem rather than from the pod views: the kernel's rule is about the hierarchy,
    so a container created since the views were built, a sandbox's pause cgroup or a pod
    the proxy does not know counts too. ``pods`` only name the owners, for arbitration."""
    if executor.layout.version != 1:
        return ()
    owners = {PurePosixPath(p.cgroup_dir): p.uid for p in pods}
    owners |= {PurePosixPath(c.cgroup_dir): p.uid for p in pods for c in p.containers}
    out: list[ChildQuota] = []
    level = _subdirs(executor, cfg.besteffort_dir)
    for depth in range(CHILD_DEPTH):
        below: list[PurePosixPath] = []
        for cgroup in level:
            read = _child_quota(executor, cgroup, cfg.cfs_period_us)
            if read is None:
                continue
            uid = owners.get(cgroup) or owners.get(PurePosixPath(*cgroup.parts[:len(cfg.besteffort_dir.parts) + 1]), "")
            out.append(ChildQuota(cgroup, read[0], read[1], uid, depth))
            if depth + 1 < CHILD_DEPTH:
                below.extend(_subdirs(executor, cgroup))
        level = below
    return tuple(out)


def read_be_state(executor: CgroupExecutor, cfg: SuppressConfig, pods: Sequence[PodView] = ()) -> BEState:
    def read(resource: Any) -> str | None:
        try:
            return executor.read(cfg.besteffort_dir, resource)
        except CgroupError as exc:
            log.debug("be_state_unreadable", resource=resource.name, reason=str(exc))
            return None

    raw_cpus, raw_quota = read(CPUSET_CPUS), read(CPU_CFS_QUOTA)
    try:
        cpus = parse_cpu_list(raw_cpus) if raw_cpus is not None else None
    except CpuListError:
        cpus = None
    quota_text = (raw_quota or "").split()
    quota: int | None = None
    if quota_text:
        quota = -1 if quota_text[0] == "max" else int(quota_text[0]) if quota_text[0].lstrip("-").isdigit() else None
    return BEState(cpus, quota, read_children(executor, cfg, pods))


def is_be(pod: PodView) -> bool:
    """Koordinator's BE test: koord QoS BE or kube QoS BestEffort."""
    return pod.qos is QoSClass.BE or pod.kube_qos == "besteffort"


@dataclass(frozen=True, slots=True)
class SuppressFormula:
    suppress: float
    non_be_used: float
    system_used: float
    pods_used: float
    floor: float | None

    def describe(self) -> dict[str, Any]:
        return {"suppress_cores": round(self.suppress, 4), "non_be_used": round(self.non_be_used, 4),
                "system_used": round(self.system_used, 4), "pods_used": round(self.pods_used, 4),
                "floor_cores": self.floor}


def suppress_cores(inputs: NodeInputs, threshold: ResourceThresholdStrategy) -> SuppressFormula:
    """The formula of §4.1. Pods with metrics but no PodView count as non-BE; with
    tier sums (fast path), non-BE = all pods minus the besteffort tier."""
    assert inputs.node_cpu_used is not None
    if inputs.tiers is not None:
        pods_used = inputs.tiers.pods
        non_be = max(inputs.tiers.pods - inputs.tiers.be, 0.0)
    else:
        be_uids = {p.uid for p in inputs.pods if is_be(p)}
        pods_used = sum(inputs.pod_cpu_used.values())
        non_be = sum(v for uid, v in inputs.pod_cpu_used.items() if uid not in be_uids)
    system = max(max(inputs.node_cpu_used - pods_used, 0.0), inputs.reserved_cores)
    value = inputs.capacity_cores * threshold.cpu_suppress_threshold_percent / 100 - non_be - system
    floor = None
    if threshold.cpu_suppress_min_percent is not None:
        floor = inputs.capacity_cores * threshold.cpu_suppress_min_percent / 100
        value = max(value, floor)
    return SuppressFormula(value, non_be, system, pods_used, floor)


# --- cpuset selection ----------------------------------------------------------------


def _buckets(cpus: Iterable[CPULike]) -> list[list[CPULike]]:
    """By (NUMA node, socket), each sorted by (core, cpu); biggest bucket first."""
    by_node: dict[tuple[int, int], list[CPULike]] = {}
    for c in cpus:
        by_node.setdefault((c.numa, c.socket), []).append(c)
    buckets = [sorted(b, key=lambda c: (c.core, c.cpu)) for b in by_node.values()]
    return sorted(buckets, key=lambda b: (-len(b), b[0].cpu))


def _pairs(bucket: Sequence[CPULike]) -> list[tuple[int, int]]:
    by_core: dict[int, list[int]] = {}
    for c in bucket:
        by_core.setdefault(c.core, []).append(c.cpu)
    return [(ids[i], ids[i + 1]) for ids in by_core.values() for i in range(0, len(ids) - 1, 2)]


def select_cpus(n: int, cpus: Sequence[CPULike]) -> frozenset[int]:
    """``n`` CPUs: whole hyper-thread pairs round-robin over NUMA/socket buckets,
    then single CPUs the same way (koordlet's calculateBESuppressCPUSetPolicy)."""
    if n >= len(cpus):
        return frozenset(c.cpu for c in cpus)
    buckets = _buckets(cpus)
    pairs = [_pairs(b) for b in buckets]
    chosen: list[int] = []
    turn = 0
    while n - len(chosen) >= 2 and any(pairs):
        pair_queue = pairs[turn % len(buckets)]
        if pair_queue:
            chosen.extend(pair_queue.pop(0))
        turn += 1
    singles = [[c.cpu for c in b if c.cpu not in chosen] for b in buckets]
    while len(chosen) < n and any(singles):
        queue = singles[turn % len(buckets)]
        if queue:
            chosen.append(queue.pop(0))
        turn += 1
    return frozenset(chosen)


def bound_cpus(pods: Iterable[PodView], classes: frozenset[QoSClass], warned: set[str]) -> frozenset[int]:
    """CPUs the scheduler bound pods of ``classes`` to (resource-status annotation).
    A bad annotation is reported once and skipped: the cpuset hook refused that
    pod's binding too, so its CPUs are not exclusive."""
    out: set[int] = set()
    for pod in pods:
        raw = pod.annotations.get(RESOURCE_STATUS)
        if pod.qos not in classes or raw is None:
            continue
        try:
            out |= parse_resource_status(raw).cpus
        except AnnotationError as exc:
            if pod.uid not in warned:
                warned.add(pod.uid)
                log.warning("resource_status_ignored", pod=pod.key, reason=str(exc))
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class Decision:
    """The BE limit a plan sets (in cores, under ``policy``) and the formula behind it."""

    policy: str
    limit_cores: float
    formula: SuppressFormula

    def samples(self, now: float) -> list[Sample]:
        """koordlet's ``be_suppress_*`` series (its CPUSuppress records the same)."""
        be_used = max(self.formula.pods_used - self.formula.non_be_used, 0.0)
        return [Sample(BE_SUPPRESS_CPU, self.limit_cores, labels(**{SUPPRESS_TYPE: self.policy}), now),
                Sample(BE_SUPPRESS_LS_USED_CPU, self.formula.non_be_used, NO_LABELS, now),
                Sample(BE_SUPPRESS_BE_USED_CPU, be_used, NO_LABELS, now)]


class SuppressStrategy:
    """Plans the BE CPU limit; keeps the warn-once set and the last plan's decision."""

    def __init__(self, cfg: SuppressConfig, topology: Sequence[CPULike]) -> None:
        self.cfg = cfg
        self.topology = tuple(sorted(topology, key=lambda c: c.cpu))
        self._warned: set[str] = set()
        #: What the last ``plan`` decided; None when it made no decision (disabled,
        #: missing inputs, unreadable state, no CPU left).
        self.decision: Decision | None = None
        #: BE children clamped below their own quota: cgroup -> (original, clamped value).
        self._clamped: dict[PurePosixPath, _Clamp] = {}

    def recovery_cpus(self, pods: Sequence[PodView]) -> frozenset[int]:
        """All CPUs - LSE-bound - reserved (koordlet's calcBECPUSet)."""
        lse = bound_cpus(pods, frozenset({QoSClass.LSE}), self._warned)
        return frozenset(c.cpu for c in self.topology) - lse - self.cfg.reserved_cpus

    def _cpuset_write(self, pods: Sequence[PodView], cpus: frozenset[int], reason: str) -> LeveledWrite:
        text = format_cpu_list(cpus)
        be = [p for p in pods if p.qos is QoSClass.BE]
        top = (SetCgroup(self.cfg.besteffort_dir, CPUSET_CPUS, text, reason),)
        pod_level = tuple(SetCgroup(PurePosixPath(p.cgroup_dir), CPUSET_CPUS, text, reason, p.uid) for p in be)
        ctr_level = tuple(SetCgroup(PurePosixPath(c.cgroup_dir), CPUSET_CPUS, text, reason, p.uid)
                          for p in be for c in p.containers)
        return LeveledWrite(tuple(lv for lv in (top, pod_level, ctr_level) if lv), reason)

    def _quota_write(self, quota: int, reason: str, children: Sequence[ChildQuota] | None = None
                     ) -> SetCgroup | LeveledWrite:
        """The tier quota, with the BE children it needs clamped or may get back (see
        the module doc); a plain write when no child needs one. ``children`` None: the
        current values are unknown (recovery), so every remembered original is restored."""
        tier = SetCgroup(self.cfg.besteffort_dir, CPU_CFS_QUOTA, quota, reason)
        if children is None:
            if quota > 0:
                return tier
            restore = [(SetCgroup(cg, CPU_CFS_QUOTA, c.original, f"{reason}: child quota {c.original} restored",
                                  c.pod_uid), c.depth) for cg, c in sorted(self._clamped.items())]
            self._clamped.clear()
            return self._levels(tier, restore)
        items: list[tuple[SetCgroup, int]] = []
        present: set[PurePosixPath] = set()
        for child in children:
            present.add(child.cgroup)
            item = self._child(child, quota, reason)
            if item is not None:
                items.append((item, child.depth))
        for gone in set(self._clamped) - present:
            del self._clamped[gone]
        return self._levels(tier, items)

    def _child(self, child: ChildQuota, tier_quota: int, reason: str) -> SetCgroup | None:
        """The write one child needs under a tier quota of ``tier_quota``, if any."""
        remembered = self._clamped.get(child.cgroup)
        if remembered is not None and child.quota != remembered.clamped:
            remembered = None  # changed by someone else since: that is its own value now
            del self._clamped[child.cgroup]
        original = remembered.original if remembered is not None else child.quota
        # The kernel compares quota/period: the child may have at most the tier's ratio.
        limit = tier_quota * child.period // self.cfg.cfs_period_us if tier_quota > 0 else None
        if limit is not None and original > limit:
            self._clamped[child.cgroup] = _Clamp(original, limit, child.pod_uid, child.depth)
            target, why = limit, f"{reason}: child quota {original} clamped to the tier's"
        else:
            self._clamped.pop(child.cgroup, None)
            target, why = original, f"{reason}: child quota {original} restored"
        if target == child.quota:
            return None
        return SetCgroup(child.cgroup, CPU_CFS_QUOTA, target, why, child.pod_uid)

    @staticmethod
    def _levels(tier: SetCgroup, items: Sequence[tuple[SetCgroup, int]]) -> SetCgroup | LeveledWrite:
        """The tier, then its children level by level (parents before children)."""
        if not items:
            return tier
        depths = sorted({depth for _, depth in items})
        levels = [tuple(i for i, d in items if d == depth) for depth in depths]
        return LeveledWrite(((tier,), *levels), tier.reason)

    @property
    def clamped(self) -> dict[str, int]:
        """Children clamped now: cgroup -> original quota (for explain and tests)."""
        return {str(cg): c.original for cg, c in self._clamped.items()}

    def recover(self, pods: Sequence[PodView], *, cpuset: bool, quota: bool, why: str) -> list[Action]:
        actions: list[Action] = []
        if cpuset:
            actions.append(self._cpuset_write(pods, self.recovery_cpus(pods), f"recover BE cpuset ({why})"))
        if quota:
            actions.append(self._quota_write(-1, f"recover BE cfs quota ({why})"))
        return actions

    def plan(self, inputs: NodeInputs, threshold: ResourceThresholdStrategy, state: BEState) -> Plan:
        self.decision = None
        if not threshold.enable:
            acts = self.recover(inputs.pods, cpuset=True, quota=True, why="resourceUsedThresholdWithBE disabled")
            return Plan(NAME, Priority.SUPPRESS, tuple(acts), {"enable": False}, "disabled: recovering BE limits")
        non_be = [p for p in inputs.pods if not is_be(p)]
        missing = inputs.missing_for(*non_be)
        base = {"policy": threshold.cpu_suppress_policy, "source": inputs.source,
                "threshold_percent": threshold.cpu_suppress_threshold_percent}
        if missing:
            return Plan(NAME, Priority.SUPPRESS, (), {**base, "missing": missing},
                        f"no decision: missing or stale {', '.join(missing)}")
        formula = suppress_cores(inputs, threshold)
        info = {**base, **formula.describe(), "node_used": inputs.node_cpu_used,
                "capacity_cores": inputs.capacity_cores, "reserved_cores": inputs.reserved_cores}
        if threshold.cpu_suppress_policy == "cpuset":
            return self._plan_cpuset(inputs, formula, state, info)
        return self._plan_quota(inputs, formula, state, info)

    def _plan_cpuset(self, inputs: NodeInputs, formula: SuppressFormula, state: BEState,
                     info: dict[str, Any]) -> Plan:
        if state.cpuset is None:
            return Plan(NAME, Priority.SUPPRESS, (), info, "no decision: current BE cpuset unreadable")
        lse = bound_cpus(inputs.pods, frozenset({QoSClass.LSE}), self._warned)
        lsr = bound_cpus(inputs.pods, frozenset({QoSClass.LSR}), self._warned)
        candidates = [c for c in self.topology if c.cpu not in lse and c.cpu not in self.cfg.reserved_cpus]
        wanted = max(math.ceil(formula.suppress), MIN_CPUSET)
        cap = len(state.cpuset) + math.ceil(GROWTH_RATIO * len(self.topology))
        n = min(wanted, cap, len(candidates))
        cpus = _split_select(n, candidates, lsr)
        info = {**info, "wanted_cpus": wanted, "growth_cap": cap, "cpus": format_cpu_list(cpus),
                "excluded_lse": format_cpu_list(lse), "excluded_reserved": format_cpu_list(self.cfg.reserved_cpus)}
        if not cpus:
            return Plan(NAME, Priority.SUPPRESS, (), info, "no decision: no CPU left for BE")
        reason = f"BE suppress: {formula.suppress:.2f} cores -> cpuset {format_cpu_list(cpus)}"
        self.decision = Decision("cpuset", float(len(cpus)), formula)
        actions = (self._cpuset_write(inputs.pods, cpus, reason),
                   *self.recover(inputs.pods, cpuset=False, quota=True, why="policy cpuset"))
        return Plan(NAME, Priority.SUPPRESS, actions, info, reason)

    def _plan_quota(self, inputs: NodeInputs, formula: SuppressFormula, state: BEState,
                    info: dict[str, Any]) -> Plan:
        if state.quota is None:
            return Plan(NAME, Priority.SUPPRESS, (), info, "no decision: current BE cfs quota unreadable")
        new, why = quota_target(formula.suppress, state.quota, inputs.capacity_cores, self.cfg.cfs_period_us)
        info = {**info, "current_quota": state.quota, "quota": new}
        recovery = self.recover(inputs.pods, cpuset=True, quota=False, why="policy cfsQuota")
        kept = state.quota if new is None else new
        if kept > 0:
            self.decision = Decision("cfsQuota", kept / self.cfg.cfs_period_us, formula)
        write = self._quota_write(kept, why, state.children)
        info["clamped_children"] = self.clamped
        if new is None and isinstance(write, SetCgroup):
            return Plan(NAME, Priority.SUPPRESS, tuple(recovery), info, why)
        return Plan(NAME, Priority.SUPPRESS, (write, *recovery), info, why)


@dataclass(frozen=True, slots=True)
class _Clamp:
    original: int
    clamped: int
    pod_uid: str
    depth: int


def quota_target(suppress: float, current: int, capacity: float, period: int) -> tuple[int | None, str]:
    """The new BE quota (None: inside the dead band) and why."""
    new = max(int(suppress * period), MIN_QUOTA)
    if current > 0 and new > current:
        new = min(new, current + int(capacity * period * GROWTH_RATIO))
    if current > 0 and new != MIN_QUOTA and abs(new - current) < capacity * period * DEAD_BAND_RATIO:
        return None, f"BE quota {current} kept: {new} is within the 1% dead band"
    return new, f"BE suppress: {suppress:.2f} cores -> cfs quota {new}"


def _split_select(n: int, candidates: Sequence[CPULike], lsr: frozenset[int]) -> frozenset[int]:
    """Share the BE CPUs between LSR-bound CPUs and the rest in proportion to their sizes."""
    on_lsr = [c for c in candidates if c.cpu in lsr]
    rest = [c for c in candidates if c.cpu not in lsr]
    if not on_lsr or not rest:
        return select_cpus(n, candidates)
    n_lsr = n * len(on_lsr) // len(candidates)
    n_rest = min(n - n_lsr, len(rest))
    n_lsr = n - n_rest
    return select_cpus(n_lsr, on_lsr) | select_cpus(n_rest, rest)
