"""TopologyCollector on fixture /sys trees (and the real one)."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from hooks.cpusets import read_online_cpus
from metrics.collect.topology import CPUInfo, CPUTopology, TopologyCollector
from runtimeproxy.hookapi import HostRoots


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def sysfs(tmp_path: Path, cpus: dict[int, tuple[int, int]], online: str | None = None) -> HostRoots:
    """cpu -> (core_id, package_id)."""
    roots = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys")
    base = roots.sys / "devices/system/cpu"
    for cpu, (core, socket) in cpus.items():
        write(base / f"cpu{cpu}/topology/core_id", f"{core}\n")
        write(base / f"cpu{cpu}/topology/physical_package_id", f"{socket}\n")
    write(base / "online", online if online is not None else f"0-{max(cpus)}\n")
    (base / "cpufreq").mkdir()  # not a cpu dir
    return roots


# 2 sockets x 2 cores x 2 threads; core ids restart per socket
EIGHT = {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1), 4: (0, 0), 5: (1, 0), 6: (0, 1), 7: (1, 1)}


def test_topology_with_numa_nodes(tmp_path: Path) -> None:
    roots = sysfs(tmp_path, EIGHT)
    write(roots.sys / "devices/system/node/node0/cpulist", "0-1,4-5\n")
    write(roots.sys / "devices/system/node/node1/cpulist", "2-3,6-7\n")
    collector = TopologyCollector(roots)
    assert collector.collect(0, []) == []
    topology = collector.latest()
    assert topology.cpus[2] == CPUInfo(cpu=2, core=0, socket=1, numa=1)
    assert topology.cpus[5] == CPUInfo(cpu=5, core=1, socket=0, numa=0)
    assert [c.cpu for c in topology.cpus] == list(range(8))
    record = collector.as_record()
    assert record is not None
    assert record["totalInfo"] == {"numberCPUs": 8, "numberCores": 4, "numberSockets": 2, "numberNodes": 2}
    assert record["processorInfos"][6] == {"cpu": 6, "core": 0, "socket": 1, "node": 1}  # type: ignore[index]


def test_without_node_dirs_every_cpu_is_in_node_0(tmp_path: Path) -> None:
    topology = TopologyCollector(sysfs(tmp_path, {0: (0, 0), 1: (0, 0)})).latest()
    assert topology == CPUTopology((CPUInfo(0, 0, 0, 0), CPUInfo(1, 0, 0, 0)))


def test_offline_and_garbled_cpus_are_left_out(tmp_path: Path) -> None:
    roots = sysfs(tmp_path, {0: (0, 0), 1: (1, 0), 2: (2, 0), 3: (3, 0)}, online="0-2\n")
    write(roots.sys / "devices/system/cpu/cpu1/topology/core_id", "one\n")
    with capture_logs() as logs:
        topology = TopologyCollector(roots).latest()
    assert [c.cpu for c in topology.cpus] == [0, 2]
    assert [(e["event"], e["log_level"]) for e in logs] == [("sample_skipped", "warning")]


def test_unreadable_sysfs_keeps_the_last_good_topology(tmp_path: Path) -> None:
    roots = sysfs(tmp_path, {0: (0, 0), 1: (1, 0)})
    collector = TopologyCollector(roots)
    collector.collect(0, [])
    good = collector.latest()
    for cpu in (0, 1):
        (roots.sys / f"devices/system/cpu/cpu{cpu}/topology/core_id").unlink()
    collector.collect(1, [])
    assert collector.latest() == good


def test_no_cpus_means_no_record(tmp_path: Path) -> None:
    empty = HostRoots(cgroup=tmp_path, proc=tmp_path, sys=tmp_path / "sys")
    collector = TopologyCollector(empty)
    assert collector.latest() == CPUTopology()
    assert collector.as_record() is None


def test_real_sysfs_has_every_online_cpu() -> None:
    topology = TopologyCollector(HostRoots()).latest()
    assert {c.cpu for c in topology.cpus} == read_online_cpus(Path("/sys"))
