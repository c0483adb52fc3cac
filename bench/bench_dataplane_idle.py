"""Benchmark: what the data plane costs on an idle node: HAProxy's master and worker.

Run by hand as root: ``.venv/bin/python bench/bench_dataplane_idle.py --seconds 60``. One
proxy with ``data_plane: haproxy`` (HAProxy its child) in front of a private containerd, no
hooks, no calls; CPU time of each process from /proc over the window (after 5 s of settling),
RSS at its end; the Python process is the anchor measured in the same run. Stopped with SIGTERM.
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
        master = _children(proc.pid)[0]  # setpriv execs HAProxy in its own pid
        procs = {"python (anchor)": proc.pid, "haproxy master": master,
                 **{f"haproxy worker {w}": w for w in _children(master)}}
        before = {name: cpu_seconds(pid) for name, pid in procs.items()}
        start = time.monotonic()
        time.sleep(args.seconds)
        took = time.monotonic() - start
        used = {name: cpu_seconds(pid) - before[name] for name, pid in procs.items()}
        rss = {name: _rss_mib(pid) for name, pid in procs.items()}
        print(f"idle window {took:.1f} s, CPU in ticks of {1000 / TICK:.0f} ms")
        print("| process | CPU s | % of a core | RSS MiB |\n|---|---|---|---|")
        for name in procs:
            print(f"| {name} | {used[name]:.2f} | {100 * used[name] / took:.3f} | {rss[name]:.1f} |")
        plane = [n for n in procs if not n.startswith("python")]
        total = sum(used[n] for n in plane)
        print(f"| data plane total (HAProxy) | {total:.2f} | {100 * total / took:.3f} | "
              f"{sum(rss[n] for n in plane):.1f} |")
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
