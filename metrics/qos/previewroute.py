"""The ``/debug/plan`` route of the QoS task: a NodeSLO preview (``metrics.qos.preview``)
against this agent's pods, samples and cgroups. 400 with ``{"error": ...}`` naming the
field for a document the agent would refuse; else the preview as JSON."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hooks.rules import Rules
from metrics.qos import preview
from metrics.qos.evict import SharedEviction
from metrics.qos.manager import QoSManager
from metrics.qos.specs import StrategySpec
from metrics.qos.strategy import RoundContext, Strategy, StrategyInit, load_strategies
from metrics.qos.tierquota import ChildClamps
from runtimeproxy.hookapi import TaskInit

if TYPE_CHECKING:
    from metrics.handles import AgentHandle

_JSON = "application/json"


def add_route(init: TaskInit, manager: QoSManager, base: StrategyInit, specs: Sequence[StrategySpec] | None,
              agent: AgentHandle) -> None:
    """Register the route; ``base`` and ``specs`` build fresh strategies as the task did."""

    def context(rules: Rules) -> RoundContext:
        return RoundContext(now=time.time(), rules=rules, pods=tuple(agent.pods()), reader=agent.tsdb,
                            executor=base.executor, config=base.config, capacity_cores=manager.capacity)

    def strategies() -> Sequence[Strategy]:
        # No store writer, no state dir, no reconcile, eviction state of their own:
        # planning only. The agent (the Node's allocatable) and the interference
        # verdicts are read.
        fresh = dataclasses.replace(base, state_dir=None, writer=None, reconcile_now=None, resctrl=None,
                                    eviction=SharedEviction(), tier_clamps=ChildClamps())
        return load_strategies(specs, fresh).enabled

    sources = preview.Sources(context=context, strategies=strategies)

    async def route(query: dict[str, str]) -> tuple[int, str, bytes]:
        try:
            spec = preview.spec_of(preview.decode(query.get(preview.QUERY, "")))
            overlay, rules = preview.candidate_rules(spec, init.rules)
        except preview.PreviewError as exc:
            return 400, _JSON, json.dumps({"error": f"invalid NodeSLO: {exc}"}).encode()
        body = await asyncio.to_thread(preview.preview, rules, sources)
        # The overlay goes on to the hooks' half (/debug/plan-hooks): the core cannot parse a NodeSLO.
        return 200, _JSON, json.dumps({**body, "overlay": overlay}, default=str).encode()

    init.add_route(preview.ROUTE, route)
