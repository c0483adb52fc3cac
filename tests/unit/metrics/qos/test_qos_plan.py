"""Arbitration: one writer per file, priority order, evicted pods, duplicates, determinism."""

from __future__ import annotations

import itertools
from pathlib import PurePosixPath

from hooks.cgroups import CPU_CFS_QUOTA, CPUSET_CPUS
from metrics.qos.plan import (
    AddTasks,
    Evict,
    LeveledWrite,
    Plan,
    Priority,
    SetCgroup,
    SetSchemata,
    arbitrate,
)

BE = PurePosixPath("kubepods/besteffort")
POD_A = PurePosixPath("kubepods/besteffort/poda")
CTR_A = POD_A / "ca"
POD_B = PurePosixPath("kubepods/besteffort/podb")


def quota(cgroup: PurePosixPath, value: int, pod: str = "") -> SetCgroup:
    return SetCgroup(cgroup, CPU_CFS_QUOTA, value, "test", pod)


def test_conflict_on_one_file_is_won_by_the_higher_priority() -> None:
    burst = Plan("cpu_burst", Priority.BURST, (quota(BE, 50_000),))
    suppress = Plan("cpu_suppress", Priority.SUPPRESS, (quota(BE, 20_000),))
    applied, rejected = arbitrate([burst, suppress])
    by_name = {p.strategy: p for p in applied}
    assert by_name["cpu_suppress"].actions == (quota(BE, 20_000),)
    assert by_name["cpu_burst"].actions == ()
    assert [(r.strategy, r.winner) for r in rejected] == [("cpu_burst", "cpu_suppress")]
    assert "conflict" in rejected[0].reason and "20000" in rejected[0].reason


def test_evicted_pod_gets_no_other_action_but_others_do() -> None:
    leveled = LeveledWrite(((SetCgroup(BE, CPUSET_CPUS, "0-1", "s"),),
                            (SetCgroup(POD_A, CPUSET_CPUS, "0-1", "s", "a"),
                             SetCgroup(POD_B, CPUSET_CPUS, "0-1", "s", "b")),
                            (SetCgroup(CTR_A, CPUSET_CPUS, "0-1", "s", "a"),)), "suppress")
    plans = [
        Plan("cpu_suppress", Priority.SUPPRESS, (leveled,)),
        Plan("be_memory_evict", Priority.EVICTION, (Evict("a", "ns/a", "memory"),)),
        Plan("resctrl", Priority.RESCTRL, (AddTasks("BE", (11,), "t", ("a",)), AddTasks("BE", (12,), "t", ("a", "b")))),
    ]
    applied, rejected = arbitrate(plans)
    assert [p.strategy for p in applied] == ["be_memory_evict", "cpu_suppress", "resctrl"]
    kept = applied[1].actions[0]
    assert isinstance(kept, LeveledWrite)
    assert [[i.cgroup for i in level] for level in kept.levels] == [[BE], [POD_B], []]
    assert applied[2].actions == (AddTasks("BE", (12,), "t", ("a", "b")),)
    assert sorted((r.strategy, r.reason) for r in rejected) == [
        ("cpu_suppress", "pod is being evicted"), ("cpu_suppress", "pod is being evicted"),
        ("resctrl", "pod is being evicted")]
    assert all(r.winner == "be_memory_evict" for r in rejected)


def test_duplicates_are_done_once() -> None:
    plans = [Plan("x", Priority.BURST, (quota(POD_A, 30_000, "a"), SetSchemata("BE", "L3:0=f\n", "r"))),
             Plan("y", Priority.BURST, (quota(POD_A, 30_000, "a"),)),
             Plan("z", Priority.RESCTRL, (SetSchemata("BE", "L3:0=f\n", "r"),)),
             Plan("cpu", Priority.EVICTION, (Evict("b", "ns/b", "cpu"),)),
             Plan("mem", Priority.EVICTION, (Evict("b", "ns/b", "memory"),))]
    applied, rejected = arbitrate(plans)
    counts = {p.strategy: len(p.actions) for p in applied}
    assert counts == {"x": 2, "y": 0, "z": 0, "cpu": 1, "mem": 0}
    assert all(r.reason.startswith("duplicate") for r in rejected)
    assert {r.winner for r in rejected} == {"x", "cpu"}


def test_result_does_not_depend_on_input_order() -> None:
    plans = [Plan("a", Priority.BURST, (quota(BE, 1000),)), Plan("b", Priority.BURST, (quota(BE, 2000),)),
             Plan("c", Priority.RESCTRL, (quota(BE, 3000),)), Plan("d", Priority.SUPPRESS, (quota(POD_A, 4000),))]
    results = {repr(arbitrate(list(order))) for order in itertools.permutations(plans)}
    assert len(results) == 1
    applied, _ = arbitrate(plans)
    # Equal priority: the strategy name breaks the tie ("a" before "b").
    assert {p.strategy: p.actions for p in applied}["a"] == (quota(BE, 1000),)


def test_a_leveled_write_whose_top_another_strategy_holds_is_dropped_whole() -> None:
    """Interference caps the tier at 50000 while cpu-suppress lifts it and restores a
    child's own 300000: the child's write under the capped tier would be refused
    (EINVAL) or run over the cap, so the lifted tier's levels go with it. A top written
    by another strategy with the same value keeps the levels."""
    restore = LeveledWrite(((quota(BE, -1),), (quota(CTR_A, 300_000, "a"),)), "suppress off")
    interference = Plan("interference", Priority.SUPPRESS + 5, (quota(BE, 50_000),))
    applied, rejected = arbitrate([Plan("cpu_suppress", Priority.SUPPRESS, (restore,)), interference])
    assert {p.strategy: p.actions for p in applied}["cpu_suppress"] == ()
    assert [(r.strategy, r.winner, r.action) for r in rejected] == [("cpu_suppress", "interference", restore)]
    same = Plan("interference", Priority.SUPPRESS + 5, (quota(BE, -1),))
    applied, rejected = arbitrate([Plan("cpu_suppress", Priority.SUPPRESS, (restore,)), same])
    kept = {p.strategy: p.actions for p in applied}["cpu_suppress"]
    assert kept == (LeveledWrite(((), (quota(CTR_A, 300_000, "a"),)), "suppress off"),)
    assert [r.reason.split(":")[0] for r in rejected] == ["duplicate"]
