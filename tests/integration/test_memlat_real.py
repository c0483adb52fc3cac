"""Memory allocation latency on the real kernel: a container under a tight memory limit that
keeps allocating stalls in memcg reclaim; an idle one does not.

No containerd: like test_schedlat_real.py the test makes its own container-like cgroups
(``koord-test-<uuid>/{busy,idle}`` in the v1 memory hierarchy and in the unified tree). The
busy one has a 32 MiB limit (this machine has no swap, so anonymous memory would get it
OOM-killed): it writes a 96 MiB file and reads it over and over with busybox dd, so its page
cache keeps hitting the limit and the kernel reclaims on every read. The idle one sleeps.
Both sources measure the same window: eBPF (stall time, memcg_reclaim) and the counters
(memory.failcnt rate). Everything started is killed by pid; the cgroups are removed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hooks.qos import QoSClass
from metrics import model as m
from metrics.collect.memlat import MemLatencyCollector, Prefer
from runtimeproxy.demo.embeddedcgroup import remove_cgroup_tree
from runtimeproxy.hookapi import HostRoots

CGROUP = Path("/sys/fs/cgroup")
BUSYBOX = "/bin/busybox"
LIMIT = 32 * 2**20
WINDOW = 3.0  # seconds per measurement
# Write a file three times the limit, then read it forever: every read charges page cache
# past the limit, and the kernel reclaims the container's older pages to make room.
CHURN = ("dd if=/dev/zero of={f} bs=1048576 count=96 2>/dev/null; "
         "while true; do dd if={f} of=/dev/null bs=1048576 2>/dev/null; done")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (CGROUP / "memory").is_dir() or not (CGROUP / "unified/cgroup.procs").is_file()
    or not Path(BUSYBOX).is_file(),
    reason="needs root, busybox-static and a hybrid cgroup host (/sys/fs/cgroup/memory and /sys/fs/cgroup/unified)",
)


def _start_in(dirs: list[Path], script: str) -> subprocess.Popen[bytes]:
    def enter() -> None:  # in the child, before exec: it allocates nothing outside its cgroups
        for d in dirs:
            (d / "cgroup.procs").write_text(f"{os.getpid()}\n")
    return subprocess.Popen([BUSYBOX, "sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            preexec_fn=enter)


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[m.PodView]:
    parent = f"koord-test-{uuid.uuid4().hex[:12]}"
    data = tmp_path_factory.mktemp("memlat") / "churn"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name in ("busy", "idle", "compact"):
            dirs = [CGROUP / "unified" / parent / name, CGROUP / "memory" / parent / name]
            for d in dirs:
                d.mkdir(parents=True)
            if name == "compact":  # its task is started by the test that needs it
                continue
            if name == "busy":
                (dirs[1] / "memory.limit_in_bytes").write_text(f"{LIMIT}\n")
            procs.append(_start_in(dirs, CHURN.format(f=data) if name == "busy" else "exec sleep 600"))
        time.sleep(1.0)  # the busy one has written its file and reads it
        assert all(p.poll() is None for p in procs), "a workload died (OOM-killed?)"
        yield m.PodView(uid="pod-1", namespace="test", name="memlat", sandbox_id="sb", qos=QoSClass.LS,
                        priority=0, priority_class="koord-prod", cgroup_dir=parent,
                        containers=tuple(m.ContainerView(id=n, name=n, cgroup_dir=f"{parent}/{n}")
                                         for n in ("busy", "idle", "compact")))
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        remove_cgroup_tree(parent, CGROUP)
        data.unlink(missing_ok=True)


Measured = dict[tuple[str, str, str], float]


def _measure(pod: m.PodView, prefer: Prefer, during: Callable[[], None] = lambda: time.sleep(WINDOW)
             ) -> tuple[MemLatencyCollector, Measured]:
    collector = MemLatencyCollector(HostRoots(), prefer=prefer, interval=WINDOW)
    try:
        collector.collect(0, [pod])  # start (eBPF: load) and prime
        during()
        out = {(s.metric, dict(s.labels).get("container_id", ""), dict(s.labels).get(m.KIND, "")): s.value
               for s in collector.collect(1, [pod])}
        return collector, out
    finally:
        collector.close()


def test_ebpf_busy_container_stalls_in_memcg_reclaim_idle_one_does_not(pod: m.PodView) -> None:
    collector, got = _measure(pod, "ebpf")
    if collector.source is None:
        pytest.skip(f"eBPF source unavailable: {collector.reason}")
    stall = m.CONTAINER_MEMORY_ALLOC_STALL
    assert got[(stall, "busy", "memcg_reclaim")] > 0, got
    assert got[(m.CONTAINER_MEMORY_ALLOC_STALLS, "busy", "memcg_reclaim")] > 1, got
    mean = got[(m.CONTAINER_MEMORY_ALLOC_LATENCY, "busy", "memcg_reclaim")]
    p99 = got[(m.CONTAINER_MEMORY_ALLOC_LATENCY_P99, "busy", "memcg_reclaim")]
    assert 0 < mean <= p99, got
    for kind in ("direct_reclaim", "memcg_reclaim", "compaction"):
        assert got[(stall, "idle", kind)] == 0.0, got
        assert (m.CONTAINER_MEMORY_ALLOC_LATENCY, "idle", kind) not in got, got
    assert "bcc" not in sys.modules  # compiled by the loader child


def test_counters_busy_container_hits_its_limit_idle_one_does_not(pod: m.PodView) -> None:
    collector, got = _measure(pod, "counters")
    assert collector.source == "counters", collector.reason
    hits = m.CONTAINER_MEMORY_ALLOC_STALLS
    assert got[(hits, "busy", "memcg_reclaim")] > 1, got
    assert got[(hits, "idle", "memcg_reclaim")] == 0.0, got
    assert (m.NODE_MEMORY_ALLOC_STALLS, "", "direct_reclaim") in got, got


def test_ebpf_compaction_is_charged_to_the_cgroup_that_ran_it(pod: m.PodView) -> None:
    """Writing vm.compact_memory compacts every zone in the writer's context (~1 s of CPU
    here, once): the same begin/end tracepoints as a direct compaction for an allocation."""
    parent = pod.cgroup_dir

    def compact() -> None:
        dirs = [CGROUP / "unified" / parent / "compact", CGROUP / "memory" / parent / "compact"]
        proc = _start_in(dirs, "echo 1 > /proc/sys/vm/compact_memory")
        assert proc.wait(timeout=60) == 0

    collector, got = _measure(pod, "ebpf", compact)
    if collector.source is None:
        pytest.skip(f"eBPF source unavailable: {collector.reason}")
    assert got[(m.CONTAINER_MEMORY_ALLOC_STALL, "compact", "compaction")] > 0, got
    assert got[(m.CONTAINER_MEMORY_ALLOC_STALLS, "compact", "compaction")] > 0, got
    assert got[(m.CONTAINER_MEMORY_ALLOC_STALL, "idle", "compaction")] == 0.0, got
