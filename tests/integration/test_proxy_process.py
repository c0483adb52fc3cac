"""The proxy as a process: bad config, reload, graceful stop, backend outages."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Any

import grpc
import pytest
import yaml

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo.embedded import EmbeddedContainerd, runtime_stub, unix_channel


def shares_hook(shares: Any, **extra: Any) -> dict[str, Any]:
    return {"name": "shares", "plugin": "example-cpu-shares", "failure_policy": "Fail",
            "args": {"cpu_shares": shares}, **extra}


# --- (a) invalid configuration -------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "key_path", "bad_value"),
    [
        ({"hooks": [shares_hook(300, timeout="-1s")]}, "hooks[0].timeout: ", "'-1s'"),
        ({"bogus_key": 1}, "bogus_key: ", "1"),
        ({"hooks": [{"name": "x", "plugin": "no-such-plugin"}]}, "hooks[0].plugin: ",
         "'no-such-plugin'"),
        ({"hooks": [shares_hook(300, stages=["PreCreateContainer", "PreFlyContainer"])]},
         "hooks[0].stages[1]: ", "'PreFlyContainer'"),
        ({"hooks": [shares_hook("lots")]}, "hooks[0].args.cpu_shares: ", "'lots'"),
    ],
    ids=["negative-timeout", "unknown-key", "unknown-plugin", "unknown-stage", "bad-plugin-arg"],
)
def test_invalid_config_exits_2_naming_key_and_value(
    proxy_factory: Any, containerd: EmbeddedContainerd, change: dict[str, Any], key_path: str, bad_value: str
) -> None:
    workdir = proxy_factory.mkdtemp()
    doc = {"listen": str(workdir / "proxy.sock"), "backend": {"runtime_endpoint": str(containerd.socket)},
           "metrics": {"listen": "127.0.0.1:0"}, "hookserver_dir": "",
           # A private state_dir: the default one may be locked by another proxy on the host,
           # and the lock is taken before the hooks (whose errors some cases expect) are built.
           "state_dir": str(workdir / "state"), **change}
    config = workdir / "config.yaml"
    config.write_text(yaml.safe_dump(doc))
    out = subprocess.run([sys.executable, "-m", "runtimeproxy.cli", "run", "--config", str(config)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("koord-runtime-proxy: invalid configuration: " + key_path), out.stderr
    assert f"(got {bad_value})" in out.stderr, out.stderr
    assert not (workdir / "proxy.sock").exists(), "a bad config must stop the proxy before it listens"


# --- (b) reload -----------------------------------------------------------------------


def _new_container_shares(pods: Any, rt: Any, name: str) -> int:
    pod = pods.sandbox(name)
    sid = pods.run(rt, pod)
    cid = pods.create(rt, sid, pod, pods.container(
        "app", resources=cri.LinuxContainerResources(cpu_shares=512)))
    pods.start(rt, cid)
    return int(pods.cpu_shares(pod, cid))


def test_reload_rejects_bad_config_and_applies_good_one(proxy_factory: Any, pods: Any) -> None:
    proxy = proxy_factory.start([shares_hook(300)], extra={"reload_poll_interval": "200ms"})
    rt = proxy.runtime()
    assert _new_container_shares(pods, rt, "reload-before") == 300

    good = proxy.config()
    bad = {**good, "hooks": [shares_hook(400, timeout="-1s")]}
    proxy.write_config(bad)
    rejected = proxy.wait_event("config_reload_rejected", trigger="file-change")
    assert "hooks[0].timeout" in rejected["error"] and "-1s" in rejected["error"]
    assert rejected["kept"] == "previous config"
    proxy.send(signal.SIGHUP)
    proxy.wait_event("config_reload_rejected", trigger="SIGHUP")
    assert proxy.running and proxy.healthz() == 200
    assert _new_container_shares(pods, rt, "reload-rejected") == 300, "the previous config is kept"

    proxy.write_config({**good, "hooks": [shares_hook(400)]})
    reloaded = proxy.wait_event("config_reloaded", trigger="file-change")
    assert reloaded["hooks"] == ["shares"]
    assert _new_container_shares(pods, rt, "reload-applied") == 400

    # SIGHUP alone (file unchanged since the last reload) re-reads and still applies.
    proxy.send(signal.SIGHUP)
    proxy.wait_event("config_reloaded", trigger="SIGHUP")
    assert _new_container_shares(pods, rt, "reload-sighup") == 400


# --- (c) graceful stop -----------------------------------------------------------------


def test_sigterm_drains_in_flight_calls_and_refuses_new_ones(proxy_factory: Any, pods: Any) -> None:
    """The gRPC transport's drain: the socket is Python's, so every new call is refused.
    (With HAProxy, the default, pass-through goes on during the drain and new lifecycle
    calls fail fast: test_dataplane_haproxy.test_during_the_drain_...)"""
    proxy = proxy_factory.start(extra={"data_plane": "grpc"})
    rt = proxy.runtime()
    pod = pods.sandbox("drain")
    sid = pods.run(rt, pod)
    cid = pods.create(rt, sid, pod, pods.container("app", command=["sleep", "3600"]))
    pods.start(rt, cid)

    # sleep is PID 1 and ignores SIGTERM: containerd waits the full 3 s, then SIGKILLs.
    started = time.monotonic()
    in_flight = rt.StopContainer.future(cri.StopContainerRequest(container_id=cid, timeout=3), timeout=30)
    # SIGTERM only once the proxy has the call (not after a fixed pause a loaded machine
    # may outlast): the call is then in flight and must be drained, not refused.
    deadline = time.monotonic() + 10
    while proxy.cri_calls("StopContainer") < 1:
        assert time.monotonic() < deadline, "StopContainer did not reach the proxy within 10 s"
        time.sleep(0.02)
    proxy.send(signal.SIGTERM)
    proxy.wait_event("stopping", timeout=5)
    assert not in_flight.done()

    with pytest.raises(grpc.RpcError) as refused:
        with unix_channel(proxy.socket) as fresh:
            runtime_stub(fresh).Version(cri.VersionRequest(), timeout=2)
    # Refused either way: the listener is closed (UNAVAILABLE), or grpc core had already
    # accepted the connection and cancels the call on the stopping server (CANCELLED).
    assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    with pytest.raises(grpc.RpcError) as refused_same:
        rt.Version(cri.VersionRequest(), timeout=2)
    assert refused_same.value.code() is grpc.StatusCode.UNAVAILABLE

    in_flight.result(timeout=30)  # the drained call completes successfully
    assert time.monotonic() - started >= 2.5
    assert proxy.wait_exit(30) == 0
    order = [e["event"] for e in proxy.events() if e["event"] in ("stopping", "cri_call", "stopped")
             and e.get("method", "StopContainer") == "StopContainer"]
    assert order == ["stopping", "cri_call", "stopped"], "the call finished during the drain, before exit"
    assert proxy.events("cri_call", method="StopContainer", result="OK", container_id=cid)
    assert not proxy.socket.exists()
    status = pods.direct.ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=10).status
    assert status.state == cri.CONTAINER_EXITED


# --- (d) backend down, then back -------------------------------------------------------


def test_backend_down_fails_fast_then_recovers_without_restart(proxy_factory: Any) -> None:
    backend_dir = proxy_factory.mkdtemp() / "ctrd"
    late = EmbeddedContainerd(backend_dir)
    assert not late.socket.exists()
    proxy = proxy_factory.start(backend=late.socket, wait_ready=False)
    proxy.wait_event("backend_unavailable", endpoint=str(late.socket))
    assert proxy.healthz() == 503
    rt = proxy.runtime()

    for call in (
        lambda: rt.Version(cri.VersionRequest(), timeout=30),  # passthrough
        lambda: rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id="x" * 64), timeout=30),  # intercepted
    ):
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - start < 2.0

    try:
        late.start()
        deadline = time.monotonic() + 10
        while True:
            try:
                version = rt.Version(cri.VersionRequest(), timeout=2)
                break
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.UNAVAILABLE
                assert time.monotonic() < deadline, "proxy did not reconnect to the backend within 10 s"
                time.sleep(0.1)
        assert version == late.version()
        while proxy.healthz() != 200:
            assert time.monotonic() < deadline + 5, proxy.log()
            time.sleep(0.1)
        proxy.wait_event("store_rebuilt")
        assert proxy.running and len(proxy.events("listening")) == 1, "the same proxy process recovered"
    finally:
        late.stop()

