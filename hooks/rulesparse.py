"""The parser combinators behind ``hooks.rules``: a NodeSLO section is a mapping of
camelCase keys to dataclass fields, each with its own value parser; a parse merges
the given keys over the current (default) value. Every error is a ``HookConfigError``
naming ``rules.<path>`` and the value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from runtimeproxy.config import configvalues
from runtimeproxy.config.configvalues import reject_unknown
from runtimeproxy.hookapi import HookConfigError

T = TypeVar("T")

Parser = Callable[[object, str, Any], Any]  # (raw value, rules.<path>, current default) -> new value


def boolean(raw: object, path: str, _current: Any) -> bool:
    return configvalues.boolean(raw, path)


def int_range(low: int, high: int) -> Parser:
    def parse(raw: object, path: str, _current: Any) -> int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise HookConfigError(path, raw, f"expected an integer in [{low}, {high}]")
        if not low <= raw <= high:
            raise HookConfigError(path, raw, f"must be in [{low}, {high}]")
        return raw

    return parse


def choice(*allowed: str) -> Parser:
    one_of = configvalues.choice(*allowed)

    def parse(raw: object, path: str, _current: Any) -> str:
        return str(one_of(raw, path))

    return parse


@dataclass(frozen=True, slots=True)
class Keyed:
    """A section's parser with the keys it accepts, as data: ``rules_from_nodeslo``
    keeps a NodeSLO's keys we model by reading ``keys`` (no registry filled at import)."""

    parse: Parser
    keys: tuple[str, ...]

    def __call__(self, raw: object, path: str, current: Any) -> Any:
        return self.parse(raw, path, current)


def section(cls: type[T], spec: Mapping[str, tuple[str, Parser]]) -> Keyed:
    """A parser for a mapping whose camelCase keys map to dataclass fields; the
    result is ``current`` with the given fields replaced (merge over defaults)."""

    def parse(raw: object, path: str, current: Any) -> T:
        if raw is None:
            return current  # type: ignore[no-any-return]
        if not isinstance(raw, Mapping):
            raise HookConfigError(path, raw, "expected a mapping")
        reject_unknown(raw, set(spec), f"{path}.")
        changes: dict[str, Any] = {}
        for key, value in raw.items():
            attr, parser = spec[key]
            changes[attr] = parser(value, f"{path}.{key}", getattr(current, attr))
        return dataclasses.replace(current, **changes)  # type: ignore[no-any-return]

    return Keyed(parse, tuple(spec))
