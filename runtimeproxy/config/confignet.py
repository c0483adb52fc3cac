"""Parsing of the listen, socket and data-plane settings of ``runtimeproxy.config.settings``:
the CRI socket path and mode, ``metrics.listen``, ``allow_insecure`` and the risks it
accepts, ``data_plane``, HAProxy's idle timeout and its systemd unit.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
from collections.abc import Mapping
from typing import Any, Final

from runtimeproxy.config.configvalues import ConfigError, boolean, mapping, parse_duration, reject_unknown, string

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
    return frozenset(k for k, flag in data.items() if boolean(flag, f"allow_insecure.{k}"))


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


#: Where Debian installs HAProxy; a root shell has it on PATH, a minimal service env may not.
HAPROXY_SEARCH_PATH: Final = ("/usr/sbin", "/sbin", "/usr/local/sbin")


def find_haproxy() -> str | None:
    """The haproxy binary on PATH or in the sbin directories, or None."""
    path = os.pathsep.join([os.environ.get("PATH", ""), *HAPROXY_SEARCH_PATH])
    return shutil.which("haproxy", path=path)


def data_plane(value: object) -> str:
    """``grpc`` or ``haproxy``; ``haproxy`` (the default) needs the binary: no fallback to
    another data plane (a node's restart semantics must not depend on what is installed)."""
    if not isinstance(value, str) or value.lower() not in DATA_PLANES:
        raise ConfigError("data_plane", value, f"must be one of {list(DATA_PLANES)}")
    if value.lower() == "haproxy" and find_haproxy() is None:
        raise ConfigError("data_plane", value, "the haproxy binary is not installed (not on PATH nor in "
                          f"{', '.join(HAPROXY_SEARCH_PATH)}): apt install haproxy, or set data_plane: grpc")
    return value.lower()


#: Keys earlier versions read that this one ignores, each with why. Accepted (one warning
#: per start) rather than refused: a node upgraded with its old config.yaml (a modified
#: conffile is kept) must still start, or kubelet loses its runtime.
DEPRECATED_KEYS: Final = {
    key: "ignored: HAProxy no longer outlives this process on its own; under systemd its own unit "
         "(data_plane_unit) keeps it across restarts, outside systemd it stops with this process"
    for key in ("data_plane_orphan_grace", "data_plane_survives_restart")
}
#: A systemd service name systemctl takes as one argument (no leading '-': no option).
_UNIT_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9:_.@\\-]{0,240}\.service")


def deprecated(top: Mapping[str, Any]) -> tuple[str, ...]:
    """``key: why`` for each deprecated key present (announced at start)."""
    return tuple(f"{key}: {why}" for key, why in DEPRECATED_KEYS.items() if key in top)


def data_plane_unit(value: object) -> str:
    """``data_plane_unit``: HAProxy's systemd service (the shipped systemd config sets it), or
    empty: HAProxy runs as this process's child and dies with it."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or not _UNIT_NAME.fullmatch(value):
        raise ConfigError("data_plane_unit", value, "must be a systemd service name (like "
                          "koord-runtime-proxy-haproxy.service) or empty (HAProxy runs as this process's child)")
    return value


def idle_timeout(value: object) -> float:
    seconds = parse_duration(value, "data_plane_idle_timeout")
    if seconds < 1.0 or seconds > _MAX_IDLE_TIMEOUT:
        raise ConfigError("data_plane_idle_timeout", value, "must be between 1s and 24 days (576h)")
    return seconds
