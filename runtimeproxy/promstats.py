"""The proxy's Prometheus metrics and the small loopback HTTP endpoint serving them.

Every kubelet→runtime CRI call passes through the proxy, so its own overhead and
its hooks' failures must be measurable per node: call counts split into
passthrough vs intercepted, per-method latency, hook latency and failures by
policy. The metric objects live in a registry passed in by the caller (never the
global default registry) so tests and embedders get isolated metrics.

The HTTP endpoint is hand-rolled on ``asyncio.start_server`` instead of
prometheus_client's threaded server or an HTTP framework: it runs on the proxy's
own loop (so health reflects the loop actually serving CRI), it needs only a
handful of GET routes, and strict size and time limits keep a misbehaving
client on the loopback from costing the CRI hot path anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal
from urllib.parse import SplitResult, parse_qsl, urlsplit

import prometheus_client
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from structlog.typing import FilteringBoundLogger

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 9316

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
            "Wall time of one hook invocation, by hook, stage and result.",
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
        self._methods: dict[tuple[str, str], MethodStats] = {}

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
        self.hook_duration.labels(hook=hook, stage=stage, result=result).observe(
            seconds
        )

    def hook_failed(self, hook: str, stage: str, policy: str) -> None:
        """Count a hook failure handled under ``policy`` (e.g. ``"Ignore"``, ``"Fail"``)."""
        self.hook_failures.labels(hook=hook, stage=stage, policy=policy).inc()

    def config_reloaded(self, ok: bool) -> None:
        self.config_reloads.labels(result="ok" if ok else "error").inc()

    def set_build_info(self, version: str) -> None:
        self.build_info.labels(version=version).set(1)


#: A body in parts (/metrics: the registry, then each exposition) is joined once, with the head.
Response = tuple[int, str, bytes | Sequence[bytes]]
RouteHandler = Callable[[dict[str, str]], Awaitable[Response]]

MAX_HEAD_BYTES: Final = 8 * 1024
_TEXT: Final = "text/plain; charset=utf-8"


class _BadRequest(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def _reason(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return ""


def _encode_response(
    status: int, content_type: str, body: bytes | Sequence[bytes], extra: str = ""
) -> bytes:
    """The whole response; a body in parts is joined once, with the head (a scrape's
    body is megabytes: every copy is RSS)."""
    parts = [body] if isinstance(body, bytes) else body
    head = (
        f"HTTP/1.1 {status} {_reason(status)}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {sum(len(p) for p in parts)}\r\n"
        f"{extra}"
        "Connection: close\r\n\r\n"
    )
    return b"".join([head.encode("latin-1"), *parts])


# Failures while reading the request head that get an error response (or, for
# IncompleteReadError, a silent close) instead of tearing down the handler.
_REJECTABLE: Final = (
    TimeoutError,
    asyncio.LimitOverrunError,
    asyncio.IncompleteReadError,
    _BadRequest,
)


def _status_for(exc: BaseException) -> int:
    if isinstance(exc, _BadRequest):
        return exc.status
    if isinstance(exc, TimeoutError):
        return 408
    if isinstance(exc, asyncio.LimitOverrunError):
        return 431  # Request Header Fields Too Large
    return 400


def _parse_request_line(head: bytes) -> tuple[str, str]:
    """Return (method, target) from the request head, or raise _BadRequest(400)."""
    line = head.split(b"\r\n", 1)[0]
    try:
        method, target, version = line.decode("ascii").split(" ")
    except (UnicodeDecodeError, ValueError):
        raise _BadRequest(400) from None
    if not version.startswith("HTTP/1.") or not target.startswith("/"):
        raise _BadRequest(400)
    return method, target


class HttpEndpoint:
    """Loopback HTTP/1.1 server: ``/metrics``, ``/healthz`` and injected routes.

    ``/metrics`` is the registry's text format followed by each ``expositions``
    renderer's (pre-rendered text of exporters too big for per-sample formatting);
    ``after_scrape`` runs once such a response has been sent and its connection
    closed (the app gives the scrape's freed megabytes back to the OS).

    One request per connection (``Connection: close``), GET only, request head
    capped at 8 KiB and read under a timeout.
    """

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        *,
        healthy: Callable[[], bool],
        routes: Mapping[str, RouteHandler] | None = None,
        expositions: Sequence[Callable[[], bytes]] = (),
        after_scrape: Callable[[], None] | None = None,
        read_timeout: float = 5.0,
        logger: FilteringBoundLogger | None = None,
    ) -> None:
        self._host = host
        self._requested_port = port
        self._registry = registry
        self._healthy = healthy
        self._read_timeout = read_timeout
        self._log: FilteringBoundLogger = (
            logger if logger is not None else structlog.get_logger(component="http")
        )
        self._routes = self._build_routes(routes or {})
        self._expositions = tuple(expositions)
        self._after_scrape = after_scrape
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        """The bound port (useful when constructed with port 0)."""
        if self._port is None:
            raise RuntimeError("endpoint not started")
        return self._port

    async def start(self) -> int:
        """Bind and start serving; return the bound port."""
        if self._server is not None:
            return self.port
        self._server = await asyncio.start_server(
            self._handle, self._host, self._requested_port, limit=MAX_HEAD_BYTES
        )
        self._port = int(self._server.sockets[0].getsockname()[1])
        self._log.info("http_listening", host=self._host, port=self._port)
        return self._port

    async def stop(self) -> None:
        """Stop listening and drop in-flight connections; idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        # On 3.11 wait_closed() does not wait for open connections; cancel them
        # so a stuck client cannot delay shutdown.
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await server.wait_closed()

    def _build_routes(
        self, extra: Mapping[str, RouteHandler]
    ) -> dict[str, RouteHandler]:
        builtin: dict[str, RouteHandler] = {
            "/metrics": self._metrics,
            "/healthz": self._healthz,
        }
        clash = builtin.keys() & extra.keys()
        if clash:
            raise ValueError(f"routes may not replace built-in paths: {sorted(clash)}")
        return {**builtin, **extra}

    async def _metrics(self, _query: dict[str, str]) -> Response:
        # Rendered on the loop: scrapes are rare (15 s), the registry's part is small and
        # the big exporters render their own text (~17 ms for 6400 series), and collectors
        # owned by other modules may not be safe to read from a worker thread.
        body = [prometheus_client.generate_latest(self._registry)]
        body.extend(render() for render in self._expositions)
        return 200, prometheus_client.CONTENT_TYPE_LATEST, body

    async def _healthz(self, _query: dict[str, str]) -> Response:
        try:
            ok = bool(self._healthy())
        except Exception as exc:  # noqa: BLE001 - a broken probe means "unhealthy"
            self._log.error("health_probe_failed", error=repr(exc))
            ok = False
        return (200, _TEXT, b"ok\n") if ok else (503, _TEXT, b"unhealthy\n")

    async def _handle(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        scraped = False
        try:
            scraped = await self._serve_one(reader, writer)
        finally:
            if task is not None:
                self._connections.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        if scraped and self._after_scrape is not None:
            self._after_scrape()

    async def _serve_one(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Serve one request; True when it was a /metrics scrape."""
        try:
            async with asyncio.timeout(self._read_timeout):
                head = await reader.readuntil(b"\r\n\r\n")
            method, target = _parse_request_line(head)
        except _REJECTABLE as exc:
            await self._reject(reader, writer, exc)
            return False
        except ConnectionError:
            return False
        if method != "GET":
            allow = "Allow: GET\r\n"
            await self._send(
                writer, _encode_response(405, _TEXT, b"method not allowed\n", allow)
            )
            return False
        parts = urlsplit(target)
        await self._send(writer, await self._dispatch(parts))
        return parts.path == "/metrics"

    async def _dispatch(self, parts: SplitResult) -> bytes:
        handler = self._routes.get(parts.path)
        if handler is None:
            return _encode_response(404, _TEXT, b"not found\n")
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        try:
            status, content_type, body = await handler(query)
        except Exception as exc:  # noqa: BLE001 - one bad route must not kill the server
            self._log.error("http_handler_failed", path=parts.path, exc_info=exc)
            return _encode_response(500, _TEXT, b"internal error\n")
        return _encode_response(status, content_type, body)

    async def _reject(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        exc: BaseException,
    ) -> None:
        if isinstance(exc, asyncio.IncompleteReadError):
            return  # client went away before finishing its request
        status = _status_for(exc)
        await self._send(
            writer, _encode_response(status, _TEXT, f"{_reason(status)}\n".encode())
        )
        await self._linger(reader, writer)

    async def _linger(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Read (and drop) what the client is still sending, briefly, before
        closing: closing with unread input makes the kernel send RST, which can
        destroy the error response before the client reads it."""
        with contextlib.suppress(OSError, TimeoutError):
            if writer.can_write_eof():
                writer.write_eof()
            async with asyncio.timeout(min(self._read_timeout, 1.0)):
                drained = 0
                while drained < 16 * MAX_HEAD_BYTES:
                    chunk = await reader.read(MAX_HEAD_BYTES)
                    if not chunk:
                        return
                    drained += len(chunk)

    async def _send(self, writer: asyncio.StreamWriter, payload: bytes) -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(payload)
            await writer.drain()
