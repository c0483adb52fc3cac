"""The besteffort tier's CFS quota above its children's own (cgroup v1).

A parent's ``cpu.cfs_quota_us`` cannot go below a child's (compared as quota/period;
the kernel answers EINVAL), and BE pods may carry quotas of their own (batch-cpu
limits, a kubelet limit, a runtime's pause cgroup). So a tier quota is written in one
leveled write with every child above it clamped to the tier's ratio first (deepest
first), remembering their originals; when the tier grows back, or is recovered, the
originals are restored, tier first. A child someone else changed since (batch-
resource's reconcile, kubelet) is not restored over: its new value is its own. On v2
the kernel takes the minimum of parent and child itself: nothing is read or clamped.

What is remembered is dropped only on the host's word (level-triggered): a read that
finds the child gone, back at its original, or at a value none of our writes put
there. Planning a write proves nothing (it may fail, back off, or lose to another
plan), and neither does a pod missing from one round's pod list: before, either made
the original forgotten while the file kept the clamp, and a container stayed at the
floor's ratio after suppression was switched off.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Final

from hooks.cgroups import CPU_CFS_PERIOD, CPU_CFS_QUOTA, CgroupError
from hooks.executor import CgroupExecutor
from metrics.model import PodView
from metrics.qos.plan import LeveledWrite, SetCgroup


@dataclass(frozen=True, slots=True)
class ChildQuota:
    """The CFS quota of a cgroup under the tier: a pod (``depth`` 0), a container or the
    sandbox's pause cgroup (1), deeper (2); ``pod_uid`` "" when no known pod owns it."""

    cgroup: PurePosixPath
    quota: int  # -1: none
    period: int
    pod_uid: str
    depth: int


@dataclass(frozen=True, slots=True)
class _Clamp:
    original: int
    #: The values the file may hold because of us: the one a read last found (ours) and
    #: the ones planned since (a write may not have happened). At most ``OURS_KEPT``.
    ours: tuple[int, ...]
    pod_uid: str
    depth: int
    #: The original was planned back; the entry goes when a read finds it in place.
    restoring: bool = False


#: The v1 file names (this module is v1 only: see the module doc).
CPU_CFS_QUOTA_FILE: Final = CPU_CFS_QUOTA.file(1)[1]
CPU_CFS_PERIOD_FILE: Final = CPU_CFS_PERIOD.file(1)[1]
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def _read_at(dir_fd: int, name: str) -> int | None:
    """One int file of an open cgroup directory (None: unreadable or not an int)."""
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        text = os.read(fd, 64).split()
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return int(text[0]) if text else None
    except ValueError:
        return None


def _child_quota(dir_fd: int, default_period: int) -> tuple[int, int] | None:
    """(quota, period) of one cgroup; None when unreadable (gone, not created yet)."""
    quota = _read_at(dir_fd, CPU_CFS_QUOTA_FILE)
    if quota is None:
        return None
    if quota <= 0:
        return quota, default_period  # unlimited: its period does not matter
    period = _read_at(dir_fd, CPU_CFS_PERIOD_FILE)
    return quota, period if period is not None and period > 0 else default_period


#: How deep under the tier quotas are looked for: pods, their containers (and the
#: sandbox's pause cgroup), and one level more for runtimes that nest.
CHILD_DEPTH: Final = 3


def _subdirs(dir_fd: int) -> list[str]:
    try:
        with os.scandir(dir_fd) as entries:
            return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
    except OSError:
        return []  # gone meanwhile: nothing under it to respect


def _norm(cgroup_dir: str) -> str:
    return cgroup_dir if "//" not in cgroup_dir and not cgroup_dir.endswith("/") else str(PurePosixPath(cgroup_dir))


def read_children(executor: CgroupExecutor, tier: PurePosixPath, default_period: int,
                  pods: Sequence[PodView]) -> tuple[ChildQuota, ...]:
    """The quotas of every cgroup under the tier (v1 only: see the module doc), found on the
    filesystem rather than from the pod views: the kernel's rule is about the hierarchy,
    so a container created since the views were built, a sandbox's pause cgroup or a pod
    the proxy does not know counts too. ``pods`` only name the owners, for arbitration.

    The tier is confined once; below it every directory and file is opened relative to its
    parent's descriptor with ``O_NOFOLLOW``, so nothing outside the tier can be reached and
    no path is resolved per child (that resolution was most of a round's CPU at 110 pods)."""
    if executor.layout.version != 1:
        return ()
    try:
        top = os.open(executor.path(tier, CPU_CFS_QUOTA).parent, _DIR_FLAGS)
    except (CgroupError, OSError):
        return ()  # gone meanwhile: nothing under it to respect
    owners = {_norm(p.cgroup_dir): p.uid for p in pods}
    owners |= {_norm(c.cgroup_dir): p.uid for p in pods for c in p.containers}
    out: list[ChildQuota] = []
    base = str(tier)
    try:
        level = [(f"{base}/{name}", name, top, name) for name in _subdirs(top)]
        for depth in range(CHILD_DEPTH):
            below: list[tuple[str, str, int, str]] = []
            for path, name, parent_fd, pod_dir in level:
                try:
                    fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
                except OSError:
                    continue
                keep = False
                try:
                    read = _child_quota(fd, default_period)
                    if read is None:
                        continue
                    uid = owners.get(path) or owners.get(f"{base}/{pod_dir}", "")
                    out.append(ChildQuota(PurePosixPath(path), read[0], read[1], uid, depth))
                    if depth + 1 < CHILD_DEPTH:
                        names = _subdirs(fd)
                        below.extend((f"{path}/{n}", n, fd, pod_dir) for n in names)
                        keep = bool(names)
                finally:
                    if not keep:
                        os.close(fd)
            for fd in {parent for _, _, parent, _ in level if parent != top}:
                os.close(fd)
            level = below
        for fd in {parent for _, _, parent, _ in level if parent != top}:
            os.close(fd)
    finally:
        os.close(top)
    return tuple(out)


#: How many of our values a child's entry keeps: a planned write that did not land
#: leaves the one before it in the file, and two strategies (cpu-suppress, interference)
#: may each plan one in a round. Bounded, so a child clamped for hours keeps a few.
OURS_KEPT: Final = 4


class ChildClamps:
    """The children clamped below their own quota, and the writes a tier quota needs.

    One per tier, shared by every strategy that writes the tier's quota (``StrategyInit.
    tier_clamps``): an original is one fact, and a strategy with its own memory would take
    another's clamp for the child's own value."""

    def __init__(self) -> None:
        #: cgroup -> its original quota and the values we clamped it to.
        self._originals: dict[PurePosixPath, _Clamp] = {}

    @property
    def clamped(self) -> dict[str, int]:
        """Children clamped now: cgroup -> original quota (for explain and tests)."""
        return {str(cg): c.original for cg, c in self._originals.items() if not c.restoring}

    @property
    def remembered(self) -> bool:
        """Whether a child is clamped or its restore is not yet confirmed by a read."""
        return bool(self._originals)

    def owners_gone(self, live: set[str]) -> bool:
        """Whether a remembered child belongs to a pod not in ``live``: its cgroup may be
        gone, which only a read of the children can tell (a pod missing from one list is
        not proof: the fast path leaves out pods it has no counter for this tick)."""
        return any(c.pod_uid and c.pod_uid not in live for c in self._originals.values())

    def write(self, tier: SetCgroup, children: Sequence[ChildQuota] | None, tier_period: int
              ) -> SetCgroup | LeveledWrite:
        """``tier`` (a quota on the tier) with the children's writes it needs; a plain
        write when none does. ``children`` None: their values are unknown (the manager
        stopping), so every remembered original is restored when the tier is lifted and
        forgotten (nobody reads them after)."""
        quota = int(tier.value)
        if children is None:
            if quota > 0:
                return tier
            restore = [(SetCgroup(cg, CPU_CFS_QUOTA, c.original, f"{tier.reason}: child quota {c.original} restored",
                                  c.pod_uid), c.depth) for cg, c in sorted(self._originals.items())]
            self._originals.clear()
            return self._levels(tier, restore)
        items: list[tuple[SetCgroup, int]] = []
        present: set[PurePosixPath] = set()
        for child in children:
            present.add(child.cgroup)
            item = self._child(child, quota, tier_period, tier.reason)
            if item is not None:
                items.append((item, child.depth))
        for gone in set(self._originals) - present:
            del self._originals[gone]
        return self._levels(tier, items)

    def _child(self, child: ChildQuota, tier_quota: int, tier_period: int, reason: str) -> SetCgroup | None:
        """The write one child needs under a tier quota of ``tier_quota``, if any."""
        remembered = self._originals.pop(child.cgroup, None)
        if remembered is not None and child.quota not in remembered.ours:
            remembered = None  # back at its original, or someone else's value now: its own
        original = remembered.original if remembered is not None else child.quota
        # The kernel compares quota/period: the child may have at most the tier's ratio.
        limit = tier_quota * child.period // tier_period if tier_quota > 0 else None
        # Ours: the value read, when it is one of ours, and the one planned now; never the original.
        before = (*remembered.ours, child.quota) if remembered is not None else ()
        if limit is not None and original > limit:
            target, why = limit, f"{reason}: child quota {original} clamped to the tier's"
            self._originals[child.cgroup] = _Clamp(original, _ours(before, limit), child.pod_uid, child.depth)
        else:
            target, why = original, f"{reason}: child quota {original} restored"
            if remembered is not None:  # kept until a read finds the original in place
                self._originals[child.cgroup] = _Clamp(original, _ours(before), child.pod_uid, child.depth,
                                                       restoring=True)
        if target == child.quota:
            return None
        return SetCgroup(child.cgroup, CPU_CFS_QUOTA, target, why, child.pod_uid)

    @staticmethod
    def _levels(tier: SetCgroup, items: Sequence[tuple[SetCgroup, int]]) -> SetCgroup | LeveledWrite:
        """The tier, then its children level by level (parents before children)."""
        if not items:
            return tier
        depths = sorted({depth for _, depth in items})
        levels = [tuple(i for i, d in items if d == depth) for depth in depths]
        return LeveledWrite(((tier,), *levels), tier.reason)


def _ours(before: tuple[int, ...], *new: int) -> tuple[int, ...]:
    """The newest ``OURS_KEPT`` of our values (``before`` then ``new``), oldest first,
    each once (where it came last)."""
    values = (*before, *new)
    merged = [v for i, v in enumerate(values) if v not in values[i + 1:]]
    return tuple(merged[-OURS_KEPT:])
