"""Typed plans and the arbitration between them.

Koordlet runs each strategy on its own timer and lets them write the same files
(reference §4: "no cross-strategy arbitration"). Here every strategy only
*plans*: it returns a ``Plan`` — a list of actions plus the inputs that led to
them — and ``arbitrate`` decides, in one place, what is done in a round:

* an **evicted pod** gets nothing else: every other action on it is dropped
  (writing the cgroup of a pod being killed only races its teardown);
* **one writer per file per round**: two actions on the same cgroup file with
  different values are a conflict, won by the plan of higher priority
  (``EVICTION > SUPPRESS > BURST > RESCTRL``: releasing resources beats
  limiting them, limiting BE beats lending LS pods more, cache partitioning
  changes nothing urgent); equal priorities are broken by strategy name. The
  priority is part of each strategy's declaration (``Strategy.priority``, an
  int: ``Priority`` names the built-in levels, a new strategy picks its own
  number between them) and the manager stamps it on every plan of the strategy;
* the same value planned twice is done once (the later copy is reported as a
  duplicate, not as a conflict).

The result depends only on the plans (sorted, never on dict or set order), so a
round can be replayed from its explain output.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import PurePosixPath
from typing import Any

from hooks.cgroups import Resource, Value


class Priority(enum.IntEnum):
    """The built-in levels (any int is a valid priority; higher wins)."""

    #: Host-wide sysctls (``system-config``): never on a cgroup file, so no conflict
    #: with the others in practice; below every cgroup writer.
    SYSTEM = 5
    RESCTRL = 10
    BURST = 20
    SUPPRESS = 30
    EVICTION = 40


def priority_name(priority: int) -> str:
    """``Priority`` member name in lower case, else the number (for explain)."""
    try:
        return Priority(priority).name.lower()
    except ValueError:
        return str(priority)


@dataclass(frozen=True, slots=True)
class SetCgroup:
    """``resource`` = ``value`` in ``cgroup`` (relative to the hierarchy root)."""

    cgroup: PurePosixPath
    resource: Resource
    value: Value
    reason: str
    #: The pod this cgroup belongs to ("" for node-level dirs like kubepods/besteffort).
    pod_uid: str = ""

    @property
    def target(self) -> str:
        return f"{self.cgroup}:{self.resource.name}"

    def describe(self) -> dict[str, Any]:
        return {"kind": "set", "target": self.target, "value": self.value, "reason": self.reason, "pod": self.pod_uid}


@dataclass(frozen=True, slots=True)
class LeveledWrite:
    """Writes over a hierarchy, top level first (e.g. besteffort, pods, containers):
    parents are widened top-down before children are narrowed bottom-up."""

    levels: tuple[tuple[SetCgroup, ...], ...]
    reason: str

    def items(self) -> tuple[SetCgroup, ...]:
        return tuple(item for level in self.levels for item in level)

    def without(self, dropped: Iterable[SetCgroup]) -> LeveledWrite:
        gone = set(dropped)
        return replace(self, levels=tuple(tuple(i for i in level if i not in gone) for level in self.levels))

    def describe(self) -> dict[str, Any]:
        return {"kind": "leveled", "reason": self.reason, "levels": [[i.describe() for i in lv] for lv in self.levels]}


@dataclass(frozen=True, slots=True)
class Evict:
    """Kill a pod; ``released_*`` is what the planner counted on getting back."""

    pod_uid: str
    pod_key: str
    reason: str
    released_cpu: float = 0.0  # cores
    released_memory: float = 0.0  # bytes

    def describe(self) -> dict[str, Any]:
        return {"kind": "evict", "pod": self.pod_uid, "name": self.pod_key, "reason": self.reason,
                "released_cpu": self.released_cpu, "released_memory": self.released_memory}


@dataclass(frozen=True, slots=True)
class SetSchemata:
    """The ``schemata`` of a resctrl group (created if missing)."""

    group: str
    text: str
    reason: str

    @property
    def target(self) -> str:
        return f"resctrl:{self.group}/schemata"

    def describe(self) -> dict[str, Any]:
        return {"kind": "schemata", "target": self.target, "value": self.text.strip(), "reason": self.reason}


@dataclass(frozen=True, slots=True)
class AddTasks:
    """Move pids into a resctrl group (appends: several writers do not conflict)."""

    group: str
    pids: tuple[int, ...]
    reason: str
    pod_uids: tuple[str, ...] = ()

    def describe(self) -> dict[str, Any]:
        return {"kind": "tasks", "target": f"resctrl:{self.group}/tasks", "pids": list(self.pids),
                "reason": self.reason, "pods": list(self.pod_uids)}


@dataclass(frozen=True, slots=True)
class SetFile:
    """``value`` into a host file outside cgroupfs (a sysctl under ``/proc/sys``, a
    ``/sys/kernel/mm`` knob). ``root`` names the injected host root the strategy
    writes under, ``path`` is relative to it; the owning strategy carries it out
    (``Strategy.apply``), confined to that root."""

    root: str
    path: str
    value: str
    reason: str

    @property
    def target(self) -> str:
        return f"{self.root}:{self.path}"

    def describe(self) -> dict[str, Any]:
        return {"kind": "file", "target": self.target, "value": self.value, "reason": self.reason}


Action = SetCgroup | LeveledWrite | Evict | SetSchemata | AddTasks | SetFile


@dataclass(frozen=True, slots=True)
class Plan:
    """What one strategy wants this round, and why."""

    strategy: str
    priority: int
    actions: tuple[Action, ...] = ()
    #: The numbers the decision was made from (JSON-able), for explain and the debug log.
    inputs: Mapping[str, Any] = field(default_factory=dict)
    #: Why the plan is what it is (notably why it is empty: "stale metric ...").
    reason: str = ""

    def describe(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "priority": priority_name(self.priority), "reason": self.reason,
                "inputs": dict(self.inputs), "actions": [a.describe() for a in self.actions]}


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of one action."""

    action: Action
    result: str  # written | unchanged | dry-run | failed: ... | gone | evicted

    def describe(self) -> dict[str, Any]:
        return {**self.action.describe(), "result": self.result}


@dataclass(frozen=True, slots=True)
class Rejected:
    """An action arbitration dropped, and why (``winner`` = the strategy that prevailed)."""

    strategy: str
    action: Action
    reason: str
    winner: str = ""

    def describe(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "action": self.action.describe(), "reason": self.reason,
                "winner": self.winner}


def _order(plans: Sequence[Plan]) -> list[Plan]:
    return sorted(plans, key=lambda p: (-int(p.priority), p.strategy))


def _evicted(plans: Sequence[Plan]) -> dict[str, str]:
    """Pod uid -> the strategy evicting it (the first in arbitration order)."""
    out: dict[str, str] = {}
    for plan in plans:
        for action in plan.actions:
            if isinstance(action, Evict):
                out.setdefault(action.pod_uid, plan.strategy)
    return out


class _Arbiter:
    def __init__(self, evicted: Mapping[str, str]) -> None:
        self.evicted = evicted
        self.owners: dict[str, tuple[str, object]] = {}  # target -> (strategy, value)
        self.evictions: set[str] = set()
        self.rejected: list[Rejected] = []

    def _claim(self, strategy: str, target: str, value: object, action: Action) -> bool:
        owner = self.owners.get(target)
        if owner is None:
            self.owners[target] = (strategy, value)
            return True
        if owner[1] == value:
            self.rejected.append(Rejected(strategy, action, f"duplicate: {target} already set to the same value",
                                          owner[0]))
        else:
            self.rejected.append(Rejected(strategy, action, f"conflict on {target}: {owner[0]} writes {owner[1]!r}",
                                          owner[0]))
        return False

    def _holder(self, item: SetCgroup) -> str | None:
        """The strategy already writing ``item``'s target with another value, if any."""
        owner = self.owners.get(item.target)
        return owner[0] if owner is not None and owner[1] != item.value else None

    def _set(self, strategy: str, action: SetCgroup) -> bool:
        uid = action.pod_uid
        if uid and uid in self.evicted:
            self.rejected.append(Rejected(strategy, action, "pod is being evicted", self.evicted[uid]))
            return False
        return self._claim(strategy, action.target, action.value, action)

    def admit(self, strategy: str, action: Action) -> Action | None:
        if isinstance(action, SetCgroup):  # most of a round's actions: tested first (the kinds are disjoint)
            return action if self._set(strategy, action) else None
        if isinstance(action, Evict):
            if action.pod_uid in self.evictions:
                self.rejected.append(Rejected(strategy, action, "duplicate: pod already evicted this round",
                                              self.evicted[action.pod_uid]))
                return None
            self.evictions.add(action.pod_uid)
            return action
        if isinstance(action, LeveledWrite):
            # The levels below depend on the top: a child quota restored or a cpuset
            # written under a tier that another strategy holds at another value is
            # refused by the kernel (EINVAL) or runs against that strategy's limit.
            winner = next((w for w in map(self._holder, action.levels[0] if action.levels else ()) if w), None)
            if winner is not None:
                self.rejected.append(Rejected(strategy, action, f"its top level is written by {winner} "
                                              "with another value", winner))
                return None
            dropped = [item for level in action.levels for item in level if not self._set(strategy, item)]
            kept = action.without(dropped) if dropped else action
            return kept if any(kept.levels) else None  # any item left (no tuple of them built)
        if isinstance(action, SetSchemata):
            return action if self._claim(strategy, action.target, action.text, action) else None
        if isinstance(action, SetFile):
            return action if self._claim(strategy, action.target, action.value, action) else None
        # AddTasks appends: only the evicted pods' pids would be wrong, and those
        # exit anyway; keep the action unless every pod in it is being evicted.
        if action.pod_uids and all(uid in self.evicted for uid in action.pod_uids):
            self.rejected.append(Rejected(strategy, action, "pod is being evicted", self.evicted[action.pod_uids[0]]))
            return None
        return action


def arbitrate(plans: Sequence[Plan]) -> tuple[list[Plan], list[Rejected]]:
    """The plans with only the actions to carry out (highest priority first), and
    the dropped actions with their reasons. Deterministic for a given input."""
    ordered = _order(plans)
    arbiter = _Arbiter(_evicted(ordered))
    applied: list[Plan] = []
    for plan in ordered:
        kept: list[Action] = []
        whole = True  # every action admitted as it is: the plan itself is what is applied
        for action in plan.actions:
            admitted = arbiter.admit(plan.strategy, action)
            if admitted is not action:
                whole = False
            if admitted is not None:
                kept.append(admitted)
        applied.append(plan if whole else replace(plan, actions=tuple(kept)))
    return applied, arbiter.rejected
