"""Dry-run reporting for hooks that write on the host.

With ``args.dry_run: true`` a hook computes every write as usual but makes none;
each one it *would* make is reported as a ``HostWrite`` whose new value ends in
``(dry-run, not written)``, so ``explain`` shows the plan with its reason. Since
nothing changes on the host, the same plan would be reported again at every
reconcile pass: ``DryRunLedger`` lets a planned write through only when the
planned value for its target changed (bounded, oldest forgotten first).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Final

from runtimeproxy.hookapi import HookConfigError, HookInit, HostWrite

DRY_RUN_SUFFIX: Final = " (dry-run, not written)"


def dry_run_arg(init: HookInit, args: Mapping[str, Any]) -> bool:
    value = args.get("dry_run", False)
    if not isinstance(value, bool):
        raise HookConfigError(f"{init.key_path}.dry_run", value, "expected true or false")
    return value


class DryRunLedger:
    """Which planned writes were reported already (target -> planned value)."""

    def __init__(self, max_entries: int = 8192) -> None:
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, str] = OrderedDict()
        self._max = max_entries

    def planned(self, target: str, old: str, new: str, reason: str) -> HostWrite | None:
        """The write to report for this plan, or None when it was reported already."""
        with self._lock:
            if self._seen.get(target) == new:
                self._seen.move_to_end(target)
                return None
            self._seen[target] = new
            self._seen.move_to_end(target)
            while len(self._seen) > self._max:
                self._seen.popitem(last=False)
        return HostWrite(target, old, new + DRY_RUN_SUFFIX, f"dry-run: {reason}")
