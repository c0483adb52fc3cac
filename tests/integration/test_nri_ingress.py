"""The shipped default chain through NRI and through the proxy, on one containerd 1.7.24.

One agent runs ``ingress: both``: the same pod scenarios as the proxy's hook tests (LS,
LSR bound to a CPU, BE with batch resources, an opted-out pod) are created once through
its CRI socket and once straight at containerd (which calls the agent over NRI), and
the cgroup files runc and the hooks wrote are compared. A pod created through the proxy
is hooked by the proxy only (its explain shows each change once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo.embedded import EmbeddedContainerd
from runtimeproxy.demo.scenario import kubelet_creates_pod_cgroup
from tests.integration.conftest import PodKit, ProxyLauncher, ProxyProcess, http_get

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "systemd" / "config.yaml"
STATUS = "scheduling.koordinator.sh/resource-status"
SPEC = "node.koordinator.sh/extended-resource-spec"
SKIP_LABEL = "runtimeproxy.koordinator.sh/skip-hookserver"


@pytest.fixture(scope="module")
def agent(nri_containerd: EmbeddedContainerd) -> Iterator[ProxyProcess]:
    shipped = yaml.safe_load(DEFAULT_CONFIG.read_text())
    launcher = ProxyLauncher(nri_containerd.socket)
    assert nri_containerd.nri_socket is not None
    extra = {"rules": shipped["rules"], "data_plane": "grpc", "ingress": "both",
             "nri": {"socket": str(nri_containerd.nri_socket), "plugin_name": "krp-test", "plugin_index": 40}}
    try:
        proc = launcher.start(shipped["hooks"], extra=extra)
        proc.wait_event("nri_synchronized")
        yield proc
    finally:
        problems = launcher.cleanup()
    assert not problems, "\n".join(problems)


def _last_online_cpu() -> str:
    return Path("/sys/devices/system/cpu/online").read_text().strip().replace("-", ",").split(",")[-1]


def _scenario(kind: str, name: str, kit: PodKit) -> tuple[cri.PodSandboxConfig, cri.ContainerConfig]:
    if kind == "ls":
        pod = kit.sandbox(name, qos="burstable", labels={"koordinator.sh/qosClass": "LS"})
        res = cri.LinuxContainerResources(cpu_shares=512, cpu_quota=50000, cpu_period=100000,
                                          memory_limit_in_bytes=64 << 20)
    elif kind == "lsr":
        pod = kit.sandbox(name, qos="guaranteed", labels={"koordinator.sh/qosClass": "LSR"},
                          annotations={STATUS: json.dumps({"cpuset": _last_online_cpu()})})
        res = cri.LinuxContainerResources(cpu_shares=1024, cpu_quota=100000, cpu_period=100000)
    elif kind == "be-batch":
        spec = {"containers": {"app": {
            "requests": {"kubernetes.io/batch-cpu": "500", "kubernetes.io/batch-memory": str(128 << 20)},
            "limits": {"kubernetes.io/batch-cpu": "1000", "kubernetes.io/batch-memory": str(256 << 20)},
        }}}
        pod = kit.sandbox(name, qos="besteffort", labels={"koordinator.sh/qosClass": "BE"},
                          annotations={SPEC: json.dumps(spec)})
        res = cri.LinuxContainerResources(cpu_shares=2)
    else:  # opted out: a BE pod the hooks must leave alone
        pod = kit.sandbox(name, qos="besteffort", labels={"koordinator.sh/qosClass": "BE", SKIP_LABEL: "true"})
        res = cri.LinuxContainerResources(cpu_shares=2)
    return pod, kit.container("app", resources=res)


#: (controller, file) read for the container and for its pod cgroup.
FILES = (("cpu", "cpu.shares"), ("cpu", "cfs_quota_us"), ("cpu", "cpu.idle"), ("cpuset", "cpuset.cpus"),
         ("memory", "memory.limit_in_bytes"))


def _files(kit: PodKit, pod: cri.PodSandboxConfig, cid: str) -> dict[str, str]:
    out = {}
    for controller, name in FILES:
        name = "cpu.cfs_quota_us" if name == "cfs_quota_us" else name
        for level, path in (("container", kit.pod_dir(pod, controller) / cid), ("pod", kit.pod_dir(pod, controller))):
            try:
                out[f"{level}:{name}"] = (path / name).read_text().strip()
            except FileNotFoundError:
                out[f"{level}:{name}"] = "<none>"
    return out


def _run(kit: PodKit, rt: Any, kind: str, name: str) -> tuple[cri.PodSandboxConfig, dict[str, str]]:
    pod, container = _scenario(kind, name, kit)
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    sid = kit.run(rt, pod)
    cid = kit.create(rt, sid, pod, container)
    kit.start(rt, cid)
    return pod, _files(kit, pod, cid)


EXPECTED = {
    "lsr": {"container:cpuset.cpus": _last_online_cpu(), "container:cpu.cfs_quota_us": "-1",
            "pod:cpu.cfs_quota_us": "-1"},
    "be-batch": {"container:cpu.shares": "512", "container:cpu.cfs_quota_us": "100000",
                 "container:memory.limit_in_bytes": str(256 << 20),
                 "pod:cpu.cfs_quota_us": "100000", "pod:cpu.idle": "1"},
    "ls": {"pod:cpu.idle": "0", "container:cpu.shares": "512", "container:cpu.cfs_quota_us": "50000"},
    "opted-out": {"container:cpu.shares": "2", "pod:cpu.idle": "0"},
}


@pytest.mark.parametrize("kind", ["ls", "lsr", "be-batch", "opted-out"])
def test_nri_gives_the_same_cgroup_files_as_the_proxy(agent: ProxyProcess, nri_pods: PodKit, kind: str) -> None:
    via_proxy_pod, via_proxy = _run(nri_pods, agent.runtime(), kind, f"{kind}-proxy")
    via_nri_pod, via_nri = _run(nri_pods, nri_pods.direct, kind, f"{kind}-nri")
    assert via_nri == via_proxy
    for key, value in EXPECTED[kind].items():
        assert via_nri[key] == value, (key, via_nri, via_proxy)
    # Each ingress hooked its own pod, once: the proxy's pod has no NRI-made change
    # (no change recorded twice), the NRI pod has the chain's changes.
    proxied, direct = _explain(agent, via_proxy_pod), _explain(agent, via_nri_pod)
    keys = [(c["hook"], c["stage"], c["target"]) for c in proxied["changes"]]
    assert len(keys) == len(set(keys)), keys
    assert sorted(keys) == sorted((c["hook"], c["stage"], c["target"].replace(
        via_nri_pod.linux.cgroup_parent, via_proxy_pod.linux.cgroup_parent)) for c in direct["changes"])
    if kind != "opted-out":
        assert direct["changes"], direct
        # The chain ran at CreateContainer through NRI for the direct pod only: the proxied
        # one carries the proxy's mark, so the NRI ingress left it alone.
        assert agent.wait_event("nri_call", call="CreateContainer", pod_name=f"{kind}-nri")
        assert not agent.events("nri_call", pod_name=f"{kind}-proxy")
    assert direct["ingress"].startswith("both (NRI plugin 40-krp-test on ")
    assert direct["ingress"].endswith(": connected)")


def _explain(agent: ProxyProcess, pod: cri.PodSandboxConfig) -> dict[str, Any]:
    status, body = http_get(agent.metrics_port, f"/debug/explain?pod={pod.metadata.namespace}/{pod.metadata.name}")
    assert status == 200, body
    data: dict[str, Any] = json.loads(body)
    return data


def test_check_config_says_which_ingress(agent: ProxyProcess) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-m", "runtimeproxy.cli", "check-config", "--config",
                          str(agent.config_path)], capture_output=True, text=True, timeout=60, env=env, check=False)
    assert out.returncode == 0, out.stderr
    assert " ingress=both" in out.stdout.splitlines()[0]
    assert "both: cri-proxy on " in out.stdout and "nri (containerd calls 40-krp-test on " in out.stdout
