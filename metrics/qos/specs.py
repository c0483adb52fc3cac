"""``tasks.qos-manager.strategies``: the entries and the entry-point registry they name
(light on imports: ``metrics.settings`` validates with it; see ``metrics.qos.strategy``)."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from runtimeproxy.config.configvalues import reject_unknown
from runtimeproxy.hookapi import HookConfigError

GROUP: Final = "koord_runtime_proxy.qos_strategies"
#: The planning order when the config lists none: koordlet's eviction task order
#: (BE*Evict, then *AllocatableEvict, then the usage evictors), then the CPU
#: knobs, then cache and host tuning. Installed strategies not named here follow, by name.
DEFAULT_ORDER: Final = ("be-evict", "allocatable-evict", "cpu-evict", "cpu-suppress", "interference", "cpu-burst",
                        "resctrl", "memory-qos", "blkio", "system-config")


class EntryPointLike(Protocol):
    @property
    def name(self) -> str: ...
    def load(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class StrategySpec:
    """One entry of ``tasks.qos-manager.strategies``."""

    name: str
    enabled: bool = True
    args: Mapping[str, Any] = field(default_factory=dict)
    key_path: str = ""


def installed(entry_points: Iterable[EntryPointLike] | None = None) -> dict[str, EntryPointLike]:
    found = entry_points if entry_points is not None else importlib.metadata.entry_points(group=GROUP)
    return {ep.name: ep for ep in found}


def default_specs(names: Iterable[str], key_path: str = "strategies") -> tuple[StrategySpec, ...]:
    """Every installed strategy: ``DEFAULT_ORDER`` first, the others by name."""
    present = set(names)
    ordered = [n for n in DEFAULT_ORDER if n in present] + sorted(present - set(DEFAULT_ORDER))
    return tuple(StrategySpec(n, key_path=f"{key_path}.{n}") for n in ordered)


def parse_specs(raw: object, key_path: str) -> tuple[StrategySpec, ...] | None:
    """``strategies:`` (None: absent). Names are checked against what is installed by
    ``load_strategies``; here only the shape, so check-config names the entry."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise HookConfigError(key_path, raw, "expected a list of strategy names or {name, enabled, args}")
    out: list[StrategySpec] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        where = f"{key_path}[{i}]"
        if isinstance(item, str):
            spec = StrategySpec(item, key_path=where)
        elif isinstance(item, Mapping):
            reject_unknown(item, {"name", "enabled", "args"}, f"{where}.")
            name, enabled, args = item.get("name"), item.get("enabled", True), item.get("args", {})
            if not isinstance(name, str) or not name:
                raise HookConfigError(f"{where}.name", name, "expected a strategy name")
            if not isinstance(enabled, bool):
                raise HookConfigError(f"{where}.enabled", enabled, "expected true or false")
            if not isinstance(args, Mapping):
                raise HookConfigError(f"{where}.args", args, "expected a mapping")
            spec = StrategySpec(name, enabled, dict(args), where)
        else:
            raise HookConfigError(where, item, "expected a strategy name or {name, enabled, args}")
        if spec.name in seen:
            raise HookConfigError(where, spec.name, "listed twice")
        seen.add(spec.name)
        out.append(spec)
    return tuple(out)


def check_specs(specs: Sequence[StrategySpec] | None, entry_points: Iterable[EntryPointLike] | None = None) -> None:
    """Every listed name is installed (for check-config and reload)."""
    names = installed(entry_points)
    for spec in specs or ():
        if spec.name not in names:
            raise HookConfigError(spec.key_path, spec.name, f"unknown QoS strategy; installed: {sorted(names)}")
