"""blkio on this machine's real cgroup v1 blkio controller and a real loop device made
by the test: the QoS strategy blkio (through the real manager) gives the BE tier above a
pod's cgroup blkio.throttle.*_device "<maj>:<min> <value>" from the NodeSLO-style rules,
the next round finds nothing to repair, and turning the class off
removes the limits again (the kernel drops a device's line on 0).

The manager is configured with this run's own BE tier (``besteffort_dir`` under a unique
parent, as a kubelet ``cgroupRoot`` other than ``/``): a ``/kubepods``-like decoy tree
under another unique parent, and a host ``/kubepods`` if there is one (only read), are
not touched (issue 28 item 9)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest

from hooks.cgroups import CgroupLayout
from hooks.executor import CgroupExecutor
from hooks.qos import QoSClass
from hooks.rules import parse_rules
from metrics.model import PodView
from metrics.qos.blkio import blkio
from metrics.qos.evict import CriEvictor
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.qos.strategy import StrategyInit
from metrics.qos.suppress import SuppressConfig
from metrics.store.tsdb import TSDB
from runtimeproxy.demo.embeddedcgroup import remove_cgroup_tree, unique_test_parent
from runtimeproxy.hookapi import HostRoots

ROOT = Path("/sys/fs/cgroup")
UID = "3c4d5e6f-7a8b-4c9d-8e0f-112233445566"

pytestmark = pytest.mark.integration


@pytest.fixture
def loop_device(tmp_path: Path) -> Iterator[str]:
    image = tmp_path / "disk.img"
    with image.open("wb") as f:
        f.truncate(8 << 20)
    device = subprocess.run(["losetup", "--find", "--show", str(image)], check=True, capture_output=True,
                            text=True).stdout.strip()
    try:
        yield device
    finally:
        subprocess.run(["losetup", "-d", device], check=False)


@pytest.fixture
def decoy_tier() -> Iterator[Path]:
    """A /kubepods-like tree with no pod of ours, under its own unique test parent."""
    prefix = unique_test_parent()
    tier = ROOT / "blkio" / prefix.lstrip("/") / "kubepods" / "besteffort"
    tier.mkdir(parents=True)
    try:
        yield tier
    finally:
        remove_cgroup_tree(prefix)


def _throttles(tree: Path) -> dict[Path, str]:
    return {p: p.read_text() for p in tree.rglob("blkio.throttle.*_device")} if tree.is_dir() else {}


@pytest.fixture
def be_pod_parent() -> Iterator[str]:
    if not (ROOT / "blkio" / "blkio.throttle.read_bps_device").is_file():
        pytest.fail("this test needs the v1 blkio controller at /sys/fs/cgroup/blkio (the CI host has it)")
    prefix = unique_test_parent()
    parent = f"{prefix}/kubepods/besteffort/pod{UID}"
    for controller in ("blkio", "cpu"):
        (ROOT / controller / parent.lstrip("/")).mkdir(parents=True)
    try:
        yield parent
    finally:
        remove_cgroup_tree(prefix)


def _rules(device: str, enable: bool) -> dict[str, object]:
    blocks = [{"name": device, "type": "device", "ioCfg": {"readBPS": 1048576, "writeIOPS": 120}}]
    return {"resourceQOSStrategy": {"beClass": {"blkioQOS": {"enable": enable, "blocks": blocks}}}}


@pytest.mark.asyncio
async def test_be_tier_throttled_on_a_real_loop_device(loop_device: str, be_pod_parent: str, decoy_tier: Path,
                                                       tmp_path: Path) -> None:
    st = os.stat(loop_device)
    devno = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    current = {"rules": parse_rules(_rules(loop_device, True))}
    executor = CgroupExecutor(CgroupLayout(ROOT, version=1))
    be_dir = PurePosixPath(be_pod_parent.lstrip("/")).parent
    config = ManagerConfig(suppress=SuppressConfig(besteffort_dir=be_dir))
    host_kubepods = _throttles(ROOT / "blkio" / "kubepods")  # another tenant's, if any: only read
    decoy = _throttles(decoy_tier.parent)
    strategy = blkio(StrategyInit(name="blkio", args={}, key_path="strategies[0]", config=config, topology=[],
                                  executor=executor, host=HostRoots(cgroup=ROOT, sys=Path("/sys"))))
    pod = PodView(uid=UID, namespace="default", name="batch", sandbox_id="sb", qos=QoSClass.BE, priority=5000,
                  priority_class="koord-batch", cgroup_dir=be_pod_parent.lstrip("/"), kube_qos="besteffort")

    async def no_runtime(method: str, payload: bytes, timeout: float) -> bytes:
        return b""

    with TSDB(tmp_path / "m.db") as store:
        manager = QoSManager(reader=store, pods=lambda: [pod], topology=[], executor=executor,
                             evictor=CriEvictor(no_runtime), rules=lambda: current["rules"], config=config,
                             strategies=[strategy])
        tier = ROOT / "blkio" / be_pod_parent.lstrip("/").rsplit("/", 1)[0]
        assert tier.name == "besteffort"

        await manager.run_once()  # the tier above this run's own pods, found from the pod list
        applied = manager.explain()["strategies"]["blkio"]["applied"]
        rel = tier.relative_to(ROOT / "blkio")
        assert sorted(a["target"] for a in applied if a["result"] == "written") == [
            f"{rel}:blkio.throttle.read_bps_device[{devno}]", f"{rel}:blkio.throttle.write_iops_device[{devno}]"]
        assert f"{devno} 1048576" in (tier / "blkio.throttle.read_bps_device").read_text().splitlines()
        assert f"{devno} 120" in (tier / "blkio.throttle.write_iops_device").read_text().splitlines()
        assert devno not in (tier / "blkio.throttle.read_iops_device").read_text()  # 0: no limit set
        pod_dir = ROOT / "blkio" / be_pod_parent.lstrip("/")
        assert devno not in (pod_dir / "blkio.throttle.read_bps_device").read_text()  # the tier, not the pod
        assert _throttles(decoy_tier.parent) == decoy and decoy
        assert _throttles(ROOT / "blkio" / "kubepods") == host_kubepods

        await manager.run_once()
        assert "written" not in {a["result"] for a in manager.explain()["strategies"]["blkio"]["applied"]}

        current["rules"] = parse_rules(_rules(loop_device, False))
        await manager.run_once()
        reasons = [a["reason"] for a in manager.explain()["strategies"]["blkio"]["applied"]]
        assert reasons and all("limit removed" in r for r in reasons)
        assert devno not in (tier / "blkio.throttle.read_bps_device").read_text()
        assert devno not in (tier / "blkio.throttle.write_iops_device").read_text()
