"""Shared fixtures for the metrics agent tests.

* ``host``: fixture /proc, /sys and cgroup v1 trees the agent's node collectors can read
  (one CPU, 8000 kB of memory, the four controllers mounted, no pods). A module that
  needs more overrides it by a ``host`` fixture taking this one.
* ``api``, ``kube``: a local API server (``tests.kubeapi``) and a ``KubeClient`` of node
  ``node-a`` connected to it (fast back-off).
* ``make_agent``: builds the metrics task as the proxy does (``metrics_task``) on a host
  and a db in a directory, with the collectors that need a real kernel (schedlat, CPI)
  off and a 100 ms flush; keyword arguments are ``tasks.metrics`` keys laid over these.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from metrics.agent import MetricsAgent, metrics_task
from metrics.informer.kubeclient import KubeClient, KubeSettings
from runtimeproxy.hookapi import HostRoots, TaskInit
from tests.kubeapi import KubeApiServer
from tests.unit.metrics.kubehelpers import kubeconfig

#: ``make_agent(host, directory, registry=None, **args) -> (agent, run)``
AgentFactory = Callable[..., tuple[MetricsAgent, Any]]


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def host(tmp_path: Path) -> HostRoots:
    h = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys", resctrl=tmp_path / "r")
    _write(h.proc / "stat", "cpu  100 0 50 800 0 0 0 0 0 0\ncpu0 100 0 50 800 0 0 0 0 0 0\n")
    _write(h.proc / "meminfo", "MemTotal:        8000 kB\nMemFree:         1000 kB\nMemAvailable:    3000 kB\n")
    _write(h.sys / "devices/system/cpu/online", "0\n")
    for controller in ("cpu", "cpuacct", "memory", "cpuset"):
        (h.cgroup / controller).mkdir(parents=True)
    return h


def _make_agent(host: HostRoots, directory: Path, registry: Any = None, **args: Any) -> tuple[MetricsAgent, Any]:
    provided: list[object] = []  # what the task hands the tasks built on it: its agent
    init = TaskInit(name="metrics", key_path="tasks.metrics", provide=provided.append,
                    snapshot=lambda: ({}, {}), host=host, registry=registry,
                    add_route=lambda _path, _route: None, add_explainer=lambda _name, _explainer: None,
                    add_exposition=lambda _render: None,
                    args={"db": str(directory / "m.db"), "schedlat_source": "off", "cpi": False,
                          "flush_interval": "100ms", **args})
    run = metrics_task(init)
    agent = provided[0]
    assert isinstance(agent, MetricsAgent)
    return agent, run


@pytest.fixture
def make_agent() -> AgentFactory:
    return _make_agent



@pytest.fixture
def api() -> Iterator[KubeApiServer]:
    server = KubeApiServer()
    yield server
    server.close()


@pytest.fixture
def kube(tmp_path: Path, api: KubeApiServer) -> Iterator[KubeClient]:
    settings = KubeSettings("node-a", kubeconfig=kubeconfig(tmp_path, api.url), qps=1000, timeout=5,
                            backoff_initial=0.05, backoff_max=0.2, watch_seconds=30)
    client = KubeClient.connect(settings)
    yield client
    client.close()
