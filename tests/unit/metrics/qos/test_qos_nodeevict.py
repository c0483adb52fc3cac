"""Node-level eviction worked by hand: cpu-evict (node CPU over a window) and
allocatable-evict (batch requests over allocatable), sharing the BE evictors' pending
set, cool-down and round; then one round through the real manager and runtime evictor."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from criapi import cri_v1_pb2
from hooks.cgroups import CgroupLayout
from hooks.executor import CgroupExecutor
from hooks.qos import QoSClass
from hooks.rules import ResourceThresholdStrategy, parse_rules
from metrics import model
from metrics.model import ContainerView, PodView, Sample, labels
from metrics.qos import evict
from metrics.qos.evict import EVICTION_POLICY, STOP_CONTAINER, CriEvictor, EvictConfig, Pending, SharedEviction
from metrics.qos.inputs import NodeInputs
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.qos.nodeevict import (
    CPU_ALLOCATABLE,
    EVICTION_ENABLED,
    MEMORY_ALLOCATABLE,
    RESOURCES,
    Allocatable,
    AllocatableEvict,
    CPUEvict,
    CPUWindow,
    allocatable_evict,
)
from metrics.qos.plan import Evict
from metrics.qos.strategy import StrategyInit
from metrics.store.tsdb import TSDB
from runtimeproxy.hookapi import HookConfigError

GIB = 1 << 30
ON = ResourceThresholdStrategy(enable=True, cpu_evict_threshold_percent=80, cpu_evict_time_window_seconds=10)
ALLOC = ResourceThresholdStrategy(enable=True, cpu_allocatable_evict_threshold_percent=110,
                                  memory_allocatable_evict_threshold_percent=110)


def pod(name: str, *, priority: int = 5500, enabled: bool = True, batch_milli: int = 0, batch_mem: int = 0,
        annotations: dict[str, str] | None = None) -> PodView:
    return PodView(uid=name, namespace="ns", name=name, sandbox_id=name, qos=QoSClass.BE, priority=priority,
                   priority_class="koord-batch", cgroup_dir=f"kubepods/besteffort/pod{name}", kube_qos="besteffort",
                   labels={EVICTION_ENABLED: "true"} if enabled else {}, annotations=annotations or {},
                   batch_cpu_request_milli=batch_milli, batch_memory_request=batch_mem,
                   containers=(ContainerView(id=f"{name}-c", name="main", cgroup_dir=f"x/{name}-c"),))


def node(pods: tuple[PodView, ...], cpu: dict[str, float] | None = None, now: float = 100.0) -> NodeInputs:
    return NodeInputs(now=now, capacity_cores=16.0, reserved_cores=0.0, pods=pods, node_cpu_used=14.0,
                      pod_cpu_used=cpu or {}, pod_memory_used={})


def victims(actions: tuple[object, ...]) -> list[str]:
    return [a.pod_uid for a in actions if isinstance(a, Evict)]


PODS = (pod("a"), pod("b"), pod("c", enabled=False), pod("d", priority=9500), pod("e"))
USAGE = {"a": 1.0, "b": 0.8, "c": 3.0, "d": 2.0, "e": 0.0}
WINDOW = CPUWindow(span=10, count=10, avg=14.0)  # 14 / 16 = 87.5 %


def test_cpu_evict_release_by_hand() -> None:
    # 87.5% >= 80%: release 16 x (87.5 - 78)% = 1.52 cores of usage. c is not labelled,
    # d is prod (9500 > 5999), e uses nothing: a (1.0) then b (0.8) cover it
    strategy = CPUEvict(EvictConfig(), SharedEviction())
    plan = strategy.plan_cpu(node(PODS, USAGE), WINDOW, ON, evict.EvictRound())
    assert victims(plan.actions) == ["a", "b"]
    assert plan.inputs["release_cores"] == pytest.approx(1.52)
    assert [a.released_cpu for a in plan.actions if isinstance(a, Evict)] == [1.0, 0.8]
    # lower set explicitly: 16 x (87.5 - 85)% = 0.4 -> a alone
    lower = ResourceThresholdStrategy(enable=True, cpu_evict_threshold_percent=86, cpu_evict_lower_percent=85)
    plan = CPUEvict(EvictConfig(), SharedEviction()).plan_cpu(node(PODS, USAGE), WINDOW, lower, evict.EvictRound())
    assert victims(plan.actions) == ["a"]


def test_cpu_evict_priority_threshold_and_policy_annotation() -> None:
    prod = ResourceThresholdStrategy(enable=True, cpu_evict_threshold_percent=80,
                                     evict_enabled_priority_threshold=9999)
    pods = (PODS[2], PODS[3], pod("f", annotations={EVICTION_POLICY: '["BECPUEvict"]'}))
    cpu = {**USAGE, "f": 5.0}
    plan = CPUEvict(EvictConfig(), SharedEviction()).plan_cpu(node(pods, cpu), WINDOW, prod, evict.EvictRound())
    assert victims(plan.actions) == ["d"]  # d (prod, 2.0) now allowed; f does not opt in to CPUEvict


@pytest.mark.parametrize(("window", "why"), [
    (CPUWindow(10, 10, 12.0), "below threshold"),  # 75 %
    (CPUWindow(10, 3, 14.0), "too few"),  # 3 x 1 s < 10 / 3
    (CPUWindow(10, 0, None), "too few"),
])
def test_cpu_evict_makes_no_decision_without_cause(window: CPUWindow, why: str) -> None:
    plan = CPUEvict(EvictConfig(), SharedEviction()).plan_cpu(node(PODS, USAGE), window, ON, evict.EvictRound())
    assert plan.actions == () and why in plan.reason
    off = ResourceThresholdStrategy(enable=True)
    assert CPUEvict(EvictConfig(), SharedEviction()).plan_cpu(node(PODS, USAGE), WINDOW, off,
                                                               evict.EvictRound()).actions == ()


def test_cpu_evict_shares_pending_round_and_cool_down_with_the_be_evictors() -> None:
    shared = SharedEviction()
    shared.tracker.add(Pending("x", 90.0, 1.0, 0.0))  # 1.0 core pending from an earlier round
    current = evict.EvictRound([PODS[0]])  # a chosen by another task this round
    strategy = CPUEvict(EvictConfig(), shared)
    plan = strategy.plan_cpu(node((*PODS, pod("x")), USAGE), WINDOW, ON, current)
    # need 1.52 - (1.0 pending + 1.0 for a) < 0
    assert plan.actions == () and "covered" in plan.reason
    shared2 = SharedEviction()
    strategy = CPUEvict(EvictConfig(), shared2)
    first = strategy.plan_cpu(node(PODS, USAGE), WINDOW, ON, evict.EvictRound())
    action = first.actions[0]
    assert isinstance(action, Evict)
    shared2.on_evicted("cpu_evict", PODS[0], node(PODS, USAGE), action)
    assert shared2.tracker.pending_cpu() == 1.0  # the usage it counted on, not a request
    again = strategy.plan_cpu(node(PODS, USAGE, now=110.0), WINDOW, ON, evict.EvictRound())
    assert again.actions == () and again.reason == "cooling down"
    # the BE CPU-satisfaction task belongs to the same evictor: it cools down too
    assert shared2.cooling(evict.CPU_NAME, 110.0, 20.0) == 120.0
    assert shared2.cooling(evict.MEMORY_NAME, 110.0, 4.0) is None


def alloc_plan(pods: tuple[PodView, ...], cpu_milli: float | None = 10_000, mem: float | None = 10 * GIB,
               t: ResourceThresholdStrategy = ALLOC, shared: SharedEviction | None = None,
               current: evict.EvictRound | None = None) -> dict[str, object]:
    strategy = AllocatableEvict(EvictConfig(), shared or SharedEviction(), lambda: Allocatable(cpu_milli, mem))
    return {r.plan: strategy.plan_resource(r, node(pods), Allocatable(cpu_milli, mem), t,
                                           current or evict.EvictRound()) for r in RESOURCES}


BATCH = (pod("x", batch_milli=4000, batch_mem=3 * GIB), pod("y", batch_milli=5000, batch_mem=2 * GIB),
         pod("z", batch_milli=3000, batch_mem=4 * GIB), pod("p", priority=9500, batch_milli=8000))


def test_allocatable_evict_release_by_hand() -> None:
    plans = alloc_plan(BATCH)
    cpu, mem = plans[CPU_ALLOCATABLE], plans[MEMORY_ALLOCATABLE]
    # cpu: (4 + 5 + 3) / 10 = 120% > 110% (p is prod: not counted) -> release 12 - 100% x 10 = 2 -> y (5) first
    assert cpu.inputs["request_percent"] == pytest.approx(120) and cpu.inputs["release"] == pytest.approx(2)
    assert victims(cpu.actions) == ["y"]
    # memory: 9 GiB / 10 GiB = 90% <= 110%: nothing
    assert mem.actions == () and mem.reason == "within threshold"


def test_allocatable_evict_needs_the_key_the_allocatable_and_counts_leaving_pods() -> None:
    off = alloc_plan(BATCH, t=ResourceThresholdStrategy(enable=True))
    assert all(p.actions == () and "unset" in p.reason for p in off.values())
    unknown = alloc_plan(BATCH, cpu_milli=None)[CPU_ALLOCATABLE]
    assert unknown.actions == () and "allocatable unknown" in unknown.reason
    shared = SharedEviction()
    shared.tracker.add(Pending("y", 90.0, 5.0, 0.0))  # y is already leaving: (4 + 3) / 10 = 70%
    assert alloc_plan(BATCH, shared=shared)[CPU_ALLOCATABLE].actions == ()
    # memory over: 9 GiB of 6 GiB = 150% -> release 3 GiB: z (4 GiB) first
    low = alloc_plan(BATCH, mem=6 * GIB)[MEMORY_ALLOCATABLE]
    assert victims(low.actions) == ["z"] and low.inputs["release"] == 3 * GIB


def test_allocatable_args_override_and_bad_args_are_named(tmp_path: Path) -> None:
    init = StrategyInit(name="allocatable-evict", args={"batch_cpu_milli": 10_000}, key_path="s.args",
                        config=ManagerConfig(), topology=[], executor=CgroupExecutor(CgroupLayout(tmp_path, version=1)))
    strategy = allocatable_evict(init)
    assert strategy.allocatable.read(None) == Allocatable(10_000.0, None)  # type: ignore[arg-type]
    with pytest.raises(HookConfigError) as err:
        allocatable_evict(StrategyInit(name="a", args={"batch_cpu_milli": -1}, key_path="s.args",
                                       config=ManagerConfig(), topology=[], executor=init.executor))
    assert (err.value.key_path, err.value.value) == ("s.args.batch_cpu_milli", -1)
    with pytest.raises(HookConfigError) as err:
        allocatable_evict(StrategyInit(name="a", args={"cpu": 1}, key_path="s.args", config=ManagerConfig(),
                                       topology=[], executor=init.executor))
    assert err.value.key_path == "s.args.cpu"


class FakeRuntime:
    def __init__(self) -> None:
        self.stopped: list[str] = []

    async def __call__(self, method: str, payload: bytes, timeout: float) -> bytes:
        if method == STOP_CONTAINER:
            self.stopped.append(cri_v1_pb2.StopContainerRequest.FromString(payload).container_id)
        return b""


@pytest.mark.asyncio
async def test_cpu_evict_through_the_manager(tmp_path: Path) -> None:
    now = 5_000.0
    store = TSDB(tmp_path / "m.db", clock=lambda: now)
    try:
        # 8 CPUs busy at 7.2 cores (90%) for the whole 5 s window; threshold 80, lower 78
        store.write([Sample(model.NODE_CPU_USAGE, 7.2, ts=now - i) for i in range(5)])
        store.write([Sample(model.POD_CPU_USAGE, 1.5, labels(pod_uid="a"), now - 0.5),
                     Sample(model.POD_CPU_USAGE, 0.5, labels(pod_uid="b"), now - 0.5)])
        store.flush()  # window aggregates read the file, as the agent's flushes make them
        (tmp_path / "cgroup" / "cpu").mkdir(parents=True)
        executor = CgroupExecutor(CgroupLayout(tmp_path / "cgroup", version=1))
        init = StrategyInit(name="", args={}, key_path="s", config=ManagerConfig(), topology=[], executor=executor)
        from metrics.qos.builtin import be_evict
        from metrics.qos.nodeevict import cpu_evict
        strategies = [be_evict(init), cpu_evict(init)]
        runtime, registry = FakeRuntime(), CollectorRegistry()
        rules = parse_rules({"resourceUsedThresholdWithBE": {"enable": True, "cpuEvictThresholdPercent": 80,
                                                             "cpuEvictTimeWindowSeconds": 5}})
        manager = QoSManager(reader=store, pods=lambda: [pod("a"), pod("b")], topology=[], executor=executor,
                             evictor=CriEvictor(runtime), rules=lambda: rules,
                             config=ManagerConfig(capacity_cores=8.0, node_name="n1"), registry=registry,
                             clock=lambda: now, strategies=strategies)
        await manager.run_once()
        # release 8 x (90 - 78)% = 0.96 cores: a (1.5) covers it
        assert runtime.stopped == ["a-c"]
        assert registry.get_sample_value("koordlet_pod_eviction_total",
                                         {"node": "n1", "reason": "EvictPodByNodeCPUUsage"}) == 1.0
        entry = manager.explain()["strategies"]["cpu_evict"]
        assert entry["owner"] == "cpu-evict" and entry["applied"][0]["result"] == "evicted"
        assert entry["plan"]["inputs"]["release_cores"] == pytest.approx(0.96)
        assert manager.explain()["inputs"]["node_cpu_window"]["samples"] == 5
        await manager.run_once()  # pending + cool-down: no second eviction
        assert runtime.stopped == ["a-c"]
        assert init.eviction.cooling("be_cpu_evict", now, 20.0) == now + 20.0  # the one both evictors share
    finally:
        store.close()
