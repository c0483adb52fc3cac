"""Which HAProxy master serves kubelet's socket, recorded so the next ``run`` can adopt it.

With ``data_plane_orphan_grace`` > 0 (the default) the HAProxy master outlives the Python process
(a SIGTERM for an upgrade, a crash, kill -9): kubelet's socket stays and pass-through
keeps working. The next ``run`` finds it through ``master.json`` in the data plane's
private directory (0700, root) and adopts it only if all of these hold: the pid is alive
with the recorded start time (no pid reuse), ``/proc/<pid>/exe`` is the haproxy binary we
would start, and the master CLI socket answers ``show proc``. Anything else is a stale
record: a new master is started (on a stale socket path, as at any start).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Final

import structlog

from runtimeproxy.dataplane import haproxy

log = structlog.get_logger("runtimeproxy.dataplane")

_TIMEOUT: Final = 1.0


def _state_file(layout: haproxy.Layout) -> Path:
    return layout.run_dir / "master.json"


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    return int(stat[stat.rindex(")") + 2:].split()[19])


def _pid_file(layout: haproxy.Layout) -> Path:
    """The same as ``master.json`` as ``<pid> <start time>``, for the orphan watchdog (sh)."""
    return layout.run_dir / "master.pid"


def record(layout: haproxy.Layout, pid: int) -> None:
    started = start_time(pid)
    data = {"pid": pid, "start_time": started}
    for path, text in ((_pid_file(layout), f"{pid} {started}\n"), (_state_file(layout), json.dumps(data))):
        tmp = path.with_suffix(".new")
        tmp.write_text(text)
        os.replace(tmp, path)


def forget(layout: haproxy.Layout) -> None:
    _state_file(layout).unlink(missing_ok=True)
    _pid_file(layout).unlink(missing_ok=True)


def _master_answers(layout: haproxy.Layout) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(_TIMEOUT)
            sock.connect(str(layout.master_socket))
            sock.sendall(b"show proc\n")
            sock.shutdown(socket.SHUT_WR)  # the master CLI keeps the connection open until our end closes
            out = b""
            while chunk := sock.recv(65536):
                out += chunk
    except OSError:
        return False
    return b"master" in out


def find_live(layout: haproxy.Layout, binary: str) -> int | None:
    """The pid of a live HAProxy master we started earlier, or None."""
    try:
        data = json.loads(_state_file(layout).read_text())
        pid, started = int(data["pid"]), data["start_time"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    why = ""
    try:
        exe = os.path.realpath(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        exe = ""
    if start_time(pid) != started or started is None:
        why = "not running"
    elif exe != os.path.realpath(binary):
        why = f"runs {exe or '?'}, not {binary}"
    elif not _master_answers(layout):
        why = "master socket does not answer"
    if why:
        log.info("data_plane_not_adopted", pid=pid, reason=why)
        return None
    return pid


async def wait_exit(pid: int) -> None:
    """Until the process (not our child: no wait()) is gone, via a pidfd."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not gone.done():
            gone.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await gone
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def signal_pid(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
