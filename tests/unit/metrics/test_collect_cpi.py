"""CPI: the hardware-counter probe (for real on this host, and each errno branch) and the
collector's behaviour when counters are unavailable. The counting path itself needs a
PMU, which this VM does not have."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hooks.qos import QoSClass
from metrics import model as m
from metrics.collect.cpi import CPICollector, PerfEventAttr, Probe, probe_hardware_counters
from runtimeproxy.hookapi import HostRoots

POD_DIR = "kubepods/podu1"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def pod() -> m.PodView:
    return m.PodView(uid="u1", namespace="ns", name="p", sandbox_id="sb", qos=QoSClass.LS, priority=0,
                     priority_class="koord-prod", cgroup_dir=POD_DIR,
                     containers=(m.ContainerView(id="c1", name="app", cgroup_dir=POD_DIR + "/c1"),))


def hybrid(tmp_path: Path) -> HostRoots:
    roots = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys")
    (roots.cgroup / "cpu").mkdir(parents=True)
    write(roots.cgroup / "unified/cgroup.procs", "")
    write(roots.sys / "devices/system/cpu/online", "0-1\n")
    return roots


def failing(code: int) -> Callable[[int, int, int], int]:
    def opener(config: int, pid: int, cpu: int) -> int:
        raise OSError(code, os.strerror(code))

    return opener


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_attr_struct_has_the_kernel_ver5_size() -> None:
    assert ctypes.sizeof(PerfEventAttr) == 112


def test_real_probe_says_whether_and_why() -> None:
    probe = probe_hardware_counters()
    if probe.available:
        assert probe.reason == "hardware cycle counter opened"
    else:
        # this VM: ENOENT (no vPMU); elsewhere EACCES / EOPNOTSUPP... always named
        assert probe.reason.startswith("perf_event_open(cycles) failed with E")


@pytest.mark.parametrize(("code", "words"), [
    (errno.ENOENT, "ENOENT: the CPU or hypervisor exposes no hardware cycle counter"),
    (errno.EOPNOTSUPP, "hardware counters are not supported here"),  # Linux names it ENOTSUP
    (errno.EACCES, "EACCES: perf_event_paranoid forbids"),
    (errno.EINVAL, "EINVAL: Invalid argument"),
])
def test_probe_reasons(code: int, words: str) -> None:
    probe = probe_hardware_counters(failing(code))
    assert not probe.available
    assert words in probe.reason


def test_probe_success_closes_its_fd() -> None:
    before = open_fds()
    probe = probe_hardware_counters(lambda config, pid, cpu: os.open(os.devnull, os.O_RDONLY))
    assert probe == Probe(True, "hardware cycle counter opened")
    assert open_fds() == before


def test_unavailable_collector_logs_the_reason_once_and_returns_nothing(tmp_path: Path) -> None:
    slept: list[float] = []
    with capture_logs() as logs:
        collector = CPICollector(hybrid(tmp_path), sleep=slept.append,
                                 probe=lambda: probe_hardware_counters(failing(errno.ENOENT)))
        for tick in range(3):
            assert collector.collect(tick, [pod()]) == []
    assert not collector.available and "ENOENT" in collector.reason
    assert [(e["event"], e["available"]) for e in logs] == [("cpi_collector", False)]
    assert slept == []


def test_containers_whose_counters_cannot_open_are_skipped_without_leaking(tmp_path: Path) -> None:
    roots = hybrid(tmp_path)
    (roots.cgroup / "unified" / POD_DIR / "c1").mkdir(parents=True)  # a plain dir, not a cgroup
    slept: list[float] = []
    collector = CPICollector(roots, sleep=slept.append, probe=lambda: Probe(True, "forced for the test"))
    before = open_fds()
    with capture_logs() as logs:
        assert collector.collect(0, [pod()]) == []
        assert collector.collect(1, [pod()]) == []
    assert open_fds() == before
    assert slept == []  # nothing opened: no counting window
    assert len(logs) == 1 and "perf_event_open" in logs[0]["reason"]


def test_missing_container_cgroup_is_skipped(tmp_path: Path) -> None:
    collector = CPICollector(hybrid(tmp_path), sleep=lambda s: None, probe=lambda: Probe(True, "forced"))
    with capture_logs() as logs:
        assert collector.collect(0, [pod()]) == []
    assert [(e["event"], e["log_level"]) for e in logs] == [("sample_skipped", "info")]
