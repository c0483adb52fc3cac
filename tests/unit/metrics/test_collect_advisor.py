"""External advisors against a real local HTTP server on a free port: real exposition
text mapped to our pod/container labels, and garbage, 500s, slow, oversized and
unreachable endpoints as counted failures logged once per change of state."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from hooks.qos import QoSClass
from metrics import model as m
from metrics.agent import MetricsAgent, metrics_task
from metrics.collect.advisor import AdvisorCollector, AdvisorHealth, AdvisorSpec, parse_advisors
from metrics.model import ContainerView, PodView, Sample
from metrics.settings import parse_metrics
from runtimeproxy.hookapi import HookConfigError, HostRoots, TaskInit

EXPOSITION = """\
# HELP tracer_reclaim_seconds_total Direct reclaim time.
# TYPE tracer_reclaim_seconds_total counter
tracer_reclaim_seconds_total{namespace="default",pod="web",container="app"} 1.5
tracer_reclaim_seconds_total{namespace="other",pod="gone",container="app"} 2.5
# TYPE tracer_runq_seconds gauge
tracer_runq_seconds{uid="u-1",cid="containerd://c-1"} 0.25
tracer_runq_seconds{uid="u-1",cid="containerd://c-2",advisor="spoof"} NaN
# TYPE node_load1 gauge
node_load1 0.7
# TYPE tracer_latency_seconds histogram
tracer_latency_seconds_bucket{le="0.001"} 3
tracer_latency_seconds_bucket{le="+Inf"} 4
tracer_latency_seconds_count 4
tracer_latency_seconds_sum 0.01
"""


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/metrics":
            self._answer(200, EXPOSITION.encode())
        elif self.path == "/garbage":
            self._answer(200, b"<html><body>not metrics</body></html>\n")
        elif self.path == "/binary":
            self._answer(200, b"\xff\xfe\x00bad")
        elif self.path == "/big":
            self._answer(200, b"node_load1 1\n" * 10_000)
        elif self.path == "/slow":
            time.sleep(1.5)
            self._answer(200, b"node_load1 1\n")
        else:
            self._answer(500, b"boom")

    def _answer(self, status: int, body: bytes) -> None:
        with contextlib.suppress(OSError):  # the client may have given up (slow)
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.fixture
def server(http_server: Callable[[type[http.server.BaseHTTPRequestHandler]], AbstractContextManager[str]]
           ) -> Iterator[str]:
    with http_server(_Handler) as url:
        yield url


POD = PodView(uid="u-web", namespace="default", name="web", sandbox_id="s", qos=QoSClass.LS, priority=0,
              priority_class="", cgroup_dir="kubepods/podu-web",
              containers=(ContainerView(id="c-app", name="app", cgroup_dir="kubepods/podu-web/c-app"),))


def _spec(url: str, **kw: Any) -> AdvisorSpec:
    raw = {"name": "tracer", "url": url, "interval": "1s", "timeout": "500ms",
           "metrics": ["tracer_reclaim_seconds_total", "tracer_runq_seconds", "tracer_latency_seconds"], **kw}
    return parse_advisors([raw], "tasks.metrics.advisors")[0]


def _scrape(collector: AdvisorCollector, pods: list[PodView] | None = None) -> list[Sample]:
    """The next tick once the scrape in flight ended (a first tick starts one): it hands
    that scrape's samples over and starts the next."""
    if collector._running is None:
        assert collector.collect(0.0, pods or [POD]) == []
    running = collector._running
    assert running is not None
    for _ in range(500):
        if running.done():
            break
        time.sleep(0.01)
    return collector.collect(0.0, pods or [POD])


def test_exposition_text_is_mapped_to_our_labels(server: str) -> None:
    labels = {"pod_namespace": "namespace", "pod_name": "pod", "container_name": "container", "pod_uid": "uid",
              "container_id": "cid"}
    collector = AdvisorCollector(_spec(f"{server}/metrics", labels=labels))
    try:
        got = {(s.metric, s.labels): s.value for s in _scrape(collector)}
    finally:
        collector.close()
    assert got == {
        # namespace/pod/container resolved to the pod's uid and the container's id
        ("tracer_reclaim_seconds_total", m.labels(advisor="tracer", container="app", namespace="default", pod="web",
                                                   pod_uid="u-web", container_id="c-app")): 1.5,
        # a pod not on this node: kept, nothing mapped
        ("tracer_reclaim_seconds_total", m.labels(advisor="tracer", container="app", namespace="other",
                                                   pod="gone")): 2.5,
        # uid and container id taken as they are, the runtime prefix dropped (NaN dropped)
        ("tracer_runq_seconds", m.labels(advisor="tracer", uid="u-1", cid="containerd://c-1", pod_uid="u-1",
                                         container_id="c-1")): 0.25,
        # a histogram family allow-listed by its name; node_load1 is not in the allow-list
        ("tracer_latency_seconds_bucket", m.labels(advisor="tracer", le="0.001")): 3.0,
        ("tracer_latency_seconds_bucket", m.labels(advisor="tracer", le="+Inf")): 4.0,
        ("tracer_latency_seconds_count", m.labels(advisor="tracer")): 4.0,
        ("tracer_latency_seconds_sum", m.labels(advisor="tracer")): 0.01,
    }
    assert collector.state == "ok" and collector.failures == {}


@pytest.mark.parametrize(("path", "reason"), [
    ("/garbage", "unparsable"), ("/binary", "unparsable"), ("/500", "http_status"), ("/big", "too_large"),
    ("/slow", "timeout"),
])
def test_a_bad_endpoint_is_a_counted_failure_logged_once(server: str, path: str, reason: str) -> None:
    collector = AdvisorCollector(_spec(f"{server}{path}", max_bytes=50_000))
    registry = CollectorRegistry()
    registry.register(AdvisorHealth([collector]))
    try:
        with capture_logs() as logs:
            for _ in range(3):
                assert _scrape(collector) == []
    finally:
        collector.close()
    assert collector.state == reason
    failed = [e for e in logs if e["event"] == "advisor_scrape_failed"]
    assert len(failed) == 1 and failed[0]["reason"] == reason and failed[0]["advisor"] == "tracer"
    # three scrapes ended (the ticks in between hand nothing over, they never wait)
    assert registry.get_sample_value("koord_runtime_proxy_advisor_scrape_failures_total",
                                     {"advisor": "tracer", "reason": reason}) == 3
    assert registry.get_sample_value("koord_runtime_proxy_advisor_up", {"advisor": "tracer"}) == 0


def test_a_tick_never_waits_for_a_slow_endpoint(server: str) -> None:
    collector = AdvisorCollector(_spec(f"{server}/slow", timeout="1s"))
    try:
        assert collector.collect(0.0, [POD]) == []  # started
        running = collector._running
        assert collector.collect(0.0, [POD]) == []  # still running: nothing, and no second scrape
        assert collector._running is running and running is not None and not running.done()
        # in a daemon thread: a hanging endpoint cannot hold the process's exit either
        scraping = [t for t in threading.enumerate() if t.name == "advisor-tracer"]
        assert scraping and all(t.daemon for t in scraping)
    finally:
        collector.close()


def test_unreachable_then_back_logs_each_change_once(server: str, closed_port: Callable[[], int]) -> None:
    collector = AdvisorCollector(_spec(f"http://127.0.0.1:{closed_port()}/metrics"))
    try:
        with capture_logs() as logs:
            _scrape(collector)
            _scrape(collector)
            assert collector.state == "unreachable" and collector.failures == {"unreachable": 2}
            collector.spec = _spec(f"{server}/metrics")  # the endpoint comes up
            _scrape(collector)  # hands over the scrape in flight (old URL), starts one of the new
            assert _scrape(collector) != []
            _scrape(collector)
    finally:
        collector.close()
    events = [(e["event"], e.get("reason")) for e in logs]
    assert events == [("advisor_scrape_failed", "unreachable"), ("advisor_scrape_ok", None)]


@pytest.mark.parametrize(("raw", "key", "message"), [
    ("x", "tasks.metrics.advisors", "must be a list"),
    ([{"name": "a", "url": "ftp://h/x", "metrics": ["a"]}], "tasks.metrics.advisors[0].url", "http://"),
    ([{"name": "A b", "url": "http://h/x", "metrics": ["a"]}], "tasks.metrics.advisors[0].name", "lower-case"),
    ([{"name": "a", "url": "http://h/x"}], "tasks.metrics.advisors[0].metrics", "allow-list"),
    ([{"name": "a", "url": "http://h/x", "metrics": ["a b"]}], "tasks.metrics.advisors[0].metrics[0]", "metric name"),
    ([{"name": "a", "url": "http://h/x", "metrics": ["a"], "interval": "soon"}],
     "tasks.metrics.advisors[0].interval", "duration"),
    ([{"name": "a", "url": "http://h/x", "metrics": ["a"], "interval": "1s", "timeout": "2s"}],
     "tasks.metrics.advisors[0].timeout", "must not exceed interval"),
    ([{"name": "a", "url": "http://h/x", "metrics": ["a"], "max_bytes": -1}],
     "tasks.metrics.advisors[0].max_bytes", "positive"),
    ([{"name": "a", "url": "http://h/x", "metrics": ["a"], "labels": {"node": "instance"}}],
     "tasks.metrics.advisors[0].labels.node", "unknown label"),
    ([{"name": "a", "url": "http://h/x", "metrics": ["a"], "labels": {"pod_name": "pod"}}],
     "tasks.metrics.advisors[0].labels", "map together"),
    ([{"name": "a", "url": "http://h/x", "metrics": ["a"], "scheme": "http"}],
     "tasks.metrics.advisors[0].scheme", "unknown key"),
    ([{"name": "a", "url": "http://h/x", "metrics": ["a"]}, {"name": "a", "url": "http://h/y", "metrics": ["a"]}],
     "tasks.metrics.advisors[1].name", "duplicate"),
])
def test_bad_advisor_entries_name_the_field(raw: object, key: str, message: str) -> None:
    with pytest.raises(HookConfigError) as refused:
        parse_metrics({"advisors": raw}, "tasks.metrics")
    assert refused.value.key_path == key and message in refused.value.message


@pytest.mark.asyncio
async def test_the_agent_stores_an_advisors_samples_and_explains_it(server: str, tmp_path: Path) -> None:
    host = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys")
    (host.proc).mkdir()
    (host.sys / "devices/system/cpu").mkdir(parents=True)
    (host.sys / "devices/system/cpu/online").write_text("0\n")
    for controller in ("cpu", "cpuacct", "memory", "cpuset"):
        (host.cgroup / controller).mkdir(parents=True)
    (host.proc / "stat").write_text("cpu  100 0 50 800 0 0 0 0 0 0\ncpu0 100 0 50 800 0 0 0 0 0 0\n")
    (host.proc / "meminfo").write_text("MemTotal: 8000 kB\nMemFree: 1000 kB\nMemAvailable: 3000 kB\n")
    registry = CollectorRegistry()
    # 500 ms (the scrape's timeout too): at 100 ms a scrape on a busy host timed out now
    # and then, and the state read below was "timeout" instead of "ok".
    advisors = [{"name": "node-exporter", "url": f"{server}/metrics", "interval": "500ms", "metrics": ["node_load1"]},
                {"name": "broken", "url": f"{server}/garbage", "interval": "500ms", "metrics": ["node_load1"]}]
    provided: list[object] = []  # what the task hands the tasks built on it: its agent
    init = TaskInit(name="metrics", key_path="tasks.metrics", provide=provided.append,
                    snapshot=lambda: ({}, {}), host=host,
                    add_route=lambda _p, _h: None, add_explainer=lambda _n, _e: None, registry=registry,
                    args={"db": str(tmp_path / "m.db"), "schedlat_source": "off", "cpi": False,
                          "advisors": advisors})
    run = metrics_task(init)
    agent = provided[0]
    assert isinstance(agent, MetricsAgent)
    task = asyncio.create_task(run())
    try:
        # Waits on the store and the advisor's state; the bound only ends a hung run (a busy
        # host may take seconds to run the first scrapes at 100 ms).
        deadline = time.monotonic() + 60
        while True:
            last = agent.tsdb.last("node_load1", m.labels(advisor="node-exporter"), max_age=60, now=time.time())
            if (last is not None and agent.advisors[1].state != "pending") or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        assert last is not None and last.value == 0.7
        view = agent.explain(None)["advisors"]
        assert view["node-exporter"]["state"] == "ok" and view["broken"]["state"] == "unparsable"
        assert (registry.get_sample_value("koord_runtime_proxy_advisor_scrape_failures_total",
                                          {"advisor": "broken", "reason": "unparsable"}) or 0) >= 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
