"""The shared beat: periodic tasks sleep to multiples of their interval, so that tasks
whose intervals divide the same instants share the event loop's wake-ups (issue 29)."""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from runtimeproxy.ops import beat


def test_a_beat_is_the_next_multiple_of_the_interval() -> None:
    assert beat.beat_after(10.3, 1.0, beat.TICK) == 11.0
    assert beat.beat_after(11.0, 1.0, beat.TICK) == 12.0  # strictly after
    assert beat.beat_after(10.3, 3.0, beat.TICK) == 12.0  # every third 1 s beat is a 3 s beat too
    assert beat.beat_after(10.3, 0.5, beat.TICK) == 10.5
    assert beat.beat_after(10.3, 1.0, beat.AFTER_TICK) == 10.5  # half a second past the whole ones
    assert beat.beat_after(10.7, 1.0, beat.AFTER_TICK) == 11.5
    assert beat.beat_after(10.7, 1.0, beat.OFFBEAT) == 10.75


def test_the_next_run_is_at_least_half_an_interval_away() -> None:
    assert beat.next_beat(10.002, 1.0, beat.TICK) == 11.0  # a run just after its beat: the next beat
    assert beat.next_beat(10.6, 1.0, beat.TICK) == 12.0  # woken off the grid: not 0.4 s later
    assert beat.next_beat(10.4, 1.0, beat.TICK) == 11.0
    assert beat.next_beat(7.0, 2.0, beat.TICK) == 10.0  # 8.0 is only one second away
    assert beat.next_beat(10.502, 1.0, beat.AFTER_TICK) == 11.5


class _CountingSelector(selectors.DefaultSelector):
    """Counts the waits that may block: each one is a wake-up of the loop's thread."""

    def __init__(self) -> None:
        super().__init__()
        self.blocking = 0

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None or timeout > 0:
            self.blocking += 1
        return super().select(timeout)


def _blocking_waits(make: Callable[[float, float], Coroutine[Any, Any, None]], seconds: float) -> int:
    selector = _CountingSelector()
    loop = asyncio.SelectorEventLoop(selector)
    try:
        async def main() -> None:
            tasks = [asyncio.create_task(make(interval, phase))
                     for interval, phase in ((0.1, 0.0), (0.2, 0.033), (0.3, 0.066))]
            await asyncio.sleep(seconds)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        loop.run_until_complete(main())
        return selector.blocking
    finally:
        loop.close()


async def _on_the_beat(interval: float, _phase: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        await beat.sleep_until(beat.next_beat(loop.time(), interval, beat.TICK))


async def _own_phase(interval: float, phase: float) -> None:
    await asyncio.sleep(phase)
    while True:
        await asyncio.sleep(interval)


def test_tasks_on_the_beat_share_the_loop_s_wake_ups() -> None:
    """Three tasks at 0.1, 0.2 and 0.3 s: on the beat the loop wakes once per 0.1 s (a
    late wake on a busy host still serves every task due by then); each on its own
    phase it wakes for each of them (10 + 5 + 3 a second)."""
    seconds = 1.2
    aligned = _blocking_waits(_on_the_beat, seconds)
    own = _blocking_waits(_own_phase, seconds)
    assert aligned <= seconds / 0.1 + 3, aligned
    assert own > aligned, (own, aligned)


@pytest.mark.asyncio
async def test_sleep_until_wakes_at_the_instant_and_not_before() -> None:
    loop = asyncio.get_running_loop()
    when = loop.time() + 0.05
    await beat.sleep_until(when)
    assert loop.time() >= when
    started = time.monotonic()
    await beat.sleep_until(loop.time() - 5)  # an instant gone: no wait
    assert time.monotonic() - started < 1.0
