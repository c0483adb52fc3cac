"""CPU burst (reference §4.2) for burstable pods (not LSR/LSE/BE).

Two knobs, chosen by ``cpuBurstStrategy.policy`` (a pod may override the node
config with the ``koordinator.sh/cpuBurst`` annotation):

* ``cpu.cfs_burst_us`` = limit x cpuBurstPercent% of a 100 ms period, so a
  container may run ahead of its quota for a moment. Upstream kernels refuse
  a burst above the quota (EINVAL), so the value is clamped to the container's
  CRI quota (Alibaba Cloud Linux, koordlet's home kernel, has no such cap).
* CFS quota burst: a throttled container gets x1.2 quota, x0.8 when the share
  pool is overloaded (or its token bucket is empty), clamped to
  ``[base, base x cfsQuotaBurstPercent%]`` where base is its CRI quota.

Knobs this strategy changed are remembered, so switching a policy off puts back
exactly those (the CRI quota, burst 0) and leaves values other hooks set alone.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Final

import structlog

from hooks.cgroups import CPU_CFS_QUOTA, CgroupError, Resource, Value
from hooks.executor import CgroupExecutor
from hooks.qos import QoSClass
from hooks.rules import CPUBurstStrategy, parse_cpu_burst
from metrics.model import ContainerView, PodView
from metrics.qos.inputs import NodeInputs
from metrics.qos.pathcache import PathCache
from metrics.qos.plan import Action, LeveledWrite, Plan, Priority, SetCgroup
from runtimeproxy.hookapi import HookConfigError

log = structlog.get_logger("metrics.qos.burst")

NAME: Final = "cpu_burst"
ANNOTATION: Final = "koordinator.sh/cpuBurst"
BASE_PERIOD: Final = 100_000
SCALE_UP: Final = 1.2
SCALE_DOWN: Final = 0.8
_NOT_BURSTABLE: Final = frozenset({QoSClass.LSR, QoSClass.LSE, QoSClass.BE})


def _check_burst(value: Value) -> Value:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2**44:
        raise CgroupError(f"cpu.cfs_burst_us: expected an integer in [0, 2**44], got {value!r}")
    return value


def _parse_int(text: str, _version: int) -> Value:
    fields = text.split()
    return int(fields[0]) if fields else 0


CPU_CFS_BURST: Final = Resource("cpu.cfs_burst_us", ("cpu", "cpu.cfs_burst_us"), "cpu.max.burst", _check_burst,
                                lambda value, _version, _current: str(value), _parse_int)


class NodeState(enum.Enum):
    IDLE = "idle"
    COOLING = "cooling"
    OVERLOAD = "overload"
    UNKNOWN = "unknown"


class Op(enum.Enum):
    UP = "scaleUp"
    DOWN = "scaleDown"
    REMAIN = "remain"
    RESET = "reset"


def burstable(pod: PodView) -> bool:
    return pod.qos not in _NOT_BURSTABLE and pod.kube_qos != "besteffort"


def _request_cores(pod: PodView) -> float:
    return sum(c.cpu_quota / c.cpu_period for c in pod.containers if c.cpu_quota > 0 and c.cpu_period > 0)


def share_pool_state(inputs: NodeInputs, threshold_percent: int) -> tuple[NodeState, float | None]:
    """Share pool = capacity - LSE/LSR requests; its usage = node - LSE/LSR/BE usage
    (window averages). >= threshold: overload; >= 0.9 x threshold: cooling."""
    if inputs.node_cpu_avg is None:
        return NodeState.UNKNOWN, None
    pinned = [p for p in inputs.pods if p.qos in (QoSClass.LSE, QoSClass.LSR)]
    others = [p for p in inputs.pods if p.qos in (QoSClass.LSE, QoSClass.LSR, QoSClass.BE)]
    if any(p.containers and p.uid not in inputs.pod_cpu_avg for p in others):
        return NodeState.UNKNOWN, None
    pool = inputs.capacity_cores - sum(_request_cores(p) for p in pinned)
    used = inputs.node_cpu_avg - sum(inputs.pod_cpu_avg.get(p.uid, 0.0) for p in others)
    if pool <= 0:
        return NodeState.OVERLOAD, None
    ratio = max(used, 0.0) / pool
    if ratio >= threshold_percent / 100:
        return NodeState.OVERLOAD, ratio
    if ratio >= 0.9 * threshold_percent / 100:
        return NodeState.COOLING, ratio
    return NodeState.IDLE, ratio


class TokenBucket:
    """koordlet's burst limiter, in percent-seconds: a container above 100 % of its
    base spends ``(usage% - 100) x dt``; below 60 % it earns ``(100 - usage%) x dt``."""

    def __init__(self, period_seconds: int, burst_percent: int, now: float) -> None:
        self.capacity = float(period_seconds * (burst_percent - 100))
        self.tokens = self.capacity
        self.last = now

    def update(self, usage_percent: float, now: float) -> bool:
        dt = max(now - self.last, 0.0)
        self.last = now
        if usage_percent >= 100:
            self.tokens -= (usage_percent - 100) * dt
        elif usage_percent < 60:
            self.tokens = min(self.capacity, self.tokens + (100 - usage_percent) * dt)
        return self.tokens > 0


def scaled_quota(op: Op, current: int, base: int, ceiling_percent: int) -> int:
    """The next quota for ``op``, clamped to [base, base x ceiling%]."""
    factor = {Op.UP: SCALE_UP, Op.DOWN: SCALE_DOWN, Op.REMAIN: 1.0}.get(op)
    target = base if factor is None else int(current * factor)
    return max(base, min(target, base * ceiling_percent // 100))


def adjust_op(op: Op, state: NodeState) -> Op:
    """Overload turns up/remain into down; cooling or unknown turns up into remain."""
    if state is NodeState.OVERLOAD and op in (Op.UP, Op.REMAIN):
        return Op.DOWN
    if state in (NodeState.COOLING, NodeState.UNKNOWN) and op is Op.UP:
        return Op.REMAIN
    return op


def burst_us(ctr: ContainerView, percent: int) -> int | None:
    """limit_cores x percent% x 100 ms, capped at the container's quota (kernel rule)."""
    if ctr.cpu_quota <= 0 or ctr.cpu_period <= 0:
        return None
    return min(int(ctr.cpu_quota / ctr.cpu_period * percent / 100 * BASE_PERIOD), ctr.cpu_quota)


def read_quotas(executor: CgroupExecutor, cgroups: Iterable[str], paths: PathCache | None = None
                ) -> dict[str, int]:
    """Current cpu.cfs_quota_us per cgroup dir; unreadable dirs are left out. ``paths``:
    the confined paths kept between rounds (every burstable container, every second)."""
    out: dict[str, int] = {}
    version = executor.layout.version
    for cgroup in cgroups:
        try:
            text = (paths.read(executor, cgroup, CPU_CFS_QUOTA) if paths is not None
                    else executor.read(PurePosixPath(cgroup), CPU_CFS_QUOTA))
            value = CPU_CFS_QUOTA.parse(text, version)
        except (CgroupError, OSError, ValueError):
            continue
        out[cgroup] = int(value)
    if paths is not None:
        paths.end_round()
    return out


@dataclass(frozen=True, slots=True)
class _Decision:
    actions: tuple[Action, ...]
    info: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class _Entry:
    """A burstable pod with the policy it follows (its annotation over the node's)."""

    pod: PodView
    cfg: CPUBurstStrategy
    #: Its dir and its containers' (the quotas a quota-bursting policy reads); () without containers.
    dirs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _PodsView:
    """What CPU burst derives from one pod list under one node policy: the burstable
    pods and their policies. ``burstable`` and the annotation's JSON were evaluated 3
    times per pod and round (quota dirs, share pool, plan); the manager hands the same
    tuple while the pods do not change, so this is built once per pod list."""

    pods: tuple[PodView, ...]
    node: CPUBurstStrategy
    entries: tuple[_Entry, ...]
    #: Container ids of the burstable pods (what the per-container state is kept for).
    live: frozenset[str]
    bursts_quota: bool


@dataclass(frozen=True, slots=True)
class _BurstKnobs:
    """One pod's ``cfs_burst_us`` actions under one policy: the same every round while
    the pod and its policy are, so they are built once and handed again (the actions
    stay in the plan: arbitration, the verified-writes cache and explain see them as
    before)."""

    pod: PodView
    cfg: CPUBurstStrategy
    actions: tuple[SetCgroup, ...]
    ids: tuple[str, ...]
    total: int


class BurstStrategy:
    """Keeps the token buckets and the knobs it raised between rounds."""

    def __init__(self) -> None:
        self._buckets: dict[str, TokenBucket] = {}
        self._raised: set[str] = set()  # container ids whose quota we raised
        self._bursted: set[str] = set()  # container ids with a cfs_burst_us of ours
        self._warned: set[str] = set()
        #: Cgroup dir -> its path, kept for the pods of the last round: every burstable
        #: container's knobs are planned every second, and building a path is most of
        #: what planning an unchanged one costs.
        self._dirs: dict[str, PurePosixPath] = {}
        self._dirs_before: dict[str, PurePosixPath] = {}
        self._view: _PodsView | None = None
        #: Pod uid -> its burst knobs as last planned (kept for the pods planned last round).
        self._knobs: dict[str, _BurstKnobs] = {}
        self._knobs_before: dict[str, _BurstKnobs] = {}

    def _dir(self, rel: str) -> PurePosixPath:
        found = self._dirs.get(rel)
        if found is None:
            found = self._dirs[rel] = self._dirs_before.get(rel) or PurePosixPath(rel)
        return found

    def _pods_view(self, pods: Iterable[PodView], node: CPUBurstStrategy) -> _PodsView:
        """The view of ``pods`` under ``node``, reused while both are the same. Only a
        tuple is remembered (by identity: immutable, and kept alive by the view, so a new
        list cannot take its address); anything else is viewed afresh each call."""
        view = self._view
        if view is not None and view.pods is pods and (view.node is node or view.node == node):
            return view
        listed = pods if isinstance(pods, tuple) else tuple(pods)
        entries = tuple(_Entry(p, self.config_of(p, node),
                               (p.cgroup_dir, *(c.cgroup_dir for c in p.containers)) if p.containers else ())
                        for p in listed if burstable(p))
        view = _PodsView(listed, node, entries, frozenset(c.id for e in entries for c in e.pod.containers),
                         any(e.cfg.cfs_quota_burst_enabled for e in entries))
        if listed is pods:
            self._view = view
        return view

    def quota_dirs(self, pods: Iterable[PodView], node: CPUBurstStrategy) -> list[str]:
        """Cgroups whose current quota the next ``plan`` needs."""
        out: list[str] = []
        for entry in self._pods_view(pods, node).entries:
            if entry.cfg.cfs_quota_burst_enabled:
                out += entry.dirs
                continue
            ctrs = [c for c in entry.pod.containers if c.id in self._raised]
            if ctrs:
                out += [entry.pod.cgroup_dir, *(c.cgroup_dir for c in ctrs)]
        return out

    def any_bursts_quota(self, pods: Iterable[PodView], node: CPUBurstStrategy) -> bool:
        """Whether some pod's own policy bursts its CFS quota (``bursts_quota`` of any)."""
        return self._pods_view(pods, node).bursts_quota

    def bursts_quota(self, pod: PodView, node: CPUBurstStrategy) -> bool:
        """Whether the pod's own policy (its annotation overrides the node's) bursts its
        CFS quota: a pod bursting under a node policy of none needs its quotas too."""
        return burstable(pod) and self.config_of(pod, node).cfs_quota_burst_enabled

    def config_of(self, pod: PodView, node: CPUBurstStrategy) -> CPUBurstStrategy:
        raw = pod.annotations.get(ANNOTATION)
        if raw is None:
            return node
        try:
            return parse_cpu_burst(json.loads(raw), f"annotation {ANNOTATION}", node)
        except (json.JSONDecodeError, RecursionError, HookConfigError) as exc:  # RecursionError: deep nesting
            if pod.uid not in self._warned:
                self._warned.add(pod.uid)
                log.warning("cpu_burst_annotation_ignored", pod=pod.key, reason=str(exc))
            return node

    def plan(self, inputs: NodeInputs, node: CPUBurstStrategy, quotas: Mapping[str, int]) -> Plan:
        state, ratio = share_pool_state(inputs, node.share_pool_threshold_percent)
        actions: list[Action] = []
        per_pod: dict[str, Any] = {}
        view = self._pods_view(inputs.pods, node)
        live = view.live
        self._dirs_before, self._dirs = self._dirs, {}
        self._knobs_before, self._knobs = self._knobs, {}
        for entry in view.entries:
            pod = entry.pod
            decision = self._plan_pod(pod, entry.cfg, inputs, state, quotas)
            actions += decision.actions
            if decision.info:
                per_pod[pod.key] = decision.info
        for gone in set(self._buckets) - live:
            del self._buckets[gone]
        self._raised &= live
        self._bursted &= live
        if self._warned:
            self._warned &= {p.uid for p in inputs.pods}
        info = {"policy": node.policy, "node_state": state.value, "share_pool_ratio": ratio, "pods": per_pod}
        return Plan(NAME, Priority.BURST, tuple(actions), info, f"share pool {state.value}")

    def _plan_pod(self, pod: PodView, cfg: CPUBurstStrategy, inputs: NodeInputs, state: NodeState,
                  quotas: Mapping[str, int]) -> _Decision:
        info: dict[str, Any] = {}
        actions: list[Action] = list(self._burst_actions(pod, cfg, info))
        writes: list[SetCgroup] = []
        delta = 0
        for ctr in pod.containers:
            write = self._quota_write(pod, ctr, cfg, inputs, state, quotas, info)
            if write is not None:
                writes.append(write)
                delta += int(write.value) - quotas[ctr.cgroup_dir]
        if writes:
            actions.append(self._leveled(pod, writes, quotas.get(pod.cgroup_dir), delta))
        return _Decision(tuple(actions), info)

    def _leveled(self, pod: PodView, writes: list[SetCgroup], pod_quota: int | None, delta: int) -> LeveledWrite:
        """Container quotas, with the pod quota moved by the same total (when it has one):
        the executor widens the pod first and narrows it last, as the kernel needs."""
        reason = f"cfs quota burst: {len(writes)} container(s), pod quota {delta:+d}"
        if pod_quota is None or pod_quota <= 0:
            return LeveledWrite((tuple(writes),), reason)
        pod_write = SetCgroup(self._dir(pod.cgroup_dir), CPU_CFS_QUOTA, max(pod_quota + delta, 1000),
                              "cfs quota burst: pod quota follows its containers", pod.uid)
        return LeveledWrite(((pod_write,), tuple(writes)), reason)

    def _burst_actions(self, pod: PodView, cfg: CPUBurstStrategy, info: dict[str, Any]) -> list[Action]:
        if cfg.cpu_burst_enabled:
            knobs = self._knobs_before.get(pod.uid)
            if knobs is None or knobs.pod is not pod or not (knobs.cfg is cfg or knobs.cfg == cfg):
                knobs = self._burst_knobs(pod, cfg)  # a new pod, pod view or policy: planned afresh
            self._knobs[pod.uid] = knobs
            self._bursted.update(knobs.ids)
            if knobs.actions:
                info["cfs_burst_us"] = knobs.total
            return list(knobs.actions)
        # Off: each of our bursts is put back to 0 once (state-dependent, never kept).
        out: list[Action] = []
        total = 0
        reason = f"cpu burst {cfg.cpu_burst_percent}% (policy {cfg.policy})"
        for ctr in pod.containers:
            if ctr.id in self._bursted:
                self._bursted.discard(ctr.id)
                out.append(SetCgroup(self._dir(ctr.cgroup_dir), CPU_CFS_BURST, 0, reason, pod.uid))
        if out:
            info["cfs_burst_us"] = total
            out.append(SetCgroup(self._dir(pod.cgroup_dir), CPU_CFS_BURST, total, "cpu burst: sum of containers",
                                 pod.uid))
        return out

    def _burst_knobs(self, pod: PodView, cfg: CPUBurstStrategy) -> _BurstKnobs:
        """The burst of each container with a quota (its limit x percent) and their sum on the pod."""
        out: list[SetCgroup] = []
        ids: list[str] = []
        total = 0
        reason = f"cpu burst {cfg.cpu_burst_percent}% (policy {cfg.policy})"
        for ctr in pod.containers:
            value = burst_us(ctr, cfg.cpu_burst_percent)
            if value is None:
                continue
            ids.append(ctr.id)
            total += value
            out.append(SetCgroup(self._dir(ctr.cgroup_dir), CPU_CFS_BURST, value, reason, pod.uid))
        if out:
            out.append(SetCgroup(self._dir(pod.cgroup_dir), CPU_CFS_BURST, total, "cpu burst: sum of containers",
                                 pod.uid))
        return _BurstKnobs(pod, cfg, tuple(out), tuple(ids), total)

    def _container_op(self, ctr: ContainerView, cfg: CPUBurstStrategy, inputs: NodeInputs,
                      state: NodeState) -> Op | None:
        if not cfg.cfs_quota_burst_enabled:
            return Op.RESET if ctr.id in self._raised else None
        throttled = inputs.container_throttled.get(ctr.id)
        if throttled is None:
            return None  # no fresh sample: no decision for this container
        op = Op.UP if throttled > 0 else Op.REMAIN
        if cfg.cfs_quota_burst_period_seconds >= 0 and not self._allowed(ctr, cfg, inputs):
            op = Op.DOWN
        return adjust_op(op, state)

    def _allowed(self, ctr: ContainerView, cfg: CPUBurstStrategy, inputs: NodeInputs) -> bool:
        used = inputs.container_cpu_used.get(ctr.id)
        bucket = self._buckets.get(ctr.id)
        if bucket is None:
            bucket = self._buckets[ctr.id] = TokenBucket(cfg.cfs_quota_burst_period_seconds,
                                                         cfg.cfs_quota_burst_percent, inputs.now)
        if used is None:
            return bucket.tokens > 0
        return bucket.update(used / (ctr.cpu_quota / ctr.cpu_period) * 100, inputs.now)

    def _quota_write(self, pod: PodView, ctr: ContainerView, cfg: CPUBurstStrategy, inputs: NodeInputs,
                     state: NodeState, quotas: Mapping[str, int], info: dict[str, Any]) -> SetCgroup | None:
        current = quotas.get(ctr.cgroup_dir)
        if ctr.cpu_quota <= 0 or ctr.cpu_period <= 0 or current is None or current <= 0:
            return None
        op = self._container_op(ctr, cfg, inputs, state)
        if op is None:
            return None
        # Reset only undoes our own raise: a lower value was set by someone else.
        new = min(current, ctr.cpu_quota) if op is Op.RESET else scaled_quota(
            op, current, ctr.cpu_quota, cfg.cfs_quota_burst_percent)
        info.setdefault("quota", {})[ctr.name] = {"op": op.value, "base": ctr.cpu_quota, "current": current,
                                                  "new": new}
        if new > ctr.cpu_quota:
            self._raised.add(ctr.id)
        else:
            self._raised.discard(ctr.id)
        if new == current:
            return None
        reason = f"cfs quota burst {op.value}: {current} -> {new} (base {ctr.cpu_quota})"
        return SetCgroup(self._dir(ctr.cgroup_dir), CPU_CFS_QUOTA, new, reason, pod.uid)
