"""The collectors' part of ``tasks.metrics``: ``intervals`` (with ``collectors.<name>.interval``
folded in), the schedlat / memlat sources and ``host_applications``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from metrics.collect.hostapp import HostApp, parse_host_apps
from metrics.collect.registry import CollectorSpec
from runtimeproxy.config.configvalues import ConfigError, Section, parse_duration

SchedSource = Literal["auto", "ebpf", "schedstat", "off"]
MemlatSource = Literal["auto", "ebpf", "counters", "off"]
SCHED_SOURCES: Final = ("auto", "ebpf", "schedstat", "off")
MEMLAT_SOURCES: Final = ("auto", "ebpf", "counters", "off")


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


def parse_intervals(raw: object, key_path: str, collectors: tuple[CollectorSpec, ...]) -> Intervals:
    """``intervals:`` (the pre-registry shape, still read) with ``collectors.<name>.interval``
    folded in; setting one collector's interval both ways is refused."""
    args = Section.of(raw, key_path)
    base = Intervals()
    args.reject_unknown(frozenset(Intervals.__slots__))
    values = {k: args.get(k, getattr(base, k), parse_duration) for k in Intervals.__slots__}
    for spec in collectors:
        if spec.interval is None or spec.name not in values:
            continue
        if args.raw.get(spec.name) is not None:
            raise ConfigError(f"{spec.key_path}.interval", spec.interval,
                              f"also set as {args.path(spec.name)}: keep one")
        values[spec.name] = spec.interval
    return Intervals(**values)


def parse_host_applications(raw: object, key_path: str, driver: str) -> tuple[HostApp, ...]:
    """The NodeSLO ``hostApplications`` shape; the first refused item is the error."""
    apps, problems = parse_host_apps(raw, driver, where=key_path)
    if problems:
        raise ConfigError(key_path, raw, problems[0])
    return apps
