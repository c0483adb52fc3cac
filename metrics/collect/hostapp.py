"""Host applications: CPU and memory of the non-pod services a NodeSLO names.

NodeSLO ``spec.hostApplications[]`` (koordinator v1.8):
``{name, priority, qos, cgroupPath: {base, parentDir, relativePath}, strategy}``. The
cgroup dir is koordlet's ``GetHostAppCgroupRelativePath``: ``base`` picks the parent
(``CgroupRoot`` or empty: the hierarchy root; ``Kubepods``, ``KubepodsBurstable``,
``KubepodsBesteffort``: the kubepods tiers under the cgroup driver), then
``parentDir/relativePath`` below it. Every dir is read under the injected host cgroup
root only: a path that would leave it (``..``) is refused with an error naming the
field and the value; an item without a name or a cgroupPath is refused the same way. A
refused item is left out (logged once); the others are measured.

Like the pod collector (koordlet's hostapplication collector): CPU cores from the
usage counter's delta, memory used = anon + unevictable (no page cache). The sums feed
the system usage (``node - pods - host applications``, see ``metrics.collect.be``).
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import structlog

from metrics.collect.base import OnceLog, ReadError
from metrics.collect.cgroupfs import CgroupReader, Clock, read_memory
from metrics.model import (
    HOST_APP_CPU_USAGE,
    HOST_APP_MEMORY_USED,
    HOST_APP_NAME,
    PRIORITY_CLASS,
    QOS,
    Labels,
    PodView,
    Sample,
    labels,
)
from runtimeproxy.errors import InputError
from runtimeproxy.hookapi import HostRoots

log = structlog.get_logger("metrics.hostapp")

#: ``cgroupPath.base`` -> the parent dir, per cgroup driver.
BASES: Final[Mapping[str, Mapping[str, str]]] = {
    "cgroupfs": {"": "", "CgroupRoot": "", "Kubepods": "kubepods", "KubepodsBurstable": "kubepods/burstable",
                 "KubepodsBesteffort": "kubepods/besteffort"},
    "systemd": {"": "", "CgroupRoot": "", "Kubepods": "kubepods.slice",
                "KubepodsBurstable": "kubepods.slice/kubepods-burstable.slice",
                "KubepodsBesteffort": "kubepods.slice/kubepods-besteffort.slice"},
}


class HostAppError(InputError, ValueError):
    """A ``hostApplications`` item is invalid; the message names the field and the value."""


@dataclass(frozen=True, slots=True)
class HostApp:
    name: str
    priority: str
    qos: str
    #: cgroup dir relative to a hierarchy root ("" = the root itself).
    cgroup_dir: str

    @property
    def labels(self) -> Labels:
        return labels(**{HOST_APP_NAME: self.name, PRIORITY_CLASS: self.priority, QOS: self.qos})


def _text(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise HostAppError(f"{where}.{key}: must be a string (got {value!r})")
    return value


def _relative(value: str, where: str) -> str:
    """``value`` as a path below its parent: leading/trailing "/" dropped, no ``.`` / ``..``."""
    parts = [p for p in value.split("/") if p]
    if any(p in (".", "..") for p in parts) or "\0" in value:
        raise HostAppError(f"{where}: escapes the cgroup root (got {value!r})")
    return "/".join(parts)


def parse_host_app(raw: object, where: str, driver: str = "cgroupfs") -> HostApp:
    """One ``hostApplications`` item; HostAppError naming ``where.<field>`` and the value."""
    if not isinstance(raw, Mapping):
        raise HostAppError(f"{where}: must be a mapping (got {raw!r})")
    name = _text(raw, "name", where)
    if not name:
        raise HostAppError(f"{where}.name: required (got {raw.get('name')!r})")
    path = raw.get("cgroupPath")
    if not isinstance(path, Mapping):
        raise HostAppError(f"{where}.cgroupPath: required, a mapping of base, parentDir, relativePath (got {path!r})")
    base = _text(path, "base", f"{where}.cgroupPath")
    bases = BASES[driver]
    if base not in bases:
        known = ", ".join(b for b in bases if b)
        raise HostAppError(f"{where}.cgroupPath.base: unknown (got {base!r}; one of {known})")
    parent = _relative(_text(path, "parentDir", f"{where}.cgroupPath"), f"{where}.cgroupPath.parentDir")
    relative = _relative(_text(path, "relativePath", f"{where}.cgroupPath"), f"{where}.cgroupPath.relativePath")
    cgroup_dir = posixpath.join(bases[base], parent, relative).strip("/")
    if not cgroup_dir:
        raise HostAppError(f"{where}.cgroupPath: names the cgroup root itself (got {dict(path)!r})")
    return HostApp(name, _text(raw, "priority", where), _text(raw, "qos", where), cgroup_dir)


def parse_host_apps(raw: object, driver: str = "cgroupfs",
                    where: str = "hostApplications") -> tuple[tuple[HostApp, ...], list[str]]:
    """Every valid item and one message per refused one (a duplicate name is refused)."""
    if raw is None:
        return (), []
    if not isinstance(raw, list):
        return (), [f"{where}: must be a list (got {raw!r})"]
    apps: list[HostApp] = []
    problems: list[str] = []
    for i, item in enumerate(raw):
        try:
            app = parse_host_app(item, f"{where}[{i}]", driver)
        except HostAppError as exc:
            problems.append(str(exc))
            continue
        if any(a.name == app.name for a in apps):
            problems.append(f"{where}[{i}].name: duplicate (got {app.name!r})")
            continue
        apps.append(app)
    return tuple(apps), problems


@dataclass(frozen=True, slots=True)
class HostAppUsage:
    cpu: Mapping[str, float]
    memory: Mapping[str, float]


class HostAppCollector:
    """Per host application: CPU cores and memory used, labelled by name, priority and QoS."""

    name = "hostapps"

    def __init__(self, host: HostRoots, *, interval: float = 1.0, clock: Clock = time.monotonic) -> None:
        self.interval = interval
        self.reader = CgroupReader(host.cgroup)
        self._clock = clock
        self._apps: tuple[HostApp, ...] = ()
        self._prev: dict[HostApp, tuple[int, float]] = {}
        self._latest = HostAppUsage({}, {})
        self._once = OnceLog(log)

    def set_apps(self, apps: Sequence[HostApp]) -> None:
        """Replace the applications (from any thread: one assignment)."""
        self._apps = tuple(apps)

    @property
    def apps(self) -> tuple[HostApp, ...]:
        return self._apps

    def latest(self) -> HostAppUsage:
        return self._latest

    def close(self) -> None:
        self._prev.clear()

    def collect(self, now: float, pods: Sequence[PodView]) -> list[Sample]:
        apps = self._apps
        if len(self._prev) > len(apps) or not set(self._prev) <= set(apps):
            self._prev = {a: v for a, v in self._prev.items() if a in apps}
        self._once.keep_owners({a.name for a in apps})
        out: list[Sample] = []
        cpu: dict[str, float] = {}
        memory: dict[str, float] = {}
        for app in apps:
            lbl = app.labels
            cores = self._cpu(app)
            if cores is not None:
                cpu[app.name] = cores
                out.append(Sample(HOST_APP_CPU_USAGE, cores, lbl))
            try:
                used = read_memory(self.reader.memory_dir(app.cgroup_dir), self.reader.version).used
            except ReadError as exc:
                self._once.skipped(app.name, exc)
            else:
                memory[app.name] = float(used)
                out.append(Sample(HOST_APP_MEMORY_USED, float(used), lbl))
        self._latest = HostAppUsage(cpu, memory)
        return out

    def _cpu(self, app: HostApp) -> float | None:
        before = self._clock()
        try:
            usage = self.reader.cpu_usage_ns(app.cgroup_dir)
        except ReadError as exc:
            self._prev.pop(app, None)
            self._once.skipped(app.name, exc)
            return None
        at = (before + self._clock()) / 2
        prev, self._prev[app] = self._prev.get(app), (usage, at)
        if prev is None or usage < prev[0] or at <= prev[1]:
            return None
        return (usage - prev[0]) / 1e9 / (at - prev[1])
