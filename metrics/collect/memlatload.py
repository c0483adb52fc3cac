"""The eBPF loader of the memory allocation latency program (see ``metrics.collect.ebpfload``
for why a short-lived child compiles it): ``python -m metrics.collect.memlatload <socket fd>``.

The program times, per task, the stretches an allocation spends stalled in the kernel:

* ``vmscan:mm_vmscan_direct_reclaim_begin/end``: global direct reclaim (the node is short);
* ``vmscan:mm_vmscan_memcg_reclaim_begin/end``: reclaim forced by the cgroup's own limit
  (``try_to_free_mem_cgroup_pages``), what a container under a tight limit hits, on cgroup
  v1 as on v2;
* ``compaction:mm_compaction_begin/end``: a zone being compacted for a high-order page
  (kcompactd's runs land on the root cgroup, which is no container).

Tracepoint arguments and helpers only, no struct offsets. Both ends fire in the stalled
task, so ``bpf_get_current_cgroup_id()`` at the end is that task's v2 cgroup. The start
time is keyed by thread id and kind (the kinds may nest: compaction inside reclaim). Per
(cgroup, kind) the kernel keeps a log2 histogram and a sum / count, drained by user space.
"""

from __future__ import annotations

import sys
from typing import Any, Final

from metrics.collect.ebpfload import load_program, serve

#: Kind numbers used by the program, in order (the user-space names of the ``kind`` label).
KINDS: Final = ("direct_reclaim", "memcg_reclaim", "compaction")

PROGRAM: Final = r"""
struct hist_key { u64 cgid; u32 kind; u32 slot; };
struct total_key { u64 cgid; u64 kind; };
struct total { u64 sum_ns; u64 count; };

BPF_TABLE("lru_hash", u64, u64, started_at, 65536);
BPF_HASH(hist, struct hist_key, u64, 16384);
BPF_HASH(totals, struct total_key, struct total, 8192);

static __always_inline int stall_begin(u32 kind) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 key = ((u64)tid << 2) | kind;
    u64 ts = bpf_ktime_get_ns();
    started_at.update(&key, &ts);
    return 0;
}

static __always_inline int stall_end(u32 kind) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 key = ((u64)tid << 2) | kind;
    u64 *tsp = started_at.lookup(&key);
    if (tsp == 0)
        return 0;
    u64 delta = bpf_ktime_get_ns() - *tsp;
    started_at.delete(&key);
    u64 cgid = bpf_get_current_cgroup_id();
    struct hist_key hk = {};
    hk.cgid = cgid;
    hk.kind = kind;
    hk.slot = bpf_log2l(delta);
    hist.increment(hk);
    struct total_key tk = {};
    tk.cgid = cgid;
    tk.kind = kind;
    struct total zero = {};
    struct total *t = totals.lookup_or_try_init(&tk, &zero);
    if (t) {
        __sync_fetch_and_add(&t->sum_ns, delta);
        __sync_fetch_and_add(&t->count, 1);
    }
    return 0;
}

TRACEPOINT_PROBE(vmscan, mm_vmscan_direct_reclaim_begin) { return stall_begin(0); }
TRACEPOINT_PROBE(vmscan, mm_vmscan_direct_reclaim_end) { return stall_end(0); }
TRACEPOINT_PROBE(vmscan, mm_vmscan_memcg_reclaim_begin) { return stall_begin(1); }
TRACEPOINT_PROBE(vmscan, mm_vmscan_memcg_reclaim_end) { return stall_end(1); }
TRACEPOINT_PROBE(compaction, mm_compaction_begin) { return stall_begin(2); }
TRACEPOINT_PROBE(compaction, mm_compaction_end) { return stall_end(2); }
"""

RESULT_MAPS: Final = ("hist", "totals")
#: The tracepoints the program attaches (the source checks tracefs has them first).
TRACEPOINTS: Final = tuple(f"{group}/{name}_{end}" for group, name in (
    ("vmscan", "mm_vmscan_direct_reclaim"), ("vmscan", "mm_vmscan_memcg_reclaim"),
    ("compaction", "mm_compaction")) for end in ("begin", "end"))


def load() -> tuple[dict[str, Any], list[int]]:
    """Compile and attach; the header and the descriptors to hand over."""
    return load_program(PROGRAM, RESULT_MAPS, len(TRACEPOINTS))


if __name__ == "__main__":
    sys.exit(serve(sys.argv, load))
