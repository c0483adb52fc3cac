"""Pass-through: everything the proxy does not intercept is relayed as raw bytes,
with status, details, metadata and deadline, through the real App in front of a
fake containerd."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import grpc.aio
import pytest

from criapi import cri_v1_pb2 as cri
from runtimeproxy.transport import grpcbackend
from runtimeproxy.transport.grpcbackend import _UnknownMethodChannel

RT = "/runtime.v1.RuntimeService/"
STATUS = RT + "Status"
VERSION = RT + "Version"
EVENTS = RT + "GetContainerEvents"
FUTURE_UNARY = RT + "SomeFutureMethod"
FUTURE_STREAM = RT + "SomeFutureStream"
IMAGE_FUTURE = "/runtime.v1.ImageService/SomeFutureMethod"
LIST_IMAGES = "/runtime.v1.ImageService/ListImages"
EXEC_SYNC = RT + "ExecSync"
MiB = 1024 * 1024
#: grpc's server clock is coarse: even a direct call can show a few ms more than the
#: caller's timeout (measured: 2.0 s -> up to 2.0095 s). Enough slack for that, far
#: below the difference between two timeouts a test compares.
CLOCK_SLACK = 0.05


@pytest.mark.asyncio
async def test_known_unary_is_byte_exact_both_ways(answer, fake_runtime, start_proxy, wire) -> None:
    proxy = await start_proxy(fake_runtime)
    # Unknown field first, known field last: any parse + re-serialize would reorder them.
    request = wire.field(1999, b"kubelet-from-the-future") + cri.StatusRequest(verbose=True).SerializeToString()
    response = wire.field(2999, b"containerd-from-the-future") + cri.StatusResponse(
        info={"k": "v"}
    ).SerializeToString()
    assert cri.StatusRequest.FromString(request).SerializeToString() != request  # the check has teeth
    fake_runtime.answer(STATUS, answer(payload=response))

    got = await proxy.call(STATUS, request)

    assert got == response
    [seen] = fake_runtime.received(STATUS)
    assert seen.payload == request


@pytest.mark.asyncio
async def test_unknown_unary_method_is_relayed(answer, fake_runtime, start_proxy) -> None:
    proxy = await start_proxy(fake_runtime)
    fake_runtime.answer(
        FUTURE_UNARY,
        answer(payload=b"\x0a\x03new", initial_metadata=(("x-future", "1"),),
               trailing_metadata=(("x-future-trailer", "2"),)),
    )
    call = proxy.unary(FUTURE_UNARY)(b"\x08\x2a", timeout=5)
    assert await call == b"\x0a\x03new"
    assert ("x-future", "1") in tuple(await call.initial_metadata())
    assert ("x-future-trailer", "2") in tuple(await call.trailing_metadata())
    [seen] = fake_runtime.received(FUTURE_UNARY)
    assert seen.payload == b"\x08\x2a"


@pytest.mark.asyncio
async def test_unknown_streaming_method_is_relayed(answer, fake_runtime, start_proxy) -> None:
    proxy = await start_proxy(fake_runtime)
    fake_runtime.answer(FUTURE_STREAM, answer(stream=(b"one", b"", b"three")))
    got = [m async for m in proxy.unary_stream(FUTURE_STREAM)(b"req", timeout=5)]
    assert got == [b"one", b"", b"three"]
    assert [c.payload for c in fake_runtime.received(FUTURE_STREAM)] == [b"req"]


@pytest.mark.asyncio
async def test_method_unknown_to_the_backend_too_is_unimplemented(fake_runtime, start_proxy) -> None:
    proxy = await start_proxy(fake_runtime)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await proxy.call(RT + "Nope", b"x")
    assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert "koord-runtime-proxy" not in (err.value.details() or ""), "relayed: the backend's own answer"


@pytest.mark.asyncio
async def test_unknown_image_service_method_goes_to_the_backend(answer, fake_runtime, start_proxy) -> None:
    proxy = await start_proxy(fake_runtime)
    fake_runtime.answer(IMAGE_FUTURE, answer(payload=b"\x0a\x01i"))
    assert await proxy.call(IMAGE_FUTURE, b"\x08\x01") == b"\x0a\x01i"
    assert [c.payload for c in fake_runtime.received(IMAGE_FUTURE)] == [b"\x08\x01"]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "method",
    [
        "/containerd.services.version.v1.Version/Version",
        "/containerd.services.tasks.v1.Tasks/List",
        "/runtime.v1alpha2.RuntimeService/Version",
        "/runtime.v1.RuntimeService/",
        "/runtime.v1.RuntimeService/Version/x",
        "/grpc.health.v1.Health/Check",
        "/x.y/z",
    ],
)
async def test_non_cri_paths_are_answered_here_never_relayed(answer, fake_runtime, start_proxy, method) -> None:
    proxy = await start_proxy(fake_runtime)
    fake_runtime.answer(method, answer(payload=b"backend answered"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await proxy.call(method, b"")
    assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert "relays only the CRI services" in (err.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as streamed:
        _ = [m async for m in proxy.unary_stream(method)(b"", timeout=5)]
    assert streamed.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert method not in fake_runtime.methods(), "nothing but CRI reaches the backend"
    assert proxy.sample("koord_runtime_proxy_cri_errors_total", {"method": "*", "code": "UNIMPLEMENTED"}) == 2


@pytest.mark.asyncio
async def test_unknown_method_with_two_request_messages_is_refused(fake_runtime, start_proxy) -> None:
    proxy = await start_proxy(fake_runtime)
    call = proxy.channel.stream_stream(FUTURE_UNARY)(iter([b"a", b"b"]), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _ = [m async for m in call]
    assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert FUTURE_UNARY not in fake_runtime.methods()


@pytest.mark.asyncio
async def test_method_names_do_not_grow_the_handler(answer, fake_runtime, start_proxy) -> None:
    """Issue 14.4: 20 000 random method names took RSS 57 -> 249 MB (a handler, a channel
    callable and metric children cached per name). Handlers and metric series stay fixed."""
    proxy = await start_proxy(fake_runtime)
    handler = proxy.app.handler
    handlers_before = handler.cached_handlers()
    series_before = _series(proxy)
    for i in range(300):
        for method in (f"/x.y/{i}", f"{RT}Future{i}", f"/runtime.v1.ImageService/Future{i}"):
            with pytest.raises(grpc.aio.AioRpcError):
                await proxy.call(method, b"")
    assert handler.cached_handlers() == handlers_before
    # Two "*" series (calls and duration per CRI service) and the refused counter, not 900.
    assert _series(proxy) - series_before <= 2 * 16 + 4


def _series(proxy) -> int:
    return sum(len(family.samples) for family in proxy.app.registry.collect())


@pytest.mark.asyncio
async def test_container_events_stream_in_order(fake_runtime, start_proxy) -> None:
    proxy = await start_proxy(fake_runtime)
    request = cri.GetEventsRequest().SerializeToString()
    got = [cri.ContainerEventResponse.FromString(m) async for m in proxy.unary_stream(EVENTS)(request, timeout=5)]
    assert [(e.container_id, e.container_event_type) for e in got] == [("c0", 0), ("c1", 1), ("c2", 2)]


@pytest.mark.asyncio
async def test_stream_error_after_messages_is_relayed(answer, fake_runtime, start_proxy) -> None:
    proxy = await start_proxy(fake_runtime)
    fake_runtime.answer(
        EVENTS, answer(stream=(b"a",), code=grpc.StatusCode.ABORTED, details="containerd restarting")
    )
    got = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for message in proxy.unary_stream(EVENTS)(b"", timeout=5):
            got.append(message)
    assert got == [b"a"]
    assert err.value.code() is grpc.StatusCode.ABORTED
    assert err.value.details() == "containerd restarting"


@pytest.mark.asyncio
@pytest.mark.parametrize("method", [STATUS, FUTURE_UNARY], ids=["known", "unknown-method"])
async def test_backend_error_status_details_and_trailers_are_relayed(
    answer, fake_runtime, start_proxy, wire, method
) -> None:
    proxy = await start_proxy(fake_runtime)
    details_bin = wire.rpc_status(grpc.StatusCode.NOT_FOUND.value[0], "container c9 not found")
    fake_runtime.answer(
        method,
        answer(code=grpc.StatusCode.NOT_FOUND, details="container c9 not found: detail ü",
            trailing_metadata=(("grpc-status-details-bin", details_bin), ("x-backend-trailer", "t1")),
        ),
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await proxy.call(method, b"")
    exc = err.value
    assert exc.code() is grpc.StatusCode.NOT_FOUND
    assert exc.details() == "container c9 not found: detail ü"
    trailing = tuple(exc.trailing_metadata())
    assert ("grpc-status-details-bin", details_bin) in trailing
    assert ("x-backend-trailer", "t1") in trailing
    label = RT + "*" if method == FUTURE_UNARY else method  # unknown methods: one series per service
    errors = proxy.sample("koord_runtime_proxy_cri_errors_total", {"method": label, "code": "NOT_FOUND"})
    assert errors == 1


@pytest.mark.asyncio
async def test_metadata_flows_both_ways(answer, fake_runtime, start_proxy) -> None:
    proxy = await start_proxy(fake_runtime)
    fake_runtime.answer(
        STATUS,
        answer(payload=b"", initial_metadata=(("x-backend-initial", "i1"),),
               trailing_metadata=(("x-backend-trailer", "t1"), ("x-bin-bin", b"\x00\xff"))),
    )
    call = proxy.unary(STATUS)(b"", timeout=5, metadata=(("x-koord-test", "hello"), ("x-koord-bin", b"\x01\x02")))
    assert await call == b""
    assert ("x-backend-initial", "i1") in tuple(await call.initial_metadata())
    trailing = tuple(await call.trailing_metadata())
    assert ("x-backend-trailer", "t1") in trailing
    assert ("x-bin-bin", b"\x00\xff") in trailing
    [seen] = fake_runtime.received(STATUS)
    assert seen.md("x-koord-test") == ["hello"]
    assert seen.md("x-koord-bin") == [b"\x01\x02"]
    # The caller's per-hop headers are not duplicated onto the backend hop.
    assert len(seen.md("user-agent")) == 1


@pytest.mark.asyncio
async def test_streaming_metadata_flows_both_ways(answer, fake_runtime, start_proxy) -> None:
    proxy = await start_proxy(fake_runtime)
    fake_runtime.answer(
        EVENTS,
        answer(stream=(b"e",), initial_metadata=(("x-backend-initial", "i1"),),
               trailing_metadata=(("x-backend-trailer", "t1"),)),
    )
    call = proxy.unary_stream(EVENTS)(b"", timeout=5, metadata=(("x-koord-test", "s"),))
    assert [m async for m in call] == [b"e"]
    assert ("x-backend-initial", "i1") in tuple(await call.initial_metadata())
    assert ("x-backend-trailer", "t1") in tuple(await call.trailing_metadata())
    assert fake_runtime.received(EVENTS)[0].md("x-koord-test") == ["s"]


@pytest.mark.asyncio
@pytest.mark.parametrize("method", [STATUS, FUTURE_UNARY, EVENTS], ids=["unary", "unknown", "stream"])
async def test_deadline_is_propagated(answer, fake_runtime, start_proxy, method) -> None:
    proxy = await start_proxy(fake_runtime)
    if method == FUTURE_UNARY:
        fake_runtime.answer(FUTURE_UNARY, answer())
    for timeout in (3.0, 0.7):
        if method == EVENTS:
            _ = [m async for m in proxy.unary_stream(method)(b"", timeout=timeout)]
        else:
            await proxy.call(method, b"", timeout=timeout)
    first, second = (c.time_remaining for c in fake_runtime.received(method))
    assert first is not None and second is not None
    assert 3.0 - 1.0 < first <= 3.0 + CLOCK_SLACK
    assert 0 < second <= 0.7 + CLOCK_SLACK


@pytest.mark.asyncio
async def test_no_deadline_stays_no_deadline(fake_runtime, start_proxy) -> None:
    proxy = await start_proxy(fake_runtime)
    await proxy.call(STATUS, b"", timeout=None)
    [seen] = fake_runtime.received(STATUS)
    assert seen.time_remaining is None


@pytest.mark.asyncio
async def test_slow_backend_gives_deadline_exceeded(answer, fake_runtime, start_proxy) -> None:
    proxy = await start_proxy(fake_runtime)
    fake_runtime.answer(STATUS, answer(delay=5.0))
    start = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await proxy.call(STATUS, b"", timeout=0.3)
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    # At the deadline, not after the backend's 5 s: a bound seconds above 0.3 s, so a
    # loaded machine cannot fail it, and still below the backend's delay.
    assert time.monotonic() - start < 4.0


@pytest.mark.asyncio
async def test_messages_above_grpc_default_limit_pass(answer, fake_runtime, start_proxy) -> None:
    proxy = await start_proxy(fake_runtime)
    big_response = bytes(range(256)) * (12 * MiB // 256)
    big_request = b"\x5a" * (12 * MiB)
    fake_runtime.answer(LIST_IMAGES, answer(payload=big_response))
    fake_runtime.answer(EXEC_SYNC, answer(payload=b"ok"))

    assert await proxy.call(LIST_IMAGES, b"", timeout=20) == big_response
    assert await proxy.call(EXEC_SYNC, big_request, timeout=20) == b"ok"
    [seen] = fake_runtime.received(EXEC_SYNC)
    assert seen.payload == big_request


@pytest.mark.asyncio
async def test_backend_down_then_up_recovers_without_restart(
    short_dir: Path, idle_runtime, start_proxy, wait_until
) -> None:
    fake, backend = idle_runtime, short_dir / "late.sock"
    # The default reconnect back-off (no max_reconnect_backoff), as in production.
    proxy = await start_proxy(fake, backend_path=backend, wait_ready=False, backend={"runtime_endpoint": str(backend)})
    assert proxy.app.settings.backend.max_reconnect_backoff == 2.0
    assert not proxy.app.ready

    start = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await proxy.call(VERSION, b"", timeout=5)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - start < 4.0  # failed fast, not at the call's 5 s deadline

    await fake.start(backend)
    deadline = time.monotonic() + 10
    while True:
        try:
            reply = await proxy.call(VERSION, b"", timeout=2)
            break
        except grpc.aio.AioRpcError as exc:
            assert exc.code() is grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() < deadline, "proxy did not recover within 10 s"
            await asyncio.sleep(0.1)
    assert cri.VersionResponse.FromString(reply).runtime_name == "fake-containerd"
    await wait_until(lambda: proxy.app.ready, 10.0, "the proxy to become ready")


@pytest.mark.asyncio
async def test_passthrough_metrics_count_calls(answer, fake_runtime, start_proxy) -> None:
    proxy = await start_proxy(fake_runtime)
    before = proxy.calls_total(STATUS, "passthrough")
    for _ in range(3):
        await proxy.call(STATUS, b"")
    assert proxy.calls_total(STATUS, "passthrough") == before + 3
    assert proxy.calls_total(STATUS, "intercepted") == 0
    _ = [m async for m in proxy.unary_stream(EVENTS)(b"", timeout=5)]
    assert proxy.calls_total(EVENTS, "passthrough") == 1
    fake_runtime.answer(FUTURE_UNARY, answer())
    await proxy.call(FUTURE_UNARY, b"")
    # Unknown methods are counted per service: a bounded label set, whatever is called.
    assert proxy.calls_total(RT + "*", "passthrough") == 1
    assert proxy.calls_total(FUTURE_UNARY, "passthrough") == 0


@pytest.mark.asyncio
async def test_image_service_goes_to_its_own_endpoint(
    answer, fake_runtime, idle_runtime, start_proxy, short_dir: Path
) -> None:
    await idle_runtime.start(short_dir / "img.sock")
    idle_runtime.answer(LIST_IMAGES, answer(payload=b"\x0a\x00"))
    endpoints = {"runtime_endpoint": str(fake_runtime.path), "image_endpoint": str(short_dir / "img.sock")}
    proxy = await start_proxy(fake_runtime, backend=endpoints)
    assert await proxy.call(LIST_IMAGES, b"") == b"\x0a\x00"
    await proxy.call(STATUS, b"")
    assert idle_runtime.methods() == [LIST_IMAGES]
    assert LIST_IMAGES not in fake_runtime.methods()
    assert STATUS in fake_runtime.methods()


@pytest.mark.asyncio
async def test_unknown_method_channel_is_replaced_after_max_paths_and_closed_when_idle(fake_runtime) -> None:
    """grpc keeps ~140 B per distinct method path for a channel's life: client-chosen
    paths go over a channel replaced every ``max_paths`` paths, closed once idle."""
    unknown = _UnknownMethodChannel(f"unix://{fake_runtime.path}", [], max_paths=2)
    first = unknown._channel
    _, done_a = unknown.acquire(RT + "A")
    _, done_b = unknown.acquire(RT + "B")
    _, done_a2 = unknown.acquire(RT + "A")
    assert unknown._channel is first, "a path seen before is no new path"
    _, done_c = unknown.acquire(RT + "C")
    second = unknown._channel
    assert second is not first
    done_a()
    done_b()
    await asyncio.sleep(0.05)
    assert not first._channel.closed(), "a call still runs on the old channel"
    done_a2()
    deadline = time.monotonic() + 5
    while not first._channel.closed():
        assert time.monotonic() < deadline, "the idle old channel was not closed"
        await asyncio.sleep(0.01)
    done_c()
    assert not second._channel.closed(), "the current channel stays open"
    await unknown.close()
    assert second._channel.closed()


@pytest.mark.asyncio
async def test_unknown_methods_are_relayed_across_channel_replacements(
    answer, fake_runtime, start_proxy, monkeypatch
) -> None:
    monkeypatch.setattr(grpcbackend, "UNKNOWN_PATHS_PER_CHANNEL", 2)
    proxy = await start_proxy(fake_runtime)
    for i in range(7):
        fake_runtime.answer(f"{RT}Future{i}", answer(payload=f"r{i}".encode()))
    replies = [await proxy.call(f"{RT}Future{i % 7}", f"q{i}".encode()) for i in range(21)]
    assert replies == [f"r{i % 7}".encode() for i in range(21)]
    assert [c.payload for c in fake_runtime.received(f"{RT}Future3")] == [b"q3", b"q10", b"q17"]
