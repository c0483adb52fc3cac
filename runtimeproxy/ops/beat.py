"""One grid of instants for the periodic tasks, so that they share the loop's wake-ups.

On a VM, coming back from ``epoll_wait`` costs more CPU than most of what the periodic
tasks then do (issue 29: ~0.25 ms per wake-up of the event loop, eight a second at 110
pods). A task that sleeps ``interval`` from whenever its last run ended wakes the loop
at its own instants; tasks that sleep to the next multiple of their interval on the
loop's clock (``time.monotonic``) wake at the same instants as every other task whose
interval divides the same whole seconds: a 1 s, a 2 s and a 3 s task make one wake-up a
second between them instead of one for each. The same idea as the kernel's timer slack,
applied where the tasks' deadlines are made.

The heavy periodic work is kept apart on the grid, in three phases of the second. The
collectors' ticks (~5 ms of Python at 110 pods, in their worker thread) fall on whole
seconds (``TICK``); what reads them every second (the QoS round, the fast path's idle
tick) half a second later (``AFTER_TICK``), so the round plans from that second's tick;
everything else at three quarters (``OFFBEAT``). Measured: all on whole seconds, the
loop's CPU fell by a quarter and the collectors' worker's rose by as much, with three
times its context switches (turns at the GIL); with the round and the rest sharing the
half second, the peak and the steady RSS rose by 0.5 MiB (their workers' transients at
once, in two malloc arenas). The interference analyser keeps a phase of its own.
"""

from __future__ import annotations

import asyncio
import math
from typing import Final

#: The collectors' ticks: whole seconds (multiples of their interval).
TICK: Final = 0.0
#: What reads the ticks every second: half a second past the multiples of its interval.
AFTER_TICK: Final = 0.5
#: Every other periodic task: three quarters of a second past them.
OFFBEAT: Final = 0.75


def beat_after(at: float, interval: float, phase: float) -> float:
    """The first instant after ``at`` (seconds on the monotonic clock) that is ``phase``
    past a multiple of ``interval``."""
    return (math.floor((at - phase) / interval) + 1) * interval + phase


def next_beat(started: float, interval: float, phase: float) -> float:
    """Where a task that started a run at ``started`` runs next: the first beat (``phase``
    past a multiple of ``interval``) at least half an interval later, so a run that began
    just after its beat (or off the grid, woken early) is not followed by another within
    a fraction of it."""
    return beat_after(started + interval / 2, interval, phase)


async def sleep_until(when: float) -> None:
    """Sleep until the loop's clock reads ``when``: one timer at exactly that instant, so
    tasks sleeping to the same beat run in the same pass of the loop."""
    loop = asyncio.get_running_loop()
    if when <= loop.time():
        await asyncio.sleep(0)
        return
    future: asyncio.Future[None] = loop.create_future()
    handle = loop.call_at(when, _wake, future)
    try:
        await future
    finally:
        handle.cancel()


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
