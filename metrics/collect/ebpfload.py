"""The eBPF loader: a short-lived child process that compiles the schedule-latency
program with bcc, attaches it, hands the file descriptors to the agent and exits.

Why a child: bcc compiles with LLVM/clang inside the calling process, which leaves
over 100 MiB resident for good — more than the whole agent may use. The program's
life does not depend on the process that loaded it: each tracepoint attachment is a
perf event holding the program, and the maps live while any descriptor refers to
them. So the child sends (SCM_RIGHTS over the socket it was given) the perf event
descriptors and the two result maps' descriptors, then leaves with ``os._exit``,
skipping bcc's cleanup, which would disable the very perf events it handed over.

Run as ``python -m metrics.collect.ebpfload <socket fd>`` by ``metrics.collect.ebpf``.
The answer is one message: a JSON header, and the descriptors in the order it names.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
from collections.abc import Callable
from typing import Any, Final

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

#: The maps the agent reads; the other two are kept alive by the program.
RESULT_MAPS: Final = ("hist", "totals")


def load() -> tuple[dict[str, Any], list[int]]:
    """Compile and attach; the header and the descriptors to hand over."""
    return load_program(PROGRAM, RESULT_MAPS, 3)


def load_program(program: str, result_maps: tuple[str, ...], attachments: int) -> tuple[dict[str, Any], list[int]]:
    """Compile and attach ``program`` (expecting ``attachments`` tracepoints); the header
    naming ``result_maps`` and the tracepoint events, and the descriptors in that order."""
    import bcc  # here, not at the top: only this child may pay for LLVM

    # bytes, not str: bcc warns (DeprecationWarning) on str and converts
    bpf = bcc.BPF(text=program.encode(), cflags=["-w"])
    fds: list[int] = []
    maps: dict[str, dict[str, int]] = {}
    for name in result_maps:
        table = bpf[name.encode()]
        maps[name] = {"index": len(fds), "key_size": _size(table.Key), "value_size": _size(table.Leaf),
                      "max_entries": int(table.max_entries)}
        fds.append(int(table.map_fd))
    events = list(bpf.tracepoint_fds.values())
    if len(events) != attachments:
        raise RuntimeError(f"expected {attachments} tracepoint attachments, bcc made {len(events)}")
    header = {"maps": maps, "events": list(range(len(fds), len(fds) + len(events)))}
    return header, fds + [int(fd) for fd in events]


def _size(ctype: Any) -> int:
    return int(ctypes.sizeof(ctype))


def main(argv: list[str]) -> int:
    return serve(argv, load)


def serve(argv: list[str], loader: Callable[[], tuple[dict[str, Any], list[int]]]) -> int:
    """The child's whole life: run ``loader``, send its answer (or the error) over the
    socket ``argv[1]`` names, and leave without bcc's cleanup."""
    sock = socket.socket(fileno=int(argv[1]))
    try:
        header, fds = loader()
    except Exception as exc:  # noqa: BLE001 - bcc raises bare Exception for compile and attach failures
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        sock.sendall(json.dumps({"error": reason}).encode())
        os._exit(0)
    socket.send_fds(sock, [json.dumps(header).encode()], fds)
    os._exit(0)  # no bcc cleanup: it would disable the perf events the agent now holds


if __name__ == "__main__":
    sys.exit(main(sys.argv))
