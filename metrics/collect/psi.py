"""Pressure stall information (PSI) of the node, pods and containers.

``/proc/pressure/<res>`` and a v2 cgroup's ``<res>.pressure`` hold two lines::

    some avg10=1.23 avg60=0.50 avg300=0.10 total=123456
    full avg10=0.00 avg60=0.00 avg300=0.00 total=0

Kernels before 5.13 have no ``full`` line for cpu, and at node level cpu ``full`` is
undefined (the kernel prints zeros), so node cpu reports ``some`` only rather than
series that look like "no stall". Cgroup cpu ``full`` is meaningful and is reported.
Averages are percentages; ``total`` is microseconds, reported as seconds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from metrics.collect.base import OnceLog, ReadError, container_labels, pod_labels, read_file
from metrics.collect.cgroupfs import CgroupReader
from metrics.model import (
    CONTAINER_PSI,
    CONTAINER_PSI_TOTAL,
    KIND,
    NO_LABELS,
    NODE_PSI,
    NODE_PSI_TOTAL,
    POD_PSI,
    POD_PSI_TOTAL,
    RESOURCE,
    WINDOW,
    Labels,
    PodView,
    Sample,
    labels,
)
from runtimeproxy.hookapi import HostRoots

log = structlog.get_logger("metrics.psi")

RESOURCES: Final = ("cpu", "memory", "io")
WINDOWS: Final = ("avg10", "avg60", "avg300")
_KINDS: Final = ("some", "full")


@dataclass(frozen=True, slots=True)
class Pressure:
    """One line of a pressure file."""

    avg10: float
    avg60: float
    avg300: float
    total_us: int


def parse_pressure(text: str, path: Path) -> dict[str, Pressure]:
    """kind ("some"/"full") -> Pressure; a missing ``full`` line is simply absent."""
    out: dict[str, Pressure] = {}
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        kind = fields[0]
        if kind not in _KINDS:
            raise ReadError(path, f"unknown line {line[:40]!r}")
        values = dict(f.partition("=")[::2] for f in fields[1:])
        try:
            out[kind] = Pressure(float(values["avg10"]), float(values["avg60"]), float(values["avg300"]),
                                 int(values["total"]))
        except (KeyError, ValueError):
            raise ReadError(path, f"malformed {kind} line {line[:60]!r}") from None
    if "some" not in out:
        raise ReadError(path, "no 'some' line")
    return out


@dataclass(frozen=True, slots=True)
class _Names:
    percent: str
    total: str


_NODE: Final = _Names(NODE_PSI, NODE_PSI_TOTAL)
_POD: Final = _Names(POD_PSI, POD_PSI_TOTAL)
_CONTAINER: Final = _Names(CONTAINER_PSI, CONTAINER_PSI_TOTAL)


def pressure_samples(
    resource: str, kinds: Mapping[str, Pressure], names: _Names, base: Labels, *, skip_full: bool = False
) -> list[Sample]:
    out: list[Sample] = []
    for kind, p in kinds.items():
        if skip_full and kind == "full":
            continue
        kind_labels = {**dict(base), KIND: kind, RESOURCE: resource}
        for window, value in zip(WINDOWS, (p.avg10, p.avg60, p.avg300), strict=True):
            out.append(Sample(names.percent, value, labels(**kind_labels, **{WINDOW: window})))
        out.append(Sample(names.total, p.total_us / 1e6, labels(**kind_labels)))
    return out


class PSICollector:
    """PSI averages and stall totals from /proc/pressure and v2 (or hybrid unified) cgroups."""

    name = "psi"

    def __init__(self, host: HostRoots, *, interval: float = 10.0) -> None:
        self.interval = interval
        self._proc = host.proc
        self.reader = CgroupReader(host.cgroup)
        self._once = OnceLog(log)
        if self.reader.unified_dir("") is None:
            log.info("cgroup_psi_unavailable", reason="no cgroup v2 tree (pure v1 host): node PSI only")

    def close(self) -> None:
        return None

    def collect(self, now: float, pods: Sequence[PodView]) -> list[Sample]:
        self._once.keep_owners(["node", *(p.uid for p in pods)])
        out: list[Sample] = []
        for resource in RESOURCES:
            kinds = self._read("node", self._proc / "pressure" / resource)
            if kinds is not None:
                out += pressure_samples(resource, kinds, _NODE, NO_LABELS, skip_full=resource == "cpu")
        for pod in pods:
            out += self._cgroup(pod.uid, pod.cgroup_dir, _POD, pod_labels(pod))
            for c in pod.containers:
                out += self._cgroup(pod.uid, c.cgroup_dir, _CONTAINER, container_labels(pod, c))
        return out

    def _cgroup(self, owner: str, rel: str, names: _Names, base: Labels) -> list[Sample]:
        directory = self.reader.pressure_dir(rel)
        if directory is None:
            return []
        out: list[Sample] = []
        for resource in RESOURCES:
            kinds = self._read(owner, directory / f"{resource}.pressure")
            if kinds is not None:
                out += pressure_samples(resource, kinds, names, base)
        return out

    def _read(self, owner: str, path: Path) -> dict[str, Pressure] | None:
        try:
            return parse_pressure(read_file(path), path)
        except ReadError as exc:
            self._once.skipped(owner, exc)
            return None
