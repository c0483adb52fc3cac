"""Kubelet /pods against a local HTTP server; node facts from Node objects."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import structlog

from metrics.informer.states import (
    KubeletPod,
    KubeletPods,
    StatesInformer,
    annotation_reserved_cpu_of,
    kubelet_reserved_cpu_of,
    node_capacity_of,
)


class Kubelet:
    """Answers GET /pods with ``self.answer`` (status, body bytes); records auth headers."""

    def __init__(self) -> None:
        self.answer: tuple[int, bytes] = (200, b'{"kind":"PodList","items":[]}')
        self.auth: list[str | None] = []
        self.paths: list[str] = []
        kubelet = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                kubelet.paths.append(self.path)
                kubelet.auth.append(self.headers.get("Authorization"))
                status, body = kubelet.answer
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def pods(self, *items: dict[str, Any]) -> None:
        self.answer = (200, json.dumps({"kind": "PodList", "items": list(items)}).encode())


@pytest.fixture
def kubelet() -> Iterator[Kubelet]:
    server = Kubelet()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


def kpod(uid: str, name: str, priority: int | None = None, **spec: Any) -> dict[str, Any]:
    pod: dict[str, Any] = {"metadata": {"name": name, "namespace": "ns", "uid": uid},
                           "spec": dict(spec), "status": {"phase": "Running", "qosClass": "Burstable"}}
    if priority is not None:
        pod["spec"]["priority"] = priority
    return pod


def test_fetch_parses_pods(kubelet: Kubelet) -> None:
    kubelet.pods(kpod("u1", "web", 9500, priorityClassName="koord-prod"), kpod("u2", "batch"), {"metadata": {}})
    pods = KubeletPods(kubelet.url).fetch()
    assert kubelet.paths == ["/pods"]
    assert pods == {
        "u1": KubeletPod("web", "ns", "u1", 9500, "Running", "Burstable", "koord-prod"),
        "u2": KubeletPod("batch", "ns", "u2", None, "Running", "Burstable", ""),
    }


def test_bearer_token_is_read_each_time(kubelet: Kubelet, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    kubelet.pods(kpod("u1", "web"))
    client = KubeletPods(kubelet.url + "/", token_path=token)
    client.fetch()
    token.write_text("rotated")
    client.fetch()
    assert kubelet.auth == ["Bearer first", "Bearer rotated"]


def test_empty_list_and_errors_are_ignored_and_logged_once(kubelet: Kubelet) -> None:
    client = KubeletPods(kubelet.url, timeout=2)
    with structlog.testing.capture_logs() as logs:
        assert client.fetch() is None  # empty list
        assert client.fetch() is None
        kubelet.answer = (500, b"boom")
        assert client.fetch() is None
        assert client.fetch() is None
        kubelet.answer = (200, b"{not json")
        assert client.fetch() is None
        kubelet.pods(kpod("u1", "web"))
        assert client.fetch() is not None
    assert [e["event"] for e in logs] == [
        "kubelet_pods_empty_ignored", "kubelet_pods_failed", "kubelet_pods_failed", "kubelet_pods_recovered",
    ]


def test_items_null_is_an_empty_list_not_a_warning(kubelet: Kubelet) -> None:
    """kubelet (Go) answers a node without pods with ``"items": null``."""
    client = KubeletPods(kubelet.url)
    kubelet.answer = (200, b'{"kind":"PodList","apiVersion":"v1","metadata":{},"items":null}')
    with structlog.testing.capture_logs() as logs:
        assert client.fetch() is None  # ignored like an empty list (koordlet does too)
        kubelet.answer = (200, b'{"kind":"PodList","items":{}}')
        assert client.fetch() is None
    assert [(e["event"], e["log_level"]) for e in logs] == [
        ("kubelet_pods_empty_ignored", "info"), ("kubelet_pods_garbled", "warning")]


@pytest.mark.asyncio
async def test_informer_priority_from_kubelet(kubelet: Kubelet) -> None:
    kubelet.pods(kpod("u1", "web", 9100))
    informer = StatesInformer(None, KubeletPods(kubelet.url), sync_interval=0.05)
    assert informer.priority_of("u1") is None
    task = asyncio.create_task(informer.run())
    async with asyncio.timeout(10):
        while informer.priority_of("u1") is None:
            await asyncio.sleep(0.01)
    assert informer.priority_of("u1") == 9100
    kubelet.answer = (200, b'{"items": []}')  # a transient empty answer keeps what we had
    # Every request counted from here got the empty answer; syncs run one after the
    # other, so once a second one has arrived the first has been fully handled.
    asked = len(kubelet.paths)
    async with asyncio.timeout(10):
        while len(kubelet.paths) < asked + 2:
            await asyncio.sleep(0.01)
    assert informer.priority_of("u1") == 9100
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert informer.nodeslo_rules() is None and informer.node_capacity() is None


def node(capacity: dict[str, str], allocatable: dict[str, str], reservation: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "n"}
    if reservation is not None:
        meta["annotations"] = {"node.koordinator.sh/reservation": reservation}
    return {"metadata": meta, "status": {"capacity": capacity, "allocatable": allocatable}}


def test_node_capacity_and_reserved() -> None:
    n = node({"cpu": "16", "memory": "64Gi"}, {"cpu": "15500m", "memory": "60Gi"})
    assert node_capacity_of(n) == (16.0, 64 * 1024**3)
    assert kubelet_reserved_cpu_of(n) == 0.5
    assert annotation_reserved_cpu_of(n) == 0.0
    assert annotation_reserved_cpu_of(node({}, {}, '{"resources": {"cpu": "1500m"}}')) == 1.5
    assert annotation_reserved_cpu_of(node({}, {}, '{"reservedCPUs": "0-1,8", "resources": {"cpu": "1"}}')) == 3.0
    assert node_capacity_of(node({"cpu": "4"}, {})) is None
    assert kubelet_reserved_cpu_of(node({"cpu": "4"}, {})) is None


@pytest.mark.parametrize(("fact", "n", "message"), [
    (node_capacity_of, node({"cpu": "lots", "memory": "1Gi"}, {}), "capacity.cpu: not a quantity: 'lots'"),
    (kubelet_reserved_cpu_of, node({"cpu": "2"}, {"cpu": "1x"}), "allocatable.cpu: not a quantity: '1x'"),
    (annotation_reserved_cpu_of, node({}, {}, "{oops"), "reservation: not JSON"),
    (annotation_reserved_cpu_of, node({}, {}, '{"reservedCPUs": "3-1"}'), "reservedCPUs"),
    (annotation_reserved_cpu_of, node({}, {}, '{"resources": {"cpu": "x"}}'), "resources.cpu: not a quantity"),
])
def test_bad_node_facts_are_named(fact: Callable[[dict[str, Any]], object], n: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fact(n)


def test_bad_interval() -> None:
    with pytest.raises(ValueError, match="sync_interval"):
        StatesInformer(None, None, sync_interval=0)


def test_pods_listed_once_kubelet_answered_a_list_even_an_empty_one(kubelet: Kubelet) -> None:
    """Issue 28 items 2-3: what the agent publishes waits for kubelet's first pod list;
    a node without pods answers an empty one, which counts (koordlet's podsHasSynced)."""
    assert StatesInformer(None, None).pods_listed()  # no kubelet configured: nothing to wait for
    client = KubeletPods(kubelet.url, timeout=2)
    informer = StatesInformer(None, client)
    kubelet.answer = (500, b"starting")
    asyncio.run(informer.sync_pods())
    assert not informer.pods_listed()
    kubelet.answer = (200, b'{"kind":"PodList","items":null}')
    asyncio.run(informer.sync_pods())
    assert informer.pods_listed() and informer.pods() == {}
