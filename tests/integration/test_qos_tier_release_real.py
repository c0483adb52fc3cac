"""Issue 28 item 8 on this machine's real cgroup v1 cpu controller: switching cfsQuota
suppression off must not hit EINVAL.

While the BE tier still has a suppressed quota (40576 µs per 100 ms), batch-resource's
reconcile restores a BE pod's own batch-cpu quota (50000): the kernel refuses a child
above its parent (EINVAL) and the pod was left unlimited until the next pass. Now the
hook holds the pod and its container at the tier's value, the QoS manager lifts the tier
(suppression off: recovered to -1) and asks for a reconciler pass at once, and that pass
writes the full 50000: the tier first, then the children.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest

from hooks.annotations import BATCH_CPU, EXTENDED_RESOURCE_SPEC
from hooks.batchresource import BatchResource
from hooks.cgroups import CgroupLayout
from hooks.executor import CgroupExecutor
from hooks.qos import QoSClass
from hooks.rules import parse_rules
from metrics.collect.topology import CPUInfo
from metrics.model import ContainerView, PodView
from metrics.qos.evict import CriEvictor
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.qos.strategy import StrategyInit, load_strategies, parse_specs
from metrics.qos.suppress import SuppressConfig
from metrics.store.tsdb import TSDB
from runtimeproxy.demo.embeddedcgroup import remove_cgroup_tree, unique_test_parent
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerInfo,
    ContainerMeta,
    HookInit,
    HostRoots,
    PodContext,
    PodInfo,
    PodMeta,
    Resources,
    Stage,
    frozen_map,
)

ROOT = Path("/sys/fs/cgroup")
UID = "8e2f5d3c-bbbb-4ccc-9ddd-0123456789ab"
CID = "beef" * 16
TIER_QUOTA = 40_576
OFF = {"resourceUsedThresholdWithBE": {"enable": False}}

pytestmark = pytest.mark.integration


@pytest.fixture
def prefix() -> Iterator[str]:
    if not (ROOT / "cpu" / "cpu.cfs_quota_us").exists() or (ROOT / "cgroup.controllers").exists():
        pytest.fail("this test needs the v1 cpu controller at /sys/fs/cgroup/cpu (the CI host has it)")
    top = unique_test_parent()
    for controller in ("cpu", "memory"):
        (ROOT / controller / top.lstrip("/") / f"kubepods/besteffort/pod{UID}" / CID).mkdir(parents=True)
    try:
        yield top
    finally:
        remove_cgroup_tree(top)


def _quota(cgroup: str) -> int:
    return int((ROOT / "cpu" / cgroup.lstrip("/") / "cpu.cfs_quota_us").read_text())


async def _no_runtime(method: str, payload: bytes, timeout: float) -> bytes:
    raise AssertionError("nothing is evicted here")


@pytest.mark.asyncio
async def test_suppression_off_lifts_the_tier_then_restores_the_be_quota(prefix: str, tmp_path: Path) -> None:
    tier, pod_dir = f"{prefix}/kubepods/besteffort", f"{prefix}/kubepods/besteffort/pod{UID}"
    (ROOT / "cpu" / tier.lstrip("/") / "cpu.cfs_quota_us").write_text(f"{TIER_QUOTA}\n")  # cfsQuota suppression
    spec = {"containers": {"main": {"requests": {BATCH_CPU: 250}, "limits": {BATCH_CPU: 500}}}}
    info = PodInfo(PodMeta("job", "batch", UID), id="sb-job", cgroup_parent=pod_dir,
                   labels=frozen_map({"koordinator.sh/qosClass": "BE"}),
                   annotations=frozen_map({EXTENDED_RESOURCE_SPEC: json.dumps(spec)}))
    container = ContainerInfo(ContainerMeta("main"), id=CID, resources=Resources(cpu_quota=-1, cpu_period=100_000))
    hook = BatchResource(HookInit("batch", {}, "hooks[0].args", HostRoots(cgroup=ROOT), OFF))

    def reconcile() -> None:
        hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, info))
        hook.reconcile_container(ContainerContext(Stage.RECONCILE_CONTAINER, info, container))

    # The rules changed (suppression off): the reconciler's pass comes before the manager's
    # round. Without the hold the kernel refuses 50000 under 40576 (a HookError here).
    reconcile()
    assert (_quota(pod_dir), _quota(f"{pod_dir}/{CID}")) == (TIER_QUOTA, TIER_QUOTA)
    assert any("held at the BE tier's quota" in w.reason for w in hook.last_writes), hook.last_writes

    # The manager's round: suppression off recovers the tier, then asks for a pass.
    asked: list[str] = []
    executor = CgroupExecutor(CgroupLayout(ROOT, version=1))
    config = ManagerConfig(suppress=SuppressConfig(besteffort_dir=PurePosixPath(tier.lstrip("/"))))
    topology = [CPUInfo(cpu=i, core=i, socket=0, numa=0) for i in range(2)]
    init = StrategyInit(name="", args={}, key_path="strategies", config=config, topology=topology,
                        executor=executor, reconcile_now=lambda: asked.append("pass"))
    loaded = load_strategies(parse_specs(["cpu-suppress"], "strategies"), init)
    view = PodView(uid=UID, namespace="batch", name="job", sandbox_id="sb-job", qos=QoSClass.BE, priority=0,
                   priority_class="", cgroup_dir=pod_dir.lstrip("/"), kube_qos="besteffort",
                   containers=(ContainerView(CID, "main", f"{pod_dir.lstrip('/')}/{CID}"),))
    rules = parse_rules(OFF)
    with TSDB(tmp_path / "m.db") as store:
        manager = QoSManager(reader=store, pods=lambda: [view], topology=topology, executor=executor,
                             evictor=CriEvictor(_no_runtime), rules=lambda: rules, config=config,
                             strategies=loaded.enabled)
        result = await manager.run_once()
    assert _quota(tier) == -1, result
    assert asked == ["pass"], "the manager lifted the tier without asking for a pass"
    reconcile()  # the pass it asked for
    assert (_quota(pod_dir), _quota(f"{pod_dir}/{CID}")) == (50_000, 50_000)
