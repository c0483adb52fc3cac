"""/healthz, the backend-up gauge and the log follow a real containerd going away and
coming back (issue 14 item 15: /healthz said 200 while containerd was gone).

The test owns its containerd (a private one, like test_proxy_process's backend-down
test) and stops and restarts it by its own pid through the fixture class.
"""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from typing import Any

from runtimeproxy.demo.embedded import EmbeddedContainerd

GRACE = 2.0


def http_get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:  # loopback only
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def gauge(proxy: Any, name: str, labels: str = "") -> float | None:
    status, body = http_get(proxy.metrics_port, "/metrics")
    assert status == 200
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", body.decode(), re.M)
    return float(match.group(1)) if match else None


def backend_up(proxy: Any) -> float | None:
    return gauge(proxy, "koord_runtime_proxy_backend_up", '{backend="runtime"}')


def wait(predicate: Any, timeout: float, what: str, proxy: Any) -> float:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {timeout}s:\n{proxy.log()[-4000:]}"
        time.sleep(0.05)
    return time.monotonic()


def test_healthz_and_gauge_follow_a_real_containerd(proxy_factory: Any) -> None:
    ctrd = EmbeddedContainerd(proxy_factory.mkdtemp() / "ctrd")
    ctrd.start()
    try:
        backend = {"runtime_endpoint": str(ctrd.socket), "probe_interval": "500ms", "unhealthy_after": f"{GRACE}s",
                   "max_reconnect_backoff": "500ms"}
        proxy = proxy_factory.start(extra={"backend": backend})
        assert proxy.healthz() == 200
        assert gauge(proxy, "koord_runtime_proxy_up") == 1.0
        wait(lambda: backend_up(proxy) == 1.0, 5.0, "backend_up 1", proxy)

        stopped = time.monotonic()
        ctrd.stop()  # SIGTERM to the fixture's own containerd pid, and wait
        lost_at = wait(lambda: proxy.healthz() == 503, 15.0, "/healthz 503", proxy)
        assert lost_at - stopped >= GRACE, "503 only after the grace"
        status, body = http_get(proxy.metrics_port, "/healthz")
        assert status == 503
        text = body.decode()
        assert text.startswith(f"unhealthy: backend runtime ({ctrd.socket}) unreachable for "), text
        assert "UNAVAILABLE" in text
        assert backend_up(proxy) == 0.0
        assert gauge(proxy, "koord_runtime_proxy_up") == 1.0, "the proxy itself still serves"
        time.sleep(2.0)  # four more failing probes: still one warning
        (lost,) = proxy.events("backend_lost")
        assert lost["level"] == "warning" and lost["backend"] == "runtime" and lost["endpoint"] == str(ctrd.socket)
        assert proxy.running

        ctrd.start()
        wait(lambda: proxy.healthz() == 200, 15.0, "/healthz 200 again", proxy)
        assert backend_up(proxy) == 1.0
        time.sleep(1.0)
        (recovered,) = proxy.events("backend_recovered")
        assert recovered["level"] == "info" and recovered["down_for"] >= GRACE
        assert len(proxy.events("backend_lost")) == 1
        assert len(proxy.events("listening")) == 1, "the same proxy process throughout"
    finally:
        ctrd.stop()
