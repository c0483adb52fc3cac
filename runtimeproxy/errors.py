"""The project's errors: one root, ``KoordError``, and its families.

Every exception class of ``runtimeproxy``, ``hooks`` and ``metrics`` derives from exactly
one family below (``tests/unit/test_error_families.py`` walks every module and fails on a
stray class). A caller catches a family or a class, never ``Exception``: ``except
KoordError`` cannot hide a bug (a TypeError, an AttributeError). Classes that callers also
catch as ``ValueError``, ``OSError`` or ``RuntimeError`` keep that builtin as a mixin.

This module is the bottom of the core's layers: it imports nothing of ours, so every
room (and every plugin) can raise these.
"""

from __future__ import annotations


class KoordError(Exception):
    """The root of the project's own errors; never raised itself."""


class ConfigError(KoordError):
    """The operator's configuration is invalid (the YAML, a flag, a hook's or task's
    ``args``): ``key_path`` names where, ``value`` what. The process exits 2 before it
    listens; a reload keeps the old configuration."""

    def __init__(self, key_path: str, value: object, message: str) -> None:
        super().__init__(f"{key_path}: {message} (got {value!r})")
        self.key_path = key_path
        self.value = value
        self.message = message


#: The name the hook API has always used for a plugin's invalid ``args``: the same class,
#: so the core reports a plugin's error as it reports its own, with no translation.
HookConfigError = ConfigError


class InputError(KoordError):
    """A value that arrives while running, not from the configuration, is malformed: a
    pod annotation, a NodeSLO or NodeMetric field, a CPU list, a request to the loopback
    endpoint. The message names the field and the value; only that object is refused."""


class HookError(KoordError):
    """A hook could not do its job (bad annotation, write refused...). The hook's
    failure policy decides whether the CRI call fails."""

    #: True when this failure repeats one already logged (a host write failing the
    #: same way again): whoever catches it logs below warning, so a retry loop
    #: does not storm the log.
    repeat: bool = False


class HostError(KoordError):
    """The host cannot be measured as asked: a /proc or /sys file unreadable, perf
    counters or eBPF missing. Collectors report it and go on."""


class PeerError(KoordError):
    """A call to another process failed (the "call" family): the runtime behind the
    proxy, the NRI peer, a remote hook, systemctl, an advisor endpoint, or another
    process holding our socket."""


class KubeError(KoordError):
    """The Kubernetes API server: no usable configuration, unreachable, or an error status."""


class StoreError(KoordError):
    """What we persist (the metrics store, the state ledger) is unusable or damaged."""


#: The families, in the order docs/architecture.md lists them.
FAMILIES: tuple[type[KoordError], ...] = (ConfigError, InputError, HookError, HostError, PeerError, KubeError,
                                          StoreError)
