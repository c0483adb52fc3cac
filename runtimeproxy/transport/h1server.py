"""The interception server behind HAProxy: gRPC over HTTP/1.1 on the event loop.

With ``data_plane: haproxy`` only the lifecycle calls reach Python. HAProxy converts
kubelet's HTTP/2 stream to an HTTP/1.1 request on a private unix socket and our reply
back to HTTP/2, trailers included. Parsing HTTP/1.1 (httptools: llhttp, in C) on the loop
costs about half of what grpc.aio's server costs per call, in latency and in CPU
(docs/benchmarks.md, "interception hop"): grpc.aio hands every message from its core
threads through a poller thread to the loop.

What gRPC carries is kept (``runtimeproxy.transport.grpcwire``): the request's metadata and
``grpc-timeout`` (the call's deadline: the lifecycle is cancelled when it passes),
the reply's initial and trailing metadata, status, message and details; an error is a
trailers-only reply. A cancelled call is a closed connection: HAProxy closes ours when
kubelet resets the stream, and the lifecycle call is cancelled as grpc.aio would do.
HAProxy sends one call at a time on a connection (no pipelining) and keeps idle
connections for the next call (``http-reuse always``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import httptools
import structlog

from runtimeproxy.backend import CallError, Code, Reply
from runtimeproxy.lifecycle import intercept
from runtimeproxy.lifecycle.handler import CallInfo, Lifecycle
from runtimeproxy.ops.promstats import MethodStats, ProxyMetrics
from runtimeproxy.transport import grpcwire
from runtimeproxy.transport.grpcserver import prepare_socket, socket_identity, unlink_bound

log = structlog.get_logger("runtimeproxy.h1server")

_OK_HEAD: Final = b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\n"
_BAD_REQUEST: Final = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def reply_bytes(reply: Reply, max_bytes: int) -> bytes:
    """A successful reply: headers, the message in one chunk, grpc-status 0 in the trailers."""
    if len(reply.payload) > max_bytes:
        raise CallError(Code.RESOURCE_EXHAUSTED, f"reply of {len(reply.payload)} bytes, more than {max_bytes}")
    message = grpcwire.frame(reply.payload)
    return b"".join((
        _OK_HEAD, grpcwire.encode_metadata(reply.initial_metadata), b"transfer-encoding: chunked\r\n\r\n",
        b"%x\r\n" % len(message), message, b"\r\n0\r\ngrpc-status: 0\r\n",
        grpcwire.encode_metadata(reply.trailing_metadata), b"\r\n",
    ))


def error_bytes(err: CallError) -> bytes:
    """A trailers-only reply: the status, message and trailing metadata in the one header
    block (HAProxy drops ``content-length`` and ends the HTTP/2 stream with it)."""
    try:
        trailing = grpcwire.encode_metadata(err.trailing_metadata)
    except CallError:
        trailing = b""  # the status still reaches kubelet
    message = b"grpc-message: " + grpcwire.encode_message(err.details) + b"\r\n" if err.details else b""
    return b"".join((_OK_HEAD, b"grpc-status: %d\r\n" % int(err.code), message, trailing,
                     b"content-length: 0\r\n\r\n"))


class H1InterceptServer:
    """Serves the lifecycle methods to HAProxy on a private unix socket (mode 0600)."""

    def __init__(self, *, listen: Path, lifecycle: Lifecycle, metrics: ProxyMetrics, max_message_bytes: int) -> None:
        self._listen = listen
        self._lifecycle = lifecycle
        self.max_bytes = max_message_bytes
        self._stats: Mapping[str, MethodStats] = {
            m: metrics.method(m, path="intercepted") for m in sorted(lifecycle.methods)
        }
        #: Lifecycle calls being handled now (a drain waits for 0, see App.shutdown).
        self.intercepting = 0
        self._server: asyncio.AbstractServer | None = None
        self._bound: tuple[int, int] | None = None
        self.connections: set[_Connection] = set()

    async def start(self) -> None:
        prepare_socket(self._listen)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), str(self._listen))
        self._bound = socket_identity(self._listen)
        os.chmod(self._listen, 0o600)
        log.info("listening", socket=str(self._listen), transport="http/1.1")

    def unlisten(self) -> None:
        """Remove the socket path and stop accepting: new connections fail (HAProxy answers
        kubelet UNAVAILABLE); calls on open connections go on."""
        if self._server is not None:
            self._server.close()
        unlink_bound(self._listen, self._bound)

    async def stop(self, grace: float) -> None:
        """Let the calls in flight finish within ``grace``, then close every connection
        (a call still running is cancelled)."""
        self.unlisten()
        deadline = asyncio.get_running_loop().time() + grace
        while self.intercepting and asyncio.get_running_loop().time() < deadline:  # noqa: ASYNC110 - a counter
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def respond(self, url: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
        """The HTTP/1.1 reply to one call."""
        method = url.decode("latin-1")
        stats = self._stats.get(method)
        if stats is None:
            return error_bytes(CallError(Code.UNIMPLEMENTED, f"koord-runtime-proxy does not intercept {method}"))
        try:
            info, request = self._decode(headers, body)
        except CallError as err:
            stats.error(err.code.name)
            return error_bytes(err)
        self.intercepting += 1
        try:
            if info.timeout is None:
                reply = await intercept.serve(self._lifecycle, stats, method, request, info)
            else:
                async with asyncio.timeout(info.timeout):
                    reply = await intercept.serve(self._lifecycle, stats, method, request, info)
        except CallError as err:  # counted by intercept.serve
            return error_bytes(err)
        except TimeoutError:
            stats.error("DEADLINE_EXCEEDED")
            return error_bytes(CallError(Code.DEADLINE_EXCEEDED, "Deadline Exceeded"))
        finally:
            self.intercepting -= 1
        try:
            return reply_bytes(reply, self.max_bytes)
        except CallError as err:  # a reply we cannot relay (too big, metadata no header can carry)
            stats.error(err.code.name)
            return error_bytes(err)

    def _decode(self, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[CallInfo, bytes]:
        timeout: float | None = None
        for name, value in headers:
            if name == b"grpc-timeout":
                timeout = grpcwire.parse_timeout(value)
            elif name == b"grpc-encoding" and value != b"identity":
                raise CallError(Code.UNIMPLEMENTED, f"grpc-encoding {value.decode('latin-1')!r} is not accepted")
        request = grpcwire.unframe(body, self.max_bytes, "request")
        return CallInfo(timeout, grpcwire.decode_metadata(headers)), request


class _Connection(asyncio.Protocol):
    """One HAProxy connection: one call at a time; its close cancels the call."""

    def __init__(self, server: H1InterceptServer) -> None:
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._task: asyncio.Task[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._size = 0

    # --- asyncio.Protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            log.warning("intercept_bad_request", error=str(exc))
            if self._transport is not None:
                self._transport.write(_BAD_REQUEST)
            self.close()

    def eof_received(self) -> bool:
        self.close()  # HAProxy gave up on the call (kubelet cancelled it or its deadline passed)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        if self._task is not None:
            self._task.cancel()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._transport is not None:
            self._transport.close()

    # --- httptools callbacks -------------------------------------------------------

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size <= self._server.max_bytes + 5:  # beyond: counted only, refused whole at the end
            self._body.append(body)

    def on_message_complete(self) -> None:
        if self._task is not None:  # a second request before our reply: HAProxy never pipelines
            log.warning("intercept_pipelined_request")
            self.close()
            return
        if self._size <= self._server.max_bytes + 5:
            body = b"".join(self._body)
        else:  # a frame header that says how big: unframe refuses it with RESOURCE_EXHAUSTED
            body = b"\0" + min(self._size - 5, 0xFFFFFFFF).to_bytes(4, "big")
        keep = self._parser.should_keep_alive()
        task = asyncio.get_running_loop().create_task(self._call(self._url, self._headers, body, keep))
        self._reset()
        self._task = task

    async def _call(self, url: bytes, headers: list[tuple[bytes, bytes]], body: bytes, keep: bool) -> None:
        try:
            out = await self._server.respond(url, headers, body)
        finally:
            self._task = None
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.write(out)
            if not keep:
                transport.close()
