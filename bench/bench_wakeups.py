"""Benchmark: what a wake-up of the event loop and a worker-thread hand-off cost here, and
what sharing wake-ups saves (issue 29).

Run by hand: ``.venv/bin/python bench/bench_wakeups.py [--seconds S]``. In this process,
one after the other, it measures the process's CPU (utime+stime, so it holds on a busy
host) and the loop's blocking waits for:

* an idle loop woken by one timer every 10 ms (the cost of a wake-up alone);
* the same with a no-op ``asyncio.to_thread`` hand-off at each wake (a worker's wake-up
  and the loop's second one);
* the agent's periodic cadences (1 s, 1 s, 1 s, 2 s, 3 s, 5 s and 10 s tasks, scaled down
  by ``--scale`` so a run is short), each task on a phase of its own (as the agent runs
  them) and then all sleeping to the next multiple of their interval (a shared beat).

The anchor is the first row: the other rows are read against one wake-up's cost measured
in the same run.

The shared beat was tried in the agent (issue 29, eleventh session, docs/benchmarks.md)
and reverted: its loop woke 34-36 times a second instead of 43, but the process's CPU did
not fall (the tasks' worker threads then ran at once and took turns at the GIL) and its
RSS rose by 0.4-0.5 MiB (their transients at once). This bench keeps the isolated figures.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import selectors
import time
from collections.abc import Awaitable, Callable
from typing import Any

CADENCES = (1.0, 1.0, 1.0, 2.0, 3.0, 5.0, 10.0)


class _CountingSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.blocking = 0

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None or timeout > 0:
            self.blocking += 1
        return super().select(timeout)


def _run(main: Callable[[], Awaitable[None]]) -> tuple[float, int]:
    """CPU seconds of the process and the loop's blocking waits while ``main`` runs."""
    selector = _CountingSelector()
    loop = asyncio.SelectorEventLoop(selector)
    try:
        started = time.process_time()
        loop.run_until_complete(main())
        return time.process_time() - started, selector.blocking
    finally:
        loop.close()


def _next_beat(now: float, interval: float) -> float:
    """The first multiple of ``interval`` at least half an interval after ``now``."""
    return (math.floor((now + interval / 2) / interval) + 1) * interval


async def _sleep_until(when: float) -> None:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()
    handle = loop.call_at(when, future.set_result, None)
    try:
        await future
    finally:
        handle.cancel()


def _timer_wakes(count: int, hand_off: bool) -> Callable[[], Awaitable[None]]:
    async def main() -> None:
        for _ in range(count):
            await asyncio.sleep(0.01)
            if hand_off:
                await asyncio.to_thread(int)

    return main


def _cadences(seconds: float, scale: float, on_beat: bool) -> Callable[[], Awaitable[None]]:
    async def task(interval: float, phase: float) -> None:
        loop = asyncio.get_running_loop()
        if not on_beat:
            await asyncio.sleep(phase)
        while True:
            if on_beat:
                await _sleep_until(_next_beat(loop.time(), interval))
            else:
                await asyncio.sleep(interval)

    async def main() -> None:
        # Phases spread over the first interval, as tasks started one after the other get.
        tasks = [asyncio.create_task(task(c * scale, (k + 1) * scale / (len(CADENCES) + 1)))
                 for k, c in enumerate(CADENCES)]
        await asyncio.sleep(seconds)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    return main


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each cadence run")
    ap.add_argument("--scale", type=float, default=0.1, help="the cadences' seconds are multiplied by this")
    ap.add_argument("--wakes", type=int, default=1000)
    args = ap.parse_args()
    wake_cpu, wake_waits = _run(_timer_wakes(args.wakes, False))
    hop_cpu, hop_waits = _run(_timer_wakes(args.wakes, True))
    per_wake = wake_cpu / args.wakes
    print("| what | blocking waits | CPU per event | in wake-ups |")
    print("|---|---:|---:|---:|")
    print(f"| a timer wake-up (anchor) | {wake_waits} | {per_wake * 1e6:.0f} µs | 1.0 |")
    per_hop = hop_cpu / args.wakes
    print(f"| a timer wake-up + a `to_thread` hand-off | {hop_waits} | {per_hop * 1e6:.0f} µs "
          f"| {per_hop / per_wake:.1f} |")
    real = args.seconds / args.scale
    print(f"\n### The agent's cadences {', '.join(f'{c:g}' for c in CADENCES)} s, scaled by {args.scale:g} "
          f"({args.seconds:g} s each, {real:.0f} s of the agent's time)\n")
    print("| tasks | blocking waits per agent second | CPU, % of a core at the real cadences |")
    print("|---|---:|---:|")
    for name, on_beat in (("each on its own phase", False), ("on the shared beat", True)):
        cpu, waits = _run(_cadences(args.seconds, args.scale, on_beat))
        # Scaled: the same wake-ups happen 1/scale times less often at the real cadences.
        print(f"| {name} | {waits / real:.2f} | {100 * cpu / real:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
