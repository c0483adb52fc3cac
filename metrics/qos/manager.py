"""The QoS manager: every second, plan all strategies, arbitrate, carry out.

One round: read the node's state (store samples, the BE tree's knobs, quotas)
in a worker thread, let each strategy plan from it, ``arbitrate`` the plans,
then write through ``CgroupExecutor`` (confined to the cgroup root, idempotent)
and evict through the ``Evictor``. Blocking reads and writes run in
``asyncio.to_thread`` so kubelet's CRI calls on the same loop never wait for
cgroupfs. Rounds never overlap: the fast path's immediate re-plan of the
suppress strategy takes the same lock and goes through the same arbitration and
executor.

``explain`` shows the last plan of every strategy with its inputs and what
became of each action (written, unchanged, dry-run, rejected and why, failed).
In dry-run mode plans are computed, logged and explained, and nothing is
written or evicted.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from hooks.cgroups import CgroupError, CgroupGoneError
from hooks.executor import CgroupExecutor, Update
from hooks.resctrlfs import ResctrlError
from hooks.rules import Rules
from metrics.model import MetricReader, MetricWriter, PodView
from metrics.qos import burst, evict, suppress
from metrics.qos.inputs import BECPUWindow, NodeInputs, build_be_cpu_window, build_node_inputs
from metrics.qos.plan import Action, AddTasks, Evict, LeveledWrite, Plan, Rejected, SetCgroup, SetSchemata, arbitrate
from metrics.qos.resctrlsync import ResctrlSync, apply_resctrl
from metrics.qos.suppress import NAME as SUPPRESS_NAME
from metrics.qos.suppress import BEState, CPULike, SuppressConfig, SuppressStrategy
from runtimeproxy.hookapi import PodInfo

log = structlog.get_logger("metrics.qos.manager")


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    #: Seconds between rounds (koordlet: 1 s for every strategy).
    interval: float = 1.0
    #: The collectors' interval: samples older than twice this are stale.
    collect_interval: float = 1.0
    dry_run: bool = False
    node_name: str = ""
    #: Node CPU capacity in cores (default: the number of logical CPUs in the topology).
    capacity_cores: float | None = None
    #: max(kubelet reserved, ``node.koordinator.sh/reservation``), in cores.
    reserved_cores: float = 0.0
    suppress: SuppressConfig = SuppressConfig()
    evict: evict.EvictConfig = evict.EvictConfig()


@dataclass(frozen=True, slots=True)
class Outcome:
    action: Action
    result: str  # written | unchanged | dry-run | failed: ... | gone

    def describe(self) -> dict[str, Any]:
        return {**self.action.describe(), "result": self.result}


@dataclass
class Round:
    """What one round (or fast-path re-plan) did."""

    ts: float
    plans: list[Plan]
    outcomes: dict[str, list[Outcome]] = field(default_factory=dict)
    rejected: list[Rejected] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Snapshot:
    inputs: NodeInputs
    window: BECPUWindow | None
    be: BEState
    quotas: Mapping[str, int]
    resctrl: Plan | None


class QoSManager:
    def __init__(
        self,
        *,
        reader: MetricReader,
        pods: Callable[[], Sequence[PodView]],
        topology: Sequence[CPULike],
        executor: CgroupExecutor,
        evictor: evict.Evictor,
        rules: Callable[[], Rules],
        config: ManagerConfig = ManagerConfig(),
        resctrl: ResctrlSync | None = None,
        registry: CollectorRegistry | None = None,
        writer: MetricWriter | None = None,
        clock: Callable[[], float] = time.time,
        on_write_failed: Callable[[str, str, str], None] | None = None,
    ) -> None:
        self.cfg = config
        #: ``(strategy, target, cause)`` on a write's first failure in a row (an Event).
        self._on_write_failed = on_write_failed
        self.capacity = config.capacity_cores if config.capacity_cores is not None else float(len(topology))
        self._reader = reader
        self._pods = pods
        self._executor = executor
        self._evictor = evictor
        self._rules = rules
        self._clock = clock
        self._writer = writer
        self.suppress = SuppressStrategy(config.suppress, topology)
        self.burst = burst.BurstStrategy()
        self.eviction = evict.EvictionStrategy(config.evict)
        self.resctrl = resctrl
        self._metrics = evict.EvictionMetrics(registry, config.node_name)
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._explain: dict[str, dict[str, Any]] = {}
        #: target(s) -> (cause, consecutive failures) of writes failing now: warned once each.
        self._failing: dict[str, tuple[str, int]] = {}
        #: The BE limit and pods as of the last round (read by the fast path).
        self.be_state: BEState | None = None
        self.pods: tuple[PodView, ...] = ()

    # --- loop ---------------------------------------------------------------------

    async def run(self) -> None:
        """Round after round until cancelled; ``wake()`` starts the next one early."""
        while True:
            await self.run_once()
            try:
                await asyncio.wait_for(self._wake.wait(), self.cfg.interval)
            except TimeoutError:
                pass
            self._wake.clear()

    def wake(self) -> None:
        """Start the next round now (a PSI trigger fired)."""
        self._wake.set()

    async def run_once(self) -> Round:
        async with self._lock:
            rules = self._rules()
            snap = await asyncio.to_thread(self._snapshot, rules)
            self.be_state, self.pods = snap.be, snap.inputs.pods
            threshold = rules.resource_used_threshold_with_be
            plans = [
                self.suppress.plan(snap.inputs, threshold, snap.be),
                self.burst.plan(snap.inputs, rules.cpu_burst_strategy, snap.quotas),
                *self.eviction.plan(snap.inputs, snap.window, threshold),
            ]
            if snap.resctrl is not None:
                plans.append(snap.resctrl)
            result = await self._execute(plans, snap.inputs)
            await self._refresh_be_state()
            return result

    async def replan_suppress(self, inputs: NodeInputs, why: str) -> Round:
        """The fast path's immediate re-plan: suppress only, from its own inputs."""
        async with self._lock:
            rules = self._rules()
            state = await asyncio.to_thread(suppress.read_be_state, self._executor, self.cfg.suppress, inputs.pods)
            self.be_state = state
            plan = self.suppress.plan(inputs, rules.resource_used_threshold_with_be, state)
            log.info("suppress_replanned", trigger=why, source=inputs.source, reason=plan.reason)
            result = await self._execute([plan], inputs)
            await self._refresh_be_state()
            return result

    async def _refresh_be_state(self) -> None:
        """The BE limit as written, so the fast path compares against what is in force."""
        if not self.cfg.dry_run:
            self.be_state = await asyncio.to_thread(suppress.read_be_state, self._executor, self.cfg.suppress)

    def _snapshot(self, rules: Rules) -> _Snapshot:
        """Everything a round reads from the host and the store (worker thread)."""
        now = self._clock()
        pods = list(self._pods())
        inputs = build_node_inputs(self._reader, pods, now=now, capacity_cores=self.capacity,
                                   reserved_cores=self.cfg.reserved_cores, collect_interval=self.cfg.collect_interval)
        threshold = rules.resource_used_threshold_with_be
        span = max(self.cfg.collect_interval, float(threshold.cpu_evict_time_window_seconds or 0))
        window = build_be_cpu_window(self._reader, now=now, window=span) if threshold.enable else None
        dirs = self.burst.quota_dirs(pods, rules.cpu_burst_strategy)
        quotas = burst.read_quotas(self._executor, dirs)
        resctrl = self.resctrl.plan(rules, pods) if self.resctrl is not None else None
        be = suppress.read_be_state(self._executor, self.cfg.suppress, pods)
        return _Snapshot(inputs, window, be, quotas, resctrl)

    # --- carrying out ---------------------------------------------------------------

    async def _execute(self, plans: list[Plan], inputs: NodeInputs) -> Round:
        applied, rejected = arbitrate(plans)
        result = Round(inputs.now, plans, rejected=rejected)
        for plan in applied:
            log.debug("qos_plan", **plan.describe())
            if self.cfg.dry_run:
                result.outcomes[plan.strategy] = [Outcome(a, "dry-run") for a in plan.actions]
                continue
            writes = [a for a in plan.actions if not isinstance(a, Evict)]
            outcomes = await asyncio.to_thread(self._write_all, plan.strategy, writes)
            for action in plan.actions:
                if isinstance(action, Evict):
                    outcomes.append(await self._evict(plan.strategy, action, inputs))
            result.outcomes[plan.strategy] = outcomes
            if plan.strategy == SUPPRESS_NAME:
                self._report_suppress(outcomes, inputs.now)
        for item in rejected:
            log.debug("qos_action_rejected", **item.describe())
        self._record(result)
        return result

    def _report_suppress(self, outcomes: Sequence[Outcome], now: float) -> None:
        """The BE limit now in force, for the ``koordlet_be_suppress_*`` series: only
        once it is written (not in dry-run, not after a failed write)."""
        decision = self.suppress.decision
        if self._writer is None or decision is None or any(o.result.startswith("failed") for o in outcomes):
            return
        self._writer.write(decision.samples(now))

    def release(self) -> list[Outcome]:
        """Give BE its CPUs back (quota -1, cpuset = recovery set): called when the task
        stops. A suppressed limit that nobody revises any more would throttle BE for
        good, and on cgroup v1 a parent quota below a new BE container's own quota
        makes runc fail to create that container. Skipped in dry-run."""
        if self.cfg.dry_run:
            return []
        actions = self.suppress.recover(list(self._pods()), cpuset=True, quota=True, why="QoS manager stopped")
        outcomes = self._write_all(SUPPRESS_NAME, actions)
        log.info("be_limits_released", results=[o.result for o in outcomes])
        return outcomes

    def _write_all(self, strategy: str, actions: Sequence[Action]) -> list[Outcome]:
        return [self._write(strategy, a) for a in actions]

    def _write(self, strategy: str, action: Action) -> Outcome:
        # Keyed by what is written and how it failed, not by the value: a suppress target
        # changes every tick, and a refused write must not warn at the tick rate.
        key = f"{strategy}:{_targets(action)}"
        try:
            changed = self._apply(action)
        except CgroupGoneError as exc:
            log.debug("qos_write_skipped", strategy=strategy, reason=str(exc))
            return Outcome(action, "gone")
        except (CgroupError, ResctrlError) as exc:
            cause = f"{type(exc).__name__}: {str(exc).rsplit(':', 1)[-1].strip()}"
            before, failures = self._failing.get(key, ("", 0))
            count = failures + 1 if before == cause else 1
            self._failing[key] = (cause, count)
            if count == 1:
                log.warning("qos_write_failed", strategy=strategy, error=str(exc), cause=cause)
                if self._on_write_failed is not None:
                    self._on_write_failed(strategy, _targets(action), cause)
            return Outcome(action, f"failed: {exc}")
        failed = self._failing.pop(key, None)
        if failed is not None:
            log.info("qos_write_recovered", strategy=strategy, target=_targets(action), cause=failed[0],
                     failures=failed[1])
        if changed:
            log.info("qos_write", strategy=strategy, **action.describe())
        return Outcome(action, "written" if changed else "unchanged")

    def _apply(self, action: Action) -> bool:
        if isinstance(action, SetCgroup):
            return any(w.changed for w in self._executor.apply([_update(action)]))
        if isinstance(action, LeveledWrite):
            levels = [[_update(i) for i in level] for level in action.levels]
            return any(w.changed for w in self._executor.leveled_update(levels))
        if isinstance(action, SetSchemata | AddTasks):
            if self.resctrl is None:
                raise ResctrlError("no resctrl root configured")
            return apply_resctrl(self.resctrl.fs, action)
        raise TypeError(f"not a write: {action!r}")

    async def _evict(self, strategy: str, action: Evict, inputs: NodeInputs) -> Outcome:
        pod = next((p for p in inputs.pods if p.uid == action.pod_uid), None)
        if pod is None:
            return Outcome(action, "gone")
        if not await evict.carry_out(self._evictor, pod, action, strategy, self._metrics):
            return Outcome(action, "failed")
        self.eviction.on_evicted(strategy, pod, inputs)
        return Outcome(action, "evicted")

    # --- explain --------------------------------------------------------------------

    def _record(self, result: Round) -> None:
        for plan in result.plans:
            self._explain[plan.strategy] = {
                "ts": result.ts,
                "dry_run": self.cfg.dry_run,
                "plan": plan.describe(),
                "applied": [o.describe() for o in result.outcomes.get(plan.strategy, [])],
                "rejected": [r.describe() for r in result.rejected if r.strategy == plan.strategy],
            }

    def explain(self, pod: PodInfo | PodView | str | None = None) -> dict[str, Any]:
        """The last plan of every strategy; for a pod, only the strategies and
        actions that concern it."""
        if pod is None:
            return {"strategies": dict(self._explain), "dry_run": self.cfg.dry_run}
        uid = pod if isinstance(pod, str) else pod.meta.uid if isinstance(pod, PodInfo) else pod.uid
        out: dict[str, Any] = {}
        for name, entry in self._explain.items():
            applied = [a for a in entry["applied"] if _mentions(a, uid)]
            rejected = [r for r in entry["rejected"] if _mentions(r, uid)]
            if applied or rejected:
                out[name] = {**entry, "applied": applied, "rejected": rejected}
        return {"pod": uid, "strategies": out, "dry_run": self.cfg.dry_run}


def _targets(action: Action) -> str:
    if isinstance(action, LeveledWrite):
        return ",".join(i.target for i in action.items())
    if isinstance(action, SetCgroup | SetSchemata):
        return action.target
    return json.dumps(action.describe(), sort_keys=True, default=str)


def _update(action: SetCgroup) -> Update:
    return Update(PurePosixPath(action.cgroup), action.resource, action.value, action.reason)


def _mentions(described: Mapping[str, Any], uid: str) -> bool:
    return f'"{uid}"' in json.dumps(described, default=str)
