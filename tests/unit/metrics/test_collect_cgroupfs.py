"""CgroupReader, read_cpu_usage_ns and PodCollector on fixture cgroup v1, hybrid and v2 trees."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hooks.qos import QoSClass
from metrics import model as m
from metrics.collect.base import ReadError
from metrics.collect.cgroupfs import (
    _NUMA_KEYS,
    PAGE_SIZE,
    QUOTA_RECHECK,
    CgroupReader,
    MemoryUsage,
    PodCollector,
    _numa_field,
    _numa_memory,
    read_cpu_usage_ns,
    read_memory,
    read_throttling,
)
from runtimeproxy.hookapi import HostRoots

POD_DIR = "kubepods/burstable/podu1"
C1_DIR = POD_DIR + "/c1"
C2_DIR = POD_DIR + "/c2"


class Clock:
    """Monotonic time that moves only when the test says so."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def pod(*containers: str, uid: str = "u1", pod_dir: str = POD_DIR) -> m.PodView:
    return m.PodView(
        uid=uid, namespace="ns", name=f"pod-{uid}", sandbox_id=f"sb-{uid}", qos=QoSClass.LS, priority=0,
        priority_class="koord-prod", cgroup_dir=pod_dir,
        containers=tuple(m.ContainerView(id=c, name=c, cgroup_dir=f"{pod_dir}/{c}") for c in containers),
    )


class Tree:
    """A fixture cgroup root: v1 with separate controller mounts plus a unified tree
    (this host's layout), or pure v2. ``numa``: v1 whose kernel has memory.numa_stat
    with hierarchical totals (the collector reads that file instead of memory.stat)."""

    def __init__(self, root: Path, version: int, numa: bool = False) -> None:
        self.root = root
        self.numa = numa
        self.version = version
        self._periods: dict[str, tuple[int, int]] = {}
        if version == 2:
            write(root / "cgroup.controllers", "cpuset cpu io memory pids\n")
        else:
            for controller in ("cpu", "cpuacct", "cpuset", "memory"):
                (root / controller).mkdir(parents=True)
            write(root / "unified/cgroup.procs", "")
        if numa:
            write(root / "memory/memory.numa_stat", numa_stat(0, 0, 0))

    def d(self, controller: str, rel: str) -> Path:
        return self.root / rel if self.version == 2 else self.root / controller / rel

    def usage(self, rel: str, ns: int) -> None:
        if self.version == 2:
            write(self.d("cpu", rel) / "cpu.stat", f"usage_usec {ns // 1000}\nuser_usec 1\nsystem_usec 2\n"
                  + self._throttle_text(rel))
        else:
            write(self.d("cpuacct", rel) / "cpuacct.usage", f"{ns}\n")

    def throttle(self, rel: str, periods: int, throttled: int) -> None:
        self._periods[rel] = (periods, throttled)
        if self.version == 2:
            path = self.d("cpu", rel) / "cpu.stat"
            usage = path.read_text().splitlines()[0] if path.exists() else "usage_usec 0"
            write(path, usage + "\n" + self._throttle_text(rel))
        else:
            write(self.d("cpu", rel) / "cpu.stat", self._throttle_text(rel))

    def _throttle_text(self, rel: str) -> str:
        periods, throttled = self._periods.get(rel, (0, 0))
        return f"nr_periods {periods}\nnr_throttled {throttled}\nthrottled_usec 0\n"

    def memory(self, rel: str, anon: int, unevictable: int, cache: int) -> None:
        """Bytes. With ``numa``, memory.stat's total_cache is 7 pages more than the file
        LRU in memory.numa_stat (shmem): a collector reading the wrong file is caught."""
        if self.version == 2:
            text = f"anon {anon}\nfile {cache}\nkernel 4096\nunevictable {unevictable}\n"
        else:
            half = anon // 2
            total_cache = cache + 7 * PAGE_SIZE if self.numa else cache
            text = (f"cache {cache + 1}\nrss 1\nactive_anon 1\ninactive_anon 1\nunevictable 1\n"
                    f"total_cache {total_cache}\ntotal_inactive_anon {half}\ntotal_active_anon {anon - half}\n"
                    f"total_unevictable {unevictable}\n")
        write(self.d("memory", rel) / "memory.stat", text)
        if self.numa:
            write(self.d("memory", rel) / "memory.numa_stat",
                  numa_stat(anon // PAGE_SIZE, unevictable // PAGE_SIZE, cache // PAGE_SIZE))

    def memory_file(self, rel: str) -> Path:
        """The file the collector reads memory from."""
        return self.d("memory", rel) / ("memory.numa_stat" if self.numa else "memory.stat")

    def cgroup(self, rel: str, usage_ns: int, anon: int = 4096, cache: int = 8192) -> None:
        self.usage(rel, usage_ns)
        self.throttle(rel, 0, 0)
        self.memory(rel, anon, 0, cache)


def numa_stat(anon: int, unevictable: int, file: int, nodes: int = 2) -> str:
    """memory.numa_stat as a v1 kernel prints it (pages; the first number is the total)."""

    def line(key: str, total: int) -> str:
        per_node = [total // nodes + (1 if n < total % nodes else 0) for n in range(nodes)]
        return f"{key}={total} " + " ".join(f"N{n}={v}" for n, v in enumerate(per_node)) + "\n"

    local = [line("total", 1), line("file", 1), line("anon", 0), line("unevictable", 0)]
    return "".join(local) + line("hierarchical_total", anon + unevictable + file) + line(
        "hierarchical_file", file) + line("hierarchical_anon", anon) + line("hierarchical_unevictable", unevictable)


@pytest.fixture(params=[(1, False), (1, True), (2, False)], ids=["v1", "v1-numa", "v2"])
def tree(request: pytest.FixtureRequest, tmp_path: Path) -> Tree:
    version, numa = request.param
    return Tree(tmp_path / "cgroup", version, numa)


def collector(tree: Tree, clock: Clock) -> PodCollector:
    return PodCollector(HostRoots(cgroup=tree.root, proc=tree.root / "none", sys=tree.root / "none"), clock=clock)


def by_key(samples: Sequence[m.Sample]) -> dict[tuple[str, m.Labels], float]:
    return {(s.metric, s.labels): s.value for s in samples}


POD = m.labels(pod_uid="u1")
C1 = m.labels(pod_uid="u1", container_id="c1")


# --- CgroupReader and read_cpu_usage_ns ----------------------------------------------


def test_reader_paths_on_a_hybrid_v1_host(tmp_path: Path) -> None:
    tree = Tree(tmp_path, 1)
    reader = CgroupReader(tmp_path)
    assert reader.version == 1
    assert reader.cpu_dir("/" + POD_DIR) == tmp_path / "cpu" / POD_DIR  # a leading "/" never escapes the root
    assert reader.cpuacct_dir(POD_DIR) == tmp_path / "cpuacct" / POD_DIR
    assert reader.memory_dir(POD_DIR) == tmp_path / "memory" / POD_DIR
    assert reader.cpuset_dir(POD_DIR) == tmp_path / "cpuset" / POD_DIR
    assert reader.pressure_dir(POD_DIR) == tmp_path / "unified" / POD_DIR
    assert reader.perf_event_dir(POD_DIR) == tmp_path / "unified" / POD_DIR
    tree.usage(POD_DIR, 5_000)
    assert reader.cpu_usage_ns(POD_DIR) == 5_000


def test_reader_on_pure_v1_with_comounted_cpu_cpuacct(tmp_path: Path) -> None:
    (tmp_path / "cpu,cpuacct").mkdir()
    (tmp_path / "memory").mkdir()
    (tmp_path / "perf_event").mkdir()
    reader = CgroupReader(tmp_path)
    assert reader.cpu_dir(POD_DIR) == reader.cpuacct_dir(POD_DIR) == tmp_path / "cpu,cpuacct" / POD_DIR
    assert reader.pressure_dir(POD_DIR) is None
    assert reader.perf_event_dir(POD_DIR) == tmp_path / "perf_event" / POD_DIR


def test_reader_on_v2(tmp_path: Path) -> None:
    Tree(tmp_path, 2)
    reader = CgroupReader(tmp_path)
    assert reader.version == 2
    for directory in (reader.cpu_dir(POD_DIR), reader.cpuacct_dir(POD_DIR), reader.memory_dir(POD_DIR),
                      reader.pressure_dir(POD_DIR), reader.perf_event_dir(POD_DIR)):
        assert directory == tmp_path / POD_DIR


def test_read_cpu_usage_ns_v1_v2_and_detected(tmp_path: Path) -> None:
    write(tmp_path / "v1/cpuacct.usage", "123456789\n")
    write(tmp_path / "v2/cpu.stat", "usage_usec 42\nuser_usec 40\nsystem_usec 2\n")
    assert read_cpu_usage_ns(tmp_path / "v1", 1) == 123456789
    assert read_cpu_usage_ns(tmp_path / "v2", 2) == 42_000
    # version unknown: cpuacct.usage first, else cpu.stat (a hybrid host's unified dir)
    assert read_cpu_usage_ns(tmp_path / "v1") == 123456789
    assert read_cpu_usage_ns(tmp_path / "v2") == 42_000


def test_read_cpu_usage_ns_errors(tmp_path: Path) -> None:
    write(tmp_path / "garbage/cpuacct.usage", "lots\n")
    write(tmp_path / "no-usage/cpu.stat", "nr_periods 1\n")
    with pytest.raises(ReadError, match="not an integer"):
        read_cpu_usage_ns(tmp_path / "garbage", 1)
    with pytest.raises(ReadError, match="no usage_usec"):
        read_cpu_usage_ns(tmp_path / "no-usage", 2)
    with pytest.raises(ReadError) as info:
        read_cpu_usage_ns(tmp_path / "vanished")
    assert info.value.gone


# --- PodCollector --------------------------------------------------------------------


def test_cpu_usage_is_a_delta_over_the_monotonic_clock(tree: Tree) -> None:
    tree.cgroup(POD_DIR, 1_000_000_000)
    tree.cgroup(C1_DIR, 500_000_000)
    clock = Clock()
    pc = collector(tree, clock)
    first = by_key(pc.collect(0, [pod("c1")]))
    assert (m.POD_CPU_USAGE, POD) not in first and (m.CONTAINER_CPU_USAGE, C1) not in first
    assert pc.latest().cpu == {} and not pc.latest().cpu_complete

    tree.usage(POD_DIR, 1_000_000_000 + 3_000_000_000)  # 3 s of CPU in 2 s
    tree.usage(C1_DIR, 500_000_000 + 1_000_000_000)
    clock.t += 2.0
    second = by_key(pc.collect(1, [pod("c1")]))
    assert second[(m.POD_CPU_USAGE, POD)] == pytest.approx(1.5)
    assert second[(m.CONTAINER_CPU_USAGE, C1)] == pytest.approx(0.5)
    assert pc.latest().cpu == {"u1": pytest.approx(1.5)} and pc.latest().cpu_complete


def test_memory_used_excludes_page_cache(tree: Tree) -> None:
    tree.cgroup(POD_DIR, 0)
    tree.memory(POD_DIR, anon=10 * PAGE_SIZE, unevictable=2 * PAGE_SIZE, cache=100 * PAGE_SIZE)
    samples = by_key(collector(tree, Clock()).collect(0, [pod()]))
    assert samples[(m.POD_MEMORY_USED, POD)] == 12 * PAGE_SIZE
    assert samples[(m.POD_MEMORY_CACHE, POD)] == 100 * PAGE_SIZE


def test_v1_reads_memory_numa_stat_only_where_the_kernel_has_hierarchical_totals(tmp_path: Path) -> None:
    numa = Tree(tmp_path / "numa", 1, numa=True)
    reader = CgroupReader(numa.root)
    assert reader.numa_stat
    with capture_logs() as logs:
        collector(numa, Clock())
    assert [(e["event"], e["file"]) for e in logs] == [("pod_memory_source", "memory.numa_stat")]
    assert reader.memory_file("/" + POD_DIR) == f"{numa.root}/memory/{POD_DIR}/memory.numa_stat"
    # A kernel whose numa_stat has no hierarchical_* lines (before 3.x): memory.stat.
    old = Tree(tmp_path / "old", 1)
    write(old.root / "memory/memory.numa_stat", "total=1 N0=1\nfile=1 N0=1\nanon=0 N0=0\nunevictable=0 N0=0\n")
    old.cgroup(POD_DIR, 0)
    old.memory(POD_DIR, anon=3 * PAGE_SIZE, unevictable=0, cache=5 * PAGE_SIZE)
    assert not CgroupReader(old.root).numa_stat
    with capture_logs() as logs:
        collector(old, Clock())
    assert [(e["event"], e["file"]) for e in logs] == [("pod_memory_source", "memory.stat")]
    samples = by_key(collector(old, Clock()).collect(0, [pod()]))
    assert samples[(m.POD_MEMORY_USED, POD)] == 3 * PAGE_SIZE
    for v2 in (Tree(tmp_path / "v2", 2),):
        write(v2.root / "memory.numa_stat", numa_stat(1, 1, 1))
        assert not CgroupReader(v2.root).numa_stat  # v2's memory.stat has anon / file directly


def test_numa_stat_parsing_by_key_and_its_errors(tmp_path: Path) -> None:
    tree = Tree(tmp_path, 1, numa=True)
    reader = CgroupReader(tmp_path)
    path = str(tree.memory_file(POD_DIR))
    usual = numa_stat(anon=10, unevictable=2, file=30).encode()
    assert reader.parse_memory(usual, path) == (12 * PAGE_SIZE, 30 * PAGE_SIZE)
    # Another line order (and one NUMA node) is parsed by key.
    shuffled = b"hierarchical_unevictable=2 N0=2\nhierarchical_anon=10 N0=10\nhierarchical_file=30 N0=30\n"
    assert reader.parse_memory(shuffled, path) == (12 * PAGE_SIZE, 30 * PAGE_SIZE)
    with pytest.raises(ReadError, match=r"hierarchical_file: '12x' is not an integer") as bad:
        reader.parse_memory(usual.replace(b"hierarchical_file=30 ", b"hierarchical_file=12x "), path)
    assert path in str(bad.value)
    with pytest.raises(ReadError, match=r"no hierarchical_anon line"):
        reader.parse_memory(b"hierarchical_file=3 N0=3\nhierarchical_unevictable=0 N0=0\n", path)


#: The three totals in the kernel's line order, other lines between them allowed.
_NUMA_TOTALS = re.compile(rb"^hierarchical_file=(\d+)\b.*?^hierarchical_anon=(\d+)\b.*?"
                          rb"^hierarchical_unevictable=(\d+)\b", re.M | re.S)


def _numa_by_expression(data: bytes, path: str) -> tuple[int, int] | str:
    """memory.numa_stat parsed as before the one-call match: an expression searching the
    kernel's line order, else by key (the error's text when neither can)."""
    found = _NUMA_TOTALS.search(data)
    if found is not None:
        file, anon, unevictable = int(found[1]), int(found[2]), int(found[3])
        return (anon + unevictable) * PAGE_SIZE, file * PAGE_SIZE
    try:
        anon, unevictable, file = (_numa_field(data, key, path) for key in _NUMA_KEYS)
    except ReadError as exc:
        return str(exc)
    return (anon + unevictable) * PAGE_SIZE, file * PAGE_SIZE


@pytest.mark.parametrize("data", [
    numa_stat(anon=10, unevictable=2, file=30).encode(),
    numa_stat(anon=10**9, unevictable=0, file=7, nodes=1).encode(),
    numa_stat(anon=5, unevictable=6, file=7, nodes=4).encode(),
    b"hierarchical_file=30 N0=30\nhierarchical_anon=10 N0=10\nhierarchical_unevictable=2 N0=2\n",  # first line
    b"total=1 N0=1\nhierarchical_file=30\nhierarchical_anon=10 N0=10\nhierarchical_unevictable=2 N0=2\n",
    b"total=1 N0=1\nhierarchical_file=3x N0=3\nhierarchical_anon=1 N0=1\nhierarchical_unevictable=2 N0=2\n",
    b"total=1 N0=1\nhierarchical_file=+3 N0=3\nhierarchical_anon=1 N0=1\nhierarchical_unevictable=2 N0=2\n",
    b"total=1\nhierarchical_file=3 N0=3\nhierarchical_anon=1 N0=1\nhierarchical_unevictable=2",  # no space at the end
    b"total=1\nhierarchical_anon=1 N0=1\nhierarchical_file=3 N0=3\nhierarchical_unevictable=2 N0=2\n",
    b"total=1\nhierarchical_file=3 N0=3\nhierarchical_anon=\nhierarchical_unevictable=2 N0=2\n",
    b"total=1\nxhierarchical_file=3 N0=3\nhierarchical_anon=1 N0=1\nhierarchical_unevictable=2 N0=2\n",
    b"total=1\nhierarchical_file=3 N0=1 N1=2\nhierarchical_anon=1 N0=1 N1=0\nhierarchical_unevictable=2 N0=2 N1=0\n",
    b"total=1\nhierarchical_file=3 N0=3\nhierarchical_total=9 N0=9\nhierarchical_anon=1 N0=1\n"
    b"hierarchical_unevictable=2 N0=2\n",  # not in a row: by key
    b"total=1\nhierarchical_file=3 N0=3\nhierarchical_anon=1\nhierarchical_unevictable=2 N0=2\n",
    b"total=1\nhierarchical_file=3 N0=3\nhierarchical_anon=1 N0=1\nhierarchical_unevictable=2\n",
    b"total=1\nhierarchical_file=3 N0=3\nhierarchical_file=4 N0=4\nhierarchical_anon=1 N0=1\n"
    b"hierarchical_unevictable=2 N0=2\n",
    b"",
], ids=lambda d: str(len(d)))
def test_numa_stat_found_by_bytes_find_as_by_the_expression(data: bytes) -> None:
    try:
        got: tuple[int, int] | str = _numa_memory(data, "/x/memory.numa_stat")
    except ReadError as exc:
        got = str(exc)
    assert got == _numa_by_expression(data, "/x/memory.numa_stat")


def test_v1_memory_falls_back_to_the_non_total_counters(tmp_path: Path) -> None:
    tree = Tree(tmp_path, 1)
    tree.cgroup(POD_DIR, 0)
    write(tree.d("memory", POD_DIR) / "memory.stat",
          "cache 300\nactive_anon 100\ninactive_anon 20\nunevictable 3\nactive_file 1\n")
    samples = by_key(collector(tree, Clock()).collect(0, [pod()]))
    assert samples[(m.POD_MEMORY_USED, POD)] == 123
    assert samples[(m.POD_MEMORY_CACHE, POD)] == 300


def test_throttled_ratio_needs_elapsed_periods(tree: Tree) -> None:
    tree.cgroup(POD_DIR, 0)
    tree.throttle(POD_DIR, 100, 10)
    pc = collector(tree, Clock())
    assert (m.POD_CPU_THROTTLED, POD) not in by_key(pc.collect(0, [pod()]))
    tree.throttle(POD_DIR, 150, 30)
    assert by_key(pc.collect(1, [pod()]))[(m.POD_CPU_THROTTLED, POD)] == pytest.approx(20 / 50)
    # no period elapsed (no quota, or idle): no sample rather than a made-up 0
    assert (m.POD_CPU_THROTTLED, POD) not in by_key(pc.collect(2, [pod()]))


def test_without_a_cfs_quota_cpu_stat_is_not_read_and_a_new_quota_is_seen_within_the_recheck(tmp_path: Path) -> None:
    """v1: no quota, no CFS periods, so no ratio and no cpu.stat read. The fixture's
    periods advance anyway, to show the file is not read; a quota set later is picked
    up at the next check and the ratio follows one tick after."""
    tree = Tree(tmp_path, 1)
    tree.cgroup(POD_DIR, 0)
    write(tree.d("cpu", POD_DIR) / "cpu.cfs_quota_us", "-1\n")
    clock = Clock()
    pc = collector(tree, clock)
    for tick in range(3):
        tree.throttle(POD_DIR, 100 * tick, 10 * tick)
        assert (m.POD_CPU_THROTTLED, POD) not in by_key(pc.collect(tick, [pod()]))
        clock.t += 1
    write(tree.d("cpu", POD_DIR) / "cpu.cfs_quota_us", "50000\n")
    tree.throttle(POD_DIR, 400, 40)
    assert (m.POD_CPU_THROTTLED, POD) not in by_key(pc.collect(3, [pod()])), "not re-checked yet"
    clock.t = 100 + QUOTA_RECHECK
    assert (m.POD_CPU_THROTTLED, POD) not in by_key(pc.collect(4, [pod()])), "the first read is a baseline"
    tree.throttle(POD_DIR, 500, 90)
    clock.t += 1
    assert by_key(pc.collect(5, [pod()]))[(m.POD_CPU_THROTTLED, POD)] == pytest.approx(50 / 100)
    # A quota that cannot be read counts as set: cpu.stat is read as before.
    write(tree.d("cpu", POD_DIR) / "cpu.cfs_quota_us", "garbage\n")
    clock.t += QUOTA_RECHECK
    tree.throttle(POD_DIR, 600, 100)
    assert by_key(pc.collect(6, [pod()]))[(m.POD_CPU_THROTTLED, POD)] == pytest.approx(10 / 100)


def test_cpu_counter_reset_starts_a_new_baseline(tree: Tree) -> None:
    tree.cgroup(POD_DIR, 9_000_000_000)
    clock = Clock()
    pc = collector(tree, clock)
    pc.collect(0, [pod()])
    tree.usage(POD_DIR, 1_000_000_000)
    clock.t += 1
    assert (m.POD_CPU_USAGE, POD) not in by_key(pc.collect(1, [pod()]))
    tree.usage(POD_DIR, 1_250_000_000)
    clock.t += 1
    assert by_key(pc.collect(2, [pod()]))[(m.POD_CPU_USAGE, POD)] == pytest.approx(0.25)


def test_vanished_container_is_skipped_and_logged_once(tree: Tree) -> None:
    tree.cgroup(POD_DIR, 0)
    tree.cgroup(C1_DIR, 0)
    clock = Clock()
    pc = collector(tree, clock)
    with capture_logs() as logs:
        for tick in range(4):  # c2 has no cgroup (the container exited)
            clock.t += 1
            samples = by_key(pc.collect(tick, [pod("c1", "c2")]))
    assert (m.CONTAINER_CPU_USAGE, C1) in samples
    assert not [k for k in samples if ("container_id", "c2") in k[1]]
    assert {(e["event"], e["log_level"]) for e in logs} == {("sample_skipped", "info")}
    paths = [e["path"] for e in logs]
    # one line per missing file (v1: cpuacct.usage, memory.stat, cpu.stat; v2: cpu.stat, memory.stat), not per tick
    assert len(paths) == len(set(paths)) == (3 if tree.version == 1 else 2)
    assert all("/c2/" in p for p in paths)


def test_state_of_a_container_that_left_is_dropped(tree: Tree) -> None:
    tree.cgroup(POD_DIR, 0)
    tree.cgroup(C1_DIR, 0)
    clock = Clock()
    pc = collector(tree, clock)
    pc.collect(0, [pod("c1")])
    clock.t += 1
    pc.collect(1, [pod()])  # c1 gone from the pod list
    tree.usage(C1_DIR, 7_000_000_000)
    clock.t += 1
    # back with the same id: it has no baseline, so no (wrong) 7-core sample
    assert (m.CONTAINER_CPU_USAGE, C1) not in by_key(pc.collect(2, [pod("c1")]))


def test_garbage_files_skip_only_their_samples(tree: Tree) -> None:
    tree.cgroup(POD_DIR, 0)
    tree.cgroup(C1_DIR, 0)
    write(tree.memory_file(C1_DIR), "anon twelve\n")
    tree.memory_file(POD_DIR).unlink()
    tree.memory_file(POD_DIR).mkdir()
    clock = Clock()
    pc = collector(tree, clock)
    with capture_logs() as logs:
        pc.collect(0, [pod("c1")])
        clock.t += 1
        samples = by_key(pc.collect(1, [pod("c1")]))
    assert (m.POD_CPU_USAGE, POD) in samples and (m.CONTAINER_CPU_USAGE, C1) in samples
    assert (m.POD_MEMORY_USED, POD) not in samples and (m.CONTAINER_MEMORY_USED, C1) not in samples
    assert sorted(e["log_level"] for e in logs) == ["warning", "warning"]
    assert not pc.latest().memory_complete and pc.latest().cpu_complete


def test_hybrid_unified_tree_usage_works_for_the_v1_reader(tmp_path: Path) -> None:
    """A hybrid host's unified dirs have cpu.stat with usage_usec only (no cpu controller)."""
    Tree(tmp_path, 1)
    write(tmp_path / "unified" / C1_DIR / "cpu.stat", "usage_usec 2500\nuser_usec 2000\nsystem_usec 500\n")
    reader = CgroupReader(tmp_path)
    unified = reader.unified_dir(C1_DIR)
    assert unified is not None
    assert read_cpu_usage_ns(unified) == 2_500_000


def test_memory_and_throttling_parsers_on_both_layouts_and_bad_values(tmp_path: Path) -> None:
    # v1 without hierarchical totals: the local keys, "cache" being the first line.
    write(tmp_path / "flat/memory.stat", "cache 7\nrss 1\ninactive_anon 2\nactive_anon 3\nunevictable 4\n")
    assert read_memory(tmp_path / "flat", 1) == MemoryUsage(used=9, cache=7)
    # v2: "anon" is the first line; "file" is the cache.
    write(tmp_path / "v2/memory.stat", "anon 100\nfile 50\nkernel 3\nunevictable 1\nfile_mapped 9\n")
    assert read_memory(tmp_path / "v2", 2) == MemoryUsage(used=101, cache=50)
    write(tmp_path / "bad/memory.stat", "cache 1\ntotal_inactive_anon 1\ntotal_active_anon 2\n"
                                        "total_unevictable 0\ntotal_cache 12x\n")
    with pytest.raises(ReadError, match=r"total_cache: '12x' is not an integer"):
        read_memory(tmp_path / "bad", 1)
    # v1 cpu.stat starts with the CFS counters; a v2 one has them after the usage lines.
    write(tmp_path / "v1/cpu.stat", "nr_periods 40\nnr_throttled 4\nthrottled_time 9\n")
    assert read_throttling(tmp_path / "v1") == (40, 4)
    write(tmp_path / "v2/cpu.stat", "usage_usec 9\nuser_usec 5\nsystem_usec 4\nnr_periods 30\nnr_throttled 3\n")
    assert read_throttling(tmp_path / "v2") == (30, 3)
    write(tmp_path / "bad/cpu.stat", "nr_periods 4O\nnr_throttled 3\n")
    with pytest.raises(ReadError, match=r"nr_periods: '4O' is not an integer"):
        read_throttling(tmp_path / "bad")


# --- samples and their order across ticks (the kept per-pod-list plan) ---------------


_POD_NAMES = (m.POD_CPU_USAGE, m.POD_MEMORY_USED, m.POD_MEMORY_CACHE, m.POD_CPU_THROTTLED)
_CONTAINER_NAMES = (m.CONTAINER_CPU_USAGE, m.CONTAINER_MEMORY_USED, m.CONTAINER_MEMORY_CACHE,
                    m.CONTAINER_CPU_THROTTLED)


def _set_target(tree: Tree, rel: str, k: int, tick: int) -> None:
    """Target ``k`` at ``tick``: k + 1 cores, k of every 10 CFS periods throttled,
    (k + 1 + tick) pages used and k + 1 pages of cache."""
    tree.usage(rel, (k + 1) * 10**9 * tick)
    tree.throttle(rel, 10 * tick, k * tick)
    tree.memory(rel, (k + 1 + tick) * PAGE_SIZE, 0, (k + 1) * PAGE_SIZE)


def _dirs(p: m.PodView) -> list[str]:
    return [p.cgroup_dir, *(c.cgroup_dir for c in p.containers)]


def _expected(pods: Sequence[m.PodView], index: dict[str, int], tick: int, seen: set[str]) -> list[m.Sample]:
    """What the collector reports at ``tick``, in order: per pod, the pod then its
    containers, each cpu, memory used, page cache, throttled (the rates only for
    targets read at the previous tick, listed in ``seen``)."""
    out: list[m.Sample] = []
    for p in pods:
        targets = [(p.cgroup_dir, m.labels(pod_uid=p.uid), _POD_NAMES)]
        targets += [(c.cgroup_dir, m.labels(pod_uid=p.uid, container_id=c.id), _CONTAINER_NAMES)
                    for c in p.containers]
        for rel, lbl, (cpu, used, cache, throttled) in targets:
            k = index[rel]
            rates = rel in seen
            if rates:
                out.append(m.Sample(cpu, float(k + 1), lbl))
            out.append(m.Sample(used, float((k + 1 + tick) * PAGE_SIZE), lbl))
            out.append(m.Sample(cache, float((k + 1) * PAGE_SIZE), lbl))
            if rates:
                out.append(m.Sample(throttled, k / 10, lbl))
    return out


def test_samples_keep_their_values_and_order_across_ticks_and_pod_set_changes(tree: Tree) -> None:
    clock = Clock()
    c = collector(tree, clock)
    a = pod("c1", "c2", uid="a", pod_dir="kubepods/poda")
    b = pod("c3", uid="b", pod_dir="kubepods/podb")
    cc = pod("c4", uid="c", pod_dir="kubepods/podc")
    d = pod("c5", uid="d", pod_dir="kubepods/podd")
    every = [a, b, cc, d]
    index = {rel: k for k, rel in enumerate(r for p in every for r in _dirs(p))}
    pods = [a, b, cc]
    seen: set[str] = set()
    for tick, listed in enumerate([pods, pods, list(pods), [cc, d, pod("c1", "c2", uid="a", pod_dir="kubepods/poda")],
                                   [cc, d]], start=1):
        clock.t = 100.0 + tick
        for rel, k in index.items():
            _set_target(tree, rel, k, tick)
        samples = c.collect(clock.t, listed)
        assert samples == _expected(listed, index, tick, seen), tick
        assert all(type(s) is m.Sample and s.ts == 0.0 for s in samples)
        latest = c.latest()
        assert latest.cpu == {p.uid: float(index[p.cgroup_dir] + 1) for p in listed if p.cgroup_dir in seen}
        assert latest.cpu_complete == all(p.cgroup_dir in seen for p in listed)
        assert latest.memory_complete
        seen = {r for p in listed for r in _dirs(p)}
