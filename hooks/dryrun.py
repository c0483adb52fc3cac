"""Dry-run for every hook that writes on the host: one module, one behaviour, one shape.

With ``args.dry_run: true`` (``dry_run_arg``) a hook computes every write as usual but
makes none. Each write it *would* make goes through the hook's ``DryRunLedger``:

- explain: a ``HostWrite`` whose new value ends in ``(dry-run, not written)`` and whose
  reason starts with ``dry-run: `` (the patch reason too, ``patch_reason``);
- log: one line ``hook_dry_run`` per reported plan (``hook``, where, ``writes``:
  ``target: old -> new``);
- once: nothing changes on the host, so the same plan would come back at every
  reconcile pass; the ledger reports a target again only when its planned value
  changed (bounded, oldest forgotten first), at any stage.

``planned_writes`` turns cgroup ``Update``s into the writes the executor would make
(files whose value differs), for the ledger.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import structlog

from hooks.cgroups import comparable
from hooks.executor import CgroupExecutor, Update
from runtimeproxy.config.configvalues import boolean
from runtimeproxy.hookapi import HookInit, HostWrite

DRY_RUN_SUFFIX: Final = " (dry-run, not written)"
REASON_PREFIX: Final = "dry-run: "

log = structlog.get_logger("hooks.dryrun")


def dry_run_arg(init: HookInit, args: Mapping[str, Any]) -> bool:
    return boolean(args.get("dry_run", False), f"{init.key_path}.dry_run")


def patch_reason(reason: str) -> str:
    """A dry-run patch's reason (the planned writes carry the same prefix)."""
    return REASON_PREFIX + reason


def planned_writes(executor: CgroupExecutor, updates: Sequence[Update]) -> list[HostWrite]:
    """What ``executor.apply(updates)`` would change, without writing: files whose value
    differs, as plain ``HostWrite``s (``DryRunLedger.report`` marks them)."""
    version = executor.layout.version
    out: list[HostWrite] = []
    for update in updates:
        value = update.resource.check(update.value)
        path = executor.path(update.cgroup, update.resource, update.source)
        old = executor.read(update.cgroup, update.resource, update.source)
        try:
            same = update.resource.parse(old, version) == comparable(update.resource, value, version)
        except (ValueError, IndexError):
            same = False
        if not same:
            out.append(HostWrite(str(path), old, update.resource.render(value, version, old), update.reason))
    return out


class DryRunLedger:
    """Which planned writes one hook reported already (target -> planned value)."""

    def __init__(self, hook: str, max_entries: int = 8192) -> None:
        self.hook = hook
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, str] = OrderedDict()
        self._max = max_entries

    def _new(self, target: str, new: str) -> bool:
        with self._lock:
            if self._seen.get(target) == new:
                self._seen.move_to_end(target)
                return False
            self._seen[target] = new
            self._seen.move_to_end(target)
            while len(self._seen) > self._max:
                self._seen.popitem(last=False)
            return True

    def report(self, writes: Iterable[HostWrite], **where: Any) -> tuple[HostWrite, ...]:
        """The planned writes not reported yet with this value, marked for explain and
        logged as one line; empty when every one was reported already."""
        fresh = tuple(HostWrite(w.target, w.old, w.new + DRY_RUN_SUFFIX, REASON_PREFIX + w.reason)
                      for w in writes if self._new(w.target, w.new))
        if fresh:
            log.info("hook_dry_run", hook=self.hook, **where,
                     writes=[f"{w.target}: {w.old or '-'} -> {w.new.removesuffix(DRY_RUN_SUFFIX)}" for w in fresh])
        return fresh


__all__ = ["DRY_RUN_SUFFIX", "REASON_PREFIX", "DryRunLedger", "dry_run_arg", "patch_reason", "planned_writes"]
