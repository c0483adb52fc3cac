"""The QoS manager's own settings (from ``tasks.qos-manager``), shared by the
manager and the strategies it builds."""

from __future__ import annotations

from dataclasses import dataclass

from metrics.qos.evict import EvictConfig
from metrics.qos.suppress import SuppressConfig


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    #: Seconds between rounds (koordlet: 1 s for every strategy).
    interval: float = 1.0
    #: The collectors' interval: samples older than twice this are stale.
    collect_interval: float = 1.0
    dry_run: bool = False
    node_name: str = ""
    #: Node CPU capacity in cores (default: the number of logical CPUs in the topology).
    capacity_cores: float | None = None
    #: max(kubelet reserved, ``node.koordinator.sh/reservation``), in cores.
    reserved_cores: float = 0.0
    #: A cgroup write found in place (or made) is not checked again for this many seconds
    #: while the plans ask for the same value (koordlet's executor cache and its
    #: ``cgroup-force-update-seconds``, 60): a round at 110 pods re-read ~200 files only
    #: to find them unchanged. 0: check every round.
    verified_for: float = 60.0
    suppress: SuppressConfig = SuppressConfig()
    evict: EvictConfig = EvictConfig()
