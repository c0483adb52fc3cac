"""Nothing of gRPC is lost on an intercepted call, through either data plane: the gRPC
transport (grpc.aio server and client in Python on kubelet's socket), and HAProxy in
front of the same grpc.aio server on the private interception socket (HTTP/2 both hops;
the lifecycle's own calls go over gRPC straight to the fake containerd).

RunPodSandbox always goes through Python (the store needs it). Status, message and
details, trailers-only errors, metadata both ways (``-bin`` too), ``grpc-timeout``,
cancellation, 16 MiB both ways and unknown fields, as test_dataplane_wire checks them
for pass-through calls.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import grpc.aio
import pytest
import pytest_asyncio

from criapi import cri_v1_pb2 as cri
from runtimeproxy.transport.grpcbackend import GrpcBackend
from tests.unit import h2raw
from tests.unit.test_dataplane_wire import CLOCK_SLACK, MiB

RT = "/runtime.v1.RuntimeService/"
RUN = RT + "RunPodSandbox"
UNKNOWN = b"\xfa\x06\x03abc"  # field 111, length-delimited: unknown to every CRI message


def _run_request(extra: bytes = b"", annotation: str = "") -> bytes:
    config = cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="p", namespace="n", uid="u"),
                                  annotations={"big": annotation} if annotation else {})
    return cri.RunPodSandboxRequest(config=config).SerializeToString() + extra


@pytest_asyncio.fixture
async def proxy(fake_runtime: Any, start_proxy: Any, plane: str) -> Any:
    p = await start_proxy(fake_runtime, data_plane=plane)
    # One interception server and one backend client on both planes: grpc.aio, gRPC.
    assert isinstance(p.app.lifecycle_backend, GrpcBackend) and p.app.lifecycle_backend is p.app.backend
    assert (p.app.data_plane is None) == (plane == "grpc")
    return p


def _intercepted(proxy: Any) -> float:
    return float(proxy.calls_total(RUN, "intercepted"))


@pytest.mark.asyncio
async def test_reply_and_unknown_fields_pass_both_ways(answer: Any, fake_runtime: Any, proxy: Any) -> None:
    reply = cri.RunPodSandboxResponse(pod_sandbox_id="sb-9").SerializeToString() + UNKNOWN
    fake_runtime.answer(RUN, answer(payload=reply))
    assert await proxy.call(RUN, _run_request(UNKNOWN)) == reply
    [seen] = fake_runtime.received(RUN)
    assert seen.payload.endswith(UNKNOWN)
    assert _intercepted(proxy) == 1


@pytest.mark.asyncio
async def test_error_status_details_and_trailers(answer: Any, fake_runtime: Any, proxy: Any, wire: Any) -> None:
    details_bin = wire.rpc_status(grpc.StatusCode.ALREADY_EXISTS.value[0], "name p_n_u_0 is reserved")
    fake_runtime.answer(RUN, answer(
        code=grpc.StatusCode.ALREADY_EXISTS, details="name \"p_n_u_0\" reserved: ü 100% %41",
        trailing_metadata=(("grpc-status-details-bin", details_bin), ("x-backend-trailer", "t1"))))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await proxy.call(RUN, _run_request())
    assert err.value.code() is grpc.StatusCode.ALREADY_EXISTS
    assert err.value.details() == "name \"p_n_u_0\" reserved: ü 100% %41"
    trailing = tuple(err.value.trailing_metadata())
    assert ("grpc-status-details-bin", details_bin) in trailing and ("x-backend-trailer", "t1") in trailing
    # No hop header turned into metadata on the way (HTTP/1.1's content-length, say).
    assert {k for k, _ in trailing} == {"grpc-status-details-bin", "x-backend-trailer"}, trailing
    assert _intercepted(proxy) == 1


@pytest.mark.asyncio
async def test_trailers_only_stays_trailers_only_and_a_reply_keeps_its_trailers(
    answer: Any, fake_runtime: Any, proxy: Any
) -> None:
    """On the wire (h2raw): an error is one HEADERS frame with END_STREAM, as direct."""
    def shapes(path: Any) -> list[tuple[int, int]]:
        return [(f.type, f.flags & h2raw.END_STREAM) for f in h2raw.unary(path, RUN, _run_request())]

    reply = [(h2raw.HEADERS, 0), (h2raw.DATA, 0), (h2raw.HEADERS, h2raw.END_STREAM)]
    for path in (fake_runtime.path, proxy.socket):
        assert await asyncio.to_thread(shapes, path) == reply, path
    fake_runtime.answer(RUN, answer(code=grpc.StatusCode.NOT_FOUND, details="no such image"))
    for path in (fake_runtime.path, proxy.socket):
        assert await asyncio.to_thread(shapes, path) == [(h2raw.HEADERS, h2raw.END_STREAM)], path
    await proxy.app.lifecycle.posts.settle()


@pytest.mark.asyncio
async def test_metadata_both_ways(answer: Any, fake_runtime: Any, proxy: Any) -> None:
    fake_runtime.answer(RUN, answer(
        payload=cri.RunPodSandboxResponse(pod_sandbox_id="sb-2").SerializeToString(),
        initial_metadata=(("x-backend-initial", "i1"), ("x-i-bin", b"\x00\x01")),
        trailing_metadata=(("x-backend-trailer", "t1"), ("x-bin-bin", b"\x00\xff\xfe"))))
    call = proxy.unary(RUN)(_run_request(), timeout=5,
                            metadata=(("x-koord-test", "hello world"), ("x-koord-bin", b"\x01\x02\xff")))
    assert cri.RunPodSandboxResponse.FromString(await call).pod_sandbox_id == "sb-2"
    initial = tuple(await call.initial_metadata())
    assert ("x-backend-initial", "i1") in initial and ("x-i-bin", b"\x00\x01") in initial
    trailing = tuple(await call.trailing_metadata())
    assert ("x-backend-trailer", "t1") in trailing and ("x-bin-bin", b"\x00\xff\xfe") in trailing
    [seen] = fake_runtime.received(RUN)
    assert seen.md("x-koord-test") == ["hello world"] and seen.md("x-koord-bin") == [b"\x01\x02\xff"]
    await proxy.app.lifecycle.posts.settle()


@pytest.mark.asyncio
async def test_deadline_reaches_the_backend_and_ends_the_call(answer: Any, fake_runtime: Any, proxy: Any) -> None:
    for timeout in (3.0, 0.7):
        await proxy.call(RUN, _run_request(), timeout=timeout)
    first, second = (c.time_remaining for c in fake_runtime.received(RUN))
    assert first is not None and 2.0 < first <= 3.0 + CLOCK_SLACK
    assert second is not None and 0 < second <= 0.7 + CLOCK_SLACK
    fake_runtime.answer(RUN, answer(delay=5.0))
    start = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await proxy.call(RUN, _run_request(), timeout=0.3)
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 2.0
    # The interception server is free again: the next call goes through at once.
    fake_runtime.answer(RUN, answer(payload=cri.RunPodSandboxResponse(pod_sandbox_id="sb-3").SerializeToString()))
    assert cri.RunPodSandboxResponse.FromString(await proxy.call(RUN, _run_request())).pod_sandbox_id == "sb-3"


@pytest.mark.asyncio
async def test_client_cancellation_reaches_the_backend(answer: Any, fake_runtime: Any, proxy: Any) -> None:
    """kubelet gives up on RunPodSandbox: containerd's handler is cancelled too, within a second."""
    started, cancelled = asyncio.Event(), asyncio.Event()

    def slow(_request: bytes) -> Any:
        started.set()
        return answer(delay=30.0)

    fake_runtime.answer(RUN, slow)
    original = fake_runtime.unary

    async def unary(method: str, request: bytes, context: Any) -> bytes:
        try:
            return await original(method, request, context)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    fake_runtime.unary = unary
    call = proxy.unary(RUN)(_run_request(), timeout=30)
    await asyncio.wait_for(started.wait(), 5)
    call.cancel()
    await asyncio.wait_for(cancelled.wait(), 1.0)
    with pytest.raises(asyncio.CancelledError):
        await call


@pytest.mark.asyncio
async def test_16_mib_messages_both_ways(answer: Any, fake_runtime: Any, proxy: Any) -> None:
    size = 16 * MiB - 256
    # Field 99, length-delimited, ~16 MiB: unknown to the proxy, relayed as bytes.
    filler = b"z" * (size - 64)
    length = len(filler)
    varint = bytearray()
    while True:
        byte, length = length & 0x7F, length >> 7
        varint.append(byte | (0x80 if length else 0))
        if not length:
            break
    big_reply = cri.RunPodSandboxResponse(pod_sandbox_id="sb-4").SerializeToString() + b"\x9a\x06" + bytes(
        varint) + filler
    fake_runtime.answer(RUN, answer(payload=big_reply))
    request = _run_request(annotation="a" * (size - 200))
    assert await proxy.call(RUN, request, timeout=30) == big_reply
    assert fake_runtime.received(RUN)[0].payload == request
    # One byte over the limit: refused before containerd, RESOURCE_EXHAUSTED.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await proxy.call(RUN, _run_request(annotation="a" * (16 * MiB)), timeout=30)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(fake_runtime.received(RUN)) == 1


@pytest.mark.asyncio
async def test_concurrent_calls_each_get_their_own_reply(answer: Any, fake_runtime: Any, proxy: Any) -> None:
    """kubelet's pod workers start pods in parallel: 20 RunPodSandbox calls in flight at once
    (HAProxy multiplexes them as streams to Python), each answered with its own sandbox id."""
    arrived: list[float] = []

    def by_name(request: bytes) -> Any:
        arrived.append(time.monotonic())
        name = cri.RunPodSandboxRequest.FromString(request).config.metadata.name
        return answer(payload=cri.RunPodSandboxResponse(pod_sandbox_id="sb-" + name).SerializeToString(), delay=1.0)

    fake_runtime.answer(RUN, by_name)

    async def one(i: int) -> str:
        request = cri.RunPodSandboxRequest(config=cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name=f"p{i}", namespace="n", uid=f"u{i}"))).SerializeToString()
        return cri.RunPodSandboxResponse.FromString(await proxy.call(RUN, request, timeout=20)).pod_sandbox_id

    got = await asyncio.gather(*(one(i) for i in range(20)))
    assert got == [f"sb-p{i}" for i in range(20)]
    assert len(arrived) == 20 and max(arrived) - min(arrived) < 1.0  # all in flight before the first answered


@pytest.mark.asyncio
async def test_a_drain_lets_the_call_in_flight_finish_with_its_reply(
    answer: Any, fake_runtime: Any, start_proxy: Any, plane: str
) -> None:
    """SIGTERM while RunPodSandbox calls are in flight: each gets its reply, trailers and all.
    Behind HAProxy the server's GOAWAY waits for the calls in flight: HAProxy 2.6 ends a
    stream whose server sent GOAWAY before its trailers with a bare DATA frame (UNKNOWN)."""
    proxy = await start_proxy(fake_runtime, data_plane=plane, shutdown_grace="5s")
    reply = cri.RunPodSandboxResponse(pod_sandbox_id="sb-drain").SerializeToString()
    fake_runtime.answer(RUN, answer(payload=reply, delay=1.5))
    calls = [asyncio.ensure_future(proxy.call(RUN, _run_request(), timeout=10)) for _ in range(3)]
    await asyncio.sleep(0.5)
    assert not any(call.done() for call in calls)
    proxy.app.request_stop()
    assert await asyncio.gather(*calls) == [reply] * 3
    assert await asyncio.wait_for(proxy.task, timeout=15) == 0
