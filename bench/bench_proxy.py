"""Benchmark: what the proxy adds over talking to containerd directly.

Run by hand as root (not part of the test suite): ``.venv/bin/python bench/bench_proxy.py``.
In one run, against one private containerd, it measures
  * pass-through latency (Version, ListContainers, ListPodSandbox, ContainerStatus),
    direct vs through the proxy, interleaved call by call so both see the same machine;
  * the pod lifecycle time (Run, Create, Start, Stop, Remove) direct vs proxy with
    the hook chain on, as a ratio of medians.
It prints a Markdown table (docs/benchmarks.md keeps the last one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from benchlib import BenchNode, percentile

from criapi import cri_v1_pb2 as cri
from runtimeproxy import devpods, embedded
from runtimeproxy.demo import DEFAULT_CONFIG, kubelet_creates_pod_cgroup

BATCH = ('{"containers": {"c": {"requests": {"kubernetes.io/batch-cpu": "500", "kubernetes.io/batch-memory": '
         '"268435456"}, "limits": {"kubernetes.io/batch-cpu": "1000", "kubernetes.io/batch-memory": "268435456"}}}}')


def _chain(hooks: int) -> dict[str, Any]:
    """``hooks`` example hooks, or (-1) the shipped QoS chain and rules of systemd/config.yaml."""
    if hooks < 0:
        shipped = yaml.safe_load(DEFAULT_CONFIG.read_text())
        return {"hooks": shipped["hooks"], "rules": shipped["rules"]}
    return {"hooks": [{"name": f"shares-{i}", "plugin": "example-cpu-shares", "failure_policy": "Ignore",
                       "args": {"cpu_shares": 512 + i}} for i in range(hooks)]}


def _lat(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e6


def passthrough(direct: Any, proxied: Any, cid: str, n: int) -> list[tuple[str, float, float, float, float]]:
    calls = {
        "Version": lambda rt: rt.Version(cri.VersionRequest()),
        "ListContainers": lambda rt: rt.ListContainers(cri.ListContainersRequest()),
        "ListPodSandbox": lambda rt: rt.ListPodSandbox(cri.ListPodSandboxRequest()),
        "ContainerStatus": lambda rt: rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)),
    }
    rows = []
    for name, call in calls.items():
        for _ in range(200):  # warm both channels and caches
            call(direct), call(proxied)
        d, p = [], []
        for _ in range(n):
            d.append(_lat(lambda: call(direct)))  # noqa: B023 - used immediately
            p.append(_lat(lambda: call(proxied)))  # noqa: B023
        rows.append((name, percentile(d, 0.5), percentile(p, 0.5), percentile(d, 0.99), percentile(p, 0.99)))
    return rows


def lifecycle(rt: Any, prefix: str, logs: Path) -> float:
    uid = str(uuid.uuid4())
    parent = devpods.kube_cgroup_parent(prefix, "besteffort", uid)
    labels = {"koordinator.sh/qosClass": "BE"}
    annotations = {"node.koordinator.sh/extended-resource-spec": BATCH}
    sandbox = devpods.sandbox_config(name="bench", namespace="bench", uid=uid, log_dir=str(logs),
                                     cgroup_parent=parent, labels=labels, annotations=annotations)
    config = devpods.container_config(name="c", image=embedded.BUSYBOX_IMAGE, command=["sleep", "60"],
                                      resources=cri.LinuxContainerResources(cpu_shares=256))
    t = time.perf_counter()
    kubelet_creates_pod_cgroup(parent)  # kubelet's step, timed on both paths
    sid = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sandbox)).pod_sandbox_id
    cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sid, config=config,
                                                        sandbox_config=sandbox)).container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=cid))
    rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0))
    rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid))
    rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid))
    rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sid))
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000, help="pass-through calls per method and path")
    ap.add_argument("--pods", type=int, default=10, help="pod lifecycles per path")
    ap.add_argument("--hooks", type=int, default=-1,
                    help="example hooks in the chain; -1 (default) = the shipped QoS chain of systemd/config.yaml")
    args = ap.parse_args()
    with BenchNode("b") as node:
        base, prefix = node.base, node.prefix
        _proc, sock, _port = node.proxy("proxy", _chain(args.hooks))
        direct = node.runtime()
        proxied = node.runtime(sock)
        # A running pod so ContainerStatus / List* return real data.
        uid = str(uuid.uuid4())
        sb = devpods.sandbox_config(name="idle", namespace="bench", uid=uid, log_dir=str(base / "logs"),
                                    cgroup_parent=devpods.kube_cgroup_parent(prefix, "burstable", uid))
        sid = direct.RunPodSandbox(cri.RunPodSandboxRequest(config=sb)).pod_sandbox_id
        cc = devpods.container_config(name="c", image=embedded.BUSYBOX_IMAGE, command=["sleep", "3600"])
        cid = direct.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sid, config=cc,
                                                                sandbox_config=sb)).container_id
        direct.StartContainer(cri.StartContainerRequest(container_id=cid))
        rows = passthrough(direct, proxied, cid, args.calls)
        d_times, p_times = [], []
        for _ in range(args.pods):
            d_times.append(lifecycle(direct, prefix, base / "logs"))
            p_times.append(lifecycle(proxied, prefix, base / "logs"))
        print(f"\n### Pass-through, {args.calls} calls per method and path (microseconds)\n")
        print("| method | direct p50 | proxy p50 | added p50 | direct p99 | proxy p99 | added p99 |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, d50, p50, d99, p99 in rows:
            print(f"| {name} | {d50:.0f} | {p50:.0f} | {p50 - d50:+.0f} | {d99:.0f} | {p99:.0f} | {p99 - d99:+.0f} |")
        dm, pm = statistics.median(d_times), statistics.median(p_times)
        print(f"\n### Pod lifecycle (Run, Create, Start, Stop, Remove), {args.pods} pods per path,"
              f" chain: {'shipped QoS chain (5 hooks)' if args.hooks < 0 else f'{args.hooks} example hooks'}\n")
        print("| path | median s | min s | max s |")
        print("|---|---:|---:|---:|")
        print(f"| direct | {dm:.3f} | {min(d_times):.3f} | {max(d_times):.3f} |")
        print(f"| proxy + hooks | {pm:.3f} | {min(p_times):.3f} | {max(p_times):.3f} |")
        print(f"\nratio proxy/direct (medians): **{pm / dm:.3f}**")
    return 0


if __name__ == "__main__":
    sys.exit(main())
