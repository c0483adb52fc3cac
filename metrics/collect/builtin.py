"""The built-in collectors as registry plugins (entry points in setup.cfg).

Phases put the readings the derived series combine in order within one tick: the
node (10) before host applications (20) before pods (30), whose tick then computes
system usage and the best-effort aggregate. The others only add series (50+).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metrics.collect.base import Collector
from metrics.collect.cgroupfs import PodCollector
from metrics.collect.cpi import CPICollector
from metrics.collect.hostapp import HostAppCollector
from metrics.collect.memlat import MemLatencyCollector
from metrics.collect.procfs import NodeCollector
from metrics.collect.psi import PSICollector
from metrics.collect.registry import CollectorInit, CollectorPlugin
from metrics.collect.resctrlmon import ResctrlMonitorCollector
from metrics.collect.schedlat import SchedLatencyCollector
from metrics.collect.topology import TopologyCollector
from runtimeproxy.hookapi import HookConfigError

_DERIVED = "the agent's derived series (system usage, BE aggregate), NodeMetric and the QoS manager read it"


def no_args(args: Mapping[str, Any], key_path: str) -> None:
    if args:
        key = sorted(args)[0]
        raise HookConfigError(f"{key_path}.{key}", args[key], "this collector takes no args")


def _no_args(init: CollectorInit) -> None:
    no_args(init.args, init.key_path)


def _node(init: CollectorInit) -> Collector:
    _no_args(init)
    return NodeCollector(init.host, interval=init.interval)


def _hostapps(init: CollectorInit) -> Collector:
    _no_args(init)
    collector = HostAppCollector(init.host, interval=init.interval)
    collector.set_apps(init.settings.host_applications)
    return collector


def _pods(init: CollectorInit) -> Collector:
    _no_args(init)
    return PodCollector(init.host, interval=init.interval)


def _topology(init: CollectorInit) -> Collector:
    _no_args(init)
    return TopologyCollector(init.host, interval=init.interval)


def _psi(init: CollectorInit) -> Collector:
    _no_args(init)
    return PSICollector(init.host, interval=init.interval)


def _schedlat(init: CollectorInit) -> Collector | None:
    _no_args(init)
    if init.settings.schedlat_source == "off":
        return None
    return SchedLatencyCollector(init.host, prefer=init.settings.schedlat_source, interval=init.interval)


def _cpi(init: CollectorInit) -> Collector | None:
    _no_args(init)
    if not init.settings.cpi:
        return None
    return CPICollector(init.host, interval=init.interval)


node = CollectorPlugin(_node, check=no_args, phase=10, interval=1.0, required=_DERIVED, legacy_interval="node")
hostapps = CollectorPlugin(_hostapps, check=no_args, phase=20, interval=1.0, legacy_interval="pods",
                           required="system usage subtracts host applications (NodeSLO hostApplications)")
pods = CollectorPlugin(_pods, check=no_args, phase=30, interval=1.0, required=_DERIVED, legacy_interval="pods")
topology = CollectorPlugin(_topology, check=no_args, phase=40, interval=60.0, legacy_interval="topology",
                           required="NodeResourceTopology and the node's CPU info record read it")
psi = CollectorPlugin(_psi, check=no_args, phase=50, interval=10.0, legacy_interval="psi")
schedlat = CollectorPlugin(_schedlat, check=no_args, phase=60, interval=10.0, legacy_interval="schedlat")
cpi = CollectorPlugin(_cpi, check=no_args, phase=70, interval=60.0, legacy_interval="cpi")


def _memlat(init: CollectorInit) -> Collector | None:
    _no_args(init)
    if init.settings.memlat_source == "off":
        return None
    return MemLatencyCollector(init.host, prefer=init.settings.memlat_source, interval=init.interval)


def _resctrl_monitor(init: CollectorInit) -> Collector | None:
    _no_args(init)
    collector = ResctrlMonitorCollector(init.host.resctrl, interval=init.interval)  # absent: one log line
    return collector if collector.available else None


memlat = CollectorPlugin(_memlat, check=no_args, phase=80, interval=10.0, legacy_interval="memlat")
resctrl_monitor = CollectorPlugin(_resctrl_monitor, check=no_args, phase=90, interval=10.0, legacy_interval="resctrl")
