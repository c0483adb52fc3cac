"""``tasks.metrics`` and ``tasks.qos-manager``: frozen, validated once at start.

Every key is optional; defaults follow koordlet (node/pod every 1 s, PSI 10 s, CPI
60 s, topology 60 s, retention 12 h, NodeMetric report every 60 s). A bad value is a
``HookConfigError`` naming ``tasks.<name>.<key>`` and the value, so the process exits
2 before it listens, like any other config error.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

from hooks.cgroups import CgroupError, CgroupLayout, Driver
from metrics.analysis.prediction import PredictionSettings
from metrics.collect.advisor import AdvisorSpec, parse_advisors
from metrics.collect.hostapp import HostApp, parse_host_apps
from metrics.collect.registry import CollectorSpec, check_collectors, parse_collectors
from metrics.qos.specs import StrategySpec, check_specs, parse_specs
from metrics.store.tsdb import (
    DEFAULT_COARSE_AFTER,
    DEFAULT_COARSE_STEP,
    DEFAULT_RAW_RETENTION,
    DEFAULT_ROLLUP_STEP,
    tier_problem,
)
from runtimeproxy.config.configvalues import parse_duration, reject_unknown
from runtimeproxy.hookapi import HookConfigError, TaskInit

T = TypeVar("T")

DEFAULT_DB: Final = Path("/var/lib/koord-runtime-proxy/metrics.db")
SchedSource = Literal["auto", "ebpf", "schedstat", "off"]
MemlatSource = Literal["auto", "ebpf", "counters", "off"]
EvictMode = Literal["cri", "api"]


@dataclass(frozen=True, slots=True)
class Intervals:
    node: float = 1.0
    pods: float = 1.0
    psi: float = 10.0
    schedlat: float = 1.0  # the interference analyser's CPU signal: a verdict within 10 s
    cpi: float = 60.0
    topology: float = 60.0
    memlat: float = 10.0
    resctrl: float = 10.0  # koordlet --resctrl-collector-interval


@dataclass(frozen=True, slots=True)
class StoreTiers:
    """The store's tiers (``metrics.store.tsdbrollup``): raw samples for ``raw``, then means
    per ``step``, per ``coarse_step`` once older than ``coarse_after``; all until the
    retention. Shorter ``raw`` or longer steps: a smaller file, coarser percentiles."""

    raw: float = DEFAULT_RAW_RETENTION
    step: float = DEFAULT_ROLLUP_STEP
    coarse_step: float = DEFAULT_COARSE_STEP
    coarse_after: float = DEFAULT_COARSE_AFTER


@dataclass(frozen=True, slots=True)
class KubeletSettings:
    """kubelet ``/pods`` enrichment (priority values); empty url = off."""

    url: str = ""
    token_path: str = ""
    ca_path: str = ""
    insecure: bool = False
    sync_interval: float = 10.0


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    db: Path = DEFAULT_DB
    retention: float = 12 * 3600.0
    max_bytes: int = 100 * 2**20
    gc_interval: float = 300.0
    tiers: StoreTiers = StoreTiers()
    #: Samples reach the file (other readers: ``top``, other processes) this often;
    #: the QoS manager's ``last()`` sees unflushed ones. 2 s: ~0.2 ms/s less than 1 s.
    flush_interval: float = 2.0
    node_name: str = field(default_factory=socket.gethostname)
    cgroup_driver: Driver = "cgroupfs"
    besteffort_dir: str = "kubepods/besteffort"
    intervals: Intervals = Intervals()
    schedlat_source: SchedSource = "auto"
    #: Memory allocation latency (reclaim / compaction stalls, ``metrics.collect.memlat``).
    memlat_source: MemlatSource = "auto"
    cpi: bool = True
    kubelet: KubeletSettings = KubeletSettings()
    #: Connect to the API server (NodeSLO/NodeMetric/Node watch, NodeMetric status).
    kube: bool = False
    kubeconfig: str = ""
    report_interval: float = 60.0
    #: NodeResourceTopology: rebuilt this often, written (create / merge patch) only on
    #: change and at most once per interval (koordlet: --node-topology-sync-interval=3s).
    nrt_interval: float = 3.0
    #: With ``kube: true``: create and patch the NodeResourceTopology (else only served locally).
    nrt_report: bool = True
    kubelet_cpu_manager_state: Path = Path("/var/lib/kubelet/cpu_manager_state")
    kubelet_config: Path = Path("/var/lib/kubelet/config.yaml")
    #: koordlet's peak predictor (``metrics.analysis.prediction``).
    prediction: PredictionSettings = PredictionSettings()
    #: NodeSLO ``hostApplications`` shape; a NodeSLO's list replaces these.
    host_applications: tuple[HostApp, ...] = ()
    #: ``collectors:`` (entry points ``koord_runtime_proxy.collectors``): per-collector
    #: enabled / interval / args; the built-ins' intervals are folded into ``intervals``.
    collectors: tuple[CollectorSpec, ...] = ()
    #: ``advisors:``: external Prometheus endpoints scraped into the store (``metrics.collect.advisor``).
    advisors: tuple[AdvisorSpec, ...] = ()

    @property
    def prediction_checkpoint(self) -> Path:
        """``prediction.checkpoint``, or next to the metrics db."""
        if self.prediction.checkpoint:
            return Path(self.prediction.checkpoint)
        return self.db.with_name(self.db.name + ".prediction.json")


@dataclass(frozen=True, slots=True)
class QoSSettings:
    interval: float = 1.0
    dry_run: bool = False
    fast_path: bool = True
    fast_interval: float = 0.1
    psi_trigger: bool = True
    #: None: ``api`` when the metrics task has a cluster (``kube: true``), else ``cri``
    #: (``metrics.qos.evict``: a CRI stop on a node with a kubelet is not an eviction).
    evict_mode: EvictMode | None = None
    cpu_evict_cool_down: float = 20.0
    memory_evict_cool_down: float = 4.0
    #: None: the metrics task's ``besteffort_dir`` (one setting for the kube-QoS root,
    #: ``metrics.qos.tierroot``); set only where the QoS manager must differ.
    besteffort_dir: str | None = None
    cgroup_driver: Driver = "cgroupfs"
    #: Reserved CPUs for the suppress formula when no Node object says (cores).
    reserved_cpu: float = 0.0
    #: ``strategies:`` in planning order (None: every installed one, metrics.qos.strategy.DEFAULT_ORDER).
    strategies: tuple[StrategySpec, ...] | None = None


class _Args:
    """Typed reads of one task's mapping; every error names the key path and value."""

    def __init__(self, raw: Mapping[str, Any], key_path: str) -> None:
        self.raw = raw
        self.key_path = key_path

    def fail(self, key: str, value: object, message: str) -> HookConfigError:
        return HookConfigError(f"{self.key_path}.{key}", value, message)

    def reject_unknown(self, known: frozenset[str]) -> None:
        reject_unknown(self.raw, known, f"{self.key_path}.")

    def get(self, key: str, default: T, conv: Callable[[object, str], T]) -> T:
        if key not in self.raw or self.raw[key] is None:
            return default
        return conv(self.raw[key], key)

    def duration(self, value: object, key: str) -> float:
        return parse_duration(value, f"{self.key_path}.{key}")

    def boolean(self, value: object, key: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(key, value, "must be true or false")
        return value

    def string(self, value: object, key: str) -> str:
        if not isinstance(value, str):
            raise self.fail(key, value, "must be a string")
        return value

    def positive_int(self, value: object, key: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.fail(key, value, "must be a positive integer")
        return value

    def choice(self, *allowed: str) -> Callable[[object, str], Any]:
        # Any: the caller's field is a Literal of exactly these strings.
        def conv(value: object, key: str) -> Any:
            if value not in allowed:
                raise self.fail(key, value, f"must be one of {', '.join(allowed)}")
            return str(value)

        return conv

    def absolute_path(self, value: object, key: str) -> Path:
        text = self.string(value, key)
        if not text.startswith("/") or "\0" in text:
            raise self.fail(key, value, "must be an absolute path")
        return Path(text)

    def relative_dir(self, value: object, key: str) -> str:
        text = self.string(value, key).strip("/")
        if not text or any(part in ("", ".", "..") for part in text.split("/")):
            raise self.fail(key, value, "must be a cgroup path below the root, without '.' or '..'")
        return text

    def section(self, key: str) -> _Args:
        value = self.raw.get(key) or {}
        if not isinstance(value, Mapping):
            raise self.fail(key, value, "must be a mapping")
        return _Args(value, f"{self.key_path}.{key}")


def _intervals(args: _Args, collectors: tuple[CollectorSpec, ...]) -> Intervals:
    """``intervals:`` (the pre-registry shape, still read) with ``collectors.<name>.interval``
    folded in; setting one collector's interval both ways is refused."""
    base = Intervals()
    args.reject_unknown(frozenset(Intervals.__slots__))
    values = {k: args.get(k, getattr(base, k), args.duration) for k in Intervals.__slots__}
    for spec in collectors:
        if spec.interval is None or spec.name not in values:
            continue
        if args.raw.get(spec.name) is not None:
            raise HookConfigError(f"{spec.key_path}.interval", spec.interval,
                                  f"also set as {args.key_path}.{spec.name}: keep one")
        values[spec.name] = spec.interval
    return Intervals(**values)


#: ``tier_problem``'s setting names -> the keys under ``tiers``.
_TIER_KEYS: Final = {"raw_retention": "raw", "rollup_step": "step", "coarse_step": "coarse_step"}


def _tiers(args: _Args) -> StoreTiers:
    base = StoreTiers()
    args.reject_unknown(frozenset(StoreTiers.__slots__))
    tiers = StoreTiers(**{k: args.get(k, getattr(base, k), args.duration) for k in StoreTiers.__slots__})
    problem = tier_problem(tiers.raw, tiers.step, tiers.coarse_step)
    if problem is not None:
        key = _TIER_KEYS[problem[0]]
        value = args.raw.get(key, f"{getattr(tiers, key):g}s (the default)")
        raise args.fail(key, value, problem[1].replace("rollup_step", "step"))
    return tiers


def _kubelet(args: _Args) -> KubeletSettings:
    base = KubeletSettings()
    args.reject_unknown(frozenset(KubeletSettings.__slots__))
    url = args.get("url", base.url, args.string)
    if url and not url.startswith(("http://", "https://")):
        raise args.fail("url", url, "must start with http:// or https://")
    return KubeletSettings(
        url=url.rstrip("/"),
        token_path=args.get("token_path", base.token_path, args.string),
        ca_path=args.get("ca_path", base.ca_path, args.string),
        insecure=args.get("insecure", base.insecure, args.boolean),
        sync_interval=args.get("sync_interval", base.sync_interval, args.duration),
    )


def _prediction(args: _Args) -> PredictionSettings:
    base = PredictionSettings()
    args.reject_unknown(frozenset(PredictionSettings.__slots__))
    margin = args.raw.get("safety_margin_percent", base.safety_margin_percent)
    if isinstance(margin, bool) or not isinstance(margin, int) or not 0 <= margin <= 100:
        raise args.fail("safety_margin_percent", margin, "must be an integer from 0 to 100")
    settings = PredictionSettings(
        enabled=args.get("enabled", base.enabled, args.boolean),
        training_interval=args.get("training_interval", base.training_interval, args.duration),
        checkpoint_interval=args.get("checkpoint_interval", base.checkpoint_interval, args.duration),
        model_ttl=args.get("model_ttl", base.model_ttl, args.duration),
        cold_start=args.get("cold_start", base.cold_start, args.duration),
        safety_margin_percent=margin,
        checkpoint=args.get("checkpoint", base.checkpoint, args.string),
    )
    if settings.model_ttl <= settings.training_interval:
        raise args.fail("model_ttl", args.raw.get("model_ttl", f"{settings.model_ttl:g}s (the default)"),
                        f"must be longer than training_interval ({settings.training_interval:g}s)")
    return settings


def _host_apps(args: _Args, driver: str) -> tuple[HostApp, ...]:
    raw = args.raw.get("host_applications")
    apps, problems = parse_host_apps(raw, driver, where=f"{args.key_path}.host_applications")
    if problems:
        raise args.fail("host_applications", raw, problems[0])
    return apps


def parse_metrics(raw: Mapping[str, Any], key_path: str) -> MetricsSettings:
    args = _Args(raw, key_path)
    args.reject_unknown(frozenset(MetricsSettings.__slots__))
    base = MetricsSettings()
    driver = args.get("cgroup_driver", base.cgroup_driver, args.choice("cgroupfs", "systemd"))
    source = args.get("schedlat_source", base.schedlat_source, args.choice("auto", "ebpf", "schedstat", "off"))
    collectors = parse_collectors(raw.get("collectors"), f"{key_path}.collectors")
    check_collectors(collectors)
    return MetricsSettings(
        db=Path(args.get("db", str(base.db), args.string)),
        retention=args.get("retention", base.retention, args.duration),
        max_bytes=args.get("max_bytes", base.max_bytes, args.positive_int),
        gc_interval=args.get("gc_interval", base.gc_interval, args.duration),
        tiers=_tiers(args.section("tiers")),
        flush_interval=args.get("flush_interval", base.flush_interval, args.duration),
        node_name=args.get("node_name", base.node_name, args.string) or base.node_name,
        cgroup_driver=driver,
        besteffort_dir=args.get("besteffort_dir", base.besteffort_dir, args.relative_dir),
        intervals=_intervals(args.section("intervals"), collectors),
        schedlat_source=source,
        memlat_source=args.get("memlat_source", base.memlat_source, args.choice("auto", "ebpf", "counters", "off")),
        cpi=args.get("cpi", base.cpi, args.boolean),
        kubelet=_kubelet(args.section("kubelet")),
        kube=args.get("kube", base.kube, args.boolean),
        kubeconfig=args.get("kubeconfig", base.kubeconfig, args.string),
        report_interval=args.get("report_interval", base.report_interval, args.duration),
        nrt_interval=args.get("nrt_interval", base.nrt_interval, args.duration),
        nrt_report=args.get("nrt_report", base.nrt_report, args.boolean),
        kubelet_cpu_manager_state=args.get("kubelet_cpu_manager_state", base.kubelet_cpu_manager_state,
                                           args.absolute_path),
        kubelet_config=args.get("kubelet_config", base.kubelet_config, args.absolute_path),
        prediction=_prediction(args.section("prediction")),
        host_applications=_host_apps(args, driver),
        collectors=collectors,
        advisors=parse_advisors(raw.get("advisors"), f"{key_path}.advisors"),
    )


def parse_qos(raw: Mapping[str, Any], key_path: str) -> QoSSettings:
    args = _Args(raw, key_path)
    args.reject_unknown(frozenset(QoSSettings.__slots__))
    base = QoSSettings()
    fast_interval = args.get("fast_interval", base.fast_interval, args.duration)
    if fast_interval < 0.05:
        raise args.fail("fast_interval", raw.get("fast_interval"), "must be at least 50ms")
    reserved = raw.get("reserved_cpu", base.reserved_cpu)
    if isinstance(reserved, bool) or not isinstance(reserved, int | float) or reserved < 0:
        raise args.fail("reserved_cpu", reserved, "must be a number of cores >= 0")
    return QoSSettings(
        interval=args.get("interval", base.interval, args.duration),
        dry_run=args.get("dry_run", base.dry_run, args.boolean),
        fast_path=args.get("fast_path", base.fast_path, args.boolean),
        fast_interval=fast_interval,
        psi_trigger=args.get("psi_trigger", base.psi_trigger, args.boolean),
        evict_mode=args.get("evict_mode", base.evict_mode, args.choice("cri", "api")) or None,
        cpu_evict_cool_down=args.get("cpu_evict_cool_down", base.cpu_evict_cool_down, args.duration),
        memory_evict_cool_down=args.get("memory_evict_cool_down", base.memory_evict_cool_down, args.duration),
        besteffort_dir=args.get("besteffort_dir", base.besteffort_dir, args.relative_dir) or None,
        cgroup_driver=args.get("cgroup_driver", base.cgroup_driver, args.choice("cgroupfs", "systemd")),
        reserved_cpu=float(reserved),
        strategies=parse_specs(raw.get("strategies"), f"{key_path}.strategies"),
    )


# --- validate entry points -----------------------------------------------------------
# The core calls a task factory's optional ``validate(init)`` (attached in agent.py and
# qostask.py) from ``plugins.validate_tasks``: one check of ``tasks:`` that ``run``,
# ``check-config`` and reload share, without building anything. The metrics task's
# validator provides its settings (``init.provide``); the tasks that need it (their
# ``needs``) read them in ``init.needed``, so cross-task rules (kube for
# evict_mode=api) are checked too, whatever the order under ``tasks:``.

#: The metrics task's name under ``tasks:`` (its entry point), as the tasks built on it
#: name it in ``needs`` and find what it provided in ``init.needed``.
METRICS_TASK: Final = "metrics"


def validate_metrics(init: TaskInit) -> MetricsSettings:
    settings = parse_metrics(init.args, init.key_path)
    init.provide(settings)
    return settings


def validated_metrics(init: TaskInit) -> MetricsSettings:
    """In a validate or plan pass, the metrics task's settings (a task that ``needs`` it)."""
    found = init.needed.get(METRICS_TASK)
    if not isinstance(found, MetricsSettings):
        raise HookConfigError(init.key_path, init.name, f"needs the metrics task: enable tasks.{METRICS_TASK}")
    return found


def validate_qos(init: TaskInit) -> QoSSettings:
    settings = parse_qos(init.args, init.key_path)
    metrics = validated_metrics(init)
    if settings.evict_mode == "api" and not metrics.kube:
        raise HookConfigError(f"{init.key_path}.evict_mode", "api",
                              "needs a cluster connection (tasks.metrics.kube: true)")
    try:
        CgroupLayout(init.host.cgroup, "auto", settings.cgroup_driver)
    except CgroupError as exc:
        raise HookConfigError(f"{init.key_path}.cgroup_driver", settings.cgroup_driver, str(exc)) from exc
    check_specs(settings.strategies)
    return settings
