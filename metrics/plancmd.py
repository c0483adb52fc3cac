"""``koord-runtime-proxy plan --nodeslo FILE``: preview a NodeSLO on this node.

Sends the document to the running agent (its loopback endpoint, route ``/debug/plan``,
``metrics.qos.preview``), which validates it with the parser its NodeSLO watch uses and
plans one QoS round under it without writing anything; then the rules overlay it
returns to ``/debug/plan-hooks`` (``runtimeproxy.state.hookpreview``): the hooks'
reconcile in dry run under those rules. Prints every cgroup value that would change,
per pod and per tier (``current -> new`` and the reason), the pods that would be evicted
at the node's current usage, the BE pods whose tier limit changes (suppressed), the
strategies idle under it and the hooks that cannot be previewed. Exit status: 0 shown, 2 the agent
refuses the document (the message names the field and value), 1 the agent cannot be
reached.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import yaml

from metrics.qos.preview import QUERY, ROUTE, encode

#: The core's route (``runtimeproxy.state.hookpreview.ROUTE``/``QUERY``, same encoding:
#: metrics never import the core's rooms).
HOOKS_ROUTE: Final = "/debug/plan-hooks"
HOOKS_QUERY: Final = "rules"
#: The endpoint reads at most 8 KiB of request head (``runtimeproxy.ops.httpendpoint``).
MAX_TARGET: Final = 7 * 1024


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``plan`` to the CLI (entry point group ``koord_runtime_proxy.commands``)."""
    p = subparsers.add_parser("plan", help="preview a NodeSLO on this node: every value that would change, "
                                           "evictions at current usage; nothing is written")
    p.add_argument("--nodeslo", type=Path, required=True, help="a NodeSLO (YAML or JSON), or its spec")
    p.add_argument("--endpoint", default="127.0.0.1:9316", help="the agent's metrics host:port")
    p.add_argument("--output", choices=("text", "json"), default="text")
    p.set_defaults(func=run)


def _load(path: Path) -> Mapping[str, Any] | str:
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        return f"cannot read {path}: {exc}"
    return doc if isinstance(doc, Mapping) else f"{path}: not a mapping"


def _fetch(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:  # loopback endpoint
            return 0, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            body = json.loads(exc.read())
        except ValueError:
            body = {}
        message = body.get("error", f"HTTP {exc.code}") if isinstance(body, Mapping) else f"HTTP {exc.code}"
        if exc.code == 404:
            message = f"the agent at {url.split('?')[0]} has no such route: is tasks.qos-manager enabled?"
        print(f"koord-runtime-proxy plan: {message}", file=sys.stderr)
        return (2 if exc.code == 400 else 1), None
    except OSError as exc:
        print(f"koord-runtime-proxy plan: cannot reach the agent at {url.split('?')[0]}: {exc}", file=sys.stderr)
        return 1, None


def render(body: Mapping[str, Any]) -> list[str]:
    out = [f"NodeSLO accepted; {body['pods']} pod(s); nothing is written"]
    if body["idle"]:
        out.append(f"strategies idle under it: {', '.join(body['idle'])}")
    pods: dict[str, list[dict[str, Any]]] = {}
    tiers: dict[str, list[dict[str, Any]]] = {}
    for change in body["changes"]:
        if change["scope"] == "pod":
            pods.setdefault(change["pods"][0], []).append(change)
        else:
            tiers.setdefault(change["cgroup"], []).append(change)

    hooks = body.get("hooks") or {}
    for change in hooks.get("changes", []):
        pods.setdefault(change["pod"], []).append({**change, "strategy": f"hook {change['hook']}"})

    def line(c: Mapping[str, Any]) -> str:
        return f"    {c['path']}: {c['current'] or '-'} -> {c['new']}  ({c['strategy']}: {c['reason']})"

    out.append("per pod:" if pods else "per pod: no change")
    for key, changes in sorted(pods.items()):
        out.append(f"  {key}")
        out.extend(line(c) for c in changes)
    out.append("per tier:" if tiers else "per tier: no change")
    for cgroup, changes in sorted(tiers.items()):
        under = changes[0]["pods"]
        out.append(f"  {cgroup}  (pods: {', '.join(under) if under else 'none'})")
        out.extend(line(c) for c in changes)
    out.append("evicted at current usage:" if body["evictions"] else "evicted at current usage: none")
    out.extend(f"  {e['pod']}  ({e['strategy']}: {e['reason']})" for e in body["evictions"])
    out.append(f"suppressed (BE tier limit changes): {', '.join(body['suppressed']) or 'none'}")
    for other in body["other"]:
        out.append(f"other: {json.dumps(other, default=str)}")
    for skipped in hooks.get("not_previewed", []):
        out.append(f"hook {skipped['hook']} not previewed: {skipped['reason']}")
    for error in hooks.get("errors", []):
        out.append(f"hook {error['hook']} failed on {error['pod']}: {error['error']}")
    return out


def run(args: argparse.Namespace) -> int:
    doc = _load(args.nodeslo)
    if isinstance(doc, str):
        print(f"koord-runtime-proxy plan: {doc}", file=sys.stderr)
        return 2
    url = f"http://{args.endpoint}{ROUTE}?{QUERY}={encode(doc)}"
    if len(url) > MAX_TARGET:
        print(f"koord-runtime-proxy plan: the NodeSLO is too large to send ({len(url)} bytes encoded, the "
              f"endpoint reads {MAX_TARGET}): drop what this node does not use", file=sys.stderr)
        return 2
    code, body = _fetch(url)
    if code:
        return code
    # The core cannot parse a NodeSLO: the QoS task's route returned it as the rules overlay.
    hooks_url = f"http://{args.endpoint}{HOOKS_ROUTE}?{HOOKS_QUERY}={encode(body.get('overlay') or {})}"
    code, hooks = _fetch(hooks_url)
    if code:
        return code
    body["hooks"] = hooks
    print(json.dumps(body, indent=2) if args.output == "json" else "\n".join(render(body)))
    return 0
