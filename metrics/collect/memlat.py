"""Memory allocation latency per container: time stalled in reclaim and compaction.

Two sources, as for schedule latency (``metrics.collect.schedlat``):

* ``ebpf`` (``metrics.collect.memlatload``): every direct reclaim, memcg (limit) reclaim
  and compaction a container's tasks go through, timed in the kernel, kept per
  (v2 cgroup id, kind) as a sum / count and a log2 histogram. Per container and kind it
  gives the stalled share of the interval (seconds stalled per second, summed over the
  container's tasks), stalls per second, and, when any, the mean and p99 stall.
* ``counters``: no times, only how often. Per container the limit hits (cgroup v1
  ``memory.failcnt``, v2 ``memory.events`` ``max``: each one is a memcg reclaim),
  node-wide ``/proc/vmstat`` (``allocstall_*`` direct reclaims, ``compact_stall``
  direct compactions, ``pgscan_direct`` pages scanned by direct reclaim), as rates.

``prefer="auto"`` takes eBPF when it starts, else the counters; every sample carries
``source`` and ``explain`` shows which source runs and why.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, Protocol

import structlog

from metrics.collect.base import (
    OnceLog,
    ReadError,
    ReasonOnce,
    SourceUnavailable,
    container_labels,
    pick_source,
    read_bytes,
)
from metrics.collect.bpfmap import BpfError, BpfMap
from metrics.collect.cgroupfs import CgroupReader
from metrics.collect.ebpf import (
    _TRACEFS,
    LOAD_TIMEOUT,
    CgroupIds,
    check_host,
    close_program,
    log2_percentile,
    open_program,
)
from metrics.collect.memlatload import KINDS, TRACEPOINTS
from metrics.model import (
    CONTAINER_MEMORY_ALLOC_LATENCY,
    CONTAINER_MEMORY_ALLOC_LATENCY_P99,
    CONTAINER_MEMORY_ALLOC_STALL,
    CONTAINER_MEMORY_ALLOC_STALLS,
    KIND,
    NODE_MEMORY_ALLOC_STALLS,
    NODE_MEMORY_RECLAIM_SCANNED,
    SOURCE,
    ContainerView,
    PodView,
    Sample,
    labels,
)
from runtimeproxy.hookapi import HostRoots

log = structlog.get_logger("metrics.memlat")

Prefer = Literal["auto", "ebpf", "counters"]
PREFERENCES: tuple[Prefer, ...] = ("auto", "ebpf", "counters")
LOADER: Final = "metrics.collect.memlatload"


@dataclass(frozen=True, slots=True)
class StallStat:
    """One container's stalls of one kind over one interval."""

    seconds: float  # summed over its tasks
    events: int
    p99: float | None = None  # seconds (eBPF histograms)

    @property
    def mean(self) -> float | None:
        return self.seconds / self.events if self.events else None


class StallSource(Protocol):
    name: str

    def start(self) -> None:
        """Raises ``SourceUnavailable`` when the source cannot work on this host."""

    def sample(self, containers: Sequence[tuple[PodView, ContainerView]], now: float) -> list[Sample]: ...

    def close(self) -> None: ...


_HIST_KEY: Final = struct.Struct("=QII")  # struct hist_key { u64 cgid; u32 kind; u32 slot; }
_TOTAL_KEY: Final = struct.Struct("=QQ")  # struct total_key { u64 cgid; u64 kind; }
_TOTAL: Final = struct.Struct("=QQ")  # struct total { u64 sum_ns; u64 count; }
_U64: Final = struct.Struct("=Q")


def aggregate(totals: Sequence[tuple[bytes, bytes]], hists: Sequence[tuple[bytes, bytes]]
              ) -> dict[int, dict[str, StallStat]]:
    """The drained maps' raw entries -> cgroup id -> kind -> stalls (unknown kinds dropped)."""
    slots: dict[tuple[int, int], dict[int, int]] = {}
    for k, v in hists:
        cgid, kind, slot = _HIST_KEY.unpack(k)
        slots.setdefault((cgid, kind), {})[slot] = _U64.unpack(v)[0]
    out: dict[int, dict[str, StallStat]] = {}
    for k, v in totals:
        cgid, kind = _TOTAL_KEY.unpack(k)
        sum_ns, count = _TOTAL.unpack(v)
        if kind >= len(KINDS) or count == 0:
            continue
        p99 = log2_percentile(slots.get((cgid, kind), {}), 0.99)
        out.setdefault(cgid, {})[KINDS[kind]] = StallStat(sum_ns / 1e9, count, p99)
    return out


def stall_samples(pod: PodView, container: ContainerView, stalls: Mapping[str, StallStat], elapsed: float,
                  source: str) -> list[Sample]:
    """The stalled share for every kind of every container (0 when it did not stall, so an
    idle container reads 0, not "no data"); the rest only where there were stalls (fewer
    rows in the store: most containers never stall)."""
    out: list[Sample] = []
    base = dict(container_labels(pod, container))
    for kind in KINDS:
        lbls = labels(**base, **{KIND: kind, SOURCE: source})
        stat = stalls.get(kind)
        if stat is None:
            out.append(Sample(CONTAINER_MEMORY_ALLOC_STALL, 0.0, lbls))
            continue
        out += [Sample(CONTAINER_MEMORY_ALLOC_STALL, stat.seconds / elapsed, lbls),
                Sample(CONTAINER_MEMORY_ALLOC_STALLS, stat.events / elapsed, lbls)]
        mean = stat.mean
        if mean is not None:
            out.append(Sample(CONTAINER_MEMORY_ALLOC_LATENCY, mean, lbls))
        if stat.p99 is not None:
            out.append(Sample(CONTAINER_MEMORY_ALLOC_LATENCY_P99, stat.p99, lbls))
    return out


class EbpfStallSource:
    name = "ebpf"

    def __init__(self, host: HostRoots, reader: CgroupReader, *, load_timeout: float = LOAD_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._sys = host.sys
        self._reader = reader
        self._timeout = load_timeout
        self._clock = clock
        self._maps: dict[str, BpfMap] = {}
        self._events: list[int] = []
        self._last = 0.0
        self._once = OnceLog(log)
        self._ids = CgroupIds(reader, self._once)

    def start(self) -> None:
        if self._maps:
            return
        check_host(self._reader)
        tracefs = next((self._sys / t for t in _TRACEFS if (self._sys / t / "events").is_dir()), None)
        if tracefs is None:
            raise SourceUnavailable(f"tracefs is not mounted ({self._sys}/kernel/tracing has no events)")
        missing = [tp for tp in TRACEPOINTS if not (tracefs / "events" / tp).is_dir()]
        if missing:
            raise SourceUnavailable(f"this kernel lacks the tracepoints {', '.join(missing)}")
        maps, events = open_program(self._timeout, LOADER)
        self._maps, self._events, self._last = maps, events, self._clock()

    def sample(self, containers: Sequence[tuple[PodView, ContainerView]], now: float) -> list[Sample]:
        if not self._maps:
            raise SourceUnavailable("EbpfStallSource.sample() before start()")
        try:
            by_cgroup = aggregate(self._maps["totals"].drain(), self._maps["hist"].drain())
        except (BpfError, struct.error) as exc:
            raise SourceUnavailable(f"cannot read BPF map: {exc}") from exc
        at = self._clock()
        elapsed, self._last = max(at - self._last, 1e-3), at
        self._once.keep_owners(pod.uid for pod, _ in containers)
        ids = self._ids.of(containers)
        out: list[Sample] = []
        for pod, container in containers:
            cgid = ids.get(container.id)
            if cgid is not None:
                out += stall_samples(pod, container, by_cgroup.get(cgid, {}), elapsed, self.name)
        return out

    def close(self) -> None:
        close_program(self._maps, self._events)
        self._maps, self._events = {}, []


#: /proc/vmstat counters -> (metric, kind) they add to; ``allocstall_<zone>`` sum up.
VMSTAT_STALLS: Final = {"allocstall_": "direct_reclaim", "compact_stall": "compaction"}


def parse_vmstat(data: bytes, path: str) -> dict[str, int]:
    """``/proc/vmstat`` -> {direct_reclaim: allocstalls, compaction: compact_stall, pgscan_direct};
    a key missing from this kernel is left out, a non-integer value is a ``ReadError``."""
    out: dict[str, int] = {}
    for line in data.splitlines():
        key, _, raw = line.decode("ascii", "replace").partition(" ")
        field = next((kind for prefix, kind in VMSTAT_STALLS.items() if key.startswith(prefix)),
                     "pgscan_direct" if key == "pgscan_direct" else None)
        if field is None:
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ReadError(Path(path), f"{key}: {raw.strip()[:40]!r} is not an integer") from None
        out[field] = out.get(field, 0) + value
    return out


def parse_limit_hits(data: bytes, path: str, version: int) -> int:
    """Times the cgroup hit its limit: v1 ``memory.failcnt`` (one integer), v2
    ``memory.events`` (its ``max`` line)."""
    text = data.decode("ascii", "replace")
    if version == 1:
        try:
            return int(text.strip())
        except ValueError:
            raise ReadError(Path(path), f"failcnt: {text.strip()[:40]!r} is not an integer") from None
    for line in text.splitlines():
        key, _, raw = line.partition(" ")
        if key == "max":
            try:
                return int(raw)
            except ValueError:
                raise ReadError(Path(path), f"max: {raw.strip()[:40]!r} is not an integer") from None
    raise ReadError(Path(path), "no 'max' line")


class CounterSource:
    """Rates of the kernel's stall counters; the first sample of each series only primes it."""

    name = "counters"

    def __init__(self, host: HostRoots, reader: CgroupReader, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._vmstat = str(host.proc / "vmstat")
        self._reader = reader
        self._clock = clock
        self._prev: dict[tuple[str, str], tuple[float, int]] = {}
        self._paths: dict[str, str] = {}  # container id -> its limit-hits file
        self._once = OnceLog(log)

    def start(self) -> None:
        try:
            parse_vmstat(read_bytes(self._vmstat), self._vmstat)
        except ReadError as exc:
            raise SourceUnavailable(f"{exc.path}: {exc.reason}") from exc

    @property
    def _hits_file(self) -> str:
        return "memory.failcnt" if self._reader.version == 1 else "memory.events"

    def sample(self, containers: Sequence[tuple[PodView, ContainerView]], now: float) -> list[Sample]:
        at = self._clock()
        live: set[tuple[str, str]] = set()
        out: list[Sample] = []
        try:
            node = parse_vmstat(read_bytes(self._vmstat), self._vmstat)
        except ReadError as exc:
            self._once.skipped("node", exc)
            node = {}
        for field, value in node.items():
            rate = self._rate(("node", field), at, value, live)
            if rate is None:
                continue
            if field == "pgscan_direct":
                out.append(Sample(NODE_MEMORY_RECLAIM_SCANNED, rate, labels(**{SOURCE: "vmstat"})))
            else:
                out.append(Sample(NODE_MEMORY_ALLOC_STALLS, rate, labels(**{KIND: field, SOURCE: "vmstat"})))
        self._once.keep_owners(["node", *(pod.uid for pod, _ in containers)])
        paths: dict[str, str] = {}
        for pod, container in containers:
            path = self._paths.get(container.id) or f"{self._reader.memory_dir(container.cgroup_dir)}/{self._hits_file}"
            paths[container.id] = path
            try:
                hits = parse_limit_hits(read_bytes(path), path, self._reader.version)
            except ReadError as exc:
                self._once.skipped(pod.uid, exc)
                continue
            rate = self._rate((container.id, "memcg_reclaim"), at, hits, live)
            if rate is not None:
                lbls = labels(**dict(container_labels(pod, container)), **{KIND: "memcg_reclaim", SOURCE: self.name})
                out.append(Sample(CONTAINER_MEMORY_ALLOC_STALLS, rate, lbls))
        self._prev = {k: v for k, v in self._prev.items() if k in live}
        self._paths = paths
        return out

    def _rate(self, key: tuple[str, str], at: float, value: int, live: set[tuple[str, str]]) -> float | None:
        live.add(key)
        prev, self._prev[key] = self._prev.get(key), (at, value)
        if prev is None or at <= prev[0] or value < prev[1]:  # first, or a reset counter
            return None
        return (value - prev[1]) / (at - prev[0])

    def close(self) -> None:
        self._prev = {}


class MemLatencyCollector:
    name = "memlat"

    def __init__(self, host: HostRoots, *, prefer: Prefer = "auto", interval: float = 10.0,
                 sources: Sequence[StallSource] | None = None) -> None:
        if prefer not in PREFERENCES:
            raise ValueError(f"memlat prefer={prefer!r}: expected one of {', '.join(PREFERENCES)}")
        self.interval = interval
        self.prefer: Prefer = prefer
        self._reader = CgroupReader(host.cgroup)
        self._host = host
        self._given = sources
        self._source: StallSource | None = None
        self._started = False
        self._failures = ReasonOnce(log, "memlat_sample_failed")
        self.reason: str | None = None

    @property
    def source(self) -> str | None:
        return None if self._source is None else self._source.name

    def _candidates(self) -> list[StallSource]:
        if self._given is not None:
            return list(self._given)
        ebpf = EbpfStallSource(self._host, self._reader)
        counters = CounterSource(self._host, self._reader)
        if self.prefer == "ebpf":
            return [ebpf]
        if self.prefer == "counters":
            return [counters]
        return [ebpf, counters]

    def start(self) -> None:
        """Pick and start the source; idempotent; never raises for an unavailable one."""
        if self._started:
            return
        self._started = True
        self._source, self.reason = pick_source(self._candidates(), self.prefer, log, "memlat_source")

    def collect(self, now: float, pods: Sequence[PodView]) -> list[Sample]:
        self.start()
        source = self._source
        if source is None:
            return []
        containers = [(pod, c) for pod in pods for c in pod.containers]
        try:
            return source.sample(containers, now)
        except SourceUnavailable as exc:
            self._failures.failed(source.name, exc)
            return []

    def explain(self) -> dict[str, Any]:
        return {"prefer": self.prefer, "source": self.source, "reason": self.reason, "interval": self.interval}

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
