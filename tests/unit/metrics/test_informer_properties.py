"""Property-based: kubelet's ``/pods`` answer and the Node object are untrusted input (issue 14).

``KubeletPods.fetch`` reads a real HTTP answer (a local server serves arbitrary,
mutated or shaped bodies); the only outcomes allowed are the pods by uid or
``None`` (with a warning), never an exception out of ``fetch``. ``_pod_of`` turns
any list item into a ``KubeletPod`` or ``None``. The node-fact readers return a
value or raise the documented ``ValueError`` naming the field.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrics.informer.states import (
    RESERVATION_ANNOTATION,
    KubeletPod,
    KubeletPods,
    _pod_of,
    annotation_reserved_cpu_of,
    kubelet_reserved_cpu_of,
    node_capacity_of,
)
from tests.unit.jsonvalues import json_values, scalars

SETTINGS = settings(max_examples=250, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])
WIRE_SETTINGS = settings(max_examples=150, derandomize=True, deadline=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

JSON = json_values(scalars(int_bits=70, finite=True))
QUANTITY = st.one_of(st.sampled_from(["4", "3500m", "16Gi", "1e3", "-1", "abc", "", "1.5"]), JSON)
POD = st.one_of(
    st.fixed_dictionaries({}, optional={
        "metadata": st.fixed_dictionaries({}, optional={
            "uid": st.uuids().map(str) | JSON, "name": st.text(max_size=10) | JSON,
            "namespace": st.text(max_size=10) | JSON,
        }) | JSON,
        "spec": st.fixed_dictionaries({}, optional={
            "priority": st.integers(-(2**40), 2**40) | JSON, "priorityClassName": st.text(max_size=10) | JSON,
        }) | JSON,
        "status": st.fixed_dictionaries({}, optional={
            "phase": st.sampled_from(["Running", "Pending"]) | JSON, "qosClass": st.text(max_size=10) | JSON,
        }) | JSON,
    }),
    JSON,
)
POD_LIST = st.one_of(
    st.fixed_dictionaries({"kind": st.just("PodList"), "items": st.lists(POD, max_size=4)}),
    st.fixed_dictionaries({}, optional={"items": JSON}),
    JSON,
)


def bodies() -> st.SearchStrategy[bytes]:
    """Pod lists as kubelet writes them, mutated, truncated, deeply nested, or pure garbage."""
    raw = POD_LIST.map(lambda doc: json.dumps(doc).encode())
    return st.one_of(
        raw,
        st.builds(lambda d, at, b: d[:at] + bytes([b]) + d[at + 1:], raw, st.integers(0, 400), st.integers(0, 255)),
        st.builds(lambda d, n: d[:n], raw, st.integers(0, 400)),
        st.integers(1, 5000).map(lambda n: b'{"items":' + b"[" * n + b"]" * n + b"}"),
        st.binary(max_size=300),
    )


class Kubelet:
    """Answers GET /pods with ``self.body`` and a 200."""

    def __init__(self) -> None:
        self.body = b""
        kubelet = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                body = kubelet.body
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()


@pytest.fixture(scope="module")
def kubelet() -> Iterator[Kubelet]:
    server = Kubelet()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


@WIRE_SETTINGS
@given(bodies())
def test_fetch_returns_pods_or_none_for_any_answer(kubelet: Kubelet, body: bytes) -> None:
    kubelet.body = body
    pods = KubeletPods(kubelet.url, timeout=5.0).fetch()
    assert pods is None or all(isinstance(p, KubeletPod) and p.uid == uid and uid for uid, p in pods.items())


@SETTINGS
@given(POD)
def test_any_list_item_is_a_pod_or_none(item: Any) -> None:
    pod = _pod_of(item)
    if pod is not None:
        assert isinstance(pod.uid, str) and pod.uid
        assert all(isinstance(v, str) for v in (pod.name, pod.namespace, pod.phase, pod.qos_class,
                                                  pod.priority_class_name))
        assert pod.priority is None or (isinstance(pod.priority, int) and not isinstance(pod.priority, bool))


RESERVATION = st.one_of(
    st.fixed_dictionaries({}, optional={"reservedCPUs": st.text(alphabet="0123456789,-", max_size=10) | JSON,
                                        "resources": st.fixed_dictionaries({}, optional={"cpu": QUANTITY}) | JSON})
    .map(json.dumps),
    st.text(max_size=20),
    st.integers(1, 5000).map(lambda n: "[" * n + "]" * n),
)
NODE = st.fixed_dictionaries({}, optional={
    # The API server's schema makes annotations a map of strings.
    "metadata": st.fixed_dictionaries({}, optional={
        "annotations": st.fixed_dictionaries({}, optional={RESERVATION_ANNOTATION: RESERVATION})}),
    "status": st.fixed_dictionaries({}, optional={
        "capacity": st.fixed_dictionaries({}, optional={"cpu": QUANTITY, "memory": QUANTITY}) | JSON,
        "allocatable": st.fixed_dictionaries({}, optional={"cpu": QUANTITY}) | JSON,
    }) | JSON,
})


@SETTINGS
@given(NODE)
def test_node_facts_are_values_or_value_errors_naming_the_field(node: dict[str, Any]) -> None:
    for read in (node_capacity_of, kubelet_reserved_cpu_of, annotation_reserved_cpu_of):
        try:
            value = read(node)
        except ValueError as exc:
            assert str(exc).startswith(("node status.", f"node annotation {RESERVATION_ANNOTATION}"))
        else:
            assert value is None or isinstance(value, float | tuple)
