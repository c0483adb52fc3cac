"""The gRPC server side of the transport: kubelet's endpoint.

One generic handler serves every call. The eight lifecycle methods go to
``Lifecycle``; the other methods of our CRI protos are relayed as raw bytes with
the caller's deadline and metadata, and the backend's status, details and metadata
are relayed back. Their handlers are built once, at start, from the generated
descriptors: a fixed table, so the pass-through path does no parsing, no logging and
no per-call lookups beyond its counters, and nothing a client sends can add to it.

Only the CRI services are relayed (``runtime.v1.RuntimeService`` and
``runtime.v1.ImageService``). A method of those services that our protos do not
know yet (a newer kubelet) is relayed by a handler made for that one call and
counted under the service's ``*`` label; any other path (containerd's native
``/containerd.services.*`` API behind the same backend socket, say) is answered
UNIMPLEMENTED here and never reaches the backend.

Behind HAProxy (``data_plane: haproxy``) the same server, on a private socket (mode
0600), serves only the lifecycle methods HAProxy routes to it (``intercept_only``):
every other path is UNIMPLEMENTED, nothing is relayed from there.

Bounds on the private socket, before a handler runs: request metadata of more than
``MAX_METADATA_ENTRIES`` entries or ``MAX_METADATA_BYTES`` (names and values, plus 32
bytes an entry as HTTP/2 counts a header list) is refused RESOURCE_EXHAUSTED before the
request is read (grpc core itself takes any amount: its metadata options bound only
what well-behaved clients send; HAProxy in front refuses more than ``tune.bufsize`` of
headers or more than ``tune.http.maxhdr`` of them already). A message whose 5-byte
prefix announces more than the server's receive limit is refused RESOURCE_EXHAUSTED
from that prefix, before its body is read. grpc core then
resets the stream (the client is still sending), and HAProxy 2.6 turns a reset that
follows a complete reply into a reset for its own client: kubelet would see CANCELLED,
not the status. So behind HAProxy the receive limit is ``max_message_bytes`` +
``INTERCEPT_SLACK``: a request a little over the limit is read and refused
RESOURCE_EXHAUSTED by the handler, as containerd does; one announced bigger is cut at
its prefix (kubelet never sends one; a peer that does gets a reset).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import stat
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, Final, NoReturn

import grpc
import grpc.aio
import structlog

from criapi import cri_v1_pb2
from runtimeproxy.backend import CallError, Reply
from runtimeproxy.config.confignet import check_unix_path
from runtimeproxy.config.settings import ConfigError
from runtimeproxy.errors import PeerError
from runtimeproxy.lifecycle import intercept
from runtimeproxy.lifecycle.handler import CallInfo, Lifecycle
from runtimeproxy.ops.promstats import MethodStats, ProxyMetrics
from runtimeproxy.transport.grpcbackend import GrpcBackend, forwardable, to_call_error

log = structlog.get_logger("runtimeproxy.grpcserver")

_STATUS: Final[Mapping[int, grpc.StatusCode]] = {sc.value[0]: sc for sc in grpc.StatusCode}


class SocketInUse(PeerError):
    """Another live process answers on our socket path."""


#: The services relayed to the backend; every other path is answered UNIMPLEMENTED here.
CRI_SERVICES: Final = ("/runtime.v1.RuntimeService/", "/runtime.v1.ImageService/")
_NOT_CRI = (
    "koord-runtime-proxy relays only the CRI services runtime.v1.RuntimeService and runtime.v1.ImageService"
)
_ONE_REQUEST = "koord-runtime-proxy relays a method it does not know only with exactly one request message"
#: Request metadata per intercepted call. kubelet sends a handful of entries, well under
#: 1 KiB; HAProxy in front allows up to 128 KiB of headers (``tune.bufsize``) and 101 of them.
MAX_METADATA_BYTES: Final = 64 * 1024
MAX_METADATA_ENTRIES: Final = 64
#: Behind HAProxy: how far over ``max_message_bytes`` a request is still read, to be
#: refused with its status (see above).
INTERCEPT_SLACK: Final = 1024 * 1024


def metadata_problem(metadata: Any) -> str | None:
    """Why this request metadata is too big for the interception server, or None."""
    if metadata is None:
        return None
    size = count = 0
    for key, value in metadata:
        count += 1
        size += len(key) + len(value) + 32
    if count > MAX_METADATA_ENTRIES:
        return f"request metadata has {count} entries, more than {MAX_METADATA_ENTRIES}"
    if size > MAX_METADATA_BYTES:
        return f"request metadata is {size} bytes, more than {MAX_METADATA_BYTES}"
    return None


def known_methods() -> Mapping[str, bool]:
    """Full method path -> server-streaming, for every method in our CRI protos."""
    out: dict[str, bool] = {}
    for service in cri_v1_pb2.DESCRIPTOR.services_by_name.values():
        for m in service.methods:
            out[f"/{service.full_name}/{m.name}"] = m.server_streaming
    return out


def cri_service(method: str) -> str | None:
    """``/runtime.v1.RuntimeService/`` for ``/runtime.v1.RuntimeService/X``; None for any
    other path (another service, no method name, a nested path)."""
    cut = method.rfind("/") + 1
    service = method[:cut]
    return service if service in CRI_SERVICES and cut < len(method) else None


_KINDS: Final = (
    (stat.S_ISREG, "regular file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symbolic link"),
    (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "special file")


def prepare_socket(path: Path) -> None:
    """Create parent dirs; replace a stale socket, refuse a live one or anything else.

    Only a socket (by ``lstat``: a symlink is not followed, even to a socket) that
    refuses connections is removed. A regular file, a directory, a symlink, a device
    or a path the kernel cannot bind is a ``ConfigError`` naming ``listen``: the path
    an operator typed is never deleted unless it is our own leftover socket.
    """
    value = str(path)
    check_unix_path(value, "listen")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError("listen", value, f"cannot use this path: {exc.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError("listen", value, f"is a {_kind(st.st_mode)}, not a socket: refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(value)
    except FileNotFoundError:
        return  # removed meanwhile
    except ConnectionRefusedError:
        _remove_stale(path, st)
        return
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.ETIMEDOUT) or isinstance(exc, TimeoutError):
            raise SocketInUse(f"{path} is held by a live but busy process (another koord-runtime-proxy?)") from None
        raise ConfigError("listen", value, f"cannot probe the existing socket: {exc.strerror}") from None
    finally:
        probe.close()
    raise SocketInUse(f"{path} is held by a live process (another koord-runtime-proxy?)")


def socket_identity(path: Path) -> tuple[int, int]:
    """(device, inode) of the socket just bound at ``path``, for ``unlink_bound``."""
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def unlink_bound(path: Path, bound: tuple[int, int] | None) -> None:
    """Remove ``path`` if it is still the socket we bound (``socket_identity``); never
    a path we refused to replace, nor a file that replaced ours since."""
    if bound is None:
        return
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == bound:
            path.unlink()


def _remove_stale(path: Path, probed: os.stat_result) -> None:
    # Remove only what was probed: the same socket inode, not whatever replaced it since.
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(now.st_mode) or (now.st_dev, now.st_ino) != (probed.st_dev, probed.st_ino):
        raise ConfigError("listen", str(path), "changed while being probed: refusing to replace it")
    path.unlink(missing_ok=True)
    log.info("stale_socket_removed", path=str(path))


async def _abort(context: grpc.aio.ServicerContext[Any, Any], err: CallError) -> NoReturn:
    await context.abort(_STATUS.get(int(err.code), grpc.StatusCode.UNKNOWN), err.details, err.trailing_metadata)
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


async def _relay_metadata(context: grpc.aio.ServicerContext[Any, Any], reply: Reply) -> None:
    if reply.initial_metadata:
        await context.send_initial_metadata(reply.initial_metadata)
    if reply.trailing_metadata:
        context.set_trailing_metadata(reply.trailing_metadata)


class ProxyHandler(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc ships no types
    """Serves the CRI methods from a table built once; nothing a client sends grows it."""

    def __init__(self, *, backend: GrpcBackend, lifecycle: Lifecycle, metrics: ProxyMetrics,
                 intercept_only: bool = False, max_request_bytes: int | None = None) -> None:
        self._backend = backend
        self._lifecycle = lifecycle
        self._metrics = metrics
        self._intercepted = lifecycle.methods
        #: Behind HAProxy: the lifecycle methods only (HAProxy counts and relays the rest).
        self.intercept_only = intercept_only
        #: Intercepted calls being served now (a drain waits for 0, see ProxyServer.stop).
        self.intercepting = 0
        #: Refused in the handler (the server lets a little more through: INTERCEPT_SLACK).
        self._max_request = max_request_bytes
        streaming = {} if intercept_only else dict(known_methods())
        streaming.update({m: False for m in self._intercepted if m not in streaming})
        self._handlers: Mapping[str, grpc.RpcMethodHandler[Any, Any]] = {
            method: self._build(method, server_streaming) for method, server_streaming in streaming.items()
        }
        # Per service, not per method name: the label set stays bounded whatever is called.
        self._unknown_stats = {service: metrics.method(service + "*") for service in CRI_SERVICES}
        refused = metrics.cri_errors.labels(method="*", code="UNIMPLEMENTED")

        async def refuse(_requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]) -> None:
            refused.inc()
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, _NOT_CRI)

        self._refuse = grpc.stream_stream_rpc_method_handler(refuse)

    def cached_handlers(self) -> int:
        """How many handlers this object holds (fixed at construction)."""
        return len(self._handlers)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any]:
        method: str = handler_call_details.method
        if self.intercept_only:
            problem = metadata_problem(handler_call_details.invocation_metadata)
            if problem is not None:
                return self._refuse_big(method, problem)
        handler = self._handlers.get(method)
        if handler is not None:
            return handler
        service = cri_service(method)
        if service is None or self.intercept_only:
            return self._refuse
        # A CRI method newer than our protos: a handler for this call only, not kept.
        return grpc.stream_stream_rpc_method_handler(self._relay_unknown(method, self._unknown_stats[service]))

    def _refuse_big(self, method: str, problem: str) -> grpc.RpcMethodHandler[Any, Any]:
        """RESOURCE_EXHAUSTED without reading the request (a handler made for this call)."""
        stats = self._metrics.method(method, path="intercepted") if method in self._handlers else None

        async def refuse(_requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]) -> None:
            if stats is not None:
                stats.calls.inc()
                stats.error("RESOURCE_EXHAUSTED")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, problem)

        return grpc.stream_stream_rpc_method_handler(refuse)

    def _build(self, method: str, server_streaming: bool) -> grpc.RpcMethodHandler[Any, Any]:
        if method in self._intercepted:
            return grpc.unary_unary_rpc_method_handler(self._intercept(method))
        if server_streaming:
            return grpc.unary_stream_rpc_method_handler(self._unary_stream(method))
        return grpc.unary_unary_rpc_method_handler(self._unary(method))

    def _unary(self, method: str) -> Callable[..., Any]:
        multi = self._backend.unary_callable(method)
        stats = self._metrics.method(method, path="passthrough")

        async def passthrough(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            stats.calls.inc()
            start = time.perf_counter()
            call = multi(request, timeout=context.time_remaining(), metadata=forwardable(context.invocation_metadata()))
            try:
                response: bytes = await call
            except grpc.aio.AioRpcError as exc:
                stats.error(exc.code().name)
                await _abort(context, to_call_error(exc))
            finally:
                stats.duration.observe(time.perf_counter() - start)
            initial = await call.initial_metadata()
            if initial:
                await context.send_initial_metadata(initial)
            trailing = await call.trailing_metadata()
            if trailing:
                context.set_trailing_metadata(trailing)
            return response

        return passthrough

    def _unary_stream(self, method: str) -> Callable[..., Any]:
        multi = self._backend.unary_stream_callable(method)
        stats = self._metrics.method(method, path="passthrough")

        async def passthrough(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            stats.calls.inc()
            call = multi(request, timeout=context.time_remaining(), metadata=forwardable(context.invocation_metadata()))
            await _pump(call, context, stats.error)

        return passthrough

    def _relay_unknown(self, method: str, stats: MethodStats) -> Callable[..., Any]:
        """Any call shape on the wire, relayed as one request and a response stream.

        Every CRI method takes one request message (CRI has no client streaming), so the
        request is read here, before the backend call starts: the backend call gets bytes,
        not our request iterator. A stream-stream relay that hands the server's request
        iterator to the client call has a task reading this call while another ends it;
        under load grpc then fails the call INTERNAL instead of relaying the backend's
        status (issue 14.5).
        """

        async def relay(_requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]) -> None:
            stats.calls.inc()
            request = await context.read()
            if request is grpc.aio.EOF or await context.read() is not grpc.aio.EOF:
                stats.error("UNIMPLEMENTED")
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, _ONE_REQUEST)
            multi, release = self._backend.unknown_method_callable(method)
            try:
                call = multi(request, timeout=context.time_remaining(),
                             metadata=forwardable(context.invocation_metadata()))
                await _pump(call, context, stats.error)
            finally:
                release()

        return relay

    def _intercept(self, method: str) -> Callable[..., Any]:
        stats = self._metrics.method(method, path="intercepted")
        lifecycle = self._lifecycle

        limit = self._max_request

        async def intercepted(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            if limit is not None and len(request) > limit:
                stats.calls.inc()
                stats.error("RESOURCE_EXHAUSTED")
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"Received message larger than max ({len(request)} vs. {limit})")
            info = CallInfo(context.time_remaining(), forwardable(context.invocation_metadata()))
            self.intercepting += 1
            try:
                reply = await intercept.serve(lifecycle, stats, method, request, info)
            except CallError as err:
                await _abort(context, err)
            finally:
                self.intercepting -= 1
            await _relay_metadata(context, reply)
            return reply.payload

        return intercepted


async def _pump(call: Any, context: grpc.aio.ServicerContext[Any, Any], on_error: Callable[[str], None]) -> None:
    """Relay a backend response stream with ``context.write`` from a plain coroutine:
    a status is set by aborting the handler, never from inside a response generator."""
    try:
        initial = await call.initial_metadata()
        if initial:
            await context.send_initial_metadata(initial)
        async for message in call:
            await context.write(message)
        trailing = await call.trailing_metadata()
        if trailing:
            context.set_trailing_metadata(trailing)
    except grpc.aio.AioRpcError as exc:
        on_error(exc.code().name)
        await _abort(context, to_call_error(exc))


class ProxyServer:
    """Owns the grpc.aio server bound to the unix socket."""

    def __init__(self, *, listen: Path, socket_mode: int, max_message_bytes: int, handler: ProxyHandler,
                 receive_slack: int = 0) -> None:
        self._listen = listen
        self._mode = socket_mode
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes + receive_slack),
                ("grpc.so_reuseport", 0),
                ("grpc.http2.bdp_probe", 0),  # as the backend channels (grpcbackend.channel_options)
            ]
        )
        self._server.add_generic_rpc_handlers((handler,))
        self._handler = handler
        self._bound: tuple[int, int] | None = None

    async def start(self) -> None:
        prepare_socket(self._listen)
        self._server.add_insecure_port("unix://" + str(self._listen))  # binds: the file exists now
        self._bound = socket_identity(self._listen)
        await self._server.start()
        os.chmod(self._listen, self._mode)
        log.info("listening", socket=str(self._listen), mode=oct(self._mode))

    def unlisten(self) -> None:
        """Remove the socket path: from here on a fresh connect fails with ENOENT (UNAVAILABLE).

        grpc core closes its listener asynchronously after shutdown begins, so a connect
        racing the shutdown can still be accepted and its call then cancelled (CANCELLED,
        not the UNAVAILABLE kubelet retries on). Removing the path first closes that window.
        """
        unlink_bound(self._listen, self._bound)

    async def stop(self, grace: float) -> None:
        """Refuse new calls, let in-flight ones finish within ``grace``.

        The intercepted calls in flight are waited for before grpc's own stop, which sends
        GOAWAY at once: behind HAProxy (2.6) a stream whose server said GOAWAY before its
        reply's trailers reaches kubelet as a bare DATA frame with END_STREAM (UNKNOWN,
        measured). HAProxy sends no new call here meanwhile (the server is in maint). On
        kubelet's own socket (the grpc plane) grpc's stop comes first: new calls on open
        connections are refused at once."""
        self.unlisten()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self._handler.intercept_only and self._handler.intercepting and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        await self._server.stop(max(0.0, deadline - loop.time()))
