"""blkio on this machine's real cgroup v1 blkio controller and a real loop device made
by the test: the BE tier's blkio.throttle.*_device get "<maj>:<min> <value>" from the
NodeSLO-style rules, a reconcile finds nothing to repair, and turning the class off
removes the limits again (the kernel drops a device's line on 0)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from hooks.blkio import Blkio
from runtimeproxy.embedded import remove_cgroup_tree, unique_test_parent
from runtimeproxy.hookapi import HookInit, HostRoots, PodContext, PodInfo, PodMeta, Stage, frozen_map

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


def test_be_tier_throttled_on_a_real_loop_device(loop_device: str, be_pod_parent: str) -> None:
    st = os.stat(loop_device)
    devno = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    current = {"rules": _rules(loop_device, True)}
    hook = Blkio(HookInit("blkio", {}, "hooks[0].args", HostRoots(cgroup=ROOT, sys=Path("/sys")),
                          current["rules"], current_rules=lambda: current["rules"]))
    pod = PodInfo(PodMeta("batch", "default", UID), cgroup_parent=be_pod_parent,
                  labels=frozen_map({"koordinator.sh/qosClass": "BE"}))
    tier = ROOT / "blkio" / be_pod_parent.lstrip("/").rsplit("/", 1)[0]
    assert tier.name == "besteffort"

    patch = hook.pre_run_pod_sandbox(PodContext(Stage.PRE_RUN_POD_SANDBOX, pod))
    assert patch is not None and len(patch.writes) == 2
    assert f"{devno} 1048576" in (tier / "blkio.throttle.read_bps_device").read_text().splitlines()
    assert f"{devno} 120" in (tier / "blkio.throttle.write_iops_device").read_text().splitlines()
    assert devno not in (tier / "blkio.throttle.read_iops_device").read_text()  # 0: no limit set
    pod_dir = ROOT / "blkio" / be_pod_parent.lstrip("/")
    assert devno not in (pod_dir / "blkio.throttle.read_bps_device").read_text()  # the tier, not the pod

    assert hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, pod)) is None  # nothing drifted

    current["rules"] = _rules(loop_device, False)
    removed = hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, pod))
    assert removed is not None and "limit removed" in removed.reason
    assert devno not in (tier / "blkio.throttle.read_bps_device").read_text()
    assert devno not in (tier / "blkio.throttle.write_iops_device").read_text()
