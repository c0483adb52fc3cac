"""The store follows containerd: pods removed or created behind the proxy's back.

Runs the shipped chain with a 1 s reconcile interval and a re-sync interval of an
hour, so what drops a pod here is the re-sync before each reconciler pass; the last
test runs without hooks and a 1 s re-sync interval (the periodic re-sync alone).
Pods are created or removed directly at containerd (``pods.direct``), as an operator
with crictl or a crashed kubelet's cleanup would.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo.embeddedcgroup import remove_cgroup_tree
from runtimeproxy.demo.scenario import DEFAULT_CONFIG, kubelet_creates_pod_cgroup

FAILURES = ("hook_failed", "reconcile_failed")
SPEC = "node.koordinator.sh/extended-resource-spec"
BATCH = {"containers": {"app": {
    "requests": {"kubernetes.io/batch-cpu": "500", "kubernetes.io/batch-memory": str(128 << 20)},
    "limits": {"kubernetes.io/batch-cpu": "1000", "kubernetes.io/batch-memory": str(256 << 20)},
}}}


@pytest.fixture(scope="module")
def proxy_config() -> dict[str, Any]:
    shipped = yaml.safe_load(DEFAULT_CONFIG.read_text())
    return {"hooks": shipped["hooks"], "rules": shipped["rules"], "reconcile_interval": "1s",
            "resync_interval": "1h"}


def http_get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def _explain(proxy: Any, name: str) -> int:
    return http_get(proxy.metrics_port, f"/debug/explain?pod=krp-test/{name}")[0]


def _wait(predicate: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def _be_pod(pods: Any, rt: Any, name: str, command: tuple[str, ...] = ("sleep", "3600")) -> tuple[Any, str, str]:
    pod = pods.sandbox(name, qos="besteffort", labels={"koordinator.sh/qosClass": "BE"},
                       annotations={SPEC: json.dumps(BATCH)})
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    sid = pods.run(rt, pod)
    cid = pods.create(rt, sid, pod, pods.container("app", command=command,
                                                   resources=cri.LinuxContainerResources(cpu_shares=2)))
    pods.start(rt, cid)
    return pod, sid, cid


def _passes(proxy: Any, n: int) -> None:
    """Let ``n`` more reconciler passes run (each starts with a re-sync, logged at debug
    when nothing changed, so count the 1 s interval instead)."""
    time.sleep(n * 1.0 + 0.5)


def _warnings_for(proxy: Any, name: str, since: int = 0) -> list[dict[str, Any]]:
    """Hook failures (a gone cgroup is a CgroupGoneError) at a reconcile stage for this pod,
    among the log lines from index ``since`` on."""
    return [e for e in proxy.events()[since:] if e.get("pod_name") == name and e.get("event") in FAILURES
            and "Reconcile" in str(e.get("stage", ""))]


def _index(proxy: Any, predicate: Callable[[dict[str, Any]], bool], start: int = 0) -> int:
    """Index (in ``proxy.events()``) of the first log line from ``start`` on matching, after waiting for it."""
    found: list[int] = []

    def seen() -> bool:
        found[:] = [i for i, e in enumerate(proxy.events()) if i >= start and predicate(e)][:1]
        return bool(found)

    _wait(seen, "a log line")
    return found[0]


def test_pod_removed_at_containerd_is_dropped_and_never_warned_about(proxy: Any, pods: Any) -> None:
    rt = proxy.runtime()
    pod, sid, cid = _be_pod(pods, rt, "behind-back")
    assert _explain(proxy, "behind-back") == 200
    _passes(proxy, 1)
    assert _warnings_for(proxy, "behind-back") == []

    # Removed directly at containerd; kubelet's cleanup removes the pod cgroup too.
    start = len(proxy.events())
    pods.direct.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0), timeout=30)
    pods.direct.RemoveContainer(cri.RemoveContainerRequest(container_id=cid), timeout=30)
    pods.direct.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=60)
    pods.direct.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=60)
    remove_cgroup_tree(pod.linux.cgroup_parent, timeout=2.0)

    _wait(lambda: _explain(proxy, "behind-back") == 404, "explain to forget the removed pod")
    # A pass already under way when the pod went may still have met it; from the re-sync
    # that dropped it on, no pass does.
    # (The container may go in an earlier re-sync than its pod: it was removed first.)
    dropped = _index(proxy, lambda e: e.get("event") == "store_resynced" and e["pods_dropped"] >= 1, start)
    _passes(proxy, 3)
    assert _warnings_for(proxy, "behind-back", dropped) == [], "the reconciler visited a pod containerd no longer has"


def test_stopped_sandbox_and_exited_container_are_left_alone(proxy: Any, pods: Any) -> None:
    rt = proxy.runtime()
    start = len(proxy.events())
    # A container that exits by itself: its cgroup goes with its task.
    _, _, quit_cid = _be_pod(pods, rt, "exits-alone", command=("true",))
    # kubelet tearing a pod down: containers stopped, sandbox stopped, pod cgroup removed;
    # RemovePodSandbox comes later (here: not in this test).
    pod, sid, cid = _be_pod(pods, rt, "torn-down")
    rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0), timeout=30)
    rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=60)
    torn_down = len(proxy.events())
    remove_cgroup_tree(pod.linux.cgroup_parent, timeout=2.0)

    def exited() -> bool:
        resp = pods.direct.ContainerStatus(cri.ContainerStatusRequest(container_id=quit_cid), timeout=10)
        return bool(resp.status.state == cri.CONTAINER_EXITED)

    _wait(exited, "the 'true' container to exit")
    # Only a re-sync learns that it exited (a pass under way at the exit may still meet
    # it); from then on no pass visits it.
    learnt = _index(proxy, lambda e: e.get("event") == "store_resynced" and e["states_changed"] >= 1, start)
    _passes(proxy, 3)
    warned = {"exits-alone": _warnings_for(proxy, "exits-alone", learnt),
              "torn-down": _warnings_for(proxy, "torn-down", torn_down)}
    assert warned == {"exits-alone": [], "torn-down": []}
    for name in ("exits-alone", "torn-down"):
        assert _explain(proxy, name) == 200, "containerd still has it: so does the store"


def test_periodic_resync_learns_and_forgets_pods_made_directly(proxy_factory: Any, pods: Any) -> None:
    quiet = proxy_factory.start(extra={"resync_interval": "1s"})  # no hooks: no reconciler passes
    pod = pods.sandbox("made-directly")
    sid = pods.run(pods.direct, pod)
    _wait(lambda: _explain(quiet, "made-directly") == 200, "a resync to learn the pod made at containerd")
    body = json.loads(http_get(quiet.metrics_port, "/debug/explain?pod=krp-test/made-directly")[1])
    assert body["sandbox_id"] == sid and body["cgroup_parent"] == pod.linux.cgroup_parent, body
    learnt = [e for e in quiet.events("store_resynced") if e["pods_added"] >= 1]
    assert learnt and learnt[0]["reason"] == "interval", learnt

    pods.direct.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=60)
    pods.direct.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=60)
    _wait(lambda: _explain(quiet, "made-directly") == 404, "a resync to forget the pod removed at containerd")
