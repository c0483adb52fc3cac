"""The NodeSLO in force: the last one that parsed, kept across a bad update and a restart.

A NodeSLO with one field the agent refuses (a value the CRD allows but the rules parser
does not, or one that contradicts the YAML ``rules:``) is rejected as a whole, as before,
but it no longer drops the node back to the YAML rules: the last good NodeSLO stays in
force (issue 28 item 6: with a good NodeSLO turning BE group identity off, a bad update put
BE pods back to ``cpu.idle=1``). The rejection is reported (a ``NodeSLORejected`` Event on
the Node, a ``nodeslo_rejected`` log line naming the field and value, and ``explain``).

The last good spec is written to ``<state_dir>/nodeslo-last-good.json`` (mode 0600,
atomically), and restored at start, before the NodeSLO is listed: a restart while the
cluster's NodeSLO is bad keeps the last good one too. A NodeSLO deleted in the cluster
is forgotten (file removed): the YAML rules apply, as koordlet falls back to its defaults.
Without ``state_dir`` the last good NodeSLO is kept in memory only.

koordlet keeps no copy on disk (it re-lists at start and merges the NodeSLO over its
defaults field by field); keeping the whole last good object is this agent's choice, so
the node never runs a mix of a half-applied update.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import structlog

from hooks.rules import parse_rules, rules_from_nodeslo
from runtimeproxy.hookapi import HookConfigError, merge_rules

log = structlog.get_logger("metrics.informer.nodeslo")

FILE_NAME: Final = "nodeslo-last-good.json"

#: (spec or None, its rules overlay or None): put in force.
Apply = Callable[[Mapping[str, Any] | None, Mapping[str, Any] | None], None]
#: (the refusal, what applies instead): report it.
Reject = Callable[[HookConfigError, str], None]


def check(spec: Mapping[str, Any] | None, base: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The spec's rules overlay, checked alone and merged over the YAML ``base``; raises
    ``HookConfigError`` naming the field."""
    overlay = rules_from_nodeslo(spec)
    if overlay is not None:
        parse_rules(merge_rules(base, overlay), path="nodeslo.spec")
    return overlay


class NodeSLOKeeper:
    def __init__(self, base: Mapping[str, Any], state_dir: Path | None, apply: Apply, reject: Reject) -> None:
        self._base = base
        self.path = state_dir / FILE_NAME if state_dir is not None else None
        self._apply = apply
        self._reject = reject
        self._lock = threading.Lock()
        self._good: Mapping[str, Any] | None = None
        self._source = "yaml rules"
        self._rejected: dict[str, Any] | None = None

    def restore(self) -> bool:
        """Put the persisted last good NodeSLO in force (at start); False without one."""
        if self.path is None or not self.path.is_file():
            return False
        try:
            spec = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(spec, Mapping):
                raise ValueError("not a JSON object")
            overlay = check(spec, self._base)
        except (OSError, ValueError, RecursionError, HookConfigError) as exc:
            log.error("nodeslo_last_good_unreadable", path=str(self.path), error=str(exc), applied="yaml rules")
            return False
        with self._lock:
            self._good, self._source = spec, f"last good NodeSLO restored from {self.path}"
        log.info("nodeslo_last_good_restored", path=str(self.path))
        self._apply(spec, overlay)
        return True

    def update(self, spec: Mapping[str, Any] | None) -> None:
        """The NodeSLO's spec changed (a watch thread; None: deleted)."""
        try:
            overlay = check(spec, self._base)
        except HookConfigError as exc:
            with self._lock:
                applied = "last good NodeSLO" if self._good is not None else "yaml rules"
                self._rejected = {"key": exc.key_path, "value": repr(exc.value)[:200], "reason": exc.message,
                                  "at": time.time(), "applied": applied}
            self._reject(exc, applied)
            return
        with self._lock:
            self._good, self._rejected = spec, None
            self._source = "NodeSLO" if spec is not None else "yaml rules (no NodeSLO)"
        self._persist(spec)
        self._apply(spec, overlay)

    def _persist(self, spec: Mapping[str, Any] | None) -> None:
        if self.path is None:
            return
        try:
            if spec is None:
                self.path.unlink(missing_ok=True)
                return
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(spec, out, sort_keys=True)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:  # in force anyway; only a restart would not keep it
            log.error("nodeslo_last_good_not_saved", path=str(self.path), error=str(exc))

    def explain(self) -> Mapping[str, Any]:
        with self._lock:
            return {"in_force": self._source, "rejected": dict(self._rejected) if self._rejected else None,
                    "persisted": str(self.path) if self.path is not None else None}
