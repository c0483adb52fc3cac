"""Noticed calls (runtimeproxy.dataplane.notices): HAProxy's lines about the lifecycle calls it
relayed straight to containerd, parsed, read off a real unix socket, and turned by
``Lifecycle.notice`` into the store update and Post stage an intercepted call gets."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest
import structlog.testing

from criapi import cri_v1_pb2 as cri
from runtimeproxy.dataplane import haproxy
from runtimeproxy.dataplane.notices import Notice, NoticeError, NoticeServer, parse
from runtimeproxy.hookapi import CallResult

RT = "/runtime.v1.RuntimeService/"
METHODS = frozenset(haproxy.LIFECYCLE_METHODS)


def line(method: str, message: bytes, http: str = "200", grpc_status: str = "-", ended: str = "--") -> bytes:
    """A line as HAProxy's log-format (haproxy.NOTICE_FORMAT) writes it."""
    framed = b"\0" + len(message).to_bytes(4, "big") + message
    return f"{method} {http} {grpc_status} {ended} {framed.hex().upper()}".encode()


START = cri.StartContainerRequest(container_id="ctr-1").SerializeToString()


def test_a_line_of_a_successful_call() -> None:
    notice = parse(line(RT + "StartContainer", START), METHODS)
    assert notice == Notice(RT + "StartContainer", START, CallResult(True))
    assert cri.StartContainerRequest.FromString(notice.payload).container_id == "ctr-1"


@pytest.mark.parametrize(("http", "grpc_status", "ended", "result"), [
    ("200", "5", "--", CallResult(False, "NOT_FOUND", "")),
    ("200", "0", "--", CallResult(True)),
    ("503", "-", "SC", CallResult(False, "UNAVAILABLE", "HTTP status 503 from the data plane")),
    ("200", "-", "CD", CallResult(False, "UNKNOWN", "the call's stream ended abnormally (HAProxy state CD)")),
], ids=["grpc-error", "grpc-ok", "haproxy-503", "client-aborted"])
def test_how_the_call_ended(http: str, grpc_status: str, ended: str, result: CallResult) -> None:
    assert parse(line(RT + "StopPodSandbox", b"", http, grpc_status, ended), METHODS).result == result


@pytest.mark.parametrize(("text", "message"), [
    (b"/runtime.v1.RuntimeService/StartContainer 200 - --", "expected 5 space-separated fields, got 4"),
    (b"/runtime.v1.RuntimeService/Version 200 - -- 0000000000", "method: not a lifecycle method: '/runtime.v1"),
    (b"/runtime.v1.RuntimeService/StartContainer 200 - -- 0G", "body: not hex: '0G'"),
    (b"/runtime.v1.RuntimeService/StartContainer 200 - -- 0100000000", "body: not one uncompressed gRPC message"),
    (b"/runtime.v1.RuntimeService/StartContainer 200 - -- 000000000A0A04", "body: gRPC frame of 10 bytes, 2 received"),
    (b"/runtime.v1.RuntimeService/StartContainer 200 99 -- 0000000000", "grpc-status: not a gRPC status code: '99'"),
    (b"", "expected 5 space-separated fields, got 1"),
])
def test_a_bad_line_names_the_field_and_value(text: bytes, message: str) -> None:
    with pytest.raises(NoticeError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        parse(text, METHODS)


@pytest.mark.asyncio
async def test_the_server_hands_over_lines_in_order_and_catch_up_reads_what_has_arrived(short_dir: Path) -> None:
    got: list[Notice] = []
    server = NoticeServer(short_dir / "n.sock", METHODS, got.append)
    server.start()
    assert (short_dir / "n.sock").stat().st_mode & 0o777 == 0o600
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(str(short_dir / "n.sock"))
    await asyncio.sleep(0.05)  # accepted on the loop
    stop = cri.StopContainerRequest(container_id="ctr-1").SerializeToString()
    first, second = line(RT + "StartContainer", START) + b"\n", line(RT + "StopContainer", stop) + b"\n"
    with structlog.testing.capture_logs() as logs:
        client.sendall(first + b"garbage\n" + second[:10])  # a line cut across two writes
        client.sendall(second[10:])
        server.catch_up()  # synchronously: no await between the writes and the check
    assert [n.method for n in got] == [RT + "StartContainer", RT + "StopContainer"]
    assert [e["event"] for e in logs] == ["notice_rejected"]
    assert logs[0]["reason"] == "expected 5 space-separated fields, got 1: b'garbage'"
    assert logs[0]["log_level"] == "warning"
    # A reconnect (HAProxy reloaded) is served like the first connection.
    client.close()
    await asyncio.sleep(0.05)
    again = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    again.connect(str(short_dir / "n.sock"))
    await asyncio.sleep(0.05)
    again.sendall(first)
    for _ in range(100):
        if len(got) == 3:
            break
        await asyncio.sleep(0.01)  # read by the loop's reader this time, no catch_up
    assert [n.method for n in got][-1] == RT + "StartContainer"
    assert server.received == 3
    server.close()
    again.close()
    assert not (short_dir / "n.sock").exists()


@pytest.mark.asyncio
async def test_a_failing_handler_does_not_stop_the_reader(short_dir: Path) -> None:
    seen: list[str] = []

    def handle(n: Notice) -> None:
        seen.append(n.method)
        if len(seen) == 1:
            raise RuntimeError("boom")

    server = NoticeServer(short_dir / "n.sock", METHODS, handle)
    server.start()
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(str(short_dir / "n.sock"))
    await asyncio.sleep(0.05)
    with structlog.testing.capture_logs() as logs:
        client.sendall((line(RT + "StartContainer", START) + b"\n") * 2)
        server.catch_up()
    assert len(seen) == 2
    assert [e["event"] for e in logs] == ["notice_failed"]
    server.close()
    client.close()


# --- Lifecycle.notice: the store and the Post stage ------------------------------------


def _pod_config(uid: str = "uid-1") -> cri.PodSandboxConfig:
    cfg = cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="web-0", namespace="prod", uid=uid))
    cfg.linux.cgroup_parent = "/kubepods/burstable/poduid-1"
    return cfg


async def _pod_with_container(proxy: Any) -> None:
    await proxy.call(RT + "RunPodSandbox", cri.RunPodSandboxRequest(config=_pod_config()).SerializeToString())
    create = cri.CreateContainerRequest(pod_sandbox_id="sb-1", sandbox_config=_pod_config(),
                                        config=cri.ContainerConfig(metadata=cri.ContainerMetadata(name="app")))
    await proxy.call(RT + "CreateContainer", create.SerializeToString())


@pytest.mark.asyncio
async def test_a_noticed_call_updates_the_store_and_runs_its_post_stage(
    fake_runtime: Any, start_proxy: Any, hook_module: Any
) -> None:
    proxy = await start_proxy(fake_runtime, hooks=[{"name": "watch", "plugin": hook_module.plugin("Observer")}])
    await _pod_with_container(proxy)
    store, lifecycle = proxy.app.store, proxy.app.lifecycle
    hook_module.events.clear()

    lifecycle.notice(RT + "StartContainer", START, CallResult(True))
    assert await lifecycle.posts.settle(timeout=5)
    assert store.container_state("ctr-1") == cri.CONTAINER_RUNNING
    [(_, stage, ctx)] = hook_module.events
    assert stage == "PostStartContainer" and ctx.container.id == "ctr-1" and ctx.result == CallResult(True)

    # A failed call: the Post stage sees the failure, the store keeps the state.
    stop = cri.StopContainerRequest(container_id="ctr-1").SerializeToString()
    lifecycle.notice(RT + "StopContainer", stop, CallResult(False, "DEADLINE_EXCEEDED", ""))
    assert await lifecycle.posts.settle(timeout=5)
    assert store.container_state("ctr-1") == cri.CONTAINER_RUNNING
    assert hook_module.events[-1][2].result == CallResult(False, "DEADLINE_EXCEEDED", "")

    update = cri.UpdateContainerResourcesRequest(container_id="ctr-1")
    update.linux.cpu_shares = 300
    lifecycle.notice(RT + "UpdateContainerResources", update.SerializeToString(), CallResult(True))
    remove = cri.RemoveContainerRequest(container_id="ctr-1").SerializeToString()
    lifecycle.notice(RT + "RemoveContainer", remove, CallResult(True))
    assert store.container("ctr-1") is None
    sandbox = cri.StopPodSandboxRequest(pod_sandbox_id="sb-1").SerializeToString()
    lifecycle.notice(RT + "StopPodSandbox", sandbox, CallResult(True))
    lifecycle.notice(RT + "RemovePodSandbox", sandbox, CallResult(True))
    assert store.pod("sb-1") is None
    assert await lifecycle.posts.settle(timeout=5)
    stages = [stage for _, stage, _ in hook_module.events]
    assert stages == ["PostStartContainer", "PostStopContainer", "PostUpdateContainerResources",
                      "PostRemoveContainer", "PostStopPodSandbox", "PostRemovePodSandbox"]
    assert hook_module.events[2][2].container.resources.cpu_shares == 300


@pytest.mark.asyncio
async def test_a_noticed_call_on_an_object_the_store_does_not_know_runs_no_hooks(
    fake_runtime: Any, start_proxy: Any, hook_module: Any
) -> None:
    proxy = await start_proxy(fake_runtime, hooks=[{"name": "watch", "plugin": hook_module.plugin("Observer")}])
    lifecycle = proxy.app.lifecycle
    lifecycle.notice(RT + "StartContainer", START, CallResult(True))
    lifecycle.notice(RT + "StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id="x").SerializeToString(),
                     CallResult(True))
    assert await lifecycle.posts.settle(timeout=5)
    assert hook_module.events == []
