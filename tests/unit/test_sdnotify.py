"""sd_notify tests against real AF_UNIX datagram sockets (path and abstract)."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtimeproxy.ops.sdnotify import notify, watchdog_interval, watchdog_loop


@pytest.fixture
def path_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5.0)
    yield sock, str(path)
    sock.close()


@pytest.fixture
def abstract_socket() -> Iterator[tuple[socket.socket, str]]:
    name = f"krp-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5.0)
    yield sock, "@" + name
    sock.close()


def pending(sock: socket.socket) -> list[bytes]:
    """Every datagram already queued on ``sock``, without waiting for more."""
    out: list[bytes] = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096))
    except BlockingIOError:
        return out
    finally:
        sock.settimeout(5.0)


def test_notify_ready_on_path_socket(path_socket: tuple[socket.socket, str]) -> None:
    sock, path = path_socket
    assert notify("READY=1", env={"NOTIFY_SOCKET": path}) is True
    assert sock.recv(4096) == b"READY=1"


def test_notify_on_abstract_socket(abstract_socket: tuple[socket.socket, str]) -> None:
    sock, address = abstract_socket
    assert notify("READY=1\nSTATUS=serving", env={"NOTIFY_SOCKET": address}) is True
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving"


def test_notify_without_socket_returns_false() -> None:
    assert notify("READY=1", env={}) is False
    assert notify("READY=1", env={"NOTIFY_SOCKET": ""}) is False
    assert notify("READY=1", env={"NOTIFY_SOCKET": "relative/path"}) is False


def test_notify_swallows_oserror(tmp_path: Path) -> None:
    missing = tmp_path / "nobody-listens.sock"
    assert notify("READY=1", env={"NOTIFY_SOCKET": str(missing)}) is False


def test_watchdog_interval_is_half_the_period() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    own = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    assert watchdog_interval(own) == 1.0


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"WATCHDOG_USEC": "0"},
        {"WATCHDOG_USEC": "abc"},
        {"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid() + 1)},
        {"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "not-a-pid"},
    ],
)
def test_watchdog_interval_disabled(env: dict[str, str]) -> None:
    assert watchdog_interval(env) is None


@pytest.mark.asyncio
async def test_watchdog_loop_pings_only_while_healthy(
    path_socket: tuple[socket.socket, str],
) -> None:
    sock, path = path_socket
    answers = iter([True, False, False, True, True])
    probes = 0
    done = asyncio.Event()

    def healthy() -> bool:
        nonlocal probes
        probes += 1
        answer = next(answers, None)
        if answer is None:
            done.set()
            return False
        return answer

    task = asyncio.create_task(
        watchdog_loop(0.001, healthy, env={"NOTIFY_SOCKET": path})
    )
    async with asyncio.timeout(5):
        await done.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert probes == 6
    assert pending(sock) == [b"WATCHDOG=1"] * 3


@pytest.mark.asyncio
async def test_watchdog_loop_treats_probe_error_as_unhealthy(
    abstract_socket: tuple[socket.socket, str],
) -> None:
    sock, address = abstract_socket
    calls = 0
    done = asyncio.Event()

    def broken() -> bool:
        nonlocal calls
        calls += 1
        if calls >= 3:
            done.set()
        raise RuntimeError("probe broke")

    task = asyncio.create_task(
        watchdog_loop(0.001, broken, env={"NOTIFY_SOCKET": address})
    )
    async with asyncio.timeout(5):
        await done.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pending(sock) == []


@pytest.mark.asyncio
async def test_watchdog_loop_rejects_bad_interval() -> None:
    with pytest.raises(ValueError):
        await watchdog_loop(0, lambda: True, env={})
