"""The gRPC server side of the transport: kubelet's endpoint.

Every method is served by one generic handler. The eight lifecycle methods go to
``Lifecycle``; everything else, including methods this proxy has never heard of,
is relayed as raw bytes with the caller's deadline and metadata, and the
backend's status, details and metadata are relayed back. Handlers are built once
per method and cached, so the pass-through path does no parsing, no logging and
no per-call lookups beyond its counters.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, Final, NoReturn

import grpc
import grpc.aio
import structlog

from criapi import cri_v1_pb2
from runtimeproxy.backend import CallError, Code, Reply
from runtimeproxy.grpcbackend import GrpcBackend, forwardable, to_call_error
from runtimeproxy.lifecycle import CallInfo, Lifecycle
from runtimeproxy.promstats import ProxyMetrics

log = structlog.get_logger("runtimeproxy.grpcserver")

_STATUS: Final[Mapping[int, grpc.StatusCode]] = {sc.value[0]: sc for sc in grpc.StatusCode}


class SocketInUse(Exception):
    """Another live process answers on our socket path."""


def known_methods() -> Mapping[str, bool]:
    """Full method path -> server-streaming, for every method in our CRI protos."""
    out: dict[str, bool] = {}
    for service in cri_v1_pb2.DESCRIPTOR.services_by_name.values():
        for m in service.methods:
            out[f"/{service.full_name}/{m.name}"] = m.server_streaming
    return out


def prepare_socket(path: Path) -> None:
    """Create parent dirs; replace a stale socket file, refuse a live one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() and not path.is_symlink():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTSOCK):
            raise
        path.unlink(missing_ok=True)
        log.info("stale_socket_removed", path=str(path))
        return
    finally:
        probe.close()
    raise SocketInUse(f"{path} is held by a live process (another koord-runtime-proxy?)")


async def _abort(context: grpc.aio.ServicerContext[Any, Any], err: CallError) -> NoReturn:
    await context.abort(_STATUS.get(int(err.code), grpc.StatusCode.UNKNOWN), err.details, err.trailing_metadata)
    raise AssertionError("unreachable: abort raises")  # pragma: no cover


async def _relay_metadata(context: grpc.aio.ServicerContext[Any, Any], reply: Reply) -> None:
    if reply.initial_metadata:
        await context.send_initial_metadata(reply.initial_metadata)
    if reply.trailing_metadata:
        context.set_trailing_metadata(reply.trailing_metadata)


class ProxyHandler(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc ships no types
    """Builds and caches one handler per method path."""

    def __init__(self, *, backend: GrpcBackend, lifecycle: Lifecycle, metrics: ProxyMetrics) -> None:
        self._backend = backend
        self._lifecycle = lifecycle
        self._metrics = metrics
        self._streaming = known_methods()
        self._intercepted = lifecycle.methods
        self._cache: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any]:
        method: str = handler_call_details.method
        handler = self._cache.get(method)
        if handler is None:
            handler = self._build(method)
            self._cache[method] = handler
        return handler

    def _build(self, method: str) -> grpc.RpcMethodHandler[Any, Any]:
        if method in self._intercepted:
            return grpc.unary_unary_rpc_method_handler(self._intercept(method))
        streaming = self._streaming.get(method)
        if streaming is False:
            return grpc.unary_unary_rpc_method_handler(self._unary(method))
        if streaming is True:
            return grpc.unary_stream_rpc_method_handler(self._unary_stream(method))
        # Unknown (newer CRI): a stream-stream relay carries any call shape on the wire.
        return grpc.stream_stream_rpc_method_handler(self._stream_stream(method))

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

        async def passthrough(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[bytes]:
            stats.calls.inc()
            call = multi(request, timeout=context.time_remaining(), metadata=forwardable(context.invocation_metadata()))
            async for message in _relay(call, context, stats.error):
                yield message

        return passthrough

    def _stream_stream(self, method: str) -> Callable[..., Any]:
        multi = self._backend.stream_stream_callable(method)
        stats = self._metrics.method(method, path="passthrough")

        async def passthrough(
            requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[bytes]:
            stats.calls.inc()
            metadata = forwardable(context.invocation_metadata())
            call = multi(requests, timeout=context.time_remaining(), metadata=metadata)
            async for message in _relay(call, context, stats.error):
                yield message

        return passthrough

    def _intercept(self, method: str) -> Callable[..., Any]:
        stats = self._metrics.method(method, path="intercepted")
        lifecycle = self._lifecycle

        async def intercepted(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            stats.calls.inc()
            start = time.perf_counter()
            info = CallInfo(context.time_remaining(), forwardable(context.invocation_metadata()))
            try:
                reply = await lifecycle.handle(method, request, info)
            except CallError as err:
                stats.error(err.code.name)
                await _abort(context, err)
            except Exception as exc:  # a bug must not end kubelet's call without a status
                log.exception("intercept_internal_error", method=method)
                stats.error("INTERNAL")
                await _abort(context, CallError(Code.INTERNAL, f"koord-runtime-proxy: {type(exc).__name__}: {exc}"))
            finally:
                stats.duration.observe(time.perf_counter() - start)
            await _relay_metadata(context, reply)
            return reply.payload

        return intercepted


async def _relay(
    call: Any, context: grpc.aio.ServicerContext[Any, Any], on_error: Callable[[str], None]
) -> AsyncIterator[bytes]:
    try:
        initial = await call.initial_metadata()
        if initial:
            await context.send_initial_metadata(initial)
        async for message in call:
            yield message
        trailing = await call.trailing_metadata()
        if trailing:
            context.set_trailing_metadata(trailing)
    except grpc.aio.AioRpcError as exc:
        on_error(exc.code().name)
        await _abort(context, to_call_error(exc))


class ProxyServer:
    """Owns the grpc.aio server bound to the unix socket."""

    def __init__(self, *, listen: Path, socket_mode: int, max_message_bytes: int, handler: ProxyHandler) -> None:
        self._listen = listen
        self._mode = socket_mode
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),
            ]
        )
        self._server.add_generic_rpc_handlers((handler,))

    async def start(self) -> None:
        prepare_socket(self._listen)
        self._server.add_insecure_port("unix://" + str(self._listen))
        await self._server.start()
        os.chmod(self._listen, self._mode)
        log.info("listening", socket=str(self._listen), mode=oct(self._mode))

    def unlisten(self) -> None:
        """Remove the socket path: from here on a fresh connect fails with ENOENT (UNAVAILABLE).

        grpc core closes its listener asynchronously after shutdown begins, so a connect
        racing the shutdown can still be accepted and its call then cancelled (CANCELLED,
        not the UNAVAILABLE kubelet retries on). Removing the path first closes that window.
        """
        with contextlib.suppress(FileNotFoundError):
            self._listen.unlink()

    async def stop(self, grace: float) -> None:
        """Refuse new calls, let in-flight ones finish within ``grace``."""
        self.unlisten()
        await self._server.stop(grace)
