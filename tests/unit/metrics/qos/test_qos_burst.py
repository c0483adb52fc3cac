"""CPU burst: cfs_burst_us, CFS quota scale up/down/clamp, share-pool state, token bucket."""

from __future__ import annotations

import json

import pytest

from hooks.qos import QoSClass
from hooks.rules import CPUBurstStrategy
from metrics.model import ContainerView, PodView
from metrics.qos.burst import (
    ANNOTATION,
    CPU_CFS_BURST,
    BurstStrategy,
    NodeState,
    Op,
    TokenBucket,
    adjust_op,
    burst_us,
    scaled_quota,
    share_pool_state,
)
from metrics.qos.inputs import NodeInputs
from metrics.qos.plan import LeveledWrite, SetCgroup

QUOTA_ONLY = CPUBurstStrategy(policy="cfsQuotaBurstOnly")


def ctr(pod_dir: str, cid: str, quota: int, period: int = 100_000) -> ContainerView:
    return ContainerView(id=cid, name=cid, cgroup_dir=f"{pod_dir}/{cid}", cpu_quota=quota, cpu_period=period)


def pod(uid: str, qos: QoSClass, quotas: tuple[int, ...], annotations: dict[str, str] | None = None) -> PodView:
    kube = "besteffort" if qos is QoSClass.BE else "burstable"
    d = f"kubepods/{kube}/pod{uid}"
    return PodView(uid=uid, namespace="ns", name=uid, sandbox_id=uid, qos=qos, priority=0, priority_class="",
                   cgroup_dir=d, kube_qos=kube, annotations=annotations or {},
                   containers=tuple(ctr(d, f"{uid}{i}", q) for i, q in enumerate(quotas)))


LS = pod("a", QoSClass.LS, (100_000, 200_000))
LSR = pod("r", QoSClass.LSR, (200_000,))
BE = pod("b", QoSClass.BE, (100_000,))


def inputs(pods: tuple[PodView, ...] = (LS, LSR, BE), throttled: dict[str, float] | None = None,
           node_avg: float | None = 4.0, now: float = 100.0) -> NodeInputs:
    return NodeInputs(now=now, capacity_cores=8.0, reserved_cores=0.0, pods=pods, node_cpu_used=4.0,
                      container_throttled={"a0": 0.3, "a1": 0.0} if throttled is None else throttled,
                      node_cpu_avg=node_avg, pod_cpu_avg={"a": 2.0, "r": 1.0, "b": 0.5})


def quotas(a0: int = 100_000, a1: int = 200_000, pod_a: int = 300_000) -> dict[str, int]:
    return {"kubepods/burstable/poda": pod_a, "kubepods/burstable/poda/a0": a0, "kubepods/burstable/poda/a1": a1,
            "kubepods/burstable/podr/r0": 200_000, "kubepods/besteffort/podb/b0": 100_000}


def test_burst_us_is_limit_times_percent_capped_at_the_quota() -> None:
    assert burst_us(ctr("p", "c", 200_000), 50) == 100_000  # 2 cores x 50% x 100 ms
    assert burst_us(ctr("p", "c", 200_000), 1000) == 200_000  # 2 s asked, kernel allows <= quota
    assert burst_us(ctr("p", "c", 100_000, 50_000), 25) == 50_000  # 2 cores x 25% x 100 ms
    assert burst_us(ctr("p", "c", -1), 100) is None


@pytest.mark.parametrize(
    ("op", "current", "expected"),
    [(Op.UP, 100_000, 120_000), (Op.UP, 280_000, 300_000), (Op.DOWN, 120_000, 100_000),
     (Op.DOWN, 200_000, 160_000), (Op.REMAIN, 150_000, 150_000), (Op.RESET, 250_000, 100_000),
     (Op.REMAIN, 400_000, 300_000)],
)
def test_quota_scaling_and_clamp(op: Op, current: int, expected: int) -> None:
    assert scaled_quota(op, current, 100_000, 300) == expected


def test_node_state_adjusts_the_op() -> None:
    assert adjust_op(Op.UP, NodeState.OVERLOAD) is Op.DOWN
    assert adjust_op(Op.REMAIN, NodeState.OVERLOAD) is Op.DOWN
    assert adjust_op(Op.UP, NodeState.COOLING) is Op.REMAIN
    assert adjust_op(Op.UP, NodeState.UNKNOWN) is Op.REMAIN
    assert adjust_op(Op.UP, NodeState.IDLE) is Op.UP
    assert adjust_op(Op.DOWN, NodeState.IDLE) is Op.DOWN


@pytest.mark.parametrize(("threshold", "state"), [(50, NodeState.IDLE), (45, NodeState.COOLING),
                                                  (40, NodeState.OVERLOAD)])
def test_share_pool_state_by_hand(threshold: int, state: NodeState) -> None:
    # pool = 8 - 2 (LSR request) = 6; used = 4.0 - 1.0 (LSR) - 0.5 (BE) = 2.5; ratio 0.4167
    got, ratio = share_pool_state(inputs(), threshold)
    assert got is state
    assert ratio == pytest.approx(2.5 / 6)


def test_share_pool_unknown_without_averages() -> None:
    assert share_pool_state(inputs(node_avg=None), 50)[0] is NodeState.UNKNOWN


def test_token_bucket_spends_and_refills() -> None:
    bucket = TokenBucket(period_seconds=10, burst_percent=300, now=0.0)  # capacity 10 x 200 = 2000
    assert bucket.update(250, 5.0) and bucket.tokens == 1250  # spends 150 x 5
    assert not bucket.update(300, 15.0) and bucket.tokens == -750  # spends 200 x 10
    assert not bucket.update(20, 20.0) and bucket.tokens == -350  # earns 80 x 5
    assert bucket.update(20, 30.0) and bucket.tokens == 450
    bucket.update(0, 1000.0)
    assert bucket.tokens == 2000  # never above capacity


def test_throttled_container_scales_up_and_the_pod_quota_follows() -> None:
    plan = BurstStrategy().plan(inputs(), QUOTA_ONLY, quotas())
    (write,) = plan.actions
    assert isinstance(write, LeveledWrite)
    assert [[(str(i.cgroup), i.value) for i in lv] for lv in write.levels] == [
        [("kubepods/burstable/poda", 320_000)], [("kubepods/burstable/poda/a0", 120_000)]]
    assert plan.inputs["node_state"] == "idle"


def test_overload_scales_down_to_the_base() -> None:
    plan = BurstStrategy().plan(inputs(), CPUBurstStrategy(policy="auto", share_pool_threshold_percent=40,
                                                           cpu_burst_percent=0), quotas(a0=120_000, pod_a=320_000))
    leveled = [a for a in plan.actions if isinstance(a, LeveledWrite)]
    assert [[(str(i.cgroup), i.value) for i in lv] for lv in leveled[0].levels] == [
        [("kubepods/burstable/poda", 300_000)], [("kubepods/burstable/poda/a0", 100_000)]]


def test_missing_throttle_sample_means_no_decision_and_lsr_be_are_never_touched() -> None:
    plan = BurstStrategy().plan(inputs(throttled={"r0": 0.9, "b0": 0.9}), QUOTA_ONLY, quotas())
    assert plan.actions == ()


def test_policy_off_resets_only_what_it_raised() -> None:
    strategy = BurstStrategy()
    strategy.plan(inputs(), QUOTA_ONLY, quotas())  # raises a0
    assert strategy.quota_dirs((LS,), CPUBurstStrategy()) == [
        "kubepods/burstable/poda", "kubepods/burstable/poda/a0"]
    plan = strategy.plan(inputs(), CPUBurstStrategy(), quotas(a0=120_000, pod_a=320_000, a1=250_000))
    (write,) = plan.actions
    assert isinstance(write, LeveledWrite)
    # a0 back to its CRI quota; a1 (250000, not ours) left alone
    assert [(str(i.cgroup), i.value) for i in write.items()] == [
        ("kubepods/burstable/poda", 300_000), ("kubepods/burstable/poda/a0", 100_000)]
    assert strategy.plan(inputs(), CPUBurstStrategy(), quotas()).actions == ()


def test_cpu_burst_sets_containers_and_the_pod_sum_then_resets_to_zero() -> None:
    strategy = BurstStrategy()
    on = strategy.plan(inputs(throttled={}), CPUBurstStrategy(policy="cpuBurstOnly", cpu_burst_percent=50), quotas())
    values = {str(a.cgroup): a.value for a in on.actions if isinstance(a, SetCgroup)}
    assert values == {"kubepods/burstable/poda/a0": 50_000, "kubepods/burstable/poda/a1": 100_000,
                      "kubepods/burstable/poda": 150_000}
    assert all(a.resource is CPU_CFS_BURST for a in on.actions if isinstance(a, SetCgroup))
    off = strategy.plan(inputs(throttled={}), CPUBurstStrategy(), quotas())
    assert {a.value for a in off.actions if isinstance(a, SetCgroup)} == {0}
    assert strategy.plan(inputs(throttled={}), CPUBurstStrategy(), quotas()).actions == ()


def test_pod_annotation_overrides_and_a_bad_one_is_reported_once(capsys: pytest.CaptureFixture[str]) -> None:
    opted_out = pod("a", QoSClass.LS, (100_000, 200_000), {ANNOTATION: json.dumps({"policy": "none"})})
    assert BurstStrategy().plan(inputs((opted_out, LSR, BE)), QUOTA_ONLY, quotas()).actions == ()
    broken = pod("a", QoSClass.LS, (100_000, 200_000), {ANNOTATION: "{policy"})
    strategy = BurstStrategy()
    for _ in range(2):
        plan = strategy.plan(inputs((broken, LSR, BE)), QUOTA_ONLY, quotas())
    assert plan.actions  # the node config applies
    assert capsys.readouterr().out.count("cpu_burst_annotation_ignored") == 1


def test_burst_resource_renders_and_checks() -> None:
    assert CPU_CFS_BURST.v1 == ("cpu", "cpu.cfs_burst_us")
    assert CPU_CFS_BURST.render(5000, 1, None) == "5000"
    assert CPU_CFS_BURST.parse("5000\n", 1) == 5000
    with pytest.raises(Exception, match="cfs_burst_us"):
        CPU_CFS_BURST.check(-1)


def test_a_pod_whose_annotation_bursts_its_quota_has_its_quotas_read_under_a_node_policy_of_none() -> None:
    annotated = pod("n", QoSClass.LS, (100_000,), {ANNOTATION: json.dumps({"policy": "cfsQuotaBurstOnly"})})
    dirs = BurstStrategy().quota_dirs((LS, annotated), CPUBurstStrategy())  # node policy: none
    assert dirs == ["kubepods/burstable/podn", "kubepods/burstable/podn/n0"]  # LS follows the node: nothing
