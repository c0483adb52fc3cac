"""Memory allocation latency: aggregation of the eBPF maps' entries, the samples per container
and kind, the counters fallback on fixture /proc + cgroup trees, and source selection."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hooks.qos import QoSClass
from metrics import model as m
from metrics.collect.base import ReadError, SourceUnavailable
from metrics.collect.cgroupfs import CgroupReader
from metrics.collect.memlat import (
    CounterSource,
    EbpfStallSource,
    MemLatencyCollector,
    StallStat,
    aggregate,
    parse_limit_hits,
    parse_vmstat,
    stall_samples,
)
from metrics.collect.memlatload import KINDS, TRACEPOINTS
from runtimeproxy.hookapi import HostRoots

POD_DIR = "kubepods/podu1"
VMSTAT = "nr_free_pages 1\nallocstall_dma 0\nallocstall_normal {n}\nallocstall_movable {mv}\n" \
         "pgscan_direct {scan}\npgscan_direct_throttle 7\ncompact_stall {c}\ncompact_fail 3\n"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def pod(*containers: str) -> m.PodView:
    return m.PodView(uid="u1", namespace="ns", name="p", sandbox_id="sb", qos=QoSClass.LS, priority=0,
                     priority_class="koord-prod", cgroup_dir=POD_DIR,
                     containers=tuple(m.ContainerView(id=c, name=c, cgroup_dir=f"{POD_DIR}/{c}") for c in containers))


def pairs(p: m.PodView) -> list[tuple[m.PodView, m.ContainerView]]:
    return [(p, c) for c in p.containers]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def by_key(samples: list[m.Sample]) -> dict[tuple[str, str, str], float]:
    return {(s.metric, dict(s.labels).get(m.CONTAINER_ID, ""), dict(s.labels).get(m.KIND, "")): s.value
            for s in samples}


# --- eBPF maps -> stalls -----------------------------------------------------------


def total(cgid: int, kind: int, sum_ns: int, count: int) -> tuple[bytes, bytes]:
    return struct.pack("=QQ", cgid, kind), struct.pack("=QQ", sum_ns, count)


def hist(cgid: int, kind: int, slot: int, n: int) -> tuple[bytes, bytes]:
    return struct.pack("=QII", cgid, kind, slot), struct.pack("=Q", n)


def test_aggregate_keeps_cgroups_and_kinds_apart() -> None:
    totals = [total(7, 1, 3_000_000, 3), total(7, 2, 500_000, 1), total(9, 1, 1_000, 1),
              total(7, 5, 1, 1),  # a kind this user space does not know: dropped
              total(8, 0, 0, 0)]  # no events: no stat
    hists = [hist(7, 1, 20, 2), hist(7, 1, 22, 1), hist(7, 2, 19, 1), hist(9, 1, 10, 1)]
    got = aggregate(totals, hists)
    assert set(got) == {7, 9}
    memcg = got[7]["memcg_reclaim"]
    assert memcg.seconds == pytest.approx(3e-3) and memcg.events == 3
    assert memcg.mean == pytest.approx(1e-3)
    assert memcg.p99 == pytest.approx(2**22 / 1e9)  # the top slot's upper bound, never understated
    assert got[7]["compaction"].p99 == pytest.approx(2**19 / 1e9)
    assert set(got[7]) == {"memcg_reclaim", "compaction"}
    assert got[9]["memcg_reclaim"].p99 == pytest.approx(2**10 / 1e9)


def test_kinds_match_the_program_numbering() -> None:
    assert KINDS == ("direct_reclaim", "memcg_reclaim", "compaction")
    assert len(TRACEPOINTS) == 6 and "vmscan/mm_vmscan_memcg_reclaim_begin" in TRACEPOINTS


def test_stall_samples_zero_for_a_container_that_did_not_stall() -> None:
    p = pod("c1")
    c1 = p.containers[0]
    got = by_key(stall_samples(p, c1, {"memcg_reclaim": StallStat(0.5, 50, 0.02)}, elapsed=10.0, source="ebpf"))
    assert got[(m.CONTAINER_MEMORY_ALLOC_STALL, "c1", "memcg_reclaim")] == pytest.approx(0.05)
    assert got[(m.CONTAINER_MEMORY_ALLOC_STALLS, "c1", "memcg_reclaim")] == pytest.approx(5.0)
    assert got[(m.CONTAINER_MEMORY_ALLOC_LATENCY, "c1", "memcg_reclaim")] == pytest.approx(0.01)
    assert got[(m.CONTAINER_MEMORY_ALLOC_LATENCY_P99, "c1", "memcg_reclaim")] == pytest.approx(0.02)
    for kind in ("direct_reclaim", "compaction"):
        assert got[(m.CONTAINER_MEMORY_ALLOC_STALL, "c1", kind)] == 0.0
        assert (m.CONTAINER_MEMORY_ALLOC_STALLS, "c1", kind) not in got
        assert (m.CONTAINER_MEMORY_ALLOC_LATENCY, "c1", kind) not in got
    labels = {dict(s.labels)[m.SOURCE] for s in stall_samples(p, c1, {}, 1.0, "ebpf")}
    assert labels == {"ebpf"}


# --- counters fallback ----------------------------------------------------------------


def test_parse_vmstat_sums_zones_and_names_a_bad_field() -> None:
    got = parse_vmstat(VMSTAT.format(n=5, mv=2, scan=300, c=4).encode(), "/proc/vmstat")
    assert got == {"direct_reclaim": 7, "pgscan_direct": 300, "compaction": 4}
    assert parse_vmstat(b"nr_free_pages 1\n", "/proc/vmstat") == {}  # a kernel without them
    with pytest.raises(ReadError, match="compact_stall: 'x1'"):
        parse_vmstat(b"compact_stall x1\n", "/proc/vmstat")


def test_parse_limit_hits_v1_and_v2() -> None:
    assert parse_limit_hits(b"42\n", "memory.failcnt", 1) == 42
    assert parse_limit_hits(b"low 0\nhigh 3\nmax 17\noom 1\noom_kill 0\n", "memory.events", 2) == 17
    with pytest.raises(ReadError, match="failcnt: 'lots'"):
        parse_limit_hits(b"lots\n", "memory.failcnt", 1)
    with pytest.raises(ReadError, match="no 'max' line"):
        parse_limit_hits(b"low 0\n", "memory.events", 2)
    with pytest.raises(ReadError, match="max: '1e3'"):
        parse_limit_hits(b"max 1e3\n", "memory.events", 2)


class Host:
    def __init__(self, tmp_path: Path, *, v2: bool = False) -> None:
        self.roots = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys")
        self.v2 = v2
        if v2:
            write(self.roots.cgroup / "cgroup.controllers", "memory\n")
        else:
            (self.roots.cgroup / "memory").mkdir(parents=True)
        self.vmstat(0, 0, 0)

    def vmstat(self, stalls: int, scan: int, compact: int) -> None:
        write(self.roots.proc / "vmstat", VMSTAT.format(n=stalls, mv=0, scan=scan, c=compact))

    def hits(self, container: str, n: int) -> None:
        if self.v2:
            write(self.roots.cgroup / POD_DIR / container / "memory.events", f"low 0\nhigh 0\nmax {n}\noom 0\n")
        else:
            write(self.roots.cgroup / "memory" / POD_DIR / container / "memory.failcnt", f"{n}\n")


@pytest.mark.parametrize("v2", [False, True])
def test_counter_source_rates_per_container_and_node(tmp_path: Path, v2: bool) -> None:
    host, clock = Host(tmp_path, v2=v2), Clock()
    source = CounterSource(host.roots, CgroupReader(host.roots.cgroup), clock=clock)
    source.start()
    p = pod("busy", "idle")
    host.hits("busy", 100)
    host.hits("idle", 0)
    assert source.sample(pairs(p), 0) == []  # the first read only primes
    clock.t += 10
    host.hits("busy", 600)
    host.vmstat(stalls=20, scan=4000, compact=5)
    samples = source.sample(pairs(p), 10)
    got = by_key(samples)
    assert got[(m.CONTAINER_MEMORY_ALLOC_STALLS, "busy", "memcg_reclaim")] == pytest.approx(50.0)
    assert got[(m.CONTAINER_MEMORY_ALLOC_STALLS, "idle", "memcg_reclaim")] == 0.0
    assert got[(m.NODE_MEMORY_ALLOC_STALLS, "", "direct_reclaim")] == pytest.approx(2.0)
    assert got[(m.NODE_MEMORY_ALLOC_STALLS, "", "compaction")] == pytest.approx(0.5)
    assert got[(m.NODE_MEMORY_RECLAIM_SCANNED, "", "")] == pytest.approx(400.0)
    assert {dict(s.labels)[m.SOURCE] for s in samples} == {"counters", "vmstat"}


def test_counter_source_skips_a_reset_counter_and_logs_a_bad_file_once(tmp_path: Path) -> None:
    host, clock = Host(tmp_path), Clock()
    source = CounterSource(host.roots, CgroupReader(host.roots.cgroup), clock=clock)
    p = pod("c1")
    host.hits("c1", 100)
    source.sample(pairs(p), 0)
    clock.t += 1
    host.hits("c1", 5)  # the cgroup was recreated: no negative rate
    assert (m.CONTAINER_MEMORY_ALLOC_STALLS, "c1", "memcg_reclaim") not in by_key(source.sample(pairs(p), 1))
    write(host.roots.cgroup / "memory" / POD_DIR / "c1/memory.failcnt", "garbage\n")
    with capture_logs() as logs:
        for _ in range(3):
            clock.t += 1
            assert (m.CONTAINER_MEMORY_ALLOC_STALLS, "c1", "memcg_reclaim") not in by_key(source.sample(pairs(p), 2))
    bad = [e for e in logs if e["event"] == "sample_skipped"]
    assert len(bad) == 1 and "failcnt: 'garbage'" in bad[0]["reason"], logs


def test_counter_source_unavailable_without_vmstat(tmp_path: Path) -> None:
    host = Host(tmp_path)
    (host.roots.proc / "vmstat").unlink()
    with pytest.raises(SourceUnavailable, match="vmstat"):
        CounterSource(host.roots, CgroupReader(host.roots.cgroup)).start()


# --- source selection -------------------------------------------------------------------


def test_ebpf_source_names_the_missing_tracepoints(tmp_path: Path) -> None:
    host = Host(tmp_path)
    write(host.roots.cgroup / "unified/cgroup.procs", "")
    (host.roots.sys / "kernel/tracing/events/vmscan/mm_vmscan_direct_reclaim_begin").mkdir(parents=True)
    source = EbpfStallSource(host.roots, CgroupReader(host.roots.cgroup))
    with pytest.raises(SourceUnavailable, match="lacks the tracepoints vmscan/mm_vmscan_direct_reclaim_end"):
        source.start()


def test_auto_falls_back_to_counters_and_explain_says_why(tmp_path: Path) -> None:
    host, clock = Host(tmp_path), Clock()  # no unified tree: eBPF cannot map cgroups
    reader = CgroupReader(host.roots.cgroup)
    collector = MemLatencyCollector(host.roots, sources=[EbpfStallSource(host.roots, reader),
                                                         CounterSource(host.roots, reader, clock=clock)])
    with capture_logs() as logs:
        collector.start()
    assert collector.source == "counters"
    explained = collector.explain()
    assert explained["source"] == "counters"
    assert "ebpf: no cgroup v2 tree" in explained["reason"]
    assert [e["source"] for e in logs if e["event"] == "memlat_source"] == ["counters"]


def test_no_source_collects_nothing_and_says_why(tmp_path: Path) -> None:
    host = Host(tmp_path)
    (host.roots.proc / "vmstat").unlink()
    collector = MemLatencyCollector(host.roots, prefer="counters")
    assert collector.collect(0, [pod("c1")]) == []
    assert collector.source is None and "counters:" in (collector.explain()["reason"] or "")


class FailingSource:
    """A source that starts and then fails every sample with the reasons given, in turn."""

    name = "failing"

    def __init__(self, *reasons: str) -> None:
        self._reasons = list(reasons)

    def start(self) -> None:
        pass

    def sample(self, containers: Sequence[tuple[m.PodView, m.ContainerView]], now: float) -> list[m.Sample]:
        raise SourceUnavailable(self._reasons.pop(0))

    def close(self) -> None:
        pass


def test_a_failing_sample_is_logged_once_per_reason(tmp_path: Path) -> None:
    collector = MemLatencyCollector(Host(tmp_path).roots, sources=[FailingSource("a", "a", "b", "a")])
    with capture_logs() as logs:
        for i in range(4):
            assert collector.collect(i, [pod("c1")]) == []
    assert [e["reason"] for e in logs if e["event"] == "memlat_sample_failed"] == ["a", "b"]


def test_a_bad_preference_is_refused() -> None:
    with pytest.raises(ValueError, match="memlat prefer='bpf'"):
        MemLatencyCollector(HostRoots(), prefer="bpf")  # type: ignore[arg-type]


# --- export ---------------------------------------------------------------------------


def test_samples_are_exported_as_koordetector_series_with_the_seed_labels() -> None:
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import CollectorRegistry

    from metrics.report.promexport import LatestValues, register_exporter

    p = pod("c1")
    latest = LatestValues(clock=lambda: 1000.0)
    exporter = register_exporter(CollectorRegistry(), latest, lambda: [p], "node-a")
    samples = stall_samples(p, p.containers[0], {"memcg_reclaim": StallStat(0.5, 50, 0.02)}, 10.0, "ebpf")
    samples.append(m.Sample(m.NODE_MEMORY_ALLOC_STALLS, 2.0, m.labels(kind="direct_reclaim", source="vmstat")))
    latest.update([s._replace(ts=10) for s in samples])
    got = {(s.name, s.labels.get("kind", "")): s for f in text_string_to_metric_families(exporter.render().decode())
           for s in f.samples}
    ratio = got[("koordetector_container_memory_alloc_stall_ratio", "memcg_reclaim")]
    assert ratio.value == pytest.approx(0.05)
    assert ratio.labels == {"node": "node-a", "container_id": "c1", "container_name": "c1", "pod_uid": "u1",
                            "pod_name": "p", "pod_namespace": "ns", "kind": "memcg_reclaim", "source": "ebpf"}
    assert got[("koordetector_container_memory_alloc_stall_ratio", "compaction")].value == 0.0
    assert got[("koordetector_container_memory_alloc_latency_p99_seconds", "memcg_reclaim")].value == 0.02
    node = got[("koordetector_node_memory_alloc_stalls_per_second", "direct_reclaim")]
    assert node.labels == {"node": "node-a", "kind": "direct_reclaim", "source": "vmstat"} and node.value == 2.0
