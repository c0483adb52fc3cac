"""The CPU strategies on the ``Strategy`` interface (entry points ``cpu-suppress``,
``cpu-burst``, ``be-evict``, ``resctrl``).

Each adapter declares what it reads and plans through the strategy it wraps
(``suppress``, ``burst``, ``evict``, ``resctrlsync``: their planning code and tests
are unchanged). Plan names stay koordlet-like (``cpu_suppress``, ``cpu_burst``,
``be_memory_evict``, ``be_cpu_evict``, ``resctrl``): explain and the logs key on them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import PurePosixPath
from typing import Any

import structlog

from hooks.cgroups import CPU_CFS_QUOTA
from hooks.resctrlfs import ResctrlFS
from hooks.rules import Rules
from metrics.model import MetricWriter, PodView
from metrics.qos import evict
from metrics.qos.burst import BurstStrategy, read_quotas
from metrics.qos.inputs import share_pool_averages
from metrics.qos.pathcache import PathCache
from metrics.qos.plan import Action, AddTasks, Evict, LeveledWrite, Outcome, Plan, Priority, SetCgroup, SetSchemata
from metrics.qos.resctrlsync import ResctrlSync, apply_resctrl
from metrics.qos.strategy import BE_CPU_WINDOW, NODE, Input, RoundContext, RoundInputs, Strategy, StrategyInit
from metrics.qos.suppress import BEState, SuppressStrategy, read_be_children, read_be_state

#: The share-pool averages (node, then by pod uid) CPU burst reads.
SharePool = tuple[float | None, Mapping[str, float]]

log = structlog.get_logger("metrics.qos.builtin")



def _state_summary(state: BEState) -> dict[str, Any]:
    return {"cpuset": sorted(state.cpuset) if state.cpuset is not None else None, "quota": state.quota,
            "children": len(state.children)}


class CPUSuppress(Strategy):
    """BE CPU suppression (§4.1). Also the fast path's strategy: ``be_state`` is the
    BE limit as last read."""

    name = "cpu-suppress"
    priority = Priority.SUPPRESS

    def __init__(self, inner: SuppressStrategy, writer: MetricWriter | None = None,
                 reconcile: Callable[[], None] | None = None) -> None:
        self.inner = inner
        self.writer = writer
        #: Asked for when the tier's quota went up (issue 28 item 8): hooks' quotas under
        #: it (batch-resource's) were held at the tier's until then; the tier is released
        #: first, then the children get their own values in a pass right after.
        self.reconcile = reconcile
        self.be_state: BEState | None = None
        #: The tier's two knobs, read twice a round (planning, then after the writes).
        self.tier_paths = PathCache()
        # The tier's knobs only: the quotas under it are read while planning, and only
        # when a write may need them (``SuppressStrategy.plan``): most rounds keep the limit.
        self.state_input: Input[BEState] = Input("be_tier", self._read_state, _state_summary)
        self.reads = (NODE, self.state_input)

    def _read_state(self, ctx: RoundContext) -> BEState:
        return read_be_state(ctx.executor, self.inner.cfg, ctx.pods, children=False, paths=self.tier_paths)

    def off_reason(self, rules: Rules) -> str:
        if rules.resource_used_threshold_with_be.enable:
            return ""
        return "resourceUsedThresholdWithBE.enable is false (BE CPU limits are kept released)"

    def plan(self, inputs: RoundInputs) -> Plan:
        state = inputs[self.state_input]
        self.be_state = state
        ctx = inputs.ctx
        return self.inner.plan(inputs[NODE], inputs.rules.resource_used_threshold_with_be, state,
                               lambda: read_be_children(ctx.executor, self.inner.cfg, ctx.pods))

    def after(self, plan: Plan, outcomes: Sequence[Outcome], inputs: RoundInputs) -> None:
        """The BE limit now in force, for the ``koordlet_be_suppress_*`` series: only
        once it is written (not in dry-run, not after a failed write)."""
        if self.reconcile is not None and _tier_raised(self.inner.cfg.besteffort_dir, outcomes,
                                                      inputs[self.state_input].quota):
            self.reconcile()
        decision = self.inner.decision
        if self.writer is None or decision is None or any(o.result.startswith("failed") for o in outcomes):
            return
        self.writer.write(decision.samples(inputs[NODE].now))

    def release(self, pods: Sequence[PodView]) -> list[Action]:
        """Give BE its CPUs back (quota -1, cpuset = recovery set): a suppressed limit
        that nobody revises any more would throttle BE for good, and on cgroup v1 a
        parent quota below a new BE container's own quota makes runc fail to create it."""
        return self.inner.recover(list(pods), cpuset=True, quota=True, why="QoS manager stopped")


def _tier_raised(tier: PurePosixPath, outcomes: Sequence[Outcome], before: int | None) -> bool:
    """Whether these outcomes lifted the tier's CFS quota (to unlimited) from a limit.
    Only then may batch-resource have held quotas under it (suppression being switched
    off: while cfsQuota suppression is on its pods carry no quota of their own); a
    growth within suppression asks for no pass (a pass walks every pod)."""
    if before is None or before <= 0:
        return False
    for outcome in outcomes:
        if outcome.result != "written":
            continue
        action = outcome.action
        top = action.levels[0] if isinstance(action, LeveledWrite) else (action,)
        for item in top:
            if (isinstance(item, SetCgroup) and item.cgroup == tier and item.resource is CPU_CFS_QUOTA
                    and isinstance(item.value, int) and item.value <= 0):
                return True
    return False


class CPUBurst(Strategy):
    """CPU burst (§4.2)."""

    name = "cpu-burst"
    priority = Priority.BURST

    def __init__(self, inner: BurstStrategy | None = None) -> None:
        self.inner = inner if inner is not None else BurstStrategy()
        self.paths = PathCache()
        self.quotas: Input[Mapping[str, int]] = Input("burst_quotas", self._read_quotas, len)
        self.share_pool: Input[SharePool | None] = Input("share_pool", self._read_share_pool,
                                                         lambda pool: pool is not None)
        self.reads = (NODE, self.share_pool, self.quotas)

    def _read_quotas(self, ctx: RoundContext) -> dict[str, int]:
        return read_quotas(ctx.executor, self.inner.quota_dirs(ctx.pods, ctx.rules.cpu_burst_strategy), self.paths)

    def _read_share_pool(self, ctx: RoundContext) -> SharePool | None:
        """The share-pool averages, read only while some pod's policy bursts its CFS
        quota (the only use of the pool's state); None otherwise."""
        if not self.inner.any_bursts_quota(ctx.pods, ctx.rules.cpu_burst_strategy):
            return None
        return share_pool_averages(ctx.reader, now=ctx.now, collect_interval=ctx.config.collect_interval)

    def plan(self, inputs: RoundInputs) -> Plan:
        node, pool = inputs[NODE], inputs[self.share_pool]
        if pool is not None:
            node = replace(node, node_cpu_avg=pool[0], pod_cpu_avg=pool[1])
        return self.inner.plan(node, inputs.rules.cpu_burst_strategy, inputs[self.quotas])


class BEEvict(Strategy):
    """BE eviction by node memory usage and by BE CPU satisfaction (§4.3)."""

    name = "be-evict"
    priority = Priority.EVICTION
    reads = (NODE, BE_CPU_WINDOW)

    def __init__(self, inner: evict.EvictionStrategy) -> None:
        self.inner = inner

    def off_reason(self, rules: Rules) -> str:
        return "" if rules.resource_used_threshold_with_be.enable else "resourceUsedThresholdWithBE.enable is false"

    def plan(self, inputs: RoundInputs) -> list[Plan]:
        return self.inner.plan(inputs[NODE], inputs[BE_CPU_WINDOW], inputs.rules.resource_used_threshold_with_be,
                               evict.round_of(inputs.scratch))

    def after(self, plan: Plan, outcomes: Sequence[Outcome], inputs: RoundInputs) -> None:
        record_evictions(self.inner.state, plan, outcomes, inputs)


def record_evictions(state: evict.SharedEviction, plan: Plan, outcomes: Sequence[Outcome],
                     inputs: RoundInputs) -> None:
    """Pods evicted by ``plan`` become pending release; its evictor cools down."""
    node = inputs[NODE]
    by_uid = {p.uid: p for p in node.pods}
    for outcome in outcomes:
        if outcome.result == "evicted" and isinstance(outcome.action, Evict):
            pod = by_uid.get(outcome.action.pod_uid)
            if pod is not None:
                state.on_evicted(plan.strategy, pod, node, outcome.action)


class Resctrl(Strategy):
    """Class resctrl groups (koordlet's ResctrlReconcile). Reads the resctrl tree and
    the pods' thread lists itself while planning (worker thread)."""

    name = "resctrl"
    priority = Priority.RESCTRL

    def __init__(self, sync: ResctrlSync) -> None:
        self.sync = sync

    def plan(self, inputs: RoundInputs) -> Plan:
        return self.sync.plan(inputs.rules, inputs.pods)

    def apply(self, action: Action) -> bool:
        if isinstance(action, SetSchemata | AddTasks):
            return apply_resctrl(self.sync.fs, action)
        return super().apply(action)


# --- factories (the entry points) ---------------------------------------------------------------

def cpu_suppress(init: StrategyInit) -> CPUSuppress:
    return CPUSuppress(SuppressStrategy(init.config.suppress, init.topology, init.tier_clamps), init.writer,
                       init.reconcile_now)


def cpu_burst(init: StrategyInit) -> CPUBurst:
    return CPUBurst()


def be_evict(init: StrategyInit) -> BEEvict:
    return BEEvict(evict.EvictionStrategy(init.config.evict, shared=init.eviction))


def resctrl(init: StrategyInit) -> Resctrl | None:
    if init.resctrl is not None:
        return Resctrl(init.resctrl)
    # No resctrl mount (VMs, AMD without RDT): the strategy is simply absent.
    if not (init.host.resctrl / "schemata").exists():
        log.info("qos_strategy_unavailable", strategy="resctrl", reason=f"no resctrl at {init.host.resctrl}")
        return None
    layout = init.executor.layout
    return Resctrl(ResctrlSync(ResctrlFS(init.host.resctrl), layout.root, layout.version))


def defaults(init: StrategyInit) -> list[Strategy]:
    """The built-in CPU strategies in the historic planning order (suppress, burst,
    evictions, resctrl), for a manager given no list; resctrl only with a
    ``ResctrlSync`` in ``init.resctrl``."""
    out: list[Strategy] = [cpu_suppress(init), cpu_burst(init), be_evict(init)]
    if init.resctrl is not None:
        out.append(Resctrl(init.resctrl))
    return out
