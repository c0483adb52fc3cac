"""External advisors: third-party Prometheus endpoints scraped into the store.

``tasks.metrics.advisors`` lists endpoints (node-exporter, a kernel tracing agent...)
with a URL, an interval, an allow-list of metric names and how their labels map to
ours. Each advisor is one collector (``advisor:<name>``) in the agent's tick; its
HTTP fetch and parse run in the advisor's own thread, so a slow or hanging endpoint
never delays the node and pod ticks that share the agent's worker: a tick hands over
the last completed scrape (at most one interval old) and starts the next one.

A scrape reads at most ``max_bytes`` within ``timeout`` (a whole-request deadline,
not per read) and parses with prometheus_client's own text parser. Samples keep their
own name and labels, plus ``advisor=<name>`` (so they never collide with our series),
with the configured labels replaced by ours: ``pod_uid``, ``container_id`` (the
runtime prefix ``containerd://`` dropped), or ``pod_namespace`` + ``pod_name`` (and
``container_name``) looked up among the node's pods. An unreachable, failing, slow,
oversized or unparsable endpoint is a counted failure
(``koord_runtime_proxy_advisor_scrape_failures_total{advisor,reason}``) logged once
per change of state, never a crash.
"""

from __future__ import annotations

import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector as PromCollector

from metrics.model import CONTAINER_ID, POD_UID, PodView, Sample
from runtimeproxy.config.configvalues import parse_duration, reject_unknown
from runtimeproxy.errors import PeerError
from runtimeproxy.hookapi import HookConfigError

log = structlog.get_logger("metrics.advisor")

ADVISOR_LABEL: Final = "advisor"
#: Our labels an advisor's labels can map to.
MAPPABLE: Final = ("pod_uid", "container_id", "pod_namespace", "pod_name", "container_name")
DEFAULT_TIMEOUT: Final = 5.0
DEFAULT_MAX_BYTES: Final = 4 * 2**20
_NAME: Final = re.compile(r"^[a-z0-9]([a-z0-9_-]{0,62})$")
_METRIC: Final = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL: Final = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_CHUNK: Final = 65536


@dataclass(frozen=True, slots=True)
class AdvisorSpec:
    """One entry of ``tasks.metrics.advisors``."""

    name: str
    url: str
    metrics: frozenset[str]
    interval: float = 15.0
    timeout: float = DEFAULT_TIMEOUT
    max_bytes: int = DEFAULT_MAX_BYTES
    #: Our label -> their label.
    labels: Mapping[str, str] = field(default_factory=dict)


def parse_advisors(raw: object, key_path: str) -> tuple[AdvisorSpec, ...]:
    """``advisors:`` -> specs; a bad entry is a ``HookConfigError`` naming the field."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise HookConfigError(key_path, raw, "must be a list of {name, url, interval, metrics, labels}")
    out: list[AdvisorSpec] = []
    for i, item in enumerate(raw):
        spec = _advisor(item, f"{key_path}[{i}]")
        if any(s.name == spec.name for s in out):
            raise HookConfigError(f"{key_path}[{i}].name", spec.name, "duplicate advisor name")
        out.append(spec)
    return tuple(out)


_KEYS: Final = frozenset({"name", "url", "interval", "timeout", "max_bytes", "metrics", "labels"})


def _advisor(item: object, where: str) -> AdvisorSpec:
    if not isinstance(item, Mapping):
        raise HookConfigError(where, item, "must be a mapping {name, url, interval, metrics, labels}")
    reject_unknown(item, _KEYS, f"{where}.")
    name = item.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise HookConfigError(f"{where}.name", name, "must be lower-case letters, digits, '-' or '_' (max 63)")
    url = item.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) < 10:
        raise HookConfigError(f"{where}.url", url, "must be an http:// or https:// URL")
    interval = parse_duration(item.get("interval", "15s"), f"{where}.interval")
    timeout = parse_duration(item.get("timeout", f"{min(interval, DEFAULT_TIMEOUT)}s"), f"{where}.timeout")
    if timeout > interval:
        raise HookConfigError(f"{where}.timeout", item.get("timeout"), f"must not exceed interval ({interval:g}s)")
    max_bytes = item.get("max_bytes", DEFAULT_MAX_BYTES)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise HookConfigError(f"{where}.max_bytes", max_bytes, "must be a positive integer (bytes)")
    metrics = item.get("metrics")
    if not isinstance(metrics, list) or not metrics:
        raise HookConfigError(f"{where}.metrics", metrics, "must be a non-empty list of metric names (allow-list)")
    for j, metric in enumerate(metrics):
        if not isinstance(metric, str) or not _METRIC.match(metric):
            raise HookConfigError(f"{where}.metrics[{j}]", metric, "must be a Prometheus metric name")
    labels = item.get("labels") or {}
    if not isinstance(labels, Mapping):
        raise HookConfigError(f"{where}.labels", labels, f"must be a mapping of ours ({', '.join(MAPPABLE)}) -> theirs")
    for ours, theirs in labels.items():
        if ours not in MAPPABLE:
            raise HookConfigError(f"{where}.labels.{ours}", theirs, f"unknown label (one of {', '.join(MAPPABLE)})")
        if not isinstance(theirs, str) or not _LABEL.match(theirs) or theirs == ADVISOR_LABEL:
            raise HookConfigError(f"{where}.labels.{ours}", theirs, "must be a Prometheus label name (not 'advisor')")
    if ("pod_namespace" in labels) != ("pod_name" in labels):
        raise HookConfigError(f"{where}.labels", dict(labels), "pod_namespace and pod_name map together")
    if "container_name" in labels and "pod_name" not in labels and "pod_uid" not in labels:
        raise HookConfigError(f"{where}.labels.container_name", labels["container_name"],
                              "needs pod_uid or pod_namespace + pod_name to find the container")
    return AdvisorSpec(name, url, frozenset(metrics), interval, timeout, max_bytes, dict(labels))


class ScrapeError(PeerError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason  # unreachable | timeout | http_status | too_large | unparsable
        self.detail = detail


#: (name, labels, value) of the allow-listed samples of one scrape.
Scraped = list[tuple[str, dict[str, str], float]]


def fetch(spec: AdvisorSpec) -> bytes:
    """The endpoint's body: at most ``max_bytes``, within ``timeout`` overall."""
    deadline = time.monotonic() + spec.timeout
    request = urllib.request.Request(spec.url, headers={"Accept": "text/plain;version=0.0.4",
                                                        "User-Agent": "koord-runtime-proxy"})
    try:
        with urllib.request.urlopen(request, timeout=spec.timeout) as response:
            chunks: list[bytes] = []
            size = 0
            while chunk := response.read1(_CHUNK):
                size += len(chunk)
                if size > spec.max_bytes:
                    raise ScrapeError("too_large", f"body larger than max_bytes ({spec.max_bytes})")
                if time.monotonic() > deadline:
                    raise ScrapeError("timeout", f"no complete answer within {spec.timeout:g}s")
                chunks.append(chunk)
            return b"".join(chunks)
    except urllib.error.HTTPError as exc:
        exc.close()  # it holds the response (and its socket)
        raise ScrapeError("http_status", f"HTTP {exc.code}") from None
    except TimeoutError:
        raise ScrapeError("timeout", f"no answer within {spec.timeout:g}s") from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise ScrapeError("timeout", f"no answer within {spec.timeout:g}s") from None
        raise ScrapeError("unreachable", str(exc.reason)[:200]) from None
    except OSError as exc:  # reset, refused mid-read, a malformed status line...
        raise ScrapeError("unreachable", str(exc)[:200]) from None


def parse(spec: AdvisorSpec, body: bytes) -> Scraped:
    """The allow-listed samples (by family or sample name); non-finite values dropped."""
    try:
        text = body.decode("utf-8")
        out: Scraped = []
        for family in text_string_to_metric_families(text):
            whole = family.name in spec.metrics
            for sample in family.samples:
                if (whole or sample.name in spec.metrics) and math.isfinite(sample.value):
                    out.append((sample.name, dict(sample.labels), float(sample.value)))
        return out
    except (ValueError, IndexError, KeyError, TypeError) as exc:  # the parser's errors on odd input
        raise ScrapeError("unparsable", f"{type(exc).__name__}: {str(exc)[:200]}") from None


class AdvisorCollector:
    """One advisor as a collector of the agent's tick."""

    def __init__(self, spec: AdvisorSpec) -> None:
        self.spec = spec
        self.name = f"advisor:{spec.name}"
        self.interval = spec.interval
        self._running: Future[Scraped] | None = None
        self._lock = threading.Lock()
        #: Failures by reason (the exported counter), the current state, the last scrape's size.
        self.failures: dict[str, int] = {}
        self.state = "pending"
        self.last_error = ""
        self.last_samples = 0

    def collect(self, now: float, pods: Sequence[PodView]) -> list[Sample]:
        """The last completed scrape's samples (mapped to ``pods``), then the next scrape started."""
        samples: list[Sample] = []
        running = self._running
        if running is not None:
            if not running.done():  # still within its timeout: nothing new this tick
                return []
            self._running = None
            try:
                samples = self._map(running.result(), pods)
                self._set_state("ok", "")
            except ScrapeError as exc:
                self._failed(exc)
            self.last_samples = len(samples)
        self._running = self._start()
        return samples

    def _start(self) -> Future[Scraped]:
        """The scrape in a daemon thread (one at a time): a hanging endpoint can hold
        neither the agent's worker nor the process's exit (an executor's threads are
        joined at exit)."""
        future: Future[Scraped] = Future()
        spec = self.spec

        def scrape() -> None:
            try:
                future.set_result(parse(spec, fetch(spec)))
            except Exception as exc:  # noqa: BLE001 - handed to the tick that takes the result
                future.set_exception(exc)

        threading.Thread(target=scrape, name=f"advisor-{spec.name}", daemon=True).start()
        return future

    def _failed(self, exc: ScrapeError) -> None:
        with self._lock:
            self.failures[exc.reason] = self.failures.get(exc.reason, 0) + 1
        self._set_state(exc.reason, exc.detail)

    def _set_state(self, state: str, detail: str) -> None:
        previous, self.state, self.last_error = self.state, state, detail
        if state == previous:
            return
        if state == "ok":
            log.info("advisor_scrape_ok", advisor=self.spec.name, url=self.spec.url, previous=previous)
        else:
            log.warning("advisor_scrape_failed", advisor=self.spec.name, url=self.spec.url, reason=state,
                        error=detail)

    def _map(self, scraped: Scraped, pods: Sequence[PodView]) -> list[Sample]:
        mapping = self.spec.labels
        by_key = {(p.namespace, p.name): p for p in pods} if "pod_name" in mapping else {}
        by_uid = {p.uid: p for p in pods} if "container_name" in mapping else {}
        out: list[Sample] = []
        for name, theirs, value in scraped:
            labels = dict(theirs)
            labels.pop(ADVISOR_LABEL, None)
            labels.update(self._ours(theirs, by_key, by_uid))
            labels[ADVISOR_LABEL] = self.spec.name
            out.append(Sample(name, value, tuple(sorted(labels.items()))))
        return out

    def _ours(self, theirs: Mapping[str, str], by_key: Mapping[tuple[str, str], PodView],
              by_uid: Mapping[str, PodView]) -> dict[str, str]:
        """Our pod/container labels from theirs (what cannot be resolved is left as it was)."""
        mapping = self.spec.labels
        ours: dict[str, str] = {}
        pod: PodView | None = None
        uid = theirs.get(mapping.get("pod_uid", ""), "")
        if uid:
            ours[POD_UID] = uid
            pod = by_uid.get(uid)
        elif "pod_name" in mapping:
            pod = by_key.get((theirs.get(mapping["pod_namespace"], ""), theirs.get(mapping["pod_name"], "")))
            if pod is not None:
                ours[POD_UID] = pod.uid
        cid = theirs.get(mapping.get("container_id", ""), "")
        if cid:
            ours[CONTAINER_ID] = cid.partition("://")[2] or cid
        elif "container_name" in mapping and pod is not None:
            cname = theirs.get(mapping["container_name"], "")
            for container in pod.containers:
                if container.name == cname:
                    ours[CONTAINER_ID] = container.id
        return ours

    def explain(self) -> dict[str, Any]:
        with self._lock:
            failures = dict(self.failures)
        return {"url": self.spec.url, "interval": self.spec.interval, "state": self.state,
                "error": self.last_error, "samples": self.last_samples, "failures": failures}

    def close(self) -> None:
        self._running = None  # a scrape in flight ends within its timeout, unread


class AdvisorHealth(PromCollector):
    """``koord_runtime_proxy_advisor_scrape_failures_total{advisor,reason}`` and
    ``koord_runtime_proxy_advisor_up{advisor}`` (1 after a good scrape)."""

    def __init__(self, advisors: Sequence[AdvisorCollector]) -> None:
        self._advisors = advisors

    def describe(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        return self._families(())

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        return self._families(self._advisors)

    @staticmethod
    def _families(advisors: Sequence[AdvisorCollector]) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        failures = CounterMetricFamily("koord_runtime_proxy_advisor_scrape_failures",
                                       "Failed scrapes of an external advisor, by reason", labels=["advisor", "reason"])
        up = GaugeMetricFamily("koord_runtime_proxy_advisor_up", "1 when the advisor's last scrape succeeded",
                               labels=["advisor"])
        for advisor in advisors:
            for reason, count in sorted(advisor.explain()["failures"].items()):
                failures.add_metric([advisor.spec.name, reason], count)
            up.add_metric([advisor.spec.name], 1.0 if advisor.state == "ok" else 0.0)
        yield failures
        yield up
