"""Issue 29: what a round derives from the pod list alone is kept while the list is the
same tuple and derived again from a new one; a leveled write found wholly in place is
fresh only as long as each of its items is."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePosixPath

from hooks.cgroups import CPUSET_CPUS
from hooks.qos import QoSClass
from metrics.model import PodView
from metrics.qos.memoryqos import PodMemory, sums_and_counts, sums_with_empty, tier_dirs
from metrics.qos.plan import LeveledWrite, SetCgroup
from metrics.qos.podmemo import PodListMemo
from metrics.qos.verified import VerifiedWrites

TIER, POD = PurePosixPath("kubepods/besteffort"), PurePosixPath("kubepods/besteffort/podu1")


def pod(uid: str, kube: str = "burstable") -> PodView:
    return PodView(uid=uid, namespace="ns", name=uid, sandbox_id=uid, qos=QoSClass.LS, priority=0,
                   priority_class="", cgroup_dir=f"kubepods/{kube}/pod{uid}", kube_qos=kube)


def test_a_pod_list_memo_builds_once_per_tuple_and_never_keeps_a_list() -> None:
    built: list[int] = []

    def count(pods: Sequence[PodView]) -> int:
        built.append(len(pods))
        return len(pods)

    memo = PodListMemo(count)
    pods = (pod("a"), pod("b"))
    assert memo(pods) == 2 and memo(pods) == 2 and built == [2]
    assert memo((pod("a"),)) == 1 and built == [2, 1]  # an equal-or-not new tuple: derived again
    listed = [pod("a")]
    memo(listed)
    listed.append(pod("b"))
    assert memo(listed) == 2 and built == [2, 1, 1, 2]  # a list may change in place: never kept


def test_memory_qos_sums_and_counts_are_those_of_every_pods_tiers() -> None:
    pods = (PodMemory("a", "ns/a", PurePosixPath("kubepods/burstable/poda"), "burstable", 10, 20),
            PodMemory("b", "ns/b", PurePosixPath("kubepods/besteffort/podb"), "besteffort", 1, 2),
            PodMemory("g", "ns/g", PurePosixPath("kubepods/podg"), "guaranteed", 100, 200))
    current = {PurePosixPath("kubepods"): (0, 0), PurePosixPath("kubepods/burstable"): None,
               PurePosixPath("kubepods/gone"): (5, 5)}
    sums, counts = sums_and_counts(pods, list(current))
    assert sums == sums_with_empty(pods, list(current))
    assert list(sums) == list(sums_with_empty(pods, list(current)))
    assert counts == {t: sum(1 for p in pods if t in tier_dirs(p)) for t in sums}


def test_a_leveled_write_found_in_place_expires_with_its_oldest_item() -> None:
    clock = [0.0]
    seen = VerifiedWrites(60.0, clock=lambda: clock[0])
    top, child = SetCgroup(TIER, CPUSET_CPUS, "0-7", "r"), SetCgroup(POD, CPUSET_CPUS, "0-7", "r", "u1")
    seen.done(top)
    clock[0] = 30.0
    seen.done(child)
    cpus = LeveledWrite(((top,), (child,)), "r")
    clock[0] = 40.0
    assert seen.fresh(cpus) and seen.fresh(cpus)  # the second time from what the first found
    clock[0] = 60.0
    assert not seen.fresh(cpus)  # the tier's check is 60 s old
    assert seen.fresh(child) and not seen.fresh(top)
