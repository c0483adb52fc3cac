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
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import structlog

from metrics.collect.base import LatencyStat, OnceLog, SourceUnavailable, os_error
from metrics.collect.cgroupfs import CgroupReader
from metrics.model import ContainerView, PodView
from runtimeproxy.hookapi import HostRoots

log = structlog.get_logger("metrics.ebpf")

# prev_state is the task state reported by the tracepoint: 0 = running, 0x100
# (TASK_REPORT_MAX) = preempted; anything in the low byte is a sleep or stop state.
PROGRAM: Final = r"""
#define SLEEP_STATE_MASK 0xff

struct hist_key { u64 cgid; u64 slot; };
struct total { u64 sum_ns; u64 count; };

BPF_TABLE("lru_hash", u32, u64, queued_at, 65536);
BPF_TABLE("lru_hash", u32, u64, cgid_of, 65536);
BPF_HASH(hist, struct hist_key, u64, 16384);
BPF_HASH(totals, u64, struct total, 4096);

static __always_inline int mark_queued(u32 pid) {
    if (pid == 0)
        return 0;
    u64 ts = bpf_ktime_get_ns();
    queued_at.update(&pid, &ts);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_wakeup) { return mark_queued(args->pid); }
TRACEPOINT_PROBE(sched, sched_wakeup_new) { return mark_queued(args->pid); }

TRACEPOINT_PROBE(sched, sched_switch) {
    u32 prev = args->prev_pid;
    u32 next = args->next_pid;
    if (prev != 0) {
        u64 cg = bpf_get_current_cgroup_id();
        cgid_of.update(&prev, &cg);
        if ((args->prev_state & SLEEP_STATE_MASK) == 0)
            mark_queued(prev);
    }
    if (next == 0)
        return 0;
    u64 *tsp = queued_at.lookup(&next);
    if (tsp == 0)
        return 0;
    u64 delta = bpf_ktime_get_ns() - *tsp;
    queued_at.delete(&next);
    u64 *cgp = cgid_of.lookup(&next);
    if (cgp == 0)
        return 0;
    u64 cgid = *cgp;
    struct hist_key key = {};
    key.cgid = cgid;
    key.slot = bpf_log2l(delta);
    hist.increment(key);
    struct total zero = {};
    struct total *t = totals.lookup_or_try_init(&cgid, &zero);
    if (t) {
        __sync_fetch_and_add(&t->sum_ns, delta);
        __sync_fetch_and_add(&t->count, 1);
    }
    return 0;
}
"""

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


def _int(value: Any) -> int:
    return int(getattr(value, "value", value))


class EbpfSource:
    """Compiles and attaches in ``start()`` (bcc takes up to seconds); drains in ``sample()``."""

    name = "ebpf"

    def __init__(self, host: HostRoots, reader: CgroupReader | None = None) -> None:
        self._sys = host.sys
        self._reader = reader if reader is not None else CgroupReader(host.cgroup)
        self._bpf: Any = None
        self._once = OnceLog(log)

    def start(self) -> None:
        """Raises ``SourceUnavailable`` naming the first thing missing."""
        if self._bpf is not None:
            return
        try:
            import bcc
        except ImportError as exc:
            raise SourceUnavailable(f"bcc is not importable ({exc}); install python3-bpfcc") from exc
        if self._reader.unified_dir("") is None:
            raise SourceUnavailable("no cgroup v2 tree: bpf_get_current_cgroup_id() needs cgroup v2 (or hybrid)")
        if not any((self._sys / t / "events/sched/sched_switch").is_dir() for t in _TRACEFS):
            raise SourceUnavailable(
                f"tracefs is not mounted ({self._sys}/kernel/tracing has no events/sched); "
                "mount -t tracefs nodev /sys/kernel/tracing"
            )
        try:
            # bytes, not str: bcc warns (DeprecationWarning) on str and converts
            self._bpf = bcc.BPF(text=PROGRAM.encode(), cflags=["-w"])
        except Exception as exc:  # bcc raises bare Exception for compile and attach failures
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SourceUnavailable(f"bcc could not compile or attach the program: {reason}") from exc

    def close(self) -> None:
        if self._bpf is not None:
            self._bpf.cleanup()
            self._bpf = None

    def sample(self, containers: Sequence[tuple[PodView, ContainerView]]) -> dict[str, LatencyStat]:
        """Container id -> waits since the previous call (the first: since ``start``)."""
        if self._bpf is None:
            raise SourceUnavailable("EbpfSource.sample() before start()")
        totals = {_int(k): (v.sum_ns, v.count) for k, v in _drain(self._bpf[b"totals"])}
        hists: dict[int, dict[int, int]] = {}
        for key, count in _drain(self._bpf[b"hist"]):
            hists.setdefault(key.cgid, {})[key.slot] = _int(count)
        self._once.keep_owners(pod.uid for pod, _ in containers)
        out: dict[str, LatencyStat] = {}
        for pod, container in containers:
            cgid = self._cgroup_id(pod.uid, container.cgroup_dir)
            if cgid is None or cgid not in totals:
                continue
            sum_ns, count = totals[cgid]
            if count > 0:
                out[container.id] = LatencyStat(sum_ns / count / 1e9, count, log2_percentile(hists.get(cgid, {}), 0.99))
        return out

    def _cgroup_id(self, owner: str, rel: str) -> int | None:
        directory = self._reader.unified_dir(rel)
        if directory is None:
            return None
        try:
            return os.stat(directory).st_ino
        except OSError as exc:
            self._once.skipped(owner, os_error(directory, exc))
            return None


def _drain(table: Any) -> Iterable[tuple[Any, Any]]:
    """Atomically read and delete every entry; older kernels lack batch ops, so fall back
    to read-then-clear (which loses the few events between the two)."""
    try:
        return list(table.items_lookup_and_delete_batch())
    except Exception:  # noqa: BLE001 - bcc raises bare Exception when the kernel lacks batch ops
        pass
    try:
        rows = list(table.items())
        table.clear()
    except Exception as exc:  # as above; one failed read must not kill the collector
        raise SourceUnavailable(f"cannot read BPF map: {exc}") from exc
    return rows
