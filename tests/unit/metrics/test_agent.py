"""The metrics task's loops: ticks grouped by interval in one worker thread, the store
flushed by the tick, its own CPU cost accounted, NodeMetric built on request without a
cluster. Against fixture /proc, /sys and cgroup trees."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from metrics import model as m
from metrics.agent import MetricsAgent
from metrics.model import PodView, Sample
from metrics.store.tsdb import TSDB, TSDBError
from runtimeproxy.hookapi import HostRoots

#: ``tasks.metrics`` keys every agent here gets (the ``make_agent`` fixture, conftest.py).
FAST: dict[str, Any] = {"memlat_source": "off",
                        "intervals": {"node": "100ms", "pods": "100ms", "psi": "300ms", "topology": "1h"}}
AgentFactory = Callable[..., tuple[MetricsAgent, Any]]


def _record(agent: MetricsAgent, calls: list[tuple[str, str]]) -> None:
    """Wrap each collector's collect to note (collector, thread) per call."""
    for collector in agent.collectors:
        original = collector.collect

        def collect(now: float, pods: Sequence[PodView], _c: Any = collector, _o: Any = original) -> list[Sample]:
            calls.append((_c.name, threading.current_thread().name))
            result: list[Sample] = _o(now, pods)
            return result

        collector.collect = collect  # type: ignore[method-assign]


async def _run_until(agent: MetricsAgent, run: Any, node_ticks: int,
                     while_running: Callable[[], Awaitable[None]] | None = None) -> None:
    """Run the task until ``node_ticks``, then ``while_running()``, then stop it (which
    closes the store)."""
    task = asyncio.create_task(run())
    try:
        for _ in range(500):
            if agent.ticks["node"] >= node_ticks and agent.ticks["psi"] >= 2:
                break
            await asyncio.sleep(0.02)
        if while_running is not None:
            await while_running()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.asyncio
async def test_ticks_of_one_interval_run_together_in_one_worker_thread(
    host: HostRoots, tmp_path: Path, make_agent: AgentFactory
) -> None:
    agent, run = make_agent(host, tmp_path, **FAST)
    calls: list[tuple[str, str]] = []
    _record(agent, calls)
    await _run_until(agent, run, node_ticks=5)
    assert {thread for _, thread in calls} == {"metrics_0"}
    # node then pods, in the same job, every tick: the derived series mix no two ticks.
    fast = [name for name, _ in calls if name in ("node", "pods")]
    assert len(fast) >= 10
    assert fast[: len(fast) // 2 * 2] == ["node", "pods"] * (len(fast) // 2)
    assert agent.ticks["psi"] >= 2 and agent.ticks["node"] >= 5


@pytest.mark.asyncio
async def test_the_tick_flushes_and_its_cost_is_accounted(
    host: HostRoots, tmp_path: Path, make_agent: AgentFactory
) -> None:
    agent, run = make_agent(host, tmp_path, **FAST)

    async def check() -> None:
        before_close = TSDB.open_readonly(tmp_path / "m.db")
        try:
            # Visible to another reader without a flush loop: the ticks flushed.
            assert before_close.series(m.NODE_MEMORY_USED) == [m.NO_LABELS]
        finally:
            before_close.close()
        cost = agent.cpu_seconds
        assert set(cost) == {"node", "hostapps", "pods", "topology", "psi", "store", "flush", "gc"}
        assert cost["node"] > 0 and cost["pods"] > 0 and cost["store"] > 0 and cost["flush"] > 0
        view = agent.explain(None)
        assert view["cpu_seconds"]["node"] == round(cost["node"], 3)

    await _run_until(agent, run, node_ticks=4, while_running=check)


@pytest.mark.asyncio
async def test_a_tick_that_fills_the_batch_flushes_it_as_the_flush_not_inside_the_write(
    host: HostRoots, tmp_path: Path, make_agent: AgentFactory
) -> None:
    # The flush interval is never due after the first tick: every later flush is of a
    # full batch. Inside the write, its cost was the store's (at 250 pods, every tick).
    agent, run = make_agent(host, tmp_path, **FAST, flush_interval="1h")
    agent.tsdb._max_batch = 5  # a node tick writes more: every tick fills the batch
    flushes: list[tuple[bool, float]] = []
    writing = threading.local()
    write, flush = agent.tsdb.write, agent.tsdb.flush

    def traced_write(*args: Any, **kwargs: Any) -> None:
        writing.now = True
        try:
            write(*args, **kwargs)
        finally:
            writing.now = False

    def traced_flush() -> int:
        flushes.append((getattr(writing, "now", False), agent.cpu_seconds["flush"]))
        return flush()

    agent.tsdb.write = traced_write  # type: ignore[method-assign]
    agent.tsdb.flush = traced_flush  # type: ignore[method-assign]

    async def check() -> None:
        assert len(flushes) >= 3
        assert not any(inside for inside, _cost in flushes)
        assert agent.cpu_seconds["flush"] > flushes[1][1] > 0  # each timed as the flush

    await _run_until(agent, run, node_ticks=4, while_running=check)


def test_the_store_gets_the_configured_retention_and_tiers(
    host: HostRoots, tmp_path: Path, make_agent: AgentFactory
) -> None:
    tiers = {"raw": "20m", "step": "30s", "coarse_step": "10m", "coarse_after": "1h"}
    agent, _run = make_agent(host, tmp_path, **FAST, retention="6h", max_bytes=10_000_000, tiers=tiers)
    try:
        db = agent.tsdb
        assert (db.retention, db.max_bytes) == (6 * 3600, 10_000_000)
        assert (db.raw_retention, db.rollup_step, db.coarse_step, db.coarse_after) == (1200, 30, 600, 3600)
    finally:
        agent.tsdb.close()


@pytest.mark.asyncio
async def test_without_a_cluster_nodemetric_is_built_on_request_only(
    host: HostRoots, tmp_path: Path, make_agent: AgentFactory
) -> None:
    agent, run = make_agent(host, tmp_path, **FAST)

    async def check() -> None:
        assert agent.kube is None and agent.reporter.latest() is None  # no periodic build
        status, _type, body = await agent.reporter.route({})
        assert status == 200 and b"nodeMetric" in body
        assert agent.reporter.latest() is not None

    await _run_until(agent, run, node_ticks=3, while_running=check)


@pytest.mark.asyncio
async def test_a_tick_that_raises_fails_the_task_and_a_slow_one_is_not_queued(
    host: HostRoots, tmp_path: Path, make_agent: AgentFactory
) -> None:
    """The loop does not wait for ticks, but a store failure still reaches the
    supervisor (the task fails), and ticks never pile up behind a slow one."""
    agent, run = make_agent(host, tmp_path, **FAST)
    release = threading.Event()
    flushes = 0

    def slow_then_broken_flush() -> int:
        nonlocal flushes
        flushes += 1
        if flushes == 1:
            release.wait(30)  # the first tick hangs until released (~10 intervals after it began)
            return 0
        raise TSDBError(tmp_path / "m.db", "disk full")

    agent.tsdb.flush = slow_then_broken_flush  # type: ignore[method-assign]
    task = asyncio.create_task(run())
    try:
        # The first tick reaches its flush in the worker thread whenever that thread gets
        # there (slow on a loaded machine): wait for it, then let ~10 intervals pass.
        async with asyncio.timeout(10):
            while flushes == 0:
                await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)
        assert not task.done() and flushes == 1 and agent.ticks["node"] == 1, "no tick queued behind the slow one"
    finally:
        release.set()
    with pytest.raises(TSDBError, match="disk full"):
        await asyncio.wait_for(task, 5)


def test_pod_views_are_complete_only_once_the_store_was_rebuilt(host: Any, tmp_path: Path) -> None:
    """Issue 28 items 2-3: right after a restart the store snapshot is empty because it is
    not rebuilt yet; views built then are not complete (NodeMetric, NRT and the restored
    prediction wait), and the first refresh after the rebuild makes them so."""
    from metrics.agent import metrics_task
    from runtimeproxy.hookapi import TaskInit

    known = False
    provided: list[object] = []  # what the task hands the tasks built on it: its agent
    init = TaskInit(name="metrics", key_path="tasks.metrics", provide=provided.append,
                    snapshot=lambda: ({}, {}), host=host,
                    add_route=lambda _path, _route: None, pods_known=lambda: known,
                    args={"db": str(tmp_path / "m.db"), "schedlat_source": "off", "cpi": False})
    metrics_task(init)
    agent = provided[0]
    try:
        agent.refresh_pods()
        assert not agent.pods_complete()
        known = True
        agent.refresh_pods()  # same (empty) pod set: rebuilt anyway, now complete
        assert agent.pods_complete()
    finally:
        agent.tsdb.close()
