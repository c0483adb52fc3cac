"""The QoS strategy interface and its registry.

A strategy is found by entry point (group ``koord_runtime_proxy.qos_strategies`` in
setup.cfg): the entry point is a factory ``(StrategyInit) -> Strategy | None`` (None:
not available on this host, e.g. no resctrl mount; the factory says so in one log
line). A strategy declares

* ``name``: its entry-point name (config, logs, explain);
* ``priority``: an int for ``plan.arbitrate`` (higher wins a conflict on a file;
  ``plan.Priority`` names the built-in levels);
* ``reads``: the ``Input`` s it plans from. The manager reads the union of all
  enabled strategies' inputs **once per round, in the worker thread** (an input
  declared by two strategies is read once: same name, same thing), and explain
  shows a summary of each;
* ``enabled(rules)``: False skips it this round (nothing read for it, no plan);
* ``plan(inputs) -> Plan | Sequence[Plan]``: what it wants; also run in the
  worker thread (plans are computed, never carried out, here).

and may override ``after`` (on the loop, after its actions were carried out; not in
dry-run), ``apply`` (to carry out an action kind it owns, e.g. ``SetFile``) and
``release`` (when the task stops). The manager iterates the list in the configured
order; ``arbitrate`` is the one place where plans meet.

Order is data: ``tasks.qos-manager.strategies`` lists names (or ``{name, enabled,
args}``); absent, every installed strategy runs in ``DEFAULT_ORDER`` (others after
it, by name). Planning order matters only to strategies sharing per-round state
(the evictors pick victims in koordlet's task order through ``RoundInputs.scratch``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Generic, Protocol, TypeVar, cast, runtime_checkable

from hooks.executor import CgroupExecutor
from hooks.rules import Rules
from metrics.model import MetricReader, MetricWriter, PodView
from metrics.qos.config import ManagerConfig
from metrics.qos.evict import SharedEviction
from metrics.qos.inputs import BECPUWindow, KeptWindows, NodeInputs, build_be_cpu_window, build_node_inputs
from metrics.qos.plan import Action, Outcome, Plan
from metrics.qos.resctrlsync import ResctrlSync
from metrics.qos.specs import (
    DEFAULT_ORDER,
    GROUP,
    EntryPointLike,
    StrategySpec,
    check_specs,
    default_specs,
    installed,
    parse_specs,
)
from metrics.qos.suppress import CPULike
from metrics.qos.tierquota import ChildClamps
from runtimeproxy.hookapi import HookConfigError, HostRoots

if TYPE_CHECKING:  # types only: the analyser's and the agent's graphs stay out of the strategies'
    from metrics.analysis.interference import Verdict
    from metrics.handles import AgentHandle

__all__ = ["BE_CPU_WINDOW", "DEFAULT_ORDER", "GROUP", "NODE", "Input", "Loaded", "RoundContext", "RoundInputs",
           "Strategy", "StrategyInit", "StrategySpec", "check_specs", "load_strategies", "parse_specs", "read_inputs"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RoundContext:
    """What an input reader may use (worker thread)."""

    now: float
    rules: Rules
    pods: tuple[PodView, ...]
    reader: MetricReader
    executor: CgroupExecutor
    config: ManagerConfig
    capacity_cores: float
    #: The manager's window reads kept between rounds (None: read whole each time).
    kept: KeptWindows | None = None


def _no_summary(_value: Any) -> Any:
    return None


@dataclass(frozen=True, slots=True, eq=False)
class Input(Generic[T]):
    """One thing a round reads (from the store or the host), once, in the worker thread."""

    name: str
    read: Callable[[RoundContext], T]
    #: A small JSON-able summary for explain (None: listed by name only).
    summary: Callable[[T], Any] = _no_summary


class RoundInputs:
    """The inputs read for one round (or one fast-path re-plan)."""

    def __init__(self, ctx: RoundContext, values: Mapping[str, Any], summaries: Mapping[str, Any]) -> None:
        self.ctx = ctx
        self._values = dict(values)
        self.summaries = dict(summaries)
        #: Per-round state shared by strategies planning in order (e.g. victims chosen so far).
        self.scratch: dict[str, Any] = {}

    @property
    def now(self) -> float:
        return self.ctx.now

    @property
    def rules(self) -> Rules:
        return self.ctx.rules

    @property
    def pods(self) -> tuple[PodView, ...]:
        return self.ctx.pods

    def __getitem__(self, key: Input[T]) -> T:
        try:
            return cast(T, self._values[key.name])
        except KeyError:
            raise KeyError(f"input {key.name!r} was not read this round: declare it in the strategy's reads") from None


def read_inputs(ctx: RoundContext, keys: Iterable[Input[Any]], given: Mapping[str, Any] | None = None
                ) -> RoundInputs:
    """Each distinct input (by name) read once; ``given`` values are used as they are."""
    values: dict[str, Any] = dict(given or {})
    summaries: dict[str, Any] = {}
    for key in keys:
        if key.name not in values:
            values[key.name] = key.read(ctx)
        if key.name not in summaries:
            summaries[key.name] = key.summary(values[key.name])
    return RoundInputs(ctx, values, summaries)


# --- the shared inputs ------------------------------------------------------------------------

def _read_node(ctx: RoundContext) -> NodeInputs:
    # Without the share-pool averages: CPU burst, their only reader, declares them itself
    # (``metrics.qos.builtin.CPUBurst``) and reads them only while some pod bursts its quota.
    return build_node_inputs(ctx.reader, ctx.pods, now=ctx.now, capacity_cores=ctx.capacity_cores,
                             reserved_cores=ctx.config.reserved_cores, collect_interval=ctx.config.collect_interval,
                             share_pool=False)


def _node_summary(node: NodeInputs) -> dict[str, Any]:
    return {"source": node.source, "node_cpu_used": node.node_cpu_used, "node_memory_used": node.node_memory_used,
            "node_memory_total": node.node_memory_total, "capacity_cores": node.capacity_cores,
            "reserved_cores": node.reserved_cores, "pods": len(node.pods), "missing": list(node.missing)}


def _read_be_window(ctx: RoundContext) -> BECPUWindow | None:
    threshold = ctx.rules.resource_used_threshold_with_be
    if not threshold.enable:
        return None
    span = max(ctx.config.collect_interval, float(threshold.cpu_evict_time_window_seconds or 0))
    return build_be_cpu_window(ctx.reader, now=ctx.now, window=span, kept=ctx.kept)


def _window_summary(window: BECPUWindow | None) -> dict[str, Any] | None:
    if window is None:
        return None
    return {"samples": window.count, "span": window.span, "usage_avg": window.usage_avg,
            "request_avg": window.request_avg, "limit_avg": window.limit_avg}


#: The node's state from the store: last fresh samples (see ``inputs``).
NODE: Final[Input[NodeInputs]] = Input("node", _read_node, _node_summary)
#: The ``node_be`` CPU series over the BE eviction window (None: disabled or no samples).
BE_CPU_WINDOW: Final[Input[BECPUWindow | None]] = Input("be_cpu_window", _read_be_window, _window_summary)


# --- the interface ----------------------------------------------------------------------------

class Strategy:
    """Base of every strategy: override ``plan`` (and what else applies)."""

    name: str = ""
    priority: int = 0
    reads: tuple[Input[Any], ...] = ()

    def enabled(self, rules: Rules) -> bool:
        return True

    def off_reason(self, rules: Rules) -> str:
        """Why it does nothing under ``rules`` ("" when it acts), for ``check-config``'s
        plan: ``enabled(rules)`` false, or a strategy that runs but plans nothing (a
        strategy that can be idle says so in its terms)."""
        return "" if self.enabled(rules) else "off under the rules in force"

    def plan(self, inputs: RoundInputs) -> Plan | Sequence[Plan]:
        raise NotImplementedError

    def after(self, plan: Plan, outcomes: Sequence[Outcome], inputs: RoundInputs) -> None:
        """Its plan was carried out (on the loop; not called in dry-run)."""

    def apply(self, action: Action) -> bool:
        """Carry out an action kind the executor does not know (blocking: worker thread);
        True when something changed."""
        raise TypeError(f"{self.name}: cannot carry out {action!r}")

    def release(self, pods: Sequence[PodView]) -> list[Action]:
        """Actions that undo its limits when the task stops, or when it is listed but
        disabled (not in dry-run; carried out like a plan's, without arbitration)."""
        return []


@dataclass(frozen=True)
class StrategyInit:
    """What a strategy factory is given."""

    name: str
    #: Its own ``args`` mapping from the config (validate it; raise ``HookConfigError`` naming ``key_path``).
    args: Mapping[str, Any]
    key_path: str
    config: ManagerConfig
    topology: Sequence[CPULike]
    executor: CgroupExecutor
    host: HostRoots = HostRoots()
    #: Where a strategy keeps what must survive a restart (None: in memory only).
    state_dir: Path | None = None
    # What the task hands its strategies: named, typed, each optional (a preview, a test).
    #: The store writer for the strategies' own series (``koordlet_be_suppress_*``).
    writer: MetricWriter | None = None
    #: The metrics agent (its informer: the Node object).
    agent: AgentHandle | None = None
    #: The interference analyser, whose latest verdicts the ``interference`` strategy reads.
    interference: VerdictSource | None = None
    #: Ask for a reconciler pass (``TaskInit.reconcile_now``).
    reconcile_now: Callable[[], None] | None = None
    #: The resctrl view (else the ``resctrl`` strategy builds one when resctrl is mounted).
    resctrl: ResctrlSync | None = None
    #: One per manager: the evictors' pending releases and cool-downs, shared by them.
    eviction: SharedEviction = field(default_factory=SharedEviction)
    #: One per manager: the BE tier's children clamped under its quota, shared by the
    #: strategies that write that quota (cpu-suppress, interference).
    tier_clamps: ChildClamps = field(default_factory=ChildClamps)


@runtime_checkable
class VerdictSource(Protocol):
    """The interference analyser as the ``interference`` strategy reads it."""

    @property
    def verdicts(self) -> Mapping[str, Mapping[str, Verdict]]: ...


@dataclass
class Loaded:
    """The strategies to run, in order, and the listed-but-disabled ones (built so
    they can undo what an earlier run left, e.g. sysctls to restore)."""

    enabled: list[Strategy]
    disabled: list[Strategy]
    #: Listed and enabled, but the factory built nothing: not on this host (it logs why).
    absent: list[str] = field(default_factory=list)


def load_strategies(specs: Sequence[StrategySpec] | None, base: StrategyInit,
                    entry_points: Iterable[EntryPointLike] | None = None) -> Loaded:
    """Build the configured strategies (all installed when ``specs`` is None)."""
    found = installed(entry_points)
    chosen = specs if specs is not None else default_specs(found, base.key_path)
    out = Loaded([], [])
    for spec in chosen:
        ep = found.get(spec.name)
        if ep is None:
            raise HookConfigError(spec.key_path, spec.name, f"unknown QoS strategy; installed: {sorted(found)}")
        factory = ep.load()
        if not callable(factory):
            raise HookConfigError(spec.key_path, spec.name, "entry point is not a strategy factory")
        init = dataclasses.replace(base, name=spec.name, args=spec.args, key_path=f"{spec.key_path}.args")
        built = factory(init)
        if built is None:
            out.absent.append(spec.name)
            continue
        if not isinstance(built, Strategy):
            raise HookConfigError(spec.key_path, spec.name, f"factory returned {type(built).__name__}, not a Strategy")
        built.name = built.name or spec.name
        (out.enabled if spec.enabled else out.disabled).append(built)
    return out
