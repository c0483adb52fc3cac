"""The config-value toolkit: the parsers every settings section shares (durations,
mappings, strings, integers, unknown keys), used by the core's settings, the hooks'
``args`` (``hooks.hookargs``) and the tasks' settings (``metrics.settings``,
``metrics.collect.registry``...). Every error is the one ``ConfigError``
(``runtimeproxy.errors``), re-exported here and by ``runtimeproxy.config.settings``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Final

from runtimeproxy.errors import ConfigError as ConfigError

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


def format_duration(seconds: object) -> str:
    """A duration as the configuration writes it: ``0.5`` -> ``500ms``, ``2`` -> ``2s``
    (anything else as is: a plan shows what it was given)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        return str(seconds)
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"
