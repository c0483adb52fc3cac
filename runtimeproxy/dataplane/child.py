"""HAProxy as a plain child of this process, outside systemd (``data_plane_unit`` empty: demo,
tests, ``run`` in a terminal).

The master runs in the foreground (``-W -db``) and dies with us: ``setpriv --pdeathsig TERM``
(util-linux) sets PR_SET_PDEATHSIG and execs HAProxy in the same pid, so a killed proxy (kill -9
included) never leaves a HAProxy holding kubelet's socket. If HAProxy dies while we run, it is
started again after a short back-off. Its messages (start, reload, alerts: a few lines per
event, never per call) are read from its stderr into our JSON log.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Final

import structlog

log = structlog.get_logger("runtimeproxy.dataplane")

#: HAProxy's message tags -> our log levels.
_LEVELS: Final = {"ALERT": "error", "WARNING": "warning", "NOTICE": "info"}


def with_pdeathsig(argv: list[str]) -> list[str]:
    """``setpriv --pdeathsig TERM`` before ``argv``. A ``preexec_fn`` would do the same but forces
    a plain fork() of this multi-threaded process (grpc's fork handlers complain, the child may
    run Python between fork and exec); without one, Python spawns with vfork/posix_spawn."""
    setpriv = shutil.which("setpriv", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin", "/bin"]))
    if setpriv is None:
        log.warning("data_plane_no_pdeathsig", reason="no setpriv (util-linux): a killed proxy leaves haproxy")
        return argv
    return [setpriv, "--pdeathsig", "TERM", *argv]


class _Backoff:
    def __init__(self, initial: float = 0.1, maximum: float = 10.0, healthy_after: float = 60.0) -> None:
        self._initial, self._max, self._healthy = initial, maximum, healthy_after
        self._next = initial

    def after(self, ran: float) -> float:
        if ran >= self._healthy:
            self._next = self._initial
        delay, self._next = self._next, min(self._next * 2, self._max)
        return delay


class ChildLauncher:
    """Starts ``argv()`` (HAProxy's master), keeps it running until ``stop``, stops it last."""

    def __init__(self, argv: Callable[[], list[str]], quiet: Callable[[str], bool]) -> None:
        self._argv = argv
        #: A message our own action explains (the interception server taken out): info, not error.
        self._quiet = quiet
        self._proc: asyncio.subprocess.Process | None = None
        self._stopping = False
        self._backoff = _Backoff()
        self.starts = 0

    def stopping(self) -> bool:
        return self._stopping

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.returncode is None else None

    async def run_forever(self, before_start: Callable[[], Awaitable[None]]) -> None:
        """Start the master (``before_start`` first: the configuration); again if it exits."""
        while not self.stopping():
            started = time.monotonic()
            await before_start()
            self._proc = await asyncio.create_subprocess_exec(
                *with_pdeathsig(self._argv()), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            )
            self.starts += 1
            log.info("data_plane_started", pid=self._proc.pid, starts=self.starts)
            code = await self._wait(self._proc)
            if self.stopping():
                return
            delay = self._backoff.after(time.monotonic() - started)
            log.error("data_plane_exited", code=code, restart_in=delay)
            await asyncio.sleep(delay)

    async def _wait(self, proc: asyncio.subprocess.Process) -> int:
        reader = asyncio.ensure_future(self._relay_log(proc))
        try:
            code = await proc.wait()
            await asyncio.wait([reader], timeout=1.0)
        finally:
            reader.cancel()
        return code

    async def _relay_log(self, proc: asyncio.subprocess.Process) -> None:
        """HAProxy's stderr as our JSON lines; read as long as it writes (a full pipe blocks it)."""
        assert proc.stderr is not None
        while True:
            try:
                line = await proc.stderr.readline()
            except ValueError:  # a line over the reader's 64 KiB limit: drop it, keep reading
                line = await proc.stderr.read(65536)
            if not line:
                return
            text = line.decode(errors="replace").strip()
            level = _LEVELS.get(text[1:text.find("]")].strip(), "info") if text.startswith("[") else "info"
            if self._quiet(text):
                level = "info"
            getattr(log, level)("data_plane_message", pid=proc.pid, text=text[:2000])

    def reload(self) -> None:
        """SIGUSR2: the master re-executes itself with the new configuration and hands the
        listeners to a new worker; the old one finishes its calls."""
        if (pid := self.pid) is not None:
            os.kill(pid, signal.SIGUSR2)
            log.info("data_plane_reloaded", pid=pid)

    async def stop(self, grace: float) -> int | None:
        """Soft stop (calls in flight finish), SIGTERM after ``grace``, SIGKILL if still there."""
        self._stopping = True
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return None
        waiter = asyncio.ensure_future(proc.wait())
        for sig, wait in ((signal.SIGUSR1, grace), (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            try:
                await asyncio.wait_for(asyncio.shield(waiter), wait)
                break
            except TimeoutError:
                log.warning("data_plane_stop_slow", signal=sig.name, waited=wait)
        waiter.cancel()
        return proc.returncode
