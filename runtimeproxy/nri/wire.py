"""NRI's transport: one unix stream, two ttRPC channels multiplexed over it.

The only module that knows bytes (shared/reference/nri-protocol.md sections 4-5);
protobuf (``criapi.ttrpc_pb2``) encodes every body. Layers, outside in:

* mux frame: 8-byte header (channel id, payload length; both uint32 big-endian), then
  the payload, a slice of that channel's byte stream. Frames we send carry at most
  ``MAX_FRAME_PAYLOAD`` (4096) bytes: containerd reads one frame into a 4096-byte
  buffer and drops the plugin on a bigger one. Frames we receive can be bigger, and
  a ttRPC message can span frames: each channel's payloads are concatenated first.
* ttRPC message: 10-byte header (data length, stream id: uint32 BE; type, flags:
  uint8), then a serialized ``ttrpc.Request`` (type 1) or ``ttrpc.Response`` (type 2).
  NRI uses unary calls only.

Channel 1 carries the Plugin service (containerd calls, we answer: ``Handler``);
channel 2 the Runtime service (we call: ``Connection.call``). Configure arrives
before the RegisterPlugin reply, so the reader never waits on a call it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Final, Protocol, TypeVar

import structlog
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as PbMessage

from criapi import ttrpc_pb2
from runtimeproxy.errors import PeerError

log = structlog.get_logger("runtimeproxy.nri.wire")

MUX_HEADER: Final = struct.Struct(">II")
TTRPC_HEADER: Final = struct.Struct(">IIBB")
#: The most payload bytes one frame we send may carry (containerd's read buffer).
MAX_FRAME_PAYLOAD: Final = 4096
#: ttRPC's message limit; a bigger one is refused, not buffered.
MAX_MESSAGE: Final = 4 << 20
PLUGIN_CHANNEL: Final = 1
RUNTIME_CHANNEL: Final = 2
REQUEST: Final = 1
RESPONSE: Final = 2
PLUGIN_SERVICE: Final = "nri.pkg.api.v1alpha1.Plugin"
RUNTIME_SERVICE: Final = "nri.pkg.api.v1alpha1.Runtime"
#: gRPC status codes used here.
UNKNOWN: Final = 2
INVALID_ARGUMENT: Final = 3
RESOURCE_EXHAUSTED: Final = 8
UNIMPLEMENTED: Final = 12


class ProtocolError(PeerError):
    """The peer broke the framing: the connection cannot go on."""


class RpcError(PeerError):
    """A ttRPC error status, ours to send (a handler raises it) or the peer's (a call got it)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Message:
    """One ttRPC message, header fields and data."""

    stream: int
    kind: int
    flags: int
    data: bytes


def encode_message(msg: Message) -> bytes:
    return TTRPC_HEADER.pack(len(msg.data), msg.stream, msg.kind, msg.flags) + msg.data


def frames(channel: int, payload: bytes, limit: int = MAX_FRAME_PAYLOAD) -> Iterator[bytes]:
    """``payload`` (one or more ttRPC messages) as mux frames of at most ``limit`` bytes."""
    for start in range(0, max(len(payload), 1), limit):
        chunk = payload[start:start + limit]
        yield MUX_HEADER.pack(channel, len(chunk)) + chunk


class Demux:
    """Bytes in, (channel, ttRPC message) out: frames cut from the stream, each channel's
    payloads concatenated, messages cut from that (they need not align with frames)."""

    def __init__(self) -> None:
        self._stream = bytearray()
        self._channels: dict[int, bytearray] = {}

    def feed(self, data: bytes) -> list[tuple[int, Message]]:
        self._stream += data
        out: list[tuple[int, Message]] = []
        while len(self._stream) >= MUX_HEADER.size:
            channel, length = MUX_HEADER.unpack_from(self._stream)
            if length > MAX_MESSAGE + TTRPC_HEADER.size:
                raise ProtocolError(f"mux frame of {length} bytes on channel {channel}")
            end = MUX_HEADER.size + length
            if len(self._stream) < end:
                break
            buf = self._channels.setdefault(channel, bytearray())
            buf += self._stream[MUX_HEADER.size:end]
            del self._stream[:end]
            out.extend((channel, msg) for msg in _cut(buf))
        return out


def _cut(buf: bytearray) -> Iterator[Message]:
    while len(buf) >= TTRPC_HEADER.size:
        length, stream, kind, flags = TTRPC_HEADER.unpack_from(buf)
        if length > MAX_MESSAGE:
            raise ProtocolError(f"ttrpc message of {length} bytes (limit {MAX_MESSAGE})")
        end = TTRPC_HEADER.size + length
        if len(buf) < end:
            return
        data = bytes(buf[TTRPC_HEADER.size:end])
        del buf[:end]
        yield Message(stream, kind, flags, data)


class Handler(Protocol):
    """Serves channel 1: the serialized reply of ``method``, or RpcError."""

    async def __call__(self, method: str, payload: bytes, timeout: float | None) -> bytes: ...


R = TypeVar("R", bound=PbMessage)


class Connection:
    """One NRI connection: calls on channel 2, served requests on channel 1.

    ``serve()`` reads until EOF or a protocol error; each request it reads is handled
    in a task of its own (answers in any order, by stream id)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler) -> None:
        self._reader, self._writer, self._handler = reader, writer, handler
        self._next_stream = 1
        self._pending: dict[int, asyncio.Future[ttrpc_pb2.Response]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = asyncio.Event()

    @classmethod
    async def open(cls, path: str, handler: Handler) -> Connection:
        reader, writer = await asyncio.open_unix_connection(path)
        return cls(reader, writer, handler)

    def _send(self, channel: int, msg: Message) -> None:
        # One write of all the frames: nothing of another message can land inside them.
        self._writer.write(b"".join(frames(channel, encode_message(msg))))

    async def call(self, method: str, request: PbMessage, response: type[R], *, timeout: float) -> R:
        """A Runtime-service call (channel 2); RpcError for an error status."""
        if self.closed.is_set():
            raise ConnectionError("NRI connection closed")
        stream, self._next_stream = self._next_stream, self._next_stream + 2
        req = ttrpc_pb2.Request(service=RUNTIME_SERVICE, method=method, payload=request.SerializeToString(),
                                timeout_nano=int(timeout * 1e9))
        waiter: asyncio.Future[ttrpc_pb2.Response] = asyncio.get_running_loop().create_future()
        self._pending[stream] = waiter
        try:
            self._send(RUNTIME_CHANNEL, Message(stream, REQUEST, 0, req.SerializeToString()))
            await self._writer.drain()
            reply = await asyncio.wait_for(waiter, timeout)
        finally:
            self._pending.pop(stream, None)
        if reply.HasField("status") and reply.status.code != 0:
            raise RpcError(reply.status.code, reply.status.message)
        return response.FromString(reply.payload)

    async def serve(self) -> None:
        """Read and dispatch until the peer closes; ProtocolError on broken framing."""
        demux = Demux()
        try:
            while True:
                data = await self._reader.read(65536)
                if not data:
                    return
                for channel, msg in demux.feed(data):
                    self._dispatch(channel, msg)
        finally:
            self.close()

    def _dispatch(self, channel: int, msg: Message) -> None:
        if channel == RUNTIME_CHANNEL and msg.kind == RESPONSE:
            waiter = self._pending.get(msg.stream)
            if waiter is not None and not waiter.done():
                try:
                    waiter.set_result(ttrpc_pb2.Response.FromString(msg.data))
                except DecodeError as exc:
                    waiter.set_exception(ProtocolError(f"undecodable ttrpc response: {exc}"))
        elif channel == PLUGIN_CHANNEL and msg.kind == REQUEST:
            task = asyncio.get_running_loop().create_task(self._answer(msg), name=f"nri-request:{msg.stream}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            log.debug("nri_frame_ignored", channel=channel, kind=msg.kind, stream=msg.stream)

    async def _answer(self, msg: Message) -> None:
        reply = ttrpc_pb2.Response()
        try:
            req = ttrpc_pb2.Request.FromString(msg.data)
            if req.service != PLUGIN_SERVICE:
                raise RpcError(UNIMPLEMENTED, f"service {req.service}")
            timeout = req.timeout_nano / 1e9 if req.timeout_nano > 0 else None
            payload = await self._handler(req.method, req.payload, timeout)
            if payload:
                reply.payload = payload
        except RpcError as err:
            reply.status.code, reply.status.message = err.code, err.message
        except DecodeError as exc:
            reply.status.code, reply.status.message = INVALID_ARGUMENT, f"undecodable request: {exc}"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must still answer: silence would cost containerd its 2 s timeout
            log.exception("nri_handler_internal_error")
            reply.status.code, reply.status.message = UNKNOWN, f"koord-runtime-proxy: {type(exc).__name__}: {exc}"
        if self.closed.is_set():
            return
        self._send(PLUGIN_CHANNEL, Message(msg.stream, RESPONSE, 0, reply.SerializeToString()))
        with contextlib.suppress(ConnectionError):
            await self._writer.drain()

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for waiter in self._pending.values():
            if not waiter.done():
                waiter.set_exception(ConnectionError("NRI connection closed"))
        for task in list(self._tasks):
            task.cancel()
        self._writer.close()


#: What a request handler for one method looks like (see runtimeproxy.nri.plugin).
MethodHandler = Callable[[bytes, float | None], Awaitable[bytes]]
