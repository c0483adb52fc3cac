"""The metrics task runs the memory allocation latency collector as configured and its
``explain`` names the source (or why there is none). Against fixture trees."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from metrics.agent import MetricsAgent, metrics_task
from metrics.collect.memlat import MemLatencyCollector
from runtimeproxy.hookapi import HostRoots, TaskInit


def _agent(tmp_path: Path, **extra: Any) -> MetricsAgent:
    host = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys", resctrl=tmp_path / "r")
    (host.cgroup / "memory").mkdir(parents=True)
    host.proc.mkdir()
    (host.proc / "vmstat").write_text("allocstall_normal 3\ncompact_stall 1\npgscan_direct 9\n")
    provided: list[object] = []  # what the task hands the tasks built on it: its agent
    init = TaskInit(name="metrics", key_path="tasks.metrics", provide=provided.append,
                    snapshot=lambda: ({}, {}), host=host,
                    add_route=lambda _path, _route: None, add_explainer=lambda _name, _explainer: None,
                    args={"db": str(tmp_path / "m.db"), "schedlat_source": "off", "cpi": False, **extra})
    run = metrics_task(init)
    if inspect.iscoroutine(run):
        run.close()
    agent = provided[0]
    assert isinstance(agent, MetricsAgent)
    return agent


def test_memlat_runs_by_default_and_explain_names_its_source(tmp_path: Path) -> None:
    agent = _agent(tmp_path)  # fixture roots: no tracefs, no unified tree -> the counters
    try:
        memlat = [c for c in agent.collectors if isinstance(c, MemLatencyCollector)]
        assert len(memlat) == 1 and memlat[0].prefer == "auto" and memlat[0].interval == 10.0
        memlat[0].start()
        explained = agent.explain(None)["memlat"]
        assert explained["source"] == "counters"
        assert explained["reason"].startswith("ebpf: ")
    finally:
        agent.tsdb.close()


def test_memlat_off_and_its_interval(tmp_path: Path) -> None:
    agent = _agent(tmp_path, memlat_source="off")
    try:
        assert not [c for c in agent.collectors if isinstance(c, MemLatencyCollector)]
        assert agent.explain(None)["memlat"] is None
    finally:
        agent.tsdb.close()
    agent = _agent(tmp_path / "b", memlat_source="counters", intervals={"memlat": "30s"})
    try:
        memlat = [c for c in agent.collectors if isinstance(c, MemLatencyCollector)]
        assert memlat[0].prefer == "counters" and memlat[0].interval == 30.0
    finally:
        agent.tsdb.close()
