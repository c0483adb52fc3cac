"""Benchmark: does the proxy's memory grow with the method names a client sends?

Run by hand as root (not part of the test suite): ``.venv/bin/python bench/bench_method_flood.py``.
One proxy (no hooks) in front of a private containerd. After a warm-up it sends
``--calls`` calls to random ``/x.y/<uuid>`` paths (not CRI: answered UNIMPLEMENTED by
the proxy), twice, then twice as many to random ``/runtime.v1.RuntimeService/<uuid>``
methods (CRI, unknown: relayed, containerd answers UNIMPLEMENTED), and prints the proxy's resident
memory, descriptors and threads after each phase (issue 14.4: 57 -> 249 MB before).
"""

from __future__ import annotations

import argparse
import collections
import os
import time
import uuid
from pathlib import Path

import grpc
from benchlib import BenchNode

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo import embedded


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _sample(pid: int) -> tuple[float, int, int]:
    return _status(pid, "VmRSS") / 1024, len(os.listdir(f"/proc/{pid}/fd")), _status(pid, "Threads")


def _flood(channel: grpc.Channel, prefix: str, n: int) -> tuple[float, collections.Counter[str]]:
    codes: collections.Counter[str] = collections.Counter()
    start = time.perf_counter()
    for _ in range(n):
        try:
            channel.unary_unary(f"{prefix}{uuid.uuid4()}")(b"", timeout=10)
            codes["OK"] += 1
        except grpc.RpcError as exc:
            codes[exc.code().name] += 1
    return n / (time.perf_counter() - start), codes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20_000, help="calls per phase")
    args = parser.parse_args()
    with BenchNode("flood") as node:
        proc, sock, _ = node.proxy("flood", {})
        channel = embedded.unix_channel(sock)
        stub = embedded.runtime_stub(channel)
        for _ in range(200):  # warm-up: the known path, once per call shape
            stub.Version(cri.VersionRequest(), timeout=10)
            stub.ListContainers(cri.ListContainersRequest(), timeout=10)
        rows = [("after warm-up", "", *_sample(proc.pid), "", "")]
        unknown_cri = ("random /runtime.v1.RuntimeService/<uuid>", "/runtime.v1.RuntimeService/")
        # Twice each: the first round also warms the allocator for that path; growth
        # with the names themselves shows as a second round growing as much again.
        for label, prefix in (("random /x.y/<uuid>", "/x.y/"), ("random /x.y/<uuid>", "/x.y/"),
                              unknown_cri, unknown_cri):
            rate, codes = _flood(channel, prefix, args.calls)
            rows.append((f"+{args.calls} {label}", ", ".join(f"{k} {v}" for k, v in codes.items()),
                         *_sample(proc.pid), f"{rate:.0f}", ""))
        time.sleep(5)
        rows.append(("5 s idle", "", *_sample(proc.pid), "", ""))
        channel.close()
        base = rows[0][2]
        print("| phase | answers | RSS MiB | fds | threads | calls/s | RSS delta MiB |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for phase, answers, rss, fds, threads, rate, _ in rows:
            print(f"| {phase} | {answers} | {rss:.1f} | {fds} | {threads} | {rate} | {rss - base:+.1f} |")


if __name__ == "__main__":
    main()
