"""The value parsers every settings section shares: ``ConfigError`` and durations,
mappings, strings, integers, unknown keys. ``runtimeproxy.config.settings`` re-exports
``ConfigError`` and ``parse_duration``, which plugins and tasks use too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Final

from runtimeproxy.hookapi import KoordError


class ConfigError(KoordError):
    """A setting is invalid. The message starts with the key path."""

    def __init__(self, key_path: str, value: object, message: str) -> None:
        super().__init__(f"{key_path}: {message} (got {value!r})")
        self.key_path = key_path
        self.value = value


DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: object, key_path: str) -> float:
    """Seconds from ``1.5``, ``"500ms"``, ``"2s"``, ``"1m"``; must be > 0."""
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


def reject_unknown(data: Mapping[str, Any], allowed: frozenset[str], prefix: str) -> None:
    for key in data:
        if key not in allowed:
            # An empty or odd key ('', 'a.b') is quoted so the path still names it.
            shown = key if re.fullmatch(r"[\w\-/]+", key) else repr(key)
            raise ConfigError(f"{prefix}{shown}", data[key], f"unknown key; expected one of {sorted(allowed)}")


def positive_int(value: object, key_path: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key_path, value, f"must be an integer >= {minimum}")
    return value
