"""resourceUsedThresholdWithBE and cpuBurstStrategy: defaults, NodeSLO paste, strict errors."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from hooks.rules import CPUBurstStrategy, ResourceThresholdStrategy, parse_cpu_burst, parse_rules
from runtimeproxy.hookapi import HookConfigError


def test_threshold_and_burst_defaults_match_koordinator() -> None:
    rules = parse_rules({})
    t = rules.resource_used_threshold_with_be
    assert (t.enable, t.cpu_suppress_threshold_percent, t.cpu_suppress_policy) == (False, 65, "cpuset")
    assert (t.memory_evict_threshold_percent, t.memory_evict_lower_percent, t.memory_evict_lower) == (70, None, 68)
    assert t.cpu_suppress_min_percent is None
    assert t.cpu_evict_be_satisfaction_lower_percent is None and t.cpu_evict_be_satisfaction_upper_percent is None
    assert (t.cpu_evict_be_usage_threshold_percent, t.cpu_evict_policy) == (90, "evictByRealLimit")
    b = rules.cpu_burst_strategy
    assert (b.policy, b.cpu_burst_percent, b.cfs_quota_burst_percent) == ("none", 1000, 300)
    assert (b.cfs_quota_burst_period_seconds, b.share_pool_threshold_percent) == (-1, 50)
    assert not b.cpu_burst_enabled and not b.cfs_quota_burst_enabled


def test_a_pasted_nodeslo_spec_parses() -> None:
    spec = """
    resourceUsedThresholdWithBE:
      enable: true
      cpuSuppressThresholdPercent: 60
      cpuSuppressMinPercent: 10
      cpuSuppressPolicy: cfsQuota
      memoryEvictThresholdPercent: 80
      memoryEvictLowerPercent: 75
      cpuEvictBESatisfactionLowerPercent: 40
      cpuEvictBESatisfactionUpperPercent: 80
      cpuEvictBEUsageThresholdPercent: 95
      cpuEvictTimeWindowSeconds: 30
      cpuEvictPolicy: evictByAllocatable
    cpuBurstStrategy:
      policy: auto
      cpuBurstPercent: 500
      cfsQuotaBurstPercent: 200
      cfsQuotaBurstPeriodSeconds: 60
      sharePoolThresholdPercent: 40
    """
    rules = parse_rules(yaml.safe_load(spec))
    assert rules.resource_used_threshold_with_be == ResourceThresholdStrategy(
        enable=True, cpu_suppress_threshold_percent=60, cpu_suppress_min_percent=10, cpu_suppress_policy="cfsQuota",
        memory_evict_threshold_percent=80, memory_evict_lower_percent=75,
        cpu_evict_be_satisfaction_lower_percent=40, cpu_evict_be_satisfaction_upper_percent=80,
        cpu_evict_be_usage_threshold_percent=95, cpu_evict_time_window_seconds=30,
        cpu_evict_policy="evictByAllocatable")
    assert rules.resource_used_threshold_with_be.memory_evict_lower == 75
    assert rules.cpu_burst_strategy == CPUBurstStrategy("auto", 500, 200, 60, 40)
    assert rules.cpu_burst_strategy.cpu_burst_enabled and rules.cpu_burst_strategy.cfs_quota_burst_enabled


def test_lower_percent_follows_the_threshold_when_unset() -> None:
    t = parse_rules({"resourceUsedThresholdWithBE": {"memoryEvictThresholdPercent": 90}})
    assert t.resource_used_threshold_with_be.memory_evict_lower == 88


@pytest.mark.parametrize(
    ("spec", "path", "value"),
    [
        ({"cpuEvictBESatisfactionLowerPercent": 61}, "cpuEvictBESatisfactionLowerPercent", 61),
        ({"cpuEvictBESatisfactionLowerPercent": 0}, "cpuEvictBESatisfactionLowerPercent", 0),
        ({"cpuEvictBESatisfactionUpperPercent": 100}, "cpuEvictBESatisfactionUpperPercent", 100),
        ({"cpuEvictBESatisfactionLowerPercent": 50, "cpuEvictBESatisfactionUpperPercent": 50},
         "cpuEvictBESatisfactionUpperPercent", 50),
        ({"memoryEvictThresholdPercent": 70, "memoryEvictLowerPercent": 70}, "memoryEvictLowerPercent", 70),
        ({"cpuSuppressMinPercent": 70}, "cpuSuppressMinPercent", 70),
        ({"cpuSuppressPolicy": "quota"}, "cpuSuppressPolicy", "quota"),
        ({"cpuEvictPolicy": "byLimit"}, "cpuEvictPolicy", "byLimit"),
        ({"cpuEvictTimeWindowSeconds": 0}, "cpuEvictTimeWindowSeconds", 0),
        ({"cpuEvictBEUsageThresholdPercent": "90"}, "cpuEvictBEUsageThresholdPercent", "90"),
    ],
)
def test_bad_threshold_values_name_the_path_and_value(spec: dict[str, Any], path: str, value: object) -> None:
    with pytest.raises(HookConfigError) as info:
        parse_rules({"resourceUsedThresholdWithBE": spec})
    assert info.value.key_path == f"rules.resourceUsedThresholdWithBE.{path}"
    assert info.value.value == value


@pytest.mark.parametrize(
    ("spec", "path"),
    [
        ({"policy": "always"}, "policy"),
        ({"cfsQuotaBurstPercent": 99}, "cfsQuotaBurstPercent"),
        ({"cfsQuotaBurstPeriodSeconds": -2}, "cfsQuotaBurstPeriodSeconds"),
        ({"sharePoolThresholdPercent": 0}, "sharePoolThresholdPercent"),
        ({"cpuBurstPercnt": 100}, "cpuBurstPercnt"),
    ],
)
def test_bad_burst_values_name_the_path(spec: dict[str, Any], path: str) -> None:
    with pytest.raises(HookConfigError) as info:
        parse_rules({"cpuBurstStrategy": spec})
    assert info.value.key_path == f"rules.cpuBurstStrategy.{path}"


def test_pod_burst_override_merges_over_the_node_config() -> None:
    node = CPUBurstStrategy(policy="auto", share_pool_threshold_percent=40)
    pod = parse_cpu_burst({"policy": "cpuBurstOnly", "cpuBurstPercent": 200}, "annotation", node)
    assert pod == CPUBurstStrategy("cpuBurstOnly", 200, 300, -1, 40)
    with pytest.raises(HookConfigError) as info:
        parse_cpu_burst({"sharePoolThresholdPercent": 10}, "annotation", node)
    assert info.value.key_path == "annotation.sharePoolThresholdPercent"
    with pytest.raises(HookConfigError):
        parse_cpu_burst(["auto"], "annotation", node)
