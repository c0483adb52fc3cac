"""The manager on a fixture cgroup v1 tree with the real TSDB: rounds, dry-run, policy
switches, stale metrics, eviction through the runtime, explain."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from criapi import cri_v1_pb2
from hooks.cgroups import CgroupLayout
from hooks.executor import CgroupExecutor
from hooks.qos import QoSClass
from hooks.rules import Rules, parse_rules
from metrics import model
from metrics.collect.topology import CPUInfo
from metrics.model import ContainerView, PodView, Sample, labels
from metrics.qos.evict import STOP_CONTAINER, CriEvictor
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.store.tsdb import TSDB
from runtimeproxy.hookapi import PodInfo, PodMeta

NOW = 5_000.0
TOPOLOGY = [CPUInfo(cpu=i, core=i % 4, socket=0, numa=0 if i % 4 < 2 else 1) for i in range(8)]
BE_DIR = "kubepods/besteffort"


def make_pod(uid: str, qos: QoSClass, kube: str) -> PodView:
    d = f"kubepods/{kube}/pod{uid}"
    return PodView(uid=uid, namespace="ns", name=uid, sandbox_id=uid, qos=qos, priority=5500, priority_class="",
                   cgroup_dir=d, kube_qos=kube, containers=(ContainerView(f"c{uid}", "main", f"{d}/c{uid}"),))


LS = make_pod("a", QoSClass.LS, "burstable")
BE = make_pod("c", QoSClass.BE, "besteffort")
FILES = {"cpu": {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000", "cpu.cfs_burst_us": "0"},
         "cpuset": {"cpuset.cpus": "0-7", "cpuset.mems": "0"}}


def add_pause_cgroup(root: Path) -> Path:
    """The BE sandbox's pause cgroup (v1 cpu and cpuset, all CPUs): in no pod view, found
    only on the filesystem. Returns its path relative to a controller."""
    pause = Path(BE.cgroup_dir) / "sandbox-c"
    for controller, files in (("cpu", {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"}),
                              ("cpuset", {"cpuset.cpus": "0-7"})):
        (root / controller / pause).mkdir()
        for name, value in files.items():
            (root / controller / pause / name).write_text(value + "\n")
    return pause


def build_tree(root: Path) -> None:
    dirs = ["", "kubepods", BE_DIR, "kubepods/burstable"]
    dirs += [d for p in (LS, BE) for d in (p.cgroup_dir, p.containers[0].cgroup_dir)]
    for controller, files in FILES.items():
        for d in dirs:
            (root / controller / d).mkdir(parents=True, exist_ok=True)
            for name, value in files.items():
                (root / controller / d / name).write_text(value + "\n")


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text().strip() for p in sorted(root.rglob("*")) if p.is_file()}


class FakeRuntime:
    def __init__(self) -> None:
        self.stopped: list[str] = []

    async def __call__(self, method: str, payload: bytes, timeout: float) -> bytes:
        if method == STOP_CONTAINER:  # StopPodSandbox: done; ListContainers: nothing runs
            self.stopped.append(cri_v1_pb2.StopContainerRequest.FromString(payload).container_id)
        return b""


class Env:
    def __init__(self, tmp_path: Path, rules: dict[str, Any], dry_run: bool = False) -> None:
        self.root = tmp_path / "cgroup"
        build_tree(self.root)
        self.store = TSDB(tmp_path / "m.db", clock=lambda: NOW)
        self.rules: Rules = parse_rules(rules)
        self.runtime = FakeRuntime()
        self.registry = CollectorRegistry()
        self.manager = QoSManager(
            reader=self.store, pods=lambda: [LS, BE], topology=TOPOLOGY,
            executor=CgroupExecutor(CgroupLayout(self.root)), evictor=CriEvictor(self.runtime),
            rules=lambda: self.rules, config=ManagerConfig(dry_run=dry_run, reserved_cores=0.5, node_name="n1"),
            registry=self.registry, writer=self.store, clock=lambda: NOW)

    def usage(self, node: float = 4.0, ls: float = 2.0, be: float = 1.0, mem: float = 500.0) -> None:
        self.store.write([
            Sample(model.NODE_CPU_USAGE, node, ts=NOW - 0.5),
            Sample(model.NODE_MEMORY_USED, mem, ts=NOW - 0.5), Sample(model.NODE_MEMORY_TOTAL, 1000.0, ts=NOW - 0.5),
            Sample(model.POD_CPU_USAGE, ls, labels(pod_uid="a"), NOW - 0.5),
            Sample(model.POD_CPU_USAGE, be, labels(pod_uid="c"), NOW - 0.5),
            Sample(model.POD_MEMORY_USED, 300.0, labels(pod_uid="c"), NOW - 0.5),
        ])

    def read(self, controller: str, cgroup: str, name: str) -> str:
        return (self.root / controller / cgroup / name).read_text().strip()


@pytest.fixture
def env_factory(tmp_path: Path) -> Iterator[Any]:
    made: list[Env] = []

    def make(rules: dict[str, Any], dry_run: bool = False) -> Env:
        env = Env(tmp_path / str(len(made)), rules, dry_run)
        made.append(env)
        return env

    yield make
    for env in made:
        env.store.close()


ON = {"resourceUsedThresholdWithBE": {"enable": True}}


@pytest.mark.asyncio
async def test_a_round_suppresses_the_be_tree_only(env_factory: Any) -> None:
    env = env_factory(ON)
    env.usage()
    before = tree(env.root)
    await env.manager.run_once()
    # 8 x 65% - 2.0 (LS) - max(4 - 3, 0.5) = 2.2 -> 3 CPUs
    for cgroup in (BE_DIR, BE.cgroup_dir, BE.containers[0].cgroup_dir):
        assert env.read("cpuset", cgroup, "cpuset.cpus") == "0,2,4"
    changed = {k for k, v in tree(env.root).items() if before[k] != v}
    assert changed == {f"cpuset/{d}/cpuset.cpus" for d in (BE_DIR, BE.cgroup_dir, BE.containers[0].cgroup_dir)}
    explained = env.manager.explain()["strategies"]["cpu_suppress"]
    assert explained["applied"][0]["result"] == "written"
    assert explained["plan"]["inputs"]["suppress_cores"] == pytest.approx(2.2)


@pytest.mark.asyncio
async def test_the_cpuset_policy_narrows_the_sandboxs_pause_cgroup_too(env_factory: Any) -> None:
    """v1: a cpuset may not drop CPUs a child still has (EBUSY), and the sandbox's pause
    cgroup is in no pod view: it is found on the filesystem and narrowed first."""
    env = env_factory(ON)
    pause = add_pause_cgroup(env.root)
    env.usage()
    await env.manager.run_once()
    assert env.read("cpuset", str(pause), "cpuset.cpus") == "0,2,4"
    assert env.read("cpuset", BE_DIR, "cpuset.cpus") == "0,2,4"


@pytest.mark.asyncio
async def test_dry_run_writes_nothing_but_explains(env_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    env = env_factory({**ON, "cpuBurstStrategy": {"policy": "auto"}}, dry_run=True)
    env.usage(mem=900.0)
    before = tree(env.root)
    calls = count_hand_offs(monkeypatch)
    await env.manager.run_once()
    assert tree(env.root) == before
    assert calls == ["_plan_round"]
    assert env.runtime.stopped == []
    out = env.manager.explain()
    assert out["dry_run"] and {a["result"] for a in out["strategies"]["cpu_suppress"]["applied"]} == {"dry-run"}
    assert out["strategies"]["be_memory_evict"]["applied"][0]["kind"] == "evict"


@pytest.mark.asyncio
async def test_explain_counts_the_rounds_and_their_worker_cpu(env_factory: Any) -> None:
    """What the control loop costs is in explain (and the cost bench reads it): rounds
    planned and the CPU of their worker-thread work, growing with each round."""
    env = env_factory(ON)
    env.usage()
    assert env.manager.explain()["rounds"] == 0 and env.manager.explain()["cpu_seconds"] == 0
    await env.manager.run_once()
    first = env.manager.explain()
    await env.manager.run_once()
    second = env.manager.explain()
    assert (first["rounds"], second["rounds"]) == (1, 2)
    assert 0 < first["cpu_seconds"] < second["cpu_seconds"]


@pytest.mark.asyncio
async def test_policy_switch_and_disable_recover_the_other_knob(env_factory: Any) -> None:
    env = env_factory({"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressPolicy": "cfsQuota"}})
    env.usage()
    await env.manager.run_once()
    assert env.read("cpu", BE_DIR, "cpu.cfs_quota_us") == "220000"
    assert env.read("cpuset", BE_DIR, "cpuset.cpus") == "0-7"
    env.rules = parse_rules(ON)
    await env.manager.run_once()
    assert env.read("cpu", BE_DIR, "cpu.cfs_quota_us") == "-1"
    assert env.read("cpuset", BE_DIR, "cpuset.cpus") == "0,2,4"
    env.rules = parse_rules({})
    await env.manager.run_once()
    assert env.read("cpuset", BE_DIR, "cpuset.cpus") == "0-7"
    assert env.read("cpuset", BE.containers[0].cgroup_dir, "cpuset.cpus") == "0-7"
    assert env.read("cpuset", LS.cgroup_dir, "cpuset.cpus") == "0-7"


def suppress_series(env: Env) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(m, lb): round(v, 6) for m, lb, v in env.store.newest_values() if m.startswith("be_suppress_")}


@pytest.mark.asyncio
async def test_the_be_limit_in_force_is_recorded_as_koordlets_be_suppress_series(env_factory: Any) -> None:
    env = env_factory({"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressPolicy": "cfsQuota"}})
    env.usage(node=4.0, ls=2.0, be=1.0)
    await env.manager.run_once()
    used = {(model.BE_SUPPRESS_LS_USED_CPU, ()): 2.0, (model.BE_SUPPRESS_BE_USED_CPU, ()): 1.0}
    quota = (model.BE_SUPPRESS_CPU, labels(type="cfsQuota"))
    assert suppress_series(env) == {quota: 2.2, **used}  # 220000 / 100000
    env.rules = parse_rules(ON)
    await env.manager.run_once()
    cpuset = (model.BE_SUPPRESS_CPU, labels(type="cpuset"))
    assert suppress_series(env) == {quota: 2.2, cpuset: 3.0, **used}  # the CPUs written: 0,2,4
    env.usage(node=5.0, ls=3.0, be=1.5)
    env.rules = parse_rules({})  # disabled: limits recovered, nothing decided, nothing recorded
    await env.manager.run_once()
    assert suppress_series(env) == {quota: 2.2, cpuset: 3.0, **used}


@pytest.mark.asyncio
async def test_no_be_suppress_series_in_dry_run_or_after_a_failed_write(env_factory: Any) -> None:
    dry = env_factory(ON, dry_run=True)
    dry.usage()
    await dry.manager.run_once()
    assert dry.manager.suppress.decision is not None and suppress_series(dry) == {}
    broken = env_factory(ON)
    broken.usage()
    target = broken.root / "cpuset" / BE.containers[0].cgroup_dir / "cpuset.cpus"
    target.unlink()
    target.mkdir()  # writing it fails
    await broken.manager.run_once()
    results = [a["result"] for a in broken.manager.explain()["strategies"]["cpu_suppress"]["applied"]]
    assert any(r.startswith("failed") for r in results) and suppress_series(broken) == {}


@pytest.mark.asyncio
async def test_stale_metrics_change_nothing(env_factory: Any) -> None:
    env = env_factory(ON)
    env.store.write([Sample(model.NODE_CPU_USAGE, 1.0, ts=NOW - 10)])
    before = tree(env.root)
    await env.manager.run_once()
    assert tree(env.root) == before
    assert "no decision" in env.manager.explain()["strategies"]["cpu_suppress"]["plan"]["reason"]


def count_hand_offs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the functions handed to a worker thread from now on."""
    calls: list[str] = []
    real = asyncio.to_thread

    async def counted(func: Any, /, *args: Any, **kwargs: Any) -> Any:
        calls.append(func.__name__)
        return await real(func, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", counted)
    return calls


@pytest.mark.asyncio
async def test_a_round_that_evicts_nothing_writes_in_its_planning_hand_off(
        env_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: each hand-off wakes a worker and then the loop (~0.1-0.3 ms of CPU on a
    VM, more than the writes): a round plans, arbitrates and writes in one."""
    env = env_factory(ON)
    env.usage()
    calls = count_hand_offs(monkeypatch)
    await env.manager.run_once()
    assert calls == ["_plan_round"]
    assert env.read("cpuset", BE_DIR, "cpuset.cpus") == "0,2,4"
    assert env.manager.explain()["strategies"]["cpu_suppress"]["applied"][0]["result"] == "written"
    assert env.manager.be_state is not None  # the BE state in force, read in the same hand-off


@pytest.mark.asyncio
async def test_eviction_goes_through_the_runtime_and_wins_over_suppression(
        env_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    env = env_factory(ON)
    env.usage(mem=900.0)  # 90% >= 70%: release 220 -> the BE pod (300)
    calls = count_hand_offs(monkeypatch)
    await env.manager.run_once()
    assert env.runtime.stopped == ["cc"]
    # The eviction runs on the loop between the evicting plan's writes and the next plan's.
    assert calls == ["_plan_round", "_write_plans", "_write_plans"]
    assert env.registry.get_sample_value("koordlet_pod_eviction_total",
                                         {"node": "n1", "reason": "EvictPodByNodeMemoryUsage"}) == 1.0
    # the evicted pod's own dirs were left alone; the besteffort dir was still suppressed
    assert env.read("cpuset", BE.cgroup_dir, "cpuset.cpus") == "0-7"
    assert env.read("cpuset", BE_DIR, "cpuset.cpus") == "0,2,4"
    info = PodInfo(meta=PodMeta(name="c", namespace="ns", uid="c"))
    mine = env.manager.explain(info)["strategies"]
    assert mine["be_memory_evict"]["applied"][0]["result"] == "evicted"
    assert {r["reason"] for r in mine["cpu_suppress"]["rejected"]} == {"pod is being evicted"}
    assert env.manager.explain("a")["strategies"] == {}  # nothing concerned the LS pod
    await env.manager.run_once()  # cool-down and the pending set: no second eviction
    assert env.runtime.stopped == ["cc"]


@pytest.mark.asyncio
async def test_run_loop_wakes_early(env_factory: Any) -> None:
    env = env_factory(ON)
    env.usage()
    env.manager.cfg = ManagerConfig(interval=3600)
    rounds: list[float] = []
    original = env.manager.run_once

    async def counted() -> Any:
        rounds.append(NOW)
        return await original()

    env.manager.run_once = counted
    task = asyncio.create_task(env.manager.run())
    while len(rounds) < 1:
        await asyncio.sleep(0.01)
    env.manager.wake()
    async with asyncio.timeout(5):
        while len(rounds) < 2:
            await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.asyncio
async def test_release_on_stop_gives_be_its_cpus_back(env_factory: Any) -> None:
    env = env_factory({"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressPolicy": "cfsQuota"}})
    env.usage()
    await env.manager.run_once()
    suppressed = env.read("cpu", BE_DIR, "cpu.cfs_quota_us")
    assert suppressed != "-1"
    outcomes = env.manager.release()
    assert {o.result for o in outcomes} <= {"written", "unchanged"}
    assert env.read("cpu", BE_DIR, "cpu.cfs_quota_us") == "-1"
    assert env.read("cpuset", BE_DIR, "cpuset.cpus") == "0-7"


@pytest.mark.asyncio
async def test_release_in_dry_run_writes_nothing(env_factory: Any) -> None:
    env = env_factory({"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressPolicy": "cfsQuota"}}, dry_run=True)
    env.usage()
    before = tree(env.root)
    assert env.manager.release() == []
    assert tree(env.root) == before


@pytest.mark.asyncio
async def test_wakes_do_not_run_rounds_faster_than_the_samples_change(env_factory: Any) -> None:
    """Issue 29: under CPU pressure the PSI trigger fires every window; a woken round
    sooner than one collect interval after the last plans from the same samples, and
    ran the loop at the trigger rate (twice its cost on a busy host)."""
    env = env_factory(ON)
    env.usage()
    env.manager.cfg = ManagerConfig(interval=0.2, collect_interval=0.2)
    rounds: list[float] = []
    original = env.manager.run_once

    async def counted() -> Any:
        rounds.append(time.monotonic())
        return await original()

    env.manager.run_once = counted
    task = asyncio.create_task(env.manager.run())
    start = time.monotonic()
    while time.monotonic() - start < 1.0:
        env.manager.wake()  # a trigger every 20 ms
        await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gaps = [b - a for a, b in itertools.pairwise(rounds)]
    assert len(rounds) <= 7, f"{len(rounds)} rounds in 1 s at a 0.2 s collect interval"
    assert min(gaps) >= 0.19, gaps


def test_a_rounds_writes_are_cut_into_hand_offs_only_after_a_plan_that_evicts() -> None:
    from metrics.qos.manager import _cut_after_evictions
    from metrics.qos.plan import Evict, Plan, Priority

    def plan(name: str, evicts: bool = False) -> Plan:
        actions = (Evict("u", "ns/p", "test"),) if evicts else ()
        return Plan(name, Priority.SUPPRESS, actions, {}, "test")

    def names(plans: list[Plan]) -> list[list[str]]:
        return [[p.strategy for p in group] for group in _cut_after_evictions(plans)]

    assert names([]) == [[]]  # one hand-off all the same: the BE state is read
    assert names([plan("a"), plan("b")]) == [["a", "b"]]
    assert names([plan("a", True), plan("b"), plan("c")]) == [["a"], ["b", "c"]]
    assert names([plan("a"), plan("b", True)]) == [["a", "b"]]
    assert names([plan("a", True), plan("b", True)]) == [["a"], ["b"]]
