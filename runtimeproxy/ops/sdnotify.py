"""systemd notify protocol (``Type=notify`` and ``WatchdogSec=``) without libsystemd.

The proxy sits between the kubelet and the container runtime, so systemd must
know when it is really ready (socket bound, runtime reachable) and must restart
it when it wedges. The protocol is one datagram per message on $NOTIFY_SOCKET; a
few lines here avoid a C-extension dependency (``systemd-python``) on every node.
Nothing in here raises: notifying is best effort and must never take the proxy
down, e.g. when run outside systemd or in a test.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Mapping

import structlog
from structlog.typing import FilteringBoundLogger

# Bounded so a full notify queue cannot stall the event loop (the CRI hot path)
# for long; a lost WATCHDOG=1 is retried on the next tick anyway.
_SEND_TIMEOUT_SECONDS = 0.5

_log: FilteringBoundLogger = structlog.get_logger(component="sdnotify")


def _environ(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def _address(raw: str) -> str | None:
    """Map $NOTIFY_SOCKET to a socket address; systemd uses '@' for the
    Linux abstract namespace, which Python spells with a leading NUL."""
    if raw.startswith("@") and len(raw) > 1:
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    return None  # e.g. vsock: addresses, which this proxy never runs under


def notify(message: str, *, env: Mapping[str, str] | None = None) -> bool:
    """Send ``message`` (e.g. ``"READY=1"``) to systemd; True if it was sent."""
    raw = _environ(env).get("NOTIFY_SOCKET", "")
    address = _address(raw) if raw else None
    if address is None:
        return False
    try:
        with socket.socket(
            socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
        ) as sock:
            sock.settimeout(_SEND_TIMEOUT_SECONDS)
            sock.sendto(message.encode(), address)
    except OSError as exc:
        _log.warning("sd_notify_failed", socket=raw, error=str(exc))
        return False
    return True


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between watchdog pings, or None when the watchdog is off for us.

    Half of WatchdogSec, as sd_watchdog_enabled(3) recommends, so one late tick
    does not get the service killed.
    """
    values = _environ(env)
    try:
        usec = int(values.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = values.get("WATCHDOG_PID")
    # WATCHDOG_PID names the process systemd watches; a child that inherited the
    # environment must not ping on its parent's behalf.
    if pid is not None:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 1_000_000 / 2


def _is_healthy(healthy: Callable[[], bool]) -> bool:
    try:
        return bool(healthy())
    except Exception as exc:  # noqa: BLE001 - a broken probe means "unhealthy"
        _log.error("watchdog_probe_failed", error=repr(exc))
        return False


async def watchdog_loop(
    interval: float,
    healthy: Callable[[], bool],
    *,
    env: Mapping[str, str] | None = None,
) -> None:
    """Ping WATCHDOG=1 every ``interval`` seconds while ``healthy()`` is True.

    When unhealthy the ping is skipped on purpose: systemd then restarts us,
    which is the cure for a proxy that can no longer reach its runtime.
    Runs until cancelled.
    """
    if interval <= 0:
        raise ValueError("watchdog interval must be positive")
    was_healthy = True
    while True:
        is_healthy = _is_healthy(healthy)
        if is_healthy:
            notify("WATCHDOG=1", env=env)
        if is_healthy != was_healthy:
            # Transitions only: one line per incident, not one per tick.
            _log.warning("watchdog_health_changed", healthy=is_healthy)
            was_healthy = is_healthy
        await asyncio.sleep(interval)
