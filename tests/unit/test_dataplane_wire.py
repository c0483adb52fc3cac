"""Nothing of gRPC is lost through either data plane: the in-process gRPC server and
HAProxy (a real ``haproxy`` child of the App) in front of the fake containerd.

Status codes, details and trailers (trailers-only errors included), metadata both
ways, ``grpc-timeout`` deadlines, 16 MiB messages both ways, server streaming,
unknown methods and fields; lifecycle methods still reach the interception server;
any non-CRI path is answered UNIMPLEMENTED and never reaches the backend.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
import pytest_asyncio
import structlog.testing
import yaml

from criapi import cri_v1_pb2 as cri
from tests.unit import h2raw
from tests.unit.conftest import need_haproxy

RT = "/runtime.v1.RuntimeService/"
STATUS = RT + "Status"
EVENTS = RT + "GetContainerEvents"
FUTURE_UNARY = RT + "SomeFutureMethod"
LIST_IMAGES = "/runtime.v1.ImageService/ListImages"
EXEC_SYNC = RT + "ExecSync"
NATIVE = "/containerd.services.version.v1.Version/Version"
MiB = 1024 * 1024
CLOCK_SLACK = 0.05


@pytest_asyncio.fixture
async def proxy(fake_runtime: Any, start_proxy: Any, plane: str) -> Any:
    p = await start_proxy(fake_runtime, data_plane=plane)
    if plane == "haproxy":
        assert p.app.data_plane is not None and p.app.data_plane.pid is not None, "haproxy must be running"
    else:
        assert p.app.data_plane is None
    return p


@pytest.mark.asyncio
async def test_reply_bytes_and_unknown_fields_pass_unchanged(answer: Any, fake_runtime: Any, proxy: Any) -> None:
    # Field 99 is unknown to every CRI message: it must reach both ends as sent.
    unknown = b"\xfa\x06\x03abc"
    fake_runtime.answer(STATUS, answer(payload=cri.StatusResponse(info={"k": "v"}).SerializeToString() + unknown))
    request = cri.StatusRequest(verbose=True).SerializeToString() + unknown
    reply = await proxy.call(STATUS, request)
    assert reply.endswith(unknown) and cri.StatusResponse.FromString(reply).info == {"k": "v"}
    assert fake_runtime.received(STATUS)[0].payload == request


@pytest.mark.asyncio
async def test_error_status_details_and_trailers(answer: Any, fake_runtime: Any, proxy: Any, wire: Any) -> None:
    details_bin = wire.rpc_status(grpc.StatusCode.NOT_FOUND.value[0], "container c9 not found")
    fake_runtime.answer(STATUS, answer(
        code=grpc.StatusCode.NOT_FOUND, details="container c9 not found: detail ü",
        trailing_metadata=(("grpc-status-details-bin", details_bin), ("x-backend-trailer", "t1"))))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await proxy.call(STATUS)
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert err.value.details() == "container c9 not found: detail ü"
    trailing = tuple(err.value.trailing_metadata())
    assert ("grpc-status-details-bin", details_bin) in trailing and ("x-backend-trailer", "t1") in trailing


@pytest.mark.asyncio
async def test_trailers_only_stays_trailers_only_and_a_reply_keeps_its_trailers(
    answer: Any, fake_runtime: Any, proxy: Any
) -> None:
    """On the wire, not through a grpc client (which hides the difference): an error before
    any reply message is one HEADERS frame with END_STREAM (trailers-only), as containerd
    sends it; a reply is HEADERS, DATA, then trailers in a HEADERS frame with END_STREAM.
    The same frames direct and through the proxy."""
    def shapes(path: Any, method: str) -> list[tuple[int, int]]:
        return [(f.type, f.flags & h2raw.END_STREAM) for f in h2raw.unary(path, method, b"")]

    fake_runtime.answer(STATUS, answer(code=grpc.StatusCode.NOT_FOUND, details="no such container"))
    fake_runtime.answer(LIST_IMAGES, answer(payload=b"\x0a\x00"))
    trailers_only = [(h2raw.HEADERS, h2raw.END_STREAM)]
    reply = [(h2raw.HEADERS, 0), (h2raw.DATA, 0), (h2raw.HEADERS, h2raw.END_STREAM)]
    for path in (fake_runtime.path, proxy.socket):
        assert await asyncio.to_thread(shapes, path, STATUS) == trailers_only, path
        assert await asyncio.to_thread(shapes, path, LIST_IMAGES) == reply, path
    # HAProxy's own answer for a path that is no CRI method is trailers-only too.
    assert await asyncio.to_thread(shapes, proxy.socket, NATIVE) == trailers_only
    assert fake_runtime.received(NATIVE) == []


@pytest.mark.asyncio
async def test_long_error_message_is_relayed(answer: Any, fake_runtime: Any, proxy: Any) -> None:
    """containerd's error text is not ours: 7 000 characters (grpc clients take at most
    8 KiB of headers by default; HAProxy's tune.bufsize is well above, see test_haproxy_config)."""
    text = "x" * 7_000
    fake_runtime.answer(STATUS, answer(code=grpc.StatusCode.INTERNAL, details=text))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await proxy.call(STATUS)
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INTERNAL, text)


@pytest.mark.asyncio
async def test_metadata_both_ways_unary_and_streaming(answer: Any, fake_runtime: Any, proxy: Any) -> None:
    fake_runtime.answer(STATUS, answer(initial_metadata=(("x-backend-initial", "i1"),),
                                       trailing_metadata=(("x-backend-trailer", "t1"), ("x-bin-bin", b"\x00\xff"))))
    call = proxy.unary(STATUS)(b"", timeout=5, metadata=(("x-koord-test", "hello"), ("x-koord-bin", b"\x01\x02")))
    assert await call == b""
    assert ("x-backend-initial", "i1") in tuple(await call.initial_metadata())
    trailing = tuple(await call.trailing_metadata())
    assert ("x-backend-trailer", "t1") in trailing and ("x-bin-bin", b"\x00\xff") in trailing
    [seen] = fake_runtime.received(STATUS)
    assert seen.md("x-koord-test") == ["hello"] and seen.md("x-koord-bin") == [b"\x01\x02"]

    fake_runtime.answer(EVENTS, answer(stream=(b"e",), initial_metadata=(("x-backend-initial", "i2"),),
                                       trailing_metadata=(("x-backend-trailer", "t2"),)))
    stream = proxy.unary_stream(EVENTS)(b"", timeout=5, metadata=(("x-koord-test", "s"),))
    assert [m async for m in stream] == [b"e"]
    assert ("x-backend-initial", "i2") in tuple(await stream.initial_metadata())
    assert ("x-backend-trailer", "t2") in tuple(await stream.trailing_metadata())
    assert fake_runtime.received(EVENTS)[0].md("x-koord-test") == ["s"]


@pytest.mark.asyncio
async def test_stream_in_order_and_error_after_messages(answer: Any, fake_runtime: Any, proxy: Any) -> None:
    got = [cri.ContainerEventResponse.FromString(m).container_id
           async for m in proxy.unary_stream(EVENTS)(b"", timeout=5)]
    assert got == ["c0", "c1", "c2"]
    fake_runtime.answer(EVENTS, answer(stream=(b"a",), code=grpc.StatusCode.ABORTED, details="restarting"))
    seen = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for message in proxy.unary_stream(EVENTS)(b"", timeout=5):
            seen.append(message)
    assert seen == [b"a"] and (err.value.code(), err.value.details()) == (grpc.StatusCode.ABORTED, "restarting")


@pytest.mark.asyncio
async def test_deadline_reaches_the_backend_and_ends_the_call(answer: Any, fake_runtime: Any, proxy: Any) -> None:
    for timeout in (3.0, 0.7):
        await proxy.call(STATUS, timeout=timeout)
    first, second = (c.time_remaining for c in fake_runtime.received(STATUS))
    assert first is not None and 2.0 < first <= 3.0 + CLOCK_SLACK
    assert second is not None and 0 < second <= 0.7 + CLOCK_SLACK
    fake_runtime.answer(STATUS, answer(delay=5.0))
    start = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await proxy.call(STATUS, timeout=0.3)
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 4.0


@pytest.mark.asyncio
async def test_16_mib_messages_both_ways(answer: Any, fake_runtime: Any, proxy: Any) -> None:
    # 16 MiB less the framing the proxy's (and containerd's) 16 MiB limit leaves room for.
    size = 16 * MiB - 64
    big_response = bytes(range(256)) * (size // 256)
    big_request = b"\x5a" * size
    fake_runtime.answer(LIST_IMAGES, answer(payload=big_response))
    fake_runtime.answer(EXEC_SYNC, answer(payload=b"ok"))
    assert await proxy.call(LIST_IMAGES, b"", timeout=30) == big_response
    assert await proxy.call(EXEC_SYNC, big_request, timeout=30) == b"ok"
    assert fake_runtime.received(EXEC_SYNC)[0].payload == big_request


@pytest.mark.asyncio
async def test_unknown_cri_method_goes_to_the_backend(answer: Any, fake_runtime: Any, proxy: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await proxy.call(RT + "NoSuchMethodAnywhere")
    assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED
    fake_runtime.answer(FUTURE_UNARY, answer(payload=b"future"))
    assert await proxy.call(FUTURE_UNARY, b"q") == b"future"
    assert [c.payload for c in fake_runtime.received(FUTURE_UNARY)] == [b"q"]


@pytest.mark.asyncio
@pytest.mark.parametrize("method", [NATIVE, "/grpc.health.v1.Health/Check", RT + "a/b", "/runtime.v1.RuntimeService/"])
async def test_non_cri_paths_are_unimplemented_and_never_reach_the_backend(
    answer: Any, fake_runtime: Any, proxy: Any, method: str
) -> None:
    fake_runtime.answer(method, answer(payload=b"served"))  # the backend would answer OK
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await proxy.call(method, b"")
    assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert "relays only the CRI services" in (err.value.details() or "")
    assert fake_runtime.received(method) == []


@pytest.mark.asyncio
async def test_lifecycle_calls_reach_the_interception_server(fake_runtime: Any, proxy: Any) -> None:
    reply = await proxy.call(RT + "RunPodSandbox", cri.RunPodSandboxRequest(
        config=cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="p", namespace="n", uid="u"))
    ).SerializeToString())
    assert cri.RunPodSandboxResponse.FromString(reply).pod_sandbox_id == "sb-1"
    # Counted by the interception server: the call went through Python, not past it.
    assert proxy.calls_total(RT + "RunPodSandbox", "intercepted") == 1
    # ... and a pass-through call did not (HAProxy relays and counts it; the gRPC transport counts it in Python).
    await proxy.call(RT + "ListContainers")
    python_counted = sum(s.value for m in proxy.app.metrics.cri_calls.collect() for s in m.samples
                         if s.name.endswith("_total") and s.labels == {"method": RT + "ListContainers",
                                                                       "path": "passthrough"})
    assert python_counted == (0 if proxy.app.data_plane is not None else 1)
    assert proxy.calls_total(RT + "ListContainers", "passthrough") == 1


@pytest.mark.asyncio
async def test_reload_rewrites_haproxy_but_keeps_what_needs_a_restart(
    fake_runtime: Any, start_proxy: Any, short_dir: Any
) -> None:
    need_haproxy()
    proxy = await start_proxy(fake_runtime, data_plane="haproxy", config_file=True)
    plane = proxy.app.data_plane
    pid = plane.pid
    cfg = plane.layout.config_file
    assert "timeout server 86400000ms" in cfg.read_text()
    doc = yaml.safe_load(proxy.config_path.read_text())
    doc["data_plane_idle_timeout"] = "2h"
    doc["backend"]["runtime_endpoint"] = str(short_dir / "elsewhere.sock")
    proxy.config_path.write_text(yaml.safe_dump(doc))
    assert await proxy.app.reload("test")
    text = cfg.read_text()
    assert "timeout server 7200000ms" in text
    # Lifecycle calls still go to the old backend until a restart: so do pass-through calls.
    assert "elsewhere.sock" not in text and str(fake_runtime.path) in text
    assert plane.pid == pid  # reloaded in place (SIGUSR2), not restarted
    assert await proxy.call(STATUS) == b""


@pytest.mark.asyncio
async def test_a_reload_without_the_haproxy_binary_is_rejected(
    fake_runtime: Any, start_proxy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The binary gone (an uninstall) and a reload: refused like any invalid configuration
    (data_plane named), HAProxy and the running settings kept; never a switch to grpc."""
    need_haproxy()
    proxy = await start_proxy(fake_runtime, data_plane="haproxy", config_file=True)
    old, pid = proxy.app.settings, proxy.app.data_plane.pid
    doc = yaml.safe_load(proxy.config_path.read_text())
    doc["data_plane_idle_timeout"] = "2h"
    proxy.config_path.write_text(yaml.safe_dump(doc))
    monkeypatch.setattr("runtimeproxy.config.confignet.find_haproxy", lambda: None)
    with structlog.testing.capture_logs() as logs:
        assert await proxy.app.reload("test") is False
    assert proxy.app.settings is old and proxy.app.data_plane.pid == pid
    assert any("data_plane: the haproxy binary is not installed" in str(e.get("error", "")) for e in logs), logs
    assert await proxy.call(STATUS) == b""


class _SlowEvents(grpc.GenericRpcHandler):  # type: ignore[misc]
    """A backend whose GetContainerEvents sends ``count`` events ``gap`` seconds apart
    after ``quiet`` seconds; every other method answers empty (Version, List*: enough for
    the proxy to start)."""

    gap, count, quiet = 0.5, 1, 0.0

    def service(self, details: Any) -> Any:
        if details.method != EVENTS:
            async def empty(_request: bytes, _context: Any) -> bytes:
                return b""

            return grpc.unary_unary_rpc_method_handler(empty)

        async def events(_request: bytes, _context: Any) -> Any:
            await asyncio.sleep(self.quiet)
            for i in range(self.count):
                yield cri.ContainerEventResponse(container_id=f"c{i}").SerializeToString()
                await asyncio.sleep(self.gap)

        return grpc.unary_stream_rpc_method_handler(events)


@pytest_asyncio.fixture
async def slow_events(short_dir: Any) -> AsyncIterator[tuple[_SlowEvents, Path]]:
    """A ``_SlowEvents`` backend served on a unix socket, and the socket's path."""
    backend = _SlowEvents()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((backend,))
    path = short_dir / "events.sock"
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    try:
        yield backend, path
    finally:
        await server.stop(None)


@pytest.mark.asyncio
async def test_an_active_stream_outlives_the_idle_timeout_a_quiet_one_is_cut(
    fake_runtime: Any, start_proxy: Any, slow_events: tuple[_SlowEvents, Path]
) -> None:
    """HAProxy's timeouts are inactivity timeouts: a GetContainerEvents stream with an event
    every 0.5 s runs 4 s through a 2 s idle timeout; one quiet for 3.5 s is cut (which is
    why the default idle timeout is 24 h: containerd may have nothing to say for hours)."""
    need_haproxy()
    backend, path = slow_events
    proxy = await start_proxy(fake_runtime, backend_path=path, data_plane="haproxy",
                              data_plane_idle_timeout="2s")
    for count, quiet, expect_cut in ((8, 0.0, False), (1, 3.5, True)):
        backend.count, backend.quiet = count, quiet
        got: list[bytes] = []
        code = grpc.StatusCode.OK
        start = time.monotonic()
        try:
            async for message in proxy.unary_stream(EVENTS)(b"", timeout=30):
                got.append(message)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
        took = time.monotonic() - start
        if expect_cut:
            assert code is not grpc.StatusCode.OK and not got and 1.5 < took < 10, (code, got, took)
        else:
            assert code is grpc.StatusCode.OK and len(got) == 8 and took > 3.5, (code, len(got), took)


@pytest.mark.asyncio
async def test_a_quiet_stream_within_the_idle_timeout_is_never_cut(
    fake_runtime: Any, start_proxy: Any, slow_events: tuple[_SlowEvents, Path]
) -> None:
    """GetContainerEvents held open far past the idle timeout while quiet stretches stay
    within it, scaled down: ``data_plane_idle_timeout`` 2 s, the stream silent for 1.5 s
    before its response headers (HAProxy waits for the server: ``timeout server``) and then
    1.5 s between events, 7.5 s in all; the kubelet connection then idle 1.5 s between calls
    (``timeout http-keep-alive``). Every HAProxy timeout but ``connect`` is the idle timeout.
    Tried at 1 s one by one: ``timeout server`` cuts the quiet stream (504: UNAVAILABLE),
    ``timeout http-keep-alive`` closes the idle connection (GOAWAY: the channel goes IDLE);
    client, tunnel, http-request, client-fin and server-fin cut neither here (set anyway,
    so that no default of theirs can be shorter)."""
    need_haproxy()
    backend, path = slow_events
    backend.count, backend.quiet, backend.gap = 5, 1.5, 1.5
    proxy = await start_proxy(fake_runtime, backend_path=path, data_plane="haproxy",
                              data_plane_idle_timeout="2s")
    text = proxy.app.data_plane.layout.config_file.read_text()
    timeouts = {line.split()[1]: line.split()[2] for line in text.splitlines()
                if line.strip().startswith("timeout ")}
    assert {k: v for k, v in timeouts.items() if k != "connect"} == dict.fromkeys(
        ("client", "server", "tunnel", "client-fin", "server-fin", "http-request", "http-keep-alive"), "2000ms")
    # One connection, as kubelet's: the stream, then a quiet connection, then a call on it.
    channel = grpc.aio.insecure_channel(f"unix://{proxy.socket}")
    try:
        await channel.channel_ready()
        start = time.monotonic()
        got = [m async for m in channel.unary_stream(EVENTS)(b"", timeout=30)]
        took = time.monotonic() - start
        assert len(got) == 5 and took > 7.0, (len(got), took)
        await asyncio.sleep(1.5)
        assert channel.get_state() is grpc.ChannelConnectivity.READY
        assert await channel.unary_unary(STATUS)(b"", timeout=5) == b""
    finally:
        await channel.close()


class _Hanging(grpc.GenericRpcHandler):  # type: ignore[misc]
    """A backend whose ExecSync hangs until cancelled (and records that it was); every
    other method answers empty."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    def service(self, details: Any) -> Any:
        async def empty(_request: bytes, _context: Any) -> bytes:
            return b""

        async def hang(_request: bytes, _context: Any) -> bytes:
            self.started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            return b""

        return grpc.unary_unary_rpc_method_handler(hang if details.method == EXEC_SYNC else empty)


@pytest.mark.asyncio
async def test_client_cancellation_reaches_the_backend(
    fake_runtime: Any, start_proxy: Any, short_dir: Any, plane: str
) -> None:
    """kubelet gives up on a call (RST_STREAM CANCEL): the backend's handler is cancelled
    too, within a second, instead of running on (an ExecSync's process would)."""
    backend = _Hanging()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((backend,))
    path = short_dir / "hang.sock"
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    try:
        proxy = await start_proxy(fake_runtime, backend_path=path, data_plane=plane)
        call = proxy.unary(EXEC_SYNC)(b"", timeout=30)
        await asyncio.wait_for(backend.started.wait(), 5)
        assert not backend.cancelled.is_set()
        call.cancel()
        await asyncio.wait_for(backend.cancelled.wait(), 1.0)
        with pytest.raises(asyncio.CancelledError):
            await call
    finally:
        await server.stop(None)


@pytest.mark.asyncio
async def test_not_ready_while_haproxy_does_not_answer(
    fake_runtime: Any, start_proxy: Any, short_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """READY=1 only when both answer: containerd answers and the interception server
    listens, but the "haproxy" started (a stand-in that passes the config check, then
    binds kubelet's socket and never answers) does not answer there: the proxy stays not
    ready."""
    need_haproxy()
    fake = short_dir / "haproxy"
    fake.write_text(
        "#!/usr/bin/python3\nimport socket, sys, time\n"
        "if '-c' in sys.argv:\n    sys.exit(0)\n"
        f"s = socket.socket(socket.AF_UNIX)\ns.bind({str(short_dir / 'p.sock')!r})\ns.listen()\ntime.sleep(3600)\n")
    fake.chmod(0o755)
    monkeypatch.setattr("runtimeproxy.app.find_haproxy", lambda: str(fake))
    notified: list[str] = []
    monkeypatch.setattr("runtimeproxy.app.sdnotify.notify", notified.append)
    proxy = await start_proxy(fake_runtime, data_plane="haproxy", wait_ready=False)
    await asyncio.sleep(2.0)
    assert fake_runtime.received(RT + "Version"), "containerd was asked"
    assert proxy.app.data_plane.pid is not None and proxy.app.data_plane.layout.intercept_socket.exists()
    assert not proxy.app.ready and "READY=1" not in notified


@pytest.mark.asyncio
async def test_a_crashing_haproxy_is_restarted_with_back_off(
    fake_runtime: Any, start_proxy: Any, short_dir: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A master that dies at once is started again after 0.1 s, then 0.2, 0.4, 0.8 s: a
    crash loop costs a few starts a second at first and fewer after, not a busy loop."""
    need_haproxy()
    fake, starts = short_dir / "haproxy", short_dir / "starts"
    fake.write_text(
        "#!/usr/bin/python3\nimport os, socket, sys, time\n"
        "if '-c' in sys.argv:\n    sys.exit(0)\n"
        f"with open({str(starts)!r}, 'a') as f:\n    f.write(f'{{time.monotonic()}}\\n')\n"
        f"path = {str(short_dir / 'p.sock')!r}\n"
        "if not os.path.exists(path):\n    socket.socket(socket.AF_UNIX).bind(path)\n"
        "sys.exit(1)\n")
    fake.chmod(0o755)
    monkeypatch.setattr("runtimeproxy.app.find_haproxy", lambda: str(fake))
    await start_proxy(fake_runtime, data_plane="haproxy", wait_ready=False)
    await asyncio.sleep(2.5)
    times = [float(t) for t in starts.read_text().split()]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # 0.1 + 0.2 + 0.4 + 0.8 = 1.5 s for 5 starts (plus each start's own time); the next after 1.6 s more.
    assert 3 <= len(times) <= 6, times  # 3: a start may take a while on a busy machine
    assert all(gap >= delay - 0.01 for gap, delay in zip(gaps, (0.1, 0.2, 0.4, 0.8), strict=False)), gaps


@pytest.mark.asyncio
async def test_a_clean_stop_logs_no_error(
    fake_runtime: Any, start_proxy: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Our drain takes the interception server out of HAProxy's rotation; HAProxy then
    says so as an ALERT ("backend 'intercept' has no server available"): logged at info,
    not as an error at every stop."""
    need_haproxy()
    proxy = await start_proxy(fake_runtime, data_plane="haproxy")
    capsys.readouterr()
    proxy.app.request_stop()
    assert await asyncio.wait_for(proxy.task, timeout=15) == 0
    out = capsys.readouterr().out
    assert "intercept" in out and "data_plane_stopped" in out, out
    assert not [line for line in out.splitlines() if "[error" in line or "[warning" in line], out
