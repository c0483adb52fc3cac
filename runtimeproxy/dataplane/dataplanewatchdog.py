"""The orphan watchdog: a HAProxy left by a dead Python process is stopped after a grace
unless the next ``run`` adopted it (``data_plane_orphan_grace``, 30 s by default).

HAProxy outlives this process (an upgrade, a restart, a crash: kubelet's socket stays), but
must not be orphaned for long (``systemctl stop``, a proxy that never comes back). The
watcher must survive our death and cost nothing per call, so it is not Python: a ``/bin/sh``
(dash) started in its own session, one per Python process, with stdin the read end of a
pipe whose write end only this process holds (close-on-exec: no child inherits it).
- while we live it blocks in ``read``: no CPU, ~1 MB RSS, no polling;
- when we are gone (exit, SIGTERM, kill -9, OOM) the kernel closes our end: EOF. It notes
  the HAProxy master recorded in ``master.pid``, sleeps the grace, then checks ``owner`` in
  the data plane's directory: a newer ``run`` that adopted HAProxy wrote its own token
  there, and this watchdog just exits. Still ours (or the directory is gone): it stops that
  master (pid and start time, re-read if recorded anew, checked so a reused pid is never
  signalled): SIGTERM, SIGKILL after 2 s, then removes kubelet's socket
  (HAProxy leaves the file) and the record, and logs one JSON line on our stderr (the journal).
- killed itself (kill -9): we notice (pidfd) and start another; no call is affected.
- adoption: the next ``run`` writes its token and ends the previous watchdog (recorded in
  ``watchdog.pid`` with its start time): one watchdog per data plane.
A full stop (SIGQUIT) or ``data_plane_orphan_grace: 0`` does not need it: HAProxy stops with us.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
from pathlib import Path
from typing import Final

import structlog

from runtimeproxy.dataplane import dataplanestate, haproxy

log = structlog.get_logger("runtimeproxy.dataplane")

#: $1 grace (seconds), $2 our token, $3 the data plane's directory, $4 kubelet's socket path.
SCRIPT: Final = r"""
grace=$1 token=$2 dir=$3 sock=$4 pid= start=
while read -r _; do :; done
read -r pid start < "$dir/master.pid" 2>/dev/null
sleep "$grace"
adopted() { owner=$(cat "$dir/owner" 2>/dev/null) && [ "$owner" != "$token" ]; }
adopted && exit 0
read -r pid start < "$dir/master.pid" 2>/dev/null
[ -n "$pid" ] || exit 0
alive() {
    line=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    set -- ${line##*) }
    [ "$1" != Z ] && [ "${20}" = "$start" ]
}
alive || exit 0
kill -TERM "$pid" 2>/dev/null
i=0; while alive && [ $i -lt 20 ]; do sleep 0.1; i=$((i + 1)); done
alive && kill -KILL "$pid" 2>/dev/null
i=0; while alive && [ $i -lt 20 ]; do sleep 0.1; i=$((i + 1)); done
adopted && exit 0
rm -f "$sock" "$dir/master.pid" "$dir/master.json" "$dir/owner" "$dir/watchdog.pid"
printf '{"event": "data_plane_orphan_stopped", "level": "warning", "pid": %s, "grace_seconds": %s, "socket": "%s"}\n' \
    "$pid" "$grace" "$sock" >&2
"""


def _owner_file(layout: haproxy.Layout) -> Path:
    return layout.run_dir / "owner"


def _pid_file(layout: haproxy.Layout) -> Path:
    return layout.run_dir / "watchdog.pid"


def end_previous(layout: haproxy.Layout, own: int | None) -> None:
    """The previous process's watchdog (recorded with its start time) is not needed once
    HAProxy is adopted: SIGKILL, unless it is ``own``."""
    with contextlib.suppress(OSError, ValueError):
        pid, start = map(int, _pid_file(layout).read_text().split())
        if pid != own and dataplanestate.start_time(pid) == start:
            dataplanestate.signal_pid(pid, signal.SIGKILL)
            log.info("data_plane_watchdog_replaced", pid=pid)


class OrphanWatchdog:
    """One watchdog process per Python process; re-started if it dies while we run."""

    def __init__(self, layout: haproxy.Layout, listen: str, grace: float) -> None:
        self.layout, self.listen, self.grace = layout, listen, grace
        self.token = secrets.token_hex(16)
        #: The armed watchdog (our child while we run; never a Popen: nothing kills or warns
        #: about it when this process exits, which is when it is meant to act).
        self.pid: int | None = None
        self._write_end: int | None = None
        self._stopped = False
        self.arms = 0

    def stopped(self) -> bool:
        return self._stopped

    def claim(self) -> None:
        """Ours from now on: an older watchdog that wakes up finds another token and leaves
        HAProxy alone. Written before this process serves (spawn or adoption). The previous
        process's watchdog (recorded with its start time) is not needed any more: ended."""
        tmp = _owner_file(self.layout).with_suffix(".new")
        tmp.write_text(self.token)
        os.replace(tmp, _owner_file(self.layout))
        end_previous(self.layout, self.pid)

    def _record(self, pid: int) -> None:
        tmp = _pid_file(self.layout).with_suffix(".new")
        tmp.write_text(f"{pid} {dataplanestate.start_time(pid)}\n")
        os.replace(tmp, _pid_file(self.layout))

    def _spawn(self) -> int:
        sh = shutil.which("sh", path="/bin:/usr/bin") or "/bin/sh"
        argv = [sh, "-c", SCRIPT, "krp-orphan-watchdog", f"{self.grace:g}", self.token,
                str(self.layout.run_dir), self.listen]
        read_end, write_end = os.pipe()  # both close-on-exec: only the watchdog gets read_end (as stdin)
        devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        try:
            pid = os.posix_spawn(sh, argv, os.environ, setsid=True, file_actions=[
                (os.POSIX_SPAWN_DUP2, read_end, 0), (os.POSIX_SPAWN_DUP2, devnull, 1)])
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
            os.close(devnull)
        if self._write_end is not None:
            os.close(self._write_end)  # the previous watchdog's pipe (it is gone)
        self._write_end = write_end
        self.pid = pid
        self._record(pid)
        return pid

    @staticmethod
    def _reap(pid: int) -> int:
        """Its exit status (it has exited: returns at once)."""
        try:
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        except ChildProcessError:
            return 0

    async def run_forever(self) -> None:
        """Keep one watchdog armed while we run; cancelling this leaves it armed (it fires
        only after we are gone)."""
        await asyncio.to_thread(self.claim)
        while not self.stopped():
            pid = await asyncio.to_thread(self._spawn)
            self.arms += 1
            log.info("data_plane_watchdog_armed", pid=pid, grace_seconds=self.grace, arms=self.arms)
            await dataplanestate.wait_exit(pid)
            code = self._reap(pid)
            if self.stopped():
                return
            log.warning("data_plane_watchdog_exited", pid=pid, code=code, rearm_in=1.0)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(self.claim)

    def disarm(self) -> None:
        """A full stop: HAProxy stops with us, the watchdog is not needed."""
        self._stopped = True
        pid, self.pid = self.pid, None
        if pid is not None:
            dataplanestate.signal_pid(pid, signal.SIGKILL)
            self._reap(pid)
        if self._write_end is not None:
            with contextlib.suppress(OSError):
                os.close(self._write_end)
            self._write_end = None
        with contextlib.suppress(OSError):
            if _owner_file(self.layout).read_text() == self.token:
                _owner_file(self.layout).unlink()
                _pid_file(self.layout).unlink()

    def leave(self) -> None:
        """A stop that keeps HAProxy: the watchdog stays; it fires once our end of its pipe
        closes (at our exit, or now)."""
        self._stopped = True
