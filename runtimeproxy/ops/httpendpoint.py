"""The small loopback HTTP endpoint: ``/metrics``, ``/healthz`` and the debug routes.

Hand-rolled on asyncio instead of prometheus_client's threaded server or an HTTP
framework: it runs on the proxy's own loop (so health reflects the loop actually
serving CRI), it needs only a handful of GET routes, and strict limits keep a
misbehaving client on the loopback from costing the CRI hot path anything — its
own accept loop caps open connections, keeps a reserve of free descriptors for
the CRI path and the hooks, drops idle clients and turns accept errors into one
rate-limited warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Final
from urllib.parse import SplitResult, parse_qsl, urlsplit

import prometheus_client
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge
from structlog.typing import FilteringBoundLogger

from runtimeproxy.errors import InputError
from runtimeproxy.ops import fdlimits
from runtimeproxy.ops.logsetup import Throttle

DEFAULT_HOST: Final = "127.0.0.1"
DEFAULT_PORT: Final = 9316


class HttpStats:
    """What the HTTP endpoint's limits did: open connections, pauses, accept errors."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.connections = Gauge(
            "koord_runtime_proxy_http_connections",
            "Connections open on the HTTP endpoint.",
            registry=registry,
        )
        self.accept_paused = Counter(
            "koord_runtime_proxy_http_accept_paused",
            "Times the HTTP endpoint stopped accepting, by reason (max_connections, fd_reserve).",
            ["reason"],
            registry=registry,
        )
        self.accept_errors = Counter(
            "koord_runtime_proxy_http_accept_errors",
            "accept() failures on the HTTP endpoint, by errno name (EMFILE, ENFILE, ...).",
            ["error"],
            registry=registry,
        )
        self.idle_timeouts = Counter(
            "koord_runtime_proxy_http_idle_timeouts",
            "HTTP connections closed because the client sent or read nothing for metrics.idle_timeout.",
            registry=registry,
        )


#: A body in parts (/metrics: the registry, then each exposition) is joined once, with the head.
Response = tuple[int, str, bytes | Sequence[bytes]]
RouteHandler = Callable[[dict[str, str]], Awaitable[Response]]

MAX_HEAD_BYTES: Final = 8 * 1024
_TEXT: Final = "text/plain; charset=utf-8"


class _BadRequest(InputError):
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


#: Errors of accept() about one connection (it died in the backlog, a firewall
#: refused it): take the next one at once. Anything else (EMFILE, ENFILE, ENOBUFS,
#: ENOMEM, ...) is counted, warned about once a minute and retried after a pause.
_ACCEPT_PER_CONNECTION: Final = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EINTR})
#: How often a paused accept loop looks again at the descriptor reserve (a closing
#: connection of ours wakes it at once; descriptors freed elsewhere do not).
_RECHECK_SECONDS: Final = 0.5


class HttpEndpoint:
    """Loopback HTTP/1.1 server: ``/metrics``, ``/healthz`` and injected routes.

    ``/metrics`` is the registry's text format followed by each ``expositions``
    renderer's (pre-rendered text of exporters too big for per-sample formatting);
    ``after_scrape`` runs once such a response has been sent and its connection
    closed (the app gives the scrape's freed megabytes back to the OS).
    ``before_scrape`` runs in a worker thread before the registry is rendered: what
    blocks (HAProxy's stats socket) is read there, never on the loop.

    ``health`` returns None when healthy, else the reason ``/healthz`` answers 503
    with.

    One request per connection (``Connection: close``), GET only, request head
    capped at 8 KiB. Its own accept loop keeps a flooding client from costing the
    rest of the process anything: at most ``max_connections`` are open (more wait
    in the kernel's backlog, unaccepted, costing no descriptor), nothing is accepted
    while fewer than ``fd_reserve`` descriptors are free (they are the CRI path's and
    the hooks'), a client idle for ``idle_timeout`` (sending its request or reading
    the response) is dropped, and an accept() failure is one rate-limited warning
    and a counter, not a traceback per attempt.
    """

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        *,
        health: Callable[[], str | None],
        routes: Mapping[str, RouteHandler] | None = None,
        expositions: Sequence[Callable[[], bytes]] = (),
        after_scrape: Callable[[], None] | None = None,
        before_scrape: Callable[[], None] | None = None,
        idle_timeout: float = 5.0,
        max_connections: int = 64,
        fd_reserve: int = 256,
        stats: HttpStats | None = None,
        free_fds: Callable[[], int] = fdlimits.free_fds,
        logger: FilteringBoundLogger | None = None,
    ) -> None:
        self._host = host
        self._requested_port = port
        self._registry = registry
        self._health = health
        self._idle_timeout = idle_timeout
        self._max_connections = max(1, max_connections)
        self._fd_reserve = fd_reserve
        self._stats = stats
        self._free_fds = free_fds
        self._log: FilteringBoundLogger = (
            logger if logger is not None else structlog.get_logger(component="http")
        )
        self._routes = self._build_routes(routes or {})
        self._expositions = tuple(expositions)
        self._after_scrape = after_scrape
        self._before_scrape = before_scrape
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._port: int | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()
        self._throttle = Throttle(60.0)

    @property
    def port(self) -> int:
        """The bound port (useful when constructed with port 0)."""
        if self._port is None:
            raise RuntimeError("endpoint not started")
        return self._port

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    async def start(self) -> int:
        """Bind and start serving; return the bound port."""
        if self._sock is not None:
            return self.port
        self._sock = await self._bind()
        self._port = int(self._sock.getsockname()[1])
        self._accepting = asyncio.create_task(self._accept_loop(self._sock), name="http-accept")
        self._log.info(
            "http_listening", host=self._host, port=self._port,
            max_connections=self._max_connections, idle_timeout=self._idle_timeout,
        )
        return self._port

    async def _bind(self) -> socket.socket:
        """The first address ``host`` resolves to (loopback in practice)."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            self._host, self._requested_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        if not infos:
            raise OSError(f"cannot resolve {self._host!r}")
        family, type_, proto, _, addr = infos[0]
        sock = socket.socket(family, type_, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            # A small backlog: what waits there costs the kernel a little, not us a descriptor.
            sock.listen(min(max(self._max_connections, 16), 128))
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    async def stop(self) -> None:
        """Stop listening and drop in-flight connections; idempotent."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        accepting, self._accepting = self._accepting, None
        if accepting is not None:
            accepting.cancel()
            await asyncio.gather(accepting, return_exceptions=True)
        sock.close()
        # Cancel open connections so a stuck client cannot delay shutdown.
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    # --- accepting -------------------------------------------------------------------

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wait_for_room()
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:
                if exc.errno in _ACCEPT_PER_CONNECTION:
                    continue
                self._accept_failed(exc)
                await self._pause(_RECHECK_SECONDS)
                continue
            try:
                self._serve(conn)
            except Exception as exc:  # noqa: BLE001 - the endpoint must keep accepting
                conn.close()
                self._accept_failed(exc)
                await self._pause(_RECHECK_SECONDS)

    def _serve(self, conn: socket.socket) -> None:
        task = asyncio.create_task(self._handle(conn), name="http-conn")
        self._connections.add(task)
        if self._stats is not None:
            self._stats.connections.set(len(self._connections))
        task.add_done_callback(self._connection_closed)

    def _connection_closed(self, task: asyncio.Task[None]) -> None:
        self._connections.discard(task)
        if self._stats is not None:
            self._stats.connections.set(len(self._connections))
        self._room.set()
        if not task.cancelled() and task.exception() is not None:
            self._log.error("http_connection_failed", exc_info=task.exception())

    def _no_room(self) -> str | None:
        """Why nothing may be accepted now, or None."""
        if len(self._connections) >= self._max_connections:
            return "max_connections"
        # Accepting takes a descriptor: keep the reserve for the CRI path and the hooks.
        if self._fd_reserve > 0 and self._free_fds() <= self._fd_reserve:
            return "fd_reserve"
        return None

    async def _wait_for_room(self) -> None:
        reason = self._no_room()
        if reason is None:
            return
        if self._stats is not None:
            self._stats.accept_paused.labels(reason=reason).inc()
        held = self._throttle.allow(("paused", reason))
        if held is not None:
            self._log.warning(
                "http_accept_paused", reason=reason, open_connections=len(self._connections),
                max_connections=self._max_connections, fd_reserve=self._fd_reserve, repeats_suppressed=held,
            )
        while self._no_room() is not None:
            await self._pause(_RECHECK_SECONDS)

    async def _pause(self, seconds: float) -> None:
        """Until one of our connections closes, or ``seconds`` at most."""
        self._room.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._room.wait()

    def _accept_failed(self, exc: Exception) -> None:
        if isinstance(exc, OSError) and exc.errno is not None:
            name, detail = errno.errorcode.get(exc.errno, str(exc.errno)), exc.strerror
        else:
            name, detail = type(exc).__name__, str(exc)
        if self._stats is not None:
            self._stats.accept_errors.labels(error=name).inc()
        held = self._throttle.allow(("accept", name))
        if held is not None:
            self._log.warning(
                "http_accept_failed", error=name, detail=detail,
                open_connections=len(self._connections), repeats_suppressed=held,
            )

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
        # owned by other modules may not be safe to read from a worker thread. What blocks
        # (a socket read) is done by ``before_scrape``, in a thread, first.
        if self._before_scrape is not None:
            await asyncio.to_thread(self._before_scrape)
        body = [prometheus_client.generate_latest(self._registry)]
        body.extend(render() for render in self._expositions)
        return 200, prometheus_client.CONTENT_TYPE_LATEST, body

    async def _healthz(self, _query: dict[str, str]) -> Response:
        try:
            problem = self._health()
        except Exception as exc:  # noqa: BLE001 - a broken probe means "unhealthy"
            self._log.error("health_probe_failed", error=repr(exc))
            problem = f"health probe failed: {exc!r}"
        if problem is None:
            return 200, _TEXT, b"ok\n"
        return 503, _TEXT, f"unhealthy: {problem}\n".encode()

    async def _handle(self, conn: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=conn, limit=MAX_HEAD_BYTES)
        except OSError:
            conn.close()
            return
        scraped = False
        try:
            scraped = await self._serve_one(reader, writer)
        finally:
            writer.close()
            # close() flushes what is buffered first: a client that stopped reading
            # would hold the connection (and stop()) forever.
            try:
                async with asyncio.timeout(self._idle_timeout):
                    await writer.wait_closed()
            except (ConnectionError, TimeoutError):
                writer.transport.abort()
        if scraped and self._after_scrape is not None:
            self._after_scrape()

    async def _serve_one(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Serve one request; True when it was a /metrics scrape."""
        try:
            async with asyncio.timeout(self._idle_timeout):
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
        if isinstance(exc, TimeoutError):
            self._idle_closed()
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
            async with asyncio.timeout(min(self._idle_timeout, 1.0)):
                drained = 0
                while drained < 16 * MAX_HEAD_BYTES:
                    chunk = await reader.read(MAX_HEAD_BYTES)
                    if not chunk:
                        return
                    drained += len(chunk)

    async def _send(self, writer: asyncio.StreamWriter, payload: bytes) -> None:
        """Write the response; a client that reads nothing for ``idle_timeout`` is cut off."""
        with contextlib.suppress(ConnectionError):
            writer.write(payload)
            try:
                async with asyncio.timeout(self._idle_timeout):
                    await writer.drain()
            except TimeoutError:
                self._idle_closed()
                writer.transport.abort()

    def _idle_closed(self) -> None:
        if self._stats is not None:
            self._stats.idle_timeouts.inc()
