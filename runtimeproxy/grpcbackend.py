"""The gRPC client side of the transport: raw-bytes calls to containerd.

No serializers are configured, so requests and replies cross as the exact bytes
kubelet and containerd produced. The channels reconnect with a short back-off so
a restarted containerd is noticed within seconds, and calls never wait for a
connection (``wait_for_ready`` off): kubelet gets UNAVAILABLE at once while the
backend is down, as it would talking to containerd directly.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import grpc
import grpc.aio

from runtimeproxy.backend import CallError, Code, Metadata, Reply
from runtimeproxy.config import BackendSettings

IMAGE_SERVICE: Final = "/runtime.v1.ImageService/"


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
    ]


def to_call_error(exc: grpc.aio.AioRpcError) -> CallError:
    code = exc.code()
    return CallError(Code(code.value[0]), exc.details() or "", tuple(exc.trailing_metadata() or ()))


class GrpcBackend:
    """Implements ``runtimeproxy.backend.Backend`` and the streaming calls the
    gRPC transport needs for pass-through."""

    def __init__(self, settings: BackendSettings, *, max_message_bytes: int) -> None:
        options = channel_options(max_message_bytes, settings.max_reconnect_backoff)
        self._runtime = grpc.aio.insecure_channel("unix://" + settings.runtime_endpoint, options=options)
        self._image = self._runtime
        if settings.image_endpoint and settings.image_endpoint != settings.runtime_endpoint:
            self._image = grpc.aio.insecure_channel("unix://" + settings.image_endpoint, options=options)

    def channel_for(self, method: str) -> grpc.aio.Channel:
        return self._image if method.startswith(IMAGE_SERVICE) else self._runtime

    def unary_callable(self, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
        return self.channel_for(method).unary_unary(method)

    def unary_stream_callable(self, method: str) -> grpc.aio.UnaryStreamMultiCallable:
        return self.channel_for(method).unary_stream(method)

    def stream_stream_callable(self, method: str) -> grpc.aio.StreamStreamMultiCallable:
        return self.channel_for(method).stream_stream(method)

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
        if self._image is not self._runtime:
            await self._image.close()


def forwardable(metadata: Iterable[tuple[str, str | bytes]] | None) -> Metadata:
    """Caller metadata minus what grpc sets per hop itself."""
    if not metadata:
        return ()
    return tuple(kv for kv in metadata if kv[0] not in _HOP_HEADERS)


_HOP_HEADERS: Final = frozenset({"user-agent", "grpc-accept-encoding", "grpc-encoding", "grpc-timeout"})
