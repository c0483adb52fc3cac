"""What the hooks would write at reconcile under other rules (the hooks' half of
``koord-runtime-proxy plan``; the QoS half is the QoS task's ``/debug/plan``).

Route ``/debug/plan-hooks?rules=<encoded rules overlay>``: the overlay (what a NodeSLO
becomes, as ``/debug/plan`` returns it after parsing the NodeSLO as the agent does) is
merged over the config's ``rules:``; every local hook is built afresh with
``dry_run: true`` deciding from those rules, and its reconcile stages run once over the
store's active pods and containers (the reconciler's walk). Each ``HostWrite`` a hook
reports is a value that would change (``hooks.dryrun``: only files that differ),
``current -> new`` with its reason. Hooks without a dry run are listed, never called.
Nothing is written and nothing is recorded in the store; the fresh hooks log their
planned writes (``hook_dry_run``) as any dry run does.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import json
import zlib
from collections.abc import Callable, Mapping
from typing import Any, Final

from runtimeproxy.chain import plugins
from runtimeproxy.chain.hookchain import BoundHook
from runtimeproxy.config.settings import Settings
from runtimeproxy.hookapi import ContainerContext, Context, HostWrite, PodContext, PodInfo, Stage, merge_rules
from runtimeproxy.state.store import Store

ROUTE: Final = "/debug/plan-hooks"
QUERY: Final = "rules"
_JSON: Final = "application/json"
#: What ``hooks.dryrun`` adds to a planned write (stripped: the preview says it once).
_SUFFIX: Final = " (dry-run, not written)"
_PREFIX: Final = "dry-run: "

Route = Callable[[dict[str, str]], Any]


def encode(overlay: Mapping[str, Any]) -> str:
    return base64.urlsafe_b64encode(zlib.compress(json.dumps(overlay, separators=(",", ":")).encode())).decode()


def _decode(text: str) -> Mapping[str, Any]:
    doc = json.loads(zlib.decompress(base64.urlsafe_b64decode(text.encode()), bufsize=1 << 16))
    if not isinstance(doc, Mapping):
        raise ValueError("not a JSON object")
    return doc


def _write(hook: str, pod: PodInfo, container: str, w: HostWrite) -> dict[str, Any]:
    return {"hook": hook, "pod": f"{pod.meta.namespace}/{pod.meta.name}", "container": container,
            "path": w.target, "current": w.old, "new": w.new.removesuffix(_SUFFIX),
            "reason": w.reason.removeprefix(_PREFIX)}


async def _call(bound: BoundHook, stage: Stage, ctx: Context) -> tuple[HostWrite, ...]:
    method = getattr(bound.impl, stage.method_name)
    result = await method(ctx) if inspect.iscoroutinefunction(method) else await asyncio.to_thread(method, ctx)
    writes: tuple[HostWrite, ...] = getattr(result, "writes", None) or ()
    return writes


async def preview(settings: Settings, store: Store, skipped: Callable[[PodInfo], bool],
                  overlay: Mapping[str, Any]) -> dict[str, Any]:
    rules = merge_rules(settings.rules, overlay)
    hooks: list[BoundHook] = []
    not_previewed: list[dict[str, str]] = []
    for entry in settings.hooks:
        built = plugins.dry_run_hook(entry, settings, lambda: rules)
        if isinstance(built, str):
            not_previewed.append({"hook": entry.name, "reason": built})
        else:
            hooks.append(built)
    changes: list[dict[str, Any]] = []
    errors: list[dict[str, str]] = []
    try:
        pods, containers = store.snapshot()
        live = {sid: pod for sid, pod in pods.items() if store.active_pod(sid) and not skipped(pod)}
        contexts: list[tuple[Stage, Context, str]] = [
            (Stage.RECONCILE_POD_SANDBOX, PodContext(Stage.RECONCILE_POD_SANDBOX, pod), "") for pod in live.values()]
        contexts += [(Stage.RECONCILE_CONTAINER, ContainerContext(Stage.RECONCILE_CONTAINER, live[sid], c),
                      c.meta.name) for sid, c in containers.values()
                     if sid in live and store.active_container(c.id)]
        for stage, ctx, container in contexts:
            for bound in hooks:
                if stage not in bound.stages:
                    continue
                try:
                    writes = await _call(bound, stage, ctx)
                except Exception as exc:  # noqa: BLE001 - one hook's failure is reported, the rest go on
                    errors.append({"hook": bound.name, "pod": ctx.pod.meta.name, "error": f"{type(exc).__name__}: "
                                   f"{exc}"})
                    continue
                changes += [_write(bound.name, ctx.pod, container, w) for w in writes]
    finally:
        await plugins.close_hooks(hooks)
    return {"changes": changes, "errors": errors, "not_previewed": not_previewed,
            "previewed": [h.name for h in hooks]}


def route(settings: Callable[[], Settings], store: Store, skipped: Callable[[PodInfo], bool]) -> Route:
    """The ``/debug/plan-hooks`` handler over the process's current settings and store."""

    async def handle(query: dict[str, str]) -> tuple[int, str, bytes]:
        try:
            overlay = _decode(query.get(QUERY, ""))
        except (ValueError, zlib.error) as exc:
            return 400, _JSON, json.dumps({"error": f"{QUERY}: not an encoded JSON object: {exc}"}).encode()
        body = await preview(settings(), store, skipped, overlay)
        return 200, _JSON, json.dumps(body, default=str).encode()

    return handle
