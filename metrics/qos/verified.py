"""Cgroup writes the manager found in place, not checked again for a while.

Every round the strategies plan the same values (burst per container, the BE cpuset
recovery over every BE pod...), and the executor confines, reads and compares each
file to find it unchanged: ~200 files a round at 110 pods, most of a round's CPU.
Like koordlet's executor cache (``cgroup-force-update-seconds``, 60 s), a write (or
a no-op check) of a cgroup action is remembered with its values; the same action
asked again within ``seconds`` is reported ``unchanged`` without touching the files.
After that, or as soon as the plan asks for another value, the file is checked and
written again: a value changed behind our back is put back within ``seconds``. A
failed or vanished target is forgotten at once. Only ``SetCgroup`` / ``LeveledWrite``
are remembered (a strategy's own actions, resctrl, evictions: never).

Bounded: an entry not asked for within ``seconds`` is dropped (``prune``), and the
entries of a pod go when it leaves the pod list (``keep_pods``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Final

from hooks.cgroups import CPUSET_CPUS, Value
from metrics.qos.plan import Action, LeveledWrite, SetCgroup

#: Resources whose writes are remembered (by name).
REMEMBERED: Final = frozenset({CPUSET_CPUS.name, "cpu.cfs_burst_us"})
_Target = tuple[PurePosixPath, str]
#: Leveled writes remembered as wholly fresh (``VerifiedWrites._whole``).
_WHOLE_MAX: Final = 8


def _items(action: Action) -> tuple[SetCgroup, ...] | None:
    if isinstance(action, SetCgroup):  # most of a round's actions (burst knobs): no generator for one item
        return (action,) if action.resource.name in REMEMBERED else None
    items = action.items() if isinstance(action, LeveledWrite) else ()
    if not items or any(i.resource.name not in REMEMBERED for i in items):
        return None
    return items


class VerifiedWrites:
    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self._clock = clock
        #: Target -> the value last found in place there (written or unchanged), when, and
        #: the pod it belongs to ("" for a tier).
        self._at: dict[_Target, tuple[Value, float, str]] = {}
        #: Leveled writes found fresh since ``_at`` last changed: id -> (the write, its
        #: oldest item's time). The same (frozen) write asked again while no entry changed
        #: is fresh until that time runs out: the suppress recovery cpuset, one write over
        #: every BE cgroup, was ~110 lookups a round. Cleared on every change to ``_at``.
        self._whole: dict[int, tuple[LeveledWrite, float]] = {}
        self._pruned = clock()

    def __len__(self) -> int:
        return len(self._at)

    def fresh(self, action: Action) -> bool:
        """True: the same action was carried out less than ``seconds`` ago."""
        if self.seconds <= 0:
            return False
        now = self._clock()
        if now - self._pruned >= self.seconds:
            self.prune(now)
        if isinstance(action, LeveledWrite):
            seen = self._whole.get(id(action))
            if seen is not None and seen[0] is action:  # the object is kept: its id is not reused
                return now - seen[1] < self.seconds
        items = _items(action)
        if items is None:
            return False
        at = self._at
        oldest = math.inf
        for item in items:
            found = at.get((item.cgroup, item.resource.name))
            if found is None or found[0] != item.value or now - found[1] >= self.seconds:
                return False
            oldest = min(oldest, found[1])
        if isinstance(action, LeveledWrite):
            if len(self._whole) >= _WHOLE_MAX:  # a few such writes a round: bounded all the same
                self._whole.clear()
            self._whole[id(action)] = (action, oldest)
        return True

    def done(self, action: Action) -> None:
        items = _items(action)
        if items is None or self.seconds <= 0:
            return
        now = self._clock()
        self._whole.clear()
        for item in items:
            self._at[(item.cgroup, item.resource.name)] = (item.value, now, item.pod_uid)

    def forget(self, action: Action) -> None:
        """Every target the action touches (a failed leveled write may have left any)."""
        items = action.items() if isinstance(action, LeveledWrite) else ()
        if isinstance(action, SetCgroup):
            items = (action,)
        self._whole.clear()
        for item in items:
            self._at.pop((item.cgroup, item.resource.name), None)

    def clear(self) -> None:
        self._whole.clear()
        self._at.clear()

    def keep_pods(self, live: set[str]) -> None:
        """Forget the targets of pods that are gone (called when the pod list changes)."""
        self._whole.clear()
        self._at = {k: v for k, v in self._at.items() if not v[2] or v[2] in live}

    def prune(self, now: float) -> None:
        self._pruned = now
        self._whole.clear()
        self._at = {k: v for k, v in self._at.items() if now - v[1] < self.seconds}
