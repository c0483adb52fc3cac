"""``check-config``'s plan of the metrics and QoS tasks (``TaskFactory.plan``): what
``run`` would build on this host, built the same way and then dropped.

- ``tasks.metrics``: every installed collector in tick order (phase, name), with its
  resolved interval, whether it is required, and on/off with the reason: switched off in
  the config (not built), or off on this host (built, as run builds it, but its own probe
  found nothing to read: no L3_MON, no perf counters...; ``built`` says which). The
  store, flush and report intervals, the cluster connection.
- ``tasks.qos-manager``: its loop and fast path, and each strategy in planning order: on,
  off (disabled in the list, or not on this host: the factory built nothing) or idle
  (built, but ``enabled(rules)`` is false under the YAML rules: a NodeSLO may turn it on),
  with the reason.

What the builders log while probing (one line per host fact, as ``run`` logs it at start)
is captured, not printed: it becomes the reason of the collector or strategy it names.
Nothing is written: collectors are built and closed, not started (the eBPF loaders start
at the first tick), strategies get no state directory and no store.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from pathlib import PurePosixPath
from typing import Any

from structlog.testing import capture_logs

from hooks.cgroups import CgroupError, CgroupLayout
from hooks.executor import CgroupExecutor
from hooks.rules import parse_rules
from metrics.collect.registry import (
    CollectorInit,
    CollectorPlugin,
    CollectorSpec,
    as_plugin,
    installed,
    resolved_interval,
)
from metrics.collect.topology import TopologyCollector
from metrics.qos.evict import EvictConfig
from metrics.qos.manager import ManagerConfig
from metrics.qos.settings import parse_qos
from metrics.qos.strategy import StrategyInit, load_strategies
from metrics.qos.suppress import SuppressConfig
from metrics.settings import MetricsSettings, parse_metrics, validated_metrics
from runtimeproxy.hookapi import HookConfigError, TaskInit

#: Fields of a captured log line that say why (first present wins).
_WHY_FIELDS = ("reason", "consequence", "error")
#: A built-in collector whose factory returns None without a word: the switch that did it.
_SWITCHES: Mapping[str, Callable[[MetricsSettings], str]] = {
    "schedlat": lambda s: "tasks.metrics.schedlat_source: off" if s.schedlat_source == "off" else "",
    "memlat": lambda s: "tasks.metrics.memlat_source: off" if s.memlat_source == "off" else "",
    "cpi": lambda s: "tasks.metrics.cpi: false" if not s.cpi else "",
}


def _why(lines: Sequence[Mapping[str, Any]], *, strict: bool = False) -> str:
    """The first captured line that says why; else (unless ``strict``) the events' names."""
    for line in lines:
        for key in _WHY_FIELDS:
            if line.get(key):
                return f"{line['event']}: {line[key]}"
    return "" if strict else "; ".join(str(line.get("event")) for line in lines)


@contextmanager
def _quiet() -> Iterator[list[MutableMapping[str, Any]]]:
    """The builders' log lines, kept instead of printed (stdout may be JSON)."""
    with capture_logs() as lines:
        yield lines


def _source_note(name: str, settings: MetricsSettings) -> str:
    prefer = {"schedlat": settings.schedlat_source, "memlat": settings.memlat_source}.get(name)
    if prefer not in ("auto", "ebpf"):
        return f"source {prefer}" if prefer else ""
    bcc = importlib.util.find_spec("bcc") is not None
    return f"source {prefer}: eBPF {'(bcc found; chosen at the first tick)' if bcc else 'unavailable (no bcc)'}"


def _collector(name: str, plugin: CollectorPlugin, spec: CollectorSpec, settings: MetricsSettings, init: TaskInit,
               shared: dict[str, Any]) -> dict[str, Any]:
    interval = resolved_interval(plugin, spec, settings)
    entry: dict[str, Any] = {"name": name, "phase": plugin.phase, "interval": interval,
                             "required": plugin.required or None, "state": "on", "reason": "", "built": False}
    if spec.enabled is False:
        return {**entry, "state": "off", "reason": f"{spec.key_path}.enabled: false"}
    build = CollectorInit(name=name, args=spec.args, key_path=f"{spec.key_path}.args", interval=interval,
                          host=init.host, settings=settings, reader=None, shared=shared)
    with _quiet() as lines:
        collector = plugin.build(build)
    if collector is None:
        switch = _SWITCHES.get(name)
        reason = (switch(settings) if switch else "") or _why(lines) or "its factory built nothing"
        return {**entry, "state": "off", "reason": reason}
    entry["built"] = True  # run builds and ticks it; "off" below: it finds nothing to read here
    try:
        if getattr(collector, "available", True) is False:
            why = getattr(collector, "reason", "") or _why(lines) or "unavailable on this host"
            return {**entry, "state": "off", "reason": str(why)}
        return {**entry, "reason": _source_note(name, settings) or _why(lines, strict=True)}
    finally:
        close: Callable[[], object] | None = getattr(collector, "close", None)
        if close is not None:
            close()


def metrics_plan(init: TaskInit) -> dict[str, Any]:
    settings = parse_metrics(init.args, init.key_path)
    specs = {s.name: s for s in settings.collectors}
    plugins = sorted(((as_plugin(ep.load(), name), name) for name, ep in installed().items()),
                     key=lambda p: (p[0].phase, p[1]))
    shared: dict[str, Any] = {}
    collectors = [
        _collector(name, plugin, specs.get(name, CollectorSpec(name, key_path=f"{init.key_path}.collectors.{name}")),
                   settings, init, shared)
        for plugin, name in plugins
    ]
    return {
        "store": str(settings.db), "flush_interval": settings.flush_interval, "retention": settings.retention,
        "kube": settings.kube, "node_name": settings.node_name,
        "report_interval": settings.report_interval if settings.kube else None,
        "nrt_interval": settings.nrt_interval,
        "prediction": settings.prediction.enabled,
        "collectors": collectors,
    }


def qos_plan(init: TaskInit) -> dict[str, Any]:
    settings = parse_qos(init.args, init.key_path)
    metrics = validated_metrics(init)
    try:
        layout = CgroupLayout(init.host.cgroup, "auto", settings.cgroup_driver)
    except CgroupError as exc:
        raise HookConfigError(f"{init.key_path}.cgroup_driver", settings.cgroup_driver, str(exc)) from exc
    topology = TopologyCollector(init.host)
    config = ManagerConfig(
        interval=settings.interval, collect_interval=metrics.intervals.pods, dry_run=settings.dry_run,
        node_name=metrics.node_name,
        suppress=SuppressConfig(besteffort_dir=PurePosixPath(settings.besteffort_dir or metrics.besteffort_dir)),
        evict=EvictConfig(collect_interval=metrics.intervals.pods, cpu_cool_down=settings.cpu_evict_cool_down,
                          memory_cool_down=settings.memory_evict_cool_down),
    )
    base = StrategyInit(name="", args={}, key_path=f"{init.key_path}.strategies", config=config,
                        topology=topology.latest().cpus, executor=CgroupExecutor(layout), host=init.host,
                        state_dir=None)
    with _quiet() as lines:
        loaded = load_strategies(settings.strategies, base)
    rules = parse_rules(init.rules)

    def host_why(name: str) -> str:
        return _why([line for line in lines if line.get("strategy") == name]) or "not available on this host"

    strategies = [{"name": s.name, "state": "on" if not (why := s.off_reason(rules)) else "idle",
                   "reason": why and f"{why}; a NodeSLO may turn it on"} for s in loaded.enabled]
    strategies += [{"name": s.name, "state": "off", "reason": "enabled: false in the strategies list "
                    "(its earlier limits are released at start)"} for s in loaded.disabled]
    strategies += [{"name": name, "state": "off", "reason": host_why(name)} for name in loaded.absent]
    psi = init.host.proc / "pressure" / "cpu"
    return {
        "interval": settings.interval, "dry_run": settings.dry_run, "evict_mode": settings.evict_mode,
        # idle_interval: its cadence while no BE pod runs or the BE threshold rule is off.
        "fast_path": {"on": settings.fast_path, "interval": settings.fast_interval,
                      "idle_interval": settings.interval} if settings.fast_path
        else {"on": False},
        "psi_trigger": {"on": settings.psi_trigger and psi.exists(),
                        "reason": "" if psi.exists() or not settings.psi_trigger else f"no {psi}"},
        "strategies": strategies,
        "host": [line for line in lines if not line.get("strategy")],
    }
