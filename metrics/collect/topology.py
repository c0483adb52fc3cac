"""CPU topology (cpu -> core, socket, NUMA node) from sysfs, for the KV record
``node_cpu_info`` and for consumers that place work by core or node.

``core_id`` is only unique within a socket, so a core is (socket, core). A host without
``/sys/devices/system/node`` (CONFIG_NUMA off) is one node: every CPU is in node 0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from hooks.cpusets import CpuListError, parse_cpu_list, read_online_cpus
from metrics.collect.base import OnceLog, ReadError, parse_int, read_file
from metrics.model import PodView, Sample
from runtimeproxy.hookapi import HostRoots

log = structlog.get_logger("metrics.topology")

_CPU_DIR: Final = Path("devices/system/cpu")
NODE_DIR: Final = Path("devices/system/node")
_CPU_NAME: Final = re.compile(r"cpu([0-9]+)")
_NODE_NAME: Final = re.compile(r"node([0-9]+)")
_OWNER: Final = "node"


@dataclass(frozen=True, slots=True)
class CPUInfo:
    cpu: int
    core: int
    socket: int
    numa: int


@dataclass(frozen=True, slots=True)
class CPUTopology:
    cpus: tuple[CPUInfo, ...] = ()

    def as_record(self) -> dict[str, object]:
        """The KV_NODE_CPU_INFO record, shaped like koordlet's CPUTopology JSON."""
        return {
            "processorInfos": [{"cpu": c.cpu, "core": c.core, "socket": c.socket, "node": c.numa} for c in self.cpus],
            "totalInfo": {
                "numberCPUs": len(self.cpus),
                "numberCores": len({(c.socket, c.core) for c in self.cpus}),
                "numberSockets": len({c.socket for c in self.cpus}),
                "numberNodes": len({c.numa for c in self.cpus}),
            },
        }


class TopologyCollector:
    """Re-reads the topology each interval (CPUs can be hot-plugged); no samples."""

    name = "topology"

    def __init__(self, host: HostRoots, *, interval: float = 60.0) -> None:
        self.interval = interval
        self._sys = host.sys
        self._once = OnceLog(log)
        self._latest: CPUTopology | None = None

    def latest(self) -> CPUTopology:
        """The last topology read (read now if ``collect`` has not run yet)."""
        if self._latest is None:
            self._refresh()
        return self._latest if self._latest is not None else CPUTopology()

    def as_record(self) -> dict[str, object] | None:
        """The KV_NODE_CPU_INFO record; None while no CPU could be read (do not store it)."""
        topology = self.latest()
        return topology.as_record() if topology.cpus else None

    def close(self) -> None:
        return None

    def collect(self, now: float, pods: Sequence[PodView]) -> list[Sample]:
        self._refresh()
        return []

    def _refresh(self) -> None:
        topology = read_topology(self._sys, self._once)
        if topology.cpus:  # an unreadable sysfs keeps the last good topology
            if self._latest is not None and topology != self._latest:
                log.info("cpu_topology_changed", cpus=len(topology.cpus))
            self._latest = topology


def read_topology(sys_root: Path, once: OnceLog) -> CPUTopology:
    numa = _numa_of(sys_root, once)
    try:
        online: frozenset[int] | None = read_online_cpus(sys_root)
    except CpuListError:
        online = None  # offline CPUs have no topology dir anyway: take what is there
    cpus: list[CPUInfo] = []
    for cpu, directory in _cpu_dirs(sys_root / _CPU_DIR):
        if online is not None and cpu not in online:
            continue
        try:
            core = _read_id(directory / "topology/core_id")
            socket = _read_id(directory / "topology/physical_package_id")
        except ReadError as exc:
            once.skipped(_OWNER, exc)
            continue
        cpus.append(CPUInfo(cpu, core, socket, numa.get(cpu, 0)))
    return CPUTopology(tuple(cpus))


def _read_id(path: Path) -> int:
    return parse_int(read_file(path).strip(), path, path.name)


def _cpu_dirs(base: Path) -> list[tuple[int, Path]]:
    try:
        entries = list(base.iterdir())
    except OSError:
        return []
    found = [(int(m.group(1)), e) for e in entries if (m := _CPU_NAME.fullmatch(e.name))]
    return sorted(found)


def numa_nodes(sys_root: Path, once: OnceLog, owner: str) -> dict[int, frozenset[int]]:
    """NUMA node id -> its CPUs (``node*/cpulist``); {} without NUMA sysfs. A node
    whose list is unreadable or garbled is left out, logged once for ``owner``."""
    try:
        entries = sorted((sys_root / NODE_DIR).iterdir())
    except OSError:
        return {}  # CONFIG_NUMA off
    out: dict[int, frozenset[int]] = {}
    for entry in entries:
        match = _NODE_NAME.fullmatch(entry.name)
        if match is None:
            continue
        path = entry / "cpulist"
        try:
            out[int(match.group(1))] = parse_cpu_list(read_file(path))
        except ReadError as exc:
            once.skipped(owner, exc)
        except CpuListError as exc:
            once.skipped(owner, ReadError(path, str(exc)))
    return out


def _numa_of(sys_root: Path, once: OnceLog) -> dict[int, int]:
    return {cpu: node for node, cpus in numa_nodes(sys_root, once, _OWNER).items() for cpu in cpus}
