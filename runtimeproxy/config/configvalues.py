"""The config-value toolkit: the parsers every settings section shares (durations,
mappings, strings, integers, booleans, choices, paths, unknown keys) and ``Section``, a
mapping read key by key with them. Used by the core's settings, the hooks' ``args``
(``hooks.hookargs``, ``hooks.rulesparse``) and the tasks' settings (each metrics
subpackage's ``settings`` module, composed by ``metrics.settings``). Every error is the
one ``ConfigError`` (``runtimeproxy.errors``), re-exported here and by
``runtimeproxy.config.settings``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, TypeVar

from runtimeproxy.errors import ConfigError as ConfigError

T = TypeVar("T")

DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: object, key_path: str) -> float:
    """Seconds from ``1.5``, ``"500ms"``, ``"2s"``, ``"1m"``; must be > 0 and finite. The one
    duration parser of the core's settings, the hooks' ``args`` and the tasks' settings."""
    if isinstance(value, bool):
        raise ConfigError(key_path, value, "must be a duration such as 1s or 500ms")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := DURATION.match(value)):
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    else:
        raise ConfigError(key_path, value, "must be a duration such as 1s or 500ms")
    if not seconds > 0:
        raise ConfigError(key_path, value, "must be a duration > 0")
    if not math.isfinite(seconds):  # YAML's .inf: a timeout that never fires, a sleep forever
        raise ConfigError(key_path, value, "must be a finite duration")
    return seconds


def mapping(value: object, key_path: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(key_path, value, "must be a mapping with string keys")
    return value


def string(value: object, key_path: str, *, allow_empty: bool = True) -> str:
    if not isinstance(value, str) or (not allow_empty and not value):
        raise ConfigError(key_path, value, "must be a non-empty string" if not allow_empty else "must be a string")
    return value


def reject_unknown(data: Mapping[str, Any], allowed: frozenset[str] | set[str], prefix: str) -> None:
    """The first key of ``data`` not in ``allowed`` is a ConfigError named ``<prefix><key>``
    (``prefix`` ends with its dot: ``"hooks[0].args."``). The one such check of the core's
    sections, the hooks' ``args`` and the tasks' settings."""
    for key in data:
        if key not in allowed:
            # An empty or odd key ('', 'a.b', YAML's 1) is quoted so the path still names it.
            shown = key if isinstance(key, str) and re.fullmatch(r"[\w\-/]+", key) else repr(key)
            raise ConfigError(f"{prefix}{shown}", data[key], f"unknown key (known: {', '.join(sorted(allowed))})")


def positive_int(value: object, key_path: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key_path, value, f"must be an integer >= {minimum}")
    return value


def boolean(value: object, key_path: str) -> bool:
    if not isinstance(value, bool):  # YAML's "yes" is a string here: refused, not truthy
        raise ConfigError(key_path, value, "must be true or false")
    return value


def choice(*allowed: str) -> Callable[[object, str], Any]:
    """A parser of one of ``allowed`` (Any: the caller's field is a Literal of exactly these)."""

    def parse(value: object, key_path: str) -> Any:
        if value not in allowed:
            raise ConfigError(key_path, value, f"must be one of {', '.join(allowed)}")
        return str(value)

    return parse


def absolute_path(value: object, key_path: str) -> Path:
    text = string(value, key_path)
    if not text.startswith("/") or "\0" in text:
        raise ConfigError(key_path, value, "must be an absolute path")
    return Path(text)


class Section:
    """One settings mapping (``tasks.metrics``, ``tasks.metrics.tiers``...) read key by key
    with the parsers above; every error names ``<key_path>.<key>`` and the value."""

    __slots__ = ("key_path", "raw")

    def __init__(self, raw: Mapping[str, Any], key_path: str) -> None:
        self.raw = raw
        self.key_path = key_path

    @classmethod
    def of(cls, value: object, key_path: str) -> Section:
        """``value`` checked to be a mapping (absent or null: empty)."""
        return cls(mapping(value, key_path), key_path)

    def path(self, key: str) -> str:
        return f"{self.key_path}.{key}"

    def fail(self, key: str, value: object, message: str) -> ConfigError:
        return ConfigError(self.path(key), value, message)

    def reject_unknown(self, known: frozenset[str] | set[str]) -> None:
        reject_unknown(self.raw, known, f"{self.key_path}.")

    def get(self, key: str, default: T, parse: Callable[[object, str], T]) -> T:
        """``parse(value, key path)``, or ``default`` when the key is absent or null."""
        if self.raw.get(key) is None:
            return default
        return parse(self.raw[key], self.path(key))

    def section(self, key: str) -> Section:
        """The nested mapping under ``key`` (absent or null: empty)."""
        return Section.of(self.raw.get(key), self.path(key))


def format_duration(seconds: object) -> str:
    """A duration as the configuration writes it: ``0.5`` -> ``500ms``, ``2`` -> ``2s``
    (anything else as is: a plan shows what it was given)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        return str(seconds)
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"
