"""One log line per failure, not one per retry.

A bad pod (an annotation no hook can parse, a process that refuses a write) fails the
same way at every reconcile pass: logged each time it would flood the log (issue 27:
six pods, 360 warnings in 3.5 min). ``RepeatFilter`` remembers the cause last logged
per object: the first failure is logged, a repeat of the same cause only counted, a
different cause logged again (with how many repeats the previous one had), and the
object's recovery logged once (``cleared``). The caller keeps counting every failure
in its metric, so the counter still shows the rate.

Bounded: the objects least recently failed are forgotten first (a forgotten one
that fails again is logged again, which is the safe side). Thread-safe: sync hooks
run in worker threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Final

#: Objects remembered at most (a node runs a few hundred pods, each a few containers).
MAX_OBJECTS: Final = 4096


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do with one failure: ``log`` it (first time or a new cause) or only count it;
    ``repeats``: how often the cause it replaces repeated unlogged (0 for a first failure)."""

    log: bool
    repeats: int


@dataclass(slots=True)
class _Entry:
    cause: str
    repeats: int = 0


class RepeatFilter:
    def __init__(self, max_objects: int = MAX_OBJECTS) -> None:
        self._max = max_objects
        self._lock = threading.Lock()
        self._seen: OrderedDict[Hashable, _Entry] = OrderedDict()  # object -> the cause last logged

    def failed(self, obj: Hashable, cause: str) -> Verdict:
        with self._lock:
            entry = self._seen.get(obj)
            if entry is not None:
                self._seen.move_to_end(obj)
                if entry.cause == cause:
                    entry.repeats += 1
                    return Verdict(log=False, repeats=entry.repeats)
            self._seen[obj] = _Entry(cause)
            while len(self._seen) > self._max:
                self._seen.popitem(last=False)
            return Verdict(log=True, repeats=entry.repeats if entry is not None else 0)

    def cleared(self, obj: Hashable) -> int | None:
        """``obj`` succeeded: None if it was not failing, else its last cause's repeats
        (log the recovery once)."""
        with self._lock:
            entry = self._seen.pop(obj, None)
            return None if entry is None else entry.repeats

    def forget(self, keep: Callable[[Hashable], bool]) -> list[Hashable]:
        """Drop the objects ``keep`` refuses (e.g. of pods that no longer exist); returns them."""
        with self._lock:
            gone = [obj for obj in self._seen if not keep(obj)]
            for obj in gone:
                del self._seen[obj]
            return gone

    def failing(self) -> int:
        """How many objects are failing now (read without the lock: a len() is atomic)."""
        return len(self._seen)
