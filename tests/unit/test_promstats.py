"""promstats tests: metric families/labels and the loopback HTTP endpoint over real TCP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from runtimeproxy.ops.promstats import HttpEndpoint, ProxyMetrics


async def request(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send a raw request and read the whole response (the server closes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        async with asyncio.timeout(5):
            data = await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    return int(status_line.split(" ")[1]), headers, body


async def get(port: int, target: str) -> tuple[int, dict[str, str], bytes]:
    return await request(
        port, f"GET {target} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode()
    )


class Health:
    def __init__(self) -> None:
        self.problem: str | None = None

    def __call__(self) -> str | None:
        return self.problem


async def explain(query: dict[str, str]) -> tuple[int, str, bytes]:
    body = f"pod={query.get('pod')} verbose={query.get('verbose')}".encode()
    return 200, "text/plain", body


async def broken(_query: dict[str, str]) -> tuple[int, str, bytes]:
    raise RuntimeError("route bug")


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def health() -> Health:
    return Health()


@pytest_asyncio.fixture
async def endpoint(
    registry: CollectorRegistry, health: Health
) -> AsyncIterator[HttpEndpoint]:
    ep = HttpEndpoint(
        "127.0.0.1",
        0,
        registry,
        health=health,
        routes={"/debug/explain": explain, "/debug/broken": broken},
        # Generous: a short read timeout would answer 408 to a well-formed request
        # whenever the loop stalls between accept and the client's write (a loaded
        # machine). The timeout itself is tested with its own endpoint below.
        idle_timeout=5.0,
    )
    await ep.start()
    yield ep
    await ep.stop()


def test_method_stats_are_cached_and_count(registry: CollectorRegistry) -> None:
    metrics = ProxyMetrics(registry)
    stats = metrics.method("/runtime.v1.RuntimeService/CreateContainer", "intercepted")
    assert (
        metrics.method("/runtime.v1.RuntimeService/CreateContainer", "intercepted")
        is stats
    )
    stats.calls.inc()
    stats.calls.inc()
    stats.duration.observe(0.0002)
    stats.error("UNAVAILABLE")
    stats.error("UNAVAILABLE")

    method = "/runtime.v1.RuntimeService/CreateContainer"
    sample = registry.get_sample_value
    calls = sample(
        "koord_runtime_proxy_cri_calls_total", {"method": method, "path": "intercepted"}
    )
    assert calls == 2.0
    errors = sample(
        "koord_runtime_proxy_cri_errors_total",
        {"method": method, "code": "UNAVAILABLE"},
    )
    assert errors == 2.0
    bucket = {"method": method, "le": "0.00025"}
    assert sample("koord_runtime_proxy_cri_call_duration_seconds_bucket", bucket) == 1.0
    assert (
        sample(
            "koord_runtime_proxy_cri_call_duration_seconds_count", {"method": method}
        )
        == 1.0
    )


def test_hook_and_reload_metrics(registry: CollectorRegistry) -> None:
    metrics = ProxyMetrics(registry)
    metrics.hook_observed("cpuset", "PreCreateContainer", "timeout", 2.0)
    metrics.hook_failed("cpuset", "PreCreateContainer", "Ignore")
    metrics.config_reloaded(ok=False)
    sample = registry.get_sample_value
    labels = {"hook": "cpuset", "stage": "PreCreateContainer"}
    count = sample(
        "koord_runtime_proxy_hook_duration_seconds_count",
        {**labels, "result": "timeout"},
    )
    assert count == 1.0
    failures = sample(
        "koord_runtime_proxy_hook_failures_total", {**labels, "policy": "Ignore"}
    )
    assert failures == 1.0
    assert (
        sample("koord_runtime_proxy_config_reloads_total", {"result": "error"}) == 1.0
    )


def test_separate_registries_do_not_collide() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    ProxyMetrics(first).method("A").calls.inc()
    ProxyMetrics(second)
    labels = {"method": "A", "path": "passthrough"}
    assert first.get_sample_value("koord_runtime_proxy_cri_calls_total", labels) == 1.0
    assert (
        second.get_sample_value("koord_runtime_proxy_cri_calls_total", labels) is None
    )


@pytest.mark.asyncio
async def test_metrics_route_serves_registry(
    registry: CollectorRegistry, endpoint: HttpEndpoint
) -> None:
    ProxyMetrics(registry).method("/runtime.v1.RuntimeService/Version").calls.inc(3)
    assert endpoint.port > 0

    status, headers, body = await get(endpoint.port, "/metrics")

    assert status == 200
    assert headers["content-type"] == CONTENT_TYPE_LATEST
    assert headers["connection"] == "close"
    assert int(headers["content-length"]) == len(body)
    expected = (
        b'koord_runtime_proxy_cri_calls_total{method="/runtime.v1.RuntimeService/Version",'
        b'path="passthrough"} 3.0'
    )
    assert expected in body


@pytest.mark.asyncio
async def test_healthz_flips_to_503(endpoint: HttpEndpoint, health: Health) -> None:
    status, _, body = await get(endpoint.port, "/healthz")
    assert (status, body) == (200, b"ok\n")
    health.problem = "backend runtime (/x.sock) unreachable for 7s: UNAVAILABLE: connection refused"
    status, _, body = await get(endpoint.port, "/healthz")
    assert (status, body) == (503, b"unhealthy: backend runtime (/x.sock) unreachable for 7s: UNAVAILABLE: "
                                   b"connection refused\n")


@pytest.mark.asyncio
async def test_extra_route_receives_query_params(endpoint: HttpEndpoint) -> None:
    status, headers, body = await get(
        endpoint.port, "/debug/explain?pod=default%2Fweb-0&verbose="
    )
    assert status == 200
    assert headers["content-type"] == "text/plain"
    assert body == b"pod=default/web-0 verbose="


@pytest.mark.asyncio
async def test_failing_route_is_500_and_server_survives(endpoint: HttpEndpoint) -> None:
    status, _, _ = await get(endpoint.port, "/debug/broken")
    assert status == 500
    status, _, _ = await get(endpoint.port, "/healthz")
    assert status == 200


@pytest.mark.asyncio
async def test_unknown_path_404_and_post_405(endpoint: HttpEndpoint) -> None:
    status, _, _ = await get(endpoint.port, "/nope")
    assert status == 404
    status, headers, _ = await request(
        endpoint.port, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
    )
    assert status == 405
    assert headers["allow"] == "GET"


@pytest.mark.asyncio
async def test_oversized_header_rejected_and_server_stays_up(
    endpoint: HttpEndpoint,
) -> None:
    raw = b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n"
    status, _, _ = await request(endpoint.port, raw)
    assert status == 431
    status, _, _ = await get(endpoint.port, "/healthz")
    assert status == 200


@pytest.mark.asyncio
async def test_malformed_request_line_is_400(endpoint: HttpEndpoint) -> None:
    status, _, _ = await request(endpoint.port, b"HELLO\r\n\r\n")
    assert status == 400


@pytest.mark.asyncio
async def test_slow_client_times_out_with_408(registry: CollectorRegistry) -> None:
    endpoint = HttpEndpoint("127.0.0.1", 0, registry, health=lambda: None, idle_timeout=0.2)
    await endpoint.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", endpoint.port)
        writer.write(b"GET /metrics HTTP/1.1\r\n")  # never finishes the head
        await writer.drain()
        async with asyncio.timeout(5):
            data = await reader.read()
        writer.close()
        await writer.wait_closed()
    finally:
        await endpoint.stop()
    assert data.startswith(b"HTTP/1.1 408 ")


@pytest.mark.asyncio
async def test_routes_cannot_shadow_builtins(registry: CollectorRegistry) -> None:
    with pytest.raises(ValueError):
        HttpEndpoint(
            "127.0.0.1", 0, registry, health=lambda: None, routes={"/metrics": explain}
        )


@pytest.mark.asyncio
async def test_stop_is_idempotent_and_frees_port(registry: CollectorRegistry) -> None:
    ep = HttpEndpoint("127.0.0.1", 0, registry, health=lambda: None)
    port = await ep.start()
    await ep.stop()
    await ep.stop()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)


@pytest.mark.asyncio
async def test_metrics_appends_expositions_after_the_registry(registry: CollectorRegistry) -> None:
    """Pre-rendered text from ``expositions`` follows the registry's, rendered per scrape;
    ``after_scrape`` runs once per /metrics response, not for other paths."""
    ProxyMetrics(registry)
    scrapes, released = [], []

    def render() -> bytes:
        scrapes.append(1)
        return f"# HELP big_family x\n# TYPE big_family gauge\nbig_family {len(scrapes)}.0\n".encode()

    ep = HttpEndpoint("127.0.0.1", 0, registry, health=lambda: None, expositions=[render],
                      after_scrape=lambda: released.append(1))
    await ep.start()
    try:
        first = (await get(ep.port, "/metrics"))[2].decode()
        status, headers, second = await get(ep.port, "/metrics")
        async with asyncio.timeout(5):  # runs once the server side has closed
            while len(released) < 2:
                await asyncio.sleep(0.01)
        await get(ep.port, "/healthz")
        await asyncio.sleep(0.2)
    finally:
        await ep.stop()
    assert status == 200 and int(headers["content-length"]) == len(second)
    assert len(released) == 2
    assert first.index("koord_runtime_proxy_build_info") < first.index("# HELP big_family x")
    assert first.endswith("big_family 1.0\n") and second.decode().endswith("big_family 2.0\n")
