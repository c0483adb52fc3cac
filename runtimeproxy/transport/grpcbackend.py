"""The gRPC client side of the transport: raw-bytes calls to containerd.

No serializers are configured, so requests and replies cross as the exact bytes
kubelet and containerd produced. The channels reconnect with a short back-off so
a restarted containerd is noticed within seconds, and calls never wait for a
connection (``wait_for_ready`` off): kubelet gets UNAVAILABLE at once while the
backend is down, as it would talking to containerd directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Final

import grpc
import grpc.aio

from runtimeproxy.backend import IMAGE_SERVICE, CallError, Code, Metadata, Reply
from runtimeproxy.config.settings import BackendSettings

#: Distinct unknown CRI method paths one backend channel carries before it is replaced.
UNKNOWN_PATHS_PER_CHANNEL: Final = 256


def channel_options(max_message_bytes: int, max_backoff: float) -> list[tuple[str, int]]:
    backoff_ms = max(int(max_backoff * 1000), 100)
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", min(100, backoff_ms)),
        ("grpc.min_reconnect_backoff_ms", min(100, backoff_ms)),
        ("grpc.max_reconnect_backoff_ms", backoff_ms),
        # Two unix-socket channels to one peer must not be merged into one subchannel.
        ("grpc.use_local_subchannel_pool", 1),
        # No BDP pings: on a unix socket they tune nothing (a 4 MB reply took the same
        # time either way), yet each call's ping and ack woke grpc's four event-engine
        # threads for another second of polling back-off (issue 29: 32 -> 13 wake-ups/s).
        ("grpc.http2.bdp_probe", 0),
    ]


def to_call_error(exc: grpc.aio.AioRpcError) -> CallError:
    code = exc.code()
    return CallError(Code(code.value[0]), exc.details() or "", tuple(exc.trailing_metadata() or ()))


class _UnknownMethodChannel:
    """The channel for CRI methods this proxy does not know, replaced every
    ``max_paths`` distinct paths.

    grpc keeps state per method path on a channel for as long as the channel lives
    (measured: ~140 bytes per distinct path, never freed), and these paths are chosen
    by the client. So they do not go over the long-lived channel: this one is replaced
    after ``max_paths`` distinct paths and closed when its last call has ended. A real
    kubelet uses a handful of new methods and never causes a replacement.
    """

    def __init__(self, target: str, options: list[tuple[str, int]], max_paths: int) -> None:
        self._target, self._options, self._max_paths = target, options, max_paths
        self._closing: set[asyncio.Task[None]] = set()
        self._open()

    def _open(self) -> None:
        self._channel = grpc.aio.insecure_channel(self._target, options=self._options)
        self._paths: set[str] = set()
        self._calls = [0]  # in-flight calls on this channel, shared with their release()

    def acquire(self, method: str) -> tuple[grpc.aio.UnaryStreamMultiCallable, Callable[[], None]]:
        if method not in self._paths:
            if len(self._paths) >= self._max_paths:
                self._retire()
            self._paths.add(method)
        channel, calls = self._channel, self._calls
        calls[0] += 1

        def release() -> None:
            calls[0] -= 1
            if calls[0] == 0 and channel is not self._channel:
                self._close_later(channel)

        return channel.unary_stream(method), release

    def _retire(self) -> None:
        old, calls = self._channel, self._calls
        self._open()
        if calls[0] == 0:
            self._close_later(old)

    def _close_later(self, channel: grpc.aio.Channel) -> None:
        task = asyncio.get_running_loop().create_task(channel.close(), name="backend:close-unknown-channel")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        await self._channel.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


class GrpcBackend:
    """Implements ``runtimeproxy.backend.Backend`` and the streaming calls the
    gRPC transport needs for pass-through."""

    def __init__(self, settings: BackendSettings, *, max_message_bytes: int) -> None:
        options = channel_options(max_message_bytes, settings.max_reconnect_backoff)
        runtime = "unix://" + settings.runtime_endpoint
        self._runtime = grpc.aio.insecure_channel(runtime, options=options)
        self._image = self._runtime
        self._unknown_runtime = _UnknownMethodChannel(runtime, options, UNKNOWN_PATHS_PER_CHANNEL)
        self._unknown_image = self._unknown_runtime
        if settings.image_endpoint and settings.image_endpoint != settings.runtime_endpoint:
            image = "unix://" + settings.image_endpoint
            self._image = grpc.aio.insecure_channel(image, options=options)
            self._unknown_image = _UnknownMethodChannel(image, options, UNKNOWN_PATHS_PER_CHANNEL)

    def channel_for(self, method: str) -> grpc.aio.Channel:
        return self._image if method.startswith(IMAGE_SERVICE) else self._runtime

    def unary_callable(self, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
        return self.channel_for(method).unary_unary(method)

    def unary_stream_callable(self, method: str) -> grpc.aio.UnaryStreamMultiCallable:
        return self.channel_for(method).unary_stream(method)

    def stream_stream_callable(self, method: str) -> grpc.aio.StreamStreamMultiCallable:
        return self.channel_for(method).stream_stream(method)

    def unknown_method_callable(
        self, method: str
    ) -> tuple[grpc.aio.UnaryStreamMultiCallable, Callable[[], None]]:
        """A callable for a CRI method our protos do not know, and the ``release()`` to call
        when that call has ended (see ``_UnknownMethodChannel``)."""
        unknown = self._unknown_image if method.startswith(IMAGE_SERVICE) else self._unknown_runtime
        return unknown.acquire(method)

    async def unary(
        self, method: str, payload: bytes, *, timeout: float | None = None, metadata: Metadata = ()
    ) -> Reply:
        call = self.unary_callable(method)(payload, timeout=timeout, metadata=metadata or None)
        try:
            response: bytes = await call
            initial = await call.initial_metadata()
            trailing = await call.trailing_metadata()
        except grpc.aio.AioRpcError as exc:
            raise to_call_error(exc) from None
        return Reply(response, tuple(initial or ()), tuple(trailing or ()))

    async def close(self) -> None:
        await self._runtime.close()
        await self._unknown_runtime.close()
        if self._image is not self._runtime:
            await self._image.close()
            await self._unknown_image.close()


def forwardable(metadata: Iterable[tuple[str, str | bytes]] | None) -> Metadata:
    """Caller metadata minus what grpc sets per hop itself."""
    if not metadata:
        return ()
    return tuple(kv for kv in metadata if kv[0] not in _HOP_HEADERS)


_HOP_HEADERS: Final = frozenset({"user-agent", "grpc-accept-encoding", "grpc-encoding", "grpc-timeout"})
