"""The ``rules:`` section: Koordinator's NodeSLO strategies, as frozen dataclasses.

Operators already know NodeSLO, so the YAML uses NodeSLO's own camelCase spec
keys (``rules: {resourceQOSStrategy: {beClass: {cpuQOS: {groupIdentity: -1}}}}``)
and a partial spec is merged over Koordinator's defaults (reference §3), exactly
as koordlet merges a NodeSLO over its defaults. Every key is checked: an unknown
key or a bad value is a ``HookConfigError`` naming ``rules.<path>`` and the
value, so a typo fails at load time instead of silently doing nothing.

``Rules.for_class`` applies Koordinator's "disabled class behaves like the None
class" rule (``mergeNoneResourceQOSIfDisabled``) so hooks never re-implement it.

One source of rules (issue 10): the process's ``RulesProvider`` merges the live
NodeSLO (``rules_from_nodeslo``, registered by the metrics task) over the YAML;
hooks and tasks read it through ``LiveRules``, which parses once per change.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from hooks.blkiorules import BlkioQOS, parse_blkio_qos
from hooks.qos import QoSClass, pod_qos
from hooks.rulesparse import Keyed, Parser, boolean, choice, int_range, section
from runtimeproxy.hookapi import HookConfigError, HookInit, PodInfo

log = structlog.get_logger("hooks.rules")



@dataclass(frozen=True, slots=True)
class CPUQOS:
    enable: bool = False
    group_identity: int = 0
    sched_idle: int = 0
    core_expeller: bool = False


@dataclass(frozen=True, slots=True)
class ResctrlQOS:
    enable: bool = False
    cat_range_start_percent: int = 0
    cat_range_end_percent: int = 100
    mba_percent: int = 100


@dataclass(frozen=True, slots=True)
class MemoryQOS:
    enable: bool = False
    min_limit_percent: int = 0
    low_limit_percent: int = 0
    throttling_percent: int = 0
    wmark_ratio: int = 0
    wmark_scale_permill: int = 50
    wmark_min_adj: int = 0
    priority_enable: int = 0
    priority: int = 0
    oom_kill_group: int = 0


@dataclass(frozen=True, slots=True)
class ClassQOS:
    cpu_qos: CPUQOS = CPUQOS()
    resctrl_qos: ResctrlQOS = ResctrlQOS()
    memory_qos: MemoryQOS = MemoryQOS()
    blkio_qos: BlkioQOS = BlkioQOS()


NONE_CLASS: Final = ClassQOS()  # Koordinator's "None" (disabled) config


def _class(group_identity: int, expeller: bool, cat_end: int, wmark_min_adj: int) -> ClassQOS:
    return ClassQOS(
        cpu_qos=CPUQOS(group_identity=group_identity, core_expeller=expeller),
        resctrl_qos=ResctrlQOS(cat_range_end_percent=cat_end),
        memory_qos=MemoryQOS(wmark_ratio=95, wmark_scale_permill=20, wmark_min_adj=wmark_min_adj),
    )


@dataclass(frozen=True, slots=True)
class ResourceQOSStrategy:
    lsr_class: ClassQOS = _class(2, True, 100, -25)
    ls_class: ClassQOS = _class(2, True, 100, -25)
    be_class: ClassQOS = _class(-1, False, 30, 50)
    system_class: ClassQOS = NONE_CLASS
    cgroup_root: ClassQOS = NONE_CLASS


@dataclass(frozen=True, slots=True)
class Policies:
    cpu_policy: str = "groupIdentity"
    net_qos_policy: str = "tc"


@dataclass(frozen=True, slots=True)
class ResourceThresholdStrategy:
    """``resourceUsedThresholdWithBE``: BE suppression and eviction thresholds.

    ``None`` means "not set": Koordinator has no default for those, and a strategy
    that needs one (BE CPU eviction needs both satisfaction bounds) stays idle."""

    enable: bool = False
    cpu_suppress_threshold_percent: int = 65
    #: Floor of the BE suppress target, % of node capacity (unset: no floor).
    cpu_suppress_min_percent: int | None = None
    cpu_suppress_policy: str = "cpuset"
    memory_evict_threshold_percent: int = 70
    #: Release down to this % (unset: threshold - 2, as koordlet).
    memory_evict_lower_percent: int | None = None
    cpu_evict_be_satisfaction_lower_percent: int | None = None
    cpu_evict_be_satisfaction_upper_percent: int | None = None
    cpu_evict_be_usage_threshold_percent: int = 90
    #: Averaging window of BE CPU eviction (unset: the collect interval).
    cpu_evict_time_window_seconds: int | None = None
    cpu_evict_policy: str = "evictByRealLimit"
    #: Node CPU eviction (``CPUEvict``): node CPU usage % over the window; unset = off.
    cpu_evict_threshold_percent: int | None = None
    #: Release down to this % (unset: threshold - 2, as koordlet).
    cpu_evict_lower_percent: int | None = None
    #: Highest priority value the usage evictors (``CPUEvict``) may evict (unset: BE pods only).
    evict_enabled_priority_threshold: int | None = None
    #: Highest priority value the allocatable evictors may evict (must be below koord-prod).
    allocatable_evict_priority_threshold: int | None = None
    #: Σ requests of those pods over allocatable, %: evict above threshold (110), down to lower (100).
    cpu_allocatable_evict_threshold_percent: int | None = None
    cpu_allocatable_evict_lower_percent: int | None = None
    memory_allocatable_evict_threshold_percent: int | None = None
    memory_allocatable_evict_lower_percent: int | None = None

    @property
    def memory_evict_lower(self) -> int:
        """The effective lower bound of memory eviction, in %."""
        if self.memory_evict_lower_percent is not None:
            return self.memory_evict_lower_percent
        return max(self.memory_evict_threshold_percent - 2, 0)


@dataclass(frozen=True, slots=True)
class CPUBurstStrategy:
    """``cpuBurstStrategy`` (node level; a pod may override it with ``koordinator.sh/cpuBurst``)."""

    policy: str = "none"
    cpu_burst_percent: int = 1000
    cfs_quota_burst_percent: int = 300
    #: Token-bucket period of the CFS quota burst; -1 = unlimited bursting.
    cfs_quota_burst_period_seconds: int = -1
    share_pool_threshold_percent: int = 50

    @property
    def cpu_burst_enabled(self) -> bool:
        return self.policy in ("cpuBurstOnly", "auto")

    @property
    def cfs_quota_burst_enabled(self) -> bool:
        return self.policy in ("cfsQuotaBurstOnly", "auto")


@dataclass(frozen=True, slots=True)
class SystemStrategy:
    """NodeSLO ``systemStrategy`` (host memory tuning); unset fields are not touched."""

    #: min_free_kbytes = MemTotal_kB x factor / 10000 (Koordinator recommends 100).
    min_free_kbytes_factor: int | None = None
    watermark_scale_factor: int | None = None
    #: ``/sys/kernel/mm/memcg_reaper/reap_background`` (Anolis kernels), 0 or 1.
    memcg_reap_background: int | None = None


@dataclass(frozen=True, slots=True)
class Rules:
    resource_qos_strategy: ResourceQOSStrategy = field(default_factory=ResourceQOSStrategy)
    policies: Policies = Policies()
    resource_used_threshold_with_be: ResourceThresholdStrategy = ResourceThresholdStrategy()
    cpu_burst_strategy: CPUBurstStrategy = CPUBurstStrategy()
    system_strategy: SystemStrategy = SystemStrategy()
    #: Our extension (not a NodeSLO key): the class of Guaranteed pods without a
    #: ``koordinator.sh/qosClass`` label. Koordinator treats them as LSR.
    guaranteed_class: QoSClass = QoSClass.LSR

    def qos_of(self, pod: PodInfo) -> QoSClass:
        """The pod's class: its label, else its Kubernetes QoS (Guaranteed -> guaranteed_class)."""
        return pod_qos(pod, guaranteed=self.guaranteed_class)

    def for_class(self, qos: QoSClass) -> ClassQOS:
        """The effective config of a class: LSE uses LSR's; a sub-config whose
        ``enable`` is false is replaced by the None config, as koordlet does."""
        strategy = self.resource_qos_strategy
        chosen = {
            QoSClass.LSE: strategy.lsr_class,
            QoSClass.LSR: strategy.lsr_class,
            QoSClass.LS: strategy.ls_class,
            QoSClass.BE: strategy.be_class,
            QoSClass.SYSTEM: strategy.system_class,
        }.get(qos, NONE_CLASS)
        return ClassQOS(
            cpu_qos=chosen.cpu_qos if chosen.cpu_qos.enable else NONE_CLASS.cpu_qos,
            resctrl_qos=chosen.resctrl_qos if chosen.resctrl_qos.enable else NONE_CLASS.resctrl_qos,
            memory_qos=chosen.memory_qos if chosen.memory_qos.enable else NONE_CLASS.memory_qos,
            blkio_qos=chosen.blkio_qos if chosen.blkio_qos.enable else NONE_CLASS.blkio_qos,
        )


# --- parsing -----------------------------------------------------------------

_PCT: Final = int_range(0, 100)
_CPU_QOS: Final = section(
    CPUQOS,
    {
        "enable": ("enable", boolean),
        "groupIdentity": ("group_identity", int_range(-1, 2)),
        "schedIdle": ("sched_idle", int_range(0, 1)),
        "coreExpeller": ("core_expeller", boolean),
    },
)
_RESCTRL_QOS: Final = section(
    ResctrlQOS,
    {
        "enable": ("enable", boolean),
        "catRangeStartPercent": ("cat_range_start_percent", _PCT),
        "catRangeEndPercent": ("cat_range_end_percent", _PCT),
        "mbaPercent": ("mba_percent", int_range(1, 100)),
    },
)
_MEMORY_QOS: Final = section(
    MemoryQOS,
    {
        "enable": ("enable", boolean),
        "minLimitPercent": ("min_limit_percent", _PCT),
        "lowLimitPercent": ("low_limit_percent", _PCT),
        "throttlingPercent": ("throttling_percent", _PCT),
        "wmarkRatio": ("wmark_ratio", _PCT),
        "wmarkScalePermill": ("wmark_scale_permill", int_range(1, 1000)),
        "wmarkMinAdj": ("wmark_min_adj", int_range(-25, 50)),
        "priorityEnable": ("priority_enable", int_range(0, 1)),
        "priority": ("priority", int_range(0, 12)),
        "oomKillGroup": ("oom_kill_group", int_range(0, 1)),
    },
)
_BLKIO_QOS: Final = Keyed(parse_blkio_qos, ("enable", "blocks"))
_CLASS: Final = section(
    ClassQOS,
    {
        "cpuQOS": ("cpu_qos", _CPU_QOS),
        "resctrlQOS": ("resctrl_qos", _RESCTRL_QOS),
        "memoryQOS": ("memory_qos", _MEMORY_QOS),
        "blkioQOS": ("blkio_qos", _BLKIO_QOS),
    },
)
_STRATEGY: Final = section(
    ResourceQOSStrategy,
    {
        "lsrClass": ("lsr_class", _CLASS),
        "lsClass": ("ls_class", _CLASS),
        "beClass": ("be_class", _CLASS),
        "systemClass": ("system_class", _CLASS),
        "cgroupRoot": ("cgroup_root", _CLASS),
    },
)
_POLICIES: Final = section(
    Policies,
    {
        "cpuPolicy": ("cpu_policy", choice("groupIdentity", "coreSched")),
        "netQOSPolicy": ("net_qos_policy", choice("tc", "terway-qos")),
    },
)
_THRESHOLD: Final = section(
    ResourceThresholdStrategy,
    {
        "enable": ("enable", boolean),
        "cpuSuppressThresholdPercent": ("cpu_suppress_threshold_percent", _PCT),
        "cpuSuppressMinPercent": ("cpu_suppress_min_percent", _PCT),
        "cpuSuppressPolicy": ("cpu_suppress_policy", choice("cpuset", "cfsQuota")),
        "memoryEvictThresholdPercent": ("memory_evict_threshold_percent", _PCT),
        "memoryEvictLowerPercent": ("memory_evict_lower_percent", _PCT),
        "cpuEvictBESatisfactionLowerPercent": ("cpu_evict_be_satisfaction_lower_percent", int_range(1, 60)),
        "cpuEvictBESatisfactionUpperPercent": ("cpu_evict_be_satisfaction_upper_percent", int_range(1, 99)),
        "cpuEvictBEUsageThresholdPercent": ("cpu_evict_be_usage_threshold_percent", _PCT),
        "cpuEvictTimeWindowSeconds": ("cpu_evict_time_window_seconds", int_range(1, 3600)),
        "cpuEvictPolicy": ("cpu_evict_policy", choice("evictByRealLimit", "evictByAllocatable")),
        "cpuEvictThresholdPercent": ("cpu_evict_threshold_percent", int_range(1, 99)),
        "cpuEvictLowerPercent": ("cpu_evict_lower_percent", _PCT),
        "evictEnabledPriorityThreshold": ("evict_enabled_priority_threshold", int_range(0, 9999)),
        "allocatableEvictPriorityThreshold": ("allocatable_evict_priority_threshold", int_range(0, 8999)),
        "cpuAllocatableEvictThresholdPercent": ("cpu_allocatable_evict_threshold_percent", int_range(1, 1000)),
        "cpuAllocatableEvictLowerPercent": ("cpu_allocatable_evict_lower_percent", int_range(0, 1000)),
        "memoryAllocatableEvictThresholdPercent": ("memory_allocatable_evict_threshold_percent", int_range(1, 1000)),
        "memoryAllocatableEvictLowerPercent": ("memory_allocatable_evict_lower_percent", int_range(0, 1000)),
    },
)
#: Ranges as koordlet's file validators (min_free_kbytes itself is checked once computed).
_SYSTEM: Final = section(
    SystemStrategy,
    {
        "minFreeKbytesFactor": ("min_free_kbytes_factor", int_range(1, 10_000)),
        "watermarkScaleFactor": ("watermark_scale_factor", int_range(10, 400)),
        "memcgReapBackGround": ("memcg_reap_background", int_range(0, 1)),
    },
)
_BURST_FIELDS: Final[Mapping[str, tuple[str, Parser]]] = {
    "policy": ("policy", choice("none", "cpuBurstOnly", "cfsQuotaBurstOnly", "auto")),
    "cpuBurstPercent": ("cpu_burst_percent", int_range(0, 100_000)),
    "cfsQuotaBurstPercent": ("cfs_quota_burst_percent", int_range(100, 100_000)),
    "cfsQuotaBurstPeriodSeconds": ("cfs_quota_burst_period_seconds", int_range(-1, 86_400)),
    "sharePoolThresholdPercent": ("share_pool_threshold_percent", int_range(1, 100)),
}
_BURST: Final = section(CPUBurstStrategy, _BURST_FIELDS)


def _guaranteed(raw: object, path: str, current: QoSClass) -> QoSClass:
    allowed = (QoSClass.LSE, QoSClass.LSR, QoSClass.LS)
    for qos in allowed:
        if raw == qos.value:
            return qos
    raise HookConfigError(path, raw, f"must be one of {', '.join(q.value for q in allowed)}")


_RULES: Final = section(
    Rules,
    {
        "resourceQOSStrategy": ("resource_qos_strategy", _STRATEGY),
        "policies": ("policies", _POLICIES),
        "resourceUsedThresholdWithBE": ("resource_used_threshold_with_be", _THRESHOLD),
        "cpuBurstStrategy": ("cpu_burst_strategy", _BURST),
        "systemStrategy": ("system_strategy", _SYSTEM),
        "guaranteedQoSClass": ("guaranteed_class", _guaranteed),
    },
)


def _check_cat_ranges(rules: Rules, path: str) -> None:
    strategy = rules.resource_qos_strategy
    for key, attr in (("lsrClass", "lsr_class"), ("lsClass", "ls_class"), ("beClass", "be_class"),
                      ("systemClass", "system_class"), ("cgroupRoot", "cgroup_root")):
        resctrl: ResctrlQOS = getattr(strategy, attr).resctrl_qos
        if resctrl.cat_range_start_percent >= resctrl.cat_range_end_percent:
            where = f"{path}.resourceQOSStrategy.{key}.resctrlQOS"
            value = (resctrl.cat_range_start_percent, resctrl.cat_range_end_percent)
            raise HookConfigError(where, value, "catRangeStartPercent must be below catRangeEndPercent")


def _check_thresholds(rules: Rules, path: str) -> None:
    """Cross-field checks koordlet does at run time (it then skips the strategy);
    here a contradiction fails at load time instead."""
    t = rules.resource_used_threshold_with_be
    where = f"{path}.resourceUsedThresholdWithBE"
    lower, upper = t.cpu_evict_be_satisfaction_lower_percent, t.cpu_evict_be_satisfaction_upper_percent
    if lower is not None and upper is not None and upper <= lower:
        raise HookConfigError(f"{where}.cpuEvictBESatisfactionUpperPercent", upper,
                              f"must be above cpuEvictBESatisfactionLowerPercent ({lower})")
    if t.memory_evict_lower_percent is not None and t.memory_evict_lower_percent >= t.memory_evict_threshold_percent:
        raise HookConfigError(f"{where}.memoryEvictLowerPercent", t.memory_evict_lower_percent,
                              f"must be below memoryEvictThresholdPercent ({t.memory_evict_threshold_percent})")
    if (t.cpu_evict_lower_percent is not None and t.cpu_evict_threshold_percent is not None
            and t.cpu_evict_lower_percent >= t.cpu_evict_threshold_percent):
        raise HookConfigError(f"{where}.cpuEvictLowerPercent", t.cpu_evict_lower_percent,
                              f"must be below cpuEvictThresholdPercent ({t.cpu_evict_threshold_percent})")
    for kind in ("cpu", "memory"):
        low = getattr(t, f"{kind}_allocatable_evict_lower_percent")
        high = getattr(t, f"{kind}_allocatable_evict_threshold_percent")
        if low is not None and low >= (high if high is not None else 110):
            raise HookConfigError(f"{where}.{kind}AllocatableEvictLowerPercent", low,
                                  f"must be below {kind}AllocatableEvictThresholdPercent ({high or 110})")
    if t.cpu_suppress_min_percent is not None and t.cpu_suppress_min_percent > t.cpu_suppress_threshold_percent:
        raise HookConfigError(f"{where}.cpuSuppressMinPercent", t.cpu_suppress_min_percent,
                              f"must not exceed cpuSuppressThresholdPercent ({t.cpu_suppress_threshold_percent})")


def parse_rules(raw: Mapping[str, Any] | None, path: str = "rules", base: Rules | None = None) -> Rules:
    """Merge a (partial) NodeSLO-style mapping over ``base`` (Koordinator's defaults)."""
    rules: Rules = _RULES(raw, path, base if base is not None else Rules())
    _check_cat_ranges(rules, path)
    _check_thresholds(rules, path)
    return rules


def parse_memory_qos(raw: object, path: str, base: MemoryQOS) -> MemoryQOS:
    """A ``memoryQOS`` mapping (a pod's ``koordinator.sh/memoryQOS`` fields) merged over
    ``base``, with the NodeSLO's key names and ranges."""
    memory: MemoryQOS = _MEMORY_QOS(raw, path, base)
    return memory


def parse_cpu_burst(raw: object, path: str, base: CPUBurstStrategy) -> CPUBurstStrategy:
    """A pod's ``koordinator.sh/cpuBurst`` config (already JSON-decoded) merged over
    the node's; ``sharePoolThresholdPercent`` is node-level only, as in Koordinator."""
    if isinstance(raw, Mapping) and "sharePoolThresholdPercent" in raw:
        raise HookConfigError(f"{path}.sharePoolThresholdPercent", raw["sharePoolThresholdPercent"],
                              "is a node-level setting; a pod cannot override it")
    burst: CPUBurstStrategy = _BURST(raw, path, base)
    return burst


# --- one source of rules -------------------------------------------------------------

#: NodeSLO keys we model, by level; anything else in a NodeSLO (the systemStrategy
#: fields other than the three memory knobs, extensions, hostApplications,
#: networkQOS, page-cache fields) is a feature this agent does not implement, so it is left out
#: instead of failing the whole document.
_NODESLO_KNOWN: Final[Mapping[str, Any]] = {
    "resourceQOSStrategy": {
        cls: {"cpuQOS": _CPU_QOS, "resctrlQOS": _RESCTRL_QOS, "memoryQOS": _MEMORY_QOS, "blkioQOS": _BLKIO_QOS}
        for cls in ("lsrClass", "lsClass", "beClass", "systemClass", "cgroupRoot")
    },
    "resourceUsedThresholdWithBE": _THRESHOLD,
    "cpuBurstStrategy": _BURST,
    "systemStrategy": _SYSTEM,
}


def _filter(raw: Mapping[str, Any], known: Mapping[str, Any] | Keyed) -> dict[str, Any]:
    if isinstance(known, Mapping):
        out: dict[str, Any] = {}
        for key, sub in known.items():
            value = raw.get(key)
            if isinstance(value, Mapping):
                out[key] = _filter(value, sub)
            elif value is not None:
                out[key] = value  # not a mapping: let parse_rules name it
        return out
    return {k: v for k, v in raw.items() if k in known.keys}


def rules_from_nodeslo(spec: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """A NodeSLO ``spec`` as a ``rules:`` mapping (None without one): the keys we model
    (``resourceQOSStrategy.policies`` moves to the top-level ``policies``), checked with
    the same parser as the YAML. Raises ``HookConfigError`` naming ``nodeslo.spec.<path>``."""
    if spec is None:
        return None
    out = _filter(spec, _NODESLO_KNOWN)
    strategy = spec.get("resourceQOSStrategy")
    policies = strategy.get("policies") if isinstance(strategy, Mapping) else None
    if isinstance(policies, Mapping):
        out["policies"] = {k: v for k, v in policies.items() if k in ("cpuPolicy", "netQOSPolicy") and v is not None}
    parse_rules(out, path="nodeslo.spec")
    return out


class LiveRules:
    """The rules a hook or task decides from: ``init.rules`` (the YAML, checked strictly
    at construction so a typo fails at load) until the process's ``RulesProvider`` has
    something else, then the rules in force, parsed once per change. Rules in force that
    do not parse (a NodeSLO contradicting the YAML) are ignored with one warning per
    change, and the last rules that parsed stay in force."""

    def __init__(self, init: HookInit | None = None, *, base: Mapping[str, Any] | None = None,
                 current: Callable[[], Mapping[str, Any]] | None = None, owner: str = "") -> None:
        raw = init.rules if init is not None else base
        self.base = parse_rules(raw)
        self._current = init.current_rules if init is not None else current
        self._owner = init.name if init is not None else owner
        self._cache: tuple[object, Rules] = (raw, self.base)

    def __call__(self) -> Rules:
        if self._current is None:
            return self.base
        raw = self._current()
        cached = self._cache
        if cached[0] is raw:
            return cached[1]
        try:
            rules = parse_rules(raw)
        except HookConfigError as exc:
            # The last rules that parsed stay (not the YAML): a bad update must not undo a
            # good NodeSLO (issue 28 item 6; the agent also rejects it before it gets here).
            log.warning("rules_ignored", owner=self._owner, key=exc.key_path, value=repr(exc.value)[:200],
                        reason=exc.message, applied="last rules in force")
            rules = cached[1]
        self._cache = (raw, rules)
        return rules
