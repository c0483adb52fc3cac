"""Issue 29: suppress's cpuset inputs kept per pod list (the LSE/LSR bindings, the cpuset
write over the BE children): each gives what a fresh computation gives, and is computed
again when its inputs change."""

from __future__ import annotations

import json
from pathlib import PurePosixPath

import pytest

from hooks.annotations import RESOURCE_STATUS
from hooks.qos import QoSClass
from hooks.rules import ResourceThresholdStrategy
from metrics.collect.topology import CPUInfo
from metrics.model import ContainerView, PodView
from metrics.qos import suppress
from metrics.qos.inputs import NodeInputs
from metrics.qos.plan import LeveledWrite
from metrics.qos.suppress import BEState, SuppressConfig, SuppressStrategy
from metrics.qos.tierquota import ChildQuota

CPUSET = ResourceThresholdStrategy(enable=True)


def topology() -> list[CPUInfo]:
    return [CPUInfo(cpu=i, core=i % 4, socket=0, numa=0 if i % 4 < 2 else 1) for i in range(8)]


def pod(uid: str, qos: QoSClass, kube: str = "burstable", annotations: dict[str, str] | None = None) -> PodView:
    cgroup = f"kubepods/{kube}/pod{uid}"
    return PodView(uid=uid, namespace="ns", name=uid, sandbox_id=f"sb-{uid}", qos=qos, priority=0,
                   priority_class="", cgroup_dir=cgroup, kube_qos=kube, annotations=annotations or {},
                   containers=(ContainerView(id=f"c{uid}", name="main", cgroup_dir=f"{cgroup}/c{uid}"),))


def inputs(pods: tuple[PodView, ...]) -> NodeInputs:
    return NodeInputs(now=100.0, capacity_cores=8.0, reserved_cores=0.5, pods=pods, node_cpu_used=2.0,
                      pod_cpu_used={p.uid: 0.1 for p in pods})


def lse(uid: str, cpus: str) -> PodView:
    return pod(uid, QoSClass.LSE, "guaranteed", {RESOURCE_STATUS: json.dumps({"cpuset": cpus})})


def test_bound_cpus_are_parsed_once_per_pod_list_and_again_for_a_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = suppress.bound_cpus

    def counted(*args: object, **kwargs: object) -> frozenset[int]:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(suppress, "bound_cpus", counted)
    strategy = SuppressStrategy(SuppressConfig(), topology())
    pods = (pod("a", QoSClass.LS), pod("c", QoSClass.BE, "besteffort"), lse("e", "2-3"))
    first = strategy.plan(inputs(pods), CPUSET, BEState(frozenset(range(8)), -1))
    parses = len(calls)
    again = strategy.plan(inputs(pods), CPUSET, BEState(frozenset(range(8)), -1))
    assert len(calls) == parses and again.actions == first.actions
    moved = (*pods[:2], lse("e", "4-5"))  # a new list: the LSE pod now holds other CPUs
    plan = strategy.plan(inputs(moved), CPUSET, BEState(frozenset(range(8)), -1))
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
