"""Run-queue latency per cgroup from scheduler tracepoints, through bcc.

The program uses tracepoint arguments and helpers only, never kernel struct offsets:
bcc compiles against whatever headers are installed, which need not match the
running kernel, and a wrong offset would read garbage silently.

* ``sched_wakeup`` / ``sched_wakeup_new``: the task became runnable; remember when.
* ``sched_switch``: a preempted task (``prev_state`` shows no sleep bit) is runnable
  again from now. The task switched in (``next_pid``) waited ``now - queued_at``.
* Which cgroup that wait belongs to: ``bpf_get_current_cgroup_id()`` in sched_switch is
  the task *leaving* the CPU, and in sched_wakeup it is the waker, not the wakee. So at
  every switch-out we store ``cgid_of[prev_pid]`` and charge a switch-in to the cgroup
  the task had when it last ran. A task that never ran since we attached is skipped.

Per cgroup the kernel keeps a log2 histogram (for p99) and a sum / count (for the
mean). User space drains both each interval with lookup-and-delete, so no interval is
counted twice. The cgroup id is the inode number of the cgroup's v2 directory.

The program (``metrics.collect.ebpfload.PROGRAM``) is compiled and attached by a child
process, which hands over the descriptors and exits, so LLVM's memory never stays in
the agent; the maps are then read with plain ``bpf()`` calls (``metrics.collect.bpfmap``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import structlog

from metrics.collect import bpfmap
from metrics.collect.base import LatencyStat, OnceLog, SourceUnavailable, os_error
from metrics.collect.bpfmap import BpfError, BpfMap
from metrics.collect.cgroupfs import CgroupReader
from metrics.model import ContainerView, PodView
from runtimeproxy.hookapi import HostRoots

log = structlog.get_logger("metrics.ebpf")

_TRACEFS: Final = ("kernel/tracing", "kernel/debug/tracing")


def log2_percentile(slots: Mapping[int, int], q: float) -> float | None:
    """The ``q`` quantile (seconds) of a bcc log2 histogram. Slot ``k`` holds values in
    ``[2^(k-1), 2^k)`` ns; the answer is the slot's upper bound, so it never understates."""
    total = sum(slots.values())
    if total <= 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for slot in sorted(slots):
        seen += slots[slot]
        if seen >= rank:
            return float(2**slot) / 1e9
    return float(2 ** max(slots)) / 1e9


_HIST_KEY: Final = struct.Struct("=QQ")  # struct hist_key { u64 cgid; u64 slot; }
_U64: Final = struct.Struct("=Q")
_TOTAL: Final = struct.Struct("=QQ")  # struct total { u64 sum_ns; u64 count; }
#: Seconds the loader may take (clang on a busy 2-CPU node takes a few).
LOAD_TIMEOUT: Final = 120.0


class EbpfSource:
    """Loads in ``start()`` (through the child: seconds); drains in ``sample()``."""

    name = "ebpf"

    def __init__(self, host: HostRoots, reader: CgroupReader | None = None, *,
                 load_timeout: float = LOAD_TIMEOUT) -> None:
        self._sys = host.sys
        self._reader = reader if reader is not None else CgroupReader(host.cgroup)
        self._timeout = load_timeout
        self._maps: dict[str, BpfMap] = {}
        self._events: list[int] = []
        self._once = OnceLog(log)
        self._ids = CgroupIds(self._reader, self._once)

    def start(self) -> None:
        """Raises ``SourceUnavailable`` naming the first thing missing."""
        if self._maps:
            return
        check_host(self._reader)
        if not any((self._sys / t / "events/sched/sched_switch").is_dir() for t in _TRACEFS):
            raise SourceUnavailable(
                f"tracefs is not mounted ({self._sys}/kernel/tracing has no events/sched); "
                "mount -t tracefs nodev /sys/kernel/tracing"
            )
        self._maps, self._events = open_program(self._timeout)
        log.debug("ebpf_loaded", maps=sorted(self._maps), events=len(self._events))

    def close(self) -> None:
        close_program(self._maps, self._events)
        self._maps, self._events = {}, []

    def sample(self, containers: Sequence[tuple[PodView, ContainerView]]) -> dict[str, LatencyStat]:
        """Container id -> waits since the previous call (the first: since ``start``)."""
        if not self._maps:
            raise SourceUnavailable("EbpfSource.sample() before start()")
        try:
            totals = {_U64.unpack(k)[0]: _TOTAL.unpack(v) for k, v in self._maps["totals"].drain()}
            hists: dict[int, dict[int, int]] = {}
            for k, v in self._maps["hist"].drain():
                cgid, slot = _HIST_KEY.unpack(k)
                hists.setdefault(cgid, {})[slot] = _U64.unpack(v)[0]
        except (BpfError, struct.error) as exc:  # one failed read must not kill the collector
            raise SourceUnavailable(f"cannot read BPF map: {exc}") from exc
        self._once.keep_owners(pod.uid for pod, _ in containers)
        out: dict[str, LatencyStat] = {}
        for cid, cgid in self._ids.of(containers).items():
            if cgid not in totals:
                continue
            sum_ns, count = totals[cgid]
            if count > 0:
                out[cid] = LatencyStat(sum_ns / count / 1e9, count, log2_percentile(hists.get(cgid, {}), 0.99))
        return out


class CgroupIds:
    """Container id -> the v2 cgroup id (its directory's inode) that
    ``bpf_get_current_cgroup_id()`` reports. A container's cgroup keeps its inode for
    the container's life and a container id is never reused, so each is looked up once
    (a stat per container per interval was ~10 % of the collector thread at 110 pods);
    a failed lookup is tried again next time, a gone container's entry is dropped."""

    def __init__(self, reader: CgroupReader, once: OnceLog) -> None:
        self._reader = reader
        self._once = once
        self._ids: dict[str, int] = {}

    def of(self, containers: Sequence[tuple[PodView, ContainerView]]) -> dict[str, int]:
        """The ids of ``containers`` that have one (in their order)."""
        known, ids = self._ids, {}
        for pod, container in containers:
            cgid = known.get(container.id) or cgroup_inode(self._reader, self._once, pod.uid, container.cgroup_dir)
            if cgid is not None:
                ids[container.id] = cgid
        self._ids = ids
        return ids


def check_host(reader: CgroupReader) -> None:
    """What every eBPF source needs before loading: bcc, a known ``bpf()`` system call
    number, and a cgroup v2 tree; raises ``SourceUnavailable`` naming the first missing."""
    if importlib.util.find_spec("bcc") is None:
        raise SourceUnavailable("bcc is not importable; install python3-bpfcc")
    if bpfmap.syscall_number() is None:
        raise SourceUnavailable(f"no bpf() system call number known for {platform.machine()}")
    if reader.unified_dir("") is None:
        raise SourceUnavailable("no cgroup v2 tree: bpf_get_current_cgroup_id() needs cgroup v2 (or hybrid)")


def open_program(timeout: float, module: str | None = None) -> tuple[dict[str, BpfMap], list[int]]:
    """Run the loader ``module`` (default: the schedule-latency one) and open what it hands
    over: the result maps by name and the tracepoint event descriptors (which keep the
    program attached until closed)."""
    header, fds = _run_loader(timeout) if module is None else _run_loader(timeout, module)
    try:
        maps = {name: BpfMap(fds[spec["index"]], spec["key_size"], spec["value_size"], spec["max_entries"])
                for name, spec in header["maps"].items()}
        events = [fds[i] for i in header["events"]]
    except (KeyError, IndexError, TypeError) as exc:
        _close(fds)
        raise SourceUnavailable(f"the eBPF loader answered an unexpected header: {exc!r}") from exc
    return maps, events


def close_program(maps: Mapping[str, BpfMap], events: Sequence[int]) -> None:
    for bmap in maps.values():
        bmap.close()
    for fd in events:  # the last reference: the kernel detaches the program
        os.close(fd)


def cgroup_inode(reader: CgroupReader, once: OnceLog, owner: str, rel: str) -> int | None:
    """The v2 cgroup id (its directory's inode) of the cgroup ``rel``; None (logged once
    per ``owner``) when it has no v2 directory or cannot be read."""
    directory = reader.unified_dir(rel)
    if directory is None:
        return None
    try:
        return os.stat(directory).st_ino
    except OSError as exc:
        once.skipped(owner, os_error(directory, exc))
        return None


def _loader_env() -> dict[str, str]:
    """The child must import this package and bcc exactly as we do, whatever the
    entry point (installed venv, source tree, test runner)."""
    here = str(Path(__file__).resolve().parents[2])
    spec = importlib.util.find_spec("bcc")
    paths = [here] + ([str(Path(spec.origin).parents[1])] if spec is not None and spec.origin else [])
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


LOADER: Final = "metrics.collect.ebpfload"


def _run_loader(timeout: float, module: str = LOADER) -> tuple[dict[str, Any], list[int]]:
    """Start the loader ``module`` and take its header and descriptors."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    errors = tempfile.TemporaryFile()  # not a pipe: clang may write more than a pipe holds
    with ours, errors:
        try:
            proc = subprocess.Popen([sys.executable, "-m", module, str(theirs.fileno())],
                                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=errors, env=_loader_env())
        except OSError as exc:
            raise SourceUnavailable(f"cannot start the eBPF loader: {exc}") from exc
        finally:
            theirs.close()
        ours.settimeout(timeout)
        try:
            msg, fds, _flags, _addr = socket.recv_fds(ours, 65536, 16)
        except TimeoutError as exc:
            proc.kill()
            raise SourceUnavailable(f"the eBPF loader did not answer within {timeout:.0f}s") from exc
        finally:
            _reap(proc)
        if not msg:
            errors.seek(0)
            tail = errors.read().decode(errors="replace").strip().splitlines()[-1:]
            raise SourceUnavailable(f"the eBPF loader exited {proc.returncode} without an answer: {' '.join(tail)}")
    try:
        header: dict[str, Any] = json.loads(msg)
    except ValueError as exc:
        _close(fds)
        raise SourceUnavailable(f"the eBPF loader answered garbage: {msg[:80]!r}") from exc
    if "error" in header:
        _close(fds)
        raise SourceUnavailable(f"bcc could not compile or attach the program: {header['error']}")
    return header, fds


def _reap(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _close(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)
