"""The prediction loop of the metrics agent: restore, train every minute, checkpoint, and
the Prod reclaimable estimate for NodeMetric and Prometheus.

Training, the estimate and the checkpoint write run in a worker thread; the loop only
waits. Inputs of the estimate: the pod views (class), kubelet's pods (requests and
creation time; without kubelet the requests are 0, so nothing is reclaimable), the Node's
capacity (else the store's CPU count and MemTotal).

Prometheus (labels as koordlet's ``metrics/prediction.go``, ``unit`` core | byte):
``koordlet_node_predicted_resource_reclaimable{node,predictor,resource,unit}`` per
predictor (``podReclaimablePredictor``, ``priorityReclaimablePredictor``, ``minPredictor``)
and ``koordlet_node_predicted_resource_peak{node,predictor,resource,unit}`` (the
``prodPeakMetric``, predictor ``podReclaimablePredictor``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import structlog
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector as PromCollector

from metrics.analysis.prediction import (
    PeakPredictor,
    PodDemand,
    PredictionSettings,
    Reclaimable,
    Resources,
    prod_reclaimable,
)
from metrics.informer.states import StatesInformer
from metrics.model import NO_LABELS, NODE_CPU_CAPACITY, NODE_MEMORY_TOTAL, MetricReader, PodView

log = structlog.get_logger("metrics.analysis.predictor_task")

RECLAIMABLE: Final = "koordlet_node_predicted_resource_reclaimable"
PEAK: Final = "koordlet_node_predicted_resource_peak"
PEAK_PREDICTOR: Final = "podReclaimablePredictor"
_LABELS: Final = ["node", "predictor", "resource", "unit"]


class PredictionTask:
    def __init__(
        self, settings: PredictionSettings, checkpoint: Path | None, reader: MetricReader,
        pods: Callable[[], list[PodView]], informer: StatesInformer | None, *, clock: Callable[[], float] = time.time,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self.settings = settings
        self.predictor = PeakPredictor(settings, checkpoint)
        self._reader = reader
        self._pods = pods
        self._informer = informer
        self._clock = clock
        self._ready = ready
        self._latest: Reclaimable | None = None
        self._restored = False

    def latest(self) -> Reclaimable | None:
        """The estimate of the last training step (None before the first, or without a
        system model or a capacity). Before the first step after a restart: the estimate
        from the restored checkpoint, once the pods are known (``ready``), so the first
        NodeMetric after a restart carries the prediction rather than nulling it for a
        training interval (computed once, by the first caller: a reporter's worker thread)."""
        if self._latest is None and self._restored and (self._ready is None or self._ready()):
            self._restored = False
            self._latest = self.estimate(self._pods(), self._clock())
        return self._latest

    async def run(self) -> None:
        self._restored = await asyncio.to_thread(self.predictor.restore, self._clock()) > 0
        try:
            while True:
                await asyncio.sleep(self.settings.training_interval)
                await asyncio.to_thread(self.step, self._pods(), self._clock())
        finally:
            await asyncio.to_thread(self._save, self._clock())

    def step(self, pods: list[PodView], now: float) -> Reclaimable | None:
        """Train, estimate, and checkpoint when due (worker thread)."""
        self.predictor.train(self._reader, pods, now)
        self._latest = self.estimate(pods, now)
        if now - self.predictor.saved_at >= self.settings.checkpoint_interval:
            self._save(now)
        return self._latest

    def _save(self, now: float) -> None:
        if self.predictor.trained_at == 0.0:
            return  # nothing learnt since start: keep the file as it is
        try:
            self.predictor.save(now)
        except OSError as exc:
            log.error("prediction_checkpoint_failed", path=str(self.predictor.checkpoint), error=str(exc))
        else:
            log.info("prediction_checkpoint_saved", path=str(self.predictor.checkpoint),
                     models=len(self.predictor.models))

    def demands(self, pods: list[PodView]) -> list[PodDemand]:
        kubelet = self._informer.pods() if self._informer is not None else {}
        out: list[PodDemand] = []
        for pod in pods:
            k = kubelet.get(pod.uid)
            out.append(PodDemand(pod.uid, pod.priority_class, k.cpu_request if k else 0.0,
                                 k.memory_request if k else 0.0, k.created if k else None))
        return out

    def capacity(self, now: float) -> Resources | None:
        node = self._informer.node_capacity() if self._informer is not None else None
        if node is not None:
            return float(node[0]), float(node[1])
        cpu = self._reader.last(NODE_CPU_CAPACITY, NO_LABELS, max_age=600, now=now)
        memory = self._reader.last(NODE_MEMORY_TOTAL, NO_LABELS, max_age=600, now=now)
        return None if cpu is None or memory is None else (cpu.value, memory.value)

    def estimate(self, pods: list[PodView], now: float) -> Reclaimable | None:
        capacity = self.capacity(now)
        if capacity is None:
            return None
        predictor = self.predictor

        def first_seen(key: str) -> float | None:
            model = predictor.model(key)
            return None if model is None else model.first_seen

        return prod_reclaimable(predictor.prediction, first_seen, self.demands(pods), capacity, now, self.settings)

    def explain(self) -> dict[str, Any]:
        latest = self._latest
        return {"models": len(self.predictor.models), "trained_at": self.predictor.trained_at,
                "checkpoint": str(self.predictor.checkpoint), "saved_at": self.predictor.saved_at,
                "estimate": latest.as_dict() if latest is not None else None}

    def gauges(self, node: str) -> PromCollector:
        return _Gauges(self, node)


class _Gauges(PromCollector):
    def __init__(self, task: PredictionTask, node: str) -> None:
        self._task = task
        self._node = node

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return self._families(None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        return self._families(self._task.latest())

    def _families(self, latest: Reclaimable | None) -> Iterator[GaugeMetricFamily]:
        reclaimable = GaugeMetricFamily(RECLAIMABLE, "The predicted reclaimable resources of the node",
                                        labels=_LABELS)
        peak = GaugeMetricFamily(PEAK, "The predicted peak of the Prod resources of the node", labels=_LABELS)
        if latest is not None:
            for predictor, value in latest.by_predictor.items():
                self._add(reclaimable, predictor, value)
            self._add(peak, PEAK_PREDICTOR, latest.peak)
        yield reclaimable
        yield peak

    def _add(self, family: GaugeMetricFamily, predictor: str, value: Resources) -> None:
        family.add_metric([self._node, predictor, "cpu", "core"], value[0])
        family.add_metric([self._node, predictor, "memory", "byte"], value[1])
