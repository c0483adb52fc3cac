"""The metrics agent with host applications and the peak predictor wired in: YAML and
NodeSLO host applications measured and kept out of system usage, the predictor trained
from the agent's store, checkpointed next to the db and restored by the next agent,
koordlet's Prometheus gauges. Fixture /proc, /sys and cgroup trees."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from structlog.testing import capture_logs

from metrics import model as m
from metrics.agent import MetricsAgent
from metrics.analysis.prediction import NODE, SYSTEM
from metrics.store.tsdb import TSDB
from runtimeproxy.hookapi import HookConfigError, HostRoots

APP = {"name": "nginx", "priority": "koord-prod", "qos": "LS",
       "cgroupPath": {"base": "CgroupRoot", "parentDir": "host-latency-sensitive", "relativePath": "nginx"}}
APP_MEMORY = 1_000_000
NODE_MEMORY = (8000 - 3000) * 1024  # MemTotal - MemAvailable
#: ``tasks.metrics`` keys every agent here gets (the ``make_agent`` fixture, conftest.py).
FAST: dict[str, Any] = {"intervals": {"node": "100ms", "pods": "100ms", "psi": "300ms", "topology": "1h"}}
AgentFactory = Callable[..., tuple[MetricsAgent, Any]]


@pytest.fixture
def host(host: HostRoots) -> HostRoots:
    """The shared tree (conftest.py) with a host application's cgroup."""
    app = "host-latency-sensitive/nginx"
    (host.cgroup / "cpuacct" / app).mkdir(parents=True)
    (host.cgroup / "cpuacct" / app / "cpuacct.usage").write_text("5000000000\n")
    (host.cgroup / "memory" / app).mkdir(parents=True)
    (host.cgroup / "memory" / app / "memory.stat").write_text(
        f"total_cache 0\ntotal_inactive_anon {APP_MEMORY}\ntotal_active_anon 0\ntotal_unevictable 0\n")
    return host


async def _run(agent: MetricsAgent, run: Any, node_ticks: int, while_running: Any = None) -> None:
    """Run the task until ``node_ticks``, call ``while_running()`` (in a thread), stop it."""
    task = asyncio.create_task(run())
    try:
        for _ in range(500):
            if agent.ticks["node"] >= node_ticks:
                break
            await asyncio.sleep(0.02)
        await asyncio.to_thread(agent.tsdb.flush)
        assert agent.ticks["node"] >= node_ticks
        if while_running is not None:
            await asyncio.to_thread(while_running)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.asyncio
async def test_yaml_host_applications_are_measured_and_left_out_of_system_usage(
    host: HostRoots, tmp_path: Path, make_agent: AgentFactory
) -> None:
    agent, run = make_agent(host, tmp_path, **FAST, host_applications=[APP])
    explained: list[Any] = []
    await _run(agent, run, node_ticks=4, while_running=lambda: explained.append(agent.explain(None)))
    app = m.labels(host_app_name="nginx", priority_class="koord-prod", qos="LS")
    store = TSDB.open_readonly(tmp_path / "m.db")
    try:
        end = time.time() + 60
        memory = store.aggregate(m.HOST_APP_MEMORY_USED, app, 0, end)
        cpu = store.aggregate(m.HOST_APP_CPU_USAGE, app, 0, end)
        system = store.aggregate(m.SYSTEM_MEMORY_USED, m.NO_LABELS, 0, end)
    finally:
        store.close()
    assert memory is not None and memory.last == APP_MEMORY
    assert cpu is not None and cpu.last == 0.0  # the fixture's counter does not move
    assert system is not None and system.last == NODE_MEMORY - APP_MEMORY
    assert explained[0]["host_applications"] == ["nginx"]


def test_a_nodeslo_replaces_the_yaml_host_applications(
    host: HostRoots, tmp_path: Path, make_agent: AgentFactory
) -> None:
    agent, _ = make_agent(host, tmp_path, **FAST, host_applications=[APP])
    try:
        other = {**APP, "name": "db", "cgroupPath": {"relativePath": "system.slice/db.service"}}
        evil = {**APP, "name": "evil", "cgroupPath": {"relativePath": "../../etc"}}
        with capture_logs() as logs:
            agent._nodeslo_changed({"hostApplications": [evil, other]})
        assert [a.name for a in agent.hostapps.apps] == ["db"]
        refused = [e for e in logs if e["event"] == "host_application_refused"]
        assert refused and refused[0]["reason"] == (
            "hostApplications[0].cgroupPath.relativePath: escapes the cgroup root (got '../../etc')")
        agent._nodeslo_changed(None)  # NodeSLO gone: the YAML's again
        assert [a.name for a in agent.hostapps.apps] == ["nginx"]
    finally:
        agent.tsdb.close()


def test_a_bad_yaml_host_application_stops_start_up(host: HostRoots, tmp_path: Path, make_agent: AgentFactory) -> None:
    with pytest.raises(HookConfigError) as exc:
        make_agent(host, tmp_path, **FAST, host_applications=[{**APP, "cgroupPath": {"parentDir": "/../x"}}])
    assert exc.value.key_path == "tasks.metrics.host_applications"
    assert "tasks.metrics.host_applications[0].cgroupPath.parentDir: escapes the cgroup root (got '/../x')" in str(
        exc.value)


@pytest.mark.asyncio
async def test_the_predictor_trains_from_the_agent_store_checkpoints_and_is_restored(
    host: HostRoots, tmp_path: Path, make_agent: AgentFactory
) -> None:
    registry = CollectorRegistry()
    agent, run = make_agent(host, tmp_path, registry, **FAST)
    task = agent.prediction
    assert task is not None
    checkpoint = tmp_path / "m.db.prediction.json"
    seen: dict[str, Any] = {}

    def train() -> None:
        # The fixture node has 1 CPU and MemTotal 8000 kB; its /proc/stat does not move, so
        # its CPU usage is written here. No pods: system = node.
        now = time.time()
        agent.tsdb.write([m.Sample(m.NODE_CPU_USAGE, 0.5, m.NO_LABELS, now - 1)], now)
        agent.tsdb.flush()
        task.step(agent.pods(), now + 0.5)
        seen["text"] = generate_latest(registry).decode()
        seen["explain"] = agent.explain(None)
        seen["status"] = agent.reporter._build(agent.pods(), agent.reporter.policy())

    await _run(agent, run, node_ticks=4, while_running=train)
    assert task.predictor.model(NODE) is not None and task.predictor.model(SYSTEM) is not None
    assert checkpoint.exists() and set(json.loads(checkpoint.read_text())["models"]) >= {NODE, SYSTEM}
    result = task.latest()
    assert result is not None and result.reclaimable == (0.0, 0.0)  # no Prod requests: nothing to reclaim
    # peak = system p95 / p98 x 1.1: 0.5 cores is in bucket 14 ([0.490, 0.539): 0.5 * (1.05**i - 1)), ending
    # at 0.539; 5000 KiB is below the first bucket's 5 MiB: bucket 0, ending at 5 MiB.
    assert result.peak == pytest.approx((1.1 * 0.5 * (1.05**15 - 1), 1.1 * 5 * 2**20))
    assert result.inputs["capacity"] == {"cpu": 1.0, "memory": 8000 * 1024}
    node = agent.settings.node_name
    assert (f'koordlet_node_predicted_resource_reclaimable{{node="{node}",predictor="minPredictor",resource="cpu",'
            'unit="core"} 0.0') in seen["text"]
    assert f'koordlet_node_predicted_resource_peak{{node="{node}",predictor="podReclaimablePredictor"' in seen["text"]
    assert seen["explain"]["prediction"]["models"] >= 2
    # the NodeMetric document (loopback route and report) carries the estimate
    assert seen["status"]["prodReclaimableMetric"] == {"resource": {"resources": {"cpu": "0m", "memory": "0"}}}
    assert seen["status"]["prodPeakMetric"]["resource"]["resources"]["cpu"] == "593m"  # 1.1 x 0.539

    again, run2 = make_agent(host, tmp_path, **FAST)
    await _run(again, run2, node_ticks=1)
    assert again.prediction is not None
    assert set(again.prediction.predictor.models) == set(task.predictor.models)


def test_prediction_settings(host: HostRoots, tmp_path: Path, make_agent: AgentFactory) -> None:
    agent, _r = make_agent(host, tmp_path, **FAST, prediction={"enabled": False})
    agent.tsdb.close()
    assert agent.prediction is None
    for bad, key in (({"model_ttl": "30s"}, "model_ttl"), ({"safety_margin_percent": 101}, "safety_margin_percent"),
                     ({"cold_start": "soon"}, "cold_start"), ({"nope": 1}, "nope")):
        with pytest.raises(HookConfigError) as exc:
            make_agent(host, tmp_path, **FAST, prediction=bad)
        assert exc.value.key_path == f"tasks.metrics.prediction.{key}"
    agent, _r = make_agent(host, tmp_path, **FAST, prediction={"checkpoint": str(tmp_path / "state" / "p.json"),
                                                   "training_interval": "30s"})
    agent.tsdb.close()
    assert agent.prediction is not None and agent.prediction.predictor.checkpoint == tmp_path / "state" / "p.json"
    assert agent.prediction.settings.training_interval == 30
