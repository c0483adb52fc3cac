"""HAProxy under systemd (``data_plane_unit``, set by the shipped systemd config): its own unit
(systemd/koord-runtime-proxy-haproxy.service) runs it, restarts it, reloads it, stops it.

This process only renders the configuration and asks systemd: ``reload-or-restart`` when the
configuration changed (also starts it if it is not running), else ``start`` (nothing if it
runs). It never stops it: the units' dependencies decide (``systemctl stop koord-runtime-proxy``
stops both; a restart, an upgrade or a crash of this process leaves HAProxy serving).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from typing import Final

import structlog

from runtimeproxy.errors import PeerError

log = structlog.get_logger("runtimeproxy.dataplane")

#: systemctl waits for a start or reload job; HAProxy (Type=notify) is ready in well under this.
_TIMEOUT: Final = 90.0


class SystemctlError(PeerError, RuntimeError):
    pass


class SystemdUnit:
    def __init__(self, unit: str) -> None:
        self.unit = unit
        #: HAProxy's master as systemd last told us (MainPID), or None.
        self.pid: int | None = None

    async def _systemctl(self, *args: str) -> str:
        binary = shutil.which("systemctl", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/bin", "/bin"]))
        if binary is None:
            raise SystemctlError(f"data_plane_unit {self.unit}: no systemctl (is this host run by systemd?)")
        proc = await asyncio.create_subprocess_exec(
            binary, *args, "--", self.unit, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), _TIMEOUT)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise SystemctlError(f"systemctl {' '.join(args)} {self.unit}: no answer in {_TIMEOUT:g}s") from None
        text = out.decode(errors="replace").strip()
        if proc.returncode != 0:
            raise SystemctlError(f"systemctl {' '.join(args)} {self.unit} failed ({proc.returncode}): {text[-1000:]}")
        return text

    async def _main_pid(self) -> int | None:
        pid = await self._systemctl("show", "--value", "--property=MainPID")
        return int(pid) if pid.isdigit() and int(pid) > 0 else None

    async def ensure(self, changed: bool) -> None:
        """HAProxy running with the configuration just written."""
        await self._systemctl("reload-or-restart" if changed else "start")
        self.pid = await self._main_pid()
        log.info("data_plane_unit_started" if not changed else "data_plane_unit_reloaded",
                 unit=self.unit, pid=self.pid)

    async def reload(self) -> None:
        await self._systemctl("reload")
        self.pid = await self._main_pid()
        log.info("data_plane_reloaded", unit=self.unit, pid=self.pid)
