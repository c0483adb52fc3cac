"""Supervisor tests: crash/exit restarts with back-off, ordered stop, abandonment."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import MutableMapping
from typing import Any

import pytest
import structlog
from structlog.testing import LogCapture
from structlog.typing import FilteringBoundLogger

from runtimeproxy.ops.supervisor import Supervisor, TaskStatus


def capturing_logger() -> tuple[FilteringBoundLogger, LogCapture]:
    capture = LogCapture()
    logger: FilteringBoundLogger = structlog.wrap_logger(
        None,
        processors=[capture],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
    )
    return logger, capture


def events(capture: LogCapture, name: str) -> list[MutableMapping[str, Any]]:
    return [e for e in capture.entries if e["event"] == name]


async def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    """Poll a condition; the timeout only guards against a hung test."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.001)


@pytest.mark.asyncio
async def test_crash_restarts_with_doubling_backoff() -> None:
    logger, capture = capturing_logger()
    sup = Supervisor(backoff_initial=0.01, backoff_max=1.0, logger=logger)
    runs = 0

    async def crasher() -> None:
        nonlocal runs
        runs += 1
        raise RuntimeError(f"boom {runs}")

    sup.add("crasher", crasher)
    await sup.start()
    await wait_for(lambda: runs >= 4)
    await sup.stop(timeout=1.0)

    crashes = events(capture, "task_crashed")
    delays = [c["next_delay"] for c in crashes[:4]]
    assert delays == [0.01, 0.02, 0.04, 0.08]
    assert [c["restarts"] for c in crashes[:4]] == [0, 1, 2, 3]
    assert crashes[0]["task"] == "crasher"
    assert crashes[0]["error"] == "RuntimeError: boom 1"
    assert isinstance(crashes[0]["exc_info"], RuntimeError)


@pytest.mark.asyncio
async def test_backoff_is_capped_and_reset_after_long_run() -> None:
    logger, capture = capturing_logger()
    # Runs 1-4 crash at once and must count as short (<= backoff_max): a cap of a few
    # milliseconds would let one GC pause or preemption on a loaded machine make a
    # crash look like a healthy run and reset the back-off early.
    sup = Supervisor(backoff_initial=0.02, backoff_max=0.08, logger=logger)
    runs = 0

    async def flappy() -> None:
        nonlocal runs
        runs += 1
        if runs == 5:
            # Longer than backoff_max: counts as a healthy run.
            await asyncio.sleep(0.3)
        raise ValueError("flap")

    sup.add("flappy", flappy)
    await sup.start()
    await wait_for(lambda: runs >= 6)
    await sup.stop(timeout=1.0)

    delays = [c["next_delay"] for c in events(capture, "task_crashed")[:5]]
    assert delays == [0.02, 0.04, 0.08, 0.08, 0.02]


@pytest.mark.asyncio
async def test_status_counts_restarts_and_last_error() -> None:
    logger, _ = capturing_logger()
    sup = Supervisor(backoff_initial=0.001, backoff_max=0.01, logger=logger)
    runs = 0
    steady = asyncio.Event()

    async def job() -> None:
        nonlocal runs
        runs += 1
        if runs <= 3:
            raise KeyError("missing")
        steady.set()
        await asyncio.Event().wait()

    sup.add("job", job)
    assert sup.status() == [TaskStatus("job", False, 0, None)]
    await sup.start()
    async with asyncio.timeout(5):
        await steady.wait()

    assert sup.status() == [TaskStatus("job", True, 3, "KeyError: 'missing'")]
    await sup.stop(timeout=1.0)
    assert sup.status()[0].running is False


@pytest.mark.asyncio
async def test_normal_return_is_logged_and_restarted() -> None:
    logger, capture = capturing_logger()
    sup = Supervisor(backoff_initial=0.001, backoff_max=0.01, logger=logger)
    runs = 0

    async def quitter() -> None:
        nonlocal runs
        runs += 1

    sup.add("quitter", quitter)
    await sup.start()
    await wait_for(lambda: runs >= 3)
    await sup.stop(timeout=1.0)

    assert len(events(capture, "task_exited")) >= 2
    assert events(capture, "task_crashed") == []
    assert sup.status()[0].last_error is None


@pytest.mark.asyncio
async def test_stop_cancels_in_reverse_order_without_crash_logs() -> None:
    logger, capture = capturing_logger()
    sup = Supervisor(logger=logger)
    stopped: list[str] = []
    started: list[str] = []

    def make(name: str) -> Any:
        async def job() -> None:
            started.append(name)
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                stopped.append(name)
                raise

        return job

    for name in ("config", "hooks", "metrics"):
        sup.add(name, make(name))
    await sup.start()
    await wait_for(lambda: len(started) == 3)
    await sup.stop(timeout=1.0)

    assert stopped == ["metrics", "hooks", "config"]
    assert events(capture, "task_crashed") == []
    assert events(capture, "task_abandoned") == []


@pytest.mark.asyncio
async def test_stop_abandons_task_that_swallows_cancellation() -> None:
    logger, capture = capturing_logger()
    sup = Supervisor(logger=logger)
    release = asyncio.Event()
    polite_cancelled = False
    in_stubborn = asyncio.Event()
    stubborn_runs = 0

    async def polite() -> None:
        nonlocal polite_cancelled
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            polite_cancelled = True
            raise

    async def stubborn() -> None:
        nonlocal stubborn_runs
        stubborn_runs += 1
        in_stubborn.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                pass

    sup.add("polite", polite)
    sup.add("stubborn", stubborn)
    await sup.start()
    await in_stubborn.wait()

    async with asyncio.timeout(2.0):  # stop must honour its own 0.05 s budget
        await sup.stop(timeout=0.05)

    abandoned = events(capture, "task_abandoned")
    assert [a["task"] for a in abandoned] == ["stubborn"]
    # The stubborn task ate the whole budget, yet the earlier task was still cancelled.
    await asyncio.sleep(0)
    assert polite_cancelled

    # Once the stubborn job finally returns it must not be restarted.
    release.set()
    tasks = [t for t in asyncio.all_tasks() if t.get_name() == "stubborn"]
    await asyncio.wait(tasks, timeout=2.0)
    assert all(t.done() for t in tasks)
    assert stubborn_runs == 1
    assert events(capture, "task_exited") == []


@pytest.mark.asyncio
async def test_add_after_start_runs_immediately_and_duplicates_rejected() -> None:
    logger, _ = capturing_logger()
    sup = Supervisor(logger=logger)
    ran = asyncio.Event()

    async def late() -> None:
        ran.set()
        await asyncio.Event().wait()

    await sup.start()
    sup.add("late", late)
    async with asyncio.timeout(5):
        await ran.wait()
    names = {t.get_name() for t in asyncio.all_tasks()}
    assert "late" in names

    with pytest.raises(ValueError):
        sup.add("late", late)
    await sup.stop(timeout=1.0)
    await sup.stop(timeout=1.0)  # idempotent
    with pytest.raises(RuntimeError):
        sup.add("after-stop", late)


@pytest.mark.asyncio
async def test_stray_cancelled_error_counts_as_crash() -> None:
    logger, capture = capturing_logger()
    sup = Supervisor(backoff_initial=0.001, backoff_max=0.01, logger=logger)
    runs = 0

    async def job() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise asyncio.CancelledError()  # not from stop(): must not kill the guard
        await asyncio.Event().wait()

    sup.add("job", job)
    await sup.start()
    await wait_for(lambda: runs >= 2)
    status = sup.status()[0]
    await sup.stop(timeout=1.0)

    assert status.restarts == 1
    assert events(capture, "task_crashed")[0]["error"] == "CancelledError"
