"""The orphan watchdog's real sh script against a real process standing in for the HAProxy
master (a ``sleep``): it fires only after the Python end of its pipe closes and the grace
passes, only if no newer process claimed the data plane, only at the recorded process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtimeproxy.dataplane import dataplanestate, haproxy
from runtimeproxy.dataplane.dataplanewatchdog import OrphanWatchdog

GRACE = 0.5


@pytest.fixture
def master(tmp_path: Path) -> Iterator[tuple[haproxy.Layout, Path, subprocess.Popen[bytes]]]:
    """A data plane directory with a recorded 'master' (sleep) and a socket file to remove."""
    layout = haproxy.Layout.for_listen(tmp_path / "kubelet.sock")
    layout.run_dir.mkdir(mode=0o700)
    sock = tmp_path / "kubelet.sock"
    sock.write_text("")
    proc = subprocess.Popen(["sleep", "60"])
    dataplanestate.record(layout, proc.pid)
    yield layout, sock, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _gone(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def _exit_code(pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    return None


def _running(pid: int) -> bool:
    return os.waitpid(pid, os.WNOHANG)[0] == 0


def _orphan(watchdog: OrphanWatchdog) -> int:
    """Arm it, then close our end of its pipe as our death would."""
    watchdog.claim()
    proc = watchdog._spawn()
    assert watchdog._write_end is not None
    os.close(watchdog._write_end)
    watchdog._write_end = None
    return proc


def test_stops_the_master_and_removes_the_socket_after_the_grace(
    master: tuple[haproxy.Layout, Path, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    layout, sock, target = master
    watchdog = OrphanWatchdog(layout, str(sock), GRACE)
    watchdog.claim()
    dog = watchdog._spawn()
    time.sleep(GRACE + 0.5)
    assert target.poll() is None and _running(dog), "fired while we were alive"
    assert watchdog._write_end is not None
    os.close(watchdog._write_end)
    watchdog._write_end = None
    start = time.monotonic()
    assert _gone(target, GRACE + 3)
    took = time.monotonic() - start
    assert _exit_code(dog, 3) == 0
    assert GRACE - 0.1 <= took <= GRACE + 2, took
    assert not sock.exists() and not (layout.run_dir / "master.pid").exists()


def test_leaves_a_master_another_process_claimed(
    master: tuple[haproxy.Layout, Path, subprocess.Popen[bytes]],
) -> None:
    layout, sock, target = master
    dog = _orphan(OrphanWatchdog(layout, str(sock), GRACE))
    (layout.run_dir / "owner").write_text("another run's token")  # the next run adopted it
    assert _exit_code(dog, GRACE + 3) == 0
    assert target.poll() is None and sock.exists()


def test_adoption_ends_the_previous_watchdog_at_once(
    master: tuple[haproxy.Layout, Path, subprocess.Popen[bytes]],
) -> None:
    layout, sock, target = master
    dog = _orphan(OrphanWatchdog(layout, str(sock), 60))
    assert (layout.run_dir / "watchdog.pid").read_text().split()[0] == str(dog)
    OrphanWatchdog(layout, str(sock), GRACE).claim()  # the next run adopts
    assert _exit_code(dog, 2) == -signal.SIGKILL
    assert target.poll() is None and sock.exists()


def test_stops_the_master_even_if_its_directory_is_removed_meanwhile(
    master: tuple[haproxy.Layout, Path, subprocess.Popen[bytes]],
) -> None:
    layout, sock, target = master
    dog = _orphan(OrphanWatchdog(layout, str(sock), GRACE))
    time.sleep(GRACE / 2)
    for path in layout.run_dir.iterdir():
        path.unlink()
    layout.run_dir.rmdir()
    assert _gone(target, GRACE + 3)
    assert _exit_code(dog, 3) == 0


def test_never_signals_a_reused_pid(master: tuple[haproxy.Layout, Path, subprocess.Popen[bytes]]) -> None:
    layout, sock, target = master
    pid, start = (layout.run_dir / "master.pid").read_text().split()
    (layout.run_dir / "master.pid").write_text(f"{pid} {int(start) + 1}\n")  # another process, same pid
    dog = _orphan(OrphanWatchdog(layout, str(sock), GRACE))
    assert _exit_code(dog, GRACE + 3) == 0
    assert target.poll() is None and sock.exists()


def test_kill_9_of_the_watchdog_rearms_it(master: tuple[haproxy.Layout, Path, subprocess.Popen[bytes]]) -> None:
    layout, sock, target = master
    watchdog = OrphanWatchdog(layout, str(sock), GRACE)

    async def scenario() -> int:
        task = asyncio.ensure_future(watchdog.run_forever())
        while watchdog.arms < 1:
            await asyncio.sleep(0.01)
        first = watchdog.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while watchdog.arms < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert watchdog.arms == 2 and watchdog.pid != first
        task.cancel()
        second = watchdog.pid
        assert second is not None
        return second

    second = asyncio.run(scenario())
    assert watchdog.pid == second and _running(second)  # still armed after we stop watching it
    assert target.poll() is None, "a killed watchdog stopped nothing"
    watchdog.disarm()
    assert watchdog.pid is None and not (layout.run_dir / "owner").exists()
    with pytest.raises(ProcessLookupError):
        os.kill(second, 0)
    assert target.poll() is None


def test_reports_one_json_line(master: tuple[haproxy.Layout, Path, subprocess.Popen[bytes]], tmp_path: Path) -> None:
    layout, sock, target = master
    watchdog = OrphanWatchdog(layout, str(sock), GRACE)
    watchdog.claim()
    read_end, write_end = os.pipe()
    saved = os.dup(2)
    os.dup2(write_end, 2)
    try:
        dog = watchdog._spawn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(write_end)
    assert watchdog._write_end is not None
    os.close(watchdog._write_end)
    assert _exit_code(dog, GRACE + 5) == 0
    with os.fdopen(read_end) as err:
        line = json.loads(err.read())
    assert line == {"event": "data_plane_orphan_stopped", "level": "warning", "pid": target.pid,
                    "grace_seconds": GRACE, "socket": str(sock)}
