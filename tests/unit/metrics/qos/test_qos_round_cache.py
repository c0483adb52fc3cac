"""Issue 29 (the agent's own CPU): what a QoS round keeps between rounds while its inputs
do not change (CPU burst's view of the pod list, its burst knobs, the BE tier's kept
files) is dropped as soon as they do: a new pod list, a new desired value, a new
policy, and a verification that expired all still produce the write."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from hooks.cgroups import CgroupLayout
from hooks.executor import CgroupExecutor
from hooks.qos import QoSClass
from hooks.rules import CPUBurstStrategy, Rules, parse_rules
from metrics.model import ContainerView, PodView
from metrics.qos.builtin import CPUBurst
from metrics.qos.burst import ANNOTATION, CPU_CFS_BURST, BurstStrategy
from metrics.qos.evict import CriEvictor
from metrics.qos.inputs import NodeInputs
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.qos.pathcache import PathCache
from metrics.qos.plan import SetCgroup
from metrics.qos.suppress import SuppressConfig, read_be_state
from metrics.store.tsdb import TSDB

NOW = 5_000.0
BURST_ONLY = CPUBurstStrategy(policy="cpuBurstOnly", cpu_burst_percent=50)
QUOTA_ONLY = CPUBurstStrategy(policy="cfsQuotaBurstOnly")


def ls_pod(uid: str, quota: int = 100_000, annotations: dict[str, str] | None = None) -> PodView:
    d = f"kubepods/burstable/pod{uid}"
    return PodView(uid=uid, namespace="ns", name=uid, sandbox_id=uid, qos=QoSClass.LS, priority=0,
                   priority_class="", cgroup_dir=d, kube_qos="burstable", annotations=annotations or {},
                   containers=(ContainerView(id=f"{uid}0", name="main", cgroup_dir=f"{d}/{uid}0", cpu_quota=quota,
                                             cpu_period=100_000),))


def node(pods: tuple[PodView, ...]) -> NodeInputs:
    return NodeInputs(now=NOW, capacity_cores=8.0, reserved_cores=0.0, pods=pods, node_cpu_used=1.0)


def bursts(actions: tuple[Any, ...]) -> dict[str, Any]:
    return {str(a.cgroup): a.value for a in actions if isinstance(a, SetCgroup) and a.resource is CPU_CFS_BURST}


# --- the strategy ---------------------------------------------------------------------------------


def test_the_same_pods_and_policy_plan_the_same_burst_actions_without_building_them_again() -> None:
    strategy = BurstStrategy()
    pods = (ls_pod("a"), ls_pod("b", 200_000))
    first = strategy.plan(node(pods), BURST_ONLY, {})
    second = strategy.plan(node(pods), BURST_ONLY, {})
    assert first.actions == second.actions  # the plan (and so explain) is what it was
    assert all(a is b for a, b in zip(first.actions, second.actions, strict=True))  # kept, not rebuilt
    assert first.describe() == second.describe()


def test_a_new_pod_list_with_another_quota_plans_the_new_burst() -> None:
    strategy = BurstStrategy()
    pods = (ls_pod("a"),)
    assert bursts(strategy.plan(node(pods), BURST_ONLY, {}).actions) == {
        "kubepods/burstable/poda/a0": 50_000, "kubepods/burstable/poda": 50_000}
    changed = (ls_pod("a", 200_000), ls_pod("c"))  # the pod's limit doubled; a pod came
    plan = strategy.plan(node(changed), BURST_ONLY, {})
    assert bursts(plan.actions) == {"kubepods/burstable/poda/a0": 100_000, "kubepods/burstable/poda": 100_000,
                                    "kubepods/burstable/podc/c0": 50_000, "kubepods/burstable/podc": 50_000}
    assert plan.inputs["pods"]["ns/a"] == {"cfs_burst_us": 100_000}


def test_the_same_pod_list_under_a_new_policy_is_planned_afresh() -> None:
    strategy = BurstStrategy()
    pods = (ls_pod("a"),)
    strategy.plan(node(pods), BURST_ONLY, {})
    more = CPUBurstStrategy(policy="cpuBurstOnly", cpu_burst_percent=80)
    assert bursts(strategy.plan(node(pods), more, {}).actions)["kubepods/burstable/poda/a0"] == 80_000
    # off: put back to 0 once; on again with the same tuple: written again
    assert set(bursts(strategy.plan(node(pods), CPUBurstStrategy(), {}).actions).values()) == {0}
    assert strategy.plan(node(pods), CPUBurstStrategy(), {}).actions == ()
    assert bursts(strategy.plan(node(pods), more, {}).actions)["kubepods/burstable/poda/a0"] == 80_000


def test_quota_dirs_follow_a_new_pod_list_and_a_new_node_policy() -> None:
    strategy = BurstStrategy()
    plain = ls_pod("a")
    pods = (plain,)
    assert strategy.quota_dirs(pods, CPUBurstStrategy()) == []
    assert not strategy.any_bursts_quota(pods, CPUBurstStrategy())
    assert strategy.quota_dirs(pods, QUOTA_ONLY) == ["kubepods/burstable/poda", "kubepods/burstable/poda/a0"]
    assert strategy.any_bursts_quota(pods, QUOTA_ONLY)
    annotated = (ls_pod("a", annotations={ANNOTATION: json.dumps({"policy": "cfsQuotaBurstOnly"})}),)
    assert strategy.quota_dirs(annotated, CPUBurstStrategy()) == [
        "kubepods/burstable/poda", "kubepods/burstable/poda/a0"]
    assert strategy.any_bursts_quota(annotated, CPUBurstStrategy())
    assert strategy.quota_dirs(pods, CPUBurstStrategy()) == []  # the annotation went with the old list


def test_a_list_changed_in_place_is_never_taken_for_the_last_one() -> None:
    strategy = BurstStrategy()
    pods = [ls_pod("a")]
    assert strategy.quota_dirs(pods, QUOTA_ONLY) == ["kubepods/burstable/poda", "kubepods/burstable/poda/a0"]
    pods.append(ls_pod("b"))
    assert strategy.quota_dirs(pods, QUOTA_ONLY) == ["kubepods/burstable/poda", "kubepods/burstable/poda/a0",
                                                     "kubepods/burstable/podb", "kubepods/burstable/podb/b0"]


def test_the_be_tier_read_through_kept_files_sees_every_new_value(tmp_path: Path) -> None:
    tier = tmp_path / "cpu" / "kubepods/besteffort"
    tier.mkdir(parents=True)
    (tmp_path / "cpuset" / "kubepods/besteffort").mkdir(parents=True)
    (tmp_path / "cpuset" / "kubepods/besteffort" / "cpuset.cpus").write_text("0-7\n")
    (tier / "cpu.cfs_quota_us").write_text("-1\n")
    executor, paths = CgroupExecutor(CgroupLayout(tmp_path, version=1)), PathCache()
    state = read_be_state(executor, SuppressConfig(), children=False, paths=paths)
    assert state.cpuset == frozenset(range(8)) and state.quota == -1
    (tier / "cpu.cfs_quota_us").write_text("400000\n")
    assert read_be_state(executor, SuppressConfig(), children=False, paths=paths).quota == 400_000
    assert read_be_state(executor, SuppressConfig(), children=False, paths=paths) == read_be_state(
        executor, SuppressConfig(), children=False)


# --- through the manager, on a fixture tree ---------------------------------------------------------


async def _no_runtime(method: str, payload: bytes, timeout: float) -> bytes:
    return b""


class Env:
    def __init__(self, tmp: Path, pods: list[PodView], verified_for: float) -> None:
        self.root = tmp / "cgroup"
        self.pods = tuple(pods)
        self.tree(pods)
        self.rules: Rules = parse_rules({"cpuBurstStrategy": {"policy": "cpuBurstOnly", "cpuBurstPercent": 50}})
        self.store = TSDB(tmp / "m.db", clock=lambda: NOW)
        self.strategy = CPUBurst()
        self.manager = QoSManager(reader=self.store, pods=lambda: self.pods, topology=[],
                                  executor=CgroupExecutor(CgroupLayout(self.root, version=1)),
                                  evictor=CriEvictor(_no_runtime), rules=lambda: self.rules, clock=lambda: NOW,
                                  config=ManagerConfig(verified_for=verified_for), strategies=[self.strategy])

    def tree(self, pods: list[PodView]) -> None:
        for d in [p.cgroup_dir for p in pods] + [c.cgroup_dir for p in pods for c in p.containers]:
            (self.root / "cpu" / d).mkdir(parents=True, exist_ok=True)
            if not (self.root / "cpu" / d / "cpu.cfs_burst_us").exists():
                (self.root / "cpu" / d / "cpu.cfs_burst_us").write_text("0\n")

    def burst(self, d: str) -> str:
        return (self.root / "cpu" / d / "cpu.cfs_burst_us").read_text().strip()

    def set_burst(self, d: str, value: str) -> None:
        (self.root / "cpu" / d / "cpu.cfs_burst_us").write_text(value + "\n")

    async def results(self) -> dict[str, str]:
        done = await self.manager.run_once()
        return {o.action.target: o.result for o in done.outcomes.get("cpu_burst", [])
                if isinstance(o.action, SetCgroup)}


@pytest.fixture
def env(tmp_path: Path, closing: Callable[[Env], Env]) -> Callable[..., Env]:
    return lambda pods, verified_for=60.0: closing(Env(tmp_path, pods, verified_for))


CTR_A = "kubepods/burstable/poda/a0:cpu.cfs_burst_us"


@pytest.mark.asyncio
async def test_an_expired_verification_still_repairs_a_kept_burst_action(env: Callable[..., Env]) -> None:
    e = env([ls_pod("a")], verified_for=0.2)
    assert (await e.results())[CTR_A] == "written"
    assert e.burst("kubepods/burstable/poda/a0") == "50000"
    e.set_burst("kubepods/burstable/poda/a0", "0")  # someone else
    kept = e.manager.explain()["strategies"]["cpu_burst"]["plan"]
    assert (await e.results())[CTR_A] == "unchanged"  # remembered: not looked at
    assert e.manager.explain()["strategies"]["cpu_burst"]["plan"] == kept  # the plan is the same
    await asyncio.sleep(0.25)
    assert (await e.results())[CTR_A] == "written"  # 60 s (here 0.2 s) on: checked, put back
    assert e.burst("kubepods/burstable/poda/a0") == "50000"


@pytest.mark.asyncio
async def test_a_new_pod_list_and_a_new_desired_value_are_written_in_the_next_round(
        env: Callable[..., Env]) -> None:
    e = env([ls_pod("a")])
    await e.results()
    assert (await e.results())[CTR_A] == "unchanged"
    pods = [ls_pod("a", 200_000), ls_pod("b")]  # a's limit doubled; b came
    e.tree(pods)
    e.pods = tuple(pods)
    results = await e.results()
    assert results[CTR_A] == "written" and results["kubepods/burstable/podb/b0:cpu.cfs_burst_us"] == "written"
    assert e.burst("kubepods/burstable/poda/a0") == "100000" and e.burst("kubepods/burstable/podb/b0") == "50000"
    e.rules = parse_rules({"cpuBurstStrategy": {"policy": "cpuBurstOnly", "cpuBurstPercent": 25}})  # same pods
    assert (await e.results())[CTR_A] == "written"
    assert e.burst("kubepods/burstable/poda/a0") == "50000" and e.burst("kubepods/burstable/poda") == "50000"


def test_a_kept_burst_action_is_the_one_the_verified_cache_compares() -> None:
    """The kept actions carry the values the cache remembers (no stale object can pass
    for a new value: a new value is a new action, compared by value)."""
    strategy = BurstStrategy()
    pods = (ls_pod("a"),)
    before = {a.cgroup: a for a in strategy.plan(node(pods), BURST_ONLY, {}).actions if isinstance(a, SetCgroup)}
    after = {a.cgroup: a for a in strategy.plan(node((ls_pod("a", 300_000),)), BURST_ONLY, {}).actions
             if isinstance(a, SetCgroup)}
    ctr = PurePosixPath("kubepods/burstable/poda/a0")
    assert before[ctr].value == 50_000 and after[ctr].value == 150_000 and before[ctr] != after[ctr]
