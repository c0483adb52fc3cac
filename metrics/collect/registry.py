"""The collector registry: entry points in ``koord_runtime_proxy.collectors``.

A collector is one module plus one line of setup.cfg::

    koord_runtime_proxy.collectors =
        gpu = mypkg.gpu:gpu

where ``mypkg.gpu:gpu`` is a ``CollectorPlugin`` (or a plain factory: a callable taking
a ``CollectorInit`` and returning a ``Collector``, or None to stay off). The plugin's data
says when it runs: ``interval`` (default, overridden by ``tasks.metrics.collectors.<name>.interval``)
and ``phase`` (collectors sharing an interval run in one worker job in ascending
phase, then name: the node reading before host applications before pods, so the
derived series of the pod tick see the same tick's figures). ``required`` names what
of the agent needs it; such a collector cannot be disabled.

``tasks.metrics.collectors`` is a mapping ``name -> {enabled, interval, args}``; a name
that is not installed, or a bad value, is a ``HookConfigError`` naming the field (run,
check-config and reload all parse through ``metrics.settings``).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

from metrics.collect.base import Collector
from runtimeproxy.config.configvalues import boolean, parse_duration, reject_unknown
from runtimeproxy.hookapi import HookConfigError, HostRoots

if TYPE_CHECKING:  # settings imports this module for CollectorSpec
    from metrics.model import MetricReader
    from metrics.settings import MetricsSettings

GROUP: Final = "koord_runtime_proxy.collectors"
DEFAULT_PHASE: Final = 100
DEFAULT_INTERVAL: Final = 10.0


class EntryPointLike(Protocol):
    @property
    def name(self) -> str: ...
    def load(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class CollectorSpec:
    """One entry of ``tasks.metrics.collectors``. ``enabled``/``interval`` None: the
    plugin's default (for the built-ins, ``intervals.<name>`` and the older switches)."""

    name: str
    enabled: bool | None = None
    interval: float | None = None
    args: Mapping[str, Any] = field(default_factory=dict)
    key_path: str = ""


@dataclass(frozen=True, slots=True)
class CollectorInit:
    """What a collector factory is given."""

    name: str
    #: ``collectors.<name>.args`` (the factory validates it, raising ``HookConfigError``
    #: naming ``key_path``).
    args: Mapping[str, Any]
    key_path: str
    #: The resolved interval (seconds).
    interval: float
    host: HostRoots
    settings: MetricsSettings
    #: The store's read side (None while validating).
    reader: MetricReader | None = None
    #: One mapping per agent: collectors that build on each other share objects here.
    shared: MutableMapping[str, Any] = field(default_factory=dict)


Factory = Callable[[CollectorInit], Collector | None]


@dataclass(frozen=True, slots=True)
class CollectorPlugin:
    """An entry point's object: the factory and its scheduling data."""

    build: Factory
    phase: int = DEFAULT_PHASE
    interval: float = DEFAULT_INTERVAL
    #: Non-empty: what needs this collector (disabling it is refused with this reason).
    required: str = ""
    #: The ``intervals.<key>`` (pre-registry shape) that sets this collector's interval.
    legacy_interval: str = ""
    #: Validates ``args`` without building (``(args, key_path)``, raising ``HookConfigError``),
    #: so check-config and reload refuse what the factory would.
    check: Callable[[Mapping[str, Any], str], None] | None = None


@dataclass(frozen=True, slots=True)
class Built:
    """A built collector and its place in the tick."""

    collector: Collector
    phase: int


def installed() -> dict[str, EntryPointLike]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUP)}


def as_plugin(obj: object, name: str) -> CollectorPlugin:
    if isinstance(obj, CollectorPlugin):
        return obj
    if callable(obj):
        return CollectorPlugin(obj, phase=int(getattr(obj, "phase", DEFAULT_PHASE)),
                               interval=float(getattr(obj, "interval", DEFAULT_INTERVAL)))
    raise HookConfigError(f"{GROUP}.{name}", repr(obj)[:80], "entry point is not a collector factory")


_SPEC_KEYS: Final = frozenset({"enabled", "interval", "args"})


def parse_collectors(raw: object, key_path: str, names: Iterable[str] | None = None) -> tuple[CollectorSpec, ...]:
    """``collectors:`` -> specs; every name must be installed (``names``: the installed ones)."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise HookConfigError(key_path, raw, "must be a mapping of collector name -> {enabled, interval, args}")
    known = sorted(installed() if names is None else names)
    out: list[CollectorSpec] = []
    for name, item in raw.items():
        where = f"{key_path}.{name}"
        if name not in known:
            raise HookConfigError(where, item, f"unknown collector; installed: {', '.join(known)}")
        if item is None:
            item = {}
        if not isinstance(item, Mapping):
            raise HookConfigError(where, item, "must be a mapping {enabled, interval, args}")
        reject_unknown(item, _SPEC_KEYS, f"{where}.")
        enabled = item.get("enabled")
        if enabled is not None:
            boolean(enabled, f"{where}.enabled")
        interval = item.get("interval")
        if interval is not None:
            interval = parse_duration(interval, f"{where}.interval")
        args = item.get("args") or {}
        if not isinstance(args, Mapping):
            raise HookConfigError(f"{where}.args", args, "must be a mapping")
        out.append(CollectorSpec(name, enabled, interval, dict(args), where))
    return tuple(out)


def load_collectors(settings: MetricsSettings, host: HostRoots, reader: MetricReader | None,
                    key_path: str = "tasks.metrics.collectors",
                    shared: MutableMapping[str, Any] | None = None) -> dict[str, Built]:
    """Build every installed collector that is enabled, keyed by name, in tick order
    (phase, then name). A factory's ``HookConfigError`` propagates (a config error)."""
    specs = {s.name: s for s in settings.collectors}
    shared = {} if shared is None else shared
    plugins: list[tuple[int, str, CollectorPlugin]] = []
    for name, ep in installed().items():
        plugin = as_plugin(ep.load(), name)
        plugins.append((plugin.phase, name, plugin))
    out: dict[str, Built] = {}
    for phase, name, plugin in sorted(plugins, key=lambda p: (p[0], p[1])):
        spec = specs.get(name, CollectorSpec(name, key_path=f"{key_path}.{name}"))
        if spec.enabled is False:
            if plugin.required:
                raise HookConfigError(f"{spec.key_path}.enabled", False, f"cannot be disabled: {plugin.required}")
            continue
        interval = resolved_interval(plugin, spec, settings)
        init = CollectorInit(name=name, args=spec.args, key_path=f"{spec.key_path}.args", interval=interval,
                             host=host, settings=settings, reader=reader, shared=shared)
        collector = plugin.build(init)
        if collector is None:  # off by its own switch (e.g. schedlat_source: off)
            continue
        try:  # the agent keys ticks and costs by the entry point's name, schedules by the interval
            collector.name = name
            collector.interval = interval
        except AttributeError as exc:
            raise HookConfigError(spec.key_path, name, f"the collector's name/interval cannot be set: {exc}") from exc
        out[name] = Built(collector, phase)
    return out


def resolved_interval(plugin: CollectorPlugin, spec: CollectorSpec, settings: MetricsSettings) -> float:
    if spec.interval is not None:
        return spec.interval
    if plugin.legacy_interval:
        return float(getattr(settings.intervals, plugin.legacy_interval))
    return plugin.interval


def check_collectors(specs: Iterable[CollectorSpec]) -> None:
    """What can be checked without building: ``enabled: false`` on a collector the agent
    needs, and ``args`` through the plugin's ``check``."""
    found = installed()
    for spec in specs:
        if spec.name not in found:
            continue
        plugin = as_plugin(found[spec.name].load(), spec.name)
        if spec.enabled is False and plugin.required:
            raise HookConfigError(f"{spec.key_path}.enabled", False, f"cannot be disabled: {plugin.required}")
        if plugin.check is not None:
            plugin.check(spec.args, f"{spec.key_path}.args")
