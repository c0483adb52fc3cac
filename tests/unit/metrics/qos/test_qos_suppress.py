"""BE CPU suppress: the formula, cpuset selection, CFS quota, recovery, stale inputs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path, PurePosixPath

import pytest

from hooks.annotations import RESOURCE_STATUS
from hooks.cgroups import CPU_CFS_QUOTA, CPUSET_CPUS
from hooks.qos import QoSClass
from hooks.rules import ResourceThresholdStrategy
from metrics.collect.topology import CPUInfo
from metrics.model import ContainerView, PodView
from metrics.qos import suppress as suppress_module
from metrics.qos.inputs import NodeInputs
from metrics.qos.plan import LeveledWrite, SetCgroup
from metrics.qos.suppress import (
    BEState,
    ChildQuota,
    SuppressConfig,
    SuppressStrategy,
    quota_target,
    select_cpus,
    suppress_cores,
)

BE_DIR = PurePosixPath("kubepods/besteffort")
ALL = frozenset(range(8))
ON = ResourceThresholdStrategy(enable=True)
QUOTA = ResourceThresholdStrategy(enable=True, cpu_suppress_policy="cfsQuota")


def topology() -> list[CPUInfo]:
    """8 CPUs, HT siblings i and i+4 (core i % 4); cores 0-1 on NUMA 0, 2-3 on NUMA 1."""
    return [CPUInfo(cpu=i, core=i % 4, socket=0, numa=0 if i % 4 < 2 else 1) for i in range(8)]


def pod(uid: str, qos: QoSClass, kube: str = "burstable", annotations: dict[str, str] | None = None) -> PodView:
    cgroup = f"kubepods/{kube}/pod{uid}"
    return PodView(uid=uid, namespace="ns", name=uid, sandbox_id=f"sb-{uid}", qos=qos, priority=0,
                   priority_class="", cgroup_dir=cgroup, kube_qos=kube, annotations=annotations or {},
                   containers=(ContainerView(id=f"c{uid}", name="main", cgroup_dir=f"{cgroup}/c{uid}"),))


LS_A, LS_B, BE_C = pod("a", QoSClass.LS), pod("b", QoSClass.LS), pod("c", QoSClass.BE, "besteffort")


def inputs(pods: tuple[PodView, ...] = (LS_A, LS_B, BE_C), used: dict[str, float] | None = None,
           node: float | None = 4.0, reserved: float = 0.5) -> NodeInputs:
    usage = {"a": 1.5, "b": 0.5, "c": 1.0} if used is None else used
    return NodeInputs(now=100.0, capacity_cores=8.0, reserved_cores=reserved, pods=pods, node_cpu_used=node,
                      pod_cpu_used=usage)


def test_formula_by_hand() -> None:
    # 8 x 65% = 5.2; non-BE = 1.5 + 0.5; system = max(4.0 - 3.0, 0.5) = 1.0 -> 2.2
    f = suppress_cores(inputs(), ON)
    assert (f.non_be_used, f.system_used, f.pods_used) == (2.0, 1.0, 3.0)
    assert f.suppress == pytest.approx(2.2)
    # reserved above the measured system usage wins: system = 1.5 -> 1.7
    assert suppress_cores(inputs(reserved=1.5), ON).suppress == pytest.approx(1.7)
    # floor: 8 x 40% = 3.2 > 2.2
    floored = suppress_cores(inputs(), ResourceThresholdStrategy(enable=True, cpu_suppress_min_percent=40))
    assert floored.suppress == pytest.approx(3.2) and floored.floor == pytest.approx(3.2)


def test_pods_without_a_view_count_as_non_be_and_kube_besteffort_as_be() -> None:
    # ghost 0.4 is non-BE: non-BE = 2.4, pods = 3.4, system = max(0.6, 1.0) = 1.0 -> 5.2 - 2.4 - 1.0
    ghost = suppress_cores(inputs(used={"a": 1.5, "b": 0.5, "c": 1.0, "ghost": 0.4}, reserved=1.0), ON)
    assert ghost.suppress == pytest.approx(1.8)
    unlabeled_be = pod("c", QoSClass.NONE, "besteffort")
    assert suppress_cores(inputs((LS_A, LS_B, unlabeled_be)), ON).suppress == pytest.approx(2.2)


@pytest.mark.parametrize(("n", "expected"), [(4, {0, 2, 4, 6}), (3, {0, 2, 4}), (5, {0, 1, 2, 4, 6}),
                                             (2, {0, 4}), (9, set(range(8)))])
def test_cpuset_selection_takes_whole_ht_pairs_round_robin_over_numa(n: int, expected: set[int]) -> None:
    assert select_cpus(n, topology()) == frozenset(expected)


def cpuset_of(plan_actions: tuple[object, ...]) -> tuple[str, LeveledWrite]:
    leveled = next(a for a in plan_actions if isinstance(a, LeveledWrite))
    top = leveled.levels[0][0]
    return str(top.value), leveled


def test_cpuset_plan_writes_only_the_be_tree_and_recovers_quota() -> None:
    strategy = SuppressStrategy(SuppressConfig(), topology())
    plan = strategy.plan(inputs(), ON, BEState(ALL, 300_000))
    cpus, leveled = cpuset_of(plan.actions)
    assert cpus == "0,2,4"  # ceil(2.2) = 3 CPUs
    assert [[str(i.cgroup) for i in level] for level in leveled.levels] == [
        ["kubepods/besteffort"], ["kubepods/besteffort/podc"], ["kubepods/besteffort/podc/cc"]]
    assert all(i.resource is CPUSET_CPUS for i in leveled.items())
    assert SetCgroup(BE_DIR, CPU_CFS_QUOTA, -1, "recover BE cfs quota (policy cpuset)") in plan.actions
    touched = {str(i.cgroup) for i in leveled.items()}
    assert not any("burstable" in t for t in touched)  # LS pods are never suppressed
    assert plan.inputs["suppress_cores"] == pytest.approx(2.2)


def test_cpuset_excludes_reserved_and_lse_bound_cpus() -> None:
    reserved = SuppressStrategy(SuppressConfig(reserved_cpus=frozenset({0})), topology())
    assert cpuset_of(reserved.plan(inputs(), ON, BEState(ALL, -1)).actions)[0] == "2,4,6"
    lse = pod("e", QoSClass.LSE, "guaranteed", {RESOURCE_STATUS: json.dumps({"cpuset": "2-3"})})
    plan = reserved.plan(inputs((LS_A, LS_B, BE_C, lse), {"a": 1.5, "b": 0.5, "c": 1.0, "e": 0.0}), ON,
                         BEState(ALL, -1))
    assert cpuset_of(plan.actions)[0] == "1,5-6"


def test_cpuset_growth_is_capped_and_never_below_two() -> None:
    strategy = SuppressStrategy(SuppressConfig(), topology())
    # idle node: 5.2 - 0 - 0.5 = 4.7 -> 5 wanted, but only 2 + ceil(0.8) = 3 allowed from {0, 1}
    idle = inputs(used={"a": 0.0, "b": 0.0, "c": 0.0}, node=0.0)
    plan = strategy.plan(idle, ON, BEState(frozenset({0, 1}), -1))
    assert (plan.inputs["wanted_cpus"], plan.inputs["growth_cap"]) == (5, 3)
    assert cpuset_of(plan.actions)[0] == "0,2,4"
    busy = inputs(used={"a": 6.0, "b": 0.0, "c": 0.5}, node=7.0)
    assert cpuset_of(strategy.plan(busy, ON, BEState(ALL, -1)).actions)[0] == "0,4"


@pytest.mark.parametrize(
    ("current", "expected"),
    [(-1, 220_000), (200_000, 220_000), (215_000, None), (100_000, 180_000)],
)
def test_cfs_quota_dead_band_and_growth_cap(current: int, expected: int | None) -> None:
    # 2.2 cores x 100 ms = 220000; dead band 1% of 8 x 100000 = 8000; growth <= 80000 a round
    assert quota_target(2.2, current, 8.0, 100_000)[0] == expected


def test_cfs_quota_floor_is_written_even_inside_the_dead_band() -> None:
    assert quota_target(-1.0, 2500, 8.0, 100_000)[0] == 2000


def test_cfs_plan_recovers_the_cpuset() -> None:
    strategy = SuppressStrategy(SuppressConfig(reserved_cpus=frozenset({7})), topology())
    plan = strategy.plan(inputs(), QUOTA, BEState(frozenset({0, 1}), 400_000))
    assert SetCgroup(BE_DIR, CPU_CFS_QUOTA, 220_000, plan.reason) in plan.actions  # shrinking is never capped
    assert cpuset_of(plan.actions)[0] == "0-6"


def test_disabled_recovers_both_knobs() -> None:
    lse = pod("e", QoSClass.LSE, "guaranteed", {RESOURCE_STATUS: json.dumps({"cpuset": "6-7"})})
    strategy = SuppressStrategy(SuppressConfig(reserved_cpus=frozenset({0})), topology())
    plan = strategy.plan(inputs((LS_A, BE_C, lse)), ResourceThresholdStrategy(enable=False), BEState(None, None))
    assert cpuset_of(plan.actions)[0] == "1-5"
    assert any(isinstance(a, SetCgroup) and a.value == -1 and a.resource is CPU_CFS_QUOTA for a in plan.actions)


def test_stale_or_missing_metrics_make_no_decision() -> None:
    strategy = SuppressStrategy(SuppressConfig(), topology())
    no_node = strategy.plan(inputs(node=None), ON, BEState(ALL, -1))
    assert no_node.actions == () and "node_cpu_usage_cores" in no_node.reason
    no_ls = strategy.plan(inputs(used={"b": 0.5, "c": 1.0}), ON, BEState(ALL, -1))
    assert no_ls.actions == () and "ns/a" in no_ls.reason
    # a BE pod without a sample does not block the decision (it is not in the formula)
    assert strategy.plan(inputs(used={"a": 1.5, "b": 0.5}), ON, BEState(ALL, -1)).actions
    unknown_state = strategy.plan(inputs(), ON, BEState(None, -1))
    assert unknown_state.actions == () and "unreadable" in unknown_state.reason


def test_bad_resource_status_is_skipped_with_one_warning(capsys: pytest.CaptureFixture[str]) -> None:
    bad = pod("e", QoSClass.LSE, "guaranteed", {RESOURCE_STATUS: "{not json"})
    strategy = SuppressStrategy(SuppressConfig(), topology())
    for _ in range(3):
        plan = strategy.plan(inputs((LS_A, LS_B, BE_C, bad), {"a": 1.5, "b": 0.5, "c": 1.0, "e": 0.0}), ON,
                             BEState(ALL, -1))
    assert cpuset_of(plan.actions)[0] == "0,2,4"
    assert capsys.readouterr().out.count("resource_status_ignored") == 1


@pytest.mark.parametrize(("current", "expected"), [(58_000, 50_000), (57_999, None), (42_000, 50_000),
                                                   (42_001, None)])
def test_cfs_quota_dead_band_edge_is_outside_the_band(current: int, expected: int | None) -> None:
    # 0.5 cores x 100 ms = 50000; the band is 1% of 8 x 100000 = 8000 exactly (binary-exact
    # numbers): a change of exactly 8000 is made, 7999 is not ("<" in quota_target, not "<=").
    assert 8.0 * 100_000 * 0.01 == 8000.0
    assert quota_target(0.5, current, 8.0, 100_000)[0] == expected


# --- the tier quota under BE children's own quotas (issue 14, item 11) ----------------------

BE_POD = PurePosixPath(BE_C.cgroup_dir)
BE_CTR = PurePosixPath(BE_C.containers[0].cgroup_dir)


def children(pod_quota: int, ctr_quota: int, ctr_period: int = 100_000) -> tuple[ChildQuota, ...]:
    return (ChildQuota(BE_POD, pod_quota, 100_000, "c", 0), ChildQuota(BE_CTR, ctr_quota, ctr_period, "c", 1))


def leveled(plan_actions: tuple[object, ...]) -> list[list[tuple[str, object]]]:
    [write] = [a for a in plan_actions if isinstance(a, LeveledWrite) and a.items()[0].resource is CPU_CFS_QUOTA]
    return [[(str(i.cgroup), i.value) for i in level] for level in write.levels]


def test_a_lower_tier_quota_clamps_the_be_children_above_it_then_restores_them() -> None:
    strategy = SuppressStrategy(SuppressConfig(), topology())
    # 2.2 cores -> 220000 on the tier; the pod (300000) and its container (125000 per 50 ms
    # period, i.e. 2.5 cores) are above it, so both are clamped, to the tier's ratio.
    plan = strategy.plan(inputs(), QUOTA, BEState(ALL, 400_000, children(300_000, 125_000, ctr_period=50_000)))
    assert leveled(plan.actions) == [[(str(BE_DIR), 220_000)], [(str(BE_POD), 220_000)], [(str(BE_CTR), 110_000)]]
    assert plan.inputs["clamped_children"] == {str(BE_POD): 300_000, str(BE_CTR): 125_000}
    # Inside the dead band the tier is kept, and the clamped children stay as they are.
    kept = strategy.plan(inputs(), QUOTA, BEState(ALL, 220_000, children(220_000, 110_000, ctr_period=50_000)))
    assert [a for a in kept.actions if isinstance(a, SetCgroup) and a.resource is CPU_CFS_QUOTA] == []
    assert strategy.clamped == {str(BE_POD): 300_000, str(BE_CTR): 125_000}
    # The tier grows back (capped: 220000 + 80000): the originals fit again and are restored.
    idle = inputs(used={"a": 0.0, "b": 0.0, "c": 1.0}, node=1.0)
    grown = strategy.plan(idle, QUOTA, BEState(ALL, 220_000, children(220_000, 110_000, ctr_period=50_000)))
    assert leveled(grown.actions) == [[(str(BE_DIR), 300_000)], [(str(BE_POD), 300_000)], [(str(BE_CTR), 125_000)]]
    assert grown.inputs["clamped_children"] == {}


def test_children_within_the_tier_quota_or_unlimited_are_left_alone() -> None:
    strategy = SuppressStrategy(SuppressConfig(), topology())
    plan = strategy.plan(inputs(), QUOTA, BEState(ALL, 400_000, children(-1, 200_000)))
    assert SetCgroup(BE_DIR, CPU_CFS_QUOTA, 220_000, plan.reason) in plan.actions  # a plain write, as before
    assert strategy.clamped == {}


def test_a_child_changed_by_someone_else_is_not_restored_over() -> None:
    strategy = SuppressStrategy(SuppressConfig(), topology())
    strategy.plan(inputs(), QUOTA, BEState(ALL, 400_000, children(300_000, -1)))
    assert strategy.clamped == {str(BE_POD): 300_000}
    # batch-resource's reconcile set the pod's quota to -1 (cfsQuota policy) meanwhile
    idle = inputs(used={"a": 0.0, "b": 0.0, "c": 1.0}, node=1.0)
    grown = strategy.plan(idle, QUOTA, BEState(ALL, 220_000, children(-1, -1)))
    assert SetCgroup(BE_DIR, CPU_CFS_QUOTA, 300_000, grown.reason) in grown.actions
    assert strategy.clamped == {}


def test_recovery_restores_the_clamped_children_after_the_tier() -> None:
    strategy = SuppressStrategy(SuppressConfig(), topology())
    strategy.plan(inputs(), QUOTA, BEState(ALL, 400_000, children(300_000, 300_000)))
    actions = strategy.recover([BE_C], cpuset=False, quota=True, why="QoS manager stopped")
    assert leveled(tuple(actions)) == [[(str(BE_DIR), -1)], [(str(BE_POD), 300_000)], [(str(BE_CTR), 300_000)]]
    assert strategy.clamped == {}
    assert strategy.recover([BE_C], cpuset=False, quota=True, why="again") == [
        SetCgroup(BE_DIR, CPU_CFS_QUOTA, -1, "recover BE cfs quota (again)")]


OFF = ResourceThresholdStrategy(enable=False)


class Files:
    """The children's quota files as a dict: a test applies a plan's writes, or does not."""

    def __init__(self, pod_quota: int, ctr_quota: int) -> None:
        self.quota = {BE_POD: pod_quota, BE_CTR: ctr_quota}

    def read(self) -> tuple[ChildQuota, ...]:
        return (ChildQuota(BE_POD, self.quota[BE_POD], 100_000, "c", 0),
                ChildQuota(BE_CTR, self.quota[BE_CTR], 100_000, "c", 1))

    def apply(self, actions: tuple[object, ...] | list[object]) -> None:
        for action in actions:
            items = action.items() if isinstance(action, LeveledWrite) else (action,)
            for item in items:
                if isinstance(item, SetCgroup) and item.resource is CPU_CFS_QUOTA and item.cgroup in self.quota:
                    self.quota[item.cgroup] = int(item.value)


def restores(actions: tuple[object, ...] | list[object]) -> dict[str, object]:
    return {str(i.cgroup): i.value for a in actions if isinstance(a, LeveledWrite)
            for i in a.items() if i.cgroup != BE_DIR and i.resource is CPU_CFS_QUOTA}


def test_a_restore_that_did_not_happen_is_planned_again_until_a_read_finds_it() -> None:
    """Suppression switched off: the restore of a clamped child may fail, back off or be
    lost; it is planned again while the file still holds our clamp, and forgotten only
    once a read finds the original in place (before, the first plan forgot it)."""
    strategy = SuppressStrategy(SuppressConfig(), topology())
    files = Files(300_000, 300_000)
    files.apply(strategy.plan(inputs(), QUOTA, BEState(ALL, 400_000), files.read).actions)
    assert files.quota == {BE_POD: 220_000, BE_CTR: 220_000}
    lost = strategy.plan(inputs(), OFF, BEState(ALL, 220_000), files.read)  # not applied
    assert restores(lost.actions) == {str(BE_POD): 300_000, str(BE_CTR): 300_000}
    again = strategy.plan(inputs(), OFF, BEState(ALL, -1), files.read)
    assert restores(again.actions) == {str(BE_POD): 300_000, str(BE_CTR): 300_000}
    files.apply(again.actions)
    confirmed = strategy.plan(inputs(), OFF, BEState(ALL, -1), files.read)
    assert restores(confirmed.actions) == {} and not strategy._clamps.remembered
    calls = []
    strategy.plan(inputs(), OFF, BEState(ALL, -1), lambda: calls.append(1) or files.read())
    assert calls == []  # nothing remembered: a disabled round reads no children


def test_a_clamp_write_that_did_not_happen_keeps_the_original() -> None:
    """A tier drop planned a lower clamp whose write never landed: the file still holds the
    previous clamp, which is ours, not the child's own value (before: it became the
    'original' and suppression off left the child at it)."""
    strategy = SuppressStrategy(SuppressConfig(), topology())
    files = Files(-1, 300_000)
    files.apply(strategy.plan(inputs(), QUOTA, BEState(ALL, 400_000), files.read).actions)
    assert files.quota[BE_CTR] == 220_000
    busy = inputs(used={"a": 4.0, "b": 1.0, "c": 1.0}, node=6.5)
    for _ in range(2):  # planned twice (a write backed off), applied neither time
        lower = strategy.plan(busy, QUOTA, BEState(ALL, 220_000), files.read)
        assert restores(lower.actions) == {str(BE_CTR): 2_000}  # the floor
    off = strategy.plan(inputs(), OFF, BEState(ALL, 220_000), files.read)
    assert restores(off.actions) == {str(BE_CTR): 300_000}


def test_a_pod_missing_from_one_list_keeps_its_clamp() -> None:
    """The fast path plans from the pods it has a counter for this tick: a BE pod left out
    once must not lose its child's original (before: ``keep_pods`` dropped it). Its
    cgroup being there (a read) is what keeps it; gone from the host, it goes."""
    strategy = SuppressStrategy(SuppressConfig(), topology())
    files = Files(-1, 300_000)
    files.apply(strategy.plan(inputs(), QUOTA, BEState(ALL, 400_000), files.read).actions)
    without = inputs(pods=(LS_A, LS_B), used={"a": 1.5, "b": 0.5})
    strategy.plan(without, QUOTA, BEState(ALL, 220_000), files.read)
    assert strategy.clamped == {str(BE_CTR): 300_000}
    off = strategy.plan(inputs(), OFF, BEState(ALL, 220_000), files.read)
    assert restores(off.actions) == {str(BE_CTR): 300_000}
    # Gone from the host: the read that the missing pod asks for forgets it.
    strategy = SuppressStrategy(SuppressConfig(), topology())
    files = Files(-1, 300_000)
    files.apply(strategy.plan(inputs(), QUOTA, BEState(ALL, 400_000), files.read).actions)
    strategy.plan(without, QUOTA, BEState(ALL, 220_000), lambda: ())
    assert strategy.clamped == {}


def test_the_strategies_writing_the_tier_quota_share_one_memory_of_its_children(tmp_path: Path) -> None:
    """cpu-suppress and interference both write the tier's quota: with a memory each, one
    took the other's clamp for the child's own quota, and the release restored that."""
    from hooks.cgroups import CgroupLayout
    from hooks.executor import CgroupExecutor
    from metrics.qos import builtin
    from metrics.qos.config import ManagerConfig
    from metrics.qos.interference import Interference
    from metrics.qos.strategy import StrategyInit, load_strategies, parse_specs

    (tmp_path / "cpu").mkdir()
    init = StrategyInit(name="", args={}, key_path="strategies", config=ManagerConfig(), topology=topology(),
                        executor=CgroupExecutor(CgroupLayout(tmp_path)))
    suppress, interference = load_strategies(parse_specs(["cpu-suppress", "interference"], "strategies"),
                                             init).enabled
    assert isinstance(suppress, builtin.CPUSuppress) and isinstance(interference, Interference)
    assert suppress.inner._clamps is interference._clamps is init.tier_clamps

    # What sharing keeps: suppress clamps, interference caps lower, suppress plans while
    # capped (its tier write loses to interference's), interference releases.
    shared = init.tier_clamps
    strategy = SuppressStrategy(SuppressConfig(), topology(), shared)
    files = Files(-1, 300_000)
    files.apply(strategy.plan(inputs(), QUOTA, BEState(ALL, 400_000), files.read).actions)
    files.apply([shared.write(SetCgroup(BE_DIR, CPU_CFS_QUOTA, 50_000, "interference cap"), files.read(), 100_000)])
    assert files.quota[BE_CTR] == 50_000
    later = dataclasses.replace(inputs(used={"a": 0.0, "b": 0.0, "c": 1.0}, node=1.0), now=1000.0)
    strategy.plan(later, QUOTA, BEState(ALL, 50_000), files.read)  # not applied: interference holds the tier
    files.apply([shared.write(SetCgroup(BE_DIR, CPU_CFS_QUOTA, -1, "interference cleared"), None, 100_000)])
    assert files.quota[BE_CTR] == 300_000


def test_read_children_reads_every_cgroup_under_the_tier_on_v1_only(tmp_path: Path) -> None:
    from hooks.cgroups import CgroupLayout
    from hooks.executor import CgroupExecutor
    from metrics.qos.suppress import read_be_state

    pause, stranger = BE_POD / "sandbox-pause", BE_DIR / "podunknown"
    for d, quota, period in ((BE_DIR, "-1", None), (BE_POD, "300000", "100000"), (BE_CTR, "25000", "50000"),
                             (pause, "-1", None), (stranger, "40000", None),
                             (PurePosixPath(LS_A.cgroup_dir), "50000", None)):
        (tmp_path / "v1" / "cpu" / d).mkdir(parents=True, exist_ok=True)
        (tmp_path / "v1" / "cpu" / d / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        if period:
            (tmp_path / "v1" / "cpu" / d / "cpu.cfs_period_us").write_text(f"{period}\n")
    (tmp_path / "v1" / "memory").mkdir()
    executor = CgroupExecutor(CgroupLayout(tmp_path / "v1"))
    state = read_be_state(executor, SuppressConfig(), [LS_A, BE_C])
    assert state.quota == -1
    # Found on the filesystem: the pause cgroup and a pod the views do not know (yet) count
    # too; the LS pod is not under the tier; a missing period file means the default.
    assert state.children == (ChildQuota(BE_POD, 300_000, 100_000, "c", 0),
                              ChildQuota(stranger, 40_000, 100_000, "", 0),
                              ChildQuota(BE_CTR, 25_000, 50_000, "c", 1), ChildQuota(pause, -1, 100_000, "c", 1))
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "cgroup.controllers").write_text("cpu cpuset memory\n")
    assert read_be_state(CgroupExecutor(CgroupLayout(tmp_path / "v2")), SuppressConfig(), [BE_C]).children == ()


# --- issue 29: cpuset inputs kept per pod list ----------------------------------------------


def lse(uid: str, cpus: str) -> PodView:
    return pod(uid, QoSClass.LSE, "guaranteed", {RESOURCE_STATUS: json.dumps({"cpuset": cpus})})


def test_bound_cpus_are_parsed_once_per_pod_list_and_again_for_a_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = suppress_module.bound_cpus

    def counted(*args: object, **kwargs: object) -> frozenset[int]:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(suppress_module, "bound_cpus", counted)
    strategy = SuppressStrategy(SuppressConfig(), topology())
    pods = (pod("a", QoSClass.LS), pod("c", QoSClass.BE, "besteffort"), lse("e", "2-3"))
    first = strategy.plan(inputs(pods, {p.uid: 0.1 for p in pods}), ON, BEState(frozenset(range(8)), -1))
    parses = len(calls)
    again = strategy.plan(inputs(pods, {p.uid: 0.1 for p in pods}), ON, BEState(frozenset(range(8)), -1))
    assert len(calls) == parses and again.actions == first.actions
    moved = (*pods[:2], lse("e", "4-5"))  # a new list: the LSE pod now holds other CPUs
    plan = strategy.plan(inputs(moved, {p.uid: 0.1 for p in moved}), ON, BEState(frozenset(range(8)), -1))
    assert len(calls) > parses
    assert plan.inputs["excluded_lse"] == "4-5" and first.inputs["excluded_lse"] == "2-3"


def test_a_list_that_is_not_a_tuple_is_parsed_every_time() -> None:
    strategy = SuppressStrategy(SuppressConfig(), topology())
    pods = [lse("e", "2-3")]
    assert strategy.recovery_cpus(pods) == frozenset({0, 1, 4, 5, 6, 7})
    pods[0] = lse("e", "6-7")  # the same list object, changed: not taken for the one seen
    assert strategy.recovery_cpus(pods) == frozenset(range(6))


def test_the_cpuset_write_over_children_is_built_once_per_children_read_and_value() -> None:
    strategy = SuppressStrategy(SuppressConfig(), topology())
    kids = (ChildQuota(PurePosixPath("kubepods/besteffort/podc"), -1, 100_000, "c", 0),)
    pods = (pod("c", QoSClass.BE, "besteffort"),)
    first = strategy._cpuset_write(pods, frozenset({0, 1}), "why", kids)
    assert strategy._cpuset_write(pods, frozenset({0, 1}), "why", kids) is first
    other = strategy._cpuset_write(pods, frozenset({0, 1, 2}), "why", kids)
    assert other is not first and isinstance(other, LeveledWrite)
    found = (*kids, ChildQuota(PurePosixPath("kubepods/besteffort/podc/cc"), -1, 100_000, "c", 1))
    again = strategy._cpuset_write(pods, frozenset({0, 1, 2}), "why", found)
    assert again is not other and sum(len(level) for level in again.levels) == 3
