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
    that keeps failing is said once per its interval (the sweep runs after every re-sync).
    The sync sweeps run one after the other in one worker-thread hand-off: each is a scan
    of its hook's own records, shorter than the hand-off (issue 29: six hand-offs a
    re-sync were ~1 ms of CPU on a VM for microseconds of work)."""
    sweepers = [(hook, hook.impl) for hook in hooks if isinstance(hook.impl, OrphanSweeper)]
    in_thread = [impl for _, impl in sweepers if not inspect.iscoroutinefunction(impl.sweep_orphans)]
    outcomes = iter(await asyncio.to_thread(_sweep_all, in_thread, live) if in_thread else ())
    total = 0
    for hook, impl in sweepers:
        outcome: Sequence[str] | Exception
        if inspect.iscoroutinefunction(impl.sweep_orphans):
            try:
                outcome = await impl.sweep_orphans(live)
            except Exception as exc:  # noqa: BLE001 - as in _sweep_all
                outcome = exc
        else:
            outcome = next(outcomes)  # in_thread's order is the chain's
        total += _report(hook, outcome, live, throttle)
    return total


def _sweep_all(sweepers: Sequence[OrphanSweeper], live: LivePods) -> list[Sequence[str] | Exception]:
    """Worker thread: each sync hook's sweep, or what it raised."""
    out: list[Sequence[str] | Exception] = []
    for impl in sweepers:
        try:
            out.append(impl.sweep_orphans(live))
        except Exception as exc:  # noqa: BLE001 - a hook's bug must not stop the re-sync; retried next time
            out.append(exc)
    return out


def _report(hook: BoundHook, outcome: Sequence[str] | Exception, live: LivePods, throttle: Throttle | None) -> int:
    """Log one hook's sweep; how many things it removed."""
    if isinstance(outcome, Exception):
        held = 0 if throttle is None else throttle.allow(hook.name)
        if held is not None:
            log.warning("orphan_sweep_failed", hook=hook.name, error=f"{type(outcome).__name__}: {outcome}"[:300],
                        repeats_suppressed=held)
        return 0
    if outcome:
        log.info("orphans_removed", hook=hook.name, count=len(outcome), removed=list(outcome[:_SHOWN]),
                 live_pods=len(live.uids))
    return len(outcome)
