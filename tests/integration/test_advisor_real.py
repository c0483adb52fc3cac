"""External advisors inside the real proxy: a local HTTP server (free port) serves real
exposition text about a pod created through the proxy in the real containerd; the
metrics task scrapes it into the store with our pod_uid / container_id resolved from
the advisor's namespace/pod/container labels. A second advisor pointing at a closed
port is a counted failure on /metrics while the proxy keeps serving."""

from __future__ import annotations

import http.server
import shutil
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest

from metrics import model
from metrics.store.tsdb import TSDB
from runtimeproxy.demo.scenario import kubelet_creates_pod_cgroup
from tests import tmpnames

DB_DIR = tmpnames.unique("advisor")
POD_NAME = f"advised-{uuid.uuid4().hex[:8]}"
BODY = (f'# TYPE tracer_reclaim_seconds_total counter\n'
        f'tracer_reclaim_seconds_total{{namespace="krp-test",pod="{POD_NAME}",container="app"}} 1.25\n'
        f'# TYPE tracer_other gauge\ntracer_other 3\n').encode()


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.fixture(scope="module")
def advisor_url(http_server: Callable[[type[http.server.BaseHTTPRequestHandler]], AbstractContextManager[str]]
                ) -> Iterator[str]:
    with http_server(_Handler) as url:
        yield f"{url}/metrics"


@pytest.fixture(scope="module")
def proxy_config(advisor_url: str, closed_port: Callable[[], int]) -> dict[str, Any]:
    DB_DIR.mkdir(mode=0o700)
    labels = {"pod_namespace": "namespace", "pod_name": "pod", "container_name": "container"}
    return {"tasks": {"metrics": {
        "db": str(DB_DIR / "metrics.db"), "flush_interval": "500ms", "node_name": "krpt-node",
        "advisors": [
            {"name": "tracer", "url": advisor_url, "interval": "500ms", "metrics": ["tracer_reclaim_seconds_total"],
             "labels": labels},
            {"name": "down", "url": f"http://127.0.0.1:{closed_port()}/metrics", "interval": "500ms",
             "metrics": ["x"]},
        ],
    }}}


@pytest.fixture(scope="module", autouse=True)
def _remove_db_dir() -> Iterator[None]:
    yield
    shutil.rmtree(DB_DIR, ignore_errors=True)


def test_an_advisors_series_reach_the_store_with_our_pod_labels(proxy: Any, module_pods: Any) -> None:
    rt = proxy.runtime()
    pod = module_pods.sandbox(POD_NAME)
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    sid = module_pods.run(rt, pod)
    cid = module_pods.create(rt, sid, pod, module_pods.container("app"))
    module_pods.start(rt, cid)
    want = model.labels(advisor="tracer", namespace="krp-test", pod=POD_NAME, container="app",
                        pod_uid=pod.metadata.uid, container_id=cid)
    found = None
    deadline = time.time() + 30
    while found is None and time.time() < deadline:
        time.sleep(0.5)
        if (DB_DIR / "metrics.db").exists():
            db = TSDB.open_readonly(DB_DIR / "metrics.db")
            try:
                found = db.last("tracer_reclaim_seconds_total", want, max_age=60, now=time.time())
            finally:
                db.close()
    assert found is not None and found.value == 1.25
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'koord_runtime_proxy_advisor_up{advisor="tracer"} 1.0' in text
    assert 'koord_runtime_proxy_advisor_up{advisor="down"} 0.0' in text
    assert 'koord_runtime_proxy_advisor_scrape_failures_total{advisor="down",reason="unreachable"}' in text
    assert proxy.running
