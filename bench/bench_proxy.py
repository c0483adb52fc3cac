"""Benchmark: what the proxy adds over talking to containerd directly.

Run by hand as root (not part of the test suite): ``.venv/bin/python bench/bench_proxy.py``.
In one run, against one private containerd with ``--idle-pods`` running pods, it measures
  * pass-through latency (Version, ListContainers, ListPodSandbox, ContainerStatus,
    ImageStatus) on four paths: direct, an asyncio byte relay (bench/byterelay.py, the
    floor), the proxy with ``data_plane: grpc`` and with ``data_plane: haproxy``,
    interleaved call by call with the path order shuffled every round;
  * CPU per pass-through call of each path's processes (proxy + haproxy master and
    worker, from /proc), idle CPU and RSS, and % of a core at 10 and 50 calls/s;
  * the pod lifecycle time (Run, Create, Start, Stop, Remove) direct vs both data planes
    with the hook chain on, as a ratio of medians, and per CRI call, with the proxy's CPU
    per lifecycle; the path order shuffled every round and ``--settle`` seconds of idle
    before each lifecycle (kubelet's lifecycle calls come after idle, when the proxy's
    caches and threads are cold; ``--settle 0`` measures back-to-back lifecycles);
    ``--lifecycle-only`` skips the other phases;
  * a fifth path, "haproxy-bare": the proxy with ``data_plane: haproxy``, no hooks, and
    its HAProxy reloaded on a config without the per-method counting rules (track-sc,
    sc-inc-gpc): with "haproxy" in the same interleaved run it gives the counting rules'
    CPU per call, and in the lifecycle what the hooks cost (haproxy - haproxy-bare) apart
    from the interception hop (haproxy-bare - direct). With no hooks HAProxy sends Python
    only RunPodSandbox, CreateContainer and StartContainer (runtimeproxy.dataplane.haproxy.STORE_CALLS);
    with the shipped chain also UpdateContainerResources, StopPodSandbox and RemovePodSandbox.
It prints a Markdown table (docs/benchmarks.md keeps the last one).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from benchlib import BenchNode, cpu_seconds, percentile

from criapi import cri_v1_pb2 as cri
from criapi import cri_v1_pb2_grpc as cri_grpc
from runtimeproxy.demo import devpods, embedded, embeddedimage
from runtimeproxy.demo.scenario import DEFAULT_CONFIG, kubelet_creates_pod_cgroup

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


CALLS: dict[str, Callable[[Any, str], Any]] = {
    "Version": lambda rt, cid: rt.Version(cri.VersionRequest()),
    "ListContainers": lambda rt, cid: rt.ListContainers(cri.ListContainersRequest()),
    "ListPodSandbox": lambda rt, cid: rt.ListPodSandbox(cri.ListPodSandboxRequest()),
    "ContainerStatus": lambda rt, cid: rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)),
    "ImageStatus": lambda rt, cid: rt.image.ImageStatus(cri.ImageStatusRequest(
        image=cri.ImageSpec(image=embeddedimage.BUSYBOX_IMAGE))),
}


def passthrough(stubs: dict[str, Any], cid: str, n: int) -> dict[str, dict[str, list[float]]]:
    """Latencies (µs) per method and path; calls interleaved, the path order shuffled every
    round (seeded): a rotation keeps each path behind the same neighbour (the slow gRPC
    transport's leftover work then lands on the path after it)."""
    names = list(stubs)
    order = random.Random(15)
    out: dict[str, dict[str, list[float]]] = {}
    for method, call in CALLS.items():
        for _ in range(200):  # warm every channel and cache
            for name in names:
                call(stubs[name], cid)
        lat: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(n):
            for name in order.sample(names, len(names)):
                lat[name].append(_lat(lambda: call(stubs[name], cid)))  # noqa: B023 - used immediately
        out[method] = lat
    return out


#: The timed steps of one pod lifecycle (kubelet's cgroup step timed with RunPodSandbox).
STEPS = ("RunPodSandbox", "CreateContainer", "StartContainer", "StopContainer", "RemoveContainer",
         "StopPodSandbox", "RemovePodSandbox")
#: HAProxy configuration lines of the per-method counting (runtimeproxy.dataplane.haproxy._counting).
COUNTING = ("track-sc0", "sc-inc-gpc", "set-var(txn.grpc_status)")


def be_pod(prefix: str, logs: Path) -> tuple[str, cri.PodSandboxConfig, cri.ContainerConfig]:
    """A new BE pod with batch resources (the lifecycle's): its cgroup parent, sandbox and container config."""
    uid = str(uuid.uuid4())
    parent = devpods.kube_cgroup_parent(prefix, "besteffort", uid)
    labels = {"koordinator.sh/qosClass": "BE"}
    annotations = {"node.koordinator.sh/extended-resource-spec": BATCH}
    sandbox = devpods.sandbox_config(name="bench", namespace="bench", uid=uid, log_dir=str(logs),
                                     cgroup_parent=parent, labels=labels, annotations=annotations)
    config = devpods.container_config(name="c", image=embeddedimage.BUSYBOX_IMAGE, command=["sleep", "60"],
                                      resources=cri.LinuxContainerResources(cpu_shares=256))
    return parent, sandbox, config


def lifecycle(rt: Any, prefix: str, logs: Path) -> dict[str, float]:
    """Seconds per step and in all ("total") for one pod's lifecycle."""
    parent, sandbox, config = be_pod(prefix, logs)
    out: dict[str, float] = {}
    t = start = time.perf_counter()

    def step(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        out[name], t = now - t, now

    kubelet_creates_pod_cgroup(parent)  # kubelet's step, timed on every path
    sid = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sandbox)).pod_sandbox_id
    step("RunPodSandbox")
    cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sid, config=config,
                                                        sandbox_config=sandbox)).container_id
    step("CreateContainer")
    rt.StartContainer(cri.StartContainerRequest(container_id=cid))
    step("StartContainer")
    rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0))
    step("StopContainer")
    rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid))
    step("RemoveContainer")
    rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid))
    step("StopPodSandbox")
    rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sid))
    step("RemovePodSandbox")
    out["total"] = t - start
    return out


def lifecycles(stubs: dict[str, Any], pids: dict[str, list[int]], prefix: str, logs: Path, pods: int,
               settle: float) -> tuple[dict[str, list[dict[str, float]]], dict[str, float]]:
    """``pods`` lifecycles per path, the path order shuffled every round (seeded). Each
    lifecycle starts ``settle`` seconds after the one before, on any path: the work a
    proxy leaves after its last reply (Post stages of RemovePodSandbox, the store, logs)
    then lands on no other path's lifecycle. A rotation with no pause put the gRPC
    transport's leftovers on the haproxy path's RunPodSandbox in 3 rounds of 4.
    Also the CPU ms per lifecycle of each path's processes (proxy and HAProxy), the
    settle pause included (the work left after the last reply is the proxy's too)."""
    names = ("direct", "grpc", "haproxy", "haproxy-bare")
    for name in names:  # warm each path's hooks, executors and caches
        for _ in range(3):
            lifecycle(stubs[name], prefix, logs)
    order = random.Random(15)
    times: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    cpu = dict.fromkeys(names, 0.0)
    for _ in range(pods):
        for name in order.sample(names, len(names)):
            before = _cpu(pids[name])
            time.sleep(settle)
            times[name].append(lifecycle(stubs[name], prefix, logs))
            cpu[name] += _cpu(pids[name]) - before
    return times, {name: total / pods * 1000 for name, total in cpu.items()}


def strip_counting(proxy_pid: int, config: Path) -> list[int]:
    """Reload the HAProxy under ``proxy_pid`` on its config without the counting rules
    (the proxy re-renders it only when its own config changes); its new process group."""
    text = config.read_text()
    config.write_text("".join(line for line in text.splitlines(keepends=True)
                              if not any(word in line for word in COUNTING)))
    master, old_worker = _children(proxy_pid)
    os.kill(master, signal.SIGUSR2)
    end = time.monotonic() + 20
    while time.monotonic() < end:
        group = _children(proxy_pid)
        if len(group) == 2 and old_worker not in group:
            return [proxy_pid, *group]
        time.sleep(0.1)
    raise SystemExit(f"haproxy under {proxy_pid} did not reload: {_children(proxy_pid)}")


def at_rate(stub: Any, groups: dict[str, list[int]], cid: str, rate: float, seconds: float) -> dict[str, float]:
    """% of a core each process group uses while ``stub`` makes ``rate`` calls/s (the 5
    methods in turn)."""
    calls = list(CALLS.values())
    before, start = {name: _cpu(group) for name, group in groups.items()}, time.monotonic()
    for i in range(int(rate * seconds)):
        wait = start + i / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        calls[i % len(calls)](stub, cid)
    took = time.monotonic() - start
    return {name: (_cpu(group) - before[name]) / took * 100 for name, group in groups.items()}


class _Stub:
    """RuntimeService stub with the ImageService one of the same channel as ``image``."""

    def __init__(self, socket: Path) -> None:
        channel = embedded.unix_channel(socket)
        self.runtime = embedded.runtime_stub(channel)
        self.image = cri_grpc.ImageServiceStub(channel)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runtime, name)


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (HAProxy's master and worker under the proxy)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


def _rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000, help="pass-through calls per method and path")
    ap.add_argument("--pods", type=int, default=10, help="pod lifecycles per path")
    ap.add_argument("--idle-pods", type=int, default=20, help="running pods while pass-through is measured")
    ap.add_argument("--idle-seconds", type=float, default=20.0, help="window for the idle CPU of each path")
    ap.add_argument("--rate-seconds", type=float, default=10.0, help="window per path and rate (10 and 50 calls/s)")
    ap.add_argument("--settle", type=float, default=0.1,
                    help="pause before each pod lifecycle, so no path's leftover work lands on another's")
    ap.add_argument("--lifecycle-only", action="store_true", help="skip the pass-through, idle and rate phases")
    ap.add_argument("--hooks", type=int, default=-1,
                    help="example hooks in the chain; -1 (default) = the shipped QoS chain of systemd/config.yaml")
    args = ap.parse_args()
    with BenchNode("b") as node:
        base, prefix = node.base, node.prefix
        chain = _chain(args.hooks)
        grpc_proc, grpc_sock, _ = node.proxy("grpc", {**chain, "data_plane": "grpc"})
        hx_proc, hx_sock, _ = node.proxy("hx", {**chain, "data_plane": "haproxy"})
        bare_proc, bare_sock, _ = node.proxy("bare", {"data_plane": "haproxy"})
        relay_sock = base / "relay.sock"
        relay = subprocess.Popen([sys.executable, str(Path(__file__).with_name("byterelay.py")),
                                  str(relay_sock), str(node.ctd.socket)])
        try:
            while not relay_sock.exists():
                time.sleep(0.02)
            pids = {"direct": [], "relay": [relay.pid], "grpc": [grpc_proc.pid],
                    "haproxy": [hx_proc.pid, *_children(hx_proc.pid)], "haproxy (data plane only)": []}
            pids["haproxy (data plane only)"] = pids["haproxy"][1:]
            if len(pids["haproxy"]) != 3:
                raise SystemExit(f"expected the proxy, haproxy's master and worker: {pids['haproxy']}")
            bare = strip_counting(bare_proc.pid, bare_sock.parent / f".{bare_sock.name}.dataplane" / "haproxy.cfg")
            pids["haproxy-bare (data plane only)"] = bare[1:]
            stubs = {"direct": _Stub(node.ctd.socket), "relay": _Stub(relay_sock), "grpc": _Stub(grpc_sock),
                     "haproxy": _Stub(hx_sock), "haproxy-bare": _Stub(bare_sock)}
            direct = stubs["direct"]
            cid = ""
            for i in range(args.idle_pods):  # running pods so List* and Status return real data
                uid = str(uuid.uuid4())
                sb = devpods.sandbox_config(name=f"idle-{i}", namespace="bench", uid=uid, log_dir=str(base / "logs"),
                                            cgroup_parent=devpods.kube_cgroup_parent(prefix, "burstable", uid))
                sid = direct.RunPodSandbox(cri.RunPodSandboxRequest(config=sb)).pod_sandbox_id
                cc = devpods.container_config(name="c", image=embeddedimage.BUSYBOX_IMAGE, command=["sleep", "3600"])
                cid = direct.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sid, config=cc,
                                                                        sandbox_config=sb)).container_id
                direct.StartContainer(cri.StartContainerRequest(container_id=cid))
            pids["haproxy-bare"] = [bare_proc.pid, *bare[1:]]
            if args.lifecycle_only:
                times, lc_cpu = lifecycles(stubs, pids, prefix, base / "logs", args.pods, args.settle)
                _report_lifecycles(args, times, lc_cpu)
                return 0
            idle = {}
            for name, group in pids.items():
                idle[name] = (_cpu(group), _rss_mb(group))
            time.sleep(args.idle_seconds)
            idle = {name: ((_cpu(group) - idle[name][0]) / args.idle_seconds * 100, _rss_mb(group))
                    for name, group in pids.items()}
            before = {name: _cpu(group) for name, group in pids.items()}
            lat = passthrough(stubs, cid, args.calls)
            cpu_us = {name: (_cpu(group) - before[name]) / (args.calls * len(CALLS)) * 1e6
                      for name, group in pids.items()}
            rated: dict[tuple[str, float], float] = {}
            for rate in (10.0, 50.0):
                for name in ("relay", "grpc", "haproxy"):
                    groups = {name: pids[name]}
                    if name == "haproxy":
                        groups["haproxy (data plane only)"] = pids["haproxy (data plane only)"]
                    for label, pct in at_rate(stubs[name], groups, cid, rate, args.rate_seconds).items():
                        rated[(label, rate)] = pct
            times, lc_cpu = lifecycles(stubs, pids, prefix, base / "logs", args.pods, args.settle)
        finally:
            relay.terminate()
            relay.wait(10)
        _report(args, lat, cpu_us, idle)
        _report_lifecycles(args, times, lc_cpu)
        print(f"\n### Measured at a kubelet-like rate ({args.rate_seconds:.0f} s each, the 5 methods in turn)\n")
        print("| path | % of a core at 10 calls/s | at 50 calls/s |")
        print("|---|---:|---:|")
        for name in ("relay", "grpc", "haproxy", "haproxy (data plane only)"):
            print(f"| {name} | {rated[(name, 10.0)]:.3f} | {rated[(name, 50.0)]:.3f} |")
    return 0


def _report(args: argparse.Namespace, lat: dict[str, dict[str, list[float]]], cpu_us: dict[str, float],
            idle: dict[str, tuple[float, float]]) -> None:
    paths = ["relay", "grpc", "haproxy", "haproxy-bare"]
    print(f"\n### Pass-through, {args.calls} calls per method and path, interleaved, {args.idle_pods} pods "
          "(microseconds)\n")
    print("| method | path | p50 | p99 | added p50 | added p99 | added p50 / relay's |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for method, per in lat.items():
        d50, d99 = percentile(per["direct"], 0.5), percentile(per["direct"], 0.99)
        print(f"| {method} | direct | {d50:.0f} | {d99:.0f} | | | |")
        r50 = percentile(per["relay"], 0.5) - d50
        for name in paths:
            p50, p99 = percentile(per[name], 0.5), percentile(per[name], 0.99)
            ratio = (p50 - d50) / r50 if r50 > 0 else float("nan")
            print(f"| {method} | {name} | {p50:.0f} | {p99:.0f} | {p50 - d50:+.0f} | {p99 - d99:+.0f} | {ratio:.2f} |")
    print("\n### Proxy processes' CPU (from /proc)\n")
    print("| path | CPU µs per pass-through call | computed % of a core at 10 calls/s | at 50 calls/s "
          "| idle % of a core | RSS MB |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in [*paths[:3], "haproxy (data plane only)", "haproxy-bare (data plane only)"]:
        us = cpu_us[name]
        idle_pct, rss = idle[name]
        print(f"| {name} | {us:.0f} | {us * 10 / 1e4 + idle_pct:.3f} | {us * 50 / 1e4 + idle_pct:.3f} "
              f"| {idle_pct:.3f} | {rss:.0f} |")
    counting = cpu_us["haproxy (data plane only)"] - cpu_us["haproxy-bare (data plane only)"]
    print(f"\nHAProxy's per-method counting rules: {counting:+.1f} µs CPU per pass-through call "
          "(haproxy - haproxy-bare, data plane only, same interleaved run)")


def _report_lifecycles(args: argparse.Namespace, steps: dict[str, list[dict[str, float]]],
                       cpu_ms: dict[str, float]) -> None:
    times = {name: [run["total"] for run in runs] for name, runs in steps.items()}
    dm = statistics.median(times["direct"])
    print(f"\n### Pod lifecycle (Run, Create, Start, Stop, Remove), {args.pods} pods per path, chain: "
          f"{'shipped QoS chain' if args.hooks < 0 else f'{args.hooks} example hooks'} "
          f"(haproxy-bare: no hooks), {args.settle:.2f} s apart, path order shuffled per round\n")
    print("| path | median s | min s | max s | median / direct | 95 % interval of the ratio (bootstrap) "
          "| proxy CPU ms per lifecycle |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for name, values in times.items():
        m = statistics.median(values)
        low, high = _ratio_interval(values, times["direct"])
        print(f"| {name} | {m:.3f} | {min(values):.3f} | {max(values):.3f} | {m / dm:.3f} | {low:.3f} … {high:.3f} "
              f"| {cpu_ms[name]:.2f} |")
    print("\n### Pod lifecycle per CRI call, median ms (added over direct)\n")
    print("| call | " + " | ".join(steps) + " |")
    print("|---|" + "---:|" * len(steps))
    for step in (*STEPS, "total"):
        d = statistics.median(run[step] for run in steps["direct"]) * 1000
        cells = [f"{d:.2f}"] + [f"{statistics.median(run[step] for run in runs) * 1000:.2f} "
                                f"({statistics.median(run[step] for run in runs) * 1000 - d:+.2f})"
                                for name, runs in steps.items() if name != "direct"]
        print(f"| {step} | " + " | ".join(cells) + " |")


def _ratio_interval(values: list[float], direct: list[float], rounds: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval of median(values) / median(direct): how far the lifecycle
    ratio moves with the run-to-run spread of single lifecycles (tens of ms on 0.2 s)."""
    rng = random.Random(1)
    ratios = sorted(statistics.median(rng.choices(values, k=len(values)))
                    / statistics.median(rng.choices(direct, k=len(direct))) for _ in range(rounds))
    return ratios[int(rounds * 0.025)], ratios[int(rounds * 0.975) - 1]


if __name__ == "__main__":
    sys.exit(main())
