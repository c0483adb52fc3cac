"""The collector registry (``koord_runtime_proxy.collectors``): a new collector is one
module plus one entry point, the built-ins run from it in the order their phases say,
and ``tasks.metrics.collectors`` enables, disables and re-times them."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from metrics import model as m
from metrics.agent import MetricsAgent
from metrics.collect.registry import GROUP
from metrics.settings import parse_metrics
from metrics.store.tsdb import TSDB
from runtimeproxy.hookapi import HookConfigError, HostRoots

AgentFactory = Callable[..., tuple[MetricsAgent, Any]]

TINY = '''
from metrics.collect.registry import CollectorPlugin
from metrics.model import Sample, labels

class Tiny:
    name = "tiny"
    interval = 1.0

    def __init__(self, init):
        self.value = float(init.args.get("value", 1))
        self.pods_seen = []

    def collect(self, now, pods):
        self.pods_seen.append(len(pods))
        return [Sample("tiny_value", self.value, labels(source="tiny"))]

    def close(self):
        pass

tiny = CollectorPlugin(Tiny, phase=5, interval=0.1)
'''


@pytest.fixture
def tiny_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module on sys.path and a real ``importlib.metadata.EntryPoint`` naming it, listed
    with the installed ones (as ``pip install`` of a package declaring it would)."""
    module = f"krp_tiny_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(TINY)
    monkeypatch.syspath_prepend(str(tmp_path))
    real = importlib.metadata.entry_points

    def entry_points(**select: Any) -> Any:
        found = real(**select)
        if select.get("group") != GROUP:
            return found
        extra = importlib.metadata.EntryPoint(name="tiny", value=f"{module}:tiny", group=GROUP)
        return importlib.metadata.EntryPoints([*found, extra])

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    return module


async def _run_until(agent: MetricsAgent, run: Any, name: str, ticks: int) -> None:
    task = asyncio.create_task(run())
    try:
        for _ in range(500):
            if agent.ticks.get(name, 0) >= ticks:
                break
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.asyncio
async def test_a_collector_from_an_entry_point_writes_to_the_store(
    host: HostRoots, tmp_path: Path, tiny_installed: str, make_agent: AgentFactory
) -> None:
    agent, run = make_agent(host, tmp_path, collectors={"tiny": {"args": {"value": 7}}})
    names = [c.name for c in agent.collectors]
    assert names[0] == "tiny"  # phase 5: before the node (10)
    tiny = agent.collectors[0]
    assert tiny.interval == 0.1  # the plugin's default
    await _run_until(agent, run, "tiny", 3)
    assert agent.ticks["tiny"] >= 3 and agent.cpu_seconds["tiny"] >= 0
    db = TSDB.open_readonly(tmp_path / "m.db")
    try:
        last = db.last("tiny_value", m.labels(source="tiny"), max_age=3600, now=time.time())
    finally:
        db.close()
    assert last is not None and last.value == 7.0


def test_a_configured_interval_and_disable_apply_to_an_entry_point_collector(
    host: HostRoots, tmp_path: Path, tiny_installed: str, make_agent: AgentFactory
) -> None:
    agent, _run = make_agent(host, tmp_path, collectors={"tiny": {"interval": "250ms"}, "psi": {"enabled": False}})
    try:
        by_name = {c.name: c for c in agent.collectors}
        assert by_name["tiny"].interval == 0.25
        assert "psi" not in by_name
        view = agent.explain(None)["collectors"]
        assert view["tiny"] == {"interval": 0.25, "phase": 5} and view["pods"] == {"interval": 1.0, "phase": 30}
        assert "psi" not in view
    finally:
        agent.tsdb.close()
    agent, _run = make_agent(host, tmp_path / "b", collectors={"tiny": {"enabled": False}})
    try:
        assert "tiny" not in {c.name for c in agent.collectors}
    finally:
        agent.tsdb.close()


def test_the_builtins_run_in_phase_order(host: HostRoots, tmp_path: Path, make_agent: AgentFactory) -> None:
    agent, _run = make_agent(host, tmp_path, schedlat_source="schedstat", cpi=True, memlat_source="counters")
    try:
        # The node before host applications before pods: the pod tick's derived series
        # combine the same tick's node and host-application readings. (resctrl-monitor:
        # not built without resctrl's L3_MON.)
        assert [c.name for c in agent.collectors] == ["node", "hostapps", "pods", "topology", "psi", "schedlat",
                                                       "cpi", "memlat"]
    finally:
        agent.tsdb.close()


def test_collector_intervals_old_and_new_shape(host: HostRoots, tmp_path: Path, make_agent: AgentFactory) -> None:
    s = parse_metrics({"intervals": {"psi": "5s"}, "collectors": {"pods": {"interval": "2s"}}}, "tasks.metrics")
    # The new key folds into ``intervals`` (which the QoS manager reads for the pod interval).
    assert (s.intervals.psi, s.intervals.pods, s.intervals.node) == (5.0, 2.0, 1.0)
    agent, _run = make_agent(host, tmp_path, intervals={"psi": "5s"}, collectors={"pods": {"interval": "2s"}},
                         memlat_source="off")
    try:
        by_name = {c.name: c.interval for c in agent.collectors}
        # host applications follow the pods' interval (same tick) unless set themselves
        assert by_name == {"node": 1.0, "hostapps": 2.0, "pods": 2.0, "topology": 60.0, "psi": 5.0}
    finally:
        agent.tsdb.close()


@pytest.mark.parametrize(("collectors", "key", "message"), [
    ({"gpu": {}}, "tasks.metrics.collectors.gpu", "unknown collector; installed: cpi, hostapps, memlat, node"),
    ({"pods": {"enabled": False}}, "tasks.metrics.collectors.pods.enabled", "cannot be disabled"),
    ({"psi": {"enabled": "no"}}, "tasks.metrics.collectors.psi.enabled", "must be true or false"),
    ({"psi": {"interval": "fast"}}, "tasks.metrics.collectors.psi.interval", "must be a duration"),
    ({"psi": "5s"}, "tasks.metrics.collectors.psi", "must be a mapping"),
    (["psi"], "tasks.metrics.collectors", "must be a mapping"),
])
def test_bad_collector_entries_name_the_field(collectors: object, key: str, message: str) -> None:
    with pytest.raises(HookConfigError) as refused:
        parse_metrics({"collectors": collectors}, "tasks.metrics")
    assert refused.value.key_path == key and message in refused.value.message


def test_a_builtin_refuses_args_it_does_not_take() -> None:
    # through the plugin's ``check``: refused without building (check-config, reload)
    with pytest.raises(HookConfigError) as refused:
        parse_metrics({"collectors": {"psi": {"args": {"cgroups": False}}}}, "tasks.metrics")
    assert refused.value.key_path == "tasks.metrics.collectors.psi.args.cgroups"
