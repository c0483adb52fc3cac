"""The shipped tasks wired by the core, listed in reverse: the metrics agent, the
interference analyser and the QoS manager reach each other through ``init.needed``
(typed handles), built in dependency order whatever the order under ``tasks:``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from metrics.agent import MetricsAgent
from metrics.analysis.interference_task import InterferenceTask
from metrics.qos.interference import Interference
from metrics.qos.manager import QoSManager
from runtimeproxy.chain import plugins
from runtimeproxy.config import settings as config
from runtimeproxy.hookapi import HostRoots
from runtimeproxy.state.store import Store


def test_qos_manager_interference_and_metrics_listed_in_reverse(host: HostRoots, tmp_path: Path) -> None:
    settings = config.from_mapping({
        "host": {"cgroup_root": str(host.cgroup), "proc": str(host.proc), "sys": str(host.sys),
                 "resctrl_root": str(host.resctrl)},
        "tasks": {
            "qos-manager": {"cgroup_driver": "cgroupfs", "strategies": ["cpu-suppress", "interference"]},
            "interference": {},
            "metrics": {"db": str(tmp_path / "m.db"), "schedlat_source": "off", "memlat_source": "off",
                        "cpi": False},
        },
    })
    explainers: dict[str, Any] = {}
    base = dataclasses.replace(plugins.task_base(Store().snapshot), add_explainer=explainers.__setitem__,
                               add_route=lambda _p, _r: None, add_exposition=lambda _render: None)
    built = plugins.build_tasks(settings, base)
    agent = explainers["metrics"].__self__
    try:
        assert [name for name, _ in built] == ["metrics", "interference", "qos-manager"]
        assert isinstance(agent, MetricsAgent)
        analyser = explainers["interference"].__self__
        manager = explainers["qos"].__self__
        assert isinstance(analyser, InterferenceTask) and isinstance(manager, QoSManager)
        # The QoS manager's executor writes through the app's services, like the hooks.
        assert manager._executor.backoff is base.services.write_backoff
        (strategy,) = [s for s in manager.strategies if isinstance(s, Interference)]
        analyser.verdicts = {"cpu": {}}
        assert strategy._verdicts() is analyser.verdicts
    finally:
        agent.tsdb.close()
