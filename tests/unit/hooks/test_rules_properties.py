"""Property-based: a NodeSLO ``spec`` from the API server is untrusted input (issue 14).

``hooks.rules.parse_rules`` merges it over the defaults. Shaped documents (every
known key, values in and out of range, wrong types) and arbitrary JSON are thrown
at it; the only outcomes allowed are ``Rules`` or a ``HookConfigError`` whose
``key_path`` names the field under ``rules``, never another exception. The input
is not modified (the informer keeps the same object for the next sync).
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hooks.rules import Rules, parse_rules
from runtimeproxy.hookapi import HookConfigError
from tests.unit.jsonvalues import json_values

SETTINGS = settings(max_examples=200, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

JSON = json_values()
PCT = st.integers(-5, 105)
NUMBER = st.one_of(PCT, st.integers(-2, 100_001), JSON)
FLAG = st.one_of(st.booleans(), JSON)


def section(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """A mapping with any subset of ``fields`` (plus, sometimes, an unknown key), or junk."""
    shaped = st.fixed_dictionaries({}, optional=fields)
    with_unknown = st.builds(lambda d, k, v: {**d, k: v}, shaped, st.text(max_size=6), JSON)
    return st.one_of(shaped, shaped, shaped, with_unknown, JSON)


CPU_QOS = section({"enable": FLAG, "groupIdentity": NUMBER, "schedIdle": NUMBER, "coreExpeller": FLAG})
RESCTRL_QOS = section({"enable": FLAG, "catRangeStartPercent": NUMBER, "catRangeEndPercent": NUMBER,
                       "mbaPercent": NUMBER})
MEMORY_QOS = section({key: NUMBER for key in (
    "minLimitPercent", "lowLimitPercent", "throttlingPercent", "wmarkRatio", "wmarkScalePermill", "wmarkMinAdj",
    "priorityEnable", "priority", "oomKillGroup")} | {"enable": FLAG})
CLASS = section({"cpuQOS": CPU_QOS, "resctrlQOS": RESCTRL_QOS, "memoryQOS": MEMORY_QOS})
CHOICE = st.sampled_from(["groupIdentity", "coreSched", "tc", "terway-qos", "cpuset", "cfsQuota", "none", "auto",
                          "cpuBurstOnly", "evictByRealLimit", "LSR", "LSE", "LS", "BE", ""]) | JSON
NODESLO_SPEC = section({
    "resourceQOSStrategy": section({key: CLASS for key in ("lsrClass", "lsClass", "beClass", "systemClass",
                                                             "cgroupRoot")}),
    "policies": section({"cpuPolicy": CHOICE, "netQOSPolicy": CHOICE}),
    "resourceUsedThresholdWithBE": section({key: NUMBER for key in (
        "cpuSuppressThresholdPercent", "cpuSuppressMinPercent", "memoryEvictThresholdPercent",
        "memoryEvictLowerPercent", "cpuEvictBESatisfactionLowerPercent", "cpuEvictBESatisfactionUpperPercent",
        "cpuEvictBEUsageThresholdPercent", "cpuEvictTimeWindowSeconds")}
        | {"enable": FLAG, "cpuSuppressPolicy": CHOICE, "cpuEvictPolicy": CHOICE}),
    "cpuBurstStrategy": section({"policy": CHOICE, "cpuBurstPercent": NUMBER, "cfsQuotaBurstPercent": NUMBER,
                                 "cfsQuotaBurstPeriodSeconds": NUMBER, "sharePoolThresholdPercent": NUMBER}),
    "guaranteedQoSClass": CHOICE,
})


@SETTINGS
@given(NODESLO_SPEC)
def test_nodeslo_spec_is_rules_or_a_config_error_naming_the_field(spec: Any) -> None:
    before = copy.deepcopy(spec)
    try:
        rules = parse_rules(spec, "nodeslo.spec")  # not always a mapping: the API may send anything
    except HookConfigError as exc:
        assert exc.key_path.startswith("nodeslo.spec")
        assert str(exc).startswith(exc.key_path)
    else:
        assert isinstance(rules, Rules)
        # Parsing a document twice gives the same rules (no hidden state).
        assert parse_rules(spec, "nodeslo.spec") == rules
    assert spec == before or spec != spec  # untouched (NaN is never equal to itself)


@SETTINGS
@given(NODESLO_SPEC, NODESLO_SPEC)
def test_nodeslo_merged_over_yaml_rules_is_rules_or_a_config_error(yaml_rules: Any, spec: Any) -> None:
    """The live NodeSLO is merged over the YAML ``rules:`` (item 10's one provider)."""
    try:
        base = parse_rules(yaml_rules, "rules")
    except HookConfigError:
        return
    try:
        merged = parse_rules(spec, "nodeslo.spec", base)
    except HookConfigError as exc:
        assert exc.key_path.startswith("nodeslo.spec")
    else:
        assert isinstance(merged, Rules)
