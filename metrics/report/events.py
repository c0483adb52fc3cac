"""Kubernetes Events on the Pod or the Node, as operators expect from ``kubectl describe``.

What becomes an Event (issue 16 §4): evictions (``evictPodSuccess`` / ``evictPodFail``,
koordlet's reasons, on the Pod), a refused NodeSLO (``NodeSLORejected``, on the Node:
the YAML rules apply instead) and a QoS write that cannot be applied
(``QoSWriteFailed``, on the Node; the BE suppression's cgroup writes mostly).

``record`` never blocks and never raises: it may be called on the event loop or in any
thread. A single daemon worker thread sends (the blocking HTTP stays off the loop),
through a bounded queue (full: the event is dropped and counted).

Deduplicated: the same object + type + reason + message within ``window`` seconds
(default 10 minutes) is not sent again but counted; the next one after the window is
sent as a new Event whose ``count`` is 1 + the occurrences suppressed since the last
one sent, ``firstTimestamp`` the first of those. (client-go aggregates by PATCHing the
existing Event's count; a new object per window keeps this to one create call, and
``kubectl describe`` shows both the same.)

Rate-limited: a token bucket (``burst`` events, refilled at ``qps`` per second, client-go's
defaults 25 / 1/300 s per object are for controllers; one node needs few) over all
events; above it events are dropped and counted (logged once per burst).

Without a cluster (``sink`` None) every call is a no-op.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

import structlog

log = structlog.get_logger("metrics.report.events")

COMPONENT: Final = "koordlet"  # source.component: what kubectl describe shows as "From"
MAX_MESSAGE: Final = 1024  # the API server refuses longer event messages
WARNING: Final = "Warning"
NORMAL: Final = "Normal"


class EventSink(Protocol):
    """What sends an Event (KubeClient.create_event)."""

    def create_event(self, event: Mapping[str, Any]) -> None: ...


@dataclass(frozen=True, slots=True)
class ObjectRef:
    kind: str  # Pod | Node
    name: str
    namespace: str = ""
    uid: str = ""


def _rfc3339(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


@dataclass
class _Seen:
    last_sent: float
    first_unsent: float = 0.0
    unsent: int = 0


class EventRecorder:
    def __init__(
        self,
        sink: EventSink | None,
        node_name: str,
        *,
        window: float = 600.0,
        qps: float = 0.5,
        burst: int = 20,
        queue_size: int = 100,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if window < 0 or qps <= 0 or burst < 1 or queue_size < 1:
            raise ValueError(f"bad event recorder settings: window={window} qps={qps} burst={burst} "
                             f"queue_size={queue_size}")
        self._sink = sink
        self.node_name = node_name
        self._window = window
        self._qps = qps
        self._burst = float(burst)
        self._tokens = float(burst)
        self._refilled = monotonic()
        self._clock = clock
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._seen: dict[tuple[ObjectRef, str, str, str], _Seen] = {}
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(queue_size)
        self._worker: threading.Thread | None = None
        self._dropping = False
        self._accepted = 0
        #: Counters for explain and tests.
        self.sent = 0
        self.suppressed = 0
        self.dropped = 0
        self.failed = 0

    @property
    def enabled(self) -> bool:
        return self._sink is not None

    def node(self) -> ObjectRef:
        # kubelet's node reference carries the node name as its UID; kubectl describe node finds it.
        return ObjectRef("Node", self.node_name, "", self.node_name)

    @staticmethod
    def pod(namespace: str, name: str, uid: str = "") -> ObjectRef:
        return ObjectRef("Pod", name, namespace, uid)

    def record(self, ref: ObjectRef, type_: str, reason: str, message: str) -> bool:
        """Queue an Event; True when queued (False: no cluster, deduplicated, rate-limited
        or the queue is full)."""
        if self._sink is None:
            return False
        message = message[:MAX_MESSAGE]
        now, mono = self._clock(), self._monotonic()
        key = (ref, type_, reason, message)
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and mono - seen.last_sent < self._window:
                if not seen.unsent:
                    seen.first_unsent = now
                seen.unsent += 1
                self.suppressed += 1
                return False
            if not self._take_token(mono):
                self.dropped += 1
                if not self._dropping:
                    self._dropping = True
                    log.warning("event_rate_limited", reason=reason, object=f"{ref.kind}/{ref.name}")
                return False
            self._dropping = False
            count = 1 + (seen.unsent if seen is not None else 0)
            first = seen.first_unsent if seen is not None and seen.unsent else now
            self._seen[key] = _Seen(last_sent=mono)
            self._forget_old(mono)
        event = self._event(ref, type_, reason, message, count, first, now)
        with self._lock:
            try:
                self._queue.put_nowait(event)
            except queue.Full:
                self.dropped += 1
                log.warning("event_dropped", reason=reason, object=f"{ref.kind}/{ref.name}", cause="queue full")
                return False
            self._accepted += 1
        self._start()
        return True

    def _take_token(self, mono: float) -> bool:
        self._tokens = min(self._burst, self._tokens + (mono - self._refilled) * self._qps)
        self._refilled = mono
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def _forget_old(self, mono: float) -> None:
        if len(self._seen) > 1000:
            self._seen = {k: v for k, v in self._seen.items() if mono - v.last_sent < self._window}

    def _event(self, ref: ObjectRef, type_: str, reason: str, message: str, count: int, first: float,
               now: float) -> dict[str, Any]:
        namespace = ref.namespace or "default"
        involved = {"apiVersion": "v1", "kind": ref.kind, "name": ref.name}
        if ref.namespace:
            involved["namespace"] = ref.namespace
        if ref.uid:
            involved["uid"] = ref.uid
        return {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{ref.name}.", "namespace": namespace},
            "involvedObject": involved, "reason": reason, "message": message, "type": type_,
            "source": {"component": COMPONENT, "host": self.node_name},
            "reportingComponent": COMPONENT, "reportingInstance": self.node_name,
            "firstTimestamp": _rfc3339(first), "lastTimestamp": _rfc3339(now), "count": count,
        }

    def _start(self) -> None:
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="events", daemon=True)
                self._worker.start()

    def _run(self) -> None:
        sink = self._sink
        assert sink is not None
        while (event := self._queue.get()) is not None:
            try:
                sink.create_event(event)
            except Exception as exc:  # noqa: BLE001 - any client failure: logged, never fatal
                with self._lock:
                    self.failed += 1
                log.warning("event_not_recorded", reason=event["reason"], error=f"{type(exc).__name__}: {exc}",
                            object=f"{event['involvedObject']['kind']}/{event['involvedObject']['name']}")
                continue
            with self._lock:
                self.sent += 1
            log.info("event_recorded", reason=event["reason"], type=event["type"], count=event["count"],
                     object=f"{event['involvedObject']['kind']}/{event['involvedObject']['name']}")

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued event was handled (sent or failed); False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self.sent + self.failed >= self._accepted:
                    return True
            time.sleep(0.01)
        return False

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to ``timeout``), then stop the worker."""
        worker = self._worker
        if worker is None:
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        worker.join(timeout)

    def explain(self) -> dict[str, Any]:
        with self._lock:
            return {"enabled": self.enabled, "sent": self.sent, "suppressed": self.suppressed,
                    "dropped": self.dropped, "failed": self.failed, "window_seconds": self._window}
