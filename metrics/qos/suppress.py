"""BE CPU suppression (reference §4.1): how much CPU best-effort pods may use now.

``suppress = capacity x threshold% - Σ used(non-BE pods) - systemUsed`` with
``systemUsed = max(node - Σ pods, reserved)`` (floored at ``capacity x
cpuSuppressMinPercent%`` when set). The result becomes either a cpuset for the
BE tree (whole hyper-thread pairs first, spread over NUMA nodes, never on
reserved or LSE-bound CPUs, growing at most ~10 % of the CPUs per round) or a
CFS quota on ``kubepods/besteffort`` (1 % dead band, ≤ 10 % growth per round).
The knob of the other policy is recovered; with the feature disabled both are.

On cgroup v1 a parent's quota cannot go below a child's, and BE pods may carry
their own: a tier quota is written with its children clamped first, and their
originals restored when it grows back (``tierquota``).

Only the BE tree is written: LS/LSR/LSE pods are never planned here. Planning
is pure (``plan``); reading the current BE state is ``read_be_state``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Any, Final, Protocol

import structlog

from hooks.annotations import RESOURCE_STATUS, AnnotationError, parse_resource_status
from hooks.cgroups import CPU_CFS_QUOTA, CPUSET_CPUS, CgroupError
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
from metrics.qos.pathcache import PathCache
from metrics.qos.plan import Action, LeveledWrite, Plan, Priority, SetCgroup
from metrics.qos.podmemo import PodListMemo
from metrics.qos.tierquota import ChildClamps, ChildQuota, read_children

log = structlog.get_logger("metrics.qos.suppress")

NAME: Final = "cpu_suppress"
MIN_QUOTA: Final = 2000  # µs: koordlet's floor, so BE pods are throttled, never frozen
MIN_CPUSET: Final = 2
GROWTH_RATIO: Final = 0.1
#: Seconds a cpuset write reuses the cgroups found under the tier while the pod list is
#: the same object (``_cpuset_children``).
CHILDREN_MAX_AGE: Final = 30.0
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
    #: After the BE limit was lowered (by either path), it grows back only from inputs
    #: newer than that: the 1 s loop's store samples are up to 2 collect intervals old,
    #: so until then they still show the moment before the LS burst the fast path saw,
    #: and raising the limit from them undid the fast path's drop 11-29 ms later (issue
    #: 28 item 7). 0 (koordlet, no fast path): no hold. The task sets it with the fast path.
    hold_after_drop: float = 0.0
    #: A growth smaller than this share of the capacity is not written (a drop still is
    #: at the 1 % dead band: protecting LS stays prompt, giving back is lazier). 0: the
    #: dead band alone (koordlet). The task sets it with the fast path.
    growth_step: float = 0.0


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


def read_be_state(executor: CgroupExecutor, cfg: SuppressConfig, pods: Sequence[PodView] = (), *,
                  children: bool = True, paths: PathCache | None = None) -> BEState:
    """The tier's knobs; with ``children`` also every quota under it (``tierquota``:
    hundreds of files at 110 pods, so a caller that may not need them passes False
    and reads them through ``read_be_children`` when it does). ``paths``: the tier's
    files confined once and kept open (the manager reads them twice a round: each
    confinement was 3 syscalls and a path build, several times the read itself)."""
    tier = str(cfg.besteffort_dir)

    def read(resource: Any) -> str | None:
        try:
            return (paths.read(executor, tier, resource) if paths is not None
                    else executor.read(cfg.besteffort_dir, resource))
        except (CgroupError, OSError) as exc:  # OSError: a kept file that could not be read (gone)
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
    return BEState(cpus, quota, read_be_children(executor, cfg, pods) if children else ())


def read_be_children(executor: CgroupExecutor, cfg: SuppressConfig, pods: Sequence[PodView]
                     ) -> tuple[ChildQuota, ...]:
    return read_children(executor, cfg.besteffort_dir, cfg.cfs_period_us, pods)


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


def suppress_cores(inputs: NodeInputs, threshold: ResourceThresholdStrategy,
                   be_uids: Collection[str] | None = None) -> SuppressFormula:
    """The formula of §4.1. Pods with metrics but no PodView count as non-BE; with
    tier sums (fast path), non-BE = all pods minus the besteffort tier. ``be_uids``:
    the BE pods' uids among ``inputs.pods`` when the caller has them already."""
    assert inputs.node_cpu_used is not None
    if inputs.tiers is not None:
        pods_used = inputs.tiers.pods
        non_be = max(inputs.tiers.pods - inputs.tiers.be, 0.0)
    else:
        if be_uids is None:
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


@dataclass(frozen=True, slots=True)
class _Classes:
    """The pods split by ``is_be`` (both asked for every pod, every round)."""

    non_be: tuple[PodView, ...]
    be_uids: frozenset[str]


def _classes(pods: Sequence[PodView]) -> _Classes:
    return _Classes(tuple(p for p in pods if not is_be(p)), frozenset(p.uid for p in pods if is_be(p)))


class SuppressStrategy:
    """Plans the BE CPU limit; keeps the warn-once set and the last plan's decision."""

    def __init__(self, cfg: SuppressConfig, topology: Sequence[CPULike], clamps: ChildClamps | None = None
                 ) -> None:
        self.cfg = cfg
        self.topology = tuple(sorted(topology, key=lambda c: c.cpu))
        self._warned: set[str] = set()
        #: What the last ``plan`` decided; None when it made no decision (disabled,
        #: missing inputs, unreadable state, no CPU left).
        self.decision: Decision | None = None
        self._clamps = clamps if clamps is not None else ChildClamps()
        #: A clamped child's pod left the pod list: read the children at the next plan
        #: that can (a tier that stays reads none), so the clamps of gone cgroups go.
        self._recheck = False
        #: ``inputs.now`` of the last plan that lowered the BE limit (either path):
        #: one decision, shared by the fast path and the loop (see ``_held``).
        self.lowered_at = -math.inf
        #: The children read for a cpuset write: (the pod list object, when, children).
        self._children: tuple[Sequence[PodView], float, tuple[ChildQuota, ...]] | None = None
        #: The last cpuset write built: (the pod list or children tuple it was built from,
        #: (cpus, reason), write).
        self._cpuset_writes: tuple[object, tuple[frozenset[int], str], LeveledWrite] | None = None
        #: CPUs bound per QoS class set, for one pod list: (the pod list object, by classes).
        self._bound: tuple[Sequence[PodView], dict[frozenset[QoSClass], frozenset[int]]] | None = None
        #: The non-BE pods and the BE uids, split once per pod list.
        self._classes = PodListMemo(_classes)

    def _cpuset_children(self, inputs: NodeInputs, children: Callable[[], tuple[ChildQuota, ...]]
                         ) -> tuple[ChildQuota, ...]:
        """The cgroups under the tier for a cpuset write: read again when the pod list
        changed (new pods, containers, sandboxes) or after ``CHILDREN_MAX_AGE``, else the
        last read's (the cpuset policy writes every round; the walk was most of it)."""
        cached = self._children
        if cached is not None and cached[0] is inputs.pods and 0 <= inputs.now - cached[1] < CHILDREN_MAX_AGE:
            return cached[2]
        found = children()
        self._children = (inputs.pods, inputs.now, found)
        return found

    def _forget_gone(self, pods: Sequence[PodView]) -> None:
        """Nothing kept per pod outlives the pod (issue 28 item 10: churn must not grow it).
        A clamp goes only when a read of the children finds its cgroup gone (see
        ``tierquota``): a pod missing from this list asks for that read."""
        if self._warned or self._clamps.remembered:
            live = {p.uid for p in pods}
            self._warned &= live
            self._recheck = self._recheck or self._clamps.owners_gone(live)

    def hold(self, now: float) -> None:
        """Inputs at ``now`` confirmed the BE limit in force (or wanted it lower): growth
        waits ``hold_after_drop`` from here (the fast path calls it on every such tick)."""
        self.lowered_at = max(self.lowered_at, now)

    def _held(self, grows: bool, lowers: bool, step_ok: bool, inputs: NodeInputs) -> str | None:
        """Why a change of the BE limit is not made now (None: make it). A drop the
        non-BE pods call for (``lowers``) is remembered; a growth waits
        ``hold_after_drop`` after one and must be a step."""
        if lowers:
            self.hold(inputs.now)
            return None
        if not grows:
            return None
        since = inputs.now - self.lowered_at
        if since < self.cfg.hold_after_drop:
            return f"lowered {max(since, 0.0):.1f}s ago: grows from inputs newer than {self.cfg.hold_after_drop:g}s"
        if not step_ok:
            return f"growth below the {self.cfg.growth_step:.0%} step"
        return None

    def _bound_cpus(self, pods: Sequence[PodView], qos: QoSClass) -> frozenset[int]:
        """``bound_cpus`` of one class, parsed once per pod list: the cpuset policy asks
        for LSE and LSR every round (116 annotation parses a round at 110 pods) and they
        depend on the pods alone. Only a tuple is remembered (by identity: immutable, and
        kept alive here, so a new list cannot take its address); a bad annotation is
        still reported once (``_warned``), at the first parse as before."""
        classes = frozenset({qos})
        cached = self._bound
        if cached is None or cached[0] is not pods:
            cached = (pods, {})
            if isinstance(pods, tuple):
                self._bound = cached
        found = cached[1].get(classes)
        if found is None:
            found = cached[1][classes] = bound_cpus(pods, classes, self._warned)
        return found

    def recovery_cpus(self, pods: Sequence[PodView]) -> frozenset[int]:
        """All CPUs - LSE-bound - reserved (koordlet's calcBECPUSet)."""
        lse = self._bound_cpus(pods, QoSClass.LSE)
        return frozenset(c.cpu for c in self.topology) - lse - self.cfg.reserved_cpus

    def _cpuset_write(self, pods: Sequence[PodView], cpus: frozenset[int], reason: str,
                      children: Sequence[ChildQuota] = ()) -> LeveledWrite:
        """The tier's, pods' and containers' cpusets. With ``children`` (every cgroup under
        the tier as found on the filesystem, v1: ``BEState.children``) those are the levels:
        a v1 cpuset may not drop CPUs a child still has (EBUSY), and a sandbox's pause
        cgroup is in no pod view."""
        # The same pod list (or children read, kept ``CHILDREN_MAX_AGE`` by ``_cpuset_children``)
        # and value: the same write, built once per change (one action per BE cgroup each round).
        source: object = children if children else pods
        cached = self._cpuset_writes
        if cached is not None and cached[0] is source and cached[1] == (cpus, reason):
            return cached[2]
        text = format_cpu_list(cpus)
        top = (SetCgroup(self.cfg.besteffort_dir, CPUSET_CPUS, text, reason),)
        if children:
            depths: dict[int, list[SetCgroup]] = {}
            for child in children:
                depths.setdefault(child.depth, []).append(
                    SetCgroup(child.cgroup, CPUSET_CPUS, text, reason, child.pod_uid))
            write = LeveledWrite((top, *(tuple(depths[d]) for d in sorted(depths))), reason)
            if isinstance(children, tuple):  # immutable: safe to know again by identity
                self._cpuset_writes = (children, (cpus, reason), write)
            return write
        be = [p for p in pods if p.qos is QoSClass.BE]
        pod_level = tuple(SetCgroup(PurePosixPath(p.cgroup_dir), CPUSET_CPUS, text, reason, p.uid) for p in be)
        ctr_level = tuple(SetCgroup(PurePosixPath(c.cgroup_dir), CPUSET_CPUS, text, reason, p.uid)
                          for p in be for c in p.containers)
        write = LeveledWrite(tuple(lv for lv in (top, pod_level, ctr_level) if lv), reason)
        self._cpuset_writes = (pods, (cpus, reason), write)
        return write

    def _quota_write(self, quota: int, reason: str, children: Sequence[ChildQuota] | None = None
                     ) -> SetCgroup | LeveledWrite:
        """The tier quota, with the children it needs clamped or may get back (see
        ``tierquota``); ``children`` None: unknown (the manager stopping), every original
        is restored."""
        if children is not None:
            self._recheck = False
        return self._clamps.write(SetCgroup(self.cfg.besteffort_dir, CPU_CFS_QUOTA, quota, reason), children,
                                  self.cfg.cfs_period_us)

    @property
    def clamped(self) -> dict[str, int]:
        """Children clamped now: cgroup -> original quota (for explain and tests)."""
        return self._clamps.clamped

    def recover(self, pods: Sequence[PodView], *, cpuset: bool, quota: bool, why: str,
                children: Callable[[], tuple[ChildQuota, ...]] | None = None) -> list[Action]:
        """BE's limits lifted. With ``children`` (a planning round) the clamped children are
        read and restored, and read again each round until every original is found in
        place: a restore that did not happen is planned again. Without (the manager
        stopping), every remembered original is written and forgotten."""
        actions: list[Action] = []
        if cpuset:
            actions.append(self._cpuset_write(pods, self.recovery_cpus(pods), f"recover BE cpuset ({why})"))
        if quota:
            read = children() if children is not None and self._clamps.remembered else None
            actions.append(self._quota_write(-1, f"recover BE cfs quota ({why})", read))
        return actions

    def plan(self, inputs: NodeInputs, threshold: ResourceThresholdStrategy, state: BEState,
             children: Callable[[], tuple[ChildQuota, ...]] | None = None) -> Plan:
        """``children``: when given, ``state.children`` were not read and this reads them,
        only when a write may need them (a cpuset write, a quota that moves); a tier
        quota that stays needs none (the kernel keeps every child below it)."""
        self.decision = None
        self._forget_gone(inputs.pods)
        given = state.children
        reread = children if children is not None else (lambda: given) if given else None
        if not threshold.enable:
            acts = self.recover(inputs.pods, cpuset=True, quota=True, why="resourceUsedThresholdWithBE disabled",
                                children=reread)
            return Plan(NAME, Priority.SUPPRESS, tuple(acts), {"enable": False}, "disabled: recovering BE limits")
        classes = self._classes(inputs.pods)
        missing = inputs.missing_for(*classes.non_be)
        base = {"policy": threshold.cpu_suppress_policy, "source": inputs.source,
                "threshold_percent": threshold.cpu_suppress_threshold_percent}
        if missing:
            return Plan(NAME, Priority.SUPPRESS, (), {**base, "missing": missing},
                        f"no decision: missing or stale {', '.join(missing)}")
        formula = suppress_cores(inputs, threshold, classes.be_uids)
        info = {**base, **formula.describe(), "node_used": inputs.node_cpu_used,
                "capacity_cores": inputs.capacity_cores, "reserved_cores": inputs.reserved_cores}
        if threshold.cpu_suppress_policy == "cpuset":
            if children is not None and state.cpuset is not None:
                state = replace(state, children=self._cpuset_children(inputs, children))
            return self._plan_cpuset(inputs, formula, state, info, reread)
        return self._plan_quota(inputs, formula, state, info, children)

    def _plan_cpuset(self, inputs: NodeInputs, formula: SuppressFormula, state: BEState,
                     info: dict[str, Any], children: Callable[[], tuple[ChildQuota, ...]] | None) -> Plan:
        if state.cpuset is None:
            return Plan(NAME, Priority.SUPPRESS, (), info, "no decision: current BE cpuset unreadable")
        lse = self._bound_cpus(inputs.pods, QoSClass.LSE)
        lsr = self._bound_cpus(inputs.pods, QoSClass.LSR)
        candidates = [c for c in self.topology if c.cpu not in lse and c.cpu not in self.cfg.reserved_cpus]
        wanted = max(math.ceil(formula.suppress), MIN_CPUSET)
        cap = len(state.cpuset) + math.ceil(GROWTH_RATIO * len(self.topology))
        n = min(wanted, cap, len(candidates))
        have = len(state.cpuset)
        step = max(1, math.ceil(self.cfg.growth_step * len(self.topology)))
        ls_cpus = math.ceil(ls_headroom(formula, inputs))
        held = self._held(n > have, n < have and ls_cpus < have, n - have >= step, inputs)
        if held is not None:
            n, info = min(have, len(candidates)), {**info, "held": held}
        cpus = _split_select(n, candidates, lsr)
        info = {**info, "wanted_cpus": wanted, "growth_cap": cap, "cpus": format_cpu_list(cpus),
                "excluded_lse": format_cpu_list(lse), "excluded_reserved": format_cpu_list(self.cfg.reserved_cpus)}
        if not cpus:
            return Plan(NAME, Priority.SUPPRESS, (), info, "no decision: no CPU left for BE")
        reason = f"BE suppress: {formula.suppress:.2f} cores -> cpuset {format_cpu_list(cpus)}"
        self.decision = Decision("cpuset", float(len(cpus)), formula)
        actions = (self._cpuset_write(inputs.pods, cpus, reason, state.children),
                   *self.recover(inputs.pods, cpuset=False, quota=True, why="policy cpuset", children=children))
        return Plan(NAME, Priority.SUPPRESS, actions, info, reason)

    def _plan_quota(self, inputs: NodeInputs, formula: SuppressFormula, state: BEState,
                    info: dict[str, Any], children: Callable[[], tuple[ChildQuota, ...]] | None = None) -> Plan:
        if state.quota is None:
            return Plan(NAME, Priority.SUPPRESS, (), info, "no decision: current BE cfs quota unreadable")
        current = state.quota
        new, why = quota_target(formula.suppress, current, inputs.capacity_cores, self.cfg.cfs_period_us)
        if new is not None and current > 0:
            step = inputs.capacity_cores * self.cfg.cfs_period_us * self.cfg.growth_step
            ls_quota = ls_headroom(formula, inputs) * self.cfg.cfs_period_us
            held = self._held(new > current, new < current and ls_quota < current, new - current >= step, inputs)
            if held is not None:
                new, why = None, f"BE quota {current} kept: {held}"
        # The children matter only when the tier moves: while it stays, the kernel keeps
        # every child at or below it, and a child someone else changed meanwhile is
        # told from its clamp when they are next read (before the tier moves).
        unread = children is not None and (new is None or new == current) and not self._recheck
        if children is not None and not unread:
            state = replace(state, children=children())
        info = {**info, "current_quota": current, "quota": new}
        recovery = self.recover(inputs.pods, cpuset=True, quota=False, why="policy cfsQuota")
        kept = current if new is None else new
        if kept > 0:
            self.decision = Decision("cfsQuota", kept / self.cfg.cfs_period_us, formula)
        if unread:
            info["clamped_children"] = self.clamped
            return Plan(NAME, Priority.SUPPRESS, tuple(recovery), info, why)
        write = self._quota_write(kept, why, state.children)
        info["clamped_children"] = self.clamped
        if new is None and isinstance(write, SetCgroup):
            return Plan(NAME, Priority.SUPPRESS, tuple(recovery), info, why)
        return Plan(NAME, Priority.SUPPRESS, (write, *recovery), info, why)


def ls_headroom(formula: SuppressFormula, inputs: NodeInputs) -> float:
    """The suppress value with the system's share at its reservation: what the non-BE
    pods alone leave BE. A drop below the limit in force by this measure is the pods'
    doing (an LS burst) and holds growth; one from system noise alone (other work on the
    host, seen for 100 ms) does not, as before the hold."""
    return formula.suppress + formula.system_used - inputs.reserved_cores


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
