"""Parsing of the listen, socket and data-plane settings of ``runtimeproxy.config.settings``:
the CRI socket path and mode, ``metrics.listen``, ``allow_insecure`` and the risks it
accepts, ``data_plane`` and HAProxy's idle timeout and orphan grace.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from typing import Any, Final

from runtimeproxy.config.configvalues import DURATION, ConfigError, mapping, parse_duration, reject_unknown, string

#: ``allow_insecure.<key>: true`` accepts one risk that is otherwise refused (exit 2 at
#: start, a reload rejected); it is then warned about at every start.
INSECURE_OPT_INS: Final = frozenset({"socket_mode", "metrics_listen", "file_permissions"})


def endpoint(value: object, key_path: str) -> str:
    text = string(value, key_path)
    text = text.removeprefix("unix://")
    if text and not text.startswith("/"):
        raise ConfigError(key_path, value, "must be an absolute unix socket path")
    check_unix_path(text, key_path)
    return text


#: ``sockaddr_un.sun_path`` is 108 bytes on Linux, the terminating NUL included.
UNIX_PATH_MAX = 107


def check_unix_path(path: str, key_path: str) -> None:
    """A path the kernel can bind or connect to as a unix socket, and that can be written
    into HAProxy's generated configuration and command line: no control character (a
    newline would end the line it is on), at most ``UNIX_PATH_MAX`` bytes."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise ConfigError(key_path, path, "a socket path must not contain control characters (newline, tab, NUL...)")
    size = len(os.fsencode(path))
    if size > UNIX_PATH_MAX:
        raise ConfigError(key_path, path, f"a unix socket path is at most {UNIX_PATH_MAX} bytes, this one has {size}")


def socket_mode(value: object) -> int:
    if isinstance(value, str) and re.fullmatch(r"0?[0-7]{3}", value):
        return int(value, 8)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 0o777:
        return value
    raise ConfigError("socket_mode", value, "must be an octal mode string such as '0660'")


def host_port(value: object, key_path: str) -> str:
    text = string(value, key_path)
    if text and (not re.fullmatch(r"[\w.\-\[\]:]+:\d{1,5}", text) or int(text.rpartition(":")[2]) > 65535):
        raise ConfigError(key_path, value, "must be host:port, or empty to disable")
    return text


def allow_insecure(value: object) -> frozenset[str]:
    data = mapping(value, "allow_insecure")
    reject_unknown(data, INSECURE_OPT_INS, "allow_insecure.")
    for key, flag in data.items():
        if not isinstance(flag, bool):
            raise ConfigError(f"allow_insecure.{key}", flag, "must be true or false")
    return frozenset(k for k, flag in data.items() if flag)


def _is_loopback(host_port: str) -> bool:
    host = host_port.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve to anything


def risks(socket_mode: int, metrics_listen: str, allowed: frozenset[str]) -> tuple[str, ...]:
    """Refuse a risky value unless allowed; return the allowed ones present."""
    risks: list[tuple[str, str, object, str]] = []
    if socket_mode & 0o007:
        risks.append(("socket_mode", "socket_mode", f"{socket_mode:04o}",
                      "gives every local user the CRI socket (root on the node); use 0660"))
    if metrics_listen and not _is_loopback(metrics_listen):
        risks.append(("metrics_listen", "metrics.listen", metrics_listen,
                      "is not a loopback address: /metrics, /debug/explain and /apis/nodemetric are served "
                      "without authentication; use 127.0.0.1:<port>"))
    accepted = []
    for opt_in, key_path, value, why in risks:
        if opt_in not in allowed:
            raise ConfigError(key_path, value, f"{why}, or set allow_insecure.{opt_in}: true to accept the risk")
        accepted.append(f"{key_path}={value}: {why}")
    return tuple(accepted)


DATA_PLANES: Final = ("grpc", "haproxy")
#: HAProxy's timers are 32-bit milliseconds (~24.8 days).
_MAX_IDLE_TIMEOUT = 24 * 86400.0


def data_plane(value: object) -> str:
    if not isinstance(value, str) or value.lower() not in DATA_PLANES:
        raise ConfigError("data_plane", value, f"must be one of {list(DATA_PLANES)}")
    return value.lower()


#: HAProxy's orphan watchdog sleeps at most this long (a day) before stopping it.
_MAX_ORPHAN_GRACE = 86400.0


def orphan_grace(top: Mapping[str, Any], default: float) -> float:
    """``data_plane_orphan_grace`` (0 .. 24h); the older ``data_plane_survives_restart``
    still works alone (false: 0, true: the default grace), never together with it."""
    if "data_plane_survives_restart" in top:
        old = top["data_plane_survives_restart"]
        if "data_plane_orphan_grace" in top:
            raise ConfigError("data_plane_survives_restart", old,
                              "replaced by data_plane_orphan_grace: set only data_plane_orphan_grace")
        if not isinstance(old, bool):
            raise ConfigError("data_plane_survives_restart", old, "must be true or false")
        return default if old else 0.0
    value = top.get("data_plane_orphan_grace", default)
    zero = isinstance(value, int | float | str) and not isinstance(value, bool) and (
        value == 0 or (isinstance(value, str) and (m := DURATION.match(value)) is not None and float(m.group(1)) == 0))
    seconds = 0.0 if zero else parse_duration(value, "data_plane_orphan_grace")
    if seconds > _MAX_ORPHAN_GRACE:
        raise ConfigError("data_plane_orphan_grace", value, "must be between 0 (stop with this process) and 24h")
    return seconds


def idle_timeout(value: object) -> float:
    seconds = parse_duration(value, "data_plane_idle_timeout")
    if seconds < 1.0 or seconds > _MAX_IDLE_TIMEOUT:
        raise ConfigError("data_plane_idle_timeout", value, "must be between 1s and 24 days (576h)")
    return seconds
