"""A proxy restart loses nothing hooks need.

Stop/Update calls carry only a container id; the pod's cgroup parent, the
container's resources and envs come from the proxy's store. After a restart the
store is rebuilt from containerd (list + verbose status). A recording hook plugin,
loaded from a tmp dir by ``module:attr``, writes the context it receives so the
test can see exactly what the new proxy instance knows about a pre-restart
container.
"""

from __future__ import annotations

import json
import signal
import socket
import textwrap
from pathlib import Path
from typing import Any

from criapi import cri_v1_pb2 as cri

RECORDER = textwrap.dedent('''
    """Test plugin: append the context of each call as one JSON line to args.out."""
    import dataclasses
    import json


    class Factory:
        def __init__(self, init):
            self.out = init.args["out"]

        def _record(self, ctx):
            res = ctx.container.resources
            resources = {f.name: getattr(res, f.name) for f in dataclasses.fields(res)}
            resources["unified"] = dict(res.unified)
            rec = {
                "stage": ctx.stage.value,
                "pod": {"id": ctx.pod.id, "name": ctx.pod.meta.name, "uid": ctx.pod.meta.uid,
                        "cgroup_parent": ctx.pod.cgroup_parent, "annotations": dict(ctx.pod.annotations)},
                "container": {"id": ctx.container.id, "name": ctx.container.meta.name,
                              "resources": resources, "envs": dict(ctx.container.envs)},
            }
            with open(self.out, "a") as f:
                f.write(json.dumps(rec) + "\\n")

        def pre_update_container_resources(self, ctx):
            self._record(ctx)

        def pre_stop_container(self, ctx):
            self._record(ctx)
''')

ENVS = {"FOO": "bar", "GREETING": "hello world", "X": "1"}
RESOURCES = cri.LinuxContainerResources(cpu_shares=512, cpu_quota=50000, cpu_period=100000,
                                        memory_limit_in_bytes=64 << 20)


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _plant_stale_socket(path: Path) -> None:
    """What a crashed proxy leaves behind: a socket file nobody listens on."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
    assert path.is_socket()


def test_rebuilt_store_feeds_hooks_after_restart(proxy_factory: Any, pods: Any) -> None:
    plugin_dir = proxy_factory.mkdtemp()
    (plugin_dir / "krp_recorder.py").write_text(RECORDER)
    out = plugin_dir / "calls.jsonl"
    hooks = [{"name": "recorder", "plugin": "krp_recorder:Factory", "args": {"out": str(out)}}]

    first = proxy_factory.start(hooks, pythonpath=[plugin_dir])
    rt = first.runtime()
    pod = pods.sandbox("restarted", annotations={"team": "a"})
    sid = pods.run(rt, pod)
    cid = pods.create(rt, sid, pod, pods.container("app", resources=RESOURCES, envs=ENVS))
    pods.start(rt, cid)

    assert first.terminate() == 0
    assert first.events("stopped")
    assert not first.socket.exists(), "a clean stop removes the socket"
    _plant_stale_socket(first.socket)

    second = proxy_factory.start(hooks, socket_path=first.socket, pythonpath=[plugin_dir])
    second.wait_event("stale_socket_removed", path=str(first.socket))
    rebuilt = second.wait_event("store_rebuilt")
    assert rebuilt["pods"] >= 1 and rebuilt["containers"] >= 1
    assert not _records(out), "nothing was recorded before the restart"

    rt = second.runtime()
    rt.UpdateContainerResources(cri.UpdateContainerResourcesRequest(
        container_id=cid, linux=cri.LinuxContainerResources(cpu_shares=600)), timeout=30)
    assert pods.cpu_shares(pod, cid) == 600
    rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0), timeout=30)

    update, stop = _records(out)
    assert update["stage"] == "PreUpdateContainerResources" and stop["stage"] == "PreStopContainer"
    for rec in (update, stop):
        assert rec["pod"] == {"id": sid, "name": "restarted", "uid": pod.metadata.uid,
                              "cgroup_parent": pod.linux.cgroup_parent, "annotations": {"team": "a"}}
        assert rec["container"]["id"] == cid and rec["container"]["name"] == "app"
        assert rec["container"]["envs"] == ENVS
        res = rec["container"]["resources"]
        assert (res["cpu_quota"], res["cpu_period"], res["memory_limit_in_bytes"]) == (50000, 100000, 64 << 20)
    # Update sees the request merged onto the stored resources; Stop sees the updated store.
    assert update["container"]["resources"]["cpu_shares"] == 600
    assert stop["container"]["resources"]["cpu_shares"] == 600


def test_second_instance_refuses_a_live_socket(proxy_factory: Any) -> None:
    running = proxy_factory.start()
    intruder = proxy_factory.start(socket_path=running.socket, wait_ready=False)
    code = intruder.wait_exit(30)
    assert code != 0
    assert f"{running.socket} is held by a live process" in intruder.log()
    # The running instance keeps its socket and keeps serving.
    assert running.socket.is_socket()
    assert running.runtime().Version(cri.VersionRequest(), timeout=5).runtime_name == "containerd"
    assert running.healthz() == 200
    running.send(signal.SIGTERM)
    assert running.wait_exit() == 0


def test_explain_history_survives_a_process_restart(proxy_factory: Any, pods: Any) -> None:
    import urllib.request

    import yaml

    from runtimeproxy.demo.scenario import DEFAULT_CONFIG, kubelet_creates_pod_cgroup

    shipped = yaml.safe_load(DEFAULT_CONFIG.read_text())
    extra = {"rules": shipped["rules"], "state_dir": str(proxy_factory.mkdtemp() / "state")}

    def changes(proxy: Any) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{proxy.metrics_port}/debug/explain?pod=krp-test/remembered"
        with urllib.request.urlopen(url, timeout=5) as resp:
            found: list[dict[str, Any]] = json.loads(resp.read())["changes"]
        return found

    first = proxy_factory.start(shipped["hooks"], extra=extra)
    pod = pods.sandbox("remembered", qos="besteffort", labels={"koordinator.sh/qosClass": "BE"})
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    pods.run(first.runtime(), pod)
    before = changes(first)
    assert any(c["hook"] == "group-identity" and c["target"].endswith("cpu.idle") for c in before), before
    assert first.terminate() == 0

    second = proxy_factory.start(shipped["hooks"], extra=extra)
    assert changes(second)[:len(before)] == before, "explain forgot the changes recorded before the restart"
