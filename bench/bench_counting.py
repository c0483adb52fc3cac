"""Benchmark: what HAProxy's per-method counting rules cost per pass-through call.

Run by hand as root: ``.venv/bin/python bench/bench_counting.py --calls 5000``. Three
proxies with ``data_plane: haproxy`` and no hooks in front of one private containerd:
"count" (the generated config), "count-reloaded" (the same, reloaded once: a reload alone
changes nothing) and "bare" (reloaded on the config without the counting rules, see
bench_proxy.strip_counting); Version and ListContainers interleaved call by call with
direct. Prints the added p50 per method and the CPU per call of each HAProxy.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import bench_proxy as bp
from benchlib import BenchNode, percentile


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=5000, help="calls per method and path")
    args = ap.parse_args()
    with BenchNode("ab") as node:
        paths = {name: node.proxy(name, {"data_plane": "haproxy"})[:2] for name in ("count", "count-reloaded", "bare")}
        proc, _ = paths["count-reloaded"]
        master, worker = bp._children(proc.pid)
        os.kill(master, signal.SIGUSR2)
        end = time.monotonic() + 20
        while worker in bp._children(proc.pid) and time.monotonic() < end:
            time.sleep(0.1)
        proc, sock = paths["bare"]
        bp.strip_counting(proc.pid, sock.parent / f".{sock.name}.dataplane" / "haproxy.cfg")
        stubs = {"direct": bp._Stub(node.ctd.socket), **{name: bp._Stub(sock) for name, (_, sock) in paths.items()}}
        groups = {name: bp._children(proc.pid) for name, (proc, _) in paths.items()}
        for name in ("ContainerStatus", "ListPodSandbox", "ImageStatus"):
            bp.CALLS.pop(name)
        before = {name: bp._cpu(group) for name, group in groups.items()}
        lat = bp.passthrough(stubs, "", args.calls)
        cpu = {name: (bp._cpu(group) - before[name]) / (args.calls * len(bp.CALLS)) * 1e6
               for name, group in groups.items()}
    print(f"\n{args.calls} calls per method and path, interleaved with direct\n")
    print("| method | " + " | ".join(f"added p50 {name}" for name in paths) + " |")
    print("|---|" + "---:|" * len(paths))
    for method, per in lat.items():
        d = percentile(per["direct"], 0.5)
        print(f"| {method} | " + " | ".join(f"+{percentile(per[name], 0.5) - d:.0f}" for name in paths) + " |")
    print("| CPU µs per call (HAProxy) | " + " | ".join(f"{cpu[name]:.1f}" for name in paths) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
