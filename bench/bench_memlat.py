"""Cost of one memory allocation latency sample at 110 pods (220 containers), by source.

Run by hand as root on a hybrid or v2 cgroup host with bcc: ``python bench/bench_memlat.py``.
Makes 220 empty cgroups under a unique parent in the unified tree (and the v1 memory
hierarchy, for the counters' ``memory.failcnt``), loads the eBPF sources once, then
times ``sample()`` per source over the same containers. The anchor, measured in the same
run, is the schedule latency eBPF source (``metrics.collect.ebpf``) on the same containers.
Per-sample time and the share of a core at the default interval (10 s) are printed.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from hooks.qos import QoSClass
from metrics import model as m
from metrics.collect.cgroupfs import CgroupReader
from metrics.collect.ebpf import EbpfSource
from metrics.collect.memlat import CounterSource, EbpfStallSource
from runtimeproxy.hookapi import HostRoots

PODS = 110
ROUNDS = 200
INTERVAL = 10.0
ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup/memory"))


def _time(fn: Callable[[], object]) -> float:
    fn()  # warm
    start = time.perf_counter()
    for _ in range(ROUNDS):
        fn()
    return (time.perf_counter() - start) / ROUNDS


def main() -> int:
    parent = f"krp-bench-memlat-{uuid.uuid4().hex[:8]}"
    made: list[Path] = []
    try:
        pods = []
        for i in range(PODS):
            pod_dir = f"{parent}/pod{i}"
            for root in ROOTS:
                for c in ("a", "b"):
                    d = root / pod_dir / c
                    d.mkdir(parents=True)
                    made.append(d)
            pods.append(m.PodView(uid=f"u{i}", namespace="bench", name=f"p{i}", sandbox_id=f"sb{i}",
                                  qos=QoSClass.LS, priority=0, priority_class="koord-prod", cgroup_dir=pod_dir,
                                  containers=tuple(m.ContainerView(id=f"{i}{c}", name=c, cgroup_dir=f"{pod_dir}/{c}")
                                                   for c in ("a", "b"))))
        containers = [(p, c) for p in pods for c in p.containers]
        host = HostRoots()
        reader = CgroupReader(host.cgroup)
        anchor = EbpfSource(host, reader)
        memlat = EbpfStallSource(host, reader)
        counters = CounterSource(host, reader)
        for s in (anchor, memlat, counters):
            s.start()
        rows = [("schedule latency, eBPF (anchor)", _time(lambda: anchor.sample(containers)), None),
                ("memory alloc latency, eBPF", _time(lambda: memlat.sample(containers, 0)),
                 len(memlat.sample(containers, 0))),
                ("memory alloc latency, counters", _time(lambda: counters.sample(containers, 0)),
                 len(counters.sample(containers, 0)))]
        for s in (anchor, memlat, counters):
            s.close()
        print(f"{PODS} pods, {len(containers)} containers, {ROUNDS} rounds, interval {INTERVAL:.0f} s\n")
        print("| source | ms per sample | % of a core at 10 s | samples per round |")
        print("|---|---:|---:|---:|")
        for name, sec, n in rows:
            print(f"| {name} | {sec * 1e3:.2f} | {sec / INTERVAL * 100:.3f} | {'' if n is None else n} |")
        return 0
    finally:
        for d in reversed(made):
            d.rmdir()
        for root in ROOTS:
            for p in sorted((root / parent).glob("pod*")):
                p.rmdir()
            if (root / parent).exists():
                (root / parent).rmdir()


if __name__ == "__main__":
    sys.exit(main())
