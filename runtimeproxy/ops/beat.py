"""One grid of instants for the periodic tasks, so that they share the loop's wake-ups.

On a VM, coming back from ``epoll_wait`` costs more CPU than most of what the periodic
tasks then do (issue 29: ~0.25 ms per wake-up of the event loop, eight a second at 110
pods). A task that sleeps ``interval`` from whenever its last run ended wakes the loop
at its own instants; tasks that sleep to the next multiple of their interval on the
loop's clock (``time.monotonic``) wake at the same instants as every other task whose
interval divides the same whole seconds: a 1 s, a 2 s and a 3 s task make one wake-up a
second between them instead of one for each. The same idea as the kernel's timer slack,
applied where the tasks' deadlines are made.

Heavy work is kept apart on the grid: the QoS round, which reads what the collectors'
tick wrote, runs half its interval after the beat (``phase``), so it plans from the tick
of that second and its worker thread does not take turns at the GIL with the collectors'
(both at the same instant measured no less CPU and half again as many context switches).
The interference analyser keeps a phase of its own.
"""

from __future__ import annotations

import asyncio
import math


def beat_after(at: float, interval: float, phase: float = 0.0) -> float:
    """The first instant after ``at`` (seconds on the monotonic clock) that is ``phase``
    past a multiple of ``interval``."""
    return (math.floor((at - phase) / interval) + 1) * interval + phase


def next_beat(started: float, interval: float, phase: float = 0.0) -> float:
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
