"""The proxy's Prometheus metrics.

Every kubelet→runtime CRI call passes through the proxy, so its own overhead and
its hooks' failures must be measurable per node: call counts split into
passthrough vs intercepted, per-method latency, hook latency and failures by
policy. The metric objects live in a registry passed in by the caller (never the
global default registry) so tests and embedders get isolated metrics.

The loopback HTTP endpoint serving them is ``runtimeproxy.ops.httpendpoint``
(re-exported here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from runtimeproxy.ops.httpendpoint import HttpEndpoint, HttpStats

__all__ = ["HttpEndpoint", "HttpStats", "MethodStats", "ProxyMetrics"]

CallPath = Literal["passthrough", "intercepted"]
HookResult = Literal["ok", "error", "timeout"]

# 50 µs (a passthrough of a cached call) up to 10 s (an image-heavy create).
CRI_BUCKETS: Final = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class MethodStats:
    """Label children for one CRI method, resolved once so the per-call path is
    just ``calls.inc()`` and ``duration.observe(dt)``."""

    calls: Counter
    duration: Histogram
    _errors: Counter = field(repr=False)
    _method: str = field(repr=False)
    _error_children: dict[str, Counter] = field(default_factory=dict, repr=False)

    def error(self, code: str) -> None:
        """Count one failed call with gRPC status ``code`` (e.g. ``"UNAVAILABLE"``)."""
        child = self._error_children.get(code)
        if child is None:
            child = self._errors.labels(method=self._method, code=code)
            self._error_children[code] = child
        child.inc()


class ProxyMetrics:
    """All metrics the proxy exports, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.cri_calls = Counter(
            "koord_runtime_proxy_cri_calls",
            "CRI calls handled, by method and whether hooks intercepted them.",
            ["method", "path"],
            registry=registry,
        )
        self.cri_errors = Counter(
            "koord_runtime_proxy_cri_errors",
            "CRI calls that returned a gRPC error, by method and status code.",
            ["method", "code"],
            registry=registry,
        )
        self.cri_call_duration = Histogram(
            "koord_runtime_proxy_cri_call_duration_seconds",
            "Wall time of a CRI call through the proxy, hooks included.",
            ["method"],
            buckets=CRI_BUCKETS,
            registry=registry,
        )
        self.hook_duration = Histogram(
            "koord_runtime_proxy_hook_duration_seconds",
            "Time of one hook invocation, by hook, stage and result: its own run time when it ran with the "
            "stage's other sync hooks in one thread hand-off, else including the hand-off.",
            ["hook", "stage", "result"],
            buckets=CRI_BUCKETS,
            registry=registry,
        )
        self.hook_failures = Counter(
            "koord_runtime_proxy_hook_failures",
            "Hook invocations that failed or timed out, by the failure policy applied.",
            ["hook", "stage", "policy"],
            registry=registry,
        )
        self.config_reloads = Counter(
            "koord_runtime_proxy_config_reloads",
            "Configuration reload attempts, by result.",
            ["result"],
            registry=registry,
        )
        self.build_info = Gauge(
            "koord_runtime_proxy_build_info",
            "Always 1; labels carry the running version.",
            ["version"],
            registry=registry,
        )
        self.up = Gauge(
            "koord_runtime_proxy_up",
            "1 while the proxy is serving CRI, 0 while starting or draining.",
            registry=registry,
        )
        self.backend_up = Gauge(
            "koord_runtime_proxy_backend_up",
            "1 while the backend answers the proxy's probe (or failed for less than "
            "backend.unhealthy_after), by backend (runtime, image).",
            ["backend"],
            registry=registry,
        )
        self.http = HttpStats(registry)
        # process_open_fds / process_max_fds / RSS / CPU: descriptor pressure is visible
        # before it becomes EMFILE.
        ProcessCollector(registry=registry)
        self._methods: dict[tuple[str, str], MethodStats] = {}
        #: Label children of hook_duration by (hook, stage, result): ``labels()`` costs
        #: more than the observation, and the reconciler observes every hook of every
        #: object it visits. Bounded: hooks x stages x results of the loaded chains.
        self._hook_children: dict[tuple[str, str, str], Histogram] = {}

    def method(self, method: str, path: CallPath = "passthrough") -> MethodStats:
        """Cached label children for ``method`` (a method's path never changes
        at runtime, so the pair is a stable cache key)."""
        key = (method, path)
        stats = self._methods.get(key)
        if stats is None:
            stats = MethodStats(
                calls=self.cri_calls.labels(method=method, path=path),
                duration=self.cri_call_duration.labels(method=method),
                _errors=self.cri_errors,
                _method=method,
            )
            self._methods[key] = stats
        return stats

    def hook_observed(
        self, hook: str, stage: str, result: HookResult, seconds: float
    ) -> None:
        """Record one hook invocation's latency and outcome."""
        key = (hook, stage, result)
        child = self._hook_children.get(key)
        if child is None:
            child = self._hook_children[key] = self.hook_duration.labels(hook=hook, stage=stage, result=result)
        child.observe(seconds)

    def hook_failed(self, hook: str, stage: str, policy: str) -> None:
        """Count a hook failure handled under ``policy`` (e.g. ``"Ignore"``, ``"Fail"``)."""
        self.hook_failures.labels(hook=hook, stage=stage, policy=policy).inc()

    def config_reloaded(self, ok: bool) -> None:
        self.config_reloads.labels(result="ok" if ok else "error").inc()

    def set_build_info(self, version: str) -> None:
        self.build_info.labels(version=version).set(1)


