"""The ``interference`` QoS strategy: act on the interference analyser's confirmed verdicts.

* a **confirmed CPU verdict** on any LS/LSR/LSE pod caps the BE tier's CFS quota at
  ``be_cpu_cores`` (default 0.5 core): below what usage-based suppression allows. Its
  priority (``SUPPRESS + 5``) wins the conflict on ``kubepods/besteffort``'s quota, so
  arbitration keeps this cap while the verdict lasts; a quota already lower (suppress
  tighter still) is left alone. On cgroup v1, BE children with quotas above the cap are
  clamped first and restored after (``tierquota``). BE is also confined to ``be_cpus``
  CPUs (the highest BE may use; default ``auto``: the cap rounded up, so 1 CPU for
  0.5 core: the quota already allows no more, and the victims get the other CPUs to
  themselves; 0: quota only), the cpuset winning over cpu-suppress's the same way: a
  quota alone lets throttled BE threads run in bursts on every CPU at the start of each
  period, which is what a latency-sensitive victim feels (koordlet's default
  cpuSuppressPolicy is a cpuset too).
* a **confirmed memory verdict** evicts the top culprit (the BE pod whose memory grew
  most), at most once per ``memory_cool_down`` (default 60 s). Reclaim by lowering the
  culprit's limit is not done: on cgroup v1 a limit below usage fails or OOM-kills
  anyway, so eviction is the honest action.
* when no CPU verdict has been confirmed for ``hold`` (30 s: the cap is what cleared
  the verdict, lifting it at once would bring the interference straight back), the
  quota found before the cap is written back once (children restored); from the next
  round cpu-suppress (when listed) plans the tier quota alone again: BE gets its CPU back.

Every change of action is one audit line ``interference_action`` (``dry_run`` says
whether it is carried out); plans carry the verdicts, evidence and culprits for
``explain``. The analyser runs as the ``interference`` task; without it this strategy
plans nothing and says why.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import PurePosixPath
from typing import Any, Final

import structlog

from hooks.cgroups import CPU_CFS_QUOTA, CPU_IDLE, CPU_SHARES, MIN_SHARES, CgroupError
from metrics.analysis.interference import CPU, MEMORY, Level, Verdict, confirmed
from metrics.model import PodView
from metrics.qos.plan import Action, Evict, Plan, Priority, SetCgroup
from metrics.qos.strategy import Input, RoundContext, RoundInputs, Strategy, StrategyInit
from metrics.qos.suppress import BEState, CPULike, SuppressConfig, SuppressStrategy, read_be_children, read_be_state
from metrics.qos.tierquota import ChildClamps
from runtimeproxy.config.configvalues import parse_duration, reject_unknown
from runtimeproxy.hookapi import HookConfigError

log = structlog.get_logger("metrics.qos.interference")

NAME: Final = "interference"
Verdicts = Mapping[str, Mapping[str, Verdict]]
#: ``args.be_cpus`` when unset: BE confined to ceil(be_cpu_cores) CPUs while capped.
DEFAULT_BE_CPUS: Final = "auto"


def _verdict_summary(verdicts: Verdicts | None) -> dict[str, Any] | None:
    if verdicts is None:
        return None
    return {r: {lv.name.lower(): sum(1 for v in verdicts.values() if r in v and v[r].level is lv)
                for lv in (Level.SUSPECTED, Level.CONFIRMED)} for r in (CPU, MEMORY)}


def _state_summary(state: BEState) -> dict[str, Any]:
    return {"cpuset": sorted(state.cpuset) if state.cpuset is not None else None, "quota": state.quota,
            "children": len(state.children)}


class Interference(Strategy):
    name = NAME
    priority = int(Priority.SUPPRESS) + 5

    def __init__(self, verdicts: Callable[[], Verdicts | None], *, be_cpu_cores: float = 0.5,
                 memory_evict: bool = True, memory_cool_down: float = 60.0, dry_run: bool = False,
                 suppress: SuppressConfig = SuppressConfig(), hold: float = 30.0, be_cpus: int = 0,
                 topology: Sequence[CPULike] = (), be_idle: bool = True, clamps: ChildClamps | None = None) -> None:
        self._verdicts = verdicts
        self.be_cpu_cores = be_cpu_cores
        self.memory_evict = memory_evict
        self.memory_cool_down = memory_cool_down
        self.hold = hold
        #: >0: BE is also confined to this many CPUs (the highest of the recovery set).
        self.be_cpus = be_cpus
        #: How ``be_cpus`` was chosen, for explain (``auto``: ceil(be_cpu_cores)).
        self.be_cpus_why = f"{be_cpus}" if be_cpus else "0 (quota only)"
        #: The BE tier SCHED_IDLE (cpu.idle 1) while capping: a victim's wake-up then preempts
        #: BE at once and counts BE's CPUs as idle when placed (koordlet's BE group identity).
        self.be_idle = be_idle
        #: The tier's cpu.idle found before the cap (None: not set by us).
        self.original_idle: int | None = None
        self._cpusets = SuppressStrategy(suppress, topology)
        self.last_confirmed = float("-inf")
        self.dry_run = dry_run
        self.cfg = suppress
        self._clamps = clamps if clamps is not None else ChildClamps()
        #: The BE tier quota found before the cap (None: not capping).
        self.original_quota: int | None = None
        self.capping = False
        self.last_evict = float("-inf")
        self.verdict_input: Input[Verdicts | None] = Input("interference_verdicts", self._read, _verdict_summary)
        # Same name as cpu-suppress's input: read once per round when both are listed.
        # The tier's knobs only, under cpu-suppress's input name (read once a round when both
        # are listed); the hundreds of quotas under the tier are read while planning, and
        # only in a round that writes (capping or releasing): most rounds have no verdict.
        self.state_input: Input[BEState] = Input("be_tier", self._read_state, _state_summary)
        # The tier's cpu.idle is not an input: it is read only in a round that caps (most
        # rounds have no verdict, and on a kernel without cpu.idle every read is a failed
        # one), in the worker thread like the inputs.
        self.reads = (self.verdict_input, self.state_input)

    def _read(self, ctx: RoundContext) -> Verdicts | None:
        return self._verdicts()

    def _read_state(self, ctx: RoundContext) -> BEState:
        return read_be_state(ctx.executor, self.cfg, ctx.pods, children=False)

    def _with_children(self, state: BEState, inputs: RoundInputs) -> BEState:
        return replace(state, children=read_be_children(inputs.ctx.executor, self.cfg, inputs.pods))

    def _read_idle(self, ctx: RoundContext) -> int | None:
        """The BE tier's cpu.idle; None without one (kernels before 5.15) or unreadable."""
        try:
            return int(ctx.executor.read(PurePosixPath(self.cfg.besteffort_dir), CPU_IDLE).strip())
        except (CgroupError, ValueError):
            return None

    def plan(self, inputs: RoundInputs) -> Plan:
        verdicts = inputs[self.verdict_input]
        if verdicts is None:
            return Plan(NAME, self.priority, (), {}, "no analyser: list the interference task under tasks")
        cpu, memory = confirmed(verdicts, CPU), confirmed(verdicts, MEMORY)
        info: dict[str, Any] = {"cpu_confirmed": [_brief(v) for v in cpu],
                                "memory_confirmed": [_brief(v) for v in memory],
                                "be_cpu_cores": self.be_cpu_cores, "be_cpus": self.be_cpus_why}
        actions: list[Action] = []
        reasons: list[str] = []
        state = inputs[self.state_input]
        if cpu or self.capping:
            state = self._with_children(state, inputs)
        if cpu:
            self.last_confirmed = inputs.now
            actions += self._cap(state, cpu, reasons, info, inputs.pods) + self._idle(inputs, cpu, info)
        elif self.capping and inputs.now - self.last_confirmed < self.hold:
            # Held a while after the verdict clears: the cap is what cleared it, and
            # lifting it at once would bring the interference straight back (flapping).
            left = self.hold - (inputs.now - self.last_confirmed)
            reasons.append(f"CPU interference cleared; cap held {left:.0f}s more")
            actions += self._cap(state, [], reasons, info, inputs.pods) + self._idle(inputs, [], info)
        elif self.capping:
            actions += self._release(reasons, inputs.pods, state)
        if memory and self.memory_evict:
            actions += self._evict(inputs, memory, reasons, info)
        return Plan(NAME, self.priority, tuple(actions), info, "; ".join(reasons) or "no confirmed interference")

    def _cap(self, state: BEState, cpu: list[Verdict], reasons: list[str], info: dict[str, Any],
             pods: Sequence[PodView]) -> list[Action]:
        out = self._confine(pods, info, state) if self.be_cpus > 0 else []
        return out + self._cap_quota(state, cpu, reasons, info)

    def _confine(self, pods: Sequence[PodView], info: dict[str, Any], state: BEState) -> list[Action]:
        """BE on the last ``be_cpus`` CPUs BE may use: the victims get the others to themselves."""
        allowed = sorted(self._cpusets.recovery_cpus(pods))
        if len(allowed) <= self.be_cpus:
            return []
        chosen = frozenset(allowed[-self.be_cpus:])
        info["cpuset"] = sorted(chosen)
        return [self._cpuset(pods, chosen, f"interference: BE confined to {sorted(chosen)}", state)]

    def _cpuset(self, pods: Sequence[PodView], cpus: frozenset[int], why: str, state: BEState | None) -> Action:
        """The tier's, pods' and containers' cpusets; on v1 every cgroup under the tier as
        found on the filesystem (see ``SuppressStrategy._cpuset_write``)."""
        return self._cpusets._cpuset_write(pods, cpus, why, state.children if state is not None else ())

    def _cap_quota(self, state: BEState, cpu: list[Verdict], reasons: list[str], info: dict[str, Any]
                   ) -> list[Action]:
        period = self.cfg.cfs_period_us
        quota = max(int(self.be_cpu_cores * period), 1000)
        if state.quota is None:
            reasons.append("CPU interference confirmed, but the BE tier quota is unreadable: no decision")
            return []
        if not self.capping:
            self.capping = True
            self.original_quota = state.quota
            self._audit("cap_be_cpu", cpu, quota=quota, original_quota=state.quota)
        if 0 < state.quota < quota:
            reasons.append(f"CPU interference confirmed; BE quota {state.quota} already below the cap {quota}")
            return []
        victims = ", ".join(v.pod.key for v in cpu) or "none now (held)"
        why = f"interference on {victims}: BE cfs quota capped at {self.be_cpu_cores:g} cores"
        reasons.append(why)
        info["quota"] = quota
        return [self._clamps.write(SetCgroup(self.cfg.besteffort_dir, CPU_CFS_QUOTA, quota, why), state.children,
                                   self.cfg.cfs_period_us)]

    def _idle(self, inputs: RoundInputs, cpu: list[Verdict], info: dict[str, Any]) -> list[Action]:
        if not self.be_idle:
            return []
        idle = self._read_idle(inputs.ctx)
        if idle is None:
            info["be_idle"] = f"no cpu.idle on {self.cfg.besteffort_dir}: not set"
            return []
        if self.original_idle is None:
            self.original_idle = idle
        info["be_idle"] = 1
        victims = ", ".join(v.pod.key for v in cpu) or "none now (held)"
        return [SetCgroup(self.cfg.besteffort_dir, CPU_IDLE, 1,
                          f"interference on {victims}: BE tier SCHED_IDLE (cpu.idle 1)")]

    def _release(self, reasons: list[str], pods: Sequence[PodView], state: BEState | None = None) -> list[Action]:
        original = self.original_quota if self.original_quota is not None else -1
        why = f"CPU interference cleared: BE cfs quota back to {original}"
        self._audit("release_be_cpu", [], quota=original)
        self.capping, self.original_quota = False, None
        reasons.append(why)
        # The children this round read (a releasing round reads them): a child clamped under
        # the cap gets its own quota back now when the tier goes back to a positive quota it
        # fits under, not when cpu-suppress next moves the tier. None (the task stopping):
        # every remembered original is restored.
        children = state.children if state is not None else None
        out: list[Action] = [self._clamps.write(SetCgroup(self.cfg.besteffort_dir, CPU_CFS_QUOTA, original, why),
                                                children, self.cfg.cfs_period_us)]
        if self.be_cpus > 0:
            out.append(self._cpuset(pods, self._cpusets.recovery_cpus(pods), why, state))
        if self.original_idle is not None:
            out.append(SetCgroup(self.cfg.besteffort_dir, CPU_IDLE, self.original_idle,
                                 f"CPU interference cleared: BE tier cpu.idle back to {self.original_idle}"))
            if self.original_idle == 0:
                # cpu.idle 1 -> 0 resets the weight to the kernel default (cpu.shares 1024): the
                # tier gets kubelet's BestEffort weight back in the same step (hooks.idleweight).
                out.append(SetCgroup(self.cfg.besteffort_dir, CPU_SHARES, MIN_SHARES,
                                     "CPU interference cleared: BE tier cpu.idle 0 reset its weight; "
                                     f"kubelet's BestEffort tier weight cpu.shares {MIN_SHARES} restored"))
            self.original_idle = None
        return out

    def _evict(self, inputs: RoundInputs, memory: list[Verdict], reasons: list[str],
               info: dict[str, Any]) -> list[Action]:
        now = inputs.now
        if now - self.last_evict < self.memory_cool_down:
            reasons.append(f"memory interference confirmed; eviction cooling down "
                           f"({self.memory_cool_down - (now - self.last_evict):.0f}s left)")
            return []
        present = {p.uid for p in inputs.pods}
        top = max(memory, key=lambda v: max((e.ratio for e in v.evidence), default=0.0))
        culprit = next((c for c in top.culprits if c.pod.uid in present), None)
        if culprit is None:
            reasons.append("memory interference confirmed; no culprit to evict")
            return []
        self.last_evict = now
        why = f"memory interference on {top.pod.key}: evict top culprit {culprit.pod.key}"
        reasons.append(why)
        info["evict"] = culprit.as_dict()
        self._audit("evict_be", memory, culprit=culprit.pod.key, culprit_uid=culprit.pod.uid,
                    memory_growth=culprit.memory_growth)
        return [Evict(culprit.pod.uid, culprit.pod.key, why, released_memory=culprit.memory or 0.0)]

    def _audit(self, action: str, victims: list[Verdict], **fields: Any) -> None:
        log.info("interference_action", action=action, dry_run=self.dry_run,
                 victims=[v.pod.key for v in victims],
                 evidence={v.pod.key: [e.as_dict() for e in v.evidence] for v in victims},
                 culprits=sorted({c.pod.key for v in victims for c in v.culprits}), **fields)

    def release(self, pods: Sequence[PodView]) -> list[Action]:
        """Task stop: the cap must not outlive the manager."""
        if not self.capping:
            return []
        return self._release([], pods)


def _brief(v: Verdict) -> dict[str, Any]:
    return {"pod": v.pod.key, "since": v.since, "evidence": [e.as_dict() for e in v.evidence],
            "culprits": [c.pod.key for c in v.culprits]}


def _number(args: Mapping[str, Any], key: str, default: float, key_path: str) -> float:
    value = args.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise HookConfigError(f"{key_path}.{key}", value, "must be a positive number")
    return float(value)


def interference(init: StrategyInit) -> Interference:
    """Entry point. ``args``: ``be_cpu_cores`` (0.5), ``be_cpus`` (auto: ceil(be_cpu_cores); 0: quota only),
    ``be_idle`` (true: the BE tier SCHED_IDLE while capping), ``hold`` (30s), ``memory_evict`` (true),
    ``memory_cool_down`` (60s)."""
    args, where = init.args, init.key_path
    known = ("be_cpu_cores", "be_cpus", "be_idle", "hold", "memory_evict", "memory_cool_down")
    reject_unknown(args, set(known), f"{where}.")
    cap = _number(args, "be_cpu_cores", 0.5, where)
    be_cpus = args.get("be_cpus", DEFAULT_BE_CPUS)
    if be_cpus == "auto":
        be_cpus = max(math.ceil(cap), 1)
        why = f"{be_cpus} (auto: be_cpu_cores {cap:g} rounded up)"
    elif isinstance(be_cpus, bool) or not isinstance(be_cpus, int) or be_cpus < 0:
        raise HookConfigError(f"{where}.be_cpus", be_cpus, "must be auto or a number of CPUs >= 0 (0: quota only)")
    else:
        why = f"{be_cpus}" if be_cpus else "0 (quota only)"
    be_idle = args.get("be_idle", True)
    if not isinstance(be_idle, bool):
        raise HookConfigError(f"{where}.be_idle", be_idle, "must be true or false")
    memory_evict = args.get("memory_evict", True)
    if not isinstance(memory_evict, bool):
        raise HookConfigError(f"{where}.memory_evict", memory_evict, "must be true or false")
    cool = parse_duration(args.get("memory_cool_down", 60.0), f"{where}.memory_cool_down")
    hold = parse_duration(args.get("hold", 30.0), f"{where}.hold")
    source = init.interference  # the interference task, when enabled (the QoS task is built after it)

    def verdicts() -> Verdicts | None:
        return source.verdicts if source is not None else None

    strategy = Interference(verdicts, be_cpu_cores=cap, memory_evict=memory_evict, memory_cool_down=cool,
                            dry_run=init.config.dry_run, suppress=init.config.suppress, hold=hold, be_cpus=be_cpus,
                            topology=init.topology, be_idle=be_idle, clamps=init.tier_clamps)
    strategy.be_cpus_why = why
    return strategy
