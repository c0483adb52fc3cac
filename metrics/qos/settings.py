"""``tasks.qos-manager``: the QoS manager's own settings, parsed by its package.

The cross-task rules (``evict_mode: api`` needs ``tasks.metrics.kube``) are checked by
``metrics.settings.validate_qos``, which composes this parser with the metrics task's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hooks.cgroups import Driver
from metrics.qos.specs import StrategySpec, parse_specs
from metrics.qos.tierroot import besteffort_dir
from runtimeproxy.config.configvalues import Section, boolean, choice, parse_duration

EvictMode = Literal["cri", "api"]


@dataclass(frozen=True, slots=True)
class QoSSettings:
    interval: float = 1.0
    dry_run: bool = False
    fast_path: bool = True
    fast_interval: float = 0.08
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


def parse_qos(raw: Mapping[str, Any], key_path: str) -> QoSSettings:
    args = Section(raw, key_path)
    args.reject_unknown(frozenset(QoSSettings.__slots__))
    base = QoSSettings()
    fast_interval = args.get("fast_interval", base.fast_interval, parse_duration)
    if fast_interval < 0.05:
        raise args.fail("fast_interval", raw.get("fast_interval"), "must be at least 50ms")
    reserved = raw.get("reserved_cpu", base.reserved_cpu)
    if isinstance(reserved, bool) or not isinstance(reserved, int | float) or reserved < 0:
        raise args.fail("reserved_cpu", reserved, "must be a number of cores >= 0")
    return QoSSettings(
        interval=args.get("interval", base.interval, parse_duration),
        dry_run=args.get("dry_run", base.dry_run, boolean),
        fast_path=args.get("fast_path", base.fast_path, boolean),
        fast_interval=fast_interval,
        psi_trigger=args.get("psi_trigger", base.psi_trigger, boolean),
        evict_mode=args.get("evict_mode", base.evict_mode, choice("cri", "api")) or None,
        cpu_evict_cool_down=args.get("cpu_evict_cool_down", base.cpu_evict_cool_down, parse_duration),
        memory_evict_cool_down=args.get("memory_evict_cool_down", base.memory_evict_cool_down, parse_duration),
        besteffort_dir=args.get("besteffort_dir", base.besteffort_dir, besteffort_dir) or None,
        cgroup_driver=args.get("cgroup_driver", base.cgroup_driver, choice("cgroupfs", "systemd")),
        reserved_cpu=float(reserved),
        strategies=parse_specs(raw.get("strategies"), f"{key_path}.strategies"),
    )
