"""Benchmark: pod lifecycle through the NRI ingress vs direct vs through the proxy.

Run by hand as root (not part of the test suite): ``.venv/bin/python bench/bench_nri.py``.
Two private containerd 1.7.24 (scripts/setup-host.sh unpacks it), same binary and shim:
  * A, NRI on, with an agent registered as its NRI plugin (``ingress: nri``): path "nri"
    calls A directly and containerd calls the agent at each event;
  * B, NRI off: path "direct" calls B with no plugin and no proxy; path "proxy" goes
    through an agent with ``ingress: cri-proxy`` (``data_plane: haproxy``, the default) in
    front of B.
Both agents run the shipped QoS chain (systemd/config.yaml). The lifecycle is
bench_proxy's (a BE pod with batch resources: Run, Create, Start, Stop, Remove), the path
order shuffled every round, ``--settle`` seconds of idle before each. Prints Markdown
(docs/benchmarks.md keeps the last run).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any

import yaml
from bench_proxy import STEPS, _children, _cpu, _ratio_interval, _Stub, lifecycle
from benchlib import BenchNode

from runtimeproxy.demo import embedded
from runtimeproxy.demo.scenario import DEFAULT_CONFIG, wait_nri_connected


def _node(tag: str, nri: bool) -> BenchNode:
    node = BenchNode(tag)
    node.ctd = embedded.EmbeddedContainerd(node.base / "ctd", binary=embedded.CONTAINERD_17,
                                           nri_socket=node.base / "nri.sock" if nri else None)
    return node


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", type=int, default=10, help="pod lifecycles per path")
    ap.add_argument("--settle", type=float, default=0.1, help="pause before each lifecycle")
    args = ap.parse_args()
    if not embedded.CONTAINERD_17.is_file():
        raise SystemExit(f"no containerd 1.7 at {embedded.CONTAINERD_17} (scripts/setup-host.sh fetches it)")
    shipped = yaml.safe_load(DEFAULT_CONFIG.read_text())
    chain = {"hooks": shipped["hooks"], "rules": shipped["rules"]}
    with _node("n", nri=True) as a, _node("p", nri=False) as b:
        nri_proc, _, nri_port = a.proxy("nri", {**chain, "data_plane": "grpc", "ingress": "nri",
                                                "nri": {"socket": str(a.ctd.nri_socket)}})
        wait_nri_connected(nri_port, nri_proc)
        proxy_proc, proxy_sock, _ = b.proxy("proxy", {**chain})
        stubs: dict[str, Any] = {"direct": _Stub(b.ctd.socket), "proxy": _Stub(proxy_sock), "nri": _Stub(a.ctd.socket)}
        prefixes = {"direct": b.prefix, "proxy": b.prefix, "nri": a.prefix}
        logs = {"direct": b.base / "logs", "proxy": b.base / "logs", "nri": a.base / "logs"}
        pids = {"direct": [], "proxy": [proxy_proc.pid, *_children(proxy_proc.pid)], "nri": [nri_proc.pid]}
        names = list(stubs)
        for name in names:  # warm each path's hooks, executors and caches
            for _ in range(3):
                lifecycle(stubs[name], prefixes[name], logs[name])
        order = random.Random(31)
        times: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        cpu = dict.fromkeys(names, 0.0)
        for _ in range(args.pods):
            for name in order.sample(names, len(names)):
                before = _cpu(pids[name])
                time.sleep(args.settle)
                times[name].append(lifecycle(stubs[name], prefixes[name], logs[name]))
                cpu[name] += _cpu(pids[name]) - before
        _report(args, times, {name: total / args.pods * 1000 for name, total in cpu.items()})
    return 0


def _report(args: argparse.Namespace, steps: dict[str, list[dict[str, float]]], cpu_ms: dict[str, float]) -> None:
    totals = {name: [run["total"] for run in runs] for name, runs in steps.items()}
    dm = statistics.median(totals["direct"])
    print(f"\n### Pod lifecycle, {args.pods} pods per path, shipped QoS chain, containerd 1.7.24, "
          f"{args.settle:.2f} s apart, path order shuffled per round\n")
    print("| path | median s | min s | max s | median / direct | 95 % interval of the ratio "
          "| agent CPU ms per lifecycle |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for name, values in totals.items():
        m = statistics.median(values)
        low, high = _ratio_interval(values, totals["direct"])
        print(f"| {name} | {m:.3f} | {min(values):.3f} | {max(values):.3f} | {m / dm:.3f} | {low:.3f} … {high:.3f} "
              f"| {cpu_ms[name]:.2f} |")
    print("\n### Per CRI call, median ms (added over direct)\n")
    print("| call | " + " | ".join(steps) + " |")
    print("|---|" + "---:|" * len(steps))
    for step in (*STEPS, "total"):
        d = statistics.median(run[step] for run in steps["direct"]) * 1000
        cells = [f"{d:.2f}"] + [f"{statistics.median(run[step] for run in runs) * 1000:.2f} "
                                f"({statistics.median(run[step] for run in runs) * 1000 - d:+.2f})"
                                for name, runs in steps.items() if name != "direct"]
        print(f"| {step} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
