"""BEAggregate (best-effort usage / request / real limit, system usage) on fixture cgroup trees."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hooks.qos import QoSClass
from metrics import model as m
from metrics.collect.be import BEAggregate
from metrics.collect.cgroupfs import PodCollector, PodUsage
from metrics.collect.procfs import NodeUsage
from runtimeproxy.hookapi import HostRoots

BE_DIR = "kubepods/besteffort"
NO_NODE = NodeUsage()


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def pod(uid: str, qos: QoSClass, batch_milli: int = 0) -> m.PodView:
    tier = "besteffort" if qos is QoSClass.BE else "burstable"
    return m.PodView(uid=uid, namespace="ns", name=uid, sandbox_id=f"sb-{uid}", qos=qos, priority=0,
                     priority_class="", cgroup_dir=f"kubepods/{tier}/pod{uid}", batch_cpu_request_milli=batch_milli)


def v1(tmp_path: Path) -> HostRoots:
    roots = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys")
    for controller in ("cpu", "cpuacct", "cpuset", "memory"):
        (roots.cgroup / controller).mkdir(parents=True)
    return roots


def v2(tmp_path: Path) -> HostRoots:
    roots = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys")
    write(roots.cgroup / "cgroup.controllers", "cpuset cpu memory\n")
    return roots


def values(samples: Sequence[m.Sample]) -> dict[str, float]:
    out = {s.metric: s.value for s in samples}
    assert len(out) == len(samples) and all(s.labels == () for s in samples)
    return out


PODS = [pod("a", QoSClass.BE, 1500), pod("b", QoSClass.BE, 500), pod("c", QoSClass.LS)]


def test_be_usage_from_the_tier_dir_falls_back_to_pods_on_the_first_tick(tmp_path: Path) -> None:
    roots = v1(tmp_path)
    write(roots.cgroup / "cpuacct" / BE_DIR / "cpuacct.usage", "1000000000\n")
    clock = Clock()
    agg = BEAggregate(roots, clock=clock)
    usage = PodUsage({"a": 0.25, "b": 0.5, "c": 2.0}, {}, cpu_complete=True)
    assert values(agg.samples(NO_NODE, usage, PODS))[m.BE_CPU_USAGE] == pytest.approx(0.75)
    write(roots.cgroup / "cpuacct" / BE_DIR / "cpuacct.usage", "4000000000\n")
    clock.t += 2
    # the tier also counts BE processes outside known pods: 3 s of CPU in 2 s
    assert values(agg.samples(NO_NODE, usage, PODS))[m.BE_CPU_USAGE] == pytest.approx(1.5)


def test_be_usage_from_pods_needs_every_be_pod(tmp_path: Path) -> None:
    agg = BEAggregate(v1(tmp_path))
    partial = PodUsage({"a": 0.25, "c": 2.0}, {})
    assert m.BE_CPU_USAGE not in values(agg.samples(NO_NODE, partial, PODS))
    assert values(agg.samples(NO_NODE, PodUsage({}, {}), [PODS[2]]))[m.BE_CPU_USAGE] == 0.0


def test_be_request_is_the_sum_of_batch_requests(tmp_path: Path) -> None:
    samples = values(BEAggregate(v1(tmp_path)).samples(NO_NODE, PodUsage({}, {}), PODS))
    assert samples[m.BE_CPU_REQUEST] == pytest.approx(2.0)


@pytest.mark.parametrize(("cpuset", "quota", "expected"), [
    ("0-3\n", "200000\n", 2.0),
    ("0-3\n", "-1\n", 4.0),
    ("0-1\n", "350000\n", 2.0),
    (None, "50000\n", 0.5),
    (None, "-1\n", None),
])
def test_v1_real_limit(tmp_path: Path, cpuset: str | None, quota: str, expected: float | None) -> None:
    roots = v1(tmp_path)
    if cpuset is not None:
        write(roots.cgroup / "cpuset" / BE_DIR / "cpuset.cpus", cpuset)
    write(roots.cgroup / "cpu" / BE_DIR / "cpu.cfs_quota_us", quota)
    write(roots.cgroup / "cpu" / BE_DIR / "cpu.cfs_period_us", "100000\n")
    assert BEAggregate(roots).real_limit() == expected


def test_v2_real_limit_uses_effective_cpus_and_cpu_max(tmp_path: Path) -> None:
    roots = v2(tmp_path)
    write(roots.cgroup / "custom/be/cpuset.cpus", "\n")  # empty = inherit: the effective set counts
    write(roots.cgroup / "custom/be/cpuset.cpus.effective", "0-1\n")
    write(roots.cgroup / "custom/be/cpu.max", "max 100000\n")
    agg = BEAggregate(roots, besteffort_dir="custom/be")
    assert agg.real_limit() == 2.0
    write(roots.cgroup / "custom/be/cpu.max", "150000 100000\n")
    assert values(agg.samples(NO_NODE, PodUsage({}, {}), []))[m.BE_CPU_LIMIT] == 1.5


def test_garbage_quota_is_logged_once_and_the_cpuset_still_counts(tmp_path: Path) -> None:
    roots = v1(tmp_path)
    write(roots.cgroup / "cpuset" / BE_DIR / "cpuset.cpus", "0-2\n")
    write(roots.cgroup / "cpu" / BE_DIR / "cpu.cfs_quota_us", "unlimited\n")
    write(roots.cgroup / "cpu" / BE_DIR / "cpu.cfs_period_us", "100000\n")
    agg = BEAggregate(roots)
    with capture_logs() as logs:
        assert [agg.real_limit() for _ in range(3)] == [3.0] * 3
    assert [(e["event"], e["log_level"]) for e in logs] == [("sample_skipped", "warning")]


def test_system_usage_is_node_minus_pods_floored_at_zero(tmp_path: Path) -> None:
    agg = BEAggregate(v1(tmp_path))
    usage = PodUsage({"a": 1.0, "c": 0.5}, {"a": 1e9, "c": 5e8}, cpu_complete=True, memory_complete=True)
    samples = values(agg.samples(NodeUsage(cpu=3.0, memory=4e9, capacity=4), usage, PODS[::2]))
    assert samples[m.SYSTEM_CPU_USAGE] == pytest.approx(1.5)
    assert samples[m.SYSTEM_MEMORY_USED] == pytest.approx(2.5e9)
    low = values(agg.samples(NodeUsage(cpu=1.0, memory=1e9), usage, PODS[::2]))
    assert low[m.SYSTEM_CPU_USAGE] == 0.0 and low[m.SYSTEM_MEMORY_USED] == 0.0


def test_no_system_usage_while_a_pod_has_no_value(tmp_path: Path) -> None:
    agg = BEAggregate(v1(tmp_path))
    incomplete = PodUsage({"a": 1.0}, {"a": 1e9}, cpu_complete=False, memory_complete=True)
    samples = values(agg.samples(NodeUsage(cpu=3.0, memory=4e9), incomplete, PODS))
    assert m.SYSTEM_CPU_USAGE not in samples and samples[m.SYSTEM_MEMORY_USED] == pytest.approx(3e9)
    assert m.SYSTEM_CPU_USAGE not in values(agg.samples(NO_NODE, PodUsage({}, {}, True, True), []))


def test_with_a_real_pod_collector(tmp_path: Path) -> None:
    roots = v1(tmp_path)
    be_pod = pod("a", QoSClass.BE, 1000)
    for ctrl, name, text in (("cpuacct", "cpuacct.usage", "0\n"), ("memory", "memory.stat", "total_cache 0\n"
                             "total_inactive_anon 100\ntotal_active_anon 0\ntotal_unevictable 0\n"),
                             ("cpu", "cpu.stat", "nr_periods 0\nnr_throttled 0\n")):
        write(roots.cgroup / ctrl / be_pod.cgroup_dir / name, text)
    clock = Clock()
    pods = PodCollector(roots, clock=clock)
    agg = BEAggregate(roots, clock=clock)
    pods.collect(0, [be_pod])
    assert m.BE_CPU_USAGE not in values(agg.samples(NO_NODE, pods.latest(), [be_pod]))
    write(roots.cgroup / "cpuacct" / be_pod.cgroup_dir / "cpuacct.usage", "500000000\n")
    clock.t += 1
    pods.collect(1, [be_pod])
    samples = values(agg.samples(NodeUsage(cpu=1.0, memory=1000.0), pods.latest(), [be_pod]))
    assert samples[m.BE_CPU_USAGE] == pytest.approx(0.5)
    assert samples[m.SYSTEM_CPU_USAGE] == pytest.approx(0.5)
    assert samples[m.SYSTEM_MEMORY_USED] == pytest.approx(900.0)
