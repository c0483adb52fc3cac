"""The interference analyser task (entry point ``interference`` in
``koord_runtime_proxy.tasks``; list it after ``metrics``).

Every ``interval`` it reads the signals of the last collection from the metrics
agent's store and steps the analyser, in a worker thread (``asyncio.to_thread``): the
loop only waits. A task of its own rather than a step of the QoS manager's round: the
baselines must be learnt whether or not the QoS manager runs (or runs in dry-run), and
its verdicts are wanted on ``/metrics`` and in ``explain`` without any acting. The
``interference`` QoS strategy reads the latest verdicts from it (the task provides
itself to the QoS manager task, which is built after it: ``after = ("interference",)``).

Outputs:

* ``explain`` (``koord-runtime-proxy explain [pod]``, ``/debug/explain``) under
  ``interference``: per pod the verdict per resource, its evidence (signal, value,
  baseline, threshold, ratio, source) and culprits, and every signal with its baseline;
* Prometheus (labels ``node, pod_namespace, pod_name, pod_uid``):
  ``koordetector_interference{…,resource}`` 0 none / 1 suspected / 2 confirmed for every
  LS-class pod, ``koordetector_signal{…,container_id,container_name,signal}`` and
  ``koordetector_signal_baseline{…}`` (its learnt median; the container is the worst
  one of a per-container signal, empty for pod/node signals), and
  ``koordetector_analysis_seconds_total`` (the analyser's own CPU time);
* one log line ``interference_verdict`` per change of a pod's verdict, and the same
  change to an event sink (a Kubernetes Event on the victim pod, when one is given:
  ``set_event_sink``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Final

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector as PromCollector

from metrics.analysis.interference import (
    RESOURCES,
    SIGNALS,
    AnalyserConfig,
    InterferenceAnalyser,
    Level,
    Observation,
    PodRef,
    Verdict,
)
from metrics.analysis.interference_signals import SignalReader
from metrics.handles import metrics_agent
from metrics.model import MetricReader, PodView
from metrics.report.events import WARNING, EventRecorder
from metrics.settings import METRICS_TASK, validated_metrics
from runtimeproxy.config.configvalues import parse_duration, reject_unknown
from runtimeproxy.hookapi import HookConfigError, PodInfo, TaskInit

log = structlog.get_logger("metrics.analysis.interference")

#: (victim, verdict) -> None: e.g. a Kubernetes Event on the victim pod.
EventSink = Callable[[PodRef, Verdict], None]


@dataclass(frozen=True, slots=True)
class InterferenceSettings:
    interval: float = 2.0
    suspect_after: float = 2.0
    confirm_after: float = 4.0
    clear_after: float = 10.0
    mad_k: float = 5.0
    min_baseline: int = 20
    be_cpu_min: float = 0.5
    be_memory_growth_min: float = 64 * 2**20

    def analyser(self) -> AnalyserConfig:
        return AnalyserConfig(suspect_after=self.suspect_after, confirm_after=self.confirm_after,
                              clear_after=self.clear_after, mad_k=self.mad_k, min_baseline=self.min_baseline,
                              be_cpu_min=self.be_cpu_min, be_memory_growth_min=self.be_memory_growth_min)


_DURATIONS: Final = frozenset({"interval", "suspect_after", "confirm_after", "clear_after"})


def parse_interference(raw: Mapping[str, Any], key_path: str) -> InterferenceSettings:
    known = {f.name for f in fields(InterferenceSettings)}
    values: dict[str, Any] = {}
    reject_unknown(raw, known, f"{key_path}.")
    for key, value in raw.items():
        where = f"{key_path}.{key}"
        if key in _DURATIONS:
            values[key] = parse_duration(value, where)
        elif key == "min_baseline":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HookConfigError(where, value, "must be a positive integer")
            values[key] = value
        else:
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise HookConfigError(where, value, "must be a positive number")
            values[key] = float(value)
    settings = InterferenceSettings(**values)
    if settings.confirm_after < settings.suspect_after:
        raise HookConfigError(f"{key_path}.confirm_after", raw.get("confirm_after"),
                              f"must be at least suspect_after ({settings.suspect_after:g}s)")
    return settings


class InterferenceTask:
    def __init__(self, settings: InterferenceSettings, reader: MetricReader, pods: Callable[[], list[PodView]], *,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.analyser = InterferenceAnalyser(settings.analyser())
        self.signals = SignalReader(reader, max_age=max(25.0, 3 * settings.interval))
        self._pods = pods
        self._clock = clock
        self._sink: EventSink | None = None
        #: uid -> resource -> verdict of the last step (replaced whole: safe to read from any thread).
        self.verdicts: Mapping[str, Mapping[str, Verdict]] = {}
        self.observation: Observation | None = None
        self.at = 0.0
        self.cpu_seconds = 0.0

    def set_event_sink(self, sink: EventSink | None) -> None:
        self._sink = sink

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval)
            await asyncio.to_thread(self.step, self._pods(), self._clock())

    def step(self, pods: list[PodView], now: float) -> Mapping[str, Mapping[str, Verdict]]:
        """Read, judge, report changes (worker thread)."""
        started = time.thread_time()
        obs = self.signals.observe(pods, now)
        before = self.verdicts
        verdicts = self.analyser.step(obs)
        self.observation, self.verdicts, self.at = obs, verdicts, now
        self.cpu_seconds += time.thread_time() - started
        for uid, mine in verdicts.items():
            for resource, verdict in mine.items():
                old = before.get(uid, {}).get(resource)
                if (old.level if old is not None else Level.NONE) != verdict.level:
                    self._changed(verdict, old)
        return verdicts

    def _changed(self, verdict: Verdict, old: Verdict | None) -> None:
        log.info("interference_verdict", pod=verdict.pod.key, pod_uid=verdict.pod.uid, resource=verdict.resource,
                 level=verdict.level.name.lower(), was=old.level.name.lower() if old is not None else "none",
                 reason=verdict.reason, evidence=[e.as_dict() for e in verdict.evidence],
                 culprits=[c.pod.key for c in verdict.culprits])
        if self._sink is not None:
            try:
                self._sink(verdict.pod, verdict)
            except Exception as exc:  # noqa: BLE001 - an event is best effort, never the analyser's failure
                log.warning("interference_event_failed", pod=verdict.pod.key, error=str(exc))

    # --- explain ---------------------------------------------------------------------

    def explain(self, pod: PodInfo | None = None) -> dict[str, Any]:
        verdicts = self.verdicts
        if pod is None:
            active: dict[str, dict[str, str]] = {}
            for mine in verdicts.values():
                for v in mine.values():
                    if v.level:
                        active.setdefault(v.pod.key, {})[v.resource] = v.level.name.lower()
            return {"at": self.at, "pods": len(verdicts), "settings": asdict(self.settings),
                    "cpu_seconds": round(self.cpu_seconds, 4), "verdicts": active}
        return self.explain_uid(pod.meta.uid)

    def explain_uid(self, uid: str) -> dict[str, Any]:
        mine = self.verdicts.get(uid)
        if mine is None:
            return {"pod_uid": uid, "verdict": None, "reason": "not an LS/LSR/LSE pod the analyser knows"}
        obs = self.observation
        signals = obs.signals.get(uid, {}) if obs is not None else {}
        sources = obs.sources.get(uid, {}) if obs is not None else {}
        where = obs.containers.get(uid, {}) if obs is not None else {}
        detail: dict[str, dict[str, Any]] = {}
        for name, value in sorted(signals.items()):
            median, enter, leave = self.analyser.thresholds(uid, name)
            detail[name] = {"value": value, "source": sources.get(name, "pod"), "baseline": median,
                            "enter": enter, "exit": leave}
            if name in where:
                detail[name]["container_id"], detail[name]["container_name"] = where[name]
        be = [{"pod": b.pod.key, "cpu": b.cpu, "memory": b.memory} for b in obs.be] if obs is not None else []
        return {"pod_uid": uid, "at": self.at, "verdict": {r: v.as_dict() for r, v in mine.items()},
                "signals": detail, "be_pods": be}

    # --- Prometheus ------------------------------------------------------------------

    def gauges(self, node: str) -> PromCollector:
        return _Gauges(self, node)


class _Gauges(PromCollector):
    _POD: Final = ["node", "pod_namespace", "pod_name", "pod_uid"]
    _CONTAINER: Final = ["container_id", "container_name"]
    _NO_CONTAINER: Final = ("", "")

    def __init__(self, task: InterferenceTask, node: str) -> None:
        self._task = task
        self._node = node

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return self._families(False)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return self._families(True)

    def _families(self, fill: bool) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        task = self._task
        level = GaugeMetricFamily("koordetector_interference",
                                  "Interference verdict of an LS-class pod: 0 none, 1 suspected, 2 confirmed",
                                  labels=[*self._POD, "resource"])
        # A per-container signal (the worst container's) names its container; a pod- or
        # node-level one leaves container_id/container_name empty (absent to Prometheus).
        signal = GaugeMetricFamily("koordetector_signal", "An interference signal of an LS-class pod (last value)",
                                   labels=[*self._POD, *self._CONTAINER, "signal"])
        baseline = GaugeMetricFamily("koordetector_signal_baseline",
                                     "The learnt quiet median of an interference signal",
                                     labels=[*self._POD, *self._CONTAINER, "signal"])
        cost = CounterMetricFamily("koordetector_analysis_seconds",
                                   "CPU time spent by the interference analyser", labels=["node"])
        if fill:
            obs = task.observation
            for uid, mine in task.verdicts.items():
                pod = next(iter(mine.values())).pod
                base = [self._node, pod.namespace, pod.name, uid]
                for resource in RESOURCES:
                    if resource in mine:
                        level.add_metric([*base, resource], float(mine[resource].level))
                signals = obs.signals.get(uid, {}) if obs is not None else {}
                where = obs.containers.get(uid, {}) if obs is not None else {}
                for name, value in signals.items():
                    if name in SIGNALS:
                        labels = [*base, *where.get(name, self._NO_CONTAINER), name]
                        signal.add_metric(labels, value)
                        baseline.add_metric(labels, task.analyser.thresholds(uid, name)[0])
            cost.add_metric([self._node], task.cpu_seconds)
        yield level
        yield signal
        yield baseline
        yield cost


def _verdict_event(events: EventRecorder, pod: PodRef, verdict: Verdict) -> None:
    """A confirmed verdict becomes a Warning Event on the victim pod (deduplicated and
    rate-limited by the recorder; a no-op without a cluster)."""
    if verdict.level is not Level.CONFIRMED:
        return
    culprits = ", ".join(c.pod.key for c in verdict.culprits) or "none identified"
    evidence = "; ".join(f"{e.signal} {e.value:.4g} (baseline {e.baseline:.4g})" for e in verdict.evidence)
    events.record(events.pod(pod.namespace, pod.name, pod.uid), WARNING, "InterferenceDetected",
                  f"{verdict.resource} interference confirmed ({evidence}); likely culprits: {culprits}")


def interference_task(init: TaskInit) -> Callable[[], Awaitable[None]]:
    settings = parse_interference(init.args, init.key_path)
    agent = metrics_agent(init)
    task = InterferenceTask(settings, agent.tsdb, agent.pods)
    task.set_event_sink(functools.partial(_verdict_event, agent.events))
    init.provide(task)  # the interference QoS strategy reads its verdicts
    init.add_explainer("interference", task.explain)
    if init.registry is not None:
        init.registry.register(task.gauges(agent.settings.node_name))
    log.info("interference_analyser", interval=settings.interval, confirm_after=settings.confirm_after)
    return task.run


def validate(init: TaskInit) -> InterferenceSettings:
    settings = parse_interference(init.args, init.key_path)
    validated_metrics(init)  # the core refuses a config without it; this names the task when called alone
    return settings


interference_task.validate = validate  # type: ignore[attr-defined]
interference_task.needs = (METRICS_TASK,)  # type: ignore[attr-defined]  # built after it, whatever the YAML order
