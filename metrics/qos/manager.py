"""The QoS manager: every second, plan all strategies, arbitrate, carry out.

One round: read every input the enabled strategies declare (store samples, the
BE tree's knobs, quotas; each once) and let each strategy plan from them, in a
worker thread; ``arbitrate`` the plans, then write through ``CgroupExecutor``
(confined to the cgroup root, idempotent), evict through the ``Evictor``, and
hand any other action kind (resctrl, host files) to the strategy that owns it.
Strategies are ``metrics.qos.strategy.Strategy`` objects, in the configured order
(see ``strategy`` for the interface and the registry). Blocking reads and writes
run in ``asyncio.to_thread`` so kubelet's CRI calls on the same loop never wait
for cgroupfs. Rounds never overlap: the fast path's immediate re-plan of the
suppress strategy takes the same lock and goes through the same arbitration and
executor.

``explain`` shows the last plan of every strategy with its inputs and what
became of each action (written, unchanged, dry-run, rejected and why, failed),
the planning order and a summary of every input read. In dry-run mode plans are
computed, logged and explained, and nothing is written or evicted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import PurePosixPath
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from hooks.cgroups import CgroupGoneError
from hooks.executor import CgroupExecutor, Update
from hooks.resctrlfs import ResctrlError
from hooks.rules import Rules
from metrics.model import MetricReader, MetricWriter, PodView
from metrics.qos import builtin, evict, suppress
from metrics.qos.builtin import CPUSuppress
from metrics.qos.config import ManagerConfig
from metrics.qos.inputs import KeptWindows, NodeInputs
from metrics.qos.plan import Action, Evict, LeveledWrite, Outcome, Plan, Rejected, SetCgroup, SetSchemata, arbitrate
from metrics.qos.resctrlsync import ResctrlSync
from metrics.qos.strategy import NODE, RoundContext, RoundInputs, Strategy, StrategyInit, read_inputs
from metrics.qos.suppress import BEState, CPULike, SuppressStrategy
from metrics.qos.verified import VerifiedWrites
from runtimeproxy.hookapi import HookError, PodInfo

__all__ = ["ManagerConfig", "Outcome", "QoSManager", "Round"]

log = structlog.get_logger("metrics.qos.manager")


@dataclass
class Round:
    """What one round (or fast-path re-plan) did."""

    ts: float
    plans: list[Plan]
    outcomes: dict[str, list[Outcome]] = field(default_factory=dict)
    rejected: list[Rejected] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Planned:
    inputs: RoundInputs
    plans: list[Plan]
    idle: list[str]
    #: Arbitrated in the worker, with the writes already made when none had to wait on an
    #: eviction (``_Written``); None: arbitrate and write on the way out (the fast path's re-plan).
    written: _Written | None = None


@dataclass(frozen=True, slots=True)
class _Written:
    applied: list[Plan]
    rejected: list[Rejected]
    #: Each applied plan's outcomes, when they were written in the planning hand-off.
    outcomes: list[list[Outcome]] | None


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
        strategies: Sequence[Strategy] | None = None,
        on_write_failed: Callable[[str, str, str], None] | None = None,
    ) -> None:
        """``strategies`` in planning order; None: the built-in CPU strategies
        (``builtin.defaults``; resctrl when ``resctrl`` is given)."""
        self.cfg = config
        #: ``(strategy, target, cause)`` on a write's first failure in a row (an Event).
        self._on_write_failed = on_write_failed
        self.capacity = config.capacity_cores if config.capacity_cores is not None else float(len(topology))
        self._reader = reader
        #: The window reads its rounds repeat, kept between rounds (rounds run one at a time).
        self._kept = KeptWindows(reader)
        self._pods = pods
        self._executor = executor
        self._evictor = evictor
        self._rules = rules
        self._clock = clock
        if strategies is None:
            init = StrategyInit(name="", args={}, key_path="strategies", config=config, topology=topology,
                                executor=executor, writer=writer, resctrl=resctrl)
            strategies = builtin.defaults(init)
        self.strategies: tuple[Strategy, ...] = tuple(strategies)
        names = [s.name for s in self.strategies]
        if len(set(names)) != len(names):
            raise ValueError(f"strategy names must be unique: {names}")
        #: The fast path's strategy (None when suppression is not configured).
        self.suppress_strategy = next((s for s in self.strategies if isinstance(s, CPUSuppress)), None)
        self._metrics = evict.EvictionMetrics(registry, config.node_name)
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        #: The last round's plan of each strategy, described only when explain asks.
        self._explain: dict[str, _Explained] = {}
        self._round_info: dict[str, Any] = {}
        #: plan name -> the strategy that made it; strategy name -> its plan names.
        self._owners: dict[str, Strategy] = {s.name: s for s in self.strategies}
        self._plan_names: dict[str, set[str]] = {}
        #: target(s) -> (cause, consecutive failures) of writes failing now: warned once each.
        #: Pruned every round to what was tried in it (a pod gone while failing leaves).
        self._failing: dict[str, tuple[str, int]] = {}
        self._tried: set[str] = set()
        #: The pods as of the last round (read by the fast path).
        self.pods: tuple[PodView, ...] = ()
        self._verified = VerifiedWrites(config.verified_for)
        #: CPU of the rounds' worker-thread work (reading inputs, planning, writing), the
        #: fast path's re-plans included: what ``explain`` and the cost bench report.
        self.cpu_seconds = 0.0
        self.rounds = 0

    @property
    def suppress(self) -> SuppressStrategy | None:
        """The suppress planner (its ``decision``, ``cfg``), if configured."""
        return self.suppress_strategy.inner if self.suppress_strategy is not None else None

    @property
    def be_state(self) -> BEState | None:
        """The BE limit as of the last round or write (read by the fast path)."""
        return self.suppress_strategy.be_state if self.suppress_strategy is not None else None

    @be_state.setter
    def be_state(self, state: BEState | None) -> None:
        if self.suppress_strategy is not None:
            self.suppress_strategy.be_state = state

    # --- loop ---------------------------------------------------------------------

    async def run(self) -> None:
        """Round after round until cancelled; ``wake()`` starts the next one early, but
        not before one collect interval after the last one started: a round sooner than
        that plans from the same store samples (one decision per input change). On a
        host under CPU pressure the PSI trigger fires every window, and each woken round
        doubled the loop's cost for nothing; the fast path, woken too, acts at once."""
        while True:
            started = time.monotonic()
            await self.run_once()
            try:
                await asyncio.wait_for(self._wake.wait(), self.cfg.interval)
            except TimeoutError:
                pass
            else:
                rest = min(self.cfg.collect_interval, self.cfg.interval) - (time.monotonic() - started)
                if rest > 0:
                    await asyncio.sleep(rest)
            self._wake.clear()

    def wake(self) -> None:
        """Start the next round now (a PSI trigger fired)."""
        self._wake.set()

    async def run_once(self) -> Round:
        async with self._lock:
            rules = self._rules()
            planned = await asyncio.to_thread(self._plan_round, rules, self.strategies, None, True)
            if planned.inputs.pods != self.pods:  # else the same object: the fast path keeps its paths
                self._verified.keep_pods({p.uid for p in planned.inputs.pods})
                self.pods = planned.inputs.pods
            result = await self._execute(planned.plans, planned.inputs, planned.written)
            self._round_info = {"order": [s.name for s in self.strategies], "idle": planned.idle,
                                "inputs": planned.inputs.summaries}
            for name in planned.idle:
                for plan_name in self._plan_names.pop(name, set()):
                    self._explain.pop(plan_name, None)
            if self._failing:
                self._failing = {k: v for k, v in self._failing.items() if k in self._tried}
            self._tried = set()
            return result

    async def replan_suppress(self, inputs: NodeInputs, why: str) -> Round:
        """The fast path's immediate re-plan: suppress only, from its own inputs."""
        async with self._lock:
            chosen = self.suppress_strategy
            if chosen is None:
                return Round(inputs.now, [])
            rules = self._rules()
            planned = await asyncio.to_thread(self._plan_round, rules, (chosen,), inputs)
            for plan in planned.plans:
                log.info("suppress_replanned", trigger=why, source=inputs.source, reason=plan.reason)
            return await self._execute(planned.plans, planned.inputs)

    def _plan_round(self, rules: Rules, strategies: Sequence[Strategy], node: NodeInputs | None = None,
                    write: bool = False) -> _Planned:
        """Read every declared input once, then plan (worker thread). ``node``: the
        fast path's own node inputs, used instead of the store's. ``write``: arbitrate
        too, and make the writes in this same hand-off unless one must wait on an
        eviction (one worker wake-up and one loop wake-up a round, not two of each)."""
        with self._costed():
            self.rounds += 1
            planned = self._plan(rules, strategies, node)
            if write:
                applied, rejected = arbitrate(planned.plans)
                groups = _cut_after_evictions(applied)
                done = (self._write_plans_now(groups[0], True)
                        if len(groups) == 1 and not self.cfg.dry_run else None)
                planned = replace(planned, written=_Written(applied, rejected, done))
            return planned

    def _plan(self, rules: Rules, strategies: Sequence[Strategy], node: NodeInputs | None) -> _Planned:
        pods = node.pods if node is not None else tuple(self._pods())
        if node is None and pods == self.pods:
            pods = self.pods  # unchanged: the same object, so views derived from it are reused
        ctx = RoundContext(now=node.now if node is not None else self._clock(), rules=rules, pods=pods,
                           reader=self._reader, executor=self._executor, config=self.cfg,
                           capacity_cores=self.capacity, kept=self._kept)
        active = [s for s in strategies if s.enabled(rules)]
        given = {NODE.name: node} if node is not None else None
        inputs = read_inputs(ctx, [key for s in active for key in s.reads], given)
        plans: list[Plan] = []
        for chosen in active:
            made = chosen.plan(inputs)
            names: set[str] = set()
            for plan in [made] if isinstance(made, Plan) else made:
                # Stamped only when it differs: built-in strategies plan at their own priority
                # already (a copy of every plan each round for nothing).
                plans.append(plan if plan.priority is chosen.priority else replace(plan, priority=chosen.priority))
                self._owners[plan.strategy] = chosen
                names.add(plan.strategy)
            self._plan_names[chosen.name] = names
        return _Planned(inputs, plans, [s.name for s in strategies if s not in active])

    # --- carrying out ---------------------------------------------------------------

    async def _execute(self, plans: list[Plan], inputs: RoundInputs, written: _Written | None = None) -> Round:
        """Carry out the applied plans in order, then read the BE state in force.
        ``written``: arbitrated in the planning hand-off, with the writes made there
        when no plan evicts before the last (``_plan_round``).

        Thread hand-offs, not the writes, are what a round costs on a quiet node (each one
        wakes a worker and then the loop: ~0.1-0.3 ms of CPU on a VM): the writes of
        consecutive plans go in one hop, cut only after a plan that evicts (its evictions
        run on the loop before the next plan's writes), and the BE state read rides on
        the last hop. A round whose plans write nothing still reads the BE state."""
        applied, rejected = arbitrate(plans) if written is None else (written.applied, written.rejected)
        result = Round(inputs.now, plans, rejected=rejected)
        # A plan's description walks every action: built only when a debug line is kept
        # (structlog evaluates the arguments before its level filter).
        debug = log.is_enabled_for(logging.DEBUG)
        if debug:
            for plan in applied:
                log.debug("qos_plan", **plan.describe())
            for item in rejected:
                log.debug("qos_action_rejected", **item.describe())
        if self.cfg.dry_run:
            for plan in applied:
                result.outcomes[plan.strategy] = [Outcome(a, "dry-run") for a in plan.actions]
            self._record(result)
            return result
        groups = _cut_after_evictions(applied)
        for k, group in enumerate(groups):
            if written is not None and written.outcomes is not None:
                done = written.outcomes  # one group, written in the planning hand-off
            else:
                done = await asyncio.to_thread(self._write_plans, group, k == len(groups) - 1)
            for plan, outcomes in zip(group, done, strict=True):
                for action in plan.actions:
                    if isinstance(action, Evict):
                        outcomes.append(await self._evict(plan.strategy, action, inputs.pods))
                result.outcomes[plan.strategy] = outcomes
                owner = self._owners.get(plan.strategy)
                if owner is not None:
                    owner.after(plan, outcomes, inputs)
        self._record(result)
        return result

    def _write_plans(self, plans: Sequence[Plan], read_be_state: bool) -> list[list[Outcome]]:
        """Worker thread: each plan's cgroup writes in order; then, when asked, the BE
        limit as written, so the fast path compares against what is in force (the tier's
        knobs only: the fast path never looks at the quotas under it)."""
        with self._costed():
            return self._write_plans_now(plans, read_be_state)

    def _write_plans_now(self, plans: Sequence[Plan], read_be_state: bool) -> list[list[Outcome]]:
        done = [self._write_all(plan.strategy, [a for a in plan.actions if not isinstance(a, Evict)])
                for plan in plans]
        chosen = self.suppress_strategy
        if read_be_state and chosen is not None:
            chosen.be_state = suppress.read_be_state(self._executor, chosen.inner.cfg, children=False,
                                                     paths=chosen.tier_paths)
        return done

    @contextmanager
    def _costed(self) -> Iterator[None]:
        """The worker thread's CPU of the block, added to ``cpu_seconds``."""
        started = time.thread_time()
        try:
            yield
        finally:
            self.cpu_seconds += time.thread_time() - started

    def release(self, strategies: Sequence[Strategy] | None = None) -> list[Outcome]:
        """Undo what the strategies hold (``Strategy.release``: suppress gives BE its
        CPUs back, system-config restores the sysctls it changed): called when the
        task stops, and at start for strategies listed but disabled. Skipped in dry-run."""
        if self.cfg.dry_run:
            return []
        self._verified.clear()  # what is released is checked against the files, not remembered
        out: list[Outcome] = []
        pods = list(self._pods())
        for chosen in strategies if strategies is not None else self.strategies:
            actions = chosen.release(pods)
            if not actions:
                continue
            self._owners.setdefault(chosen.name, chosen)
            outcomes = self._write_all(chosen.name, actions)
            log.info("qos_strategy_released", strategy=chosen.name, results=[o.result for o in outcomes])
            out += outcomes
        return out

    def _write_all(self, strategy: str, actions: Sequence[Action]) -> list[Outcome]:
        return [self._write(strategy, a) for a in actions]

    def _write(self, strategy: str, action: Action) -> Outcome:
        # Keyed by what is written and how it failed, not by the value: a suppress target
        # changes every tick, and a refused write must not warn at the tick rate.
        if self._verified.fresh(action):
            return Outcome(action, "unchanged")
        key = f"{strategy}:{_targets(action)}"
        self._tried.add(key)
        try:
            changed = self._apply(strategy, action)
        except CgroupGoneError as exc:
            self._verified.forget(action)
            log.debug("qos_write_skipped", strategy=strategy, reason=str(exc))
            return Outcome(action, "gone")
        except HookError as exc:  # CgroupError, ResctrlError, a strategy's own write error
            self._verified.forget(action)
            cause = f"{type(exc).__name__}: {str(exc).rsplit(':', 1)[-1].strip()}"
            before, failures = self._failing.get(key, ("", 0))
            count = failures + 1 if before == cause else 1
            self._failing[key] = (cause, count)
            if count == 1:
                log.warning("qos_write_failed", strategy=strategy, error=str(exc), cause=cause)
                if self._on_write_failed is not None:
                    self._on_write_failed(strategy, _targets(action), cause)
            return Outcome(action, f"failed: {exc}")
        self._verified.done(action)
        failed = self._failing.pop(key, None)
        if failed is not None:
            log.info("qos_write_recovered", strategy=strategy, target=_targets(action), cause=failed[0],
                     failures=failed[1])
        if changed:
            log.info("qos_write", strategy=strategy, **action.describe())
        return Outcome(action, "written" if changed else "unchanged")

    def _apply(self, strategy: str, action: Action) -> bool:
        if isinstance(action, SetCgroup):
            return any(w.changed for w in self._executor.apply([_update(action)]))
        if isinstance(action, LeveledWrite):
            levels = [[_update(i) for i in level] for level in action.levels]
            return any(w.changed for w in self._executor.leveled_update(levels))
        owner = self._owners.get(strategy)
        if owner is None:
            raise ResctrlError(f"no strategy {strategy!r} to carry out {action.describe()['kind']}")
        return owner.apply(action)

    async def _evict(self, strategy: str, action: Evict, pods: Sequence[PodView]) -> Outcome:
        pod = next((p for p in pods if p.uid == action.pod_uid), None)
        if pod is None:
            return Outcome(action, "gone")
        if not await evict.carry_out(self._evictor, pod, action, strategy, self._metrics):
            return Outcome(action, "failed")
        return Outcome(action, "evicted")

    # --- explain --------------------------------------------------------------------

    def _record(self, result: Round) -> None:
        """Keeps the round's frozen plans and outcomes; ``explain`` describes them."""
        for plan in result.plans:
            self._explain[plan.strategy] = _Explained(self._owners.get(plan.strategy), result, plan,
                                                      self.cfg.dry_run)

    def explain(self, pod: PodInfo | PodView | str | None = None) -> dict[str, Any]:
        """The last plan of every strategy; for a pod, only the strategies and
        actions that concern it."""
        described = {name: entry.describe() for name, entry in list(self._explain.items())}
        if pod is None:
            return {"strategies": described, "dry_run": self.cfg.dry_run, **self._round_info,
                    "rounds": self.rounds, "cpu_seconds": round(self.cpu_seconds, 4)}
        uid = pod if isinstance(pod, str) else pod.meta.uid if isinstance(pod, PodInfo) else pod.uid
        out: dict[str, Any] = {}
        for name, entry in described.items():
            applied = [a for a in entry["applied"] if _mentions(a, uid)]
            rejected = [r for r in entry["rejected"] if _mentions(r, uid)]
            if applied or rejected:
                out[name] = {**entry, "applied": applied, "rejected": rejected}
        return {"pod": uid, "strategies": out, "dry_run": self.cfg.dry_run}


@dataclass(frozen=True, slots=True)
class _Explained:
    """One strategy's last plan as the round left it (all frozen: described on demand)."""

    owner: Strategy | None
    result: Round
    plan: Plan
    dry_run: bool

    def describe(self) -> dict[str, Any]:
        owner, plan, result = self.owner, self.plan, self.result
        return {
            "owner": owner.name if owner is not None else plan.strategy,
            "reads": [k.name for k in owner.reads] if owner is not None else [],
            "ts": result.ts,
            "dry_run": self.dry_run,
            "plan": plan.describe(),
            "applied": [o.describe() for o in result.outcomes.get(plan.strategy, [])],
            "rejected": [r.describe() for r in result.rejected if r.strategy == plan.strategy],
        }


def _cut_after_evictions(plans: Sequence[Plan]) -> list[list[Plan]]:
    """The plans in order, in groups that each end with a plan that evicts (or at the
    end); never no group, so a round with nothing to write still reads the BE state."""
    groups: list[list[Plan]] = [[]]
    for plan in plans:
        if groups[-1] and any(isinstance(a, Evict) for a in groups[-1][-1].actions):
            groups.append([])
        groups[-1].append(plan)
    return groups


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
