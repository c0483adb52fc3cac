"""Settings: the YAML file and the command line, validated once into frozen values.

Nothing downstream indexes raw YAML. Every error names the key path and the bad
value (``hooks[1].timeout: must be a duration > 0 (got '0s')``) so an operator can
fix the file without reading code. Sections owned by plugins (``rules``, ``tasks``
and each hook's ``args``) are kept as plain data and validated by their owners.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.resources
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import yaml

from runtimeproxy.config import confignet as net

# ConfigError and parse_duration are re-exported: plugins and tasks import them from here.
from runtimeproxy.config.configvalues import ConfigError as ConfigError
from runtimeproxy.config.configvalues import mapping, positive_int, reject_unknown, string
from runtimeproxy.config.configvalues import parse_duration as parse_duration
from runtimeproxy.config.filetrust import path_problem
from runtimeproxy.config.ingress import NriSettings, nri_settings
from runtimeproxy.config.ingress import ingress as ingress_value
from runtimeproxy.hookapi import HostRoots, Stage

DEFAULT_CONFIG_PATH: Final = Path("/etc/koord-runtime-proxy/config.yaml")
#: The built-in default, package data of ``runtimeproxy`` (``systemd/config.yaml`` is a
#: copy, pinned equal by a test): used when no file is named and DEFAULT_CONFIG_PATH is
#: absent. Data, not code: the core still names no hook.
DEFAULT_CONFIG_RESOURCE: Final = "default-config.yaml"
MiB: Final = 1024 * 1024


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
    #: How often the backend is probed (one Version call; ImageFsInfo for a separate image endpoint).
    #: kubelet checks its runtime's status every 5 s too. A probe is a gRPC call: ~38 wake-ups
    #: of the process's threads and ~2.6 ms of CPU on a small VM; at 2 s it was 1 ms/s (issue 29).
    probe_interval: float = 5.0
    #: Failing probes for this long make /healthz 503 and the backend-up gauge 0.
    unhealthy_after: float = 6.0


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
    #: HTTP connections open at once; more wait unaccepted in the kernel's backlog.
    metrics_max_connections: int = 64
    #: An HTTP client sending or reading nothing for this long is disconnected.
    metrics_idle_timeout: float = 5.0
    #: The HTTP endpoint accepts nothing while fewer descriptors than this are free.
    metrics_fd_reserve: int = 256
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
    #: Where these settings came from (a path or the built-in default), for the start log.
    source: str = field(default="", compare=False)
    #: Who serves kubelet's socket: ``haproxy`` (the default: pass-through in HAProxy, only the
    #: lifecycle methods reach this process; see runtimeproxy.dataplane.haproxy) or ``grpc`` (this process;
    #: also where the haproxy binary is missing).
    data_plane: str = "haproxy"
    #: haproxy: a call or stream sending nothing either way for this long is cut (dead peers).
    data_plane_idle_timeout: float = 86400.0
    #: haproxy: HAProxy's systemd service (the shipped systemd config sets it): systemd runs it,
    #: this process renders its configuration and reloads it. Empty: HAProxy is this process's
    #: child and dies with it (demo, tests, ``run`` in a terminal). See docs/architecture.md, "Data plane".
    data_plane_unit: str = ""
    #: Risks the operator accepted (``allow_insecure:``), see confignet.INSECURE_OPT_INS.
    allow_insecure: frozenset[str] = frozenset()
    #: The accepted risks actually present: one warning line each at every start.
    accepted_risks: tuple[str, ...] = field(default=(), compare=False)
    #: How lifecycle events reach the chain: ``cri-proxy``, ``nri`` or ``both`` (runtimeproxy.config.ingress).
    ingress: str = "cri-proxy"
    nri: NriSettings = NriSettings()
    #: Deprecated keys present (``key: why``, ignored): one warning line each at every start.
    deprecated: tuple[str, ...] = field(default=(), compare=False)


_TOP_KEYS: Final = frozenset(
    {
        "listen", "socket_mode", "backend", "hooks", "hookserver_dir", "skip_label",
        "metrics", "log", "shutdown_grace", "max_message_bytes", "reload_poll_interval", "reconcile_interval",
        "host", "rules", "tasks", "allow_insecure", "resync_interval", "state_dir",
        "data_plane", "data_plane_idle_timeout", "data_plane_unit", *net.DEPRECATED_KEYS,
        "ingress", "nri",
    }
)
_HOOK_KEYS: Final = frozenset({"name", "plugin", "remote", "stages", "failure_policy", "timeout", "args"})


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
    data = mapping(raw, path)
    reject_unknown(data, _HOOK_KEYS, f"{path}.")
    name = string(data.get("name"), f"{path}.name", allow_empty=False)
    plugin = string(data.get("plugin", ""), f"{path}.plugin")
    remote = net.endpoint(data.get("remote", ""), f"{path}.remote")
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
        args=types.MappingProxyType(dict(mapping(data.get("args"), f"{path}.args"))),
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
    data = mapping(value, "backend")
    reject_unknown(
        data,
        frozenset({"runtime_endpoint", "image_endpoint", "max_reconnect_backoff", "probe_interval", "unhealthy_after"}),
        "backend.",
    )
    default = BackendSettings()
    return BackendSettings(
        runtime_endpoint=net.endpoint(
            data.get("runtime_endpoint", default.runtime_endpoint), "backend.runtime_endpoint"
        )
        or default.runtime_endpoint,
        image_endpoint=net.endpoint(data.get("image_endpoint", ""), "backend.image_endpoint"),
        max_reconnect_backoff=parse_duration(
            data.get("max_reconnect_backoff", default.max_reconnect_backoff), "backend.max_reconnect_backoff"
        ),
        probe_interval=parse_duration(data.get("probe_interval", default.probe_interval), "backend.probe_interval"),
        unhealthy_after=parse_duration(
            data.get("unhealthy_after", default.unhealthy_after), "backend.unhealthy_after"
        ),
    )


def _host(value: object) -> HostRoots:
    data = mapping(value, "host")
    reject_unknown(data, frozenset({"cgroup_root", "proc", "sys", "resctrl_root"}), "host.")
    default = HostRoots()
    roots = {}
    for key, attr in (("cgroup_root", "cgroup"), ("proc", "proc"), ("sys", "sys"), ("resctrl_root", "resctrl")):
        raw = data.get(key, str(getattr(default, attr)))
        text = string(raw, f"host.{key}", allow_empty=False)
        if not text.startswith("/") or ".." in Path(text).parts:
            raise ConfigError(f"host.{key}", raw, "must be an absolute path without '..'")
        roots[attr] = Path(text)
    return HostRoots(**roots)


def _log(value: object) -> tuple[str, str]:
    data = mapping(value, "log")
    reject_unknown(data, frozenset({"level", "format"}), "log.")
    level = str(data.get("level", "info")).lower()
    if level not in {"debug", "info", "warning", "error"}:
        raise ConfigError("log.level", data.get("level"), "must be debug, info, warning or error")
    fmt = str(data.get("format", "auto")).lower()
    if fmt not in {"auto", "json", "console"}:
        raise ConfigError("log.format", data.get("format"), "must be auto, json or console")
    return level, fmt


def _resync_interval(value: object) -> float:
    seconds = parse_duration(value, "resync_interval")
    if seconds < 1.0:  # each resync lists every sandbox and container at containerd
        raise ConfigError("resync_interval", value, "must be at least 1s")
    return seconds


def _state_dir(value: object) -> str:
    path = string(value, "state_dir")
    if path and (not path.startswith("/") or "\0" in path):
        raise ConfigError("state_dir", value, "must be an absolute path, or empty to keep state in memory only")
    return path


def from_mapping(data: object) -> Settings:
    """Validate a parsed YAML document (already merged with CLI overrides)."""
    top = mapping(data, "<root>")
    reject_unknown(top, _TOP_KEYS, "")
    default = Settings()
    skip = mapping(top.get("skip_label"), "skip_label")
    reject_unknown(skip, frozenset({"key", "value"}), "skip_label.")
    metrics = mapping(top.get("metrics"), "metrics")
    reject_unknown(metrics, frozenset({"listen", "max_connections", "idle_timeout", "fd_reserve"}), "metrics.")
    level, fmt = _log(top.get("log"))
    listen = net.endpoint(top.get("listen", default.listen), "listen")
    if not listen:
        raise ConfigError("listen", top.get("listen"), "must be a unix socket path")
    allow_insecure = net.allow_insecure(top.get("allow_insecure"))
    socket_mode = net.socket_mode(top.get("socket_mode", "0660"))
    metrics_listen = net.host_port(metrics.get("listen", default.metrics_listen), "metrics.listen")
    accepted_risks = net.risks(socket_mode, metrics_listen, allow_insecure)
    return Settings(
        listen=listen,
        socket_mode=socket_mode,
        backend=_backend(top.get("backend")),
        hooks=_hooks(top.get("hooks")),
        hookserver_dir=string(top.get("hookserver_dir", default.hookserver_dir), "hookserver_dir"),
        skip_label_key=string(skip.get("key", default.skip_label_key), "skip_label.key", allow_empty=False),
        skip_label_value=string(skip.get("value", default.skip_label_value), "skip_label.value"),
        metrics_listen=metrics_listen,
        metrics_max_connections=positive_int(
            metrics.get("max_connections", default.metrics_max_connections), "metrics.max_connections", 1
        ),
        metrics_idle_timeout=parse_duration(
            metrics.get("idle_timeout", default.metrics_idle_timeout), "metrics.idle_timeout"
        ),
        metrics_fd_reserve=positive_int(
            metrics.get("fd_reserve", default.metrics_fd_reserve), "metrics.fd_reserve", 0
        ),
        log_level=level,
        log_format=fmt,
        shutdown_grace=parse_duration(top.get("shutdown_grace", default.shutdown_grace), "shutdown_grace"),
        max_message_bytes=positive_int(
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
        rules=types.MappingProxyType(dict(mapping(top.get("rules"), "rules"))),
        tasks=types.MappingProxyType(dict(mapping(top.get("tasks"), "tasks"))),
        data_plane=net.data_plane(top.get("data_plane", default.data_plane)),
        data_plane_idle_timeout=net.idle_timeout(top.get("data_plane_idle_timeout", default.data_plane_idle_timeout)),
        data_plane_unit=net.data_plane_unit(top.get("data_plane_unit", default.data_plane_unit)),
        deprecated=net.deprecated(top),
        allow_insecure=allow_insecure,
        accepted_risks=accepted_risks,
        ingress=ingress_value(top.get("ingress", default.ingress)),
        nri=nri_settings(top.get("nri")),
    )


def _cyclic(data: object) -> bool:
    """An alias to an enclosing node (``a: &x [*x]``) makes a loop no validator expects."""
    stack: list[tuple[object, frozenset[int]]] = [(data, frozenset())]
    while stack:
        node, above = stack.pop()
        if isinstance(node, dict | list):
            if id(node) in above:
                return True
            inner = above | {id(node)}
            stack.extend((child, inner) for child in (node.values() if isinstance(node, dict) else node))
    return False


def _parse_yaml(text: str, where: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError("--config", where, f"invalid YAML{line}") from exc
    except ValueError as exc:  # a timestamp-looking value that is no date: 2001-13-45
        raise ConfigError("--config", where, f"invalid YAML: {exc}") from exc
    except RecursionError as exc:
        raise ConfigError("--config", where, "invalid YAML: nested too deeply") from exc
    if _cyclic(data):
        raise ConfigError("--config", where, "invalid YAML: an alias refers to a node that contains it")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("<root>", data, "must be a mapping")
    return data


def read_yaml(path: Path) -> dict[str, Any]:
    """Parse the file; YAML syntax errors become ConfigError naming the file and line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError("--config", str(path), f"cannot read: {exc.strerror}") from exc
    return _parse_yaml(text, str(path))


def builtin_default_text() -> str:
    """The shipped default configuration, as shipped (comments included)."""
    return importlib.resources.files("runtimeproxy").joinpath(DEFAULT_CONFIG_RESOURCE).read_text(encoding="utf-8")


def builtin_default() -> dict[str, Any]:
    """The built-in default document: what ``run`` uses without a config file."""
    return _parse_yaml(builtin_default_text(), f"<built-in {DEFAULT_CONFIG_RESOURCE}>")


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
    """Load settings. With ``path=None`` the default file is used if present, else the
    built-in default (the shipped configuration, package data); an explicitly named file
    must exist. A file is the whole configuration: keys it omits take Settings' defaults
    (no hooks, rules or tasks), not the built-in document's."""
    if path is None and not DEFAULT_CONFIG_PATH.exists():
        data, source = builtin_default(), f"built-in default ({DEFAULT_CONFIG_PATH} absent)"
    else:
        path = DEFAULT_CONFIG_PATH if path is None else path
        data, source = read_yaml(path), str(path)
    settings = from_mapping(merge_overrides(data, overrides or {}))
    settings = dataclasses.replace(settings, source=source)
    if path is not None and (problem := path_problem(path)) is not None:
        # Read and parsed first: the opt-in is in the file itself.
        if "file_permissions" not in settings.allow_insecure:
            raise ConfigError("--config", str(path), f"refused: {problem}; fix the ownership/mode, or set "
                              "allow_insecure.file_permissions: true to accept the risk")
        settings = dataclasses.replace(settings, accepted_risks=(*settings.accepted_risks, f"--config: {problem}"))
    return settings
