"""Settings: the YAML file and the command line, validated once into frozen values.

Nothing downstream indexes raw YAML. Every error names the key path and the bad
value (``hooks[1].timeout: must be a duration > 0 (got '-1s')``) so an operator can
fix the file without reading code. Sections owned by plugins (``rules``, ``tasks``
and each hook's ``args``) are kept as plain data and validated by their owners.
"""

from __future__ import annotations

import enum
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import yaml

from runtimeproxy.hookapi import HostRoots, Stage

DEFAULT_CONFIG_PATH: Final = Path("/etc/koord-runtime-proxy/config.yaml")
MiB: Final = 1024 * 1024


class ConfigError(Exception):
    """A setting is invalid. The message starts with the key path."""

    def __init__(self, key_path: str, value: object, message: str) -> None:
        super().__init__(f"{key_path}: {message} (got {value!r})")
        self.key_path = key_path
        self.value = value


class FailurePolicy(enum.Enum):
    """What a hook failure does to the CRI call (Koordinator's words)."""

    FAIL = "Fail"
    IGNORE = "Ignore"


@dataclass(frozen=True, slots=True)
class HookSettings:
    """One entry of ``hooks:``; the list order is the chain order."""

    name: str
    #: Entry-point name (group ``koord_runtime_proxy.hooks``) or ``module:attr``.
    plugin: str
    #: Unix socket of a RuntimeHookService v1alpha1 server; exclusive with ``plugin``.
    remote: str
    #: Stages to run; ``None`` means every stage the hook implements.
    stages: frozenset[Stage] | None
    #: Fail aborts the CRI call; Ignore logs, counts and goes on.
    failure_policy: FailurePolicy
    #: Seconds one hook call may take. 1 s by default: kubelet's own CRI timeout is
    #: 2 min, but a pod start should never wait long on a tuning hook.
    timeout: float
    args: Mapping[str, Any]
    key_path: str


@dataclass(frozen=True, slots=True)
class BackendSettings:
    #: containerd's CRI socket.
    runtime_endpoint: str = "/run/containerd/containerd.sock"
    #: ImageService endpoint; empty means the runtime endpoint.
    image_endpoint: str = ""
    #: Cap on the reconnect back-off, so the proxy notices a restarted containerd quickly.
    max_reconnect_backoff: float = 2.0


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the core needs, frozen. See docs/configuration.md for the YAML."""

    #: Unix socket kubelet talks to (``--container-runtime-endpoint``).
    listen: str = "/var/run/koord-runtimeproxy/runtimeproxy.sock"
    #: Socket file mode: kubelet runs as root; group access for debugging tools.
    socket_mode: int = 0o660
    backend: BackendSettings = BackendSettings()
    hooks: tuple[HookSettings, ...] = ()
    #: Koordinator hook-server registrations (``*.json``); empty disables.
    hookserver_dir: str = "/etc/runtime/hookserver.d"
    #: Pods with this label value skip every hook (Koordinator's key).
    skip_label_key: str = "runtimeproxy.koordinator.sh/skip-hookserver"
    skip_label_value: str = "true"
    #: host:port for /metrics and the debug endpoints; loopback only by default.
    metrics_listen: str = "127.0.0.1:9316"
    log_level: str = "info"
    log_format: str = "auto"
    #: How long SIGTERM waits for in-flight CRI calls.
    shutdown_grace: float = 10.0
    #: kubelet allows 16 MiB; grpc's default 4 MiB breaks big ListContainers.
    max_message_bytes: int = 16 * MiB
    #: How often the config file and hookserver dir are polled for changes.
    reload_poll_interval: float = 2.0
    #: Period of the reconciler's pass (hooks' Reconcile* stages); koordlet uses 10 s too.
    reconcile_interval: float = 10.0
    #: Period of the store's re-sync with containerd (pods removed or created behind the proxy's back).
    resync_interval: float = 60.0
    #: Where state kept across restarts lives (explain's change history); empty keeps it in memory only.
    state_dir: str = "/var/lib/koord-runtime-proxy"
    host: HostRoots = HostRoots()
    rules: Mapping[str, Any] = field(default_factory=lambda: types.MappingProxyType({}))
    tasks: Mapping[str, Any] = field(default_factory=lambda: types.MappingProxyType({}))


_TOP_KEYS: Final = frozenset(
    {
        "listen", "socket_mode", "backend", "hooks", "hookserver_dir", "skip_label",
        "metrics", "log", "shutdown_grace", "max_message_bytes", "reload_poll_interval", "reconcile_interval",
        "host", "rules", "tasks", "resync_interval", "state_dir",
    }
)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_HOOK_KEYS: Final = frozenset({"name", "plugin", "remote", "stages", "failure_policy", "timeout", "args"})


def parse_duration(value: object, key_path: str) -> float:
    """Seconds from ``1.5``, ``"500ms"``, ``"2s"``, ``"1m"``; must be > 0."""
    if isinstance(value, bool):
        raise ConfigError(key_path, value, "must be a duration such as 1s or 500ms")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    else:
        raise ConfigError(key_path, value, "must be a duration such as 1s or 500ms")
    if not seconds > 0:
        raise ConfigError(key_path, value, "must be a duration > 0")
    return seconds


def _mapping(value: object, key_path: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(key_path, value, "must be a mapping with string keys")
    return value


def _string(value: object, key_path: str, *, allow_empty: bool = True) -> str:
    if not isinstance(value, str) or (not allow_empty and not value):
        raise ConfigError(key_path, value, "must be a non-empty string" if not allow_empty else "must be a string")
    return value


def _reject_unknown(data: Mapping[str, Any], allowed: frozenset[str], prefix: str) -> None:
    for key in data:
        if key not in allowed:
            raise ConfigError(f"{prefix}{key}", data[key], f"unknown key; expected one of {sorted(allowed)}")


def _endpoint(value: object, key_path: str) -> str:
    text = _string(value, key_path)
    text = text.removeprefix("unix://")
    if text and not text.startswith("/"):
        raise ConfigError(key_path, value, "must be an absolute unix socket path")
    return text


def _socket_mode(value: object) -> int:
    if isinstance(value, str) and re.fullmatch(r"0?[0-7]{3}", value):
        return int(value, 8)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 0o777:
        return value
    raise ConfigError("socket_mode", value, "must be an octal mode string such as '0660'")


def _host_port(value: object, key_path: str) -> str:
    text = _string(value, key_path)
    if text and (not re.fullmatch(r"[\w.\-\[\]:]+:\d{1,5}", text) or int(text.rpartition(":")[2]) > 65535):
        raise ConfigError(key_path, value, "must be host:port, or empty to disable")
    return text


def _failure_policy(value: object, key_path: str) -> FailurePolicy:
    for policy in FailurePolicy:
        if isinstance(value, str) and value.lower() == policy.value.lower():
            return policy
    raise ConfigError(key_path, value, "must be Fail or Ignore")


def _stages(value: object, key_path: str) -> frozenset[Stage] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise ConfigError(key_path, value, "must be a non-empty list of stage names")
    known = {stage.value: stage for stage in Stage}
    out = set()
    for i, item in enumerate(value):
        if not isinstance(item, str) or item not in known:
            raise ConfigError(f"{key_path}[{i}]", item, f"unknown stage; expected one of {sorted(known)}")
        out.add(known[item])
    return frozenset(out)


def _hook(raw: object, index: int, default_timeout: float) -> HookSettings:
    path = f"hooks[{index}]"
    data = _mapping(raw, path)
    _reject_unknown(data, _HOOK_KEYS, f"{path}.")
    name = _string(data.get("name"), f"{path}.name", allow_empty=False)
    plugin = _string(data.get("plugin", ""), f"{path}.plugin")
    remote = _endpoint(data.get("remote", ""), f"{path}.remote")
    if bool(plugin) == bool(remote):
        raise ConfigError(path, dict(data), "needs exactly one of 'plugin' or 'remote'")
    timeout = default_timeout
    if "timeout" in data:
        timeout = parse_duration(data["timeout"], f"{path}.timeout")
    return HookSettings(
        name=name,
        plugin=plugin,
        remote=remote,
        stages=_stages(data.get("stages"), f"{path}.stages"),
        failure_policy=_failure_policy(data.get("failure_policy", "Ignore"), f"{path}.failure_policy"),
        timeout=timeout,
        args=types.MappingProxyType(dict(_mapping(data.get("args"), f"{path}.args"))),
        key_path=path,
    )


def _hooks(value: object) -> tuple[HookSettings, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ConfigError("hooks", value, "must be a list")
    hooks = tuple(_hook(raw, i, 1.0) for i, raw in enumerate(value))
    seen: set[str] = set()
    for i, hook in enumerate(hooks):
        if hook.name in seen:
            raise ConfigError(f"hooks[{i}].name", hook.name, "duplicate hook name")
        seen.add(hook.name)
    return hooks


def _backend(value: object) -> BackendSettings:
    data = _mapping(value, "backend")
    _reject_unknown(data, frozenset({"runtime_endpoint", "image_endpoint", "max_reconnect_backoff"}), "backend.")
    default = BackendSettings()
    return BackendSettings(
        runtime_endpoint=_endpoint(data.get("runtime_endpoint", default.runtime_endpoint), "backend.runtime_endpoint")
        or default.runtime_endpoint,
        image_endpoint=_endpoint(data.get("image_endpoint", ""), "backend.image_endpoint"),
        max_reconnect_backoff=parse_duration(
            data.get("max_reconnect_backoff", default.max_reconnect_backoff), "backend.max_reconnect_backoff"
        ),
    )


def _host(value: object) -> HostRoots:
    data = _mapping(value, "host")
    _reject_unknown(data, frozenset({"cgroup_root", "proc", "sys", "resctrl_root"}), "host.")
    default = HostRoots()
    roots = {}
    for key, attr in (("cgroup_root", "cgroup"), ("proc", "proc"), ("sys", "sys"), ("resctrl_root", "resctrl")):
        raw = data.get(key, str(getattr(default, attr)))
        text = _string(raw, f"host.{key}", allow_empty=False)
        if not text.startswith("/") or ".." in Path(text).parts:
            raise ConfigError(f"host.{key}", raw, "must be an absolute path without '..'")
        roots[attr] = Path(text)
    return HostRoots(**roots)


def _log(value: object) -> tuple[str, str]:
    data = _mapping(value, "log")
    _reject_unknown(data, frozenset({"level", "format"}), "log.")
    level = str(data.get("level", "info")).lower()
    if level not in {"debug", "info", "warning", "error"}:
        raise ConfigError("log.level", data.get("level"), "must be debug, info, warning or error")
    fmt = str(data.get("format", "auto")).lower()
    if fmt not in {"auto", "json", "console"}:
        raise ConfigError("log.format", data.get("format"), "must be auto, json or console")
    return level, fmt


def _positive_int(value: object, key_path: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key_path, value, f"must be an integer >= {minimum}")
    return value


def _resync_interval(value: object) -> float:
    seconds = parse_duration(value, "resync_interval")
    if seconds < 1.0:  # each resync lists every sandbox and container at containerd
        raise ConfigError("resync_interval", value, "must be at least 1s")
    return seconds


def _state_dir(value: object) -> str:
    path = _string(value, "state_dir")
    if path and (not path.startswith("/") or "\0" in path):
        raise ConfigError("state_dir", value, "must be an absolute path, or empty to keep state in memory only")
    return path


def from_mapping(data: object) -> Settings:
    """Validate a parsed YAML document (already merged with CLI overrides)."""
    top = _mapping(data, "<root>")
    _reject_unknown(top, _TOP_KEYS, "")
    default = Settings()
    skip = _mapping(top.get("skip_label"), "skip_label")
    _reject_unknown(skip, frozenset({"key", "value"}), "skip_label.")
    metrics = _mapping(top.get("metrics"), "metrics")
    _reject_unknown(metrics, frozenset({"listen"}), "metrics.")
    level, fmt = _log(top.get("log"))
    listen = _endpoint(top.get("listen", default.listen), "listen")
    if not listen:
        raise ConfigError("listen", top.get("listen"), "must be a unix socket path")
    return Settings(
        listen=listen,
        socket_mode=_socket_mode(top.get("socket_mode", "0660")),
        backend=_backend(top.get("backend")),
        hooks=_hooks(top.get("hooks")),
        hookserver_dir=_string(top.get("hookserver_dir", default.hookserver_dir), "hookserver_dir"),
        skip_label_key=_string(skip.get("key", default.skip_label_key), "skip_label.key", allow_empty=False),
        skip_label_value=_string(skip.get("value", default.skip_label_value), "skip_label.value"),
        metrics_listen=_host_port(metrics.get("listen", default.metrics_listen), "metrics.listen"),
        log_level=level,
        log_format=fmt,
        shutdown_grace=parse_duration(top.get("shutdown_grace", default.shutdown_grace), "shutdown_grace"),
        max_message_bytes=_positive_int(
            top.get("max_message_bytes", default.max_message_bytes), "max_message_bytes", 4 * MiB
        ),
        reload_poll_interval=parse_duration(
            top.get("reload_poll_interval", default.reload_poll_interval), "reload_poll_interval"
        ),
        reconcile_interval=parse_duration(
            top.get("reconcile_interval", default.reconcile_interval), "reconcile_interval"
        ),
        resync_interval=_resync_interval(top.get("resync_interval", default.resync_interval)),
        state_dir=_state_dir(top.get("state_dir", default.state_dir)),
        host=_host(top.get("host")),
        rules=types.MappingProxyType(dict(_mapping(top.get("rules"), "rules"))),
        tasks=types.MappingProxyType(dict(_mapping(top.get("tasks"), "tasks"))),
    )


def read_yaml(path: Path) -> dict[str, Any]:
    """Parse the file; YAML syntax errors become ConfigError naming the file and line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("--config", str(path), f"cannot read: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError("--config", str(path), f"invalid YAML{where}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("<root>", data, "must be a mapping")
    return data


def merge_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Apply CLI overrides given as dotted keys (``backend.runtime_endpoint``)."""
    merged: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
    for dotted, value in overrides.items():
        head, _, tail = dotted.partition(".")
        if tail:
            section = merged.get(head)
            section = dict(section) if isinstance(section, Mapping) else {}
            section[tail] = value
            merged[head] = section
        else:
            merged[head] = value
    return merged


def load(path: Path | None, overrides: Mapping[str, Any] | None = None) -> Settings:
    """Load settings. With ``path=None`` the default file is used if present, else
    built-in defaults; an explicitly named file must exist."""
    if path is None:
        data = read_yaml(DEFAULT_CONFIG_PATH) if DEFAULT_CONFIG_PATH.exists() else {}
    else:
        data = read_yaml(path)
    return from_mapping(merge_overrides(data, overrides or {}))
