"""Node-level eviction (reference §4.3): ``cpu-evict`` and ``allocatable-evict``.

Both share the BE evictors' ``SharedEviction`` (pods being evicted count as pending
release and are never picked again; a successful eviction cools its evictor down:
cpu 20 s, memory 4 s) and the round's chosen victims (``evict.round_of``), and order
victims as they do (``koordinator.sh/eviction-priority``, priority, sub-priority,
then the amount, highest first). Like koordlet's non-BE tasks they only consider pods
labelled ``koordinator.sh/eviction-enabled: "true"`` whose priority is at most the
threshold, and honour ``koordinator.sh/eviction-policy``. Gated, as all evictors, by
``resourceUsedThresholdWithBE.enable``.

``cpu-evict`` (koordlet ``CPUEvict``): node CPU usage averaged over
``max(collect interval, cpuEvictTimeWindowSeconds)`` (valid with samples covering a
third of it) at or above ``cpuEvictThresholdPercent`` of capacity releases
``capacity x (usage% - lower%) / 100`` cores (``cpuEvictLowerPercent``, default
threshold - 2) of pod CPU usage, minus what is pending. Candidates: priority <=
``evictEnabledPriorityThreshold`` (unset: 5999, the top of koord-batch; our default).

``allocatable-evict`` (koordlet ``CPUAllocatableEvict`` / ``MemoryAllocatableEvict``):
Σ ``kubernetes.io/batch-cpu`` (``batch-memory``) requests of the pods with priority <=
``allocatableEvictPriorityThreshold`` (unset: 5999) over the Node's allocatable of that
resource; above ``<res>AllocatableEvictThresholdPercent`` it releases ``requested -
lower% x allocatable`` (lower default 100). Differences from koordlet: the feature
is on when the NodeSLO sets the threshold key (koordlet: the ``CPUAllocatableEvict``
feature gate, off by default, with threshold 110); only the batch resources are
counted (the pod views carry no ``mid-*`` requests); allocatable comes from the Node
object (``tasks.metrics.kube``) or the strategy's ``args`` (``batch_cpu_milli``,
``batch_memory_bytes``), else no decision.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from hooks.annotations import quantity_value
from hooks.rules import ResourceThresholdStrategy, Rules
from metrics import model
from metrics.model import PodView
from metrics.qos import evict
from metrics.qos.builtin import record_evictions
from metrics.qos.evict import EvictConfig, SharedEviction, allowed, batch_cpu_cores, order_victims, pick
from metrics.qos.inputs import NodeInputs
from metrics.qos.plan import Evict, Outcome, Plan, Priority
from metrics.qos.strategy import NODE, Input, RoundContext, RoundInputs, Strategy, StrategyInit
from runtimeproxy.config.configvalues import reject_unknown
from runtimeproxy.hookapi import HookConfigError

CPU_EVICT: Final = "cpu_evict"
CPU_ALLOCATABLE: Final = "cpu_allocatable_evict"
MEMORY_ALLOCATABLE: Final = "memory_allocatable_evict"
EVICTION_ENABLED: Final = "koordinator.sh/eviction-enabled"
#: The top of the koord-batch priority band: the default of both priority thresholds.
BATCH_TOP: Final = 5999
BATCH_CPU: Final = "kubernetes.io/batch-cpu"
BATCH_MEMORY: Final = "kubernetes.io/batch-memory"


def eviction_enabled(pod: PodView, threshold: int, feature: str) -> bool:
    """koordlet's filter for non-BE tasks: the opt-in label, priority <= threshold, and
    the eviction-policy annotation (when present) naming the feature."""
    return (pod.labels.get(EVICTION_ENABLED) == "true" and pod.priority <= threshold
            and allowed(pod, feature))


@dataclass(frozen=True, slots=True)
class CPUWindow:
    """Node CPU usage over the eviction window."""

    span: float
    count: int
    avg: float | None


def _read_window(ctx: RoundContext) -> CPUWindow:
    span = max(ctx.config.collect_interval,
               float(ctx.rules.resource_used_threshold_with_be.cpu_evict_time_window_seconds or 0))
    agg = ctx.reader.aggregate(model.NODE_CPU_USAGE, model.NO_LABELS, ctx.now - span, ctx.now)
    if agg is None or agg.count == 0:
        return CPUWindow(span, 0, None)
    return CPUWindow(span, agg.count, agg.avg)


NODE_CPU_WINDOW: Final[Input[CPUWindow]] = Input(
    "node_cpu_window", _read_window, lambda w: {"span": w.span, "samples": w.count, "avg_cores": w.avg})


def _mine(inputs: NodeInputs, state: SharedEviction, current: evict.EvictRound, keep: Callable[[PodView], bool]
          ) -> list[PodView]:
    taken = current.uids()
    return [p for p in inputs.pods if p.uid not in state.tracker and p.uid not in taken and keep(p)]


class CPUEvict(Strategy):
    name = "cpu-evict"
    priority = Priority.EVICTION
    reads = (NODE, NODE_CPU_WINDOW)

    def __init__(self, cfg: EvictConfig, state: SharedEviction) -> None:
        self.cfg = cfg
        self.state = state

    def enabled(self, rules: Rules) -> bool:
        t = rules.resource_used_threshold_with_be
        return t.enable and t.cpu_evict_threshold_percent is not None

    def off_reason(self, rules: Rules) -> str:
        if self.enabled(rules):
            return ""
        return ("resourceUsedThresholdWithBE.enable is false" if not rules.resource_used_threshold_with_be.enable
                else "resourceUsedThresholdWithBE.cpuEvictThresholdPercent is not set")

    def plan(self, inputs: RoundInputs) -> Plan:
        t = inputs.rules.resource_used_threshold_with_be
        node, window = inputs[NODE], inputs[NODE_CPU_WINDOW]
        return self.plan_cpu(node, window, t, evict.round_of(inputs.scratch))

    def plan_cpu(self, node: NodeInputs, window: CPUWindow, t: ResourceThresholdStrategy,
                 current: evict.EvictRound) -> Plan:
        threshold = t.cpu_evict_threshold_percent
        if not t.enable or threshold is None:
            return Plan(CPU_EVICT, self.priority, (), {"enable": t.enable},
                        "disabled or cpuEvictThresholdPercent unset")
        self.state.tracker.refresh(node.pods, node.now)
        until = self.state.cooling(CPU_EVICT, node.now, self.cfg.cpu_cool_down)
        if until is not None:
            return Plan(CPU_EVICT, self.priority, (), {"cool_down_until": until}, "cooling down")
        info: dict[str, Any] = {"window_seconds": window.span, "samples": window.count,
                                "threshold_percent": threshold, "capacity_cores": node.capacity_cores}
        if window.avg is None or window.count * self.cfg.collect_interval < window.span / 3:
            return Plan(CPU_EVICT, self.priority, (), info, "no decision: too few node CPU samples in the window")
        lower = t.cpu_evict_lower_percent if t.cpu_evict_lower_percent is not None else max(threshold - 2, 0)
        percent = window.avg / node.capacity_cores * 100
        info |= {"usage_avg_cores": window.avg, "usage_percent": round(percent, 3), "lower_percent": lower}
        if percent < threshold:
            return Plan(CPU_EVICT, self.priority, (), info, "below threshold")

        def used(p: PodView) -> float:
            return node.pod_cpu_used.get(p.uid, 0.0)

        pending = self.state.tracker.pending_cpu() + sum(used(p) for p in current.chosen)
        need = node.capacity_cores * (percent - lower) / 100 - pending
        info |= {"release_cores": need, "pending_cores": pending}
        if need <= 0:
            return Plan(CPU_EVICT, self.priority, (), info, "covered by pods already being evicted")
        limit = t.evict_enabled_priority_threshold if t.evict_enabled_priority_threshold is not None else BATCH_TOP
        info["priority_threshold"] = limit
        # a pod using no CPU frees none: evicting it cannot help
        pool = _mine(node, self.state, current, lambda p: eviction_enabled(p, limit, "CPUEvict") and used(p) > 0)
        victims = pick(order_victims(pool, used), need, used)
        current.chosen += victims
        why = f"node cpu {percent:.1f}% >= {threshold}% over {window.span:g}s"
        actions = tuple(Evict(p.uid, p.key, why, used(p), node.pod_memory_used.get(p.uid, 0.0)) for p in victims)
        return Plan(CPU_EVICT, self.priority, actions, info, why if actions else "no pod may be evicted")

    def after(self, plan: Plan, outcomes: Sequence[Outcome], inputs: RoundInputs) -> None:
        record_evictions(self.state, plan, outcomes, inputs)


@dataclass(frozen=True, slots=True)
class Allocatable:
    """The Node's batch allocatable (None: unknown)."""

    cpu_milli: float | None
    memory_bytes: float | None


#: per resource: plan name, koordlet feature, threshold / lower attributes, request and allocatable getters
@dataclass(frozen=True, slots=True)
class _Resource:
    plan: str
    feature: str
    key: str  # NodeSLO key prefix ("cpu" | "memory")
    unit: str
    request: Callable[[PodView], float]
    allocatable: Callable[[Allocatable], float | None]


def _mem_request(pod: PodView) -> float:
    return float(pod.batch_memory_request)


RESOURCES: Final = (
    _Resource(CPU_ALLOCATABLE, "CPUAllocatableEvict", "cpu", "cores", batch_cpu_cores,
              lambda a: None if a.cpu_milli is None else a.cpu_milli / 1000),
    _Resource(MEMORY_ALLOCATABLE, "MemoryAllocatableEvict", "memory", "bytes", _mem_request,
              lambda a: a.memory_bytes),
)


class AllocatableEvict(Strategy):
    name = "allocatable-evict"
    priority = Priority.EVICTION

    def __init__(self, cfg: EvictConfig, state: SharedEviction, allocatable: Callable[[], Allocatable]) -> None:
        self.cfg = cfg
        self.state = state
        self.allocatable: Input[Allocatable] = Input(
            "batch_allocatable", lambda _ctx: allocatable(),
            lambda a: {"batch_cpu_milli": a.cpu_milli, "batch_memory_bytes": a.memory_bytes})
        self.reads = (NODE, self.allocatable)

    def enabled(self, rules: Rules) -> bool:
        t = rules.resource_used_threshold_with_be
        return t.enable and any(getattr(t, f"{r.key}_allocatable_evict_threshold_percent") is not None
                                for r in RESOURCES)

    def off_reason(self, rules: Rules) -> str:
        if self.enabled(rules):
            return ""
        return ("resourceUsedThresholdWithBE.enable is false" if not rules.resource_used_threshold_with_be.enable
                else "resourceUsedThresholdWithBE: no cpu/memoryAllocatableEvictThresholdPercent set")

    def plan(self, inputs: RoundInputs) -> list[Plan]:
        t = inputs.rules.resource_used_threshold_with_be
        node, alloc = inputs[NODE], inputs[self.allocatable]
        current = evict.round_of(inputs.scratch)
        self.state.tracker.refresh(node.pods, node.now)
        return [self.plan_resource(r, node, alloc, t, current) for r in RESOURCES]

    def plan_resource(self, res: _Resource, node: NodeInputs, alloc: Allocatable, t: ResourceThresholdStrategy,
                      current: evict.EvictRound) -> Plan:
        threshold = getattr(t, f"{res.key}_allocatable_evict_threshold_percent")
        if not t.enable or threshold is None:
            return Plan(res.plan, self.priority, (), {"enable": t.enable},
                        f"disabled or {res.key}AllocatableEvictThresholdPercent unset")
        cool = self.cfg.cpu_cool_down if res.key == "cpu" else self.cfg.memory_cool_down
        until = self.state.cooling(res.plan, node.now, cool)
        if until is not None:
            return Plan(res.plan, self.priority, (), {"cool_down_until": until}, "cooling down")
        allocatable = res.allocatable(alloc)
        if allocatable is None or allocatable <= 0:
            return Plan(res.plan, self.priority, (), {"allocatable": allocatable},
                        f"no decision: node batch {res.key} allocatable unknown")
        lower_raw = getattr(t, f"{res.key}_allocatable_evict_lower_percent")
        lower = lower_raw if lower_raw is not None else 100
        limit = (t.allocatable_evict_priority_threshold if t.allocatable_evict_priority_threshold is not None
                 else BATCH_TOP)
        members = [p for p in node.pods if p.priority <= limit and res.request(p) > 0]
        # pods being evicted (earlier, or by another task this round) are pending release
        leaving = {p.uid for p in current.chosen} | {p.uid for p in members if p.uid in self.state.tracker}
        requested = sum(res.request(p) for p in members if p.uid not in leaving)
        percent = requested / allocatable * 100
        info: dict[str, Any] = {"requested": requested, "allocatable": allocatable, "unit": res.unit,
                                "request_percent": round(percent, 3), "threshold_percent": threshold,
                                "lower_percent": lower, "priority_threshold": limit}
        if percent <= threshold:
            return Plan(res.plan, self.priority, (), info, "within threshold")
        need = requested - lower / 100 * allocatable
        info["release"] = need
        pool = _mine(node, self.state, current, lambda p: p in members and eviction_enabled(p, limit, res.feature))
        victims = pick(order_victims(pool, res.request), need, res.request)
        current.chosen += victims
        why = f"batch {res.key} requests {percent:.1f}% of allocatable > {threshold}%"
        actions = tuple(Evict(p.uid, p.key, why, batch_cpu_cores(p), _mem_request(p)) for p in victims)
        return Plan(res.plan, self.priority, actions, info, why if actions else "no pod may be evicted")

    def after(self, plan: Plan, outcomes: Sequence[Outcome], inputs: RoundInputs) -> None:
        record_evictions(self.state, plan, outcomes, inputs)


# --- factories -----------------------------------------------------------------------------------

def cpu_evict(init: StrategyInit) -> CPUEvict:
    return CPUEvict(init.config.evict, init.eviction)


def _number(args: Mapping[str, Any], key: str, key_path: str) -> float | None:
    value = args.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise HookConfigError(f"{key_path}.{key}", value, "expected a positive number")
    return float(value)


def _node_allocatable(agent: Any) -> Allocatable:
    informer = getattr(agent, "informer", None)
    node = informer.node() if informer is not None else None
    status = node.get("status") if isinstance(node, Mapping) else None
    values = status.get("allocatable") if isinstance(status, Mapping) else None
    if not isinstance(values, Mapping):
        return Allocatable(None, None)

    def quantity(key: str) -> float | None:
        try:
            return float(quantity_value(values[key], key)) if key in values else None
        except (TypeError, ValueError, ArithmeticError):
            return None

    return Allocatable(quantity(BATCH_CPU), quantity(BATCH_MEMORY))


def allocatable_evict(init: StrategyInit) -> AllocatableEvict:
    reject_unknown(init.args, {"batch_cpu_milli", "batch_memory_bytes"}, f"{init.key_path}.")
    cpu = _number(init.args, "batch_cpu_milli", init.key_path)
    memory = _number(init.args, "batch_memory_bytes", init.key_path)
    agent = init.agent

    def source() -> Allocatable:
        found = _node_allocatable(agent) if agent is not None else Allocatable(None, None)
        return Allocatable(cpu if cpu is not None else found.cpu_milli,
                           memory if memory is not None else found.memory_bytes)

    return AllocatableEvict(init.config.evict, init.eviction, source)
