"""The process's shared services: made once by the app at start, handed to every hook
and task through its init object (``HookInit.services``, ``TaskInit.services``).

Nothing here is a module global: two apps (or two tests) in one process each have their
own ``NodeServices`` and share nothing unless handed the same object.

* ``FailureCounter`` — refused host writes by cause (errno name); the app exposes its
  one as ``koord_runtime_proxy_host_write_failures_total{cause}``.
* ``WriteBackoff`` — per file, a write the kernel refuses is retried with the same
  value only after an exponential back-off (1 s doubling to 5 min; another value after
  1 s, so a changed desired state is not held up), and logged once per (path, cause):
  ``host_write_failed`` at warning, then at most one ``host_write_still_failing``
  reminder per 5 min with ``repeats=N``; success logs ``host_write_recovered`` and
  clears the state. Every executor built from one ``NodeServices`` (hooks, the
  reconciler's passes through them, the QoS manager and its fast path) shares it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger("runtimeproxy.services")


class FailureCounter:
    """Thread-safe counts of refused host writes, by cause."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def inc(self, cause: str) -> None:
        with self._lock:
            self._counts[cause] = self._counts.get(cause, 0) + 1

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


@dataclass(slots=True)
class _Failing:
    cause: str
    value: str
    failures: int  # consecutive refused writes since the last success
    delay: float
    next_try: float
    warned_at: float
    tried_at: float
    unreported: int = 0  # refused writes since the last log line
    skipped: int = 0  # attempts not made (backed off) since the last log line


class WriteBackoff:
    """Per file: back off a write that keeps failing, warn once per cause.

    Knows files, values and causes, not the writer's errors: the executor turns
    ``before``'s answer into its own error and marks repeats (``failed`` returns True).
    Thread-safe (sync hooks write from worker threads). Bounded: at most
    ``max_entries`` failing files are remembered (the oldest is forgotten)."""

    def __init__(
        self,
        *,
        counter: FailureCounter,
        clock: Callable[[], float] = time.monotonic,
        first: float = 1.0,
        cap: float = 300.0,
        reminder: float = 300.0,
        max_entries: int = 4096,
    ) -> None:
        self._clock = clock
        self._first, self._cap, self._reminder = first, cap, reminder
        self._max_entries = max_entries
        self._counter = counter
        self._lock = threading.Lock()
        self._failing: dict[Path, _Failing] = {}

    def before(self, path: Path, value: str) -> str | None:
        """Why writing ``value`` to ``path`` must wait (its back-off runs), else None."""
        with self._lock:
            state = self._failing.get(path)
            now = self._clock()
            if state is None:
                return None
            # The same value waits out the whole back-off; another one (a changed desired
            # state, e.g. a tier growing back) only ``first`` seconds after the last try.
            next_try = state.next_try if state.value == value else state.tried_at + self._first
            if now >= next_try:
                return None
            state.skipped += 1
            wait = next_try - now
            return (f"writing {value!r} to {path} backed off: refused {state.failures} time(s) "
                    f"({state.cause}), next try in {wait:.1f}s")

    def failed(self, path: Path, value: str, cause: str, error: str) -> bool:
        """Record a refused write; the first of a cause is logged at warning, repeats are not
        (True is returned: the caller marks its error a repeat) but for a reminder every
        ``reminder`` seconds."""
        self._counter.inc(cause)
        previous: str | None = None
        with self._lock:
            now = self._clock()
            state = self._failing.get(path)
            if state is not None and state.cause == cause:
                state.failures += 1
                state.unreported += 1
                state.delay = min(state.delay * 2, self._cap)
                state.value, state.next_try, state.tried_at = value, now + state.delay, now
                if now - state.warned_at < self._reminder:
                    return True
                repeats, skipped = state.unreported, state.skipped
                state.warned_at, state.unreported, state.skipped = now, 0, 0
                retry = state.delay
            else:
                previous = state.cause if state is not None else None
                self._failing.pop(path, None)
                while len(self._failing) >= self._max_entries:
                    self._failing.pop(next(iter(self._failing)))
                self._failing[path] = _Failing(cause, value, 1, self._first, now + self._first, now, now)
                repeats = skipped = 0
                retry = self._first
        if repeats:
            log.warning("host_write_still_failing", path=str(path), cause=cause, error=error, repeats=repeats,
                        skipped=skipped, retry_in_seconds=retry)
            return True
        log.warning("host_write_failed", path=str(path), cause=cause, error=error, retry_in_seconds=retry,
                    previous_cause=previous)
        return False

    def succeeded(self, path: Path) -> None:
        """A write to ``path`` went through: forget its failures."""
        if path not in self._failing:  # the common case, without the lock
            return
        with self._lock:
            state = self._failing.pop(path, None)
        if state is not None:
            log.info("host_write_recovered", path=str(path), cause=state.cause, failures=state.failures)

    def failing(self) -> dict[str, dict[str, object]]:
        """The files whose last write failed: for explain and tests."""
        with self._lock:
            return {str(p): {"cause": s.cause, "value": s.value, "failures": s.failures,
                             "retry_in_seconds": max(0.0, round(s.next_try - self._clock(), 3))}
                    for p, s in self._failing.items()}


@dataclass(frozen=True, slots=True)
class NodeServices:
    """The services one process shares across its hooks and tasks, built once by the
    app (``NodeServices.create()``) and passed in; a test builds its own (with a fake
    clock: ``create(clock=...)``). Not a locator: each service is a named, typed field."""

    #: Refused host writes by cause, for ``/metrics``.
    write_failures: FailureCounter
    #: The host-write back-off every executor built from these services shares (it
    #: counts into ``write_failures``).
    write_backoff: WriteBackoff

    @classmethod
    def create(cls, *, clock: Callable[[], float] = time.monotonic) -> NodeServices:
        failures = FailureCounter()
        return cls(write_failures=failures, write_backoff=WriteBackoff(counter=failures, clock=clock))
