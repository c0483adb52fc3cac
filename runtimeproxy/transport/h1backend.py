"""The lifecycle's backend behind HAProxy: gRPC over HTTP/1.1 to HAProxy, HTTP/2 on to containerd.

The intercepted calls' own backend calls (the call itself, a status lookup) go to a
private HTTP/1.1 listener of the data plane, which relays them to containerd over its
HTTP/2 connection. Like ``h1server``, this avoids grpc.aio's per-message thread hops
(docs/benchmarks.md, "interception hop"). Idle connections are kept for the next call.

- deadline: sent as ``grpc-timeout`` (containerd enforces it) and kept here too: when it
  passes, the connection is closed (HAProxy then resets the stream to containerd) and
  the call fails DEADLINE_EXCEEDED;
- cancellation (the kubelet call went away): the connection is closed, likewise;
- status, message, details and metadata: as containerd sent them, trailers-only included;
- HAProxy not there (restarting): the call goes over the gRPC client (``fallback``)
  instead, so a lifecycle call, a status lookup or a noticed call's lookup never fails
  because the data plane is being restarted.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Final

import httptools
import structlog

from runtimeproxy.backend import Backend, CallError, Code, Metadata, Reply
from runtimeproxy.transport import grpcwire

log = structlog.get_logger("runtimeproxy.h1backend")

#: Idle connections kept (one per concurrent call beyond this is closed after its reply).
MAX_IDLE: Final = 8
_HEAD: Final = b" HTTP/1.1\r\nhost: containerd\r\ncontent-type: application/grpc\r\nte: trailers\r\n"


class _Lost(Exception):
    """The connection closed before the whole reply came."""


class _Reply:
    __slots__ = ("body", "headers", "keep", "status", "trailers")

    def __init__(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.trailers: list[tuple[bytes, bytes]] = []
        self.keep = True


class _Connection(asyncio.Protocol):
    """One connection to the data plane's HTTP/1.1 listener: one call at a time."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes + 5
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[_Reply] | None = None
        self._reply = _Reply()
        self._size = 0
        self._in_trailers = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def send(self, request: bytes) -> asyncio.Future[_Reply]:
        assert self._transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self._reply, self._size, self._in_trailers = _Reply(), 0, False
        self._transport.write(request)
        return self._waiter

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        if self._waiter is None or self._waiter.done():
            self.close()  # bytes nobody asked for: this connection cannot be trusted any more
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(CallError(Code.INTERNAL, f"malformed reply from the data plane: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        self.closed = True
        self._fail(_Lost())
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(_Lost())

    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    # --- httptools callbacks -------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        (self._reply.trailers if self._in_trailers else self._reply.headers).append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self._reply.status = self._parser.get_status_code()
        self._reply.keep = self._parser.should_keep_alive()
        self._in_trailers = True

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size <= self._max:
            self._reply.body.append(body)

    def on_message_complete(self) -> None:
        if self._size > self._max:
            too_big = f"reply of {self._size - 5} bytes, more than {self._max - 5}"
            self._fail(CallError(Code.RESOURCE_EXHAUSTED, too_big))
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(self._reply)


def to_reply(got: _Reply, max_bytes: int) -> Reply:
    """The call's reply, or its CallError, from what the data plane relayed."""
    status = message = None
    trailers_only = False
    for name, value in got.trailers or got.headers:
        if name == b"grpc-status":
            status, trailers_only = value, not got.trailers
        elif name == b"grpc-message":
            message = value
    code, details = grpcwire.status_of(got.status, status, message)
    trailing = grpcwire.decode_metadata(got.headers if trailers_only else got.trailers)
    if code != Code.OK:
        raise CallError(code, details, trailing)
    initial = () if trailers_only else grpcwire.decode_metadata(got.headers)
    return Reply(grpcwire.unframe(b"".join(got.body), max_bytes, "reply"), initial, trailing)


class H1Backend:
    """Implements ``runtimeproxy.backend.Backend`` over the data plane's HTTP/1.1 listener."""

    def __init__(self, socket: Path, *, max_message_bytes: int, fallback: Backend) -> None:
        self._socket = str(socket)
        self._max = max_message_bytes
        self._fallback = fallback
        self._idle: list[_Connection] = []
        #: Calls that went over the fallback because the data plane's listener was not there.
        self.fallbacks = 0
        self._falling_back = False

    async def unary(
        self, method: str, payload: bytes, *, timeout: float | None = None, metadata: Metadata = ()
    ) -> Reply:
        if len(payload) > self._max:
            raise CallError(Code.RESOURCE_EXHAUSTED, f"request of {len(payload)} bytes, more than {self._max}")
        head = b"POST " + method.encode("ascii") + _HEAD
        if timeout is not None:
            head += b"grpc-timeout: " + grpcwire.format_timeout(timeout) + b"\r\n"
        request = b"".join((head, grpcwire.encode_metadata(metadata),
                            b"content-length: %d\r\n\r\n" % (len(payload) + 5), grpcwire.frame(payload)))
        conn = await self._connection()
        if conn is None:
            if not self._falling_back:  # one line per episode, not per call
                log.info("lifecycle_backend_fallback", socket=self._socket, using="grpc",
                         reason="the data plane's listener is not there (restarting?)")
            self.fallbacks += 1
            self._falling_back = True
            return await self._fallback.unary(method, payload, timeout=timeout, metadata=metadata)
        self._falling_back = False
        try:
            if timeout is None:
                got = await conn.send(request)
            else:
                async with asyncio.timeout(timeout):
                    got = await conn.send(request)
        except TimeoutError:
            conn.close()
            raise CallError(Code.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except _Lost:
            conn.close()
            raise CallError(Code.UNAVAILABLE, "the data plane closed the connection before the reply") from None
        except BaseException:  # cancelled (kubelet's call went away), or a malformed reply
            conn.close()
            raise
        if got.keep and len(self._idle) < MAX_IDLE:
            self._idle.append(conn)
        else:
            conn.close()
        return to_reply(got, self._max)

    async def _connection(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        try:
            _, conn = await asyncio.get_running_loop().create_unix_connection(
                lambda: _Connection(self._max), self._socket)
        except OSError:
            return None
        return conn

    async def close(self) -> None:
        while self._idle:
            self._idle.pop().close()
