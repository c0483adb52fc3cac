"""The HAProxy data plane as a supervised child of ``koord-runtime-proxy run``.

HAProxy runs master-worker in the foreground (``-W -db``): the master is our child.
- start: the configuration is rendered from Settings (runtimeproxy.dataplane.haproxy), checked
  with ``haproxy -c`` and written; the master binds kubelet's socket (to a temporary
  name, then renamed over the path: the path never disappears, a stale file is replaced).
- crash: ``run_forever`` (a supervised task) restarts the master after a short back-off
  (0.1 s, doubling up to 10 s, reset after a minute of health): kubelet's socket is back
  at the same path well within 2 s.
- reload: a changed configuration is checked, written, and the master gets SIGUSR2: it
  re-executes itself, hands the listeners to a new worker and lets the old worker finish
  its calls (an idle kubelet connection gets GOAWAY and reconnects): nothing in flight fails.
- stop: last, after Python drained its calls: SIGUSR1 (soft stop: finish calls, no new
  connections), SIGTERM after ``grace``, SIGKILL if still there.
- our own death: the master gets SIGTERM from the kernel (PR_SET_PDEATHSIG), so a killed
  proxy does not leave a HAProxy holding kubelet's socket for the next one.
  That is ``data_plane_orphan_grace: 0``.
- ``data_plane_orphan_grace`` > 0 (the default, 30 s) instead: the master runs in its own
  session without PR_SET_PDEATHSIG, is recorded in ``master.json`` (runtimeproxy.dataplane.dataplanestate),
  outlives a SIGTERM (an upgrade) or a crash of this process, and the next ``run`` adopts it
  (and reloads it if the configuration changed): kubelet's socket never goes away. If no
  ``run`` adopts it within the grace, the orphan watchdog (runtimeproxy.dataplane.dataplanewatchdog, a
  ``sh`` that outlives us) stops it and removes the socket. A full stop (SIGQUIT) stops it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import grpc
import grpc.aio
import structlog

from criapi import cri_v1_pb2 as cri
from runtimeproxy.config.confignet import find_haproxy
from runtimeproxy.config.settings import ConfigError, Settings
from runtimeproxy.dataplane import dataplanestate, dataplanewatchdog, haproxy, haproxystats
from runtimeproxy.dataplane.dataplanewatchdog import OrphanWatchdog
from runtimeproxy.transport.grpcserver import SocketInUse, prepare_socket

log = structlog.get_logger("runtimeproxy.dataplane")

VERSION_METHOD: Final = "/runtime.v1.RuntimeService/Version"
#: HAProxy's message tags -> our log levels.
_LEVELS: Final = {"ALERT": "error", "WARNING": "warning", "NOTICE": "info"}


def check(settings: Settings) -> str:
    """What ``check-config`` says about the data plane (``data_plane=...``); ConfigError if HAProxy refuses
    the configuration ``run`` would generate (checked with ``haproxy -c`` in a temp dir)."""
    if settings.data_plane != "haproxy":
        return "data_plane=grpc"
    binary = find_haproxy()
    if binary is None:  # removed since the configuration was parsed
        raise ConfigError("data_plane", "haproxy", "the haproxy binary is not installed: apt install haproxy,"
                          " or set data_plane: grpc")
    with tempfile.TemporaryDirectory(prefix="krp-check-") as tmp:
        layout = haproxy.Layout(Path(tmp))
        layout.not_cri_reply.write_bytes(haproxy.NOT_CRI_REPLY)
        layout.config_file.write_text(haproxy.render(settings, layout))
        out = subprocess.run([*haproxy.check_command(binary, layout.config_file)], capture_output=True,
                             text=True, timeout=30, check=False)
    if out.returncode != 0:
        raise ConfigError("data_plane", "haproxy", "haproxy refused the generated configuration: "
                          + (out.stdout + out.stderr).strip()[-2000:])
    grace = settings.data_plane_orphan_grace
    outlives = f"outlives the proxy by up to {grace:g}s" if grace else "stops with the proxy"
    return f"data_plane=haproxy ({binary}; {outlives})"


def _with_pdeathsig(argv: list[str]) -> list[str]:
    """``setpriv --pdeathsig TERM`` (util-linux, Essential in Debian) sets PR_SET_PDEATHSIG
    and execs HAProxy in the same pid. A ``preexec_fn`` would do the same but forces a plain
    fork() of this multi-threaded process (grpc's fork handlers then complain on stderr,
    and the child may run Python between fork and exec); without one, Python spawns with
    vfork/posix_spawn."""
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


class HaproxyDataPlane:
    """Owns the HAProxy master process, its configuration and its private directory."""

    def __init__(
        self, binary: str, settings: Settings,
        intercepted: Callable[[], tuple[str, ...]] = lambda: haproxy.LIFECYCLE_METHODS,
    ) -> None:
        self.binary = binary
        #: The lifecycle paths the running hook chain needs in Python, read at every render.
        self._intercepted = intercepted
        self.layout = haproxy.Layout.for_listen(Path(settings.listen))
        self._settings = settings
        self._proc: asyncio.subprocess.Process | None = None
        self._stopping = False
        #: The interception server is out of rotation because we took it out (a drain).
        self._intercept_out = False
        self._backoff = _Backoff()
        self.starts = 0
        self._rendered = ""
        self._keep = settings.data_plane_orphan_grace > 0
        self.watchdog = OrphanWatchdog(self.layout, settings.listen, settings.data_plane_orphan_grace) \
            if self._keep else None
        self._adopted: int | None = None
        self._candidate: int | None = None

    @property
    def intercept_socket(self) -> Path:
        return self.layout.intercept_socket

    def stopping(self) -> bool:
        return self._stopping

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.returncode is None else self._adopted

    def prepare(self) -> None:
        """Before anything listens: the private dir (0700) and kubelet's socket path free
        (a live socket there is another proxy: SocketInUse; a stale one is removed)."""
        if self.layout.run_dir.is_dir():
            # Also with grace 0: a HAProxy the previous run (with a grace) left is adopted,
            # not a reason to refuse the socket; it then stops with us.
            self._candidate = dataplanestate.find_live(self.layout, self.binary)
        if self._candidate is None:
            prepare_socket(Path(self._settings.listen))
        try:
            self.layout.run_dir.mkdir(mode=0o700, exist_ok=True)
            os.chmod(self.layout.run_dir, 0o700)
        except OSError as exc:
            why = f"cannot create the data plane's directory {self.layout.run_dir}: {exc.strerror}"
            raise ConfigError("listen", self._settings.listen, why) from None
        self.layout.not_cri_reply.write_bytes(haproxy.NOT_CRI_REPLY)

    # --- configuration -----------------------------------------------------------

    async def _write_config(self, settings: Settings) -> bool:
        """Render, check with ``haproxy -c``, replace the file; False if unchanged."""
        text = haproxy.render(settings, self.layout, self._intercepted())
        if text == self._rendered and self.layout.config_file.exists():
            return False
        tmp = self.layout.config_file.with_suffix(".new")
        tmp.write_text(text)
        check = await asyncio.create_subprocess_exec(
            *haproxy.check_command(self.binary, tmp),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await check.communicate()
        if check.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise ConfigError("data_plane", "haproxy", f"haproxy refused the generated configuration: "
                              f"{out.decode(errors='replace').strip()[-2000:]}")
        os.replace(tmp, self.layout.config_file)
        self._rendered = text
        return True

    async def apply(self, settings: Settings) -> bool:
        """On a config reload: rewrite and reload HAProxy if its configuration changed."""
        self._settings = settings
        try:
            changed = await self._write_config(settings)
        except ConfigError as exc:
            log.error("data_plane_reload_rejected", error=str(exc), kept="previous haproxy configuration")
            return False
        pid = self.pid
        if changed and pid is not None:
            os.kill(pid, signal.SIGUSR2)
            log.info("data_plane_reloaded", pid=pid)
        return changed

    # --- process -----------------------------------------------------------------

    async def _spawn(self) -> asyncio.subprocess.Process:
        await self._write_config(self._settings)
        self.layout.master_socket.unlink(missing_ok=True)
        argv = haproxy.command(self.binary, self.layout)
        if self._keep:
            # Outlives us: its own session, no death signal, and its messages (a few lines per
            # start, reload or alert) go to a file in its private dir, not to a pipe that breaks
            # when we exit; the file is started afresh with each new master.
            fd = os.open(self.layout.run_dir / "haproxy.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True,
                )
            finally:
                os.close(fd)
            dataplanestate.record(self.layout, proc.pid)
        else:
            proc = await asyncio.create_subprocess_exec(
                *_with_pdeathsig(argv), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            )
        self.starts += 1
        log.info("data_plane_started", binary=self.binary, pid=proc.pid, socket=self._settings.listen,
                 intercept_socket=str(self.layout.intercept_socket), starts=self.starts)
        return proc

    async def _relay_log(self, proc: asyncio.subprocess.Process) -> None:
        """HAProxy's own messages (start, reload, stop, alerts) as our JSON log lines, so
        nothing but JSON reaches the journal. It writes a few lines per event, never per call."""
        assert proc.stderr is not None
        while True:
            try:
                line = await proc.stderr.readline()
            except ValueError:  # a line over the reader's 64 KiB limit: drop it, keep reading
                line = await proc.stderr.read(65536)
            if not line:
                return  # the pipe must be read as long as HAProxy writes: a full pipe blocks it
            text = line.decode(errors="replace").strip()
            level = _LEVELS.get(text[1:text.find("]")].strip(), "info") if text.startswith("[") else "info"
            if self._intercept_out and "intercept" in text:
                # "Server intercept/python is going DOWN for maintenance", "backend 'intercept' has
                # no server available": what our own drain does, at every clean stop; not an error.
                level = "info"
            getattr(log, level)("data_plane_message", pid=proc.pid, text=text[:2000])

    async def run_forever(self) -> None:
        """Keep the master running until ``stop``; cancelling this leaves the process
        alone (``stop`` ends it, last). With an orphan grace, the watchdog is armed first."""
        if self.watchdog is not None:
            watch = asyncio.ensure_future(self.watchdog.run_forever())
            try:
                await self._run()
            finally:
                watch.cancel()
        else:
            await self._run()

    async def _run(self) -> None:
        while not self.stopping():
            started = time.monotonic()
            if self._candidate is not None:
                pid, self._candidate = self._candidate, None
                await self._adopt(pid)
                await dataplanestate.wait_exit(pid)
                self._adopted, code = None, None
            else:
                self._proc = await self._spawn()
                code = await self._wait_child(self._proc)
            if self.stopping():
                return
            delay = self._backoff.after(time.monotonic() - started)
            log.error("data_plane_exited", code=code, restart_in=delay)
            await asyncio.sleep(delay)

    async def _wait_child(self, proc: asyncio.subprocess.Process) -> int:
        if proc.stderr is None:
            return await proc.wait()
        reader = asyncio.ensure_future(self._relay_log(proc))
        try:
            code = await proc.wait()
            await asyncio.wait([reader], timeout=1.0)
        finally:
            reader.cancel()
        return code

    async def _adopt(self, pid: int) -> None:
        """Take over the master a previous ``run`` left serving; reload it if the
        configuration it runs is not the one these settings give."""
        self._adopted = pid
        if self.watchdog is None:
            await asyncio.to_thread(dataplanewatchdog.end_previous, self.layout, None)
        with contextlib.suppress(OSError):
            self._rendered = self.layout.config_file.read_text()
        try:
            changed = await self._write_config(self._settings)
        except ConfigError as exc:
            log.error("data_plane_reload_rejected", error=str(exc), kept="the adopted haproxy's configuration")
            changed = False
        if changed:
            os.kill(pid, signal.SIGUSR2)  # the new worker starts with the interception server in
        else:
            await asyncio.to_thread(self.intercept, True)  # the previous process took it out
        log.info("data_plane_adopted", pid=pid, socket=self._settings.listen, reloaded=changed)

    def intercept(self, ready: bool) -> None:
        """Put the interception server in or out of HAProxy's rotation (runtime API). Out
        (maint) before Python drains: a new lifecycle call gets 503 (UNAVAILABLE) from HAProxy
        at once instead of racing the server's stop on an open connection; in again when a
        Python process that adopted HAProxy listens."""
        state = "ready" if ready else "maint"
        self._intercept_out = not ready
        try:
            out = haproxystats.command(self.layout.stats_socket, f"set server intercept/python state {state}")
        except OSError as exc:
            log.warning("data_plane_intercept_state_failed", state=state, error=str(exc))
            return
        if out.strip():
            log.warning("data_plane_intercept_state_failed", state=state, error=out.strip()[:500])

    async def wait_answering(self, stop: asyncio.Event, timeout: float = 2.0) -> bool:
        """Poll Version through kubelet's socket (HAProxy, then containerd) until it
        answers or ``stop`` is set."""
        payload = cri.VersionRequest(version="v1").SerializeToString()
        delay = 0.05
        # grpc's default reconnect back-off (1 s) would delay READY=1 past HAProxy's start.
        options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
                   ("grpc.max_reconnect_backoff_ms", 500)]
        async with grpc.aio.insecure_channel("unix://" + self._settings.listen, options=options) as channel:
            call = channel.unary_unary(VERSION_METHOD)
            while not stop.is_set():
                try:
                    await call(payload, timeout=timeout)
                    return True
                except grpc.aio.AioRpcError:
                    await asyncio.wait([asyncio.ensure_future(stop.wait())], timeout=delay)
                    delay = min(delay * 2, 1.0)
        return False

    async def stop(self, grace: float, *, full: bool = True) -> None:
        """Soft stop (calls in flight finish), then SIGTERM, then SIGKILL. With
        an orphan grace and not ``full``: left running for the next ``run`` (or its watchdog)."""
        self._stopping = True
        pid, proc = self.pid, self._proc
        if self.watchdog is not None:
            if self._keep and not full and pid is not None:
                self.watchdog.leave()
                log.info("data_plane_kept", pid=pid, socket=self._settings.listen,
                         orphan_grace_seconds=self._settings.data_plane_orphan_grace, watchdog=self.watchdog.pid)
                return
            await asyncio.to_thread(self.watchdog.disarm)
        if pid is None:
            return
        exited = proc.wait() if proc is not None and proc.pid == pid else dataplanestate.wait_exit(pid)
        waiter = asyncio.ensure_future(exited)
        for sig, wait in ((signal.SIGUSR1, grace), (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            dataplanestate.signal_pid(pid, sig)
            try:
                await asyncio.wait_for(asyncio.shield(waiter), wait)
                break
            except TimeoutError:
                log.warning("data_plane_stop_slow", signal=sig.name, waited=wait)
        # HAProxy leaves its socket file: remove it (only if nothing answers on it), so a
        # stopped proxy looks like the gRPC transport's: no socket.
        waiter.cancel()
        dataplanestate.forget(self.layout)
        with contextlib.suppress(SocketInUse, ConfigError):
            prepare_socket(Path(self._settings.listen))
        log.info("data_plane_stopped", pid=pid, code=proc.returncode if proc is not None else None)
