"""Cycles per instruction per container, from hardware counters in cgroup mode.

As koordlet does: every ``interval`` (60 s), open ``PERF_COUNT_HW_CPU_CYCLES`` and
``PERF_COUNT_HW_INSTRUCTIONS`` for each container's perf_event cgroup on each online
CPU (cgroup-mode events are per CPU), count for ``window`` (10 s), read, close. Counts
are scaled by time_enabled / time_running because the PMU multiplexes when there are
more events than counters.

Many VMs expose no PMU at all. ``probe_hardware_counters`` opens one cycles counter
on our own thread and turns the errno into a reason; when it fails the collector
logs that reason once and returns no samples.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from hooks.cpusets import CpuListError, read_online_cpus
from metrics.collect.base import OnceLog, ReadError, container_labels, os_error
from metrics.collect.cgroupfs import CgroupReader
from metrics.model import (
    CONTAINER_CPI,
    CONTAINER_CYCLES,
    CONTAINER_INSTRUCTIONS,
    ContainerView,
    PodView,
    Sample,
)
from runtimeproxy.errors import HostError
from runtimeproxy.hookapi import HostRoots

log = structlog.get_logger("metrics.cpi")

_SYSCALL: Final = {"x86_64": 298, "aarch64": 241}
PERF_TYPE_HARDWARE: Final = 0
PERF_COUNT_HW_CPU_CYCLES: Final = 0
PERF_COUNT_HW_INSTRUCTIONS: Final = 1
PERF_FORMAT_TOTAL_TIME_ENABLED: Final = 1
PERF_FORMAT_TOTAL_TIME_RUNNING: Final = 2
PERF_FLAG_PID_CGROUP: Final = 1 << 2
PERF_FLAG_FD_CLOEXEC: Final = 1 << 3
_EXCLUDE_HV: Final = 1 << 6  # attr flag bit: hypervisor time is not the container's


class PerfEventAttr(ctypes.Structure):
    """``struct perf_event_attr`` up to PERF_ATTR_SIZE_VER5 (112 bytes); the kernel
    accepts any size it knows and zero-fills the rest."""

    _fields_ = [
        ("type", ctypes.c_uint32), ("size", ctypes.c_uint32), ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64), ("sample_type", ctypes.c_uint64), ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64), ("wakeup_events", ctypes.c_uint32), ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64), ("config2", ctypes.c_uint64), ("branch_sample_type", ctypes.c_uint64),
        ("sample_regs_user", ctypes.c_uint64), ("sample_stack_user", ctypes.c_uint32), ("clockid", ctypes.c_int32),
        ("sample_regs_intr", ctypes.c_uint64), ("aux_watermark", ctypes.c_uint32),
        ("sample_max_stack", ctypes.c_uint16), ("reserved_2", ctypes.c_uint16),
    ]


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


class PerfError(HostError, OSError):
    """perf_event_open failed; ``errno`` says why."""


def perf_event_open(config: int, pid: int, cpu: int, flags: int = PERF_FLAG_FD_CLOEXEC) -> int:
    """Open one counting (not sampling) hardware event; returns the fd."""
    number = _SYSCALL.get(platform.machine())
    if number is None:
        raise PerfError(errno.ENOSYS, f"perf_event_open: unknown syscall number on {platform.machine()}")
    attr = PerfEventAttr(type=PERF_TYPE_HARDWARE, size=ctypes.sizeof(PerfEventAttr), config=config,
                         read_format=PERF_FORMAT_TOTAL_TIME_ENABLED | PERF_FORMAT_TOTAL_TIME_RUNNING,
                         flags=_EXCLUDE_HV)
    fd = int(_libc().syscall(ctypes.c_long(number), ctypes.byref(attr), ctypes.c_int(pid), ctypes.c_int(cpu),
                          ctypes.c_int(-1), ctypes.c_ulong(flags)))
    if fd < 0:
        code = ctypes.get_errno()
        raise PerfError(code, os.strerror(code))
    return fd


@dataclass(frozen=True, slots=True)
class Probe:
    available: bool
    reason: str


_WHY: Final = {
    errno.ENOENT: "the CPU or hypervisor exposes no hardware cycle counter",
    errno.EOPNOTSUPP: "hardware counters are not supported here (no PMU, or a VM without vPMU)",
    errno.ENODEV: "no PMU device for hardware events",
    errno.EACCES: "perf_event_paranoid forbids hardware counters for this user",
    errno.EPERM: "perf_event_paranoid forbids hardware counters for this user",
    errno.ENOSYS: "perf_event_open is not available on this kernel or architecture",
}


def probe_hardware_counters(opener: Callable[[int, int, int], int] | None = None) -> Probe:
    """Can we count CPU cycles? Opens (and closes) a cycles counter on this thread.
    ``opener`` is ``(config, pid, cpu) -> fd``; tests pass their own to reach each branch."""
    open_event = opener if opener is not None else (lambda c, p, u: perf_event_open(c, p, u))
    try:
        fd = open_event(PERF_COUNT_HW_CPU_CYCLES, 0, -1)
    except OSError as exc:
        code = exc.errno if exc.errno is not None else 0
        name = errno.errorcode.get(code, str(code))
        why = _WHY.get(code, os.strerror(code) if code else str(exc))
        return Probe(False, f"perf_event_open(cycles) failed with {name}: {why}")
    os.close(fd)
    return Probe(True, "hardware cycle counter opened")


@dataclass(frozen=True, slots=True)
class _Counters:
    pod: PodView
    container: ContainerView
    fds: tuple[tuple[int, int], ...]  # (cycles fd, instructions fd) per CPU


def _read_scaled(fd: int) -> int | None:
    value, enabled, running = (int(v) for v in struct.unpack("QQQ", os.read(fd, 24)))
    if running == 0:
        return None  # never scheduled on the PMU: unknown, not zero
    return round(value * enabled / running)


class CPICollector:
    """Container cycles, instructions and CPI over a counting window."""

    name = "cpi"

    def __init__(
        self, host: HostRoots, *, interval: float = 60.0, window: float = 10.0,
        sleep: Callable[[float], None] = time.sleep, probe: Callable[[], Probe] = probe_hardware_counters,
    ) -> None:
        self.interval = interval
        self.window = window
        self._sleep = sleep
        self._sys = host.sys
        self.reader = CgroupReader(host.cgroup)
        self._once = OnceLog(log)
        result = probe()
        self.available = result.available
        self.reason = result.reason
        log.info("cpi_collector", available=self.available, reason=self.reason)

    def close(self) -> None:
        return None

    def collect(self, now: float, pods: Sequence[PodView]) -> list[Sample]:
        if not self.available:
            return []
        try:
            cpus = sorted(read_online_cpus(self._sys))
        except CpuListError as exc:
            self._once.skipped("node", ReadError(self._sys / "devices/system/cpu/online", str(exc)))
            return []
        self._once.keep_owners(["node", *(p.uid for p in pods)])
        opened: list[_Counters] = []
        try:
            for pod in pods:
                for container in pod.containers:
                    counters = self._open(pod, container, cpus)
                    if counters is not None:
                        opened.append(counters)
            if opened:
                self._sleep(self.window)
            return [s for c in opened for s in _samples(c)]
        finally:
            for counters in opened:
                for pair in counters.fds:
                    for fd in pair:
                        os.close(fd)

    def _open(self, pod: PodView, container: ContainerView, cpus: Sequence[int]) -> _Counters | None:
        directory = self.reader.perf_event_dir(container.cgroup_dir)
        if directory is None:
            return None
        fds: list[tuple[int, int]] = []
        try:
            cgroup_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            self._once.skipped(pod.uid, os_error(directory, exc))
            return None
        try:
            flags = PERF_FLAG_PID_CGROUP | PERF_FLAG_FD_CLOEXEC
            for cpu in cpus:
                cycles = perf_event_open(PERF_COUNT_HW_CPU_CYCLES, cgroup_fd, cpu, flags)
                try:
                    instructions = perf_event_open(PERF_COUNT_HW_INSTRUCTIONS, cgroup_fd, cpu, flags)
                except OSError:
                    os.close(cycles)
                    raise
                fds.append((cycles, instructions))
        except OSError as exc:
            for pair in fds:
                for fd in pair:
                    os.close(fd)
            self._once.skipped(pod.uid, ReadError(Path(directory), f"perf_event_open: {exc.strerror or exc}"))
            return None
        finally:
            os.close(cgroup_fd)
        return _Counters(pod, container, tuple(fds))


def _samples(counters: _Counters) -> list[Sample]:
    cycles = instructions = 0
    for cycles_fd, instructions_fd in counters.fds:
        c, i = _read_scaled(cycles_fd), _read_scaled(instructions_fd)
        if c is None or i is None:
            continue
        cycles += c
        instructions += i
    lbls = container_labels(counters.pod, counters.container)
    out = [Sample(CONTAINER_CYCLES, float(cycles), lbls), Sample(CONTAINER_INSTRUCTIONS, float(instructions), lbls)]
    if instructions > 0:
        out.append(Sample(CONTAINER_CPI, cycles / instructions, lbls))
    return out
