"""Soak: pod cycles through the shipped default, with pods also removed behind the proxy's back.

Run by hand as root (not part of the test suite): ``.venv/bin/python bench/bench_soak.py [--cycles 1000]``.
Starts a private containerd and the real proxy on the shipped default config
(systemd/config.yaml, pointed at the private containerd, a work dir and a private cgroup
parent, as ``koord-runtime-proxy demo`` does; JSON logs at info). Then runs ``--cycles``
kubelet-like pod cycles through the proxy: RunPodSandbox, CreateContainer,
StartContainer, StopContainer, RemoveContainer, StopPodSandbox, RemovePodSandbox (QoS
classes in turn, BE pods with batch resources so every hook acts). Every ``--behind``-th
pod is instead torn down directly at containerd, behind the proxy's back. After each
cycle the pod cgroup is removed, as kubelet does.

Every ``--every`` cycles prints one table row: the proxy process's RSS, open fds and
threads, the store's size (pods/containers, from ``/debug/explain``) and the number of
warning/error log lines so far. All should stay flat: the store holds at most the pods
removed behind its back since the last re-sync (one before every reconciler pass, 10 s).
A last row is taken after one more reconcile interval ("settled").

``--probe`` starts the proxy with ``bench/soakprobe`` on PYTHONPATH: every 10 s it records
where the memory is (glibc heap in use and free, SQLite's own allocations, the store's
in-memory indexes); each row then adds those columns, and ``--probe-log`` keeps the
whole trace. ``--retention 4m`` scales every store window down (tiers, GC every 30 s)
so that they all fill within the run: RSS must then be flat across several windows.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Literal

import yaml
from benchlib import BenchNode

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo import devpods, embedded, embeddedcgroup, embeddedimage
from runtimeproxy.demo.scenario import demo_config, free_port, kubelet_creates_pod_cgroup, wait_healthy

SPEC = "node.koordinator.sh/extended-resource-spec"
BATCH = {"containers": {"app": {
    "requests": {"kubernetes.io/batch-cpu": "500", "kubernetes.io/batch-memory": str(64 << 20)},
    "limits": {"kubernetes.io/batch-cpu": "1000", "kubernetes.io/batch-memory": str(128 << 20)},
}}}
QOS: tuple[Literal["besteffort", "burstable", "guaranteed"], ...] = ("besteffort", "burstable", "guaranteed")


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _store_size(port: int) -> tuple[int, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/debug/explain", timeout=10) as resp:
        store = json.load(resp).get("store", {})
    return int(store.get("pods", -1)), int(store.get("containers", -1))


def _warning_lines(log: Path) -> list[str]:
    """Warning and error lines; a line that is not JSON (a traceback) counts too."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            level = json.loads(line).get("level") if line.startswith("{") else "plain"
        except ValueError:
            level = "plain"
        if level in ("warning", "error", "critical", "plain"):
            out.append(line)
    return out


PROBE_HEAD = " heap used | heap free | sqlite | py objs k | keys | latest |"
PROBE_RULE = "----------:|----------:|-------:|----------:|-----:|-------:|"


def _probe(trace: Path | None) -> str:
    """The newest probe line as table cells: glibc heap and SQLite in MiB, live Python
    allocations (thousands of blocks), the store's label-set index and newest values."""
    if trace is None:
        return ""
    lines = trace.read_text().splitlines() if trace.exists() else []
    if not lines:
        return " - | - | - | - | - | - |"
    p = json.loads(lines[-1])
    mib = 1 << 20
    return (f" {p.get('heap_used', 0) / mib:9.1f} | {p.get('heap_free', 0) / mib:9.1f} "
            f"| {p.get('sqlite', 0) / mib:6.1f} | {p.get('py_blocks', 0) / 1000:9.0f} "
            f"| {p.get('keys', '-'):>4} | {p.get('latest', '-'):>6} |")


def _row(label: str, pid: int, port: int, log: Path, started: float, trace: Path | None = None) -> str:
    pods, containers = _store_size(port)
    store = f"{pods} / {containers}"
    return (f"| {label:>8} | {time.monotonic() - started:9.0f} | {_status(pid, 'VmRSS') / 1024:7.1f} "
            f"| {len(os.listdir(f'/proc/{pid}/fd')):4d} | {_status(pid, 'Threads'):7d} "
            f"| {store:>17} | {len(_warning_lines(log)):8d} |" + _probe(trace))


def _cycle(rt: Any, direct: Any, node: BenchNode, i: int, behind: bool, logs: Path) -> None:
    uid = str(uuid.uuid4())
    qos = QOS[i % len(QOS)]
    labels = {"koordinator.sh/qosClass": "BE"} if qos == "besteffort" else {}
    annotations = {SPEC: json.dumps(BATCH)} if qos == "besteffort" else {}
    parent = devpods.kube_cgroup_parent(node.prefix, qos, uid)
    sb = devpods.sandbox_config(name=f"soak-{i:05d}", namespace="soak", uid=uid, log_dir=str(logs / uid),
                                cgroup_parent=parent, labels=labels, annotations=annotations)
    kubelet_creates_pod_cgroup(parent)
    sid = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sb), timeout=120).pod_sandbox_id
    cc = devpods.container_config(name="app", image=embeddedimage.BUSYBOX_IMAGE, command=["sleep", "3600"],
                                  resources=cri.LinuxContainerResources(cpu_shares=2))
    cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sid, config=cc, sandbox_config=sb),
                             timeout=120).container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=120)
    down = direct if behind else rt
    down.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0), timeout=120)
    down.RemoveContainer(cri.RemoveContainerRequest(container_id=cid), timeout=120)
    down.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    down.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=120)
    embeddedcgroup.remove_cgroup_tree(parent, timeout=2.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100, help="cycles per table row")
    parser.add_argument("--minutes", type=float, default=0,
                        help="run for this long instead (rows still every --every cycles): to pass a window's length")
    parser.add_argument("--behind", type=int, default=5, help="every k-th pod is removed directly at containerd")
    parser.add_argument("--retention", default="",
                        help="tasks.metrics retention (e.g. 2m; GC every 30s): bounds the store's per-pod state")
    parser.add_argument("--probe", action="store_true",
                        help="record the proxy's heap, SQLite memory and store indexes every 10 s (bench/soakprobe)")
    parser.add_argument("--probe-log", type=Path, default=None, help="copy the probe's JSON lines here")
    parser.add_argument("--no-tasks", action="store_true",
                        help="hooks only (no metrics or QoS task): tells the proxy's own growth from the store's")
    args = parser.parse_args()
    # SIGTERM (e.g. a soak started in the background, where SIGINT is ignored) stops
    # the proxy and containerd on the way out like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.geteuid() != 0:
        print("bench_soak: must run as root (private containerd, cgroups)", file=sys.stderr)
        return 1
    with BenchNode("soak") as node:
        work = node.base / "soak"
        work.mkdir()
        socket, port = node.base / "soak.sock", free_port()
        doc = yaml.safe_load(demo_config(work, socket, node.ctd.socket, port, node.prefix))
        doc |= {"log": {"level": "info", "format": "json"}, "hookserver_dir": "", "state_dir": str(work / "state")}
        if args.no_tasks:
            doc["tasks"] = {}
        elif args.retention:
            # Every window shorter than the retention, so all fill within the run.
            tiers = {"raw": "1m", "step": "10s", "coarse_step": "30s", "coarse_after": "1m"}
            doc["tasks"]["metrics"] |= {"retention": args.retention, "gc_interval": "30s", "tiers": tiers}
        cfg = work / "config.yaml"
        cfg.write_text(yaml.safe_dump(doc, sort_keys=False))
        log = work / "proxy.log"
        env = dict(os.environ)
        trace = work / "probe.jsonl" if args.probe else None
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
        direct = node.runtime()
        length = f"{args.minutes:g} minutes of" if args.minutes > 0 else str(args.cycles)
        print(f"soak: {length} pod cycles through the shipped default; every {args.behind}th pod "
              f"removed directly at containerd; proxy pid {proc.pid}")
        print("|   cycles | elapsed s | RSS MiB |  fds | threads | store pods / ctrs | warnings |"
              + (PROBE_HEAD if trace else ""))
        print("|---------:|----------:|--------:|-----:|--------:|------------------:|---------:|"
              + (PROBE_RULE if trace else ""))
        started = time.monotonic()
        print(_row("0", proc.pid, port, log, started, trace), flush=True)
        until = started + args.minutes * 60 if args.minutes > 0 else None
        i = 0
        while (i < args.cycles) if until is None else (time.monotonic() < until):
            i += 1
            _cycle(rt, direct, node, i, args.behind > 0 and i % args.behind == 0, work / "logs")
            if i % args.every == 0:
                print(_row(str(i), proc.pid, port, log, started, trace), flush=True)
        if i % args.every:
            print(_row(str(i), proc.pid, port, log, started, trace), flush=True)
        time.sleep(12)  # one more reconcile pass (10 s in the shipped default), which re-syncs first
        print(_row("settled", proc.pid, port, log, started, trace), flush=True)
        if trace is not None and args.probe_log is not None and trace.exists():
            args.probe_log.write_text(trace.read_text())
        for line in _warning_lines(log)[:20]:
            print("  warning:", line[:300])
        if proc.poll() is not None:
            print(f"proxy exited with {proc.returncode}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
