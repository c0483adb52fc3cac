"""NodeSLO-style rules: Koordinator defaults, partial merge, strict errors."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from hooks.qos import QoSClass
from hooks.rules import CPUQOS, NONE_CLASS, Rules, parse_rules
from runtimeproxy.hookapi import HookConfigError


def test_defaults_match_koordinator() -> None:
    rules = parse_rules({})
    strategy = rules.resource_qos_strategy
    assert strategy.lsr_class.cpu_qos.group_identity == 2
    assert strategy.ls_class.cpu_qos.group_identity == 2
    assert strategy.be_class.cpu_qos.group_identity == -1
    assert strategy.system_class.cpu_qos.group_identity == 0
    assert strategy.lsr_class.cpu_qos.core_expeller and not strategy.be_class.cpu_qos.core_expeller
    be_resctrl = strategy.be_class.resctrl_qos
    assert (be_resctrl.cat_range_start_percent, be_resctrl.cat_range_end_percent) == (0, 30)
    assert strategy.ls_class.resctrl_qos.cat_range_end_percent == 100
    assert all(c.resctrl_qos.mba_percent == 100 for c in (strategy.lsr_class, strategy.ls_class, strategy.be_class))
    assert strategy.be_class.memory_qos.wmark_min_adj == 50
    assert strategy.ls_class.memory_qos.wmark_min_adj == -25
    assert strategy.ls_class.memory_qos.wmark_ratio == 95
    assert strategy.system_class.memory_qos.wmark_scale_permill == 50
    assert not any(
        c.cpu_qos.enable or c.resctrl_qos.enable or c.memory_qos.enable
        for c in (strategy.lsr_class, strategy.ls_class, strategy.be_class, strategy.system_class)
    )
    assert rules.policies.cpu_policy == "groupIdentity" and rules.policies.net_qos_policy == "tc"
    threshold = rules.resource_used_threshold_with_be
    assert (threshold.enable, threshold.cpu_suppress_threshold_percent, threshold.cpu_suppress_policy) == (
        False,
        65,
        "cpuset",
    )
    assert parse_rules(None) == Rules()


def test_partial_spec_merges_over_defaults_from_yaml() -> None:
    text = """
    resourceQOSStrategy:
      beClass:
        cpuQOS: {enable: true, groupIdentity: 0}
        resctrlQOS: {enable: true, catRangeEndPercent: 50, mbaPercent: 40}
    policies: {cpuPolicy: coreSched}
    resourceUsedThresholdWithBE: {enable: true, cpuSuppressPolicy: cfsQuota}
    """
    rules = parse_rules(yaml.safe_load(text))
    be = rules.resource_qos_strategy.be_class
    assert be.cpu_qos == CPUQOS(enable=True, group_identity=0, sched_idle=0, core_expeller=False)
    assert (be.resctrl_qos.cat_range_start_percent, be.resctrl_qos.cat_range_end_percent) == (0, 50)
    assert be.resctrl_qos.mba_percent == 40
    assert be.memory_qos.wmark_min_adj == 50  # untouched default
    assert rules.resource_qos_strategy.ls_class == Rules().resource_qos_strategy.ls_class
    assert rules.policies.cpu_policy == "coreSched"
    assert rules.resource_used_threshold_with_be.cpu_suppress_policy == "cfsQuota"


def test_merge_over_a_given_base() -> None:
    first = parse_rules({"resourceQOSStrategy": {"lsClass": {"cpuQOS": {"enable": True}}}})
    second = parse_rules({"resourceQOSStrategy": {"lsClass": {"cpuQOS": {"groupIdentity": 1}}}}, base=first)
    assert second.resource_qos_strategy.ls_class.cpu_qos == CPUQOS(enable=True, group_identity=1, core_expeller=True)


def test_for_class_applies_enable_and_lse() -> None:
    rules = parse_rules({"resourceQOSStrategy": {"lsrClass": {"cpuQOS": {"enable": True}}}})
    assert rules.for_class(QoSClass.LSE).cpu_qos.group_identity == 2
    assert rules.for_class(QoSClass.LSR).cpu_qos.group_identity == 2
    assert rules.for_class(QoSClass.LS).cpu_qos == NONE_CLASS.cpu_qos  # disabled -> None config
    assert rules.for_class(QoSClass.BE).resctrl_qos == NONE_CLASS.resctrl_qos
    assert rules.for_class(QoSClass.NONE) == NONE_CLASS


@pytest.mark.parametrize(
    ("raw", "path", "value"),
    [
        ({"resourceQOSStrategy": {"beClass": {"cpuQOS": {"groupIdentity": 5}}}},
         "rules.resourceQOSStrategy.beClass.cpuQOS.groupIdentity", 5),
        ({"resourceQOSStrategy": {"beClass": {"cpuQOS": {"groupIdentity": "-1"}}}},
         "rules.resourceQOSStrategy.beClass.cpuQOS.groupIdentity", "-1"),
        ({"resourceQOSStrategy": {"beClass": {"cpuQOS": {"enable": "yes"}}}},
         "rules.resourceQOSStrategy.beClass.cpuQOS.enable", "yes"),
        ({"resourceQOSStrategy": {"beClass": {"cpuQOS": {"enable": 1}}}},
         "rules.resourceQOSStrategy.beClass.cpuQOS.enable", 1),
        ({"resourceQOSStrategy": {"beClass": {"cpuQos": {}}}}, "rules.resourceQOSStrategy.beClass.cpuQos", {}),
        ({"resourceQOSStrategy": {"bestEffort": {}}}, "rules.resourceQOSStrategy.bestEffort", {}),
        ({"resourceQOSStrategy": {"lsClass": {"resctrlQOS": {"mbaPercent": 0}}}},
         "rules.resourceQOSStrategy.lsClass.resctrlQOS.mbaPercent", 0),
        ({"resourceQOSStrategy": {"lsClass": {"resctrlQOS": {"catRangeEndPercent": 101}}}},
         "rules.resourceQOSStrategy.lsClass.resctrlQOS.catRangeEndPercent", 101),
        ({"resourceQOSStrategy": {"lsClass": {"memoryQOS": {"wmarkMinAdj": 60}}}},
         "rules.resourceQOSStrategy.lsClass.memoryQOS.wmarkMinAdj", 60),
        ({"resourceQOSStrategy": {"lsClass": {"memoryQOS": {"minLimitPercent": True}}}},
         "rules.resourceQOSStrategy.lsClass.memoryQOS.minLimitPercent", True),
        ({"resourceQOSStrategy": []}, "rules.resourceQOSStrategy", []),
        ({"policies": {"cpuPolicy": "bvt"}}, "rules.policies.cpuPolicy", "bvt"),
        ({"resourceUsedThresholdWithBE": {"cpuSuppressPolicy": "quota"}},
         "rules.resourceUsedThresholdWithBE.cpuSuppressPolicy", "quota"),
        ({"nodeSLO": {}}, "rules.nodeSLO", {}),
    ],
)
def test_bad_rules_name_path_and_value(raw: dict[str, Any], path: str, value: object) -> None:
    with pytest.raises(HookConfigError) as info:
        parse_rules(raw)
    assert info.value.key_path == path
    assert info.value.value == value
    assert path in str(info.value) and repr(value) in str(info.value)


def test_cat_range_must_not_be_empty() -> None:
    raw = {"resourceQOSStrategy": {"beClass": {"resctrlQOS": {"catRangeStartPercent": 30}}}}
    with pytest.raises(HookConfigError, match="catRangeStartPercent must be below") as info:
        parse_rules(raw)
    assert info.value.key_path == "rules.resourceQOSStrategy.beClass.resctrlQOS"
    assert info.value.value == (30, 30)


def test_rules_are_frozen() -> None:
    rules = parse_rules({})
    with pytest.raises(AttributeError):
        rules.policies.cpu_policy = "coreSched"  # type: ignore[misc]


def test_guaranteed_class_is_configurable() -> None:
    from runtimeproxy.hookapi import PodInfo, PodMeta

    guaranteed = PodInfo(meta=PodMeta(name="g", namespace="ns", uid="u"), cgroup_parent="/kubepods/podu")
    labelled = PodInfo(meta=PodMeta(name="l", namespace="ns", uid="v"), cgroup_parent="/kubepods/podv",
                       labels={"koordinator.sh/qosClass": "LSE"})
    assert parse_rules(None).qos_of(guaranteed) is QoSClass.LSR
    custom = parse_rules({"guaranteedQoSClass": "LS"})
    assert custom.qos_of(guaranteed) is QoSClass.LS
    assert custom.qos_of(labelled) is QoSClass.LSE, "the label still wins"
    with pytest.raises(HookConfigError) as err:
        parse_rules({"guaranteedQoSClass": "BE"})
    assert err.value.key_path == "rules.guaranteedQoSClass"


# --- the NodeSLO as the rules overlay (issue 14, item 10) ------------------------------------


def test_a_full_nodeslo_spec_becomes_rules_without_the_features_we_do_not_model() -> None:
    from hooks.rules import rules_from_nodeslo

    spec = {
        "resourceQOSStrategy": {
            "policies": {"cpuPolicy": "coreSched", "netQOSPolicy": "tc"},
            "beClass": {"cpuQOS": {"enable": True, "groupIdentity": -1, "schedIdle": 1},
                        "memoryQOS": {"enable": False, "pageCacheEnable": True},
                        "blkioQOS": {"enable": False, "blocks": []}, "networkQOS": {"enable": False}},
        },
        "resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressPolicy": "cfsQuota",
                                        "cpuAllocatableEvictThresholdPercent": 80},
        "cpuBurstStrategy": {"policy": "auto"},
        "systemStrategy": {"minFreeKbytesFactor": 100}, "extensions": {}, "hostApplications": [],
    }
    out = rules_from_nodeslo(spec)
    assert out == {
        "resourceQOSStrategy": {"beClass": {"cpuQOS": {"enable": True, "groupIdentity": -1, "schedIdle": 1},
                                            "memoryQOS": {"enable": False},
                                            "blkioQOS": {"enable": False, "blocks": []}}},
        "resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressPolicy": "cfsQuota",
                                        "cpuAllocatableEvictThresholdPercent": 80},  # allocatable-evict
        "cpuBurstStrategy": {"policy": "auto"},
        "systemStrategy": {"minFreeKbytesFactor": 100},  # system-config
        "policies": {"cpuPolicy": "coreSched", "netQOSPolicy": "tc"},
    }
    rules = parse_rules(out)
    assert rules.policies.cpu_policy == "coreSched" and rules.for_class(QoSClass.BE).cpu_qos.sched_idle == 1
    assert rules_from_nodeslo(None) is None


@pytest.mark.parametrize(
    ("spec", "path", "value"),
    [
        ({"resourceQOSStrategy": {"beClass": {"cpuQOS": {"groupIdentity": 7}}}},
         "nodeslo.spec.resourceQOSStrategy.beClass.cpuQOS.groupIdentity", 7),
        ({"resourceQOSStrategy": {"policies": {"cpuPolicy": "bvt"}}}, "nodeslo.spec.policies.cpuPolicy", "bvt"),
        ({"resourceQOSStrategy": {"beClass": []}}, "nodeslo.spec.resourceQOSStrategy.beClass", []),
        ({"resourceUsedThresholdWithBE": {"cpuSuppressPolicy": "quota"}},
         "nodeslo.spec.resourceUsedThresholdWithBE.cpuSuppressPolicy", "quota"),
        ({"systemStrategy": {"watermarkScaleFactor": 5000}}, "nodeslo.spec.systemStrategy.watermarkScaleFactor", 5000),
        ({"systemStrategy": {"minFreeKbytesFactor": 0}}, "nodeslo.spec.systemStrategy.minFreeKbytesFactor", 0),
        ({"systemStrategy": {"memcgReapBackGround": 2}}, "nodeslo.spec.systemStrategy.memcgReapBackGround", 2),
        ({"resourceUsedThresholdWithBE": {"cpuEvictThresholdPercent": 60, "cpuEvictLowerPercent": 70}},
         "nodeslo.spec.resourceUsedThresholdWithBE.cpuEvictLowerPercent", 70),
        ({"resourceUsedThresholdWithBE": {"memoryAllocatableEvictLowerPercent": 120}},
         "nodeslo.spec.resourceUsedThresholdWithBE.memoryAllocatableEvictLowerPercent", 120),
    ],
)
def test_a_bad_nodeslo_value_is_named(spec: dict[str, Any], path: str, value: object) -> None:
    from hooks.rules import rules_from_nodeslo

    with pytest.raises(HookConfigError) as info:
        rules_from_nodeslo(spec)
    assert info.value.key_path == path and info.value.value == value


def test_live_rules_parse_once_per_change_and_keep_the_last_that_parsed(capsys: pytest.CaptureFixture[str]) -> None:
    from hooks.rules import LiveRules
    from runtimeproxy.hookapi import RulesProvider

    yaml_rules = {"resourceQOSStrategy": {"beClass": {"cpuQOS": {"enable": True}}}}
    provider = RulesProvider(yaml_rules)
    live = LiveRules(base=yaml_rules, current=provider.current, owner="gi")
    first = live()
    assert first.for_class(QoSClass.BE).cpu_qos.enable and live() is first  # cached by identity
    # Valid alone, contradicting the YAML once merged: ignored with one warning, the last
    # rules that parsed stay in force (issue 28 item 6), not the YAML's.
    provider.set_base({"resourceUsedThresholdWithBE": {"cpuSuppressThresholdPercent": 40}})
    good = live()
    assert good.resource_used_threshold_with_be.cpu_suppress_threshold_percent == 40
    provider.set_overlay("nodeslo", {"resourceUsedThresholdWithBE": {"cpuSuppressMinPercent": 50}})
    assert live() is good and live() is good
    out = capsys.readouterr().out
    assert out.count("rules_ignored") == 1 and "cpuSuppressMinPercent" in out
    with pytest.raises(HookConfigError):  # the YAML itself is checked strictly, at construction
        LiveRules(base={"resourceQOSStrategy": {"beClass": {"cpuQOS": {"enable": 1}}}})


def test_arbitrary_nodeslo_documents_give_rules_or_a_named_error() -> None:
    """A NodeSLO is untrusted input: random nested documents over the real keys and odd
    values either become rules (that parse) or fail with a HookConfigError naming
    ``nodeslo.spec.<path>`` — never another exception. Seeded, so a failure replays."""
    import random

    from hooks.rules import rules_from_nodeslo

    keys = ["resourceQOSStrategy", "policies", "cpuPolicy", "lsrClass", "lsClass", "beClass", "cgroupRoot",
            "cpuQOS", "memoryQOS", "resctrlQOS", "blkioQOS", "enable", "groupIdentity", "catRangeEndPercent",
            "resourceUsedThresholdWithBE", "cpuSuppressPolicy", "cpuSuppressMinPercent", "cpuBurstStrategy",
            "policy", "systemStrategy", "unknown", ""]
    values: list[object] = [None, True, False, 0, 1, -1, 2, 101, 10**30, 1.5, "", "cfsQuota", "auto",
                            "groupIdentity", [], [1], {}]
    rng = random.Random(14)

    def doc(depth: int = 0) -> object:
        if depth > 4 or rng.random() < 0.3:
            return rng.choice(values)
        return {rng.choice(keys): doc(depth + 1) for _ in range(rng.randint(0, 4))}

    outcomes = {"rules": 0, "error": 0}
    for _ in range(3000):
        spec = doc()
        if not isinstance(spec, dict):
            continue
        try:
            out = rules_from_nodeslo(spec)
        except HookConfigError as exc:
            assert exc.key_path.startswith("nodeslo.spec."), exc.key_path
            outcomes["error"] += 1
            continue
        assert out is not None
        parse_rules(out)
        outcomes["rules"] += 1
    assert outcomes["rules"] > 100 and outcomes["error"] > 100, outcomes
