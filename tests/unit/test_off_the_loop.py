"""Issue 27 item 12: nothing blocking on the event loop, every task supervised. A
reload's load/validate/build runs in a worker thread, HAProxy's stats socket is read in
a worker thread before /metrics is rendered, and a one-shot task that fails is logged."""

from __future__ import annotations

import asyncio
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from runtimeproxy.dataplane import haproxystats
from runtimeproxy.ops.httpendpoint import HttpEndpoint
from runtimeproxy.ops.promstats import ProxyMetrics
from tests.unit.test_promstats import get

PLUGIN = """
import threading

BUILT_IN = []


class Recorder:
    def __init__(self, init):
        BUILT_IN.append(threading.current_thread() is threading.main_thread())

    def pre_create_container(self, ctx):
        return None
"""


@pytest.mark.asyncio
async def test_a_reload_builds_the_chain_off_the_loop(
        fake_runtime: Any, start_proxy: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"krp_offloop_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    hooks = [{"name": "rec", "plugin": f"{name}:Recorder"}]
    proxy = await start_proxy(fake_runtime, hooks=hooks, config_file=True)
    module = __import__(name)
    assert module.BUILT_IN == [True], "at start: built in App(), on the main thread"
    data = yaml.safe_load(proxy.config_path.read_text())
    data["hooks"].append({"name": "rec2", "plugin": f"{name}:Recorder"})
    proxy.config_path.write_text(yaml.safe_dump(data))
    assert await proxy.app.reload("test")
    assert module.BUILT_IN[1:] == [False, False], "the reload built both hooks in a worker thread"
    assert [h.name for h in proxy.app.chain.hooks] == ["rec", "rec2"]


@pytest.mark.asyncio
async def test_haproxys_stats_are_read_off_the_loop_before_metrics_render() -> None:
    registry = CollectorRegistry()
    metrics = ProxyMetrics(registry)
    reads: list[bool] = []

    def read_table() -> dict[str, dict[str, int]]:  # the stats socket: blocking I/O
        reads.append(threading.current_thread() is threading.main_thread())
        return {"/runtime.v1.RuntimeService/Version": {"http_req_cnt": 7}}

    counters = haproxystats.DataPlaneCounters(metrics.cri_calls, metrics.cri_errors, read_table)
    registry.unregister(metrics.cri_calls)
    registry.unregister(metrics.cri_errors)
    registry.register(counters)
    endpoint = HttpEndpoint("127.0.0.1", 0, registry, health=lambda: None, before_scrape=counters.refresh)
    await endpoint.start()
    try:
        status, _, body = await get(endpoint.port, "/metrics")
    finally:
        await endpoint.stop()
    assert status == 200
    assert reads == [False], "read once, in a worker thread (not again while rendering on the loop)"
    assert ('koord_runtime_proxy_cri_calls_total{method="/runtime.v1.RuntimeService/Version",path="passthrough"}'
            ' 7.0') in body.decode()


@pytest.mark.asyncio
async def test_a_failing_sighup_reload_is_logged_not_lost(fake_runtime: Any, start_proxy: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = await start_proxy(fake_runtime, config_file=True)

    def broken() -> None:
        raise RuntimeError("a bug in the reload")

    monkeypatch.setattr(proxy.app, "_prepare_reload", broken)
    with capture_logs() as logs:
        proxy.app._reload_soon()
        tasks = set(proxy.app._oneshots)
        assert [t.get_name() for t in tasks] == ["reload:SIGHUP"]
        await asyncio.wait(tasks)
        await asyncio.sleep(0)  # the done callbacks run on the next turn of the loop
    failed = [e for e in logs if e["event"] == "task_failed"]
    assert len(failed) == 1 and failed[0]["task"] == "reload:SIGHUP" and "a bug" in failed[0]["error"]
    assert not proxy.app._oneshots
