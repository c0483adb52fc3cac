"""Supervised background tasks on one asyncio loop.

The proxy runs several eternal background jobs next to the gRPC server (config
watcher, hookserver.d watcher, systemd watchdog, metrics endpoint, ...). A bare
``asyncio.create_task`` loses an exception until the task is garbage collected and
never restarts anything, so one bug in a side job would silently switch a feature
off on every node. Like kopf's guarded tasks, each job here runs inside a guard
that logs a crash, restarts the job after an exponential back-off, and is stopped
in a known order on shutdown (reverse of start, so later jobs that depend on
earlier ones go first).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
from structlog.typing import FilteringBoundLogger

TaskFactory = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class TaskStatus:
    """Snapshot of one supervised task.

    ``running`` is True while the task's own coroutine is executing; it is False
    while the guard waits out a back-off and after the supervisor stopped.
    """

    name: str
    running: bool
    restarts: int
    last_error: str | None


class _Backoff:
    """Exponential back-off that forgets earlier failures after a long healthy run."""

    def __init__(self, initial: float, maximum: float) -> None:
        self._initial = initial
        self._max = maximum
        self._next = initial

    def delay_after(self, run_seconds: float) -> float:
        # A run longer than the cap means the job was healthy for a while; the
        # next failure is a fresh incident, not part of a crash loop.
        if run_seconds > self._max:
            self._next = self._initial
        delay = self._next
        # Doubling the previous value instead of computing initial*2**n avoids
        # float overflow for a job that has been crash-looping for days.
        self._next = min(self._next * 2, self._max)
        return delay


class _Entry:
    """Mutable per-task bookkeeping; only the guard and the supervisor touch it."""

    def __init__(self, name: str, factory: TaskFactory, backoff: _Backoff) -> None:
        self.name = name
        self.factory = factory
        self.backoff = backoff
        self.task: asyncio.Task[None] | None = None
        self.running = False
        self.restarts = 0
        self.last_error: str | None = None

    def status(self) -> TaskStatus:
        return TaskStatus(self.name, self.running, self.restarts, self.last_error)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _cancel_requested() -> bool:
    """True when our own task is being cancelled (as opposed to a stray
    CancelledError escaping from something the job awaited)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Supervisor:
    """Runs named background jobs, restarting them when they crash or return."""

    def __init__(
        self,
        *,
        backoff_initial: float = 1.0,
        backoff_max: float = 60.0,
        logger: FilteringBoundLogger | None = None,
    ) -> None:
        if backoff_initial <= 0 or backoff_max < backoff_initial:
            raise ValueError("need 0 < backoff_initial <= backoff_max")
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        # A lazy proxy (not .bind()) so a later logsetup.configure() still applies.
        self._log: FilteringBoundLogger = (
            logger
            if logger is not None
            else structlog.get_logger(component="supervisor")
        )
        self._entries: dict[str, _Entry] = {}
        self._started = False
        self._stopping = False
        self._stopped: asyncio.Event | None = None

    def add(self, name: str, factory: TaskFactory) -> None:
        """Register a job; ``factory`` must return a fresh awaitable per call.

        After ``start()`` the job starts immediately, so this must then be called
        from the loop's thread.
        """
        if name in self._entries:
            raise ValueError(f"task {name!r} is already supervised")
        if self._stopping:
            raise RuntimeError("supervisor is stopped")
        entry = _Entry(
            name, factory, _Backoff(self._backoff_initial, self._backoff_max)
        )
        self._entries[name] = entry
        if self._started:
            self._launch(entry)

    async def start(self) -> None:
        """Start every registered job; calling it again is a no-op."""
        if self._started or self._stopping:
            return
        self._started = True
        for entry in self._entries.values():
            self._launch(entry)

    async def stop(self, timeout: float = 10.0) -> None:
        """Cancel jobs in reverse order of ``add()``, sharing one overall timeout.

        A job that ignores cancellation is logged and abandoned once the timeout
        is used up, so shutdown (and systemd's stop job) cannot hang on it.
        Concurrent and repeated calls wait for the first one to finish.
        """
        if self._stopped is not None:
            await self._stopped.wait()
            return
        self._stopped = asyncio.Event()
        self._stopping = True
        try:
            await self._stop_all(timeout)
        finally:
            self._stopped.set()

    def status(self) -> list[TaskStatus]:
        """Snapshot of every job, in order of ``add()``."""
        return [entry.status() for entry in self._entries.values()]

    def _launch(self, entry: _Entry) -> None:
        entry.task = asyncio.create_task(self._guard(entry), name=entry.name)
        entry.task.add_done_callback(self._guard_finished)

    async def _stop_all(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        me = asyncio.current_task()
        for entry in reversed(list(self._entries.values())):
            task = entry.task
            # Skipping our own task lets a supervised job trigger shutdown itself.
            if task is None or task.done() or task is me:
                continue
            task.cancel()
            remaining = max(0.0, deadline - loop.time())
            done, _ = await asyncio.wait({task}, timeout=remaining)
            if not done:
                self._log.error("task_abandoned", task=entry.name, timeout=timeout)

    def _stop_requested(self) -> bool:
        # A method, not the attribute, because stop() flips it while _guard awaits.
        return self._stopping

    async def _guard(self, entry: _Entry) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            started = loop.time()
            error = await self._run_once(entry)
            # A job that swallowed our cancel and finished later must not restart.
            if self._stop_requested():
                return
            delay = entry.backoff.delay_after(loop.time() - started)
            self._report(entry, error, delay)
            await asyncio.sleep(delay)
            entry.restarts += 1

    async def _run_once(self, entry: _Entry) -> BaseException | None:
        """Run the job once; return what it raised (None if it returned)."""
        entry.running = True
        try:
            await entry.factory()
        except asyncio.CancelledError as exc:
            if _cancel_requested():
                raise
            return exc
        except Exception as exc:  # noqa: BLE001 - a job's crash must never escape
            return exc
        finally:
            entry.running = False
        return None

    def _report(self, entry: _Entry, error: BaseException | None, delay: float) -> None:
        if error is None:
            self._log.warning(
                "task_exited",
                task=entry.name,
                restarts=entry.restarts,
                next_delay=delay,
            )
            return
        entry.last_error = _describe(error)
        self._log.error(
            "task_crashed",
            task=entry.name,
            error=entry.last_error,
            restarts=entry.restarts,
            next_delay=delay,
            exc_info=error,
        )

    def _guard_finished(self, task: asyncio.Task[None]) -> None:
        # Retrieving the exception here keeps asyncio from printing "exception
        # was never retrieved" and makes a bug in the guard itself visible.
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._log.critical(
                "supervisor_guard_failed", task=task.get_name(), exc_info=exc
            )
