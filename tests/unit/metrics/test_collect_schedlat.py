"""Schedule latency: the schedstat source on fixture /proc + cgroup trees, source selection,
and the log2-histogram percentile of the eBPF source."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hooks.qos import QoSClass
from metrics import model as m
from metrics.collect import ebpf
from metrics.collect.base import SourceUnavailable
from metrics.collect.ebpf import EbpfSource, log2_percentile
from metrics.collect.schedlat import SchedLatencyCollector
from metrics.collect.schedstat import SchedstatSource, mean_wait
from runtimeproxy.hookapi import HostRoots

POD_DIR = "kubepods/podu1"
C1 = m.labels(pod_uid="u1", container_id="c1", source="schedstat")


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def pod(*containers: str) -> m.PodView:
    return m.PodView(uid="u1", namespace="ns", name="p", sandbox_id="sb", qos=QoSClass.LS, priority=0,
                     priority_class="koord-prod", cgroup_dir=POD_DIR,
                     containers=tuple(m.ContainerView(id=c, name=c, cgroup_dir=f"{POD_DIR}/{c}") for c in containers))


class Host:
    """Fixture /proc (threads with schedstat) and a hybrid cgroup root."""

    def __init__(self, tmp_path: Path, *, v2: bool = False) -> None:
        self.roots = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys")
        self.v2 = v2
        if v2:
            write(self.roots.cgroup / "cgroup.controllers", "cpu\n")
        else:
            (self.roots.cgroup / "cpu").mkdir(parents=True)
            write(self.roots.cgroup / "unified/cgroup.procs", "")
        write(self.roots.proc / "self/schedstat", "1 2 3\n")

    def procs(self, container: str, *pids: int, hierarchy: str = "cpu") -> None:
        base = self.roots.cgroup if self.v2 else self.roots.cgroup / hierarchy
        write(base / POD_DIR / container / "cgroup.procs", "".join(f"{p}\n" for p in pids))

    def threads(self, pid: int, stats: dict[int, tuple[int, int]]) -> None:
        """tid -> (wait ns, timeslices); replaces the process's thread list."""
        task = self.roots.proc / str(pid) / "task"
        if task.exists():
            for old in task.iterdir():
                (old / "schedstat").unlink()
                old.rmdir()
        for tid, (wait, slices) in stats.items():
            write(task / str(tid) / "schedstat", f"{wait * 3} {wait} {slices}\n")


def containers(p: m.PodView) -> list[tuple[m.PodView, m.ContainerView]]:
    return [(p, c) for c in p.containers]


def test_mean_wait_counts_only_threads_seen_twice() -> None:
    prev = {10: (1000, 10), 11: (500, 5), 13: (900, 9)}
    cur = {10: (3000, 20), 12: (9_000_000_000, 1), 13: (10, 1)}  # 11 exited, 12 is new, 13's tid was reused
    stat = mean_wait(prev, cur)
    assert stat is not None
    assert stat.mean == pytest.approx(2000 / 10 / 1e9)
    assert stat.events == 10
    assert mean_wait({10: (5, 5)}, {10: (5, 5)}) is None  # not scheduled: no value, not zero


def test_schedstat_source_sums_over_processes_and_threads(tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.procs("c1", 100, 200)
    host.threads(100, {100: (1_000, 1), 101: (0, 0)})
    host.threads(200, {200: (50_000, 10)})
    source = SchedstatSource(host.roots)
    source.start()
    assert source.sample(containers(pod("c1"))) == {}  # baseline
    host.threads(100, {100: (4_000, 3), 101: (6_000, 2), 102: (1, 1)})  # 102 appeared
    host.threads(200, {200: (56_000, 14)})
    stats = source.sample(containers(pod("c1")))
    # waits: 3000 + 6000 + 6000 over 2 + 2 + 4 slices
    assert stats["c1"].mean == pytest.approx(15_000 / 8 / 1e9)
    assert stats["c1"].p99 is None


def test_schedstat_source_handles_exited_processes_and_vanished_cgroups(tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.procs("c1", 100, 999)  # 999 has already exited: no /proc/999
    host.threads(100, {100: (0, 0)})
    source = SchedstatSource(host.roots)
    with capture_logs() as logs:
        for _ in range(3):
            source.sample(containers(pod("c1", "gone")))
        host.threads(100, {100: (2_000, 4)})
        stats = source.sample(containers(pod("c1", "gone")))
    assert stats["c1"].mean == pytest.approx(500e-9)
    assert "gone" not in stats
    assert [e["event"] for e in logs] == ["sample_skipped"]  # once for the missing cgroup, not per tick


def test_schedstat_source_falls_back_to_the_unified_cgroup(tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.procs("c1", 100, hierarchy="unified")
    host.threads(100, {100: (0, 0)})
    source = SchedstatSource(host.roots)
    source.sample(containers(pod("c1")))
    host.threads(100, {100: (300, 3)})
    assert source.sample(containers(pod("c1")))["c1"].mean == pytest.approx(100e-9)


def test_schedstat_source_on_v2_and_garbled_schedstat(tmp_path: Path) -> None:
    host = Host(tmp_path, v2=True)
    host.procs("c1", 100)
    host.threads(100, {100: (0, 0), 101: (0, 0)})
    source = SchedstatSource(host.roots)
    source.sample(containers(pod("c1")))
    host.threads(100, {100: (700, 7), 101: (0, 0)})
    write(host.roots.proc / "100/task/101/schedstat", "not a schedstat\n")
    with capture_logs() as logs:
        stats = source.sample(containers(pod("c1")))
    assert stats["c1"].mean == pytest.approx(100e-9)
    assert [(e["event"], e["log_level"]) for e in logs] == [("sample_skipped", "warning")]


def test_schedstat_source_unavailable_without_schedstat(tmp_path: Path) -> None:
    host = Host(tmp_path)
    (host.roots.proc / "self/schedstat").unlink()
    with pytest.raises(SourceUnavailable, match="CONFIG_SCHED_INFO"):
        SchedstatSource(host.roots).start()


def test_auto_falls_back_to_schedstat_and_says_why_once(tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.procs("c1", 100)
    host.threads(100, {100: (0, 0)})
    collector = SchedLatencyCollector(host.roots, prefer="auto", interval=1.0)
    with capture_logs() as logs:
        assert collector.collect(0, [pod("c1")]) == []
        host.threads(100, {100: (1_000, 2)})
        samples = collector.collect(1, [pod("c1")])
    assert collector.source == "schedstat"
    assert [(s.metric, s.labels) for s in samples] == [(m.CONTAINER_SCHED_LATENCY, C1)]
    assert samples[0].value == pytest.approx(500e-9)
    choices = [e for e in logs if e["event"] == "schedlat_source"]
    assert len(choices) == 1
    assert choices[0]["source"] == "schedstat"
    # the fixture /sys has no tracefs (or this host has no bcc): the reason names eBPF's problem
    assert choices[0]["reason"].startswith("ebpf: ")


def test_prefer_ebpf_does_not_fall_back(tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.procs("c1", 100)
    host.threads(100, {100: (0, 0)})
    collector = SchedLatencyCollector(host.roots, prefer="ebpf")
    with capture_logs() as logs:
        for tick in range(3):
            assert collector.collect(tick, [pod("c1")]) == []
    assert collector.source is None
    assert collector.unavailable_reason is not None and collector.unavailable_reason.startswith("ebpf: ")
    assert [(e["event"], e["source"]) for e in logs] == [("schedlat_source", "none")]


def test_prefer_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="auto, ebpf, schedstat"):
        SchedLatencyCollector(Host(tmp_path).roots, prefer="bpf")  # type: ignore[arg-type]


def test_ebpf_source_without_tracefs_or_v2_says_why(tmp_path: Path) -> None:
    host = Host(tmp_path)
    with pytest.raises(SourceUnavailable) as info:
        EbpfSource(host.roots).start()
    assert "tracefs" in info.value.reason or "bcc" in info.value.reason
    pure_v1 = HostRoots(cgroup=tmp_path / "v1", proc=host.roots.proc, sys=host.roots.sys)
    (pure_v1.cgroup / "cpu").mkdir(parents=True)
    with pytest.raises(SourceUnavailable) as info:
        EbpfSource(pure_v1).start()
    assert "cgroup v2" in info.value.reason or "bcc" in info.value.reason


def test_log2_percentile_returns_the_slot_upper_bound() -> None:
    # slot k holds [2^(k-1), 2^k) ns
    assert log2_percentile({}, 0.99) is None
    assert log2_percentile({10: 100}, 0.99) == 2**10 / 1e9
    hist = {10: 98, 20: 1, 25: 1}
    assert log2_percentile(hist, 0.99) == 2**20 / 1e9  # the 99th of 100 is in slot 20
    assert log2_percentile(hist, 0.5) == 2**10 / 1e9
    assert log2_percentile({10: 989, 25: 11}, 0.99) == 2**25 / 1e9


LOADERS = {
    "silent": "import sys\nsys.stderr.write('clang: fatal error: no headers\\n')\nsys.exit(3)\n",
    "refuses": "import json, socket, sys\nsocket.socket(fileno=int(sys.argv[1])).sendall("
               "json.dumps({'error': 'Failed to compile BPF module'}).encode())\n",
    "garbage": "import socket, sys\nsocket.socket(fileno=int(sys.argv[1])).sendall(b'not json')\n",
    "hangs": "import time\ntime.sleep(60)\n",
}


@pytest.mark.parametrize(("name", "reason"), [
    ("silent", "exited 3 without an answer: clang: fatal error: no headers"),
    ("refuses", "bcc could not compile or attach the program: Failed to compile BPF module"),
    ("garbage", "answered garbage: b'not json'"),
    ("hangs", "did not answer within 1s"),
])
def test_a_failing_loader_child_is_a_reason_not_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        name: str, reason: str) -> None:
    (tmp_path / f"fake_loader_{name}.py").write_text(LOADERS[name])
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    # The timeout covers the child's interpreter start-up, which can take seconds on a
    # loaded machine: only the hanging child gets the short one its reason names.
    timeout = 1.0 if name == "hangs" else 10.0
    started = time.monotonic()
    with pytest.raises(SourceUnavailable) as info:
        ebpf._run_loader(timeout, module=f"fake_loader_{name}")
    assert reason in info.value.reason
    assert time.monotonic() - started < 10  # the hanging child was killed, not waited for


def test_cgroup_ids_are_looked_up_once_per_container_and_follow_the_container_list(tmp_path: Path) -> None:
    from metrics.collect.base import OnceLog
    from metrics.collect.cgroupfs import CgroupReader
    from metrics.collect.ebpf import CgroupIds

    host = Host(tmp_path)
    unified = host.roots.cgroup / "unified" / POD_DIR
    (unified / "c1").mkdir(parents=True)
    ids = CgroupIds(CgroupReader(host.roots.cgroup), OnceLog(ebpf.log))
    p = pod("c1", "c2")
    first = ids.of([(p, c) for c in p.containers])
    assert first == {"c1": (unified / "c1").stat().st_ino}  # c2 has no cgroup yet: no id, no crash
    # c1's id is not looked up again (its directory may even be gone: the id stays the
    # container's until it leaves the list); c2's is, now that it exists.
    (unified / "c1").rmdir()
    (unified / "c2").mkdir()
    second = ids.of([(p, c) for c in p.containers])
    assert second == {"c1": first["c1"], "c2": (unified / "c2").stat().st_ino}
    # A container that left the list is forgotten: back with its cgroup recreated, it is looked up anew.
    assert ids.of([(p, p.containers[1])]) == {"c2": second["c2"]}
    (unified / "c1").mkdir()
    assert ids.of([(p, p.containers[0])]) == {"c1": (unified / "c1").stat().st_ino}
