"""The NodeMetric document built with one read per window is byte for byte the one the
earlier build (a read per window and metric, kept below as the reference) made, on a
store written as the agent writes it: several collectors, missed ticks, a departed pod,
chunks, frames not compacted yet and samples not flushed."""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import pytest

from hooks.qos import QoSClass
from metrics import model as m
from metrics.report import nodemetric as nm
from metrics.store.tsdb import TSDB

START = 1_700_000_000.0
TICKS = 2100  # 35 min: the 30 min window reaches into the compacted past
PODS = 6


def _pod(i: int) -> m.PodView:
    return m.PodView(uid=f"uid-{i}", namespace=f"ns-{i % 2}", name=f"pod-{i}", sandbox_id=f"sb-{i}",
                     qos=QoSClass.LS if i % 3 else QoSClass.BE, priority=0,
                     priority_class="koord-prod" if i % 2 else "", cgroup_dir=f"kubepods/pod{i}")


def _tick(rnd: random.Random, t: int) -> Iterator[list[m.Sample]]:
    """One tick's frames, one per collector. Pod 0 leaves at tick 1500 and pod 5 starts
    at tick 1900; node and system samples miss ticks of their own."""
    pods: list[m.Sample] = []
    for i in range(PODS):
        if (i == 0 and t >= 1500) or (i == PODS - 1 and t < 1900):
            continue
        lbl = m.labels(**{m.POD_UID: f"uid-{i}"})
        pods += [m.Sample(m.POD_CPU_USAGE, rnd.random() * 2, lbl),
                 m.Sample(m.POD_MEMORY_USED, float(rnd.randrange(1 << 30)), lbl),
                 m.Sample(m.POD_MEMORY_CACHE, float(rnd.randrange(1 << 28)), lbl)]
    yield pods
    if t % 41 != 7:
        node = [m.Sample(m.NODE_CPU_USAGE, rnd.random() * 8), m.Sample(m.NODE_MEMORY_USED, rnd.random() * 2**34)]
        for n in range(2):
            lbl = m.labels(**{m.NUMA_NODE: str(n)})
            node += [m.Sample(m.NUMA_CPU_USAGE, rnd.random() * 4, lbl),
                     m.Sample(m.NUMA_MEMORY_USED, rnd.random() * 2**33, lbl)]
        yield node
    if t % 53 != 11:
        yield [m.Sample(m.SYSTEM_CPU_USAGE, rnd.random()), m.Sample(m.SYSTEM_MEMORY_USED, rnd.random() * 2**31)]
    if t % 3 == 0:
        app = m.labels(**{m.HOST_APP_NAME: "sshd", m.PRIORITY_CLASS: "koord-prod", m.QOS: "LS"})
        yield [m.Sample(m.HOST_APP_CPU_USAGE, rnd.random(), app), m.Sample(m.HOST_APP_MEMORY_USED, 3e7, app)]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TSDB, float]]:
    clock = [START]
    db = TSDB(tmp_path_factory.mktemp("nm") / "metrics.db", clock=lambda: clock[0])
    rnd = random.Random(29)
    for t in range(TICKS):
        clock[0] = START + t
        if t % 97 == 13:
            continue  # a missed tick of every collector
        for frame in _tick(rnd, t):
            db.write(frame)
        if t % 2 == 0:
            db.flush()  # the last tick's frames stay in the batch
        if t % 300 == 299 and t < 1800:
            db.gc()  # compacts every frame; the last 5 min stay frames
    yield db, clock[0]
    db.close()


# --- the reference: the build before windows shared their reads -------------------------
def _reference_aggregated(reader: m.MetricReader, pods: Sequence[m.PodView], policy: nm.CollectPolicy, now: float,
                          cpu_metric: str, mem_metric: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for duration in policy.durations:
        window = nm._Window(reader, policy, pods, now, duration, [(cpu_metric, ()), (mem_metric, ())])
        cpu = window.one(cpu_metric)
        memory = window.node_memory() if mem_metric == m.NODE_MEMORY_USED else window.one(mem_metric)
        if cpu is None or memory is None or nm._cold(cpu, duration) or nm._cold(memory, duration):
            continue
        usage = {stat: nm._resource_map(nm._resources(cpu, memory, stat)) for stat in nm.PERCENTILES}
        out.append({"duration": nm.format_go_duration(duration), "usage": usage})
    return out


def _reference_status(reader: m.MetricReader, pods: Sequence[m.PodView], policy: nm.CollectPolicy,
                      now: float) -> dict[str, Any]:
    series: list[tuple[str, m.Labels]] = [(x, ()) for x in (m.NODE_CPU_USAGE, m.NODE_MEMORY_USED,
                                                            m.SYSTEM_CPU_USAGE, m.SYSTEM_MEMORY_USED)]
    series += [(x, m.labels(**{m.POD_UID: p.uid})) for p in pods for x in (m.POD_CPU_USAGE, m.POD_MEMORY_USED)]
    window = nm._Window(reader, policy, pods, now, policy.aggregate_duration, series)
    node_usage = nm._resources(window.one(m.NODE_CPU_USAGE), window.node_memory(), "avg")
    system_usage = nm._resources(window.one(m.SYSTEM_CPU_USAGE), window.one(m.SYSTEM_MEMORY_USED), "avg")
    pods_metric = [e for e in (nm._pod_entry(window, p) for p in pods) if e is not None]
    pods_metric.sort(key=lambda e: (e["namespace"], e["name"]))
    node_metric: dict[str, Any] = {
        "nodeUsage": nm._resource_map(node_usage),
        "aggregatedNodeUsages": _reference_aggregated(reader, pods, policy, now, m.NODE_CPU_USAGE,
                                                      m.NODE_MEMORY_USED),
        "systemUsage": nm._resource_map(system_usage),
        "aggregatedSystemUsages": _reference_aggregated(reader, pods, policy, now, m.SYSTEM_CPU_USAGE,
                                                        m.SYSTEM_MEMORY_USED),
    }
    numa = nm._numa_usages(window)
    if numa:
        node_metric["numaUsages"] = numa
    status: dict[str, Any] = {"updateTime": nm.rfc3339(now), "nodeMetric": node_metric, "podsMetric": pods_metric}
    host_apps = nm._host_applications(window)
    if host_apps:
        status["hostApplicationMetric"] = host_apps
    return status


class CountingReader:
    """The store, counting its window reads."""

    def __init__(self, store: TSDB) -> None:
        self.store = store
        self.many = 0
        self.all = 0
        self.means = 0

    def aggregate(self, metric: str, labels: m.Labels, start: float, end: float) -> m.Aggregate | None:
        return self.store.aggregate(metric, labels, start, end)

    def aggregate_all(self, metric: str, start: float, end: float) -> Mapping[m.Labels, m.Aggregate]:
        self.all += 1
        return self.store.aggregate_all(metric, start, end)

    def aggregate_many(self, series: Iterable[tuple[str, m.Labels]], start: float, end: float
                       ) -> Mapping[tuple[str, m.Labels], m.Aggregate]:
        self.many += 1
        return self.store.aggregate_many(series, start, end)

    def means_many(self, series: Iterable[tuple[str, m.Labels]], start: float, end: float
                   ) -> Mapping[tuple[str, m.Labels], m.Mean]:
        self.means += 1
        return self.store.means_many(series, start, end)

    def last(self, metric: str, labels: m.Labels, max_age: float, now: float) -> m.Sample | None:
        return self.store.last(metric, labels, max_age, now)

    def get_kv(self, key: str) -> object | None:
        return self.store.get_kv(key)


def _json(doc: object) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


POLICIES = [
    nm.CollectPolicy(),
    nm.CollectPolicy(memory_policy=nm.WITH_PAGE_CACHE),
    nm.CollectPolicy(memory_policy=nm.WITH_HOT_PAGE_CACHE),
    nm.CollectPolicy(aggregate_duration=600, durations=(1800, 300, 600), memory_policy=nm.WITH_PAGE_CACHE),
    nm.CollectPolicy(aggregate_duration=120, durations=(60, 900)),
]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: f"{p.aggregate_duration}-{p.durations}-{p.memory_policy}")
@pytest.mark.parametrize("back", [0.0, 250.5, 1234.0])
def test_document_is_the_reference_one_byte_for_byte(store: tuple[TSDB, float], policy: nm.CollectPolicy,
                                                     back: float) -> None:
    db, end = store
    now = end - back
    pods = [_pod(i) for i in range(PODS)]
    reader = CountingReader(db)
    built = nm.build_status(reader, pods, policy, now)
    assert _json(built) == _json(_reference_status(db, pods, policy, now))
    assert built["podsMetric"] and built["nodeMetric"]["aggregatedNodeUsages"] and built["nodeMetric"]["numaUsages"]
    # One read for the main window (node, system and pods), one per other duration.
    assert reader.many == 1 + sum(d != policy.aggregate_duration for d in policy.durations)
    assert reader.means == 1  # every pod's mean in one pass, summed as read (no samples held)


def test_the_store_holds_chunks_frames_and_an_unflushed_batch(store: tuple[TSDB, float]) -> None:
    """What the equality test relies on: its window spans compacted and uncompacted samples."""
    db, end = store
    frames = db._reader().execute("SELECT count(*), min(lo) FROM frames").fetchone()
    assert frames[0] > 0 and frames[1] < (end - 250) * 1000
    assert db._reader().execute("SELECT count(*) FROM chunks").fetchone()[0] > 0
    assert db._batch_len > 0
