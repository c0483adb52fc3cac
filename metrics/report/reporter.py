"""Reports the NodeMetric status: to the API server when connected, always on the
loopback endpoint (``/apis/nodemetric``, mounted by the agent).

The report interval is the NodeMetric's ``reportIntervalSeconds`` when the informer
has the CR, else the default policy's. Building reads a window of the store, so it
runs off the event loop; so does the PATCH.

A document without any node usage (no samples yet, e.g. right after the first start)
is served but never sent: it would overwrite the last good status with an empty one.
Nor is one sent before the NodeMetric was listed (its spec says how to aggregate; koordlet
waits for its informer's sync too) or before the agent's first pod listing (``ready``):
right after a restart the first report went out 0.6 s early with the default policy and
an empty ``podsMetric``. ``run`` waits for both, at most one default report interval.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import structlog

from metrics.analysis.prediction import Reclaimable
from metrics.informer.kubetypes import Kind, KubeError
from metrics.informer.states import StatesInformer
from metrics.model import MetricReader, PodView
from metrics.report.nodemetric import WITH_HOT_PAGE_CACHE, CollectPolicy, build_status, status_merge_patch
from runtimeproxy import heap

if TYPE_CHECKING:  # the API client: imported only when configured
    from metrics.informer.kubeclient import KubeClient

log = structlog.get_logger("metrics.report.reporter")

JSON = "application/json"
#: The loopback document is rebuilt on request when older than this (seconds).
ROUTE_MAX_AGE = 5.0


def _json(doc: object) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


class NodeMetricReporter:
    def __init__(
        self,
        reader: MetricReader,
        pods: Callable[[], list[PodView]],
        informer: StatesInformer | None,
        kube: KubeClient | None,
        policy_default: CollectPolicy | None = None,
        *,
        clock: Callable[[], float] = time.time,
        prediction: Callable[[], Reclaimable | None] | None = None,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self._reader = reader
        self._pods = pods
        self._informer = informer
        self._kube = kube
        self._default = policy_default or CollectPolicy()
        self._clock = clock
        self._prediction = prediction
        self._ready = ready
        self._deferred = ""
        self._latest: tuple[dict[str, Any], bytes] | None = None
        self._built_at = 0.0
        self._problems: set[str] = set()
        self._last_send_problem = ""
        self.reports_sent = 0

    def policy(self) -> CollectPolicy:
        """The NodeMetric's policy when known and valid, else the default (bad spec logged once)."""
        spec = self._informer.nodemetric_spec() if self._informer is not None and self._kube is not None else None
        if spec is None:
            return self._default
        try:
            return CollectPolicy.from_spec(spec)
        except ValueError as exc:
            self._once("nodemetric_spec_ignored", reason=str(exc))
            return self._default

    def _once(self, event: str, **kw: Any) -> None:
        key = f"{event}:{sorted(kw.items())}"
        if key not in self._problems:
            self._problems.add(key)
            log.warning(event, **kw)

    def latest(self) -> Mapping[str, Any] | None:
        return None if self._latest is None else self._latest[0]

    async def report_once(self) -> CollectPolicy:
        """Build one document (and send it when connected); returns the policy used."""
        policy = self.policy()
        if policy.memory_policy == WITH_HOT_PAGE_CACHE:
            self._once("hot_page_cache_unavailable", reported_as="usageWithoutPageCache")
        doc = await asyncio.to_thread(self._build, self._pods(), policy)
        self._latest, self._built_at = (doc, _json(doc)), self._clock()
        if self._kube is not None:
            await self._send(self._kube, doc)
        return policy

    def _build(self, pods: list[PodView], policy: CollectPolicy) -> dict[str, Any]:
        """In a worker thread. The build decodes up to 30 minutes of node and pod samples
        (as arrays, ``metrics.store.tsdbcols``) and frees them at once; trimmed after (110 pods,
        4 builds: RSS 63.7-64.3 MiB from 62.8)."""
        prediction = self._prediction() if self._prediction is not None else None
        doc = build_status(self._reader, pods, policy, self._clock(), prediction)
        heap.trim()
        return doc

    def not_ready(self) -> str:
        """Why a report may not be sent yet ("" when it may)."""
        if self._kube is not None and self._informer is not None and not self._informer.has_synced(Kind.NODEMETRIC):
            return "NodeMetric spec not read yet"
        if self._ready is not None and not self._ready():
            return "pods not listed yet"
        return ""

    async def _send(self, kube: KubeClient, doc: dict[str, Any]) -> None:
        if reason := self.not_ready():
            if reason != self._deferred:
                self._deferred = reason
                log.info("nodemetric_report_deferred", reason=reason)
            return
        if not doc["nodeMetric"]["nodeUsage"]["resources"]:
            self._send_problem("nodemetric_not_sent", "no node usage samples yet")
            return
        try:
            sent = await asyncio.to_thread(kube.update_nodemetric_status, status_merge_patch(doc))
        except KubeError as exc:
            self._send_problem("nodemetric_report_failed", str(exc))
            return
        if sent:
            self.reports_sent += 1
            if self._last_send_problem:
                self._last_send_problem = ""
                log.info("nodemetric_report_recovered")

    def _send_problem(self, event: str, reason: str) -> None:
        # One line per distinct problem in a row, not one per report interval.
        if self._last_send_problem != f"{event}:{reason}":
            self._last_send_problem = f"{event}:{reason}"
            log.warning(event, reason=reason)

    async def run(self, poll: float = 0.05) -> None:
        """Report every interval until cancelled; the first once ready (or after one
        default interval: then deferred until the next while still not ready)."""
        deadline = time.monotonic() + self._default.report_interval
        # Readiness comes from watch threads and the pod tick: polled, not signalled.
        while self.not_ready() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(poll)
        while True:
            policy = await self.report_once()
            await asyncio.sleep(policy.report_interval)

    async def route(self, query: dict[str, str]) -> tuple[int, str, bytes]:
        """GET handler: the document as JSON, rebuilt (not sent) when the last one is older
        than ``ROUTE_MAX_AGE`` — without a cluster this endpoint is the only reader, and a
        60 s old document would hide pods started since."""
        if self._latest is None or self._clock() - self._built_at > ROUTE_MAX_AGE:
            doc = await asyncio.to_thread(self._build, self._pods(), self.policy())
            self._latest, self._built_at = (doc, _json(doc)), self._clock()
        return 200, JSON, self._latest[1]
