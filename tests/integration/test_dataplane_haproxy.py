"""The HAProxy data plane as the proxy process runs it outside systemd: a plain child
(kill -9, config reloads under load, it dies with us, stop), in front of the real fixture
containerd. Under systemd (its own unit): test_systemd_units. The parity suites (test_proxy_parity, test_proxy_relay,
test_proxy_hooks_cgroups) run through both data planes."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import grpc
import pytest

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo.embedded import EmbeddedContainerd, runtime_stub, unix_channel

VERSION = "/runtime.v1.RuntimeService/Version"
LIST = "/runtime.v1.RuntimeService/ListContainers"
CALL_TIMEOUT = 2.0


#: HAProxy sends Python only the lifecycle calls some Pre hook needs (plus the two that bring
#: objects into the store): plugins (``watch_plugin``) that make Python get StopContainer /
#: RemovePodSandbox first. They change nothing.
WATCH_STOP: Final = {"name": "watch-stop", "plugin": "krp_watch:PreStop", "failure_policy": "Ignore"}
WATCH_REMOVE: Final = {"name": "watch-remove", "plugin": "krp_watch:PreRemove", "failure_policy": "Ignore"}
WATCH_MODULE: Final = """
class PreStop:
    def __init__(self, init):
        pass

    def pre_stop_container(self, ctx):
        return None


class PreRemove:
    def __init__(self, init):
        pass

    def pre_remove_pod_sandbox(self, ctx):
        return None
"""
#: Post stages only: Stop/Remove calls go straight to containerd, found after by the re-sync.
#: A remote hook that points nowhere: each of its stages is a logged failure (hook_failed), ignored.
WATCH_POST: Final = {"name": "watch-post", "remote": "/nonexistent/krp-hook.sock",
                     "stages": ["PostStartContainer", "PostStopContainer", "PostStopPodSandbox"],
                     "failure_policy": "Ignore"}


@pytest.fixture
def watch_plugin(proxy_factory: Any) -> list[Path]:
    """The ``pythonpath`` of a proxy that runs WATCH_STOP / WATCH_REMOVE."""
    directory = proxy_factory.mkdtemp()
    (directory / "krp_watch.py").write_text(WATCH_MODULE)
    return [directory]


@pytest.fixture
def haproxy_config(haproxy_data_plane: dict[str, Any]) -> dict[str, Any]:
    return {**haproxy_data_plane, "reload_poll_interval": "200ms"}


def _haproxy_pid(proxy: Any, starts: int) -> int:
    return int(proxy.wait_event("data_plane_started", starts=starts)["pid"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not reaped yet) is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped between the kill and the read (ESRCH)
        return False


class Clients:
    """``n`` threads calling ``method`` in a loop on their own channels; every outcome and
    the slowest call are recorded."""

    def __init__(self, socket: Any, method: str, n: int = 5) -> None:
        self.outcomes: Counter[str] = Counter()
        self.slowest = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        payload = cri.VersionRequest(version="v1").SerializeToString() if method == VERSION else b""
        self._threads = [threading.Thread(target=self._loop, args=(socket, method, payload), daemon=True)
                         for _ in range(n)]

    def _loop(self, socket: Any, method: str, payload: bytes) -> None:
        with unix_channel(socket) as channel:
            call = channel.unary_unary(method)
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    call(payload, timeout=CALL_TIMEOUT)
                    outcome = "OK"
                except grpc.RpcError as exc:
                    outcome = f"{exc.code().name}: {exc.details()}"
                took = time.monotonic() - start
                with self._lock:
                    self.outcomes[outcome] += 1
                    self.slowest = max(self.slowest, took)
                if outcome != "OK":
                    time.sleep(0.01)

    def __enter__(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)

    def ok(self) -> int:
        with self._lock:
            return self.outcomes["OK"]


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not {what} after {timeout}s")
        time.sleep(0.02)
    return time.monotonic() - start


def _answers(socket: Any) -> bool:
    with unix_channel(socket) as channel:
        try:
            channel.unary_unary(VERSION)(cri.VersionRequest(version="v1").SerializeToString(), timeout=0.5)
        except grpc.RpcError:
            return False
    return True


def test_kill_9_of_haproxy_is_back_within_2s_on_the_same_socket(
    proxy_factory: Any, haproxy_config: dict[str, Any]
) -> None:
    proxy = proxy_factory.start(extra=haproxy_config)
    first = _haproxy_pid(proxy, 1)
    inode = os.stat(proxy.socket).st_ino
    with Clients(proxy.socket, LIST) as clients:
        _wait(lambda: clients.ok() > 50, 10, "calling")
        os.kill(first, signal.SIGKILL)
        killed = time.monotonic()
        _wait(lambda: not _alive(first), 5, "gone")
        _wait(lambda: _answers(proxy.socket), 5, "answering again")
        back = time.monotonic() - killed
        second = _haproxy_pid(proxy, 2)
        before = clients.ok()
        _wait(lambda: clients.ok() > before + 50, 10, "calling again")
    assert back < 2.0, f"back after {back:.2f}s"
    assert second != first and proxy.socket.exists() and os.stat(proxy.socket).st_ino != inode
    # Every call succeeded or failed UNAVAILABLE, and none hung past its deadline.
    assert {o.split(":")[0] for o in clients.outcomes} <= {"OK", "UNAVAILABLE"}, clients.outcomes
    assert clients.slowest < CALL_TIMEOUT + 1.0, clients.slowest
    assert proxy.events("data_plane_exited", code=-9)


def test_config_reloads_under_load_fail_no_call(proxy_factory: Any, haproxy_config: dict[str, Any]) -> None:
    proxy = proxy_factory.start(extra=haproxy_config)
    pid = _haproxy_pid(proxy, 1)
    with Clients(proxy.socket, LIST) as clients:
        # 5 reloads spread over 10 000 calls: one every ~1 700 calls, the last ~1 500 before the end.
        for i in range(1, 6):
            _wait(lambda n=i * 1_700: clients.ok() >= n, 60, f"{i * 1_700} calls")
            doc = proxy.config()
            doc["data_plane_idle_timeout"] = f"{10 + i}h"
            proxy.write_config(doc)
            proxy.wait_event("data_plane_reloaded", count=i, timeout=10)
        _wait(lambda: clients.ok() >= 10_000, 60, "10 000 calls")
    assert set(clients.outcomes) == {"OK"}, clients.outcomes
    assert sum(clients.outcomes.values()) >= 10_000
    # The same master, reloaded: no restart.
    assert [e["pid"] for e in proxy.events("data_plane_started")] == [pid]
    cfg = (proxy.socket.parent / f".{proxy.socket.name}.dataplane" / "haproxy.cfg").read_text()
    assert "timeout server 54000000ms" in cfg


def test_haproxy_dies_with_a_killed_proxy_and_the_next_one_takes_the_socket(
    proxy_factory: Any, haproxy_config: dict[str, Any], containerd: EmbeddedContainerd
) -> None:
    proxy = proxy_factory.start(extra=haproxy_config)
    pid = _haproxy_pid(proxy, 1)
    proxy.send(signal.SIGKILL)
    assert proxy.wait_exit() == -9
    _wait(lambda: not _alive(pid), 5, "haproxy gone with its parent")
    again = proxy_factory.start(extra=haproxy_config, socket_path=proxy.socket)
    assert _answers(again.socket)


def test_sigterm_stops_haproxy_last_and_removes_the_socket(
    proxy_factory: Any, haproxy_config: dict[str, Any]
) -> None:
    proxy = proxy_factory.start(extra={**haproxy_config, "shutdown_grace": "2s"})
    pid = _haproxy_pid(proxy, 1)
    assert _answers(proxy.socket)
    assert proxy.terminate() == 0
    assert not _alive(pid)
    assert not proxy.socket.exists()
    events = [e["event"] for e in proxy.events()]
    assert events.index("data_plane_stopped") > events.index("stopping")
    assert events.index("data_plane_stopped") < events.index("stopped")
    # HAProxy's own messages arrive as JSON log lines, not as its plain text.
    assert any("Loading success" in e["text"] for e in proxy.events("data_plane_message"))
    assert not [line for line in proxy.log().splitlines() if line.startswith(("[NOTICE]", "[WARNING]", "[ALERT]"))]


def test_non_cri_service_is_unimplemented_and_containerd_sees_nothing(
    proxy_factory: Any, haproxy_config: dict[str, Any], containerd: EmbeddedContainerd
) -> None:
    """containerd's own API behind the same socket: served directly, refused through HAProxy
    (the refusal comes from HAProxy: no backend connection is made for it)."""
    proxy = proxy_factory.start(extra=haproxy_config)
    native = "/containerd.services.namespaces.v1.Namespaces/List"
    with unix_channel(containerd.socket) as direct:
        direct.unary_unary(native)(b"", timeout=5)  # containerd serves it
    stats = proxy.socket.parent / f".{proxy.socket.name}.dataplane" / "stats.sock"

    def backend_sessions() -> int:
        """Sessions HAProxy ever opened to containerd (its stats, backend "runtime")."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(stats))
            sock.sendall(b"show stat\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        header, *rows = data.decode().splitlines()
        fields = header.lstrip("# ").split(",")
        row = next(r.split(",") for r in rows if r.startswith("runtime,BACKEND"))
        return int(row[fields.index("stot")])

    before = backend_sessions()
    with unix_channel(proxy.socket) as channel:
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary(native)(b"", timeout=5, metadata=(("containerd-namespace", "k8s.io"),))
            assert err.value.code() is grpc.StatusCode.UNIMPLEMENTED
    assert backend_sessions() == before


def test_second_instance_refuses_haproxys_live_socket(proxy_factory: Any, haproxy_config: dict[str, Any]) -> None:
    running = proxy_factory.start(extra=haproxy_config)
    intruder = proxy_factory.start(extra=haproxy_config, socket_path=running.socket, wait_ready=False)
    assert intruder.wait_exit(30) != 0
    assert f"{running.socket} is held by a live process" in intruder.log()
    assert not intruder.events("data_plane_started")
    assert _answers(running.socket)


def _cycle(rt: Any, pods: Any, name: str) -> None:
    pod = pods.sandbox(name)
    sid = pods.run(rt, pod)
    cid = pods.create(rt, sid, pod, pods.container("app", command=["sleep", "3600"]))
    pods.start(rt, cid)
    rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0), timeout=30)
    rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid), timeout=30)
    rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=30)
    rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=30)


def _post_stages(proxy: Any, pod: str) -> set[str]:
    return {e["stage"] for e in proxy.events("hook_failed", pod_name=pod)}


def test_python_gets_only_the_calls_a_pre_hook_needs_stops_are_found_by_the_resync_and_a_reload_reroutes(
    proxy_factory: Any, haproxy_config: dict[str, Any], pods: Any, watch_plugin: list[Path]
) -> None:
    """Only Post hooks: Run/Create/StartContainer (the store needs them; Start's Post stages
    place the container's tasks) reach Python before containerd; Stop/Remove go straight to
    containerd, counted by HAProxy, and what follows them is found by the re-sync: their
    Post stages run in Python (the hook points nowhere, so each is a logged, ignored
    failure). A reload that adds a PreStopContainer hook sends StopContainer to Python
    first from then on."""
    proxy = proxy_factory.start([WATCH_POST], extra={**haproxy_config, "resync_interval": "1s"},
                                pythonpath=watch_plugin)
    rt = proxy.runtime()

    _cycle(rt, pods, "route-a")
    seen = {e["method"] for e in proxy.events("cri_call", pod_name="route-a")}
    assert seen == {"RunPodSandbox", "CreateContainer", "StartContainer"}
    for method in ("StopContainer", "RemoveContainer", "StopPodSandbox", "RemovePodSandbox"):
        assert proxy.cri_calls(method, "passthrough") == 1, method
        assert proxy.cri_calls(method, "intercepted") == 0, method
    want = {"PostStartContainer", "PostStopContainer", "PostStopPodSandbox"}
    _wait(lambda: _post_stages(proxy, "route-a") == want, 10, "the Post stages, Stop's from the re-sync")
    [stop] = proxy.events("hook_failed", pod_name="route-a", stage="PostStopContainer")
    assert stop["container_name"] == "app" and "method" not in stop  # no call: found from containerd's state

    doc = proxy.config()
    doc["hooks"] = [WATCH_POST, WATCH_STOP]
    proxy.write_config(doc)
    proxy.wait_event("data_plane_reloaded", timeout=10)
    proxy.wait_event("config_reloaded", timeout=10)
    time.sleep(0.5)  # the new worker takes the listener
    _cycle(rt, pods, "route-b")
    seen = {e["method"] for e in proxy.events("cri_call", pod_name="route-b")}
    assert seen == {"RunPodSandbox", "CreateContainer", "StartContainer", "StopContainer"}
    assert proxy.cri_calls("StopContainer", "intercepted") == 1
    assert proxy.cri_calls("StopContainer", "passthrough") == 1  # route-a's, counted by the old worker
    _wait(lambda: _post_stages(proxy, "route-b") == want, 10, "the Post stages after the reload")
    assert len(proxy.events("hook_failed", pod_name="route-b", stage="PostStopContainer")) == 1  # once


def test_during_the_drain_pass_through_keeps_working_and_new_lifecycle_calls_fail_fast(
    proxy_factory: Any, haproxy_config: dict[str, Any], pods: Any, watch_plugin: list[Path]
) -> None:
    """SIGTERM with a lifecycle call in flight: Python drains it; HAProxy, stopped last,
    still relays pass-through calls meanwhile; a new lifecycle call gets UNAVAILABLE at once
    (kubelet retries), not a hang."""
    proxy = proxy_factory.start([WATCH_STOP], extra=haproxy_config, pythonpath=watch_plugin)
    rt = proxy.runtime()
    pod = pods.sandbox("drain-hx")
    sid = pods.run(rt, pod)
    cid = pods.create(rt, sid, pod, pods.container("app", command=["sleep", "3600"]))
    pods.start(rt, cid)
    # sleep is PID 1 and ignores SIGTERM: containerd waits the full 3 s, then SIGKILLs.
    in_flight = rt.StopContainer.future(cri.StopContainerRequest(container_id=cid, timeout=3), timeout=30)
    _wait(lambda: proxy.cri_calls("StopContainer") >= 1, 10, "StopContainer at the proxy")
    proxy.send(signal.SIGTERM)
    proxy.wait_event("stopping", timeout=5)
    assert not in_flight.done()

    with unix_channel(proxy.socket) as fresh:
        stub = runtime_stub(fresh)
        assert stub.Version(cri.VersionRequest(), timeout=2).runtime_name == "containerd"
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            stub.StopContainer(cri.StopContainerRequest(container_id="no-such"), timeout=5)  # intercepted
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - start < 2.0
    in_flight.result(timeout=30)  # the drained call completes
    assert proxy.wait_exit(30) == 0
    events = [e["event"] for e in proxy.events()]
    assert events.index("stopping") < events.index("data_plane_stopped") < events.index("stopped")


class _Lifecycle:
    """One client looping on a lifecycle call (RemovePodSandbox of a pod that does not
    exist: containerd answers OK) while the Python process restarts."""

    def __init__(self, socket: Any) -> None:
        self.details: set[str] = set()
        self.broken: list[tuple[float, float]] = []  # (start, end) of calls neither OK nor UNAVAILABLE
        self.outcomes: Counter[str] = Counter()
        self.slowest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(socket,), daemon=True)

    def _loop(self, socket: Any) -> None:
        payload = cri.RemovePodSandboxRequest(pod_sandbox_id="krp-no-such-pod").SerializeToString()
        with unix_channel(socket) as channel:
            call = channel.unary_unary("/runtime.v1.RuntimeService/RemovePodSandbox")
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    call(payload, timeout=CALL_TIMEOUT)
                    outcome = "OK"
                except grpc.RpcError as exc:
                    outcome = exc.code().name
                    self.details.add(f"{outcome}: {exc.details()}")
                end = time.monotonic()
                self.slowest = max(self.slowest, end - start)
                self.outcomes[outcome] += 1
                if outcome not in ("OK", "UNAVAILABLE"):
                    self.broken.append((start, end))
                time.sleep(0.02)

    def __enter__(self) -> _Lifecycle:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
