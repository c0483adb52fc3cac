"""The HAProxy data plane: its configuration, its process, and the calls we make to it.

HAProxy runs master-worker. Who runs it depends on ``data_plane_unit``:
- set (the shipped systemd config): systemd, through HAProxy's own unit
  (runtimeproxy.dataplane.systemdunit): restarted by systemd if it dies, stopped with the
  product's unit, left serving while this process restarts, upgrades or crashes;
- empty (demo, tests, ``run`` in a terminal): this process, as a plain child that dies with it
  (runtimeproxy.dataplane.child: PR_SET_PDEATHSIG).
Either way this process renders the configuration (runtimeproxy.dataplane.haproxy), checks it
with ``haproxy -c``, writes it to the data plane's private directory and asks for a reload when
it changed: the master re-executes (the binary now installed, after an upgrade), hands the
listeners to a new worker and lets the old worker finish its calls: nothing in flight fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Final

import grpc
import grpc.aio
import structlog

from criapi import cri_v1_pb2 as cri
from runtimeproxy.config.confignet import find_haproxy
from runtimeproxy.config.settings import ConfigError, Settings
from runtimeproxy.dataplane import haproxy, haproxystats
from runtimeproxy.dataplane.child import ChildLauncher
from runtimeproxy.dataplane.systemdunit import SystemdUnit
from runtimeproxy.transport.grpcserver import SocketInUse, prepare_socket

log = structlog.get_logger("runtimeproxy.dataplane")

VERSION_METHOD: Final = "/runtime.v1.RuntimeService/Version"


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
    who = f"run by systemd: {settings.data_plane_unit}" if settings.data_plane_unit else "a child: stops with the proxy"
    return f"data_plane=haproxy ({binary}; {who})"


class HaproxyDataPlane:
    """HAProxy's configuration and private directory, and its process: a child or a systemd unit."""

    def __init__(
        self, binary: str, settings: Settings,
        intercepted: Callable[[], tuple[str, ...]] = lambda: haproxy.LIFECYCLE_METHODS,
    ) -> None:
        self.binary = binary
        #: The lifecycle paths the running hook chain needs in Python, read at every render.
        self._intercepted = intercepted
        self.layout = haproxy.Layout.for_listen(Path(settings.listen))
        self._settings = settings
        #: The interception server is out of rotation because we took it out (a drain).
        self._intercept_out = False
        self._rendered = ""
        self.unit = SystemdUnit(settings.data_plane_unit) if settings.data_plane_unit else None
        self.child = None if self.unit is not None else ChildLauncher(
            lambda: haproxy.command(self.binary, self.layout),
            quiet=lambda text: self._intercept_out and "intercept" in text,
        )

    @property
    def intercept_socket(self) -> Path:
        return self.layout.intercept_socket

    @property
    def pid(self) -> int | None:
        """HAProxy's master: our child's, or the unit's MainPID when we last asked systemd."""
        return self.unit.pid if self.unit is not None else self.child.pid if self.child is not None else None

    def prepare(self) -> None:
        """Before anything listens: the private dir (0700) and, for a child, kubelet's socket path
        free (a live socket there is another proxy: SocketInUse; a stale one is removed). Under
        systemd a live socket is our HAProxy unit's, serving on while this process restarts."""
        if self.unit is None:
            prepare_socket(Path(self._settings.listen))
        try:
            self.layout.run_dir.mkdir(mode=0o700, parents=self.unit is not None, exist_ok=True)
            os.chmod(self.layout.run_dir, 0o700)
        except OSError as exc:
            why = f"cannot create the data plane's directory {self.layout.run_dir}: {exc.strerror}"
            raise ConfigError("listen", self._settings.listen, why) from None
        self.layout.not_cri_reply.write_bytes(haproxy.NOT_CRI_REPLY)

    # --- configuration -----------------------------------------------------------

    async def _write_config(self, settings: Settings) -> bool:
        """Render, check with ``haproxy -c``, replace the file; False if what is there is the same."""
        text = haproxy.render(settings, self.layout, self._intercepted())
        if not self._rendered:
            with contextlib.suppress(OSError):  # under systemd: what the running HAProxy was given
                self._rendered = self.layout.config_file.read_text()
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
        if changed and self.unit is not None:
            await self.unit.reload()
        elif changed and self.child is not None:
            self.child.reload()
        return changed

    # --- process -----------------------------------------------------------------

    async def _fresh_config(self) -> None:
        """Before a child starts: its master CLI socket free, the configuration written."""
        self.layout.master_socket.unlink(missing_ok=True)
        await self._write_config(self._settings)

    async def run_forever(self) -> None:
        """A child: keep it running until ``stop``. A unit: started (or reloaded if the
        configuration changed) once; systemd keeps it. Cancelling this leaves HAProxy alone."""
        if self.child is not None:
            await self.child.run_forever(self._fresh_config)
            return
        assert self.unit is not None
        changed = await self._write_config(self._settings)
        await self.unit.ensure(changed)
        # A previous process took the interception server out when it stopped (a reloaded
        # worker starts with it in; telling it again is harmless).
        await asyncio.to_thread(self.intercept, True)
        log.info("data_plane_serving", unit=self.unit.unit, pid=self.unit.pid, socket=self._settings.listen,
                 intercept_socket=str(self.layout.intercept_socket))
        await asyncio.Event().wait()  # nothing to supervise: systemd does

    def intercept(self, ready: bool) -> None:
        """Put the interception server in or out of HAProxy's rotation (runtime API). Out
        (maint) before Python drains: a new lifecycle call gets 503 (UNAVAILABLE) from HAProxy
        at once instead of racing the server's stop on an open connection; in again when a
        Python process listens (under systemd HAProxy outlives the one that took it out)."""
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

    async def stop(self, grace: float) -> None:
        """A child: soft stop (calls in flight finish), then SIGTERM, then SIGKILL; kubelet's socket
        removed. A unit: left to systemd (``systemctl stop koord-runtime-proxy`` stops it too)."""
        if self.child is None:
            log.info("data_plane_left_to_systemd", unit=self._settings.data_plane_unit, pid=self.pid)
            return
        pid = self.child.pid
        code = await self.child.stop(grace)
        # HAProxy leaves its socket file: remove it (only if nothing answers on it), so a
        # stopped proxy looks like the gRPC transport's: no socket.
        with contextlib.suppress(SocketInUse, ConfigError):
            prepare_socket(Path(self._settings.listen))
        log.info("data_plane_stopped", pid=pid, code=code)
