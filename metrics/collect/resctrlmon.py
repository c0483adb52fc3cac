"""resctrl monitoring (Intel RDT CMT/MBM, AMD QoS): LLC occupancy and memory bandwidth
per class group and per pod group (koordlet's ``ResctrlCollector``, reference §5).

Every resctrl group with monitoring has ``mon_data/mon_L3_<cache id>/``, holding the
group's ``llc_occupancy`` (bytes of L3 it occupies now) and the byte counters
``mbm_total_bytes`` / ``mbm_local_bytes`` (traffic between L3 and all / local memory,
since the group was created). Read here:

* the class groups ``LSR``, ``LS``, ``BE`` under the resctrl root (the ``resctrl`` hook's
  and strategy's names, koordlet's ``ResctrlReconcile``): label ``qos``;
* per pod, ``koordlet-<pod uid>`` (the ``resctrl`` hook's pod groups, at the root) or a
  monitoring group of that name under a class group's ``mon_groups/``: label ``pod_uid``.

Bandwidth is a rate: the counter's increase over the time since the previous read,
in bytes/s (first read of a group, a counter that went backwards (group re-created,
wrap) or the value ``Unavailable``: no sample that tick). The counters are stored too.
**Ours:** koordlet's ``koordlet_resctrl_memory_bandwidth`` gauge holds the raw counter;
ours is the rate (the raw counter is ``koord_runtime_proxy_resctrl_memory_bandwidth_bytes_total``),
and koordlet reads the class groups only.

Only reads. Without resctrl monitoring under the injected root (no mount, or no
``info/L3_MON``: VMs, this project's CI host) the collector says so in one log line
(``resctrl_monitor_unavailable``) and produces nothing, ever.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

import structlog

from metrics.collect.base import OnceLog, ReadError, parse_int, read_file
from metrics.model import (
    CACHE_ID,
    MB_TYPE,
    POD_RESCTRL_LLC,
    POD_RESCTRL_MB,
    POD_RESCTRL_MB_TOTAL,
    POD_UID,
    QOS,
    RESCTRL_LLC,
    RESCTRL_MB,
    RESCTRL_MB_TOTAL,
    Labels,
    PodView,
    Sample,
    labels,
)

log = structlog.get_logger("metrics.resctrlmon")

CLASS_GROUPS: Final = ("LSR", "LS", "BE")
POD_GROUP_PREFIX: Final = "koordlet-"
LLC_FILE: Final = "llc_occupancy"
MB_FILES: Final = ("mbm_total_bytes", "mbm_local_bytes")
_DOMAIN: Final = "mon_L3_"


def domains(group: Path) -> Iterator[tuple[str, Path]]:
    """(cache id, directory) of each ``mon_data/mon_L3_<id>`` of a group, by id."""
    try:
        names = os.listdir(group / "mon_data")
    except OSError:
        return
    found = []
    for name in names:
        suffix = name[len(_DOMAIN):] if name.startswith(_DOMAIN) else ""
        if suffix.isdigit():
            found.append((int(suffix), name))
    for cache_id, name in sorted(found):
        yield str(cache_id), group / "mon_data" / name


def read_counter(path: Path) -> int | None:
    """A monitoring file's value; None for the kernel's ``Unavailable`` (the counter
    cannot be read now: no RMID yet, or the domain is offline)."""
    text = read_file(path).strip()
    if text in ("Unavailable", "Error"):
        return None
    return parse_int(text, path, path.name)


class ResctrlMonitorCollector:
    """Class and pod groups' ``mon_data``; bandwidth rates from the previous read."""

    name = "resctrl-monitor"

    def __init__(self, root: Path, *, interval: float = 10.0) -> None:
        self.interval = interval
        self.root = root
        self._once = OnceLog(log)
        #: (group dir, cache id, file) -> (counter, when read)
        self._last: dict[tuple[str, str, str], tuple[int, float]] = {}
        self.available = (root / "info" / "L3_MON").is_dir()
        if not self.available:
            log.info("resctrl_monitor_unavailable", root=str(root),
                     reason=f"no {root / 'info' / 'L3_MON'} (resctrl not mounted or no monitoring): "
                            "no koordlet_resctrl_* metrics on this host")

    def close(self) -> None:
        self._last.clear()

    def pod_group(self, pod: PodView) -> Path | None:
        name = POD_GROUP_PREFIX + pod.uid
        for candidate in (self.root / name, *(self.root / c / "mon_groups" / name for c in CLASS_GROUPS)):
            if candidate.is_dir():
                return candidate
        return None

    def collect(self, now: float, pods: Sequence[PodView]) -> list[Sample]:
        if not self.available:
            return []
        self._once.keep_owners(["node", *(p.uid for p in pods)])
        out: list[Sample] = []
        seen: set[tuple[str, str, str]] = set()
        for group in CLASS_GROUPS:
            path = self.root / group
            if path.is_dir():
                self._group(path, "node", labels(**{QOS: group}), (RESCTRL_LLC, RESCTRL_MB, RESCTRL_MB_TOTAL),
                            now, out, seen)
        for pod in pods:
            found = self.pod_group(pod)
            if found is not None:
                self._group(found, pod.uid, labels(**{POD_UID: pod.uid}),
                            (POD_RESCTRL_LLC, POD_RESCTRL_MB, POD_RESCTRL_MB_TOTAL), now, out, seen)
        self._last = {k: v for k, v in self._last.items() if k in seen}
        return out

    def _group(self, group: Path, owner: str, base: Labels, names: tuple[str, str, str], now: float,
               out: list[Sample], seen: set[tuple[str, str, str]]) -> None:
        llc, rate, total = names
        for cache_id, directory in domains(group):
            where = labels(**dict(base), **{CACHE_ID: cache_id})
            if (directory / LLC_FILE).exists():
                try:
                    value = read_counter(directory / LLC_FILE)
                    if value is not None:
                        out.append(Sample(llc, float(value), where, ts=now))
                except ReadError as exc:
                    self._once.skipped(owner, exc)
            for file in MB_FILES:
                path = directory / file
                if not path.exists():
                    continue
                try:
                    counter = read_counter(path)
                except ReadError as exc:
                    self._once.skipped(owner, exc)
                    continue
                if counter is None:
                    continue
                key = (str(group), cache_id, file)
                seen.add(key)
                mb_labels = labels(**dict(where), **{MB_TYPE: file})
                out.append(Sample(total, float(counter), mb_labels, ts=now))
                previous = self._last.get(key)
                self._last[key] = (counter, now)
                if previous is not None and counter >= previous[0] and now > previous[1]:
                    out.append(Sample(rate, (counter - previous[0]) / (now - previous[1]), mb_labels, ts=now))
