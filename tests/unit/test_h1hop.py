"""The HTTP/1.1 interception hop behind HAProxy, each side alone: gRPC's conventions on
HTTP/1.1 (runtimeproxy.transport.grpcwire), the interception server (runtimeproxy.transport.h1server) with raw
HTTP/1.1 requests as HAProxy sends them, and the lifecycle's backend client
(runtimeproxy.transport.h1backend) against raw HTTP/1.1 replies as HAProxy relays containerd's.
The whole hop through a real HAProxy: test_intercept_wire.py."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
import pytest_asyncio
import structlog.testing

from criapi import cri_v1_pb2 as cri
from runtimeproxy.backend import CallError, Code, Metadata, Reply
from runtimeproxy.chain.hookchain import HookChain
from runtimeproxy.lifecycle.handler import Lifecycle, SkipLabel
from runtimeproxy.ops.promstats import ProxyMetrics
from runtimeproxy.state.store import Store
from runtimeproxy.transport import grpcwire
from runtimeproxy.transport.h1backend import H1Backend
from runtimeproxy.transport.h1server import H1InterceptServer

RUN = "/runtime.v1.RuntimeService/RunPodSandbox"
REQUEST = cri.RunPodSandboxRequest(config=cri.PodSandboxConfig(
    metadata=cri.PodSandboxMetadata(name="p", namespace="n", uid="u"))).SerializeToString()
REPLY = cri.RunPodSandboxResponse(pod_sandbox_id="sb-1").SerializeToString()

# --- grpcwire ------------------------------------------------------------------------


def test_a_message_is_framed_and_unframed_and_bad_frames_are_named() -> None:
    assert grpcwire.unframe(grpcwire.frame(b"abc"), 10, "request") == b"abc"
    assert grpcwire.frame(b"") == b"\0\0\0\0\0"
    cases = [
        (b"\0\0\0", Code.INTERNAL, "request: no gRPC message in a body of 3 bytes"),
        (b"\1\0\0\0\1x", Code.UNIMPLEMENTED, "request: compressed messages are not accepted (flag 1)"),
        (b"\0\0\0\0\x0bxxxxxxxxxxx", Code.RESOURCE_EXHAUSTED, "request: message of 11 bytes, more than 10"),
        (b"\0\0\0\0\2x", Code.INTERNAL, "request: one message of 2 bytes framed, the body has 1"),
        (grpcwire.frame(b"a") + grpcwire.frame(b"b"), Code.INTERNAL, "request: one message of 1 bytes framed"),
    ]
    for body, code, text in cases:
        with pytest.raises(CallError) as err:
            grpcwire.unframe(body, 10, "request")
        assert err.value.code is code and err.value.details.startswith(text), (body, err.value)


def test_grpc_timeout_both_ways() -> None:
    assert grpcwire.parse_timeout(b"100m") == pytest.approx(0.1)
    assert grpcwire.parse_timeout(b"2H") == 7200.0
    assert grpcwire.parse_timeout(b"99999999n") == pytest.approx(0.099999999)
    for bad in (b"", b"10", b"123456789S", b"1.5S", b"-1S", b"10x", b"S"):
        with pytest.raises(CallError) as err:
            grpcwire.parse_timeout(bad)
        assert err.value.code is Code.INTERNAL and repr(bad.decode()) in err.value.details
    for seconds in (0.0, 1e-7, 0.0015, 2.5, 119.9999, 3600 * 24 * 30, 1e12):
        text = grpcwire.format_timeout(seconds)
        assert 2 <= len(text) <= 9, text
        back = grpcwire.parse_timeout(text)
        assert back >= seconds or seconds > 99_999_999 * 3600  # never shorter than asked (rounded up)
        assert back <= max(seconds * 1.0001, seconds + 1e-6) or seconds == 0.0 or seconds > 99_999_999 * 3600
    assert grpcwire.format_timeout(1e20) == b"99999999H"


def test_metadata_both_ways_and_what_cannot_be_relayed() -> None:
    headers = [(b"x-a", b"one"), (b"content-type", b"application/grpc"), (b"grpc-timeout", b"1S"),
               (b"x-b-bin", base64.b64encode(b"\0\xff").rstrip(b"=")), (b"x-c-bin", base64.b64encode(b"\1\2\3\4")),
               (b"user-agent", b"kubelet"), (b"te", b"trailers"), (b"content-length", b"0")]
    assert grpcwire.decode_metadata(headers) == (("x-a", "one"), ("x-b-bin", b"\0\xff"), ("x-c-bin", b"\1\2\3\4"))
    with pytest.raises(CallError) as err:
        grpcwire.decode_metadata([(b"x-d-bin", b"%%%")])
    assert err.value.details == "metadata x-d-bin: not base64"
    md: Metadata = (("x-a", "one two"), ("x-b-bin", b"\0\xff"))
    assert grpcwire.encode_metadata(md) == b"x-a: one two\r\nx-b-bin: AP8\r\n"
    assert grpcwire.decode_metadata([(b"x-a", b"one two"), (b"x-b-bin", b"AP8")]) == md
    for bad, text in (((("X-Up", "v"),), "metadata key 'X-Up' cannot be relayed"),
                      ((("content-type", "text/html"),), "metadata key 'content-type' cannot be relayed"),
                      ((("x-a", "v\r\nx-injected: 1"),), "metadata x-a: a control character in its value")):
        with pytest.raises(CallError) as err:
            grpcwire.encode_metadata(bad)
        assert err.value.details == text


def test_grpc_message_and_status() -> None:
    for text in ("plain", "100% done %41", "ü and 日本", "two\nlines"):
        encoded = grpcwire.encode_message(text)
        assert all(0x20 <= c < 0x7F for c in encoded) and grpcwire.decode_message(encoded) == text
    assert grpcwire.status_of(200, b"5", b"not%20found") == (Code.NOT_FOUND, "not found")
    assert grpcwire.status_of(200, b"0", None) == (Code.OK, "")
    assert grpcwire.status_of(200, b"99", None)[0] is Code.UNKNOWN
    assert grpcwire.status_of(200, None, None) == (Code.INTERNAL, "the reply ended without a grpc-status")
    assert grpcwire.status_of(503, None, None) == (Code.UNAVAILABLE, "HTTP status 503 with no grpc-status")
    assert grpcwire.status_of(404, None, None)[0] is Code.UNIMPLEMENTED
    assert grpcwire.status_of(418, None, None)[0] is Code.UNKNOWN


# --- the server ------------------------------------------------------------------------


class FakeBackend:
    """What the lifecycle's backend call does: ``answer`` (a coroutine function) or a fixed reply."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes, float | None, Metadata]] = []
        self.answer: Callable[[], Awaitable[Reply]] | None = None
        self.cancelled = asyncio.Event()
        #: The server's metrics (the ``served`` fixture registers them here).
        self.registry = prometheus_client.CollectorRegistry()

    async def unary(self, method: str, payload: bytes, *, timeout: float | None = None,
                    metadata: Metadata = ()) -> Reply:
        self.calls.append((method, payload, timeout, metadata))
        if self.answer is None:
            return Reply(REPLY, (("x-i", "1"),), (("x-t-bin", b"\0\1"),))
        try:
            return await self.answer()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@pytest_asyncio.fixture
async def served(short_dir: Path) -> AsyncIterator[tuple[H1InterceptServer, FakeBackend, Path]]:
    backend = FakeBackend()
    lifecycle = Lifecycle(store=Store(), backend=backend, chain=lambda: HookChain([]),
                          skip_label=lambda: SkipLabel("k", "v"))
    metrics = ProxyMetrics(backend.registry)
    path = short_dir / "i.sock"
    server = H1InterceptServer(listen=path, lifecycle=lifecycle, metrics=metrics, max_message_bytes=4096)
    await server.start()
    assert path.stat().st_mode & 0o777 == 0o600
    yield server, backend, path
    await server.stop(1.0)
    assert not path.exists()


def _request(body: bytes = grpcwire.frame(REQUEST), path: str = RUN, extra: bytes = b"") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/grpc\r\nte: trailers\r\n".encode()
            + extra + b"content-length: %d\r\n\r\n" % len(body) + body)


def _answer_after(started: asyncio.Event, seconds: float, payload: bytes) -> Callable[[], Awaitable[Reply]]:
    """A backend answer that says it has started, then takes ``seconds``."""
    async def answer() -> Reply:
        started.set()
        await asyncio.sleep(seconds)
        return Reply(payload)
    return answer


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


async def _reply(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One raw reply: its header block and, when chunked, the rest up to the trailers' end."""
    head = await reader.readuntil(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head:
        return head, b""
    return head, await reader.readuntil(b"\r\n0\r\n") + await reader.readuntil(b"\r\n\r\n")


@pytest.mark.asyncio
async def test_a_call_and_the_next_on_the_same_connection(served: Any) -> None:
    server, backend, path = served
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(_request(extra=b"grpc-timeout: 2S\r\nx-koord: a b\r\nx-k-bin: AQI\r\nuser-agent: grpc-go\r\n"))
    head, rest = await _reply(reader)
    assert head.startswith(b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\nx-i: 1\r\n"), head
    message = grpcwire.frame(REPLY)
    assert rest == b"%x\r\n" % len(message) + message + b"\r\n0\r\ngrpc-status: 0\r\nx-t-bin: AAE\r\n\r\n"
    [(method, payload, timeout, metadata)] = backend.calls
    assert (method, payload, metadata) == (RUN, REQUEST, (("x-koord", "a b"), ("x-k-bin", b"\1\2")))
    assert timeout is not None and 1.5 < timeout <= 2.0
    writer.write(_request())
    head, _ = await _reply(reader)
    assert head.startswith(b"HTTP/1.1 200 OK") and len(backend.calls) == 2
    assert len(server.connections) == 1 and server.intercepting == 0
    await _close(writer)


@pytest.mark.asyncio
@pytest.mark.parametrize(("request_bytes", "status", "message"), [
    (_request(path="/runtime.v1.RuntimeService/Version"), b"12",
     b"koord-runtime-proxy does not intercept /runtime.v1.RuntimeService/Version"),
    (_request(extra=b"grpc-timeout: soon\r\n"), b"13", b"malformed grpc-timeout 'soon'"),
    (_request(extra=b"grpc-encoding: gzip\r\n"), b"12", b"grpc-encoding 'gzip' is not accepted"),
    (_request(b"\1\0\0\0\1x"), b"12", b"request: compressed messages are not accepted (flag 1)"),
    (_request(b"\0\0\0\x10\1" + b"x" * 4097), b"8", b"request: message of 4097 bytes, more than 4096"),
    (_request(b"\0\0\0\x20\0" + b"x" * 8192), b"8", b"request: message of 8192 bytes, more than 4096"),
])
async def test_a_bad_call_gets_a_trailers_only_error_and_never_reaches_the_backend(
    served: Any, request_bytes: bytes, status: bytes, message: bytes
) -> None:
    _, backend, path = served
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(request_bytes)
    head, _ = await _reply(reader)
    assert head.startswith(b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ngrpc-status: " + status + b"\r\n")
    assert b"grpc-message: " + grpcwire.encode_message(message.decode()) + b"\r\n" in head, head
    assert head.endswith(b"content-length: 0\r\n\r\n") and backend.calls == []
    writer.write(_request())  # the connection stays usable
    assert (await _reply(reader))[0].startswith(b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\nx-i")
    await _close(writer)


@pytest.mark.asyncio
async def test_not_http_is_a_400_and_a_closed_connection(served: Any) -> None:
    _, backend, path = served
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(b"\x16\x03\x01 not http\r\n\r\n")
    assert (await reader.read()).startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert backend.calls == []
    await _close(writer)


@pytest.mark.asyncio
async def test_backend_errors_deadlines_and_bugs_become_statuses(served: Any) -> None:
    server, backend, path = served
    reader, writer = await asyncio.open_unix_connection(str(path))

    async def refuse() -> Reply:
        raise CallError(Code.NOT_FOUND, "image 100% gone", (("x-why", "w"),))

    async def slow() -> Reply:
        await asyncio.sleep(10)
        return Reply(b"")

    async def bug() -> Reply:
        raise KeyError("oops")

    expected = [(refuse, b"", b"5", b"image 100%25 gone", b"x-why: w\r\n"),
                (slow, b"grpc-timeout: 100m\r\n", b"4", b"Deadline Exceeded", b""),
                (bug, b"", b"13", b"koord-runtime-proxy: KeyError: 'oops'", b"")]
    for answer, extra, status, message, trailing in expected:
        backend.answer = answer
        start = asyncio.get_running_loop().time()
        writer.write(_request(extra=extra))
        head, _ = await _reply(reader)
        assert head == (b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ngrpc-status: " + status
                        + b"\r\ngrpc-message: " + message + b"\r\n" + trailing + b"content-length: 0\r\n\r\n")
        assert asyncio.get_running_loop().time() - start < 2.0
    assert backend.cancelled.is_set()  # the deadline cancelled the backend call
    assert server.intercepting == 0
    await _close(writer)


@pytest.mark.asyncio
async def test_a_reply_too_big_to_relay_is_resource_exhausted_and_counted(served: Any) -> None:
    _, backend, path = served

    async def big() -> Reply:
        return Reply(b"x" * 5000)

    backend.answer = big
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(_request())
    head, _ = await _reply(reader)
    assert head.startswith(b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ngrpc-status: 8\r\n"
                           b"grpc-message: reply of 5000 bytes, more than 4096\r\n"), head
    assert backend.registry.get_sample_value(
        "koord_runtime_proxy_cri_errors_total", {"method": RUN, "code": "RESOURCE_EXHAUSTED"}) == 1
    await _close(writer)


@pytest.mark.asyncio
async def test_a_closed_connection_cancels_its_call(served: Any) -> None:
    """HAProxy closes our connection when kubelet resets the stream: the lifecycle call is cancelled."""
    server, backend, path = served
    started = asyncio.Event()
    backend.answer = _answer_after(started, 30, b"")
    _, writer = await asyncio.open_unix_connection(str(path))
    writer.write(_request())
    await asyncio.wait_for(started.wait(), 5)
    assert server.intercepting == 1
    await _close(writer)
    await asyncio.wait_for(backend.cancelled.wait(), 1)
    await asyncio.sleep(0)
    assert server.intercepting == 0


@pytest.mark.asyncio
async def test_stop_lets_the_call_in_flight_answer_then_closes(served: Any) -> None:
    server, backend, path = served
    started = asyncio.Event()
    backend.answer = _answer_after(started, 0.3, REPLY)
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(_request())
    await asyncio.wait_for(started.wait(), 5)
    stopping = asyncio.create_task(server.stop(5.0))
    await asyncio.sleep(0.05)
    assert not path.exists()  # no new connections meanwhile
    head, _ = await _reply(reader)
    assert head.startswith(b"HTTP/1.1 200 OK")
    await asyncio.wait_for(stopping, 2)
    assert await reader.read() == b"" and not backend.cancelled.is_set()
    await _close(writer)


# --- the backend client ------------------------------------------------------------------


#: A fake data plane's reply that starts with this is written, then the connection closed.
CLOSE = b"<close>"


class FakeDataPlane:
    """A raw HTTP/1.1 listener answering each request with the next of ``replies`` (bytes,
    or None: never answer)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.replies: list[bytes | None] = []
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed = asyncio.Event()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, str(self.path))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                reply = self.replies.pop(0)
                if reply is None:
                    await reader.read()  # until the client gives up
                    break
                writer.write(reply.removeprefix(CLOSE))
                if reply.startswith(CLOSE):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        self.closed.set()
        await _close(writer)

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()
        for writer in self._writers:
            await _close(writer)


class FallbackBackend:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def unary(self, method: str, payload: bytes, *, timeout: float | None = None,
                    metadata: Metadata = ()) -> Reply:
        self.calls.append(method)
        return Reply(b"from-grpc")


def _ok(payload: bytes, headers: bytes = b"", trailers: bytes = b"") -> bytes:
    message = grpcwire.frame(payload)
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\n" + headers + b"transfer-encoding: chunked\r\n\r\n"
            + b"%x\r\n" % len(message) + message + b"\r\n0\r\ngrpc-status: 0\r\n" + trailers + b"\r\n")


@pytest_asyncio.fixture
async def upstream(short_dir: Path) -> AsyncIterator[tuple[FakeDataPlane, H1Backend, FallbackBackend]]:
    fake = FakeDataPlane(short_dir / "up.sock")
    await fake.start()
    fallback = FallbackBackend()
    client = H1Backend(fake.path, max_message_bytes=4096, fallback=fallback)
    yield fake, client, fallback
    await client.close()
    await fake.stop()


@pytest.mark.asyncio
async def test_client_reply_metadata_and_a_kept_connection(upstream: Any) -> None:
    fake, client, fallback = upstream
    fake.replies = [_ok(REPLY, b"x-i: 1\r\n", b"x-t-bin: AAE\r\n"), _ok(b"")]
    reply = await client.unary(RUN, REQUEST, timeout=2.5, metadata=(("x-koord", "a"), ("x-k-bin", b"\1\2")))
    assert reply == Reply(REPLY, (("x-i", "1"),), (("x-t-bin", b"\0\1"),))
    sent = fake.requests[0]
    assert sent.startswith(f"POST {RUN} HTTP/1.1\r\n".encode()) and sent.endswith(b"\r\n\r\n" + grpcwire.frame(REQUEST))
    for line in (b"content-type: application/grpc", b"te: trailers", b"grpc-timeout: 2500000u", b"x-koord: a",
                 b"x-k-bin: AQI"):
        assert b"\r\n" + line + b"\r\n" in sent, (line, sent)
    assert await client.unary(RUN, b"") == Reply(b"")
    assert b"grpc-timeout" not in fake.requests[1]
    assert fake.connections == 1 and fallback.calls == []


@pytest.mark.asyncio
async def test_client_errors_are_relayed_with_their_trailers(upstream: Any) -> None:
    fake, client, _ = upstream
    fake.replies = [
        b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ngrpc-status: 5\r\ngrpc-message: gone%20%25\r\n"
        b"grpc-status-details-bin: CAU\r\nx-w: 1\r\ncontent-length: 0\r\n\r\n",  # trailers-only
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n",  # HAProxy: containerd is down
        b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ntransfer-encoding: chunked\r\n\r\n"
        b"0\r\ngrpc-status: 9\r\ngrpc-message: busy\r\nx-t: 2\r\n\r\n",  # headers, no message, trailers
        _ok(b"x" * 5000),  # over max_message_bytes
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\ngrpc-status: 0\r\n\r\n",  # bad frame
    ]
    expected = [(Code.NOT_FOUND, "gone %", (("grpc-status-details-bin", b"\x08\x05"), ("x-w", "1"))),
                (Code.UNAVAILABLE, "HTTP status 503 with no grpc-status", ()),
                (Code.FAILED_PRECONDITION, "busy", (("x-t", "2"),)),
                (Code.RESOURCE_EXHAUSTED, "reply of 5000 bytes, more than 4096", ()),
                (Code.INTERNAL, "reply: no gRPC message in a body of 3 bytes", ())]
    for code, details, trailing in expected:
        with pytest.raises(CallError) as err:
            await client.unary(RUN, REQUEST)
        assert (err.value.code, err.value.details, err.value.trailing_metadata) == (code, details, trailing)
    with pytest.raises(CallError) as err:
        await client.unary(RUN, b"y" * 4097)
    assert (err.value.code, err.value.details) == (Code.RESOURCE_EXHAUSTED, "request of 4097 bytes, more than 4096")
    assert len(fake.requests) == 5


@pytest.mark.asyncio
async def test_client_deadline_and_cancellation_close_the_connection(upstream: Any) -> None:
    """The deadline passes, or kubelet's call goes away: our connection closes (HAProxy then
    resets containerd's stream, see test_intercept_wire) and the next call takes a new one."""
    fake, client, _ = upstream
    fake.replies = [None, None, _ok(b"")]
    start = asyncio.get_running_loop().time()
    with pytest.raises(CallError) as err:
        await client.unary(RUN, REQUEST, timeout=0.2)
    assert (err.value.code, err.value.details) == (Code.DEADLINE_EXCEEDED, "Deadline Exceeded")
    assert 0.2 <= asyncio.get_running_loop().time() - start < 1.0
    await asyncio.wait_for(fake.closed.wait(), 1)
    fake.closed.clear()
    call = asyncio.create_task(client.unary(RUN, REQUEST))
    while len(fake.requests) < 2:
        await asyncio.sleep(0.01)
    call.cancel()
    await asyncio.wait_for(fake.closed.wait(), 1)
    assert await client.unary(RUN, REQUEST) == Reply(b"")
    assert fake.connections == 3


@pytest.mark.asyncio
async def test_client_connection_lost_mid_reply_is_unavailable_and_no_listener_means_fallback(upstream: Any) -> None:
    fake, client, fallback = upstream
    fake.replies = [CLOSE + b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\n"
                    b"transfer-encoding: chunked\r\n\r\n5\r\n"]
    with pytest.raises(CallError) as err:
        await client.unary(RUN, REQUEST)
    assert (err.value.code, err.value.details) == (
        Code.UNAVAILABLE, "the data plane closed the connection before the reply")
    await fake.stop()
    fake.path.unlink()  # HAProxy away (restarting): its listener is gone
    with structlog.testing.capture_logs() as logs:
        assert await client.unary(RUN, REQUEST) == Reply(b"from-grpc")
        assert await client.unary(RUN, REQUEST) == Reply(b"from-grpc")
    assert fallback.calls == [RUN, RUN] and client.fallbacks == 2
    assert [e["event"] for e in logs] == ["lifecycle_backend_fallback"]  # once per episode
