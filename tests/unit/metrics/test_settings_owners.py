"""Each settings section is parsed by the package that owns it, with the one toolkit.

A bad key under ``tasks.<name>`` goes through the core's one check of ``tasks:``
(``plugins.validate_tasks``: the entry points' ``validate``); the error must name the
key path and the value, and be raised in the owning subpackage's parser (a frame of that
module on the way to ``configvalues``), so a central parser that bypasses it, or a second
private copy of the toolkit, fails here. The hooks' sections that checked unknown keys
by hand do it with ``configvalues.reject_unknown`` too (tests/unit/hooks/test_unknown_keys.py).
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import pytest

from runtimeproxy.chain import plugins
from runtimeproxy.config import settings as config
from runtimeproxy.config.configvalues import ConfigError
from runtimeproxy.hookapi import HostRoots


def _modules(tb: TracebackType | None) -> list[str]:
    """The modules of the frames the error passed through, outermost first."""
    out: list[str] = []
    while tb is not None:
        out.append(str(tb.tb_frame.f_globals.get("__name__")))
        tb = tb.tb_next
    return out


def _validate(host: HostRoots, tasks: dict[str, Any]) -> pytest.ExceptionInfo[ConfigError]:
    with pytest.raises(ConfigError) as info:
        settings = config.from_mapping({
            "host": {"cgroup_root": str(host.cgroup), "proc": str(host.proc), "sys": str(host.sys),
                     "resctrl_root": str(host.resctrl)},
            "tasks": tasks,
        })
        plugins.validate_tasks(settings)
    return info


@pytest.mark.parametrize(("tasks", "key_path", "value", "owner"), [
    ({"metrics": {}, "qos-manager": {"fast_patth": True}},
     "tasks.qos-manager.fast_patth", True, "metrics.qos.settings"),
    ({"metrics": {}, "qos-manager": {"besteffort_dir": "../etc"}},
     "tasks.qos-manager.besteffort_dir", "../etc", "metrics.qos.tierroot"),
    ({"metrics": {"tiers": {"hot": "1m"}}}, "tasks.metrics.tiers.hot", "1m", "metrics.store.settings"),
    ({"metrics": {"tiers": {"step": "7m"}}}, "tasks.metrics.tiers.coarse_step", "300s (the default)",
     "metrics.store.settings"),
    ({"metrics": {"kubelet": {"uri": "http://x"}}}, "tasks.metrics.kubelet.uri", "http://x",
     "metrics.informer.settings"),
    ({"metrics": {"intervals": {"gpu": "1s"}}}, "tasks.metrics.intervals.gpu", "1s", "metrics.collect.settings"),
    ({"metrics": {"host_applications": "nginx"}}, "tasks.metrics.host_applications", "nginx",
     "metrics.collect.settings"),
    ({"metrics": {"prediction": {"ttl": "1h"}}}, "tasks.metrics.prediction.ttl", "1h",
     "metrics.analysis.prediction"),
])
def test_a_bad_key_is_refused_by_the_owning_package(host: HostRoots, tasks: dict[str, Any], key_path: str,
                                                     value: object, owner: str) -> None:
    info = _validate(host, tasks)
    assert (info.value.key_path, info.value.value) == (key_path, value)
    modules = _modules(info.tb)
    assert owner in modules, modules  # not re-parsed centrally: the subpackage's parser ran and refused it
    # ...with the one toolkit: the composer and the owner hand the check to configvalues
    assert modules[-1] == "runtimeproxy.config.configvalues" or owner == modules[-1], modules


def test_the_composer_still_checks_across_tasks(host: HostRoots) -> None:
    """``evict_mode: api`` is the QoS package's value, refused by the composer (it needs
    the metrics task's ``kube``), naming the QoS key."""
    info = _validate(host, {"metrics": {}, "qos-manager": {"evict_mode": "api"}})
    assert (info.value.key_path, info.value.value) == ("tasks.qos-manager.evict_mode", "api")
    assert "tasks.metrics.kube: true" in info.value.message
