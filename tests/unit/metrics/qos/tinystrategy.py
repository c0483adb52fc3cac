"""A strategy as a third party would write one: one module, one entry point
(loaded by test_qos_strategy through a real ``importlib.metadata.EntryPoint``)."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from hooks.cgroups import CPU_CFS_QUOTA
from hooks.rules import Rules
from metrics.qos.plan import Plan, Priority, SetCgroup
from metrics.qos.strategy import NODE, Input, RoundContext, RoundInputs, Strategy, StrategyInit

READS: list[float] = []  # the times TINY_INPUT was read


def _read(ctx: RoundContext) -> int:
    READS.append(ctx.now)
    return len(ctx.pods)


#: Declared by two strategies below: read once per round all the same.
TINY_INPUT: Input[int] = Input("tiny_pods", _read, lambda n: {"pods": n})


class Tiny(Strategy):
    """Caps the BE tier quota at ``args.quota`` while ``resourceUsedThresholdWithBE``
    is enabled; between suppression and eviction in priority."""

    priority = Priority.SUPPRESS + 5
    #: What its plans say: the manager stamps the declared ``priority`` over it.
    plan_priority = 1
    reads = (NODE, TINY_INPUT)

    def __init__(self, quota: int, name: str) -> None:
        self.quota = quota
        self.name = name

    def enabled(self, rules: Rules) -> bool:
        return rules.resource_used_threshold_with_be.enable

    def plan(self, inputs: RoundInputs) -> Plan:
        pods = inputs[TINY_INPUT]
        node = inputs[NODE]
        info: dict[str, Any] = {"pods": pods, "node_cpu_used": node.node_cpu_used}
        action = SetCgroup(PurePosixPath("kubepods/besteffort"), CPU_CFS_QUOTA, self.quota, "tiny cap")
        return Plan(self.name, self.plan_priority, (action,), info, "capped")


def tiny(init: StrategyInit) -> Tiny:
    quota = init.args.get("quota", 50_000)
    return Tiny(int(quota), init.name)
