"""blkio through the real proxy and containerd, on a real loop device made by the test:
with a real BE pod running, the QoS strategy blkio (the proxy's qos-manager task)
throttles its kube-QoS tier (the run's own ``<prefix>/kubepods/besteffort``, found above
the pod) on that device within a round; the hook blkio throttles an LSR pod's own cgroup
at RunPodSandbox; ``explain`` names the writer, the file and the rule that asked for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtimeproxy.demo.scenario import kubelet_creates_pod_cgroup

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
def proxy_config(loop_device: str, db_dir: Path) -> dict[str, Any]:
    def block(**io: int) -> dict[str, Any]:
        return {"blkioQOS": {"enable": True, "blocks": [{"name": loop_device, "type": "device", "ioCfg": io}]}}

    return {
        "hooks": [{"name": "blkio", "plugin": "blkio", "failure_policy": "Fail"}],
        "rules": {"resourceQOSStrategy": {"beClass": block(readBPS=2097152, writeBPS=1048576),
                                          "lsrClass": block(readIOPS=900)}},
        "reconcile_interval": "1s",
        "tasks": {
            "metrics": {"db": str(db_dir / "m.db"), "schedlat_source": "off", "cpi": False},
            "qos-manager": {"fast_path": False, "strategies": ["blkio"]},
        },
    }


def _devno(device: str) -> str:
    st = os.stat(device)
    return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"


def _explain(proxy: Any, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        [sys.executable, "-m", "runtimeproxy.cli", "explain", *args, "--endpoint", proxy.endpoint],
        capture_output=True, text=True, timeout=30, env=env, check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_be_pod_throttles_its_tier_and_explain_says_why(proxy: Any, pods: Any, loop_device: str) -> None:
    devno = _devno(loop_device)
    rt = proxy.runtime()
    pod = pods.sandbox("be-blkio", qos="besteffort", labels={"koordinator.sh/qosClass": "BE"})
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    pods.run(rt, pod)
    tier = pods.pod_dir(pod, "blkio").parent
    assert tier.name == "besteffort"
    read_bps = tier / "blkio.throttle.read_bps_device"
    deadline = time.monotonic() + 30  # a pod tick for the pod list, then a round
    while f"{devno} 2097152" not in read_bps.read_text().splitlines() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert f"{devno} 2097152" in read_bps.read_text().splitlines()
    assert f"{devno} 1048576" in (tier / "blkio.throttle.write_bps_device").read_text().splitlines()
    assert devno not in (pods.pod_dir(pod, "blkio") / "blkio.throttle.read_bps_device").read_text()

    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.metrics_port}/debug/explain", timeout=5) as resp:
        shown = json.loads(resp.read())
    plan = shown["tasks"]["qos"]["strategies"]["blkio"]["plan"]
    reasons = " ".join(a["reason"] for a in plan["actions"])
    assert f"beClass.blkioQOS.blocks[0] {loop_device} ({devno}): readBPS 2097152" in reasons, plan
    assert plan["inputs"]["tiers"][str(tier.relative_to(Path("/sys/fs/cgroup/blkio")))]["class"] == "BE", plan
    # the hook leaves BE pods to the strategy: nothing at RunPodSandbox
    assert "[PreRunPodSandbox] blkio" not in _explain(proxy, "krp-test/be-blkio")


def test_lsr_pod_gets_its_own_pod_cgroup_throttled(proxy: Any, pods: Any, loop_device: str) -> None:
    devno = _devno(loop_device)
    rt = proxy.runtime()
    pod = pods.sandbox("lsr-blkio", qos="guaranteed", labels={"koordinator.sh/qosClass": "LSR"})
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    pods.run(rt, pod)
    pod_dir = pods.pod_dir(pod, "blkio")
    assert f"{devno} 900" in (pod_dir / "blkio.throttle.read_iops_device").read_text().splitlines()
    assert devno not in (pod_dir.parent / "blkio.throttle.read_iops_device").read_text()  # kubepods stays free
