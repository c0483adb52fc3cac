"""blkio through the real proxy and containerd, on a real loop device made by the test:
RunPodSandbox of a real BE pod throttles its kube-QoS tier (the run's own
``<prefix>/kubepods/besteffort``) on that device, an LSR pod gets its own pod cgroup
throttled, and ``explain`` names the hook, the file and the rule that asked for it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtimeproxy.demo import kubelet_creates_pod_cgroup

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def loop_device(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    image = tmp_path_factory.mktemp("blkio") / "disk.img"
    with image.open("wb") as f:
        f.truncate(8 << 20)
    device = subprocess.run(["losetup", "--find", "--show", str(image)], check=True, capture_output=True,
                            text=True).stdout.strip()
    try:
        yield device
    finally:
        subprocess.run(["losetup", "-d", device], check=False)
        image.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def proxy_config(loop_device: str) -> dict[str, Any]:
    def block(**io: int) -> dict[str, Any]:
        return {"blkioQOS": {"enable": True, "blocks": [{"name": loop_device, "type": "device", "ioCfg": io}]}}

    return {
        "hooks": [{"name": "blkio", "plugin": "blkio", "failure_policy": "Fail"}],
        "rules": {"resourceQOSStrategy": {"beClass": block(readBPS=2097152, writeBPS=1048576),
                                          "lsrClass": block(readIOPS=900)}},
        "reconcile_interval": "1s",
    }


def _devno(device: str) -> str:
    st = os.stat(device)
    return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"


def test_be_pod_throttles_its_tier_and_explain_says_why(proxy: Any, pods: Any, loop_device: str) -> None:
    devno = _devno(loop_device)
    rt = proxy.runtime()
    pod = pods.sandbox("be-blkio", qos="besteffort", labels={"koordinator.sh/qosClass": "BE"})
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    pods.run(rt, pod)
    tier = pods.pod_dir(pod, "blkio").parent
    assert tier.name == "besteffort"
    assert f"{devno} 2097152" in (tier / "blkio.throttle.read_bps_device").read_text().splitlines()
    assert f"{devno} 1048576" in (tier / "blkio.throttle.write_bps_device").read_text().splitlines()
    assert devno not in (pods.pod_dir(pod, "blkio") / "blkio.throttle.read_bps_device").read_text()

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        [sys.executable, "-m", "runtimeproxy.cli", "explain", "krp-test/be-blkio", "--endpoint", proxy.endpoint],
        capture_output=True, text=True, timeout=30, env=env, check=False,
    )
    assert out.returncode == 0, out.stderr
    target = tier / "blkio.throttle.read_bps_device"
    assert f"[PreRunPodSandbox] blkio: host:{target}: " in out.stdout, out.stdout
    assert f"beClass.blkioQOS.blocks[0] {loop_device} ({devno}): readBPS 2097152" in out.stdout, out.stdout


def test_lsr_pod_gets_its_own_pod_cgroup_throttled(proxy: Any, pods: Any, loop_device: str) -> None:
    devno = _devno(loop_device)
    rt = proxy.runtime()
    pod = pods.sandbox("lsr-blkio", qos="guaranteed", labels={"koordinator.sh/qosClass": "LSR"})
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    pods.run(rt, pod)
    pod_dir = pods.pod_dir(pod, "blkio")
    assert f"{devno} 900" in (pod_dir / "blkio.throttle.read_iops_device").read_text().splitlines()
    assert devno not in (pod_dir.parent / "blkio.throttle.read_iops_device").read_text()  # kubepods stays free
