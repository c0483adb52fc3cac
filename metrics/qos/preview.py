"""A NodeSLO preview (``koord-runtime-proxy plan``, the ``/debug/plan`` route): what the
QoS manager would do on this node, now, if a NodeSLO were applied. Nothing is written.

The document goes through the agent's own path: ``rules_from_nodeslo`` (the parser the
NodeSLO watch uses: an error names ``nodeslo.spec.<field>`` and the value), merged over
the YAML rules like the rules overlay, parsed like ``LiveRules`` does. Then one round is
planned with *fresh* strategies (built like the task's, so the live ones keep their
state: burst buckets, eviction cool-downs), from the store's current samples and the
current pods, and arbitrated like a real round. Each cgroup write goes through the
knobs' dry-run path (``hooks.dryrun.planned_writes``): the file is read and only a value
that would change is listed, ``current -> new`` with the reason (the rule that decides
it), per pod or per tier (a tier lists the pods under it). Evictions list the pod and
why. Other actions (resctrl schemata, task moves) are listed as the strategy describes
them.

The hooks' half (what they write per pod and container at reconcile) is the core's
``/debug/plan-hooks`` (``runtimeproxy.state.hookpreview``), given the overlay returned here.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from hooks.dryrun import planned_writes
from hooks.executor import Update
from hooks.rules import Rules, parse_rules, rules_from_nodeslo
from metrics.model import PodView
from metrics.qos.plan import Action, Evict, LeveledWrite, Plan, SetCgroup, arbitrate
from metrics.qos.strategy import RoundContext, Strategy, read_inputs
from runtimeproxy.errors import InputError
from runtimeproxy.hookapi import HookConfigError, merge_rules

#: The route's one query parameter: the NodeSLO document (a NodeSLO object, or its
#: spec), JSON, zlib-compressed, URL-safe base64 (the endpoint takes 8 KiB of head).
QUERY: Final = "nodeslo"
ROUTE: Final = "/debug/plan"


class PreviewError(InputError, ValueError):
    """The document is refused; the message names the field as the agent's log would."""


def encode(doc: Mapping[str, Any]) -> str:
    return base64.urlsafe_b64encode(zlib.compress(json.dumps(doc, separators=(",", ":")).encode())).decode()


def decode(text: str) -> Mapping[str, Any]:
    try:
        doc = json.loads(zlib.decompress(base64.urlsafe_b64decode(text.encode()), bufsize=1 << 16))
    except (ValueError, zlib.error) as exc:
        raise PreviewError(f"{QUERY}: not an encoded JSON document: {exc}") from exc
    if not isinstance(doc, Mapping):
        raise PreviewError(f"{QUERY}: not a JSON object")
    return doc


def spec_of(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    """A NodeSLO object's ``spec``, or the document itself when it is a bare spec."""
    if "kind" in doc or "apiVersion" in doc:
        if doc.get("kind") != "NodeSLO":
            raise PreviewError(f"kind: not a NodeSLO (got {doc.get('kind')!r})")
        spec = doc.get("spec")
        if not isinstance(spec, Mapping):
            raise PreviewError(f"spec: must be a mapping (got {spec!r})")
        return spec
    return doc


def candidate_rules(spec: Mapping[str, Any], yaml_rules: Mapping[str, Any]) -> tuple[Mapping[str, Any], Rules]:
    """The NodeSLO as the rules overlay the agent would register, and the rules in
    force then: the watch's parser, the overlay merge, the rules provider's parse
    (errors as the agent logs them)."""
    try:
        overlay = rules_from_nodeslo(spec) or {}
        return overlay, parse_rules(merge_rules(yaml_rules, overlay))
    except HookConfigError as exc:
        raise PreviewError(f"{exc.key_path}: {exc.message} (got {exc.value!r})") from exc


@dataclass(frozen=True, slots=True)
class Sources:
    """What a preview reads: the manager's context pieces, and fresh strategies."""

    context: Callable[[Rules], RoundContext]
    strategies: Callable[[], Sequence[Strategy]]


def _owner(cgroup: str, pods: Sequence[PodView]) -> tuple[str, list[str]]:
    """("pod", [its key]) for a pod's or container's cgroup, else ("tier", pods under it)."""
    for pod in pods:
        if cgroup == pod.cgroup_dir or any(cgroup == c.cgroup_dir for c in pod.containers):
            return "pod", [pod.key]
    prefix = cgroup.rstrip("/") + "/"
    return "tier", sorted(p.key for p in pods if p.cgroup_dir.startswith(prefix))


def _sets(action: Action) -> tuple[SetCgroup, ...]:
    if isinstance(action, SetCgroup):
        return (action,)
    if isinstance(action, LeveledWrite):
        return action.items()
    return ()


def _changes(plan: Plan, ctx: RoundContext) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    changes: list[dict[str, Any]] = []
    evictions: list[dict[str, Any]] = []
    other: list[dict[str, Any]] = []
    for action in plan.actions:
        if isinstance(action, Evict):
            evictions.append({"strategy": plan.strategy, "pod": action.pod_key, "uid": action.pod_uid,
                              "reason": action.reason})
            continue
        sets = _sets(action)
        if not sets:
            other.append({"strategy": plan.strategy, **action.describe()})
            continue
        for item in sets:
            writes = planned_writes(ctx.executor, [Update(item.cgroup, item.resource, item.value, item.reason)])
            scope, pods = _owner(str(item.cgroup), ctx.pods)
            changes.extend({"strategy": plan.strategy, "scope": scope, "pods": pods, "cgroup": str(item.cgroup),
                            "file": item.resource.name, "path": w.target, "current": w.old, "new": w.new,
                            "reason": w.reason} for w in writes)
    return changes, evictions, other


def preview(rules: Rules, sources: Sources) -> dict[str, Any]:
    """One planned, arbitrated round under ``rules`` (worker thread); writes nothing."""
    ctx = sources.context(rules)
    strategies = list(sources.strategies())
    active = [s for s in strategies if s.enabled(rules)]
    inputs = read_inputs(ctx, [key for s in active for key in s.reads])
    plans: list[Plan] = []
    for chosen in active:
        made = chosen.plan(inputs)
        plans += [made] if isinstance(made, Plan) else list(made)
    applied, rejected = arbitrate(plans)
    out: dict[str, Any] = {"changes": [], "evictions": [], "other": [], "plans": [], "rejected": [],
                           "idle": [s.name for s in strategies if s not in active], "pods": len(ctx.pods)}
    for plan in applied:
        changes, evictions, other = _changes(plan, ctx)
        out["changes"] += changes
        out["evictions"] += evictions
        out["other"] += other
        out["plans"].append({"strategy": plan.strategy, "reason": plan.reason, "actions": len(plan.actions)})
    out["rejected"] = [r.describe() for r in rejected]
    be_pods = sorted(p.key for p in ctx.pods if p.qos.value == "BE")
    suppressing = [c for c in out["changes"] if c["strategy"] == "cpu_suppress"]
    out["suppressed"] = be_pods if suppressing else []
    return out


__all__ = ["QUERY", "ROUTE", "PreviewError", "Sources", "candidate_rules", "decode", "encode", "preview", "spec_of"]
