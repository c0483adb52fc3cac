"""The collectors' one-call parses give what the line-by-line parses give (memory.numa_stat's:
test_collect_cgroupfs), and the pod collector's memory figures follow its file when it changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from hooks.qos import QoSClass
from metrics import model as m
from metrics.collect.base import ReadError
from metrics.collect.cgroupfs import PAGE_SIZE, PodCollector
from metrics.collect.procfs import _ticks, parse_stat
from metrics.collect.psi import _parse, _parse_lines
from runtimeproxy.hookapi import HostRoots


def outcome(parse: object, data: bytes) -> object:
    try:
        return parse(data, "/x/cpu.pressure")  # type: ignore[operator]
    except ReadError as exc:
        return str(exc)


@pytest.mark.parametrize("data", [
    b"some avg10=0.62 avg60=6.45 avg300=9.93 total=216093538\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    b"some avg10=100.00 avg60=0.01 avg300=12.50 total=1\n",  # cpu before 5.13: no full line
    b"some avg10=1.00 avg60=2.00 avg300=3.00 total=4\nfull avg10=5.00 avg60=6.00 avg300=7.00 total=8",  # no \n
    b"full avg10=5.00 avg60=6.00 avg300=7.00 total=8\nsome avg10=1.00 avg60=2.00 avg300=3.00 total=4\n",
    b"some avg10=1 avg60=2.00 avg300=3.00 total=4\n",
    b"some avg60=2.00 avg10=1.00 avg300=3.00 total=4\n",
    b"some avg10=1.00 avg60=2.00 avg300=3.00 total=4\n\nfull avg10=5.00 avg60=6.00 avg300=7.00 total=8\n",
    b"some avg10=1.00 avg60=2.00 avg300=3.00 total=4\nfull avg10=x avg60=6.00 avg300=7.00 total=8\n",
    b"some avg10=1.00 avg60=2.00 avg300=3.00 total=4\nweird 1\n",
    b"some avg10=1.00 avg60=2.00 avg300=3.00 total=-4\n",
    b"",
], ids=lambda d: str(len(d)))
def test_pressure_file_matched_in_one_call_as_line_by_line(data: bytes) -> None:
    assert outcome(_parse, data) == outcome(_parse_lines, data)


def numa_stat(anon: int, file: int) -> str:
    return (f"total={anon + file} N0={anon + file}\nhierarchical_total={anon + file} N0={anon + file}\n"
            f"hierarchical_file={file} N0={file}\nhierarchical_anon={anon} N0={anon}\n"
            f"hierarchical_unevictable=0 N0=0\n")


def test_pod_memory_follows_its_file_and_a_returning_pod_starts_afresh(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    for controller in ("cpu", "cpuacct", "cpuset", "memory"):
        (root / controller / "pods/p1").mkdir(parents=True)
    (root / "memory/memory.numa_stat").write_text(numa_stat(0, 0))
    (root / "cpuacct/pods/p1/cpuacct.usage").write_text("100\n")
    (root / "cpu/pods/p1/cpu.cfs_quota_us").write_text("-1\n")
    memory = root / "memory/pods/p1/memory.numa_stat"
    pod = m.PodView(uid="u1", namespace="ns", name="p", sandbox_id="sb", qos=QoSClass.LS, priority=0,
                    priority_class="", cgroup_dir="pods/p1")
    collector = PodCollector(HostRoots(cgroup=root, proc=tmp_path / "none", sys=tmp_path / "none"))
    used = m.labels(pod_uid="u1")

    def figures(pods: list[m.PodView]) -> tuple[float, float]:
        got = {s.metric: s.value for s in collector.collect(0.0, pods) if s.labels == used}
        return got[m.POD_MEMORY_USED], got[m.POD_MEMORY_CACHE]

    memory.write_text(numa_stat(anon=3, file=5))
    assert figures([pod]) == (3 * PAGE_SIZE, 5 * PAGE_SIZE)
    assert figures([pod]) == (3 * PAGE_SIZE, 5 * PAGE_SIZE)
    memory.write_text(numa_stat(anon=4, file=5))
    assert figures([pod]) == (4 * PAGE_SIZE, 5 * PAGE_SIZE)
    memory.write_text("hierarchical_anon=x\n")  # unparsable: no memory samples, not the last figures
    assert not [s for s in collector.collect(0.0, [pod]) if s.metric == m.POD_MEMORY_USED]
    collector.collect(0.0, [])
    assert not collector._memory
    memory.write_text(numa_stat(anon=4, file=5))
    assert figures([pod]) == (4 * PAGE_SIZE, 5 * PAGE_SIZE)
    collector.close()


def parse_stat_by_splitting_every_line(text: str) -> tuple[object, dict[int, object]]:
    """parse_stat as it was: every line split, then kept when its first field is a cpu's."""
    total = None
    per_cpu: dict[int, object] = {}
    for line in text.splitlines():
        fields = line.split()
        if not fields or not fields[0].startswith("cpu"):
            continue
        ticks = _ticks(fields[1:], Path("/proc/stat"))
        if fields[0] == "cpu":
            total = ticks
        else:
            per_cpu[int(fields[0][3:])] = ticks
    return total, per_cpu


@pytest.mark.parametrize("text", [
    "cpu  10 1 5 100 2 1 1 0 0 0\ncpu0 5 1 2 50 1 1 1 0 0 0\ncpu1 5 0 3 50 1 0 0 0 0 0\n"
    "intr 123 " + " ".join(["0"] * 500) + "\nctxt 5\nsoftirq 9 1 2 3\n",
    "cpu 1 2 3 4 5 6 7 8\n  cpu3 1 2 3 4 5 6 7 8\n\t\u2003cpu4 1 2 3 4 5 6 7 8\n\n   \nintr 1 2\n",
    "cpufreq\ncpu 1 2 3 4 5 6 7 8\n",
], ids=["proc", "indented", "cpu-named-line"])
def test_stat_lines_skipped_before_the_split_as_after_it(text: str) -> None:
    try:
        stat: object = parse_stat(text, Path("/proc/stat"))
        got: object = (stat.total, dict(stat.per_cpu))  # type: ignore[attr-defined]
    except ReadError as exc:
        got = str(exc)
    try:
        want: object = parse_stat_by_splitting_every_line(text)
    except ReadError as exc:
        want = str(exc)
    assert got == want
