"""``tasks.metrics`` and ``tasks.qos-manager``: frozen, validated once at start.

Each metrics subpackage parses its own part (``metrics.store.settings``: ``tiers``;
``metrics.informer.settings``: ``kubelet``; ``metrics.collect.settings``: ``intervals``,
``host_applications``, with ``metrics.collect.registry`` / ``.advisor``: ``collectors``,
``advisors``; ``metrics.analysis.prediction``: ``prediction``; ``metrics.qos.settings``:
all of ``tasks.qos-manager``) with the one toolkit, ``runtimeproxy.config.configvalues``.
This module composes them into the metrics task's settings, and holds the validate entry
points and the cross-task rules.

Every key is optional; defaults follow koordlet (node/pod every 1 s, PSI 10 s, CPI
60 s, topology 60 s, retention 12 h, NodeMetric report every 60 s). A bad value is a
``HookConfigError`` naming ``tasks.<name>.<key>`` and the value, so the process exits
2 before it listens, like any other config error.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from hooks.cgroups import CgroupError, CgroupLayout, Driver
from metrics.analysis.prediction import PredictionSettings, parse_prediction
from metrics.collect.advisor import AdvisorSpec, parse_advisors
from metrics.collect.hostapp import HostApp
from metrics.collect.registry import CollectorSpec, check_collectors, parse_collectors
from metrics.collect.settings import (
    MEMLAT_SOURCES,
    SCHED_SOURCES,
    Intervals,
    MemlatSource,
    SchedSource,
    parse_host_applications,
    parse_intervals,
)
from metrics.informer.settings import KubeletSettings, parse_kubelet
from metrics.qos.settings import QoSSettings, parse_qos
from metrics.qos.specs import check_specs
from metrics.qos.tierroot import besteffort_dir
from metrics.store.settings import StoreTiers, parse_tiers
from runtimeproxy.config.configvalues import (
    Section,
    absolute_path,
    boolean,
    choice,
    parse_duration,
    positive_int,
    string,
)
from runtimeproxy.hookapi import HookConfigError, TaskInit

DEFAULT_DB: Final = Path("/var/lib/koord-runtime-proxy/metrics.db")


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


def parse_metrics(raw: Mapping[str, Any], key_path: str) -> MetricsSettings:
    """The store, agent and reporting keys read here; every section by its subpackage."""
    args = Section(raw, key_path)
    args.reject_unknown(frozenset(MetricsSettings.__slots__))
    base = MetricsSettings()
    driver = args.get("cgroup_driver", base.cgroup_driver, choice("cgroupfs", "systemd"))
    collectors = parse_collectors(raw.get("collectors"), args.path("collectors"))
    check_collectors(collectors)
    return MetricsSettings(
        db=Path(args.get("db", str(base.db), string)),
        retention=args.get("retention", base.retention, parse_duration),
        max_bytes=args.get("max_bytes", base.max_bytes, functools.partial(positive_int, minimum=1)),
        gc_interval=args.get("gc_interval", base.gc_interval, parse_duration),
        tiers=parse_tiers(raw.get("tiers"), args.path("tiers")),
        flush_interval=args.get("flush_interval", base.flush_interval, parse_duration),
        node_name=args.get("node_name", base.node_name, string) or base.node_name,
        cgroup_driver=driver,
        besteffort_dir=args.get("besteffort_dir", base.besteffort_dir, besteffort_dir),
        intervals=parse_intervals(raw.get("intervals"), args.path("intervals"), collectors),
        schedlat_source=args.get("schedlat_source", base.schedlat_source, choice(*SCHED_SOURCES)),
        memlat_source=args.get("memlat_source", base.memlat_source, choice(*MEMLAT_SOURCES)),
        cpi=args.get("cpi", base.cpi, boolean),
        kubelet=parse_kubelet(raw.get("kubelet"), args.path("kubelet")),
        kube=args.get("kube", base.kube, boolean),
        kubeconfig=args.get("kubeconfig", base.kubeconfig, string),
        report_interval=args.get("report_interval", base.report_interval, parse_duration),
        nrt_interval=args.get("nrt_interval", base.nrt_interval, parse_duration),
        nrt_report=args.get("nrt_report", base.nrt_report, boolean),
        kubelet_cpu_manager_state=args.get("kubelet_cpu_manager_state", base.kubelet_cpu_manager_state,
                                           absolute_path),
        kubelet_config=args.get("kubelet_config", base.kubelet_config, absolute_path),
        prediction=parse_prediction(raw.get("prediction"), args.path("prediction")),
        host_applications=parse_host_applications(raw.get("host_applications"), args.path("host_applications"),
                                                  driver),
        collectors=collectors,
        advisors=parse_advisors(raw.get("advisors"), args.path("advisors")),
    )


# --- validate entry points -----------------------------------------------------------
# The core calls a task factory's optional ``validate(init)`` (attached in agent.py and
# qos/task.py) from ``plugins.validate_tasks``: one check of ``tasks:`` that ``run``,
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
