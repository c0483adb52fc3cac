"""The NRI ingress alone (``ingress: nri``) on containerd 1.7.24: a Fail-policy hook's
error refuses the container through NRI, an agent restart re-registers and
re-synchronises without touching running pods, a containerd restart is survived, and
a missing NRI socket is one clear error at start.

Each test starts its own agent: one NRI plugin at a time on this containerd.
"""

from __future__ import annotations

import json
import socket
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo.embedded import EmbeddedContainerd
from tests.integration.conftest import PodKit, ProxyLauncher, ProxyProcess, http_get

ANNOTATION = "example.koordinator.sh/cpu-shares"
HOOKS = [{"name": "shares", "plugin": "example-cpu-shares", "failure_policy": "Fail", "args": {"cpu_shares": 300}}]


@pytest.fixture
def launcher(nri_containerd: EmbeddedContainerd) -> Iterator[ProxyLauncher]:
    started = ProxyLauncher(nri_containerd.socket)
    yield started
    problems = started.cleanup()
    assert not problems, "\n".join(problems)


def _nri_extra(ctrd: EmbeddedContainerd, **nri: Any) -> dict[str, Any]:
    return {"data_plane": "grpc", "ingress": "nri", "nri": {"socket": str(ctrd.nri_socket), **nri}}


def _agent(launcher: ProxyLauncher, ctrd: EmbeddedContainerd) -> ProxyProcess:
    agent = launcher.start(HOOKS, extra=_nri_extra(ctrd))
    agent.wait_event("nri_synchronized")
    return agent


def _pod(kit: PodKit, name: str, **kw: Any) -> tuple[cri.PodSandboxConfig, str, str]:
    pod = kit.sandbox(name, **kw)
    sid = kit.run(kit.direct, pod)
    cid = kit.create(kit.direct, sid, pod, kit.container("app", resources=cri.LinuxContainerResources(cpu_shares=512)))
    kit.start(kit.direct, cid)
    return pod, sid, cid


def test_fail_policy_error_refuses_the_container(launcher: ProxyLauncher, nri_containerd: EmbeddedContainerd,
                                                 nri_pods: PodKit) -> None:
    agent = _agent(launcher, nri_containerd)
    pod = nri_pods.sandbox("nri-bad", annotations={ANNOTATION: "abc"})
    sid = nri_pods.run(nri_pods.direct, pod)
    with pytest.raises(grpc.RpcError) as err:
        nri_pods.create(nri_pods.direct, sid, pod, nri_pods.container("app"))
    details = err.value.details()
    assert "NRI adjustment" in details and "'shares'" in details and "PreCreateContainer" in details
    assert "'abc'" in details
    listed = nri_pods.direct.ListContainers(cri.ListContainersRequest(filter=cri.ContainerFilter(pod_sandbox_id=sid)),
                                            timeout=10)
    assert not listed.containers
    agent.wait_event("cri_call_rejected", hook="shares", ingress="nri", pod_name="nri-bad")
    # The plugin stayed connected: the next pod gets the hook's value.
    ok, _, cid = _pod(nri_pods, "nri-after-bad", annotations={ANNOTATION: "700"})
    assert nri_pods.cpu_shares(ok, cid) == 700
    assert len(agent.events("nri_connected")) == 1


def test_agent_restart_resyncs_and_leaves_pods_alone(launcher: ProxyLauncher, nri_containerd: EmbeddedContainerd,
                                                     nri_pods: PodKit) -> None:
    first = _agent(launcher, nri_containerd)
    pod, sid, cid = _pod(nri_pods, "nri-kept")
    assert nri_pods.cpu_shares(pod, cid) == 300
    pid = nri_pods.direct.ContainerStatus(cri.ContainerStatusRequest(container_id=cid, verbose=True),
                                          timeout=10).info["info"]
    assert first.terminate() == 0
    second = _agent(launcher, nri_containerd)
    synced = second.wait_event("nri_synchronized")
    assert synced["pods"] >= 1 and synced["containers"] >= 1
    # Nothing happened to the running pod: same process, same cgroup value.
    status = nri_pods.direct.ContainerStatus(cri.ContainerStatusRequest(container_id=cid, verbose=True), timeout=10)
    assert status.status.state == cri.CONTAINER_RUNNING and status.info["info"] == pid
    assert nri_pods.cpu_shares(pod, cid) == 300
    # The store knows the pod from Synchronize alone, and hooks run again for new containers.
    code, body = http_get(second.metrics_port, f"/debug/explain?pod=krp-test/{pod.metadata.name}")
    assert code == 200 and sid.encode() in body
    other, _, cid2 = _pod(nri_pods, "nri-after-restart")
    assert nri_pods.cpu_shares(other, cid2) == 300


def test_containerd_restart_is_survived(launcher: ProxyLauncher, nri_containerd: EmbeddedContainerd,
                                        nri_pods: PodKit) -> None:
    agent = _agent(launcher, nri_containerd)
    pod, _, cid = _pod(nri_pods, "nri-before-ctrd-restart")
    nri_containerd.restart()
    agent.wait_event("nri_disconnected")
    agent.wait_event("nri_connected", count=2, timeout=30)
    status = nri_pods.direct.ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=10).status
    assert status.state == cri.CONTAINER_RUNNING
    assert nri_pods.cpu_shares(pod, cid) == 300
    after, _, cid2 = _pod(nri_pods, "nri-after-ctrd-restart", annotations={ANNOTATION: "800"})
    assert nri_pods.cpu_shares(after, cid2) == 800


def test_missing_nri_socket_is_one_clear_error(launcher: ProxyLauncher, nri_containerd: EmbeddedContainerd) -> None:
    absent = launcher.mkdtemp() / "absent.sock"
    extra = {"data_plane": "grpc", "ingress": "nri", "nri": {"socket": str(absent)}}
    agent = launcher.start(HOOKS, extra=extra, wait_ready=False)
    assert agent.wait_exit() == 2
    errors = [line for line in agent.log().splitlines() if "invalid configuration" in line]
    assert len(errors) == 1, agent.log()
    assert "nri.socket: no NRI socket there (ingress: nri)" in errors[0] and str(absent) in errors[0]


SLOW = textwrap.dedent('''
    """Test plugin: a PreCreateContainer hook that takes args.seconds, then sets cpu shares 999."""
    import time

    from runtimeproxy.hookapi import ContainerPatch, ResourcesPatch


    class Factory:
        def __init__(self, init):
            self.seconds = float(init.args["seconds"])

        def pre_create_container(self, ctx):
            time.sleep(self.seconds)
            return ContainerPatch(resources=ResourcesPatch(cpu_shares=999), reason="slow")
''')


@pytest.mark.parametrize("policy", ["Ignore", "Fail"])
def test_chain_deadline_answers_before_containerds_timeout(launcher: ProxyLauncher,
                                                           nri_containerd: EmbeddedContainerd,
                                                           nri_pods: PodKit, policy: str) -> None:
    """A hook slower than ``nri.chain_deadline`` (0.5 s) costs its patch (Ignore) or the
    container (Fail), never the plugin's connection: the reply beats containerd's 2 s."""
    plugin_dir = launcher.mkdtemp()
    (plugin_dir / "krp_slow.py").write_text(SLOW)
    hooks = [{"name": "slow", "plugin": "krp_slow:Factory", "failure_policy": policy, "timeout": "10s",
              "args": {"seconds": 3}}]
    agent = launcher.start(hooks, extra=_nri_extra(nri_containerd, chain_deadline="500ms"),
                           pythonpath=[plugin_dir])
    agent.wait_event("nri_synchronized")
    pod = nri_pods.sandbox(f"nri-slow-{policy.lower()}")
    sid = nri_pods.run(nri_pods.direct, pod)
    container = nri_pods.container("app", resources=cri.LinuxContainerResources(cpu_shares=512))
    start = time.monotonic()
    if policy == "Fail":
        with pytest.raises(grpc.RpcError) as err:
            nri_pods.create(nri_pods.direct, sid, pod, container)
        assert "'slow'" in err.value.details() and "timed out" in err.value.details()
    else:
        cid = nri_pods.create(nri_pods.direct, sid, pod, container)
    # Answered within the chain's deadline, well before containerd's 2 s plugin timeout.
    assert time.monotonic() - start < 2.0
    if policy == "Ignore":
        nri_pods.start(nri_pods.direct, cid)
        assert nri_pods.cpu_shares(pod, cid) == 512  # the slow hook's 999 was dropped
        agent.wait_event("hook_failed", hook="slow", policy="Ignore")
    assert not agent.events("nri_disconnected")
    assert "closing plugin" not in nri_containerd.log_tail(200)


OOM = textwrap.dedent('''
    """Test plugin: PreCreateContainer sets oom_score_adj 432 (NRI 0.6.1 cannot adjust it)."""
    from runtimeproxy.hookapi import ContainerPatch, ResourcesPatch


    class Factory:
        def __init__(self, init):
            pass

        def pre_create_container(self, ctx):
            return ContainerPatch(resources=ResourcesPatch(oom_score_adj=432), reason="oom test")
''')


def test_oom_score_adj_the_adjustment_cannot_carry_is_set_after_start(
        launcher: ProxyLauncher, nri_containerd: EmbeddedContainerd, nri_pods: PodKit) -> None:
    plugin_dir = launcher.mkdtemp()
    (plugin_dir / "krp_oom.py").write_text(OOM)
    agent = launcher.start([{"name": "oom", "plugin": "krp_oom:Factory", "failure_policy": "Fail"}],
                           extra=_nri_extra(nri_containerd), pythonpath=[plugin_dir])
    agent.wait_event("nri_synchronized")
    _, _, cid = _pod(nri_pods, "nri-oom")
    status = nri_pods.direct.ContainerStatus(cri.ContainerStatusRequest(container_id=cid, verbose=True), timeout=10)
    pid = json.loads(status.info["info"])["pid"]
    set_line = agent.wait_event("oom_score_adj_set", pid=pid, ingress="nri")
    assert set_line["value"] == 432
    assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() == "432"


WATCH = textwrap.dedent('''
    """Test plugin: PostCreateContainer appends the container's name to args.out."""


    class Factory:
        def __init__(self, init):
            self.out = init.args["out"]

        def post_create_container(self, ctx):
            with open(self.out, "a") as f:
                f.write(ctx.container.meta.name + "\\n")
''')


def test_reload_with_a_new_stage_registers_again_for_its_event(
        launcher: ProxyLauncher, nri_containerd: EmbeddedContainerd, nri_pods: PodKit) -> None:
    """containerd takes the event mask only at Configure: a reload adding a hook at a stage
    whose event is not subscribed (PostCreateContainer) makes the plugin register again."""
    plugin_dir = launcher.mkdtemp()
    (plugin_dir / "krp_watch.py").write_text(WATCH)
    out = plugin_dir / "created.txt"
    agent = launcher.start(HOOKS, extra=_nri_extra(nri_containerd), pythonpath=[plugin_dir])
    first = agent.wait_event("nri_configured")
    assert not int(first["events"], 16) & 0x10
    doc = agent.config()
    doc["hooks"] = [*HOOKS, {"name": "watch", "plugin": "krp_watch:Factory", "args": {"out": str(out)}}]
    agent.write_config(doc)
    agent.wait_event("config_reloaded", timeout=20)
    again = agent.wait_event("nri_configured", count=2)
    assert int(again["events"], 16) == int(first["events"], 16) | 0x10
    agent.wait_event("nri_connected", count=2)
    assert not agent.events("nri_disconnected")
    pod, _, cid = _pod(nri_pods, "nri-resubscribed")
    assert nri_pods.cpu_shares(pod, cid) == 300
    deadline = time.monotonic() + 10
    while not (out.exists() and out.read_text() == "app\n"):
        assert time.monotonic() < deadline, out.read_text() if out.exists() else "no PostCreateContainer"
        time.sleep(0.05)


def test_update_container_resources_goes_through_the_chain(launcher: ProxyLauncher, nri_containerd: EmbeddedContainerd,
                                                           nri_pods: PodKit) -> None:
    """PreUpdateContainerResources on NRI's UpdateContainer: the hook's value is returned as
    an update of that container and wins over the CRI request's (example hook: 300)."""
    agent = _agent(launcher, nri_containerd)
    pod, _, cid = _pod(nri_pods, "nri-updated")
    assert nri_pods.cpu_shares(pod, cid) == 300
    nri_pods.direct.UpdateContainerResources(cri.UpdateContainerResourcesRequest(
        container_id=cid, linux=cri.LinuxContainerResources(cpu_shares=600, memory_limit_in_bytes=96 << 20)),
        timeout=30)
    assert nri_pods.cpu_shares(pod, cid) == 300
    assert nri_pods.cgroup_value(pod, cid, "memory", "memory.limit_in_bytes") == str(96 << 20)
    code, body = http_get(agent.metrics_port, f"/debug/explain?pod=krp-test/{pod.metadata.name}")
    changes = [(c["stage"], c["target"], c["old"], c["new"]) for c in json.loads(body)["changes"]]
    assert code == 200 and ("PreUpdateContainerResources", "container.resources.cpu_shares", "600", "300") in changes


def test_healthz_says_when_the_nri_plugin_is_not_connected(launcher: ProxyLauncher,
                                                           nri_containerd: EmbeddedContainerd) -> None:
    """A socket that accepts but never speaks NRI (registration never answered): containerd
    would create pods without our hooks, so /healthz is 503 and says why."""
    silent = launcher.mkdtemp() / "silent.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(silent))
        listener.listen(8)
        agent = launcher.start(HOOKS, extra={"data_plane": "grpc", "ingress": "nri", "nri": {"socket": str(silent)}},
                               wait_ready=False)
        agent.wait_event("ready")
        status, body = http_get(agent.metrics_port, "/healthz")
        assert status == 503 and b"NRI plugin not connected to " + str(silent).encode() in body
    finally:
        listener.close()


BIG = textwrap.dedent('''
    """Test plugin: PreCreateContainer adds a 6 KB annotation (the reply exceeds one 4096-byte frame)."""
    from runtimeproxy.hookapi import ContainerPatch


    class Factory:
        def __init__(self, init):
            pass

        def pre_create_container(self, ctx):
            return ContainerPatch(annotations={"example.com/big": "x" * 6000}, reason="big")
''')


def test_a_reply_bigger_than_one_frame_reaches_containerd(launcher: ProxyLauncher, nri_containerd: EmbeddedContainerd,
                                                          nri_pods: PodKit) -> None:
    """containerd drops a plugin whose frame carries more than 4096 bytes (and creates the
    container without its adjustment); ours go out split, so the 6 KB annotation lands."""
    plugin_dir = launcher.mkdtemp()
    (plugin_dir / "krp_big.py").write_text(BIG)
    agent = launcher.start([{"name": "big", "plugin": "krp_big:Factory", "failure_policy": "Fail"}],
                           extra=_nri_extra(nri_containerd), pythonpath=[plugin_dir])
    agent.wait_event("nri_synchronized")
    _, _, cid = _pod(nri_pods, "nri-big")
    status = nri_pods.direct.ContainerStatus(cri.ContainerStatusRequest(container_id=cid, verbose=True), timeout=10)
    spec = json.loads(status.info["info"])["runtimeSpec"]
    assert spec["annotations"]["example.com/big"] == "x" * 6000
    assert not agent.events("nri_disconnected")


def test_fail_policy_error_at_run_pod_sandbox_refuses_the_pod(launcher: ProxyLauncher,
                                                               nri_containerd: EmbeddedContainerd,
                                                               nri_pods: PodKit) -> None:
    """PreRunPodSandbox's veto through RUN_POD_SANDBOX (the reference marks it read, not
    verified: here it is): containerd fails RunPodSandbox and leaves no sandbox."""
    from runtimeproxy.demo.scenario import kubelet_creates_pod_cgroup

    spec = "node.koordinator.sh/extended-resource-spec"
    agent = launcher.start([{"name": "batch", "plugin": "batch-resource", "failure_policy": "Fail"}],
                           extra=_nri_extra(nri_containerd))
    agent.wait_event("nri_synchronized")
    pod = nri_pods.sandbox("nri-batch-bad", qos="besteffort", labels={"koordinator.sh/qosClass": "BE"}, annotations={
        spec: '{"containers": {"app": {"requests": {"kubernetes.io/batch-cpu": "-5"}}}}'})
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    with pytest.raises(grpc.RpcError) as err:
        nri_pods.run(nri_pods.direct, pod)
    details = err.value.details()
    assert "'batch'" in details and "PreRunPodSandbox" in details and spec in details
    listed = nri_pods.direct.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=10).items
    assert not [p for p in listed if p.metadata.name == "nri-batch-bad" and p.state == cri.SANDBOX_READY]
    agent.wait_event("cri_call_rejected", hook="batch", stage="PreRunPodSandbox", ingress="nri")
