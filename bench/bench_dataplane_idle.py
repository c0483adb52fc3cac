"""Benchmark: what the data plane costs on an idle node: HAProxy's master and worker.

Run by hand as root: ``.venv/bin/python bench/bench_dataplane_idle.py --seconds 120``. One
proxy with ``data_plane: haproxy`` (HAProxy its child, through ``setpriv --pdeathsig``, which
execs it: the proxy's one child is the master) in front of a private containerd, no hooks, no
calls, no pods. After 5 s of settling, each process's CPU over the window: the scheduler's
run time of its threads (``/proc/<pid>/task/*/schedstat``, nanoseconds) and, as a cross-check,
utime + stime from ``/proc/<pid>/stat`` (clock ticks); RSS at the window's end. The Python
process is the anchor measured in the same run. The last row, the data plane's total in % of
one core, is issue 26's idle target (< 0.05 %). The proxy is stopped with SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path

from benchlib import TICK, BenchNode, cpu_seconds


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _run_ns(pid: int) -> int:
    """Time on a CPU of all the process's threads now, in ns (first field of schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            pass  # a thread that just exited
    return total


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0, help="the idle window")
    args = ap.parse_args()
    with BenchNode("di") as node:
        proc, _, _ = node.proxy("idle", {"data_plane": "haproxy"})
        time.sleep(5)
        masters = _children(proc.pid)
        if len(masters) != 1 or "haproxy" not in Path(f"/proc/{masters[0]}/exe").resolve().name:
            raise SystemExit(f"expected HAProxy's master as the proxy's one child: {masters}")
        master = masters[0]
        workers = _children(master)
        if not workers:
            raise SystemExit(f"HAProxy's master {master} has no worker")
        procs = {"python (anchor)": proc.pid, "haproxy master": master,
                 **{f"haproxy worker {w}": w for w in workers}}
        ticks = {name: cpu_seconds(pid) for name, pid in procs.items()}
        ns = {name: _run_ns(pid) for name, pid in procs.items()}
        start = time.monotonic()
        time.sleep(args.seconds)
        took = time.monotonic() - start
        used = {name: (_run_ns(pid) - ns[name]) / 1e9 for name, pid in procs.items()}
        used_ticks = {name: cpu_seconds(pid) - ticks[name] for name, pid in procs.items()}
        rss = {name: _rss_mib(pid) for name, pid in procs.items()}
        print(f"idle window {took:.1f} s; CPU from schedstat (ns), utime+stime in ticks of {1000 / TICK:.0f} ms "
              "as a cross-check")
        print("| process | CPU ms | % of a core | utime+stime ms | RSS MiB |\n|---|---:|---:|---:|---:|")
        for name in procs:
            print(f"| {name} | {1000 * used[name]:.2f} | {100 * used[name] / took:.4f} | "
                  f"{1000 * used_ticks[name]:.0f} | {rss[name]:.1f} |")
        plane = [n for n in procs if not n.startswith("python")]
        total, total_ticks = sum(used[n] for n in plane), sum(used_ticks[n] for n in plane)
        print(f"| data plane total (HAProxy) | {1000 * total:.2f} | {100 * total / took:.4f} | "
              f"{1000 * total_ticks:.0f} | {sum(rss[n] for n in plane):.1f} |")
        print(f"\nissue 26's idle target: the data plane < 0.05 % of a core: {100 * total / took:.4f} %")
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
