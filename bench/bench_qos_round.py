"""Benchmark: the cost of one QoS manager round by strategy set (issue 17).

Run by hand (no root needed): ``.venv/bin/python bench/bench_qos_round.py [--pods 100]``.
A fixture cgroup v1 tree of N pods (half LS, half BE), a fake /proc and /sys, the real
store with one fresh sample per series, and the real manager with every strategy's
NodeSLO section on. Each set runs ``--rounds`` rounds (``run_once``: inputs read once,
plans, arbitration, writes, explain) and prints CPU time per round (process time,
so the loaded shared machine's other work does not count) and wall time. The anchor
is the empty strategy list in the same run: the manager's own floor.

``--pods 30,110,250`` runs each pod count and prints the marginal CPU per pod between
them (flat in pods: the cost per pod at 250 not above that at 110). The "re-check" row
is the CPU set with ``verified_for: 0``: every cgroup write checked against its file,
as a round does once per ``verified_for`` (60 s) for what it found in place before.
``--profile`` prints where one round's CPU goes (cProfile, the worker thread inlined).

Then the suppress flap (issue 28 item 7): a simulated minute of an LS pod bursting to
6 cores for 100 ms every second on a fixture tree, the real fast path (100 ms) and the
1 s loop; it prints the BE tier quota writes per minute with the fast path's hold and
step (shipped) and without them (before the fix).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog

from hooks.cgroups import CgroupLayout
from hooks.executor import CgroupExecutor
from hooks.qos import QoSClass
from hooks.rules import parse_rules
from metrics import model
from metrics.collect.topology import CPUInfo
from metrics.model import ContainerView, PodView, Sample, labels
from metrics.qos.evict import CriEvictor
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.qos.strategy import StrategyInit, load_strategies, parse_specs
from metrics.store.tsdb import TSDB
from runtimeproxy.hookapi import HostRoots

NOW = 5_000.0
TOPOLOGY = [CPUInfo(cpu=i, core=i % 8, socket=0, numa=i // 8) for i in range(16)]
RULES = {
    "resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressPolicy": "cfsQuota",
                                    "cpuEvictThresholdPercent": 95, "cpuAllocatableEvictThresholdPercent": 500,
                                    "cpuEvictBESatisfactionLowerPercent": 10,
                                    "cpuEvictBESatisfactionUpperPercent": 20},
    "cpuBurstStrategy": {"policy": "auto"},
    "systemStrategy": {"watermarkScaleFactor": 150},
    # the v1 fixture tree has the Anolis memory.min/low files, and a /sys with one disk
    "resourceQOSStrategy": {"lsClass": {"memoryQOS": {"enable": True}},
                            "beClass": {"blkioQOS": {"enable": True, "blocks": [
                                {"name": "/dev/vdb", "type": "device", "ioCfg": {"readBPS": 1048576}}]}}},
}
SETS = {
    "none (anchor)": [],
    "CPU (be-evict, suppress, burst)": ["be-evict", "cpu-suppress", "cpu-burst"],
    "all 6 (no resctrl mount)": ["be-evict", "allocatable-evict", "cpu-evict", "cpu-suppress", "cpu-burst",
                              "system-config"],
    "memory-qos (tier sums: 2 reads per pod)": ["memory-qos"],
    "blkio (class tiers)": ["blkio"],
}


async def _no_runtime(method: str, payload: bytes, timeout: float) -> bytes:
    return b""


def build(root: Path, n: int) -> list[PodView]:
    pods: list[PodView] = []
    for i in range(n):
        be = i % 2 == 1
        tier = "besteffort" if be else "burstable"
        d = f"kubepods/{tier}/pod{i}"
        pods.append(PodView(uid=f"u{i}", namespace="ns", name=f"p{i}", sandbox_id=f"s{i}",
                            qos=QoSClass.BE if be else QoSClass.LS, priority=5500 if be else 9500,
                            priority_class="", cgroup_dir=d, kube_qos=tier, batch_cpu_request_milli=500 if be else 0,
                            containers=(ContainerView(f"c{i}", "main", f"{d}/c{i}", cpu_quota=100_000,
                                                      cpu_period=100_000),)))
    dirs = ["", "kubepods", "kubepods/besteffort", "kubepods/burstable"]
    dirs += [d for p in pods for d in (p.cgroup_dir, p.containers[0].cgroup_dir)]
    files = {"cpu": {"cpu.cfs_quota_us": "100000", "cpu.cfs_period_us": "100000", "cpu.cfs_burst_us": "0"},
             "cpuset": {"cpuset.cpus": "0-15", "cpuset.mems": "0-1"},
             "memory": {"memory.min": "0", "memory.low": "0"},
             "blkio": {f"blkio.throttle.{k}_device": "" for k in ("read_bps", "write_bps", "read_iops", "write_iops")}}
    for controller, names in files.items():
        for d in dirs:
            (root / "cgroup" / controller / d).mkdir(parents=True, exist_ok=True)
            for name, value in names.items():
                (root / "cgroup" / controller / d / name).write_text(value + "\n")
    (root / "sys" / "class" / "block" / "vdb").mkdir(parents=True)
    (root / "sys" / "class" / "block" / "vdb" / "dev").write_text("253:16\n")
    (root / "proc" / "sys" / "vm").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text("MemTotal: 16384000 kB\n")
    (root / "proc" / "sys" / "vm" / "min_free_kbytes").write_text("67584\n")
    (root / "proc" / "sys" / "vm" / "watermark_scale_factor").write_text("10\n")
    return pods


def samples(pods: list[PodView]) -> list[Sample]:
    out = [Sample(model.NODE_CPU_USAGE, 8.0, ts=NOW - 0.5), Sample(model.NODE_MEMORY_USED, 500.0, ts=NOW - 0.5),
           Sample(model.NODE_MEMORY_TOTAL, 1000.0, ts=NOW - 0.5)]
    for p in pods:
        out.append(Sample(model.POD_CPU_USAGE, 0.1, labels(pod_uid=p.uid), NOW - 0.5))
        out.append(Sample(model.POD_MEMORY_USED, 1e6, labels(pod_uid=p.uid), NOW - 0.5))
        out.append(Sample(model.CONTAINER_CPU_USAGE, 0.1, labels(pod_uid=p.uid, container_id=p.containers[0].id),
                          NOW - 0.5))
    return out


async def measure(root: Path, pods: list[PodView], names: list[str], rounds: int,
                  verified_for: float = 60.0) -> tuple[float, float]:
    store = TSDB(root / f"m-{len(names)}-{verified_for:g}.db", clock=lambda: NOW)
    try:
        store.write(samples(pods))
        store.flush()
        executor = CgroupExecutor(CgroupLayout(root / "cgroup", version=1))
        config = ManagerConfig(reserved_cores=0.5, verified_for=verified_for)
        base = StrategyInit(name="", args={}, key_path="strategies", config=config, topology=TOPOLOGY,
                            executor=executor, host=HostRoots(cgroup=root / "cgroup", proc=root / "proc",
                                                              sys=root / "sys"), state_dir=root / "state")
        loaded = load_strategies(parse_specs(names, "strategies"), base)
        rules = parse_rules(RULES)
        manager = QoSManager(reader=store, pods=lambda: pods, topology=TOPOLOGY, executor=executor,
                             evictor=CriEvictor(_no_runtime), rules=lambda: rules, config=config, clock=lambda: NOW,
                             strategies=loaded.enabled)
        await manager.run_once()  # warm-up: the first round writes, later ones find files in place
        cpu: list[float] = []
        wall: list[float] = []
        for _ in range(rounds):
            c0, w0 = time.process_time(), time.perf_counter()
            await manager.run_once()
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
        return statistics.median(cpu) * 1000, statistics.median(wall) * 1000
    finally:
        store.close()


RECHECK = "CPU set, re-check round"


def run_counts(counts: list[int], rounds: int) -> dict[int, dict[str, tuple[float, float]]]:
    out: dict[int, dict[str, tuple[float, float]]] = {}
    for n in counts:
        with tempfile.TemporaryDirectory(prefix="krpb-qosround-") as tmp:
            root = Path(tmp)
            pods = build(root, n)
            results: dict[str, tuple[float, float]] = {}
            for label, names in SETS.items():
                results[label] = asyncio.run(measure(root, pods, names, rounds))
            results[RECHECK] = asyncio.run(measure(root, pods, SETS["CPU (be-evict, suppress, burst)"], rounds, 0.0))
            out[n] = results
    return out


def profile(n: int, rounds: int) -> None:
    import cProfile
    import pstats

    async def inline(func: Any, /, *args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs)

    asyncio.to_thread = inline  # type: ignore[assignment]  # the worker thread's work, profiled
    prof = cProfile.Profile()
    with tempfile.TemporaryDirectory(prefix="krpb-qosround-") as tmp:
        root = Path(tmp)
        pods = build(root, n)
        original = QoSManager.run_once

        async def profiled(self: QoSManager) -> Any:
            prof.enable()
            try:
                return await original(self)
            finally:
                prof.disable()

        asyncio.run(measure(root, pods, SETS["all 6 (no resctrl mount)"], 1))  # warm caches, first writes
        QoSManager.run_once = profiled  # type: ignore[method-assign]
        asyncio.run(measure(root, pods, SETS["all 6 (no resctrl mount)"], rounds))
        QoSManager.run_once = original  # type: ignore[method-assign]
    print(f"\nprofile: all 6 strategies, {n} pods, {rounds + 1} rounds (cProfile adds its own overhead)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(r"metrics|hooks", 45)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", default="100", help="pod counts, comma-separated (e.g. 30,110,250)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-flap", action="store_true", help="skip the suppress flap minute")
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    counts = [int(n) for n in args.pods.split(",")]
    results = run_counts(counts, args.rounds)
    for n, by_set in results.items():
        print(f"QoS manager round, {n} pods, median of {args.rounds} rounds")
        print(f"{'strategies':<40} {'cpu ms':>8} {'wall ms':>8}")
        for label, (cpu, wall) in by_set.items():
            print(f"{label:<40} {cpu:>8.2f} {wall:>8.2f}")
    if len(counts) > 1:
        print("\nmarginal CPU per pod (µs per pod and round) between pod counts")
        print(f"{'strategies':<40} " + " ".join(f"{f'{a}->{b}':>10}" for a, b in itertools.pairwise(counts)))
        for label in results[counts[0]]:
            steps = [(results[b][label][0] - results[a][label][0]) * 1000 / (b - a)
                     for a, b in itertools.pairwise(counts)]
            print(f"{label:<40} " + " ".join(f"{s:>10.1f}" for s in steps))
    if args.profile:
        profile(counts[-1], 10)
    if not args.no_flap:
        from qosflap import flap_minute

        print("\nsuppress flap: LS bursts 6 cores for 100 ms every second, one simulated minute")
        print(f"{'suppress config':<44} {'tier writes/min':>16} {'quota up':>9} {'quota down':>11}")
        for label, hold in (("fast path + 1 s loop, before (no hold/step)", False),
                            ("fast path + 1 s loop, shipped (hold, step)", True)):
            writes = asyncio.run(flap_minute(hold))
            ups = sum(1 for a, b in itertools.pairwise(writes) if b > a)
            print(f"{label:<44} {len(writes):>16} {ups:>9} {len(writes) - 1 - ups:>11}")


if __name__ == "__main__":
    main()
