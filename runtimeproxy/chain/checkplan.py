"""``check-config``: the whole plan ``run`` would build from a config, as text or JSON.

The hooks in chain order (built, so each validated its args), and per enabled task what
its factory's optional ``plan(init)`` says it would run (``plugins.plan_tasks``: the
metrics task's collectors, the QoS manager's strategies, their intervals, what is off on
this host and why). The core renders any task's plan without knowing it: scalars as
``key=value``, lists of named items as a table (name, state, interval, reason).

What the builders log while probing the host is kept as ``notes`` instead of printed, so
``--output json`` is one JSON document on stdout.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from structlog.testing import capture_logs

from runtimeproxy.chain import plugins
from runtimeproxy.chain.hookchain import BoundHook
from runtimeproxy.config.configvalues import format_duration
from runtimeproxy.config.settings import Settings


def _host(hook: BoundHook) -> dict[str, str]:
    """A hook's optional ``host_support() -> (on | off | unknown, why)``: whether this
    host has what it writes (detected as at its first pod); "on" without one."""
    probe: Callable[[], tuple[str, str]] | None = getattr(hook.impl, "host_support", None)
    if probe is None:
        return {"state": "on", "reason": ""}
    try:
        state, reason = probe()
    except Exception as exc:  # noqa: BLE001 - a probe's failure is shown, not a crash of check-config
        return {"state": "unknown", "reason": f"{type(exc).__name__}: {exc}"}
    return {"state": state, "reason": reason}


def ingress_line(settings: Settings) -> str:
    """Which way kubelet's calls reach the hook chain (check-config, explain)."""
    nri = settings.nri
    if settings.ingress == "cri-proxy":
        return f"cri-proxy (kubelet -> {settings.listen})"
    where = f"nri (containerd calls {nri.plugin_index}-{nri.plugin_name} on {nri.socket})"
    return where if settings.ingress == "nri" else f"both: cri-proxy on {settings.listen} + {where}"


def build(settings: Settings) -> dict[str, Any]:
    """The plan as one JSON-able mapping (raises ConfigError like ``run`` would)."""
    with capture_logs() as lines:
        hooks, tasks = plugins.validate(settings)
        plans = plugins.plan_tasks(settings)
        hosts = [_host(h) for h in hooks]
    return {
        "config": {"listen": settings.listen, "backend": settings.backend.runtime_endpoint,
                   "data_plane": settings.data_plane, "source": settings.source,
                   "ingress": settings.ingress, "ingress_detail": ingress_line(settings),
                   "deprecated": list(settings.deprecated)},
        "hooks": [{"position": i + 1, "name": h.name, "failure_policy": h.policy.value, "timeout": h.timeout,
                   "stages": sorted(s.value for s in h.stages), "host": host}
                  for i, (h, host) in enumerate(zip(hooks, hosts, strict=True))],
        "tasks": {name: plans.get(name, {}) for name in tasks},
        "notes": [{k: v for k, v in line.items() if k != "log_level"} for line in lines],
    }


def _item(entry: Mapping[str, Any]) -> str:
    parts = [str(entry.get("name", "")), str(entry.get("state", ""))]
    if entry.get("interval") is not None:
        parts.append(f"every {format_duration(entry['interval'])}")
    if entry.get("required"):
        parts.append("required")
    line = "  ".join(p for p in parts if p)
    return f"{line}  ({entry['reason']})" if entry.get("reason") else line


def _is_table(value: object, key: str = "name") -> bool:
    return (isinstance(value, Sequence) and not isinstance(value, str) and bool(value)
            and all(isinstance(v, Mapping) and key in v for v in value))


def _note(note: Mapping[str, Any]) -> str:
    fields = " ".join(f"{k}={_scalar(v)}" for k, v in note.items() if k not in ("event", "log_level"))
    return f"{note.get('event')}: {fields}"


def _scalar(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def render_text(plan: Mapping[str, Any], data_plane: str) -> list[str]:
    """The plan for a terminal; the first lines are check-config's historic ones."""
    cfg = plan["config"]
    out = [f"config ok: listen={cfg['listen']} backend={cfg['backend']} {data_plane}"
           f" ingress={cfg['ingress']} source={cfg['source']}"]
    if cfg["ingress"] != "cri-proxy":
        out.append(f"ingress: {cfg['ingress_detail']}")
    if not plan["hooks"]:
        out.append("no hooks configured: every call is passed through")
    for h in plan["hooks"]:
        out.append(f"{h['position']}. {h['name']}\t{h['failure_policy']}\t{h['timeout']}s\t{','.join(h['stages'])}")
    off = [h for h in plan["hooks"] if h["host"]["state"] != "on"]
    if off:
        out.append("hooks that do nothing on this host (or not known before the first pod):")
        out.extend(f"  {h['name']}  {h['host']['state']}  ({h['host']['reason']})" for h in off)
    tasks: Mapping[str, Mapping[str, Any]] = plan["tasks"]
    out.append(f"tasks: {', '.join(tasks) if tasks else 'none'}")
    out.extend(f"deprecated, ignored: {key}" for key in cfg["deprecated"])
    for name, task in tasks.items():
        out.append(f"task {name}:")
        scalars = [f"{k}={_scalar(v)}" for k, v in task.items() if not (_is_table(v) or _is_table(v, "event"))]
        if scalars:
            out.append("  " + " ".join(scalars))
        for key, value in task.items():
            if _is_table(value):
                out.append(f"  {key}:")
                out.extend(f"    {_item(entry)}" for entry in value)
            elif _is_table(value, "event"):
                out.append(f"  {key}:")
                out.extend(f"    {_note(entry)}" for entry in value)
    if plan["notes"]:
        out.append("host notes (what the builders found, as run logs them at start):")
        out.extend(f"  {_note(note)}" for note in plan["notes"])
    return out
