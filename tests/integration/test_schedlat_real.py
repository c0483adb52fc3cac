"""Schedule latency on the real kernel: both sources see run-queue waits rise under CPU contention.

No containerd: the test makes its own container-like cgroups (``koord-test-<uuid>/c1`` in
the v1 cpu hierarchy and in the v2 / unified tree), puts a child that sleeps briefly
and spins in them, and measures once idle and once while extra spinning processes
(outside the cgroup) compete with it. Everything it starts it kills by pid; the
cgroups are removed afterwards.

Robust on a busy host by construction: the child and the hogs are pinned to one CPU
(an affinity mask, the cpuset the kernel schedules them in) and their cgroups weighted
above everything else there: the test's parent cgroup has the most ``cpu.shares``
(256x a default group: what the host runs beside the test barely delays the child,
the idle window stays idle); inside it the hogs' group has 10x the child's (the busy
window's waits are theirs).

tracefs is needed for the eBPF source; scripts/setup-host.sh (run by CI) mounts it where it
is missing. Without it (or without bcc/headers) the eBPF test skips, naming the reason.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hooks.qos import QoSClass
from metrics import model as m
from metrics.collect.schedlat import Prefer, SchedLatencyCollector
from runtimeproxy.demo.embeddedcgroup import remove_cgroup_tree
from runtimeproxy.hookapi import HostRoots

CGROUP = Path("/sys/fs/cgroup")
WINDOW = 2.0  # seconds per measurement
HOGS = 3  # spinning processes on the child's CPU
# Sleep 1 ms, spin ~2 ms, forever: many wakeups (eBPF) and many timeslices (schedstat).
CHILD = "import time\nwhile True:\n    time.sleep(0.001)\n    end = time.perf_counter() + 0.002\n" \
        "    while time.perf_counter() < end:\n        pass\n"
HOG = "while True:\n    pass\n"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (CGROUP / "cpu").is_dir() or not (CGROUP / "unified/cgroup.procs").is_file(),
    reason="needs root and a hybrid cgroup host (/sys/fs/cgroup/cpu and /sys/fs/cgroup/unified)",
)


#: The CPU the child and the hogs share (the last one this process may use).
CPU = max(os.sched_getaffinity(0))
PARENT_SHARES = 262144  # the kernel's maximum
HOG_SHARES = 10240


def _start(code: str) -> subprocess.Popen[bytes]:
    # taskset execs in the same pid: pinned from the first instruction.
    argv = ["taskset", "-c", str(CPU), sys.executable, "-c", code]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _wait_running(procs: list[subprocess.Popen[bytes]]) -> None:
    """Until every hog has spun a few clock ticks (they compete now, not still starting)."""
    deadline = time.monotonic() + 30
    while not all(_cpu_ticks(p.pid) >= 5 for p in procs):
        assert time.monotonic() < deadline, "the hogs did not start spinning"
        time.sleep(0.01)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def container() -> Iterator[m.PodView]:
    parent = f"koord-test-{uuid.uuid4().hex[:12]}"
    dirs = [CGROUP / "unified" / parent / "c1", CGROUP / "cpu" / parent / "c1"]
    for d in dirs:
        d.mkdir(parents=True)
    (CGROUP / "cpu" / parent / "cpu.shares").write_text(f"{PARENT_SHARES}\n")
    (CGROUP / "cpu" / parent / "hogs").mkdir()
    (CGROUP / "cpu" / parent / "hogs" / "cpu.shares").write_text(f"{HOG_SHARES}\n")
    child = _start(CHILD)
    try:
        for d in dirs:
            (d / "cgroup.procs").write_text(f"{child.pid}\n")
        yield m.PodView(uid="pod-1", namespace="test", name="schedlat", sandbox_id="sb", qos=QoSClass.LS,
                        priority=0, priority_class="koord-prod", cgroup_dir=parent,
                        containers=(m.ContainerView(id="c1", name="spinner", cgroup_dir=f"{parent}/c1"),))
    finally:
        _stop(child)
        remove_cgroup_tree(parent, CGROUP)


@dataclass(frozen=True)
class Result:
    idle: float | None
    busy: float | None
    busy_p99: float | None
    unavailable: str | None


def _series(samples: list[m.Sample], source: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in samples:
        assert dict(s.labels) == {"pod_uid": "pod-1", "container_id": "c1", "source": source}
        out[s.metric] = s.value
    return out


@pytest.fixture(scope="module")
def measured(container: m.PodView) -> dict[str, Result]:
    """Both sources over the same two windows: idle, then with hogs."""
    sources: tuple[Prefer, ...] = ("schedstat", "ebpf")
    collectors = {name: SchedLatencyCollector(HostRoots(), prefer=name) for name in sources}
    try:
        for c in collectors.values():
            c.collect(0, [container])  # start the source and take the baseline
        time.sleep(WINDOW)
        idle = {name: _series(c.collect(1, [container]), name) for name, c in collectors.items()}
        hogs = [_start(HOG) for _ in range(HOGS)]
        try:
            for hog in hogs:
                (CGROUP / "cpu" / container.cgroup_dir / "hogs" / "cgroup.procs").write_text(f"{hog.pid}\n")
            _wait_running(hogs)
            for c in collectors.values():
                c.collect(2, [container])  # drop the ramp-up
            time.sleep(WINDOW)
            busy = {name: _series(c.collect(3, [container]), name) for name, c in collectors.items()}
        finally:
            for hog in hogs:
                _stop(hog)
        mean, p99 = m.CONTAINER_SCHED_LATENCY, m.CONTAINER_SCHED_LATENCY_P99
        return {name: Result(idle[name].get(mean), busy[name].get(mean), busy[name].get(p99), c.unavailable_reason)
                for name, c in collectors.items()}
    finally:
        for c in collectors.values():
            c.close()


def _assert_rises(result: Result) -> None:
    assert result.idle is not None and result.busy is not None, result
    assert result.busy > 2 * result.idle, result
    assert result.busy > 100e-6, result  # three heavier hogs on its CPU: waits of milliseconds


def test_schedstat_latency_rises_under_contention(measured: dict[str, Result]) -> None:
    _assert_rises(measured["schedstat"])
    assert measured["schedstat"].busy_p99 is None  # no histogram from schedstat


def test_ebpf_latency_rises_under_contention(measured: dict[str, Result]) -> None:
    result = measured["ebpf"]
    if result.unavailable is not None:
        pytest.skip(f"eBPF source unavailable: {result.unavailable}")
    _assert_rises(result)
    assert result.busy_p99 is not None and result.busy is not None
    assert result.busy_p99 >= result.busy, result
    # Compiled by the loader child: LLVM never entered this process.
    assert "bcc" not in sys.modules
