"""The private interception server is bounded before a handler runs: a 1 MB header,
20,000 headers and a body announced as 1 GiB are refused at once, without reading the
body, on the private socket itself and through HAProxy in front of it (kubelet's socket).
Nothing reaches the lifecycle or the (fake) containerd.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import structlog.testing

from runtimeproxy.transport.grpcserver import MAX_METADATA_BYTES, MAX_METADATA_ENTRIES, metadata_problem
from tests.unit import h2raw

RUN = "/runtime.v1.RuntimeService/RunPodSandbox"
#: Well under the client's read timeout: a server waiting for the rest of a body fails the test.
QUICK = 2.0


def _refusal(socket: Path, headers: list[tuple[str, str]], body: bytes, end_stream: bool = True) -> str:
    """How the server refused the call: ``reset``, ``status``, ``goaway`` or ``closed``
    (the connection dropped while we were still sending). A reply message, or no answer
    within the timeout, fails the test."""
    try:
        frames = h2raw.call(socket, headers, body, timeout=QUICK + 3, end_stream=end_stream)
    except ConnectionError as exc:
        return "goaway" if "GOAWAY" in str(exc) else "closed"
    assert h2raw.reply_message(frames) is None, frames
    if frames[-1].type == h2raw.RST_STREAM:
        return "reset"
    block = b"".join(f.payload for f in frames if f.type == h2raw.HEADERS)
    assert b"grpc-status" in block, frames
    return "status"


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["private", "kubelet"])
@pytest.mark.parametrize("case", ["1MB-header", "20000-headers", "1GiB-body"])
async def test_oversized_requests_are_refused_before_the_body_is_read(
    fake_runtime: Any, start_proxy: Any, where: str, case: str
) -> None:
    from tests.unit.conftest import need_haproxy

    need_haproxy()
    proxy = await start_proxy(fake_runtime, data_plane="haproxy")
    socket = proxy.app.data_plane.intercept_socket if where == "private" else proxy.socket
    if where == "private":
        assert socket.stat().st_mode & 0o777 == 0o600
    message = h2raw.grpc_message(b"")
    end_stream = True
    if case == "1MB-header":
        headers = h2raw.grpc_headers(RUN, extra=[("x-big", "a" * (1 << 20))])
    elif case == "20000-headers":
        headers = h2raw.grpc_headers(RUN, extra=[(f"x-h{i}", "v") for i in range(20_000)])
    else:
        headers = h2raw.grpc_headers(RUN)
        # The prefix says 1 GiB; 32 KiB of it are sent and the stream left open.
        message, end_stream = h2raw.grpc_message(b"z" * 32768, announced=1 << 30), False
    start = time.monotonic()
    with structlog.testing.capture_logs() as logs:
        how = await asyncio.to_thread(_refusal, socket, headers, message, end_stream)
    took = time.monotonic() - start
    assert took < QUICK, f"{case} via {where}: refused ({how}) only after {took:.1f}s"
    if where == "private":
        assert how == "status"  # RESOURCE_EXHAUSTED (HAProxy closes the connection on the first two)
    assert fake_runtime.received(RUN) == []
    # Never reached the lifecycle: counted as refused, if at all, not served.
    refused = proxy.sample("koord_runtime_proxy_cri_errors_total", {"method": RUN, "code": "RESOURCE_EXHAUSTED"})
    assert refused == proxy.calls_total(RUN, "intercepted")
    assert not [e for e in logs if e.get("event") == "cri_call"], logs
    # The server is still there for the next, ordinary call.
    reply = await asyncio.to_thread(h2raw.unary, socket, RUN, b"")
    assert [f.type for f in reply][:1] == [h2raw.HEADERS]


def test_the_metadata_bounds_leave_room_for_kubelets_calls() -> None:
    # kubelet sends a handful of entries, well under 1 KiB; a bound an ordinary call could reach is a bug.
    assert metadata_problem([("user-agent", "grpc-go/1.49.0"), ("x-a", "b" * 4096)] * 8) is None
    assert metadata_problem(None) is None
    assert "entries" in str(metadata_problem([("x", "")] * (MAX_METADATA_ENTRIES + 1)))
    assert "bytes" in str(metadata_problem([("x-big", "a" * MAX_METADATA_BYTES)]))
