"""Benchmark (issue 28 item 10): does the agent's cost grow with the node's age or churn?

Run by hand as root (not part of the test suite):
``.venv/bin/python bench/bench_churn_slope.py [--minutes 10] [--pods 11] [--churn-every 5]``.

Starts a private containerd and the real proxy with everything on, as on the small
node of the issue: the shipped hooks, rules and tasks (``koord-runtime-proxy demo``'s
config: data plane, metrics, qos-manager ...) with ``kube: true`` against the test API
server (``tests/kubeapi.py``, in this process: Node, NodeSLO with cfsQuota suppression,
NodeMetric reported every 30 s, each pod put and deleted as the API server would show it).
``--pods`` pods (QoS classes in turn, BE pods with batch resources so every hook acts)
run through the proxy; every ``--churn-every`` seconds the oldest is torn down through
the proxy (its cgroup removed, its object deleted) and a new one takes its place.

Every minute it prints the proxy tree's CPU (utime+stime of the proxy and every
descendant, e.g. the data plane's HAProxy, over that minute, in % of a core), RSS and
PSS (``smaps_rollup``, summed over the tree) at the minute's end, and the pods replaced
so far; at the end the least-squares slope of CPU % and of RSS and PSS per minute (over
all minutes, and without the first, the warm-up). A flat slope is one whose change over
the run is small against the run's spread (printed: slope x minutes vs. the standard
deviation); a growth shows as a slope that keeps its sign over a longer run.

The store's per-series state and SQLite's page caches fill for the first ~15 minutes at
the shipped windows (``LATEST_KEEP`` 10 min + one 5-minute GC interval; see "Soak memory,
explained and bounded" in docs/benchmarks.md), so a 10-minute run at the defaults shows
that fill-up as a slope. ``--retention 4m`` scales every store window down as
``bench_soak.py`` does (raw tier 1 m, GC every 30 s, newest values kept 4 min) so that
they all fill within the first ~5 minutes and the later minutes show what still grows.
``--probe`` adds where the proxy's memory is (``bench/soakprobe``: glibc heap in use,
SQLite's allocations, live Python blocks, the store's label sets and newest values).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from benchlib import TICK, BenchNode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.kubeapi

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo import devpods, embedded, embeddedcgroup, embeddedimage
from runtimeproxy.demo.scenario import demo_config, free_port, kubelet_creates_pod_cgroup, wait_healthy

NODE = "bench-churn-node"
NS = "bench"
SPEC = "node.koordinator.sh/extended-resource-spec"
BATCH = {"containers": {"app": {
    "requests": {"kubernetes.io/batch-cpu": "500", "kubernetes.io/batch-memory": str(64 << 20)},
    "limits": {"kubernetes.io/batch-cpu": "1000", "kubernetes.io/batch-memory": str(128 << 20)},
}}}
QOS: tuple[Literal["besteffort", "burstable", "guaranteed"], ...] = ("besteffort", "burstable", "guaranteed")


@dataclass(frozen=True, slots=True)
class Pod:
    uid: str
    name: str
    sandbox: str
    container: str
    parent: str


def _tree(pid: int) -> list[int]:
    """``pid`` and every descendant (children found through /proc/<p>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return out


def _tree_cpu(pid: int) -> float:
    """CPU seconds of the tree (own utime+stime and the waited-for children's cutime+cstime,
    so a helper that exited during the minute still counts)."""
    total = 0.0
    for p in _tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15]) / TICK
    return total


def _tree_mem(pid: int) -> tuple[float, float]:
    """(RSS, PSS) of the tree in MiB."""
    rss = pss = 0
    for p in _tree(pid):
        try:
            lines = Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, rest = line.partition(":")
            if key == "Rss":
                rss += int(rest.split()[0])
            elif key == "Pss":
                pss += int(rest.split()[0])
    return rss / 1024, pss / 1024


def slope(ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against 0, 1, 2 ... (per step)."""
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sum((x - mx) ** 2 for x in range(n))


def _api(base: Path) -> tuple[Any, Path]:
    from tests.kubeapi import KubeApiServer

    api = KubeApiServer()
    api.put("nodes", {"metadata": {"name": NODE}, "status": {
        "capacity": {"cpu": str(os.cpu_count()), "memory": "4Gi"},
        "allocatable": {"cpu": str(os.cpu_count()), "memory": "4Gi"}}})
    api.put("nodeslos", {"metadata": {"name": NODE}, "spec": {"resourceUsedThresholdWithBE": {
        "enable": True, "cpuSuppressThresholdPercent": 65, "cpuSuppressPolicy": "cfsQuota"}}})
    api.put("nodemetrics", {"metadata": {"name": NODE}, "spec": {"metricCollectPolicy": {
        "reportIntervalSeconds": 30, "aggregateDurationSeconds": 300}}})
    kubeconfig = base / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "bench",
        "clusters": [{"name": "bench", "cluster": {"server": api.url}}],
        "users": [{"name": "agent", "user": {"token": "bench"}}],
        "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": "agent"}}]}))
    return api, kubeconfig


def _start(rt: Any, api: Any, node: BenchNode, i: int, logs: Path) -> Pod:
    uid, name, qos = str(uuid.uuid4()), f"churn-{i:05d}", QOS[i % len(QOS)]
    be = qos == "besteffort"
    parent = devpods.kube_cgroup_parent(node.prefix, qos, uid)
    sb = devpods.sandbox_config(name=name, namespace=NS, uid=uid, log_dir=str(logs / uid), cgroup_parent=parent,
                                labels={"koordinator.sh/qosClass": "BE"} if be else {},
                                annotations={SPEC: json.dumps(BATCH)} if be else {})
    api.put("pods", {"metadata": {"name": name, "namespace": NS, "uid": uid}, "spec": {"nodeName": NODE}})
    kubelet_creates_pod_cgroup(parent)
    sid = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sb), timeout=120).pod_sandbox_id
    cc = devpods.container_config(name="app", image=embeddedimage.BUSYBOX_IMAGE, command=["sleep", "36000"],
                                  resources=cri.LinuxContainerResources(cpu_shares=2 if be else 512))
    cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sid, config=cc, sandbox_config=sb),
                             timeout=120).container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=120)
    return Pod(uid, name, sid, cid, parent)


def _stop(rt: Any, api: Any, pod: Pod) -> None:
    rt.StopContainer(cri.StopContainerRequest(container_id=pod.container, timeout=0), timeout=120)
    rt.RemoveContainer(cri.RemoveContainerRequest(container_id=pod.container), timeout=120)
    rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod.sandbox), timeout=120)
    rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod.sandbox), timeout=120)
    embeddedcgroup.remove_cgroup_tree(pod.parent, timeout=2.0)
    api.delete("pods", pod.name, NS)


def _config(node: BenchNode, kubeconfig: Path, socket: Path, port: int, retention: str) -> dict[str, Any]:
    work = node.base / "work"
    work.mkdir()
    doc: dict[str, Any] = yaml.safe_load(demo_config(work, socket, node.ctd.socket, port, node.prefix))
    doc |= {"log": {"level": "warning", "format": "json"}, "hookserver_dir": "", "state_dir": str(work / "state")}
    doc["tasks"]["metrics"] |= {"kube": True, "kubeconfig": str(kubeconfig), "node_name": NODE}
    if retention:  # every window shorter than the retention, so all fill within the run
        tiers = {"raw": "1m", "step": "10s", "coarse_step": "30s", "coarse_after": "1m"}
        doc["tasks"]["metrics"] |= {"retention": retention, "gc_interval": "30s", "tiers": tiers}
    return doc


def _row(minute: int | str, cpu: float, rss: float, pss: float, replaced: int, trace: Path | None) -> str:
    return f"| {minute} | {cpu:.2f} | {rss:.1f} | {pss:.1f} | {replaced} |" + _probe(trace)


PROBE_HEAD = " heap MiB | heap free MiB | SQLite MiB | py k | keys | latest |"


def _probe(trace: Path | None) -> str:
    """The newest probe line as table cells (empty without ``--probe``)."""
    if trace is None:
        return ""
    lines = trace.read_text().splitlines() if trace.exists() else []
    if not lines:
        return " - | - | - | - | - | - |"
    p, mib = json.loads(lines[-1]), 1 << 20
    return (f" {p.get('heap_used', 0) / mib:.1f} | {p.get('heap_free', 0) / mib:.1f} | {p.get('sqlite', 0) / mib:.1f}"
            f" | {p.get('py_blocks', 0) / 1000:.0f} | {p.get('keys', '-')} | {p.get('latest', '-')} |")


def _slopes(label: str, cpu: list[float], rss: list[float], pss: list[float]) -> None:
    n = len(cpu)
    for name, ys, unit in (("CPU %", cpu, "points"), ("RSS", rss, "MiB"), ("PSS", pss, "MiB")):
        s = slope(ys)
        spread = statistics.pstdev(ys) if n > 1 else 0.0
        print(f"| {label} | {name} | {s:+.4f} {unit}/min | {s * (n - 1):+.3f} | {spread:.3f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=int, default=10)
    ap.add_argument("--pods", type=int, default=11)
    ap.add_argument("--churn-every", type=float, default=5.0, help="seconds between pod replacements")
    ap.add_argument("--retention", default="", help="tasks.metrics retention (e.g. 4m; GC every 30 s): scaled windows")
    ap.add_argument("--probe", action="store_true", help="where the proxy's memory is, every 10 s (bench/soakprobe)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.geteuid() != 0:
        print("bench_churn_slope: must run as root (private containerd, cgroups)", file=sys.stderr)
        return 1
    with BenchNode("churn") as node:
        api, kubeconfig = _api(node.base)
        try:
            return _run(node, api, kubeconfig, args)
        finally:
            api.close()


def _run(node: BenchNode, api: Any, kubeconfig: Path, args: argparse.Namespace) -> int:
    socket, port = node.base / "churn.sock", free_port()
    cfg = node.base / "churn.yaml"
    cfg.write_text(yaml.safe_dump(_config(node, kubeconfig, socket, port, args.retention), sort_keys=False))
    log = node.base / "proxy.log"
    env = dict(os.environ)
    trace = node.base / "probe.jsonl" if args.probe else None
    if trace is not None:
        probe_dir = Path(__file__).resolve().parent / "soakprobe"
        env |= {"KRP_SOAK_PROBE": str(trace),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(probe_dir), env.get("PYTHONPATH", "")]))}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "runtimeproxy.cli", "run", "--config", str(cfg)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    node._procs.append(proc)  # stopped (SIGTERM, by pid) with the node
    wait_healthy(port, proc)
    rt = embedded.runtime_stub(embedded.unix_channel(socket))
    retention = f", metrics retention {args.retention}" if args.retention else ""
    names = [Path(f"/proc/{p}/comm").read_text().strip() for p in _tree(proc.pid)]
    logs = node.base / "logs"
    live: deque[Pod] = deque(_start(rt, api, node, i, logs) for i in range(args.pods))
    made, replaced = args.pods, 0
    print(f"churn slope: {args.pods} pods, one replaced every {args.churn_every:g} s, {args.minutes} min, "
          f"everything on with kube: true{retention}; proxy tree {', '.join(names)}, load {os.getloadavg()[0]:.1f}")
    print("\n| minute | tree CPU % of a core | tree RSS MiB | tree PSS MiB | pods replaced |"
          + (PROBE_HEAD if trace else ""))
    print("|---:|---:|---:|---:|---:|" + ("---:|" * 6 if trace else ""))
    cpu_rows: list[float] = []
    rss_rows: list[float] = []
    pss_rows: list[float] = []
    t0, c0 = time.monotonic(), _tree_cpu(proc.pid)
    t_prev = t0
    next_churn = t0 + args.churn_every
    for minute in range(1, args.minutes + 1):
        end = t0 + 60 * minute
        while (now := time.monotonic()) < end:
            if now >= next_churn:
                _stop(rt, api, live.popleft())
                live.append(_start(rt, api, node, made, logs))
                made, replaced, next_churn = made + 1, replaced + 1, next_churn + args.churn_every
            time.sleep(max(min(next_churn, end) - time.monotonic(), 0))
        if proc.poll() is not None:
            print(f"proxy exited with {proc.returncode}", file=sys.stderr)
            return 1
        t1, c1, (rss, pss) = time.monotonic(), _tree_cpu(proc.pid), _tree_mem(proc.pid)
        cpu = 100 * (c1 - c0) / (t1 - t_prev)
        t_prev, c0 = t1, c1
        cpu_rows.append(cpu)
        rss_rows.append(rss)
        pss_rows.append(pss)
        print(_row(minute, cpu, rss, pss, replaced, trace), flush=True)
    print(f"\nmean CPU {statistics.fmean(cpu_rows):.2f} % of a core; load at the end {os.getloadavg()[0]:.1f}")
    print("\n| minutes | series | least-squares slope | change over the run | spread (stdev) |")
    print("|---|---|---:|---:|---:|")
    _slopes(f"1-{args.minutes}", cpu_rows, rss_rows, pss_rows)
    if args.minutes > 2:
        _slopes(f"2-{args.minutes}", cpu_rows[1:], rss_rows[1:], pss_rows[1:])
    half = args.minutes // 2
    if half >= 2:
        _slopes(f"{args.minutes - half + 1}-{args.minutes}", cpu_rows[-half:], rss_rows[-half:], pss_rows[-half:])
    lines = log.read_text(errors="replace").splitlines()
    warnings = [line for line in lines if '"level": "error"' in line or '"level": "warning"' in line]
    print(f"\nwarning and error log lines: {len(warnings)}")
    for line in warnings[:5]:
        print("  ", line[:300])
    return 0


if __name__ == "__main__":
    sys.exit(main())
