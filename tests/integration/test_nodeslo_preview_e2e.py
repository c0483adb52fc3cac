"""Issue 30 item 5: ``koord-runtime-proxy plan --nodeslo FILE`` previews a NodeSLO on a
real node (real containerd, real cgroups) and the preview is what the agent then does.

The agent runs the group-identity hook, the metrics and QoS tasks, against the test API
server (``tests/kubeapi.py``). An LS pod with a CPU limit and a BE pod run.

- The NodeSLO turns on CPU burst (``cpuBurstOnly``, 200 %) and BE group identity (-1:
  ``cpu.idle`` 1 on this cgroup v1 host). The command (a subprocess, as an operator runs
  it) prints ``current -> new`` with the rule, per pod: the LS pod's
  ``cpu.cfs_burst_us`` (QoS strategy), the BE pod's ``cpu.idle`` (the hook, in dry run);
  nothing is written. Applied through the API server, the agent writes exactly those
  values (the files read back equal ``new``; its ``qos_write`` lines are the preview's).
- A NodeSLO the agent would refuse is refused by the command with the field and reason
  of the agent's own ``nodeslo_rejected`` line, exit status 2.
- Then BE memory eviction above 1 % node memory: the preview lists the BE pod as
  evicted at current usage (and no burst change: already applied); applied, the agent
  evicts exactly that pod.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo.scenario import kubelet_creates_pod_cgroup
from tests.integration.conftest import CGROUP_ROOT
from tests.kubeapi import KubeApiServer
from tests.unit.metrics.kubehelpers import kubeconfig

pytestmark = pytest.mark.integration

NODE = "krp-preview-node"
BURST = {"cpuBurstStrategy": {"policy": "cpuBurstOnly", "cpuBurstPercent": 200},
         "resourceQOSStrategy": {"beClass": {"cpuQOS": {"enable": True, "groupIdentity": -1}}}}
NODESLO = {"apiVersion": "slo.koordinator.sh/v1alpha1", "kind": "NodeSLO", "metadata": {"name": NODE},
           "spec": BURST}
#: Then BE memory eviction above 1 % node memory (always true here) on top.
EVICT = {**BURST, "resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": 65,
                                                  "memoryEvictThresholdPercent": 1}}
#: The CRD allows each value; the agent refuses the minimum above the threshold.
REFUSED = {"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": 50,
                                           "cpuSuppressMinPercent": 60}}
TIMEOUT = 30.0


@pytest.fixture
def api() -> Iterator[KubeApiServer]:
    server = KubeApiServer()
    server.put("nodes", {"metadata": {"name": NODE}, "status": {
        "capacity": {"cpu": "2", "memory": "4Gi"}, "allocatable": {"cpu": "2", "memory": "4Gi"}}})
    server.put("nodeslos", {"metadata": {"name": NODE}, "spec": {}})
    yield server
    server.close()


def _wait_for(what: str, check: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _plan(proxy: Any, path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runtimeproxy.cli", "plan", "--nodeslo", str(path),
                           "--endpoint", proxy.endpoint, *extra],
                          capture_output=True, text=True, timeout=60, check=False)


def _read(cgroup: str, file: str) -> str:
    return (CGROUP_ROOT / "cpu" / cgroup / file).read_text().strip()


def _cpu_idle(pod: Any) -> str:
    return _read(pod.linux.cgroup_parent.lstrip("/"), "cpu.idle")


def test_plan_previews_a_nodeslo_and_the_agent_then_does_exactly_that(
    proxy_factory: Any, pods: Any, api: KubeApiServer, cgroup_prefix: str, tmp_path: Path
) -> None:
    workdir = proxy_factory.mkdtemp()
    hooks = [{"name": "group-identity", "plugin": "group-identity", "failure_policy": "Ignore"}]
    proxy = proxy_factory.start(hooks, extra={"rules": {}, "reconcile_interval": "1s", "tasks": {
        "metrics": {"db": str(workdir / "m.db"), "schedlat_source": "off", "memlat_source": "off", "cpi": False,
                    "kube": True, "kubeconfig": str(kubeconfig(workdir, api.url)), "node_name": NODE,
                    "kubelet_cpu_manager_state": str(workdir / "cpu_manager_state"),
                    "kubelet_config": str(workdir / "kubelet-config.yaml")},
        "qos-manager": {"besteffort_dir": f"{cgroup_prefix.strip('/')}/kubepods/besteffort"},
    }})
    rt = proxy.runtime()
    ls = pods.sandbox(f"ls-{uuid.uuid4().hex[:6]}", labels={"koordinator.sh/qosClass": "LS"})
    kubelet_creates_pod_cgroup(ls.linux.cgroup_parent)
    ls_sid = pods.run(rt, ls)
    limit = cri.LinuxContainerResources(cpu_period=100_000, cpu_quota=50_000, cpu_shares=512)
    pods.start(rt, pods.create(rt, ls_sid, ls, pods.container("app", resources=limit)))
    be = pods.sandbox(f"be-{uuid.uuid4().hex[:6]}", qos="besteffort", labels={"koordinator.sh/qosClass": "BE"})
    kubelet_creates_pod_cgroup(be.linux.cgroup_parent)
    be_sid = pods.run(rt, be)
    pods.start(rt, pods.create(rt, be_sid, be, pods.container("be")))
    ls_key, be_key = f"krp-test/{ls.metadata.name}", f"krp-test/{be.metadata.name}"
    assert _cpu_idle(be) == "0"

    doc = tmp_path / "nodeslo.yaml"
    doc.write_text(yaml.safe_dump(NODESLO))

    def previewed(path: Path, ready: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        def attempt() -> dict[str, Any] | None:
            out = _plan(proxy, path, "--output", "json")
            assert out.returncode == 0, out.stderr
            body: dict[str, Any] = json.loads(out.stdout)
            return body if ready(body) else None
        found: dict[str, Any] = _wait_for(f"a preview of {path.name}", attempt)
        return found

    # --- the preview (once the agent sees both pods): the burst per LS container and pod,
    # the BE pod's cpu.idle by the group-identity hook; no eviction under this NodeSLO
    body = previewed(doc, lambda b: any(c["strategy"] == "cpu_burst" for c in b["changes"]))
    burst = [c for c in body["changes"] if c["strategy"] == "cpu_burst"]
    assert all(c["scope"] == "pod" and c["pods"] == [ls_key] for c in burst), burst
    container_burst = [c for c in burst if c["cgroup"] != ls.linux.cgroup_parent.lstrip("/")]
    assert [(c["file"], c["current"], c["new"]) for c in container_burst] == [("cpu.cfs_burst_us", "0", "50000")]
    assert "cpu burst 200% (policy cpuBurstOnly)" in container_burst[0]["reason"]
    assert body["evictions"] == []
    hook_changes = body["hooks"]["changes"]
    assert [(c["hook"], c["pod"], Path(c["path"]).name, c["current"], c["new"]) for c in hook_changes] == [
        ("group-identity", be_key, "cpu.idle", "0", "1")], hook_changes
    assert "group-identity" in body["hooks"]["previewed"]

    text = _plan(proxy, doc)
    assert text.returncode == 0, text.stderr
    assert f"  {ls_key}" in text.stdout and "cpu.cfs_burst_us: 0 -> 50000  (cpu_burst: cpu burst 200%" in text.stdout
    assert f"  {be_key}\n" in text.stdout and "cpu.idle: 0 -> 1  (hook group-identity: " in text.stdout
    assert "evicted at current usage: none" in text.stdout

    # nothing was written
    for c in burst:
        assert _read(c["cgroup"], c["file"]) == c["current"], c
    assert _cpu_idle(be) == "0"
    assert not proxy.events("qos_write", strategy="cpu_burst") and not proxy.events("reconcile_repaired")

    # --- a document the agent refuses: the same field as its own log line, exit 2
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**NODESLO, "spec": REFUSED}))
    refused = _plan(proxy, bad)
    assert refused.returncode == 2, refused
    api.put("nodeslos", {"metadata": {"name": NODE}, "spec": REFUSED})
    logged = proxy.wait_event("nodeslo_rejected", timeout=TIMEOUT)
    assert f"invalid NodeSLO: {logged['key']}: {logged['reason']}" in refused.stderr, (refused.stderr, logged)

    # --- applied: the agent writes exactly what the preview showed
    api.put("nodeslos", {"metadata": {"name": NODE}, "spec": BURST})
    for c in burst:
        _wait_for(f"{c['path']} = {c['new']}", lambda c=c: _read(c["cgroup"], c["file"]) == c["new"])
    written = {(e["target"], str(e["value"])) for e in proxy.events("qos_write", strategy="cpu_burst")}
    assert written == {(f"{c['cgroup']}:{c['file']}", c["new"]) for c in burst}
    _wait_for("the BE pod's cpu.idle = 1", lambda: _cpu_idle(be) == "1")

    # --- then eviction on top: the preview lists the BE pod, the agent evicts exactly it
    evict = tmp_path / "evict.yaml"
    evict.write_text(yaml.safe_dump({**NODESLO, "spec": EVICT}))
    body = previewed(evict, lambda b: bool(b["evictions"]))
    assert [e["pod"] for e in body["evictions"]] == [be_key]
    assert "memory" in body["evictions"][0]["reason"]
    assert not [c for c in body["changes"] if c["strategy"] == "cpu_burst"], "already applied: nothing changes"
    assert not proxy.events("pod_evicted")
    api.put("nodeslos", {"metadata": {"name": NODE}, "spec": EVICT})
    evicted = proxy.wait_event("pod_evicted", timeout=TIMEOUT)
    assert evicted["pod"] == be_key
