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

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from metrics.collect.base import OnceLog, ReadError, container_labels, pod_labels
from metrics.collect.cgroupfs import CgroupReader
from metrics.collect.openfiles import OpenFiles
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


def parse_pressure(text: str | bytes, path: Path | str) -> dict[str, Pressure]:
    """kind ("some"/"full") -> Pressure; a missing ``full`` line is simply absent."""
    data = text.encode("ascii", "replace") if isinstance(text, str) else text
    return {kind.decode(): Pressure(*values) for kind, values in _parse(data, str(path))}


_Values = tuple[float, float, float, int]  # avg10, avg60, avg300, total_us


_LINE: Final = rb"avg10=(\d+\.\d+) avg60=(\d+\.\d+) avg300=(\d+\.\d+) total=(\d+)\n"
#: The file as the kernel prints it: a ``some`` line, then a ``full`` line or none.
_KERNEL_FORMAT: Final = re.compile(rb"some " + _LINE + rb"(?:full " + _LINE + rb")?")


def _parse(data: bytes, path: str) -> list[tuple[bytes, _Values]]:
    """The lines of a pressure file as (kind, values). The kernel's format is matched
    in one C call (1.5 against 2.0 µs for the per-line parse, 660 files every 10 s at
    110 pods); anything else goes to ``_parse_lines``, which decides by name."""
    found = _KERNEL_FORMAT.fullmatch(data)
    if found is None:
        return _parse_lines(data, path)
    some = (float(found[1]), float(found[2]), float(found[3]), int(found[4]))
    if found[5] is None:
        return [(b"some", some)]
    return [(b"some", some), (b"full", (float(found[5]), float(found[6]), float(found[7]), int(found[8])))]


def _parse_lines(data: bytes, path: str) -> list[tuple[bytes, _Values]]:
    """The lines of a pressure file as (kind, values), each value found by its name."""
    out: dict[bytes, _Values] = {}
    for line in data.splitlines():
        f = line.split()
        if not f:
            continue
        kind = f[0]
        if kind != b"some" and kind != b"full":
            raise ReadError(Path(path), f"unknown line {line.decode('ascii', 'replace')[:40]!r}")
        try:
            values = dict(x.partition(b"=")[::2] for x in f[1:])
            out[kind] = (float(values[b"avg10"]), float(values[b"avg60"]), float(values[b"avg300"]),
                         int(values[b"total"]))
        except (KeyError, ValueError):
            text = line.decode("ascii", "replace")
            raise ReadError(Path(path), f"malformed {kind.decode()} line {text[:60]!r}") from None
    if b"some" not in out:
        raise ReadError(Path(path), "no 'some' line")
    return list(out.items())


@dataclass(frozen=True, slots=True)
class _Names:
    percent: str
    total: str


_NODE: Final = _Names(NODE_PSI, NODE_PSI_TOTAL)
_POD: Final = _Names(POD_PSI, POD_PSI_TOTAL)
_CONTAINER: Final = _Names(CONTAINER_PSI, CONTAINER_PSI_TOTAL)


_SeriesLabels = tuple[Labels, Labels, Labels, Labels]  # avg10, avg60, avg300 (percent); total


@dataclass(frozen=True, slots=True)
class _File:
    """One pressure file and the label tuples of its series, built once."""

    owner: str
    path: str
    names: _Names
    kinds: Mapping[bytes, _SeriesLabels]  # b"some" / b"full" -> labels


#: The (name, value) pairs every pressure series shares, made once: a file's 8 label
#: tuples hold these and its owner's pairs instead of copies (at 250 pods the PSI
#: labels were most of the collectors' memory growth per pod, 3 of 10 MiB, in copies of pairs).
_KIND_PAIRS: Final = {kind: (KIND, kind) for kind in _KINDS}
_RESOURCE_PAIRS: Final = {r: (RESOURCE, r) for r in RESOURCES}
_WINDOW_PAIRS: Final = tuple((WINDOW, w) for w in WINDOWS)


def _merged(base: Labels, *pairs: tuple[str, str]) -> Labels:
    """``base`` with ``pairs`` set (a pair wins over the base's of the same name), as
    ``labels`` sorts them, built of the very pair objects given."""
    named = {pair[0]: pair for pair in (*base, *pairs)}
    return tuple(named[name] for name in sorted(named))


def _file(owner: str, path: str, resource: str, names: _Names, base: Labels, *, skip_full: bool = False) -> _File:
    kinds: dict[bytes, _SeriesLabels] = {}
    for kind in _KINDS:
        if skip_full and kind == "full":
            continue
        common = (_KIND_PAIRS[kind], _RESOURCE_PAIRS[resource])
        windows = [_merged(base, *common, w) for w in _WINDOW_PAIRS]
        kinds[kind.encode()] = (windows[0], windows[1], windows[2], _merged(base, *common))
    return _File(owner, path, names, kinds)


class PSICollector:
    """PSI averages and stall totals from /proc/pressure and v2 (or hybrid unified) cgroups.

    The files of each pod / container and their label tuples are built once (cached by
    pod, container and cgroup dir); the files stay open and are re-read with one pread
    (``OpenFiles``): opening a cgroupfs path costs more than generating its two lines."""

    name = "psi"

    def __init__(self, host: HostRoots, *, interval: float = 10.0) -> None:
        self.interval = interval
        self._proc = host.proc
        self.reader = CgroupReader(host.cgroup)
        self._once = OnceLog(log)
        if self.reader.unified_dir("") is None:
            log.info("cgroup_psi_unavailable", reason="no cgroup v2 tree (pure v1 host): node PSI only")
        self._node = [_file("node", str(self._proc / "pressure" / r), r, _NODE, NO_LABELS, skip_full=r == "cpu")
                      for r in RESOURCES]
        self._files: dict[tuple[str, str, str], list[_File]] = {}
        self._open = OpenFiles()

    def close(self) -> None:
        self._files.clear()
        self._open.close()

    def collect(self, now: float, pods: Sequence[PodView]) -> list[Sample]:
        self._once.keep_owners(["node", *(p.uid for p in pods)])
        out: list[Sample] = []
        for f in self._node:
            self._read(f, out)
        for f in self._resolve(pods):
            self._read(f, out)
        return out

    def _resolve(self, pods: Sequence[PodView]) -> list[_File]:
        cache = self._files
        fresh: dict[tuple[str, str, str], list[_File]] = {}
        out: list[_File] = []
        for pod in pods:
            key = (pod.uid, "", pod.cgroup_dir)
            files = cache.get(key)
            if files is None:
                files = self._cgroup_files(pod.uid, pod.cgroup_dir, _POD, pod_labels(pod))
            fresh[key] = files
            out += files
            for c in pod.containers:
                key = (pod.uid, c.id, c.cgroup_dir)
                files = cache.get(key)
                if files is None:
                    files = self._cgroup_files(pod.uid, c.cgroup_dir, _CONTAINER, container_labels(pod, c))
                fresh[key] = files
                out += files
        if fresh.keys() != cache.keys():
            self._open.retain([f.path for f in self._node] + [f.path for f in out])
        self._files = fresh
        return out

    def _cgroup_files(self, owner: str, rel: str, names: _Names, base: Labels) -> list[_File]:
        directory = self.reader.pressure_dir(rel)
        if directory is None:
            return []
        return [_file(owner, f"{directory}/{r}.pressure", r, names, base) for r in RESOURCES]

    def _read(self, f: _File, out: list[Sample]) -> None:
        try:
            parsed = _parse(self._open.read(f.path), f.path)
        except ReadError as exc:
            self._once.skipped(f.owner, exc)
            return
        percent, total = f.names.percent, f.names.total
        append = out.append
        # Samples made as the tuples they are: the NamedTuple's ``__new__`` is a Python
        # function (0.22 against 0.09 µs, for some 5300 samples a tick at 110 pods).
        new = tuple.__new__
        for kind, (avg10, avg60, avg300, total_us) in parsed:
            series = f.kinds.get(kind)
            if series is None:
                continue  # node cpu "full"
            append(new(Sample, (percent, avg10, series[0], 0.0)))
            append(new(Sample, (percent, avg60, series[1], 0.0)))
            append(new(Sample, (percent, avg300, series[2], 0.0)))
            append(new(Sample, (total, total_us / 1e6, series[3], 0.0)))
