"""The NodeResourceTopology in the metrics task: its settings, the loopback route the
agent mounts, explain; no writer task without a cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from metrics.agent import MetricsAgent, metrics_task
from metrics.settings import parse_metrics
from runtimeproxy.hookapi import HookConfigError, TaskInit
from tests.unit.metrics.crdschema import validate_nrt
from tests.unit.metrics.test_nrt import host_tree, write


def test_nrt_settings_parse_and_bad_values_name_key_and_value() -> None:
    s = parse_metrics({"nrt_interval": "10s", "nrt_report": False, "kubelet_config": "/etc/kubelet/config.yaml",
                       "kubelet_cpu_manager_state": "/data/kubelet/cpu_manager_state"}, "tasks.metrics")
    assert (s.nrt_interval, s.nrt_report) == (10.0, False)
    assert (str(s.kubelet_config), str(s.kubelet_cpu_manager_state)) == (
        "/etc/kubelet/config.yaml", "/data/kubelet/cpu_manager_state")
    defaults = parse_metrics({}, "tasks.metrics")
    assert (defaults.nrt_interval, defaults.nrt_report) == (3.0, True)
    assert str(defaults.kubelet_cpu_manager_state) == "/var/lib/kubelet/cpu_manager_state"
    for raw, key in (({"nrt_interval": "0s"}, "nrt_interval"), ({"nrt_report": "yes"}, "nrt_report"),
                     ({"kubelet_config": "config.yaml"}, "kubelet_config"),
                     ({"kubelet_cpu_manager_state": 3}, "kubelet_cpu_manager_state")):
        with pytest.raises(HookConfigError) as err:
            parse_metrics(raw, "tasks.metrics")
        assert err.value.key_path == f"tasks.metrics.{key}" and err.value.value == next(iter(raw.values()))


@pytest.mark.asyncio
async def test_the_agent_serves_the_object_on_loopback_without_a_cluster(tmp_path: Path) -> None:
    host = host_tree(tmp_path)
    write(host.proc / "meminfo", "MemTotal:        8000 kB\nMemFree:         1000 kB\nMemAvailable:    3000 kB\n")
    write(tmp_path / "kubelet/config.yaml", "topologyManagerPolicy: best-effort\n")
    for controller in ("cpu", "cpuacct", "memory", "cpuset"):
        (host.cgroup / controller).mkdir(parents=True)
    routes: dict[str, Any] = {}
    provided: list[object] = []  # what the task hands the tasks built on it: its agent
    init = TaskInit(name="metrics", key_path="tasks.metrics", provide=provided.append,
                    snapshot=lambda: ({}, {}), host=host,
                    add_route=routes.__setitem__, add_explainer=lambda _name, _explainer: None,
                    args={"db": str(tmp_path / "m.db"), "schedlat_source": "off", "cpi": False,
                          "node_name": "node-a", "kubelet_config": str(tmp_path / "kubelet/config.yaml"),
                          "kubelet_cpu_manager_state": str(tmp_path / "kubelet/cpu_manager_state")})
    metrics_task(init)
    agent = provided[0]
    assert isinstance(agent, MetricsAgent)
    try:
        assert not agent.nrt.connected
        status, content_type, body = await routes["/apis/noderesourcetopology"]({})
        doc = json.loads(body)
        assert (status, content_type) == (200, "application/json")
        assert doc["metadata"]["name"] == "node-a"
        assert doc["topologyPolicies"] == ["BestEffortContainerLevel"]
        assert [z["name"] for z in doc["zones"]] == ["node-0", "node-1"]
        validate_nrt(doc)
        view = agent.explain(None)["noderesourcetopology"]
        assert view["inputs"]["ls_pool"] == "0-7" and view["cluster"] is False
    finally:
        agent.tsdb.close()
