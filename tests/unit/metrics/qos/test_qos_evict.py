"""BE eviction: memory release, CPU satisfaction, victim order, cool-down, shared set, CRI evictor."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from criapi import cri_v1_pb2
from hooks.qos import QoSClass
from hooks.rules import ResourceThresholdStrategy
from metrics.model import ContainerView, PodView
from metrics.qos.evict import (
    CPU_NAME,
    EVICTION_POLICY,
    EVICTION_PRIORITY,
    LIST_CONTAINERS,
    MEMORY_NAME,
    STOP_CONTAINER,
    STOP_SANDBOX,
    CriEvictor,
    EvictConfig,
    EvictionError,
    EvictionMetrics,
    EvictionStrategy,
    Pending,
    carry_out,
)
from metrics.qos.inputs import BECPUWindow, NodeInputs
from metrics.qos.plan import Evict
from runtimeproxy.hookapi import CriCallError

MEM = ResourceThresholdStrategy(enable=True)  # threshold 70, lower 68
CPU = ResourceThresholdStrategy(enable=True, cpu_evict_be_satisfaction_lower_percent=30,
                                cpu_evict_be_satisfaction_upper_percent=80, cpu_evict_time_window_seconds=10)


def be(name: str, *, priority: int = 5500, batch_milli: int = 0, annotations: dict[str, str] | None = None,
       qos: QoSClass = QoSClass.BE) -> PodView:
    return PodView(uid=name, namespace="ns", name=name, sandbox_id=name, qos=qos, priority=priority,
                   priority_class="koord-batch", cgroup_dir=f"kubepods/besteffort/pod{name}",
                   kube_qos="besteffort" if qos is QoSClass.BE else "burstable", annotations=annotations or {},
                   batch_cpu_request_milli=batch_milli,
                   containers=(ContainerView(id=f"{name}-c", name="main", cgroup_dir=f"x/{name}-c"),))


def node(pods: tuple[PodView, ...], mem: Mapping[str, float] | None = None, used: float | None = 750.0,
         cpu: Mapping[str, float] | None = None, now: float = 100.0) -> NodeInputs:
    return NodeInputs(now=now, capacity_cores=16.0, reserved_cores=0.0, pods=pods, node_cpu_used=8.0,
                      node_memory_used=used, node_memory_total=1000.0, pod_memory_used=mem or {},
                      pod_cpu_used=cpu or {})


def victims(plan_actions: tuple[object, ...]) -> list[str]:
    return [a.pod_uid for a in plan_actions if isinstance(a, Evict)]


def test_memory_release_by_hand() -> None:
    # 75% >= 70%: release 1000 x (75 - 68)% = 70 -> x (50) then y (30); z (no usage) spared
    pods = (be("x"), be("y"), be("z"), be("ls", qos=QoSClass.LS))
    plan = EvictionStrategy(EvictConfig()).plan_memory(node(pods, {"x": 50, "y": 30, "ls": 900}), MEM)
    assert victims(plan.actions) == ["x", "y"]
    assert plan.inputs["release_bytes"] == pytest.approx(70)
    assert [a.released_memory for a in plan.actions if isinstance(a, Evict)] == [50, 30]


def test_below_threshold_or_missing_usage_evicts_nothing() -> None:
    strategy = EvictionStrategy(EvictConfig())
    assert strategy.plan_memory(node((be("x"),), {"x": 50}, used=650.0), MEM).actions == ()
    stale = strategy.plan_memory(node((be("x"),), {"x": 50}, used=None), MEM)
    assert stale.actions == () and "missing" in stale.reason
    assert strategy.plan_memory(node((be("x"),), {"x": 50}), ResourceThresholdStrategy()).actions == ()


def test_victim_order_annotation_priority_usage_name() -> None:
    pods = (be("big", priority=5500), be("low", priority=5000), be("pinned", annotations={EVICTION_PRIORITY: "-5"}),
            be("p", priority=5500), be("q", priority=5500))
    mem = {"big": 60, "low": 1, "pinned": 1, "p": 10, "q": 10}
    plan = EvictionStrategy(EvictConfig()).plan_memory(node(pods, mem, used=1000.0), MEM)  # release 320: all
    assert victims(plan.actions) == ["pinned", "low", "big", "q", "p"]


def test_eviction_policy_annotation_opts_a_pod_out() -> None:
    pods = (be("x", annotations={EVICTION_POLICY: json.dumps([CPU_NAME, "BECPUEvict"])}), be("y"))
    plan = EvictionStrategy(EvictConfig()).plan_memory(node(pods, {"x": 50, "y": 30}), MEM)
    assert victims(plan.actions) == ["y"]


def test_pending_evictions_count_and_cool_down() -> None:
    strategy = EvictionStrategy(EvictConfig())
    pods = (be("x"), be("y"))
    strategy.tracker.add(Pending("x", 90.0, 0.0, 50.0))
    plan = strategy.plan(node(pods, {"x": 50, "y": 30}), None, MEM)[0]
    assert victims(plan.actions) == ["y"]  # 70 - 50 pending = 20 still needed; x is already going
    strategy.on_evicted(MEMORY_NAME, pods[1], node(pods, {"x": 50, "y": 30}))
    cooling = strategy.plan_memory(node(pods, {"x": 50, "y": 30}, now=103.9), MEM)
    assert cooling.actions == () and cooling.inputs["cool_down_until"] == 104.0
    # both pending (80 >= 70): nothing more to do once the cool-down is over
    assert strategy.plan_memory(node(pods, {"x": 50, "y": 30}, now=104.0), MEM).actions == ()
    strategy.tracker.prune(["y"])  # x is gone: its release happened
    assert "x" not in strategy.tracker and "y" in strategy.tracker


def window(count: int = 10, usage: float = 1.9, request: float = 10.0, limit: float = 2.0,
           limit_last: float = 2.5) -> BECPUWindow:
    return BECPUWindow(count=count, span=float(count), usage_avg=usage, request_avg=request, limit_avg=limit,
                       usage_last=usage, request_last=request, limit_last=limit_last)


CPU_PODS = (be("p1", batch_milli=4000), be("p2", batch_milli=3000), be("p3", batch_milli=3000), be("none"))
CPU_USE = {"p1": 3.0, "p2": 2.9, "p3": 1.0, "none": 5.0}


def test_cpu_satisfaction_release_by_hand() -> None:
    # satisfaction 2/10 = 0.2 <= 0.3; by avg 10 x (0.8 - 0.2) = 6, by last 10 x (0.8 - 0.25) = 5.5
    plan = EvictionStrategy(EvictConfig()).plan_cpu(node(CPU_PODS, cpu=CPU_USE), window(), CPU)
    assert plan.inputs["release_cores"] == pytest.approx(5.5)
    # usage/request desc: p2 (0.97) then p1 (0.75) = 7 cores >= 5.5; "none" has no request
    assert victims(plan.actions) == ["p2", "p1"]
    assert [a.released_cpu for a in plan.actions if isinstance(a, Evict)] == [3.0, 4.0]


@pytest.mark.parametrize(
    ("win", "why"),
    [(window(usage=1.0), "not starved"), (window(limit=4.0, usage=3.8), "above"), (window(count=3), "too few"),
     (None, "too few"), (window(limit_last=9.0), "recovered")],
)
def test_cpu_no_eviction_cases(win: BECPUWindow | None, why: str) -> None:
    plan = EvictionStrategy(EvictConfig()).plan_cpu(node(CPU_PODS, cpu=CPU_USE), win, CPU)
    assert plan.actions == () and why in plan.reason


def test_cpu_needs_both_satisfaction_bounds() -> None:
    plan = EvictionStrategy(EvictConfig()).plan_cpu(node(CPU_PODS, cpu=CPU_USE), window(), MEM)
    assert plan.actions == ()


def test_memory_and_cpu_tasks_share_the_round() -> None:
    # memory takes p2 (biggest memory, 200 >= 70); the cpu task counts its 3 cores as released
    mem = {"p1": 10, "p2": 200, "p3": 10}
    memory, cpu = EvictionStrategy(EvictConfig()).plan(node(CPU_PODS, mem, cpu=CPU_USE), window(), CPU)
    assert victims(memory.actions) == ["p2"]
    assert cpu.inputs["pending_cores"] == 3.0 and victims(cpu.actions) == ["p1"]


class FakeRuntime:
    """The runtime behind the proxy (an OS boundary), with containerd's rules: StopContainer
    on a container not yet started answers OK and does nothing; a stopped sandbox refuses
    StartContainer. Records the stop calls."""

    def __init__(self, errors: dict[str, str], states: dict[str, Any] | None = None) -> None:
        self.errors = errors
        self.stopped: list[tuple[str, int]] = []
        self.sandboxes_stopped: list[str] = []
        #: container id -> CRI state (the runtime's own list; absent: the view's ids, RUNNING).
        self.states = states

    def start(self, cid: str) -> None:
        """StartContainer as containerd answers it."""
        if self.sandboxes_stopped:
            raise CriCallError("StartContainer", "UNKNOWN", "sandbox container is not running")
        assert self.states is not None
        self.states[cid] = cri_v1_pb2.CONTAINER_RUNNING

    async def __call__(self, method: str, payload: bytes, timeout: float) -> bytes:
        if method == STOP_SANDBOX:
            sid = cri_v1_pb2.StopPodSandboxRequest.FromString(payload).pod_sandbox_id
            self.sandboxes_stopped.append(sid)
            for cid, state in (self.states or {}).items():
                if state == cri_v1_pb2.CONTAINER_RUNNING:
                    self.states[cid] = cri_v1_pb2.CONTAINER_EXITED  # type: ignore[index]
            return b""
        if method == LIST_CONTAINERS:
            states = self.states or {}
            return cri_v1_pb2.ListContainersResponse(containers=[
                cri_v1_pb2.Container(id=cid, metadata=cri_v1_pb2.ContainerMetadata(name=cid), state=state)
                for cid, state in states.items() if state == cri_v1_pb2.CONTAINER_RUNNING]).SerializeToString()
        assert method == STOP_CONTAINER
        request = cri_v1_pb2.StopContainerRequest.FromString(payload)
        self.stopped.append((request.container_id, request.timeout))
        code = self.errors.get(request.container_id)
        if code:
            raise CriCallError(method, code, "boom")
        if self.states is not None and self.states.get(request.container_id) == cri_v1_pb2.CONTAINER_RUNNING:
            self.states[request.container_id] = cri_v1_pb2.CONTAINER_EXITED
        return b""


def _pod(*containers: str) -> PodView:
    return PodView(uid="u", namespace="ns", name="n", sandbox_id="s", qos=QoSClass.BE, priority=0, priority_class="",
                   cgroup_dir="d", containers=tuple(ContainerView(c, c, f"d/{c}") for c in containers))


@pytest.mark.asyncio
async def test_cri_evictor_stops_every_container_now() -> None:
    pod = PodView(uid="u", namespace="ns", name="n", sandbox_id="s", qos=QoSClass.BE, priority=0, priority_class="",
                  cgroup_dir="d", containers=(ContainerView("c1", "a", "d/c1"), ContainerView("c2", "b", "d/c2")))
    runtime = FakeRuntime({"c1": "NOT_FOUND"})
    await CriEvictor(runtime).evict(pod, "test")
    assert runtime.stopped == [("c1", 0), ("c2", 0)]
    assert runtime.sandboxes_stopped == ["s"]
    failing = FakeRuntime({"c1": "UNAVAILABLE"})
    with pytest.raises(EvictionError, match="a: UNAVAILABLE"):
        await CriEvictor(failing).evict(pod, "test")
    assert [c for c, _ in failing.stopped] == ["c1", "c2"]  # the rest are still tried


@pytest.mark.asyncio
async def test_an_eviction_before_start_container_keeps_the_pod_down() -> None:
    # The race seen under load: the manager evicts a BE pod between RunPodSandbox /
    # CreateContainer and StartContainer. StopContainer on a CREATED container is a no-op,
    # and a container the pod view does not know yet is not stopped at all; the eviction
    # used to count as done and the pod, remembered as evicted, then ran for good.
    for view, states in (((), {}), (("c1",), {"c1": cri_v1_pb2.CONTAINER_CREATED})):
        runtime = FakeRuntime({}, states)
        await CriEvictor(runtime).evict(_pod(*view), "test")
        assert runtime.sandboxes_stopped == ["s"]
        with pytest.raises(CriCallError, match="sandbox container is not running"):
            runtime.start("c1")  # kubelet's StartContainer, landing after the eviction
        assert runtime.states == ({"c1": cri_v1_pb2.CONTAINER_CREATED} if view else {})


@pytest.mark.asyncio
async def test_an_eviction_that_leaves_a_container_running_fails() -> None:
    # Still running after the stops (the runtime did not do it): not done, so it is
    # neither counted nor remembered, and the next round tries again.
    class Stubborn(FakeRuntime):
        async def __call__(self, method: str, payload: bytes, timeout: float) -> bytes:
            if method in (STOP_SANDBOX, STOP_CONTAINER):
                return b""
            return await super().__call__(method, payload, timeout)

    runtime = Stubborn({}, {"c1": cri_v1_pb2.CONTAINER_RUNNING})
    with pytest.raises(EvictionError, match="c1: still running"):
        await CriEvictor(runtime).evict(_pod("c1"), "test")
    registry = CollectorRegistry()
    action = Evict("u", "ns/n", "node memory 75% >= 70%", 0.0, 50.0)
    assert not await carry_out(CriEvictor(runtime), _pod("c1"), action, MEMORY_NAME, EvictionMetrics(registry, "n"))
    assert registry.get_sample_value("koordlet_pod_eviction_total",
                                     {"node": "n", "reason": "EvictPodByNodeMemoryUsage"}) is None


@pytest.mark.asyncio
async def test_every_eviction_counts_and_logs(capsys: pytest.CaptureFixture[str]) -> None:
    registry = CollectorRegistry()
    metrics = EvictionMetrics(registry, "node-1")
    pod = be("x")
    action = Evict("x", "ns/x", "node memory 75% >= 70%", 0.0, 50.0)
    assert await carry_out(CriEvictor(FakeRuntime({})), pod, action, MEMORY_NAME, metrics)
    assert not await carry_out(CriEvictor(FakeRuntime({"x-c": "INTERNAL"})), pod, action, MEMORY_NAME, metrics)
    labels = {"node": "node-1", "reason": "EvictPodByNodeMemoryUsage"}
    assert registry.get_sample_value("koordlet_pod_eviction_total", labels) == 1.0
    out = capsys.readouterr().out
    assert out.count("pod_evicted") == 1 and out.count("pod_eviction_failed") == 1
    EvictionMetrics(None, "node-1").inc(MEMORY_NAME)  # no registry: nothing exported, no error


def test_a_pod_restarted_under_its_uid_or_evicted_too_long_ago_is_no_longer_pending() -> None:
    """Issue 28 item 4: kubelet restarts a pod stopped through the CRI (same UID, new
    sandbox): it is not being evicted any more, and usage over the threshold evicts again;
    a pod still there PENDING_MAX_AGE after its eviction no longer counts either."""
    from dataclasses import replace

    from metrics.qos.evict import PENDING_MAX_AGE

    strategy = EvictionStrategy(EvictConfig())
    x, y = be("x"), be("y")
    strategy.on_evicted(MEMORY_NAME, x, node((x, y), {"x": 80, "y": 30}))  # at 100, sandbox "x"
    held = strategy.plan(node((x, y), {"x": 80, "y": 30}, now=105.0), None, MEM)[0]
    assert held.actions == () and held.reason == "covered by pods already being evicted"
    again = replace(x, sandbox_id="x-restarted")  # kubelet ran the pod again
    plan = strategy.plan(node((again, y), {"x": 80, "y": 30}, now=106.0), None, MEM)[0]
    assert victims(plan.actions) == ["x"] and "x" not in strategy.tracker
    strategy.on_evicted(MEMORY_NAME, again, node((again, y), {"x": 80, "y": 30}, now=106.0))
    assert strategy.plan(node((again, y), {"x": 80}, now=106.0 + PENDING_MAX_AGE), None, MEM)[0].actions == ()
    late = strategy.plan(node((again, y), {"x": 80}, now=106.5 + PENDING_MAX_AGE), None, MEM)[0]
    assert victims(late.actions) == ["x"]
