"""memory-qos on this machine's real cgroup v1 memory controller: the kernel has no
memory.min/low/high (upstream v1; only Anolis kernels add them), so the hook and the
tier strategy each detect that once, say so in one log line, and write nothing, however
often they are called."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hooks.cgroups import CgroupLayout
from hooks.executor import CgroupExecutor
from hooks.memoryqos import MemoryQoS
from hooks.qos import QoSClass
from hooks.rules import parse_rules
from metrics.model import PodView
from metrics.qos.evict import CriEvictor
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.qos.memoryqos import memory_qos
from metrics.qos.strategy import StrategyInit
from metrics.store.tsdb import TSDB
from runtimeproxy.demo.embeddedcgroup import remove_cgroup_tree, unique_test_parent
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerInfo,
    ContainerMeta,
    HookInit,
    HostRoots,
    PodInfo,
    PodMeta,
    Resources,
    Stage,
)

ROOT = Path("/sys/fs/cgroup")
UID = "7d1e4c2b-aaaa-4bbb-8ccc-0123456789ab"
CID = "feed" * 16
RULES = {"resourceQOSStrategy": {c: {"memoryQOS": {"enable": True, "minLimitPercent": 100, "lowLimitPercent": 100,
                                                   "throttlingPercent": 80}}
                                 for c in ("lsrClass", "lsClass", "beClass")}}

pytestmark = pytest.mark.integration


@pytest.fixture
def pod_parent() -> Iterator[str]:
    if not (ROOT / "memory").is_dir() or (ROOT / "cgroup.controllers").exists():
        pytest.fail("this test needs the v1 memory controller at /sys/fs/cgroup/memory (the CI host has it)")
    prefix = unique_test_parent()
    parent = f"{prefix}/kubepods/burstable/pod{UID}"
    (ROOT / "memory" / parent.lstrip("/") / CID).mkdir(parents=True)
    try:
        yield parent
    finally:
        remove_cgroup_tree(prefix)


#: The memory controller's settings (counters such as usage_in_bytes move on their own).
SETTINGS = ("memory.limit_in_bytes", "memory.soft_limit_in_bytes", "memory.memsw.limit_in_bytes",
            "memory.kmem.limit_in_bytes", "memory.swappiness", "memory.move_charge_at_immigrate",
            "memory.use_hierarchy")


def _files(directory: Path) -> dict[str, str]:
    out = {}
    for name in SETTINGS:
        for path in sorted(directory.rglob(name)):
            out[str(path)] = path.read_text()
    return out


def test_v1_without_memory_min_is_off_once_and_writes_nothing(pod_parent: str) -> None:
    memory = ROOT / "memory"
    top = memory / pod_parent.lstrip("/").split("/")[0]
    if (top / "memory.min").exists():
        pytest.fail("this kernel has v1 memory.min (Anolis): the off path is not what runs here")
    before = _files(top)
    hook = MemoryQoS(HookInit("memory-qos", {}, "hooks[0].args", HostRoots(cgroup=ROOT), RULES))
    pod = PodInfo(PodMeta("web", "default", UID), id="sb", cgroup_parent=pod_parent)
    container = ContainerInfo(ContainerMeta("app"), id=CID, resources=Resources(memory_limit_in_bytes=256 << 20))
    with capture_logs() as logs:
        for stage in (Stage.POST_START_CONTAINER, Stage.RECONCILE_CONTAINER, Stage.RECONCILE_CONTAINER):
            ctx = ContainerContext(stage, pod, container)
            patch = (hook.post_start_container(ctx) if stage is Stage.POST_START_CONTAINER
                     else hook.reconcile_container(ctx))
            assert patch is None
    assert [e["event"] for e in logs] == ["memory_qos_detected"]
    assert logs[0]["enabled"] is False and logs[0]["files"] == []
    assert "cgroup v1 without memory.min" in logs[0]["detail"]
    assert hook.support is not None and not hook.support.enabled
    after = _files(top)
    assert after == before and len(after) >= 4 * 5  # 5 dirs (prefix, kubepods, burstable, pod, container)


@pytest.mark.asyncio
async def test_the_tier_strategy_is_off_too_with_one_line(pod_parent: str, tmp_path: Path) -> None:
    """The strategy memory-qos (kube-QoS tier sums) on the same real v1 tree, through the
    real manager: detected once from the pod's kubepods, one line, nothing written, idle."""
    async def no_runtime(method: str, payload: bytes, timeout: float) -> bytes:
        return b""

    executor = CgroupExecutor(CgroupLayout(ROOT, version=1))
    config = ManagerConfig()
    pod = PodView(uid=UID, namespace="default", name="web", sandbox_id="sb", qos=QoSClass.LS, priority=9000,
                  priority_class="koord-prod", cgroup_dir=pod_parent.lstrip("/"), kube_qos="burstable")
    prefix = ROOT / "memory" / pod_parent.lstrip("/").split("/", 1)[0]
    before = _files(prefix)
    with capture_logs() as logs, TSDB(tmp_path / "m.db") as store:
        strategy = memory_qos(StrategyInit(name="memory-qos", args={}, key_path="strategies[0]", config=config,
                                           topology=[], executor=executor, host=HostRoots(cgroup=ROOT)))
        manager = QoSManager(reader=store, pods=lambda: [pod], topology=[], executor=executor,
                             evictor=CriEvictor(no_runtime), rules=lambda: parse_rules(RULES), config=config,
                             strategies=[strategy])
        for _ in range(3):
            await manager.run_once()
        explained = manager.explain()
    events = [e for e in logs if e["event"].startswith("memory_qos")]
    assert [e["event"] for e in events] == ["memory_qos_tiers_unsupported"], events
    assert "cgroup v1 without memory.min" in events[0]["detail"]
    assert "memory_qos" not in explained["strategies"] and "memory-qos" in explained["idle"]
    assert _files(prefix) == before and len(before) >= 3 * 5
