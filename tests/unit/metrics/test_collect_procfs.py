"""NodeCollector and read_cpu_ticks against fixture /proc and /sys trees (and one real read)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from metrics import model as m
from metrics.collect.base import ReadError
from metrics.collect.procfs import LAYOUT_REFRESH, NodeCollector, meminfo_fields, read_cpu_ticks
from runtimeproxy.hookapi import HostRoots

# user nice system idle iowait irq softirq steal
Ticks = tuple[int, int, int, int, int, int, int, int]
BASE: Ticks = (100, 0, 50, 800, 10, 5, 5, 30)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def stat_text(per_cpu: Sequence[Ticks]) -> str:
    total = [sum(col) for col in zip(*per_cpu, strict=True)]
    lines = ["cpu  " + " ".join(map(str, total)) + " 0 0"]
    lines += [f"cpu{i} " + " ".join(map(str, t)) + " 0 0" for i, t in enumerate(per_cpu)]
    lines += ["intr 12345 0 0", "ctxt 999", "btime 1700000000"]
    return "\n".join(lines) + "\n"


def add(t: Ticks, user: int = 0, system: int = 0, idle: int = 0, steal: int = 0, irq: int = 0) -> Ticks:
    return (t[0] + user, t[1], t[2] + system, t[3] + idle, t[4], t[5] + irq, t[6], t[7] + steal)


def node_meminfo(node: int, total: int, free: int, active_file: int, inactive_file: int, srecl: int) -> str:
    rows = [("MemTotal", total), ("MemFree", free), ("MemUsed", total - free), ("Active(file)", active_file),
            ("Inactive(file)", inactive_file), ("SReclaimable", srecl)]
    return "".join(f"Node {node} {k}:{v:>16} kB\n" for k, v in rows)


@pytest.fixture
def host(tmp_path: Path) -> HostRoots:
    h = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys", resctrl=tmp_path / "r")
    write(h.proc / "stat", stat_text([BASE, BASE]))
    write(h.proc / "meminfo", "MemTotal:        8000 kB\nMemFree:         1000 kB\nMemAvailable:    3000 kB\n")
    write(h.sys / "devices/system/cpu/online", "0-1\n")
    return h


def numa(host: HostRoots) -> None:
    base = host.sys / "devices/system/node"
    write(base / "node0/cpulist", "0\n")
    write(base / "node0/meminfo", node_meminfo(0, 4000, 1000, 500, 300, 200))
    write(base / "node1/cpulist", "1\n")
    write(base / "node1/meminfo", node_meminfo(1, 4000, 3000, 100, 100, 100))
    write(base / "online", "0-1\n")  # not a node dir: ignored


def by_key(samples: Sequence[m.Sample]) -> dict[tuple[str, m.Labels], float]:
    out = {(s.metric, s.labels): s.value for s in samples}
    assert len(out) == len(samples), "duplicate series in one collect"
    return out


def node0(metric: str) -> tuple[str, m.Labels]:
    return metric, m.labels(numa_node_id="0")


def node1(metric: str) -> tuple[str, m.Labels]:
    return metric, m.labels(numa_node_id="1")


def test_read_cpu_ticks_sums_used_fields_and_keeps_steal_out_of_used(host: HostRoots) -> None:
    used, total = read_cpu_ticks(host.proc)
    # used = user + nice + system + irq + softirq; total adds idle, iowait and steal
    assert used == 2 * (100 + 0 + 50 + 5 + 5)
    assert total == 2 * sum(BASE)


def test_read_cpu_ticks_errors_name_the_file(host: HostRoots, tmp_path: Path) -> None:
    write(host.proc / "stat", "intr 1 2 3\n")
    with pytest.raises(ReadError, match="aggregate cpu line"):
        read_cpu_ticks(host.proc)
    write(host.proc / "stat", "cpu  1 2 x 4 5 6 7 8\n")
    with pytest.raises(ReadError, match="not an integer"):
        read_cpu_ticks(host.proc)
    with pytest.raises(ReadError) as info:
        read_cpu_ticks(tmp_path / "nowhere")
    assert info.value.gone


def test_first_collect_has_no_cpu_usage_then_a_delta(host: HostRoots) -> None:
    collector = NodeCollector(host)
    first = by_key(collector.collect(0, []))
    assert (m.NODE_CPU_USAGE, ()) not in first
    assert first[(m.NODE_CPU_CAPACITY, ())] == 2
    assert collector.latest().cpu is None

    # cpu0: 80 busy of 100 ticks; cpu1: idle 90 + steal 10 -> 0 busy of 100
    write(host.proc / "stat", stat_text([add(BASE, user=60, system=20, idle=20), add(BASE, idle=90, steal=10)]))
    second = by_key(collector.collect(1, []))
    assert second[(m.NODE_CPU_USAGE, ())] == pytest.approx(0.8)
    assert collector.latest().cpu == pytest.approx(0.8)


def test_counter_going_backwards_resets_the_baseline(host: HostRoots) -> None:
    collector = NodeCollector(host)
    collector.collect(0, [])
    low: Ticks = (10, 0, 10, 10, 0, 0, 0, 0)
    write(host.proc / "stat", stat_text([low, low]))
    with capture_logs() as logs:
        assert (m.NODE_CPU_USAGE, ()) not in by_key(collector.collect(1, []))
    assert [e["event"] for e in logs] == ["cpu_counter_reset"]
    write(host.proc / "stat", stat_text([add(low, user=50, idle=50), add(low, idle=100)]))
    assert by_key(collector.collect(2, []))[(m.NODE_CPU_USAGE, ())] == pytest.approx(0.5)


def test_memory_used_is_total_minus_available(host: HostRoots) -> None:
    samples = by_key(NodeCollector(host).collect(0, []))
    assert samples[(m.NODE_MEMORY_USED, ())] == 5000 * 1024
    assert samples[(m.NODE_MEMORY_TOTAL, ())] == 8000 * 1024


def test_numa_split_of_cpu_and_memory(host: HostRoots) -> None:
    numa(host)
    collector = NodeCollector(host)
    first = by_key(collector.collect(0, []))
    assert node0(m.NUMA_CPU_USAGE) not in first  # no delta yet, memory is a gauge
    # MemTotal - (MemFree + Active(file) + Inactive(file) + SReclaimable)
    assert first[node0(m.NUMA_MEMORY_USED)] == (4000 - (1000 + 500 + 300 + 200)) * 1024
    assert first[node1(m.NUMA_MEMORY_USED)] == (4000 - (3000 + 100 + 100 + 100)) * 1024

    write(host.proc / "stat", stat_text([add(BASE, user=30, irq=10, idle=60), add(BASE, system=100)]))
    second = by_key(collector.collect(1, []))
    assert second[node0(m.NUMA_CPU_USAGE)] == pytest.approx(0.4)
    assert second[node1(m.NUMA_CPU_USAGE)] == pytest.approx(1.0)
    assert second[(m.NODE_CPU_USAGE, ())] == pytest.approx(1.4)


def test_numa_node_skips_a_tick_when_one_of_its_cpus_went_backwards(host: HostRoots) -> None:
    numa(host)
    collector = NodeCollector(host)
    collector.collect(0, [])
    hotplugged: Ticks = (1, 0, 1, 1, 0, 0, 0, 0)
    write(host.proc / "stat", stat_text([add(BASE, user=100, idle=100), hotplugged]))
    samples = by_key(collector.collect(1, []))
    assert samples[node0(m.NUMA_CPU_USAGE)] == pytest.approx(0.5)
    assert node1(m.NUMA_CPU_USAGE) not in samples


def test_without_node_dirs_there_are_no_numa_samples(host: HostRoots) -> None:
    collector = NodeCollector(host)
    collector.collect(0, [])
    write(host.proc / "stat", stat_text([add(BASE, user=10, idle=90), add(BASE, idle=100)]))
    metrics = {s.metric for s in collector.collect(1, [])}
    assert m.NODE_CPU_USAGE in metrics
    assert not metrics & {m.NUMA_CPU_USAGE, m.NUMA_MEMORY_USED}


def test_unreadable_files_skip_their_samples_and_log_once(host: HostRoots) -> None:
    numa(host)
    (host.proc / "meminfo").unlink()
    (host.proc / "meminfo").mkdir()  # a directory where a file is expected: EISDIR
    write(host.sys / "devices/system/node/node1/meminfo", "Node 1 MemTotal: lots kB\n")
    collector = NodeCollector(host)
    with capture_logs() as logs:
        for tick in range(3):
            samples = by_key(collector.collect(tick, []))
    assert (m.NODE_MEMORY_USED, ()) not in samples
    assert node1(m.NUMA_MEMORY_USED) not in samples
    assert node0(m.NUMA_MEMORY_USED) in samples
    assert (m.NODE_CPU_USAGE, ()) not in samples  # /proc/stat did not move: no share to compute
    assert samples[(m.NODE_CPU_CAPACITY, ())] == 2
    skipped = sorted(e["path"] for e in logs if e["event"] == "sample_skipped")
    assert skipped == sorted([str(host.proc / "meminfo"), str(host.sys / "devices/system/node/node1/meminfo")])


def test_garbled_stat_gives_no_cpu_sample_and_keeps_the_baseline(host: HostRoots) -> None:
    collector = NodeCollector(host)
    collector.collect(0, [])
    write(host.proc / "stat", "cpu  1 2 3\n")
    assert m.NODE_CPU_USAGE not in {s.metric for s in collector.collect(1, [])}
    write(host.proc / "stat", stat_text([add(BASE, user=25, idle=75), add(BASE, idle=100)]))
    assert by_key(collector.collect(2, []))[(m.NODE_CPU_USAGE, ())] == pytest.approx(0.25)


def test_capacity_falls_back_to_the_cpu_lines_without_an_online_file(host: HostRoots) -> None:
    (host.sys / "devices/system/cpu/online").unlink()
    write(host.proc / "stat", stat_text([BASE, BASE, BASE]))
    assert by_key(NodeCollector(host).collect(0, []))[(m.NODE_CPU_CAPACITY, ())] == 3


def test_real_proc_usage_is_between_zero_and_capacity() -> None:
    collector = NodeCollector(HostRoots())
    collector.collect(0, [])
    time.sleep(0.3)
    samples = by_key(collector.collect(1, []))
    capacity = samples[(m.NODE_CPU_CAPACITY, ())]
    assert capacity >= 1
    assert 0 <= samples[(m.NODE_CPU_USAGE, ())] <= capacity
    assert 0 < samples[(m.NODE_MEMORY_USED, ())] < samples[(m.NODE_MEMORY_TOTAL, ())]


def test_meminfo_fields_reads_only_the_keys_on_both_layouts_and_names_bad_ones(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    proc = b"MemTotal:       8000 kB\nMemFree:  1 kB\nMemAvailable:   3000 kB\nHugePages_Total:       4\n"
    assert meminfo_fields(proc, (b"MemTotal", b"MemAvailable", b"HugePages_Total"), path) == [8000 * 1024,
                                                                                             3000 * 1024, 4]
    node = b"Node 1 Inactive(file):  30 kB\nNode 1 Active(file):  20 kB\nNode 1 MemTotal: 99 kB\n"
    assert meminfo_fields(node, (b"Active(file)", b"MemTotal"), path) == [20 * 1024, 99 * 1024]
    with pytest.raises(ReadError, match="missing MemAvailableX, SReclaimable"):
        meminfo_fields(proc, (b"MemTotal", b"MemAvailableX", b"SReclaimable"), path)
    with pytest.raises(ReadError, match=f"{path}.*MemTotal"):
        meminfo_fields(b"MemTotal: lots kB\n", (b"MemTotal",), path)


def test_online_cpus_and_numa_nodes_are_reread_every_layout_refresh(host: HostRoots) -> None:
    numa(host)
    clock = [0.0]
    collector = NodeCollector(host, clock=lambda: clock[0])
    assert by_key(collector.collect(0, []))[(m.NODE_CPU_CAPACITY, ())] == 2
    write(host.sys / "devices/system/cpu/online", "0-3\n")
    (host.sys / "devices/system/node/node1/cpulist").unlink()
    clock[0] = LAYOUT_REFRESH - 1
    samples = by_key(collector.collect(1, []))
    assert samples[(m.NODE_CPU_CAPACITY, ())] == 2 and node1(m.NUMA_MEMORY_USED) in samples
    clock[0] = LAYOUT_REFRESH
    samples = by_key(collector.collect(2, []))
    assert samples[(m.NODE_CPU_CAPACITY, ())] == 4 and node1(m.NUMA_MEMORY_USED) not in samples
