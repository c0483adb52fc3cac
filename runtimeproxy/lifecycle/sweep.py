"""The host sweep: cleanup owed to pods that no longer exist, found from the host.

Post stages after a removal (``runtimeproxy.lifecycle.owed``) clean up what the store
knew; what no ledger knew (a pod removed before the ledger existed, a ledger lost or
full, a Post stage that failed) is found by the hooks themselves: every hook with the
optional ``sweep_orphans`` method (``runtimeproxy.hookapi.OrphanSweeper``) is given the
live pods' uids at start and after every re-sync and removes what it made for the others.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterable, Sequence
from typing import Final

import structlog

from runtimeproxy.chain.hookchain import BoundHook
from runtimeproxy.hookapi import LivePods, OrphanSweeper
from runtimeproxy.ops.logsetup import Throttle

log = structlog.get_logger("runtimeproxy.sweep")

#: Items named in one log line (the count is always whole).
_SHOWN: Final = 20


async def sweep(hooks: Iterable[BoundHook], live: LivePods, throttle: Throttle | None = None) -> int:
    """Run every hook's sweep; returns how many things were removed. ``throttle``: a hook
    that keeps failing is said once per its interval (the sweep runs after every re-sync)."""
    total = 0
    for hook in hooks:
        impl = hook.impl
        if not isinstance(impl, OrphanSweeper):
            continue
        try:
            if inspect.iscoroutinefunction(impl.sweep_orphans):
                removed: Sequence[str] = await impl.sweep_orphans(live)
            else:
                removed = await asyncio.to_thread(impl.sweep_orphans, live)
        except Exception as exc:  # noqa: BLE001 - a hook's bug must not stop the re-sync; retried next time
            held = 0 if throttle is None else throttle.allow(hook.name)
            if held is not None:
                log.warning("orphan_sweep_failed", hook=hook.name, error=f"{type(exc).__name__}: {exc}"[:300],
                            repeats_suppressed=held)
            continue
        if removed:
            total += len(removed)
            log.info("orphans_removed", hook=hook.name, count=len(removed), removed=list(removed[:_SHOWN]),
                     live_pods=len(live.uids))
    return total
