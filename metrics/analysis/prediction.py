"""Peak prediction and the Prod reclaimable estimate, as koordlet's ``pkg/koordlet/prediction``.

Every ``training_interval`` (1 min) the predictor reads the mean usage over the last
interval from the store and adds it to decaying exponential histograms
(``metrics.analysis.histogram``), one CPU and one memory histogram per model:

- each pod (by UID), keyed ``pod/<uid>``;
- each priority class (the sum of its pods' usage), keyed ``priority/<class>`` (``none``
  for pods without one);
- all pods (``allpods``), the node (``node``) and the system (``sys`` = node - all pods,
  floored at 0).

CPU: buckets from 0.025 to 1024 cores; memory: 5 MiB to 2 TiB; both grow 5 % per
bucket, minimum weight 0.1; half-life 12 h (CPU), 24 h (memory). A model not updated
for ``model_ttl`` (30 min) is dropped (a vanished pod). The models are checkpointed to
one JSON file (written atomically) and restored at start; a checkpoint that cannot be
read is one logged error and a cold start.

``prod_reclaimable`` is koordlet's ``minPredictor`` over two Prod predictors (pods of
class ``koord-prod`` or without a class); the safety margin (10 %) scales every peak:

- pod predictor: a pod younger than ``cold_start`` (24 h; or without a model) counts its
  request as *unpredicted*; any other pod has peak = (p95 CPU, p98 memory) x 1.1 and
  reclaimable = max(request - peak, 0). Result = min(capacity - sum(peaks), sum(reclaimable)).
- priority predictor: unreclaimable = (sys + each Prod class) p95 CPU / p98 memory x 1.1;
  result = min(capacity - unreclaimable, max(sum(Prod requests) - unreclaimable, 0)).
- peak (``prodPeakMetric``): system peak + the pod predictor's peaks + the unpredicted
  requests, all with the margin: what Prod can use, system included.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import structlog

from metrics.analysis.histogram import BucketOptions, DecayingHistogram
from metrics.model import (
    NO_LABELS,
    NODE_CPU_USAGE,
    NODE_MEMORY_USED,
    POD_CPU_USAGE,
    POD_MEMORY_USED,
    POD_UID,
    Labels,
    MetricReader,
    PodView,
    labels,
)
from runtimeproxy.config.configvalues import Section, boolean, parse_duration, string
from runtimeproxy.ops.privatefiles import write_private

log = structlog.get_logger("metrics.analysis.prediction")

MIB: Final = 2**20
CPU_OPTIONS: Final = BucketOptions(max_value=1024.0, first=0.025, ratio=1.05, epsilon=0.1)
MEMORY_OPTIONS: Final = BucketOptions(max_value=2.0 * 2**40, first=5.0 * MIB, ratio=1.05, epsilon=0.1)
CPU_HALF_LIFE: Final = 12 * 3600.0
MEMORY_HALF_LIFE: Final = 24 * 3600.0
PERCENTILES: Final = {"p60": 0.60, "p90": 0.90, "p95": 0.95, "p98": 0.98, "max": 1.0}
NODE: Final = "node"
SYSTEM: Final = "sys"
ALL_PODS: Final = "allpods"
#: Priority classes whose pods are Prod for reclaiming (koordlet: prod and none).
PROD_CLASSES: Final = ("koord-prod", "")
CHECKPOINT_VERSION: Final = 1


def pod_key(uid: str) -> str:
    return f"pod/{uid}"


def class_key(priority_class: str) -> str:
    return f"priority/{priority_class or 'none'}"


@dataclass(frozen=True, slots=True)
class PredictionSettings:
    """``tasks.metrics.prediction``."""

    enabled: bool = True
    training_interval: float = 60.0
    checkpoint_interval: float = 600.0
    model_ttl: float = 1800.0
    cold_start: float = 24 * 3600.0
    safety_margin_percent: int = 10
    #: Empty: next to the metrics db (``<db>.prediction.json``).
    checkpoint: str = ""


def parse_prediction(raw: object, key_path: str) -> PredictionSettings:
    """``tasks.metrics.prediction``, parsed next to the predictor it configures."""
    args = Section.of(raw, key_path)
    base = PredictionSettings()
    args.reject_unknown(frozenset(PredictionSettings.__slots__))
    margin = args.raw.get("safety_margin_percent", base.safety_margin_percent)
    if isinstance(margin, bool) or not isinstance(margin, int) or not 0 <= margin <= 100:
        raise args.fail("safety_margin_percent", margin, "must be an integer from 0 to 100")
    settings = PredictionSettings(
        enabled=args.get("enabled", base.enabled, boolean),
        training_interval=args.get("training_interval", base.training_interval, parse_duration),
        checkpoint_interval=args.get("checkpoint_interval", base.checkpoint_interval, parse_duration),
        model_ttl=args.get("model_ttl", base.model_ttl, parse_duration),
        cold_start=args.get("cold_start", base.cold_start, parse_duration),
        safety_margin_percent=margin,
        checkpoint=args.get("checkpoint", base.checkpoint, string),
    )
    if settings.model_ttl <= settings.training_interval:
        raise args.fail("model_ttl", args.raw.get("model_ttl", f"{settings.model_ttl:g}s (the default)"),
                        f"must be longer than training_interval ({settings.training_interval:g}s)")
    return settings


@dataclass(slots=True)
class Model:
    cpu: DecayingHistogram
    memory: DecayingHistogram
    first_seen: float
    last_update: float

    @classmethod
    def new(cls, now: float) -> Model:
        return cls(DecayingHistogram(CPU_OPTIONS, CPU_HALF_LIFE), DecayingHistogram(MEMORY_OPTIONS, MEMORY_HALF_LIFE),
                   now, now)

    def add(self, cpu: float | None, memory: float | None, now: float) -> None:
        if cpu is not None:
            self.cpu.add(cpu, 1.0, now)
        if memory is not None:
            self.memory.add(memory, 1.0, now)
        self.last_update = now

    def ready(self) -> bool:
        return not (self.cpu.empty() or self.memory.empty())

    def percentiles(self) -> dict[str, tuple[float, float]]:
        """``{"p95": (cores, bytes), ...}``."""
        return {name: (self.cpu.percentile(p), self.memory.percentile(p)) for name, p in PERCENTILES.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"cpu": self.cpu.to_dict(), "memory": self.memory.to_dict(), "first_seen": self.first_seen,
                "last_update": self.last_update}

    @classmethod
    def from_dict(cls, raw: object) -> Model:
        if not isinstance(raw, dict):
            raise ValueError(f"model: not a mapping (got {type(raw).__name__})")
        first, last = raw.get("first_seen"), raw.get("last_update")
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (first, last)):
            raise ValueError("model: first_seen and last_update must be numbers")
        assert isinstance(first, int | float) and isinstance(last, int | float)
        return cls(DecayingHistogram.from_dict(raw.get("cpu"), CPU_OPTIONS, CPU_HALF_LIFE),
                   DecayingHistogram.from_dict(raw.get("memory"), MEMORY_OPTIONS, MEMORY_HALF_LIFE),
                   float(first), float(last))


class PeakPredictor:
    """The models; ``train`` and ``save`` run in a worker thread, readers take ``snapshot``."""

    def __init__(self, settings: PredictionSettings, checkpoint: Path | None) -> None:
        self.settings = settings
        self.checkpoint = checkpoint
        self.models: dict[str, Model] = {}
        self.trained_at = 0.0
        self.saved_at = 0.0
        self._snapshot: Mapping[str, Model] = {}

    # --- training ------------------------------------------------------------------
    def train(self, reader: MetricReader, pods: Sequence[PodView], now: float) -> int:
        """One training step from the mean usage over the last interval; returns the number
        of models updated. Pods without samples in the interval are skipped."""
        start = now - self.settings.training_interval
        series: list[tuple[str, Labels]] = [(NODE_CPU_USAGE, NO_LABELS), (NODE_MEMORY_USED, NO_LABELS)]
        series += [(m, labels(**{POD_UID: p.uid})) for p in pods for m in (POD_CPU_USAGE, POD_MEMORY_USED)]
        aggs = reader.aggregate_many(series, start, now)

        def avg(metric: str, lbl: Labels) -> float | None:
            agg = aggs.get((metric, lbl))
            return agg.avg if agg is not None and agg.count > 0 and math.isfinite(agg.avg) else None

        usages: dict[str, tuple[float | None, float | None]] = {}
        sums: dict[str, list[float]] = {}
        all_cpu: float | None = 0.0
        all_memory: float | None = 0.0
        for pod in pods:
            lbl = labels(**{POD_UID: pod.uid})
            cpu, memory = avg(POD_CPU_USAGE, lbl), avg(POD_MEMORY_USED, lbl)
            if cpu is None and memory is None:
                continue
            usages[pod_key(pod.uid)] = (cpu, memory)
            total = sums.setdefault(class_key(pod.priority_class), [0.0, 0.0])
            total[0] += cpu or 0.0
            total[1] += memory or 0.0
            all_cpu = None if all_cpu is None or cpu is None else all_cpu + cpu
            all_memory = None if all_memory is None or memory is None else all_memory + memory
        for key, (cpu_sum, memory_sum) in sums.items():
            usages[key] = (cpu_sum, memory_sum)
        node_cpu, node_memory = avg(NODE_CPU_USAGE, NO_LABELS), avg(NODE_MEMORY_USED, NO_LABELS)
        if node_cpu is not None or node_memory is not None:
            usages[NODE] = (node_cpu, node_memory)
            usages[ALL_PODS] = (all_cpu, all_memory)
            usages[SYSTEM] = (_minus(node_cpu, all_cpu), _minus(node_memory, all_memory))
        for key, (cpu, memory) in usages.items():
            model = self.models.get(key)
            if model is None:
                model = self.models[key] = Model.new(now)
            model.add(cpu, memory, now)
        self.gc(now)
        self.trained_at = now
        self._snapshot = dict(self.models)
        return len(usages)

    def gc(self, now: float) -> list[str]:
        """Drop the models not updated for ``model_ttl`` (vanished pods, classes without pods)."""
        dropped = [k for k, m in self.models.items() if now - m.last_update > self.settings.model_ttl]
        for key in dropped:
            del self.models[key]
        return dropped

    def model(self, key: str) -> Model | None:
        return self._snapshot.get(key)

    def prediction(self, key: str) -> dict[str, tuple[float, float]] | None:
        model = self.model(key)
        return model.percentiles() if model is not None and model.ready() else None

    # --- checkpoints ---------------------------------------------------------------
    def save(self, now: float) -> None:
        """Write every model to ``checkpoint`` atomically (temp file, fsync, rename)."""
        if self.checkpoint is None:
            return
        doc = {"version": CHECKPOINT_VERSION, "saved_at": now,
               "models": {k: m.to_dict() for k, m in self._snapshot.items()}}
        self.checkpoint.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_private(self.checkpoint, json.dumps(doc, separators=(",", ":")))  # 0600: state is private
        self.saved_at = now

    def restore(self, now: float) -> int:
        """Load the checkpoint (models past ``model_ttl`` dropped); 0 when there is none. A
        checkpoint that does not parse is logged once and ignored: a cold start."""
        if self.checkpoint is None or not self.checkpoint.exists():
            return 0
        try:
            raw = json.loads(self.checkpoint.read_text(encoding="utf-8"))
            if not isinstance(raw, dict) or raw.get("version") != CHECKPOINT_VERSION:
                raise ValueError(f"not a version-{CHECKPOINT_VERSION} prediction checkpoint")
            models_raw = raw.get("models")
            if not isinstance(models_raw, dict):
                raise ValueError("models: not a mapping")
            models = {str(k): Model.from_dict(v) for k, v in models_raw.items()}
        except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            log.error("prediction_checkpoint_unreadable", path=str(self.checkpoint), error=str(exc),
                      applied="cold start")
            return 0
        self.models = models
        self.gc(now)
        self._snapshot = dict(self.models)
        log.info("prediction_checkpoint_restored", path=str(self.checkpoint), models=len(self.models))
        return len(self.models)


def _minus(total: float | None, part: float | None) -> float | None:
    return None if total is None or part is None else max(total - part, 0.0)


# --- Prod reclaimable ----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PodDemand:
    """What the reclaimable predictors need of a pod: its class, requests and age."""

    uid: str
    priority_class: str
    cpu_request: float  # cores
    memory_request: float  # bytes
    #: Unix time the pod was created (kubelet's ``metadata.creationTimestamp``), None: unknown.
    created: float | None = None


Resources = tuple[float, float]  # (cores, bytes)


@dataclass(frozen=True, slots=True)
class Reclaimable:
    """The result and every input that made it (for ``explain``)."""

    reclaimable: Resources
    peak: Resources
    by_predictor: Mapping[str, Resources]
    unpredicted: Resources
    cold_pods: tuple[str, ...] = ()
    inputs: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"reclaimable": {"cpu": self.reclaimable[0], "memory": self.reclaimable[1]},
                "peak": {"cpu": self.peak[0], "memory": self.peak[1]},
                "by_predictor": {k: {"cpu": v[0], "memory": v[1]} for k, v in self.by_predictor.items()},
                "unpredicted": {"cpu": self.unpredicted[0], "memory": self.unpredicted[1]},
                "cold_pods": list(self.cold_pods), **self.inputs}


def _peak_of(prediction: Mapping[str, tuple[float, float]], ratio: float) -> Resources:
    return prediction["p95"][0] * ratio, prediction["p98"][1] * ratio


def _add(a: Resources, b: Resources) -> Resources:
    return a[0] + b[0], a[1] + b[1]


def _floor0(a: Resources) -> Resources:
    return max(a[0], 0.0), max(a[1], 0.0)


def _min(a: Resources, b: Resources) -> Resources:
    return min(a[0], b[0]), min(a[1], b[1])


def _sub(a: Resources, b: Resources) -> Resources:
    return a[0] - b[0], a[1] - b[1]


def prod_reclaimable(
    predict: Callable[[str], Mapping[str, tuple[float, float]] | None],
    first_seen: Callable[[str], float | None],
    pods: Iterable[PodDemand],
    capacity: Resources,
    now: float,
    settings: PredictionSettings,
) -> Reclaimable | None:
    """koordlet's min of the pod and priority predictors for Prod (see the module doc);
    None while the system model has no prediction yet (nothing is reported then)."""
    ratio = (100 + settings.safety_margin_percent) / 100
    system = predict(SYSTEM)
    if system is None:
        return None
    zero: Resources = (0.0, 0.0)
    unreclaimable, reclaimable, unpredicted, requests = zero, zero, zero, zero
    cold: list[str] = []
    for pod in pods:
        if pod.priority_class not in PROD_CLASSES:
            continue
        request: Resources = (pod.cpu_request, pod.memory_request)
        requests = _add(requests, request)
        key = pod_key(pod.uid)
        born = pod.created if pod.created is not None else first_seen(key)
        prediction = predict(key)
        if born is None or now - born <= settings.cold_start or prediction is None:
            unpredicted = _add(unpredicted, request)
            cold.append(pod.uid)
            continue
        peak = _peak_of(prediction, ratio)
        unreclaimable = _add(unreclaimable, peak)
        reclaimable = _add(reclaimable, _floor0(_sub(request, peak)))
    by_pod = _min(_floor0(_sub(capacity, unreclaimable)), reclaimable)
    # priority predictor: system + the Prod classes' own models
    class_peak = _peak_of(system, 1.0)
    for pclass in PROD_CLASSES:
        prediction = predict(class_key(pclass))
        if prediction is not None:
            class_peak = _add(class_peak, _peak_of(prediction, 1.0))
    class_peak = (class_peak[0] * ratio, class_peak[1] * ratio)
    by_priority = _min(_floor0(_sub(capacity, class_peak)), _floor0(_sub(requests, class_peak)))
    result = _min(by_pod, by_priority)
    peak = _add(_add(_peak_of(system, ratio), unreclaimable), unpredicted)
    return Reclaimable(
        reclaimable=result, peak=peak, unpredicted=unpredicted, cold_pods=tuple(cold),
        by_predictor={"podReclaimablePredictor": by_pod, "priorityReclaimablePredictor": by_priority,
                      "minPredictor": result},
        inputs={"capacity": {"cpu": capacity[0], "memory": capacity[1]},
                "prod_requests": {"cpu": requests[0], "memory": requests[1]},
                "safety_margin_percent": settings.safety_margin_percent},
    )


