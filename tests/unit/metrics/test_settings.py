"""tasks.metrics / tasks.qos-manager settings: shipped defaults, and errors naming key and value."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from metrics.analysis.interference_task import InterferenceSettings, parse_interference
from metrics.collect.registry import installed as installed_collectors
from metrics.collect.settings import Intervals
from metrics.qos.settings import QoSSettings, parse_qos
from metrics.qos.specs import default_specs, installed
from metrics.settings import MetricsSettings, parse_metrics
from metrics.store.settings import StoreTiers
from runtimeproxy.hookapi import HookConfigError

SHIPPED = Path(__file__).resolve().parents[3] / "systemd" / "config.yaml"


def test_shipped_tasks_are_the_documented_defaults() -> None:
    tasks = yaml.safe_load(SHIPPED.read_text())["tasks"]
    assert list(tasks) == ["metrics", "interference", "qos-manager"]  # both build on metrics
    assert parse_interference(tasks["interference"], "tasks.interference") == InterferenceSettings()
    metrics = parse_metrics(tasks["metrics"], "tasks.metrics")
    assert replace(metrics, collectors=()) == MetricsSettings(node_name=metrics.node_name)
    # every installed collector listed, enabled, at its default interval
    assert {c.name for c in metrics.collectors} == set(installed_collectors())
    assert all(c.enabled and c.interval is None and not c.args for c in metrics.collectors)
    assert metrics.intervals == Intervals(node=1, pods=1, psi=10, schedlat=1, cpi=60, topology=60)
    qos = parse_qos(tasks["qos-manager"], "tasks.qos-manager")
    assert replace(qos, strategies=None) == QoSSettings()
    # the shipped list is what no list means: every installed strategy, in the documented order
    assert [s.name for s in qos.strategies or ()] == [s.name for s in default_specs(installed())]


def test_durations_and_nested_sections_parse() -> None:
    s = parse_metrics({"retention": "2h", "intervals": {"pods": "500ms"}, "kubelet": {"url": "http://127.0.0.1:10255/"}},
                      "tasks.metrics")
    assert s.retention == 7200 and s.intervals.pods == 0.5 and s.intervals.node == 1.0
    assert s.kubelet.url == "http://127.0.0.1:10255"
    t = parse_metrics({"tiers": {"raw": "1h", "step": "30s", "coarse_step": "2m"}}, "tasks.metrics").tiers
    assert (t.raw, t.step, t.coarse_step, t.coarse_after) == (3600, 30, 120, StoreTiers().coarse_after)
    same = parse_metrics({"tiers": {"step": "5m"}}, "tasks.metrics").tiers  # one tier of buckets only
    assert same.step == same.coarse_step == 300
    q = parse_qos({"fast_interval": "100ms", "dry_run": True, "evict_mode": "api"}, "tasks.qos-manager")
    assert (q.fast_interval, q.dry_run, q.evict_mode) == (0.1, True, "api")


@pytest.mark.parametrize(("raw", "key", "value"), [
    ({"retention": "soon"}, "tasks.metrics.retention", "soon"),
    ({"retention": -1}, "tasks.metrics.retention", -1),
    ({"intervals": {"pods": "1x"}}, "tasks.metrics.intervals.pods", "1x"),
    ({"intervals": {"gpu": "1s"}}, "tasks.metrics.intervals.gpu", "1s"),
    ({"max_bytes": 0}, "tasks.metrics.max_bytes", 0),
    ({"schedlat_source": "perf"}, "tasks.metrics.schedlat_source", "perf"),
    ({"memlat_source": "bpf"}, "tasks.metrics.memlat_source", "bpf"),
    ({"intervals": {"memlat": "often"}}, "tasks.metrics.intervals.memlat", "often"),
    ({"cgroup_driver": "cgroup"}, "tasks.metrics.cgroup_driver", "cgroup"),
    ({"besteffort_dir": "../etc"}, "tasks.metrics.besteffort_dir", "../etc"),
    ({"kubelet": {"url": "127.0.0.1:10255"}}, "tasks.metrics.kubelet.url", "127.0.0.1:10255"),
    ({"kube": "yes"}, "tasks.metrics.kube", "yes"),
    ({"dbpath": "/x"}, "tasks.metrics.dbpath", "/x"),
    ({"tiers": "1m"}, "tasks.metrics.tiers", "1m"),
    ({"tiers": {"hot": "1m"}}, "tasks.metrics.tiers.hot", "1m"),
    ({"tiers": {"raw": "0s"}}, "tasks.metrics.tiers.raw", "0s"),
    ({"tiers": {"step": "0.5ms"}}, "tasks.metrics.tiers.step", "0.5ms"),
    ({"tiers": {"coarse_step": "90s"}}, "tasks.metrics.tiers.coarse_step", "90s"),
    ({"tiers": {"step": "7m"}}, "tasks.metrics.tiers.coarse_step", "300s (the default)"),
])
def test_bad_metrics_values_name_key_and_value(raw: dict[str, Any], key: str, value: object) -> None:
    with pytest.raises(HookConfigError) as err:
        parse_metrics(raw, "tasks.metrics")
    assert err.value.key_path == key and err.value.value == value


@pytest.mark.parametrize(("raw", "key"), [
    ({"fast_interval": "10ms"}, "tasks.qos-manager.fast_interval"),
    ({"evict_mode": "kill"}, "tasks.qos-manager.evict_mode"),
    ({"reserved_cpu": -1}, "tasks.qos-manager.reserved_cpu"),
    ({"dry_run": 1}, "tasks.qos-manager.dry_run"),
    ({"besteffort_dir": "/"}, "tasks.qos-manager.besteffort_dir"),
])
def test_bad_qos_values_name_key(raw: dict[str, Any], key: str) -> None:
    with pytest.raises(HookConfigError) as err:
        parse_qos(raw, "tasks.qos-manager")
    assert err.value.key_path == key
