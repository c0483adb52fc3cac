"""An Evictor that records each eviction as a Kubernetes Event on the pod.

koordlet's reasons: ``evictPodSuccess`` and ``evictPodFail`` (both Warning), message
``evict Pod:<name>, reason: <why>``. Wraps whichever evictor is configured (CRI or the
Eviction API), so the QoS manager does not change; without a cluster the recorder is a no-op.
"""

from __future__ import annotations

from metrics.model import PodView
from metrics.qos.evict import EvictionError, Evictor
from metrics.report.events import WARNING, EventRecorder

SUCCESS = "evictPodSuccess"
FAIL = "evictPodFail"


class RecordingEvictor:
    def __init__(self, inner: Evictor, events: EventRecorder) -> None:
        self.inner = inner
        self._events = events

    async def evict(self, pod: PodView, reason: str) -> None:
        ref = self._events.pod(pod.namespace, pod.name, pod.uid)
        try:
            await self.inner.evict(pod, reason)
        except EvictionError as exc:
            self._events.record(ref, WARNING, FAIL, f"evict Pod:{pod.name}, reason: {reason}, failed: {exc}")
            raise
        self._events.record(ref, WARNING, SUCCESS, f"evict Pod:{pod.name}, reason: {reason}")
