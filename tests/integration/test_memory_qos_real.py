"""memory-qos on this machine's real cgroup v1 memory controller: the kernel has no
memory.min/low/high (upstream v1; only Anolis kernels add them), so the hook detects
that once, says so in one log line, and writes nothing, however often it is called."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hooks.memoryqos import MemoryQoS
from runtimeproxy.embedded import remove_cgroup_tree, unique_test_parent
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
