"""Interference analysis (Koordetector's analyser): does an LS-class pod suffer from
what the BE pods are doing, on which resource, and who is to blame?

Pure decisions on plain values, fed one ``Observation`` per step (the reading of the
store is ``interference_signals``; the loop, explain and Prometheus are
``interference_task``). Per LS/LSR/LSE pod and per signal:

* **Baseline**: the median and MAD of the signal's last ``baseline_samples`` values
  taken while the pod had no verdict on the resource and the value was not anomalous
  (its own quiet behaviour, robust to the odd spike). While a signal has fewer than
  ``min_baseline`` values (warm-up) it is judged against its absolute ``floor`` alone,
  so a new LS pod is protected from its first minute (issue 28 item 11); a warm-up value
  above the floor is learnt only when no BE activity explains it (the pod's own load).
* **Anomalous**: ``value > median + max(k x 1.4826 MAD, floor, rel x median)``: ``k``
  (``mad_k``) robust deviations, but never less than the signal's absolute ``floor``
  (PSI 10 points, schedule-latency p99 2 ms, ...) nor ``rel`` of the baseline: a pod
  whose latency is flat at 50 µs is not "interfered" at 80 µs.
* **Per resource** (cpu: schedule latency, CPU PSI, throttling, CPI; memory: memory
  PSI, reclaim latency, allocation stall share), a verdict needs an unbroken run of anomalous steps:
  **suspected** once the run is ``suspect_after`` long, **confirmed** once it is
  ``confirm_after`` long *and* BE pods explain it (cpu: BE pods use at least
  ``be_cpu_min`` cores; memory: BE pods' memory grew by ``be_memory_growth_min`` over
  the growth window, or they use at least ``be_memory_min`` while the node's memory is
  above ``node_memory_high`` of its total). The run also needs ``min_samples``
  distinct anomalous samples (a PSI value collected every 10 s and read at every step
  is one). A run broken before ``suspect_after`` is forgotten: spikes never add up.
* **Hysteresis**: a verdict holds while any signal stays above its **exit** threshold
  (half-way between median and entry) and clears only after ``clear_after`` seconds
  with every signal below it; meanwhile nothing is learnt for that resource.
* **Culprits**: BE pods ranked by CPU usage (cpu) or by memory growth, then usage
  (memory), the top ``max_culprits``.
"""

from __future__ import annotations

import array
import enum
import operator
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Final

from hooks.qos import QoSClass

CPU: Final = "cpu"
MEMORY: Final = "memory"
RESOURCES: Final = (CPU, MEMORY)
LS_CLASSES: Final = frozenset({QoSClass.LS, QoSClass.LSR, QoSClass.LSE})


class Level(enum.IntEnum):
    NONE = 0
    SUSPECTED = 1
    CONFIRMED = 2


@dataclass(frozen=True, slots=True)
class SignalSpec:
    """How one signal is judged: its resource, the absolute floor of a deviation
    (in the signal's unit) and the relative one (of the baseline median)."""

    name: str
    resource: str
    floor: float
    rel: float = 0.5


#: The signals, by name (``Observation.signals`` keys). Units: PSI percent, seconds, ratio.
SIGNALS: Final[Mapping[str, SignalSpec]] = {
    s.name: s for s in (
        SignalSpec("sched_latency_p99", CPU, floor=0.002, rel=1.0),
        SignalSpec("sched_latency_mean", CPU, floor=0.001, rel=1.0),
        SignalSpec("cpu_psi", CPU, floor=10.0, rel=1.0),
        SignalSpec("cpu_throttled", CPU, floor=0.2, rel=0.5),
        SignalSpec("cpi", CPU, floor=0.5, rel=0.3),
        SignalSpec("memory_psi", MEMORY, floor=5.0, rel=1.0),
        SignalSpec("reclaim_latency", MEMORY, floor=0.001, rel=1.0),
        # Share of time the container stalled in direct reclaim/compaction (memlat; 0 when idle).
        SignalSpec("alloc_stall", MEMORY, floor=0.05, rel=1.0),
    )
}


@dataclass(frozen=True, slots=True)
class AnalyserConfig:
    suspect_after: float = 2.0
    confirm_after: float = 4.0
    clear_after: float = 10.0
    mad_k: float = 5.0
    baseline_samples: int = 600
    #: Quiet values a signal's baseline needs before the signal is judged (warm-up).
    min_baseline: int = 20
    be_cpu_min: float = 0.5
    be_memory_growth_min: float = 64 * 1024 * 1024
    be_memory_min: float = 256 * 1024 * 1024
    node_memory_high: float = 0.9
    growth_window: float = 30.0
    max_culprits: int = 3
    #: Distinct anomalous samples a verdict needs (a 10 s PSI sample read for 10 steps is one).
    min_samples: int = 2


@dataclass(frozen=True, slots=True)
class PodRef:
    uid: str
    namespace: str
    name: str
    qos: QoSClass

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class BEUsage:
    pod: PodRef
    cpu: float | None = None
    memory: float | None = None


@dataclass(frozen=True, slots=True)
class Observation:
    """What one step sees: each LS-class pod's signals (name -> value; absent: not
    measured), where each came from (``pod``, ``container``, ``node``), and the BE pods."""

    now: float
    pods: Sequence[PodRef]
    signals: Mapping[str, Mapping[str, float]]
    sources: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    be: Sequence[BEUsage] = ()
    #: Per pod, signal -> the sample's timestamp (absent: every step is a new sample).
    stamps: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    node_memory_used: float | None = None
    node_memory_total: float | None = None
    #: Per pod, signal -> (container id, container name) of a per-container signal (the
    #: worst container's); absent for pod- and node-level signals.
    containers: Mapping[str, Mapping[str, tuple[str, str]]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Evidence:
    signal: str
    value: float
    baseline: float
    threshold: float
    #: value / max(baseline, floor): how far from normal.
    ratio: float
    source: str = "pod"

    def as_dict(self) -> dict[str, Any]:
        return {"signal": self.signal, "value": self.value, "baseline": self.baseline, "threshold": self.threshold,
                "ratio": round(self.ratio, 3), "source": self.source}


@dataclass(frozen=True, slots=True)
class Culprit:
    pod: PodRef
    #: cpu: cores in use; memory: bytes grown over the window (or in use).
    score: float
    cpu: float | None
    memory: float | None
    memory_growth: float | None

    def as_dict(self) -> dict[str, Any]:
        return {"pod": self.pod.key, "uid": self.pod.uid, "score": self.score, "cpu": self.cpu,
                "memory": self.memory, "memory_growth": self.memory_growth}


@dataclass(frozen=True, slots=True)
class Verdict:
    pod: PodRef
    resource: str
    level: Level
    since: float | None
    evidence: tuple[Evidence, ...] = ()
    culprits: tuple[Culprit, ...] = ()
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"resource": self.resource, "level": self.level.name.lower(), "since": self.since,
                "reason": self.reason, "evidence": [e.as_dict() for e in self.evidence],
                "culprits": [c.as_dict() for c in self.culprits]}


class Baseline:
    """Robust statistics of a signal's quiet values (median, MAD). Recomputed (a sort of
    up to ``baseline_samples`` values) only every ``REFRESH`` new values once warm: the
    baseline of a quiet pod moves slowly, and a sort per signal per pod per second was
    most of the analyser's CPU. The values are a ring of plain doubles: a full baseline
    is 600 values for each of ~5 signals of every LS pod (a deque of float objects held
    7.8 MiB for 80 LS pods once the baselines had filled; this holds 2 MiB)."""

    __slots__ = ("_added", "_mad", "_median", "_next", "_size", "_values")
    REFRESH: Final = 10

    def __init__(self, size: int) -> None:
        self._values: array.array[float] = array.array("d")
        self._size = size
        self._next = 0  # where the next value goes once the ring is full (the oldest)
        self._median = 0.0
        self._mad = 0.0
        self._added = -1  # values added since the last computation; -1: never computed

    def __len__(self) -> int:
        return len(self._values)

    def add(self, value: float) -> None:
        if len(self._values) < self._size:
            self._values.append(value)
        else:
            self._values[self._next] = value
            self._next = (self._next + 1) % self._size
        if self._added >= 0:
            self._added += 1

    def stats(self, min_count: int) -> tuple[float, float]:
        """(median, MAD); (0, 0) until ``min_count`` values are known."""
        if len(self._values) < min_count:
            return 0.0, 0.0
        if self._added < 0 or self._added >= self.REFRESH:
            # ``tolist`` + ``sort`` and ``map`` over C functions: the same values as
            # ``sorted`` and a generator of ``abs(v - median)``, without a Python frame
            # per value (this was most of a step's judging at 80 LS pods).
            values = self._values.tolist()
            values.sort()
            median = self._median = values[len(values) // 2]
            self._mad = statistics.median(map(abs, map(operator.sub, values, repeat(median))))
            self._added = 0
        return self._median, self._mad

    def values(self) -> list[float]:
        """Oldest first."""
        return self._values[self._next:].tolist() + self._values[:self._next].tolist()


@dataclass
class _Streak:
    since: float
    #: Last time any signal of the resource was above its exit threshold.
    last_hot: float
    level: Level = Level.NONE
    #: Start of the current unbroken run of anomalous steps (None: the last step was quiet).
    run_since: float | None = None
    #: Distinct anomalous samples (signal, timestamp) seen in the current run.
    samples: set[tuple[str, float]] = field(default_factory=set)


@dataclass
class _PodState:
    baselines: dict[str, Baseline] = field(default_factory=dict)
    streaks: dict[str, _Streak] = field(default_factory=dict)
    #: signal -> timestamp of the last sample learnt (a sample is learnt once).
    learnt: dict[str, float] = field(default_factory=dict)


class InterferenceAnalyser:
    """Per-pod baselines and verdicts, updated by ``step`` (one thread at a time)."""

    def __init__(self, config: AnalyserConfig = AnalyserConfig()) -> None:
        self.cfg = config
        self._pods: dict[str, _PodState] = {}
        self._be_memory: dict[str, deque[tuple[float, float]]] = {}
        self.verdicts: dict[str, dict[str, Verdict]] = {}
        self.steps = 0

    def thresholds(self, uid: str, signal: str) -> tuple[float, float, float]:
        """(baseline median, entry threshold, exit threshold) of a pod's signal."""
        state = self._pods.get(uid)
        return self._limits(SIGNALS[signal], state.baselines.get(signal) if state is not None else None)

    def _limits(self, spec: SignalSpec, base: Baseline | None) -> tuple[float, float, float]:
        """``thresholds`` of a baseline at hand (``_judge`` has it: no lookups again)."""
        median, mad = base.stats(self.cfg.min_baseline) if base is not None else (0.0, 0.0)
        enter = median + max(self.cfg.mad_k * 1.4826 * mad, spec.floor, spec.rel * median)
        return median, enter, median + (enter - median) / 2

    def step(self, obs: Observation) -> dict[str, dict[str, Verdict]]:
        """Judge every LS-class pod of ``obs``; pods gone are forgotten."""
        self.steps += 1
        growth = self._be_growth(obs)
        present = {p.uid for p in obs.pods}
        for uid in [u for u in self._pods if u not in present]:
            del self._pods[uid]
        out: dict[str, dict[str, Verdict]] = {}
        for pod in obs.pods:
            if pod.qos not in LS_CLASSES:
                continue
            state = self._pods.get(pod.uid)
            if state is None:  # not ``setdefault``: it would build a state per pod and step
                state = self._pods[pod.uid] = _PodState()
            signals = obs.signals.get(pod.uid, {})
            sources = obs.sources.get(pod.uid, {})
            stamps = obs.stamps.get(pod.uid, {})
            out[pod.uid] = {r: self._judge(pod, state, r, signals, sources, stamps, obs, growth)
                            for r in RESOURCES}
        self.verdicts = out
        return out

    def _judge(self, pod: PodRef, state: _PodState, resource: str, signals: Mapping[str, float],
               sources: Mapping[str, str], stamps: Mapping[str, float], obs: Observation,
               growth: Mapping[str, float]) -> Verdict:
        cfg, now = self.cfg, obs.now
        hot: list[Evidence] = []
        warm = False
        learning: list[str] = []
        mine = [(n, v) for n, v in signals.items() if n in SIGNALS and SIGNALS[n].resource == resource]
        streak = state.streaks.get(resource)
        explained_now: list[str] = []  # computed at most once, only when a learning signal is hot

        def be_explains() -> bool:
            if not explained_now:
                explained_now.append(self._culprits(resource, obs, growth)[1])
            return bool(explained_now[0])

        for name, value in mine:
            base = state.baselines.get(name)
            if base is None:
                base = state.baselines[name] = Baseline(cfg.baseline_samples)
            stamp = stamps.get(name, now)
            new_sample = state.learnt.get(name) != stamp
            median, enter, leave = self._limits(SIGNALS[name], base)
            if len(base) < cfg.min_baseline:
                # Warming up: judged against the absolute floor (``thresholds`` without a
                # baseline), so a new pod is protected from its first samples. Values at
                # or below it are learnt; one above it only when no BE activity explains
                # it (the pod's own load), so interference is not learnt as normal.
                learning.append(f"{name} {len(base)}/{cfg.min_baseline}")
                hot_now = value > enter
                if hot_now:
                    hot.append(Evidence(name, value, median, enter, value / max(median, SIGNALS[name].floor),
                                        sources.get(name, "pod")))
                if new_sample and (not hot_now or not be_explains()):
                    state.learnt[name] = stamp
                    base.add(value)
                continue
            if value > enter:
                hot.append(Evidence(name, value, median, enter, value / max(median, SIGNALS[name].floor),
                                    sources.get(name, "pod")))
            elif value > leave:
                warm = True
            elif streak is None and new_sample:
                # Learnt only from quiet values of a pod without a verdict on this resource.
                state.learnt[name] = stamp
                base.add(value)
        if not mine:
            return Verdict(pod, resource, Level.NONE, None, reason="no signal measured")
        if streak is None and not hot:
            why = "no signal above its threshold"
            return Verdict(pod, resource, Level.NONE, None,
                           reason=why + (f"; learning baselines: {', '.join(learning)}" if learning else ""))
        if streak is None:
            streak = state.streaks[resource] = _Streak(since=now, last_hot=now)
        if hot or (warm and streak.level):
            streak.last_hot = now
            if streak.run_since is None:
                streak.run_since = now
                streak.samples.clear()
            streak.samples.update((e.signal, stamps.get(e.signal, now)) for e in hot)
        else:
            streak.run_since = None
            if not streak.level:  # a spike that became no verdict is forgotten
                del state.streaks[resource]
                return Verdict(pod, resource, Level.NONE, None, reason="a spike shorter than the minimum duration")
            if now - streak.last_hot >= cfg.clear_after:
                del state.streaks[resource]
                return Verdict(pod, resource, Level.NONE, None, reason=f"cleared: quiet for {cfg.clear_after:g}s")
        culprits, explained = self._culprits(resource, obs, growth)
        run = now - streak.run_since if streak.run_since is not None else 0.0
        many = len(streak.samples) >= cfg.min_samples
        if streak.level < Level.CONFIRMED and run >= cfg.confirm_after and many and explained:
            streak.level = Level.CONFIRMED
        elif streak.level < Level.SUSPECTED and run >= cfg.suspect_after and many:
            streak.level = Level.SUSPECTED
        level = streak.level
        if level is Level.CONFIRMED:
            reason = f"anomalous since {streak.since:.0f}; BE pods explain it ({explained or 'earlier'})"
        elif level is Level.SUSPECTED:
            reason = f"anomalous for {run:.1f}s; " + (f"BE pods: {explained}" if explained
                                                       else "no BE activity explains it")
        else:
            reason = f"anomalous for {run:.1f}s (< {cfg.suspect_after:g}s: not yet a verdict)"
        if not hot and level:
            reason += f"; below the entry threshold, clears after {cfg.clear_after:g}s quiet"
        if learning:
            reason += f"; learning baselines (judged against their floors): {', '.join(learning)}"
        hot.sort(key=lambda e: -e.ratio)
        return Verdict(pod, resource, level, streak.since, tuple(hot), culprits if level else (), reason)

    # --- BE side -----------------------------------------------------------------------

    def _be_growth(self, obs: Observation) -> dict[str, float]:
        """BE pods' memory growth over the growth window (bytes; unknown: absent)."""
        out: dict[str, float] = {}
        seen: set[str] = set()
        for be in obs.be:
            seen.add(be.pod.uid)
            if be.memory is None:
                continue
            hist = self._be_memory.setdefault(be.pod.uid, deque())
            hist.append((obs.now, be.memory))
            while hist and hist[0][0] < obs.now - self.cfg.growth_window:
                hist.popleft()
            out[be.pod.uid] = be.memory - min(map(operator.itemgetter(1), hist))  # C-level: no frame per entry
        for uid in [u for u in self._be_memory if u not in seen]:
            del self._be_memory[uid]
        return out

    def _culprits(self, resource: str, obs: Observation, growth: Mapping[str, float]
                  ) -> tuple[tuple[Culprit, ...], str]:
        """Ranked BE culprits and why they explain the signal ('' when they do not)."""
        cfg = self.cfg
        items = [Culprit(b.pod, 0.0, b.cpu, b.memory, growth.get(b.pod.uid)) for b in obs.be]
        if resource == CPU:
            ranked = sorted((c for c in items if c.cpu), key=lambda c: (-(c.cpu or 0.0), c.pod.key))
            total = sum(c.cpu or 0.0 for c in ranked)
            top = tuple(_scored(c, c.cpu or 0.0) for c in ranked[:cfg.max_culprits])
            return top, (f"BE CPU {total:.2f} cores >= {cfg.be_cpu_min:g}" if total >= cfg.be_cpu_min else "")
        ranked = sorted((c for c in items if c.memory), key=lambda c: (-(c.memory_growth or 0.0),
                                                                        -(c.memory or 0.0), c.pod.key))
        grown = sum(max(c.memory_growth or 0.0, 0.0) for c in ranked)
        used = sum(c.memory or 0.0 for c in ranked)
        top = tuple(_scored(c, c.memory_growth or c.memory or 0.0) for c in ranked[:cfg.max_culprits])
        if grown >= cfg.be_memory_growth_min:
            return top, f"BE memory grew {grown / 2**20:.0f} MiB in {cfg.growth_window:g}s"
        cap, node_used = obs.node_memory_total, obs.node_memory_used
        if (used >= cfg.be_memory_min and cap and node_used is not None
                and node_used >= cfg.node_memory_high * cap):
            return top, f"BE memory {used / 2**20:.0f} MiB with the node at {100 * node_used / cap:.0f}%"
        return top, ""


def _scored(c: Culprit, score: float) -> Culprit:
    return Culprit(c.pod, score, c.cpu, c.memory, c.memory_growth)


def worst(verdicts: Mapping[str, Verdict]) -> Verdict | None:
    """The pod's highest verdict (cpu first on a tie), None when none."""
    found = [v for v in verdicts.values() if v.level]
    return max(found, key=lambda v: (v.level, v.resource == CPU)) if found else None


def confirmed(verdicts: Mapping[str, Mapping[str, Verdict]], resource: str) -> list[Verdict]:
    return [v[resource] for v in verdicts.values() if resource in v and v[resource].level is Level.CONFIRMED]


def as_dicts(verdicts: Iterable[Verdict]) -> list[dict[str, Any]]:
    return [v.as_dict() for v in verdicts]
