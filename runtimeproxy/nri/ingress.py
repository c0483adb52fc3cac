"""The NRI ingress as the process sees it: built from settings, checked at start,
described for ``explain``; and the no-op server ``ingress: nri`` has instead of a socket."""

from __future__ import annotations

import stat
from collections.abc import Callable
from pathlib import Path

from runtimeproxy.chain.hookchain import HookChain
from runtimeproxy.config.ingress import NriSettings
from runtimeproxy.config.settings import ConfigError, Settings
from runtimeproxy.hookapi import PodInfo
from runtimeproxy.lifecycle.posthooks import PostQueue
from runtimeproxy.nri.plugin import PROXY_MARK, PROXY_MARK_VALUE, NriPlugin, PluginInit
from runtimeproxy.state.store import Store


class NoSocket:
    """``ingress: nri``: kubelet talks to containerd, nothing of ours listens for it."""

    async def start(self) -> None:
        return None

    def unlisten(self) -> None:
        return None

    async def stop(self, grace: float) -> None:
        return None


def plugin(settings: Settings, *, store: Store, chain: Callable[[], HookChain], skipped: Callable[[PodInfo], bool],
           posts: PostQueue, settings_now: Callable[[], NriSettings], synchronized: Callable[[], None]
           ) -> NriPlugin | None:
    if settings.ingress == "cri-proxy":
        return None
    return NriPlugin(PluginInit(settings=settings_now, store=store, chain=chain, skipped=skipped, posts=posts,
                                proc=settings.host.proc, synchronized=synchronized))


def proxy_mark(settings: Settings) -> dict[str, str]:
    """``ingress: both``: what the proxy ingress marks its forwarded objects with."""
    return {PROXY_MARK: PROXY_MARK_VALUE} if settings.ingress == "both" else {}


def check_socket(settings: Settings) -> None:
    """NRI configured but no socket: one clear error at start, naming the key."""
    if settings.ingress == "cri-proxy":
        return
    path = Path(settings.nri.socket)
    try:
        is_socket = stat.S_ISSOCK(path.stat().st_mode)
    except OSError:
        is_socket = False
    if not is_socket:
        raise ConfigError("nri.socket", settings.nri.socket,
                          f"no NRI socket there (ingress: {settings.ingress}): containerd is older than 1.7, "
                          "or NRI is off (set disable = false under [plugins.\"io.containerd.nri.v1.nri\"] "
                          "and restart containerd), or its socket_path differs")


def problem(nri: NriPlugin | None) -> str | None:
    """/healthz: an NRI plugin not connected runs no hook for new pods (containerd goes on without it)."""
    if nri is None or nri.connected.is_set():
        return None
    return f"NRI plugin not connected to {nri.socket} (no hooks for new pods until it is)"


def describe(settings: Settings, nri: NriPlugin | None) -> str:
    """Which ingress is active, for ``explain``."""
    if nri is None:
        return "cri-proxy"
    state = "connected" if nri.connected.is_set() else "not connected"
    name = f"{settings.nri.plugin_index}-{settings.nri.plugin_name}"
    return f"{settings.ingress} (NRI plugin {name} on {settings.nri.socket}: {state})"
