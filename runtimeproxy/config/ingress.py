"""The ``ingress`` and ``nri`` settings: how lifecycle events reach the hook chain.

``cri-proxy`` (the default): kubelet talks to our socket and we forward to containerd.
``nri``: containerd calls us as an NRI plugin (containerd >= 1.7 with NRI enabled); our
socket is not served. ``both``: while migrating kubelet from one to the other; each
object is hooked by the ingress that saw it first (docs/nri.md says how).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from runtimeproxy.config.confignet import check_unix_path
from runtimeproxy.config.configvalues import ConfigError, choice, mapping, parse_duration, reject_unknown, string

INGRESSES: Final = ("cri-proxy", "nri", "both")
_NRI_KEYS: Final = frozenset({"socket", "plugin_name", "plugin_index", "request_timeout", "chain_deadline"})
_NAME: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


@dataclass(frozen=True, slots=True)
class NriSettings:
    #: containerd's ``plugins."io.containerd.nri.v1.nri".socket_path``.
    socket: str = "/var/run/nri/nri.sock"
    #: Registered as ``<plugin_index>-<plugin_name>``; the index orders us among NRI plugins.
    plugin_name: str = "koord-runtime-proxy"
    plugin_index: str = "50"
    #: containerd's ``plugin_request_timeout`` (NRI 0.6.1 does not tell plugins; 2 s by default).
    request_timeout: float = 2.0
    #: The chain's own deadline per event: under ``request_timeout``, so a slow hook costs
    #: its patch (policy Ignore) or the call (Fail), never the plugin's connection.
    chain_deadline: float = 1.5


def ingress(value: object) -> str:
    return str(choice(*INGRESSES)(value, "ingress"))


def nri_settings(value: object) -> NriSettings:
    data: Mapping[str, Any] = mapping(value, "nri")
    reject_unknown(data, _NRI_KEYS, "nri.")
    default = NriSettings()
    socket = string(data.get("socket", default.socket), "nri.socket", allow_empty=False)
    if not socket.startswith("/"):
        raise ConfigError("nri.socket", socket, "must be an absolute unix socket path")
    check_unix_path(socket, "nri.socket")
    name = string(data.get("plugin_name", default.plugin_name), "nri.plugin_name", allow_empty=False)
    if not _NAME.match(name):
        raise ConfigError("nri.plugin_name", name, "must be 1-63 of [A-Za-z0-9_.-], starting alphanumeric")
    index = data.get("plugin_index", default.plugin_index)
    if isinstance(index, int) and not isinstance(index, bool) and 0 <= index <= 99:
        index = f"{index:02d}"
    if not isinstance(index, str) or not re.fullmatch(r"[0-9]{2}", index):
        raise ConfigError("nri.plugin_index", index, "must be two digits, 00 to 99")
    timeout = parse_duration(data.get("request_timeout", default.request_timeout), "nri.request_timeout")
    deadline = parse_duration(data.get("chain_deadline", default.chain_deadline), "nri.chain_deadline")
    if deadline >= timeout:
        raise ConfigError("nri.chain_deadline", data.get("chain_deadline", deadline),
                          f"must be below nri.request_timeout ({timeout}s): a late answer drops the plugin")
    return NriSettings(socket=socket, plugin_name=name, plugin_index=index, request_timeout=timeout,
                       chain_deadline=deadline)
