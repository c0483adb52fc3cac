"""Benchmark: the metrics agent's own cost on a node with 110 pods.

Run by hand as root (not part of the test suite): ``.venv/bin/python bench/bench_metrics.py``.
Starts a private containerd, runs ``--pods`` real sleeping pods (one container
each) directly, then starts the proxy twice against them — once with the metrics
task at its default intervals, once without tasks — and measures each process's
CPU time (utime+stime from /proc/<pid>/stat) over the same window after a warm-up,
and its RSS. The difference is what the agent costs. Prints a Markdown table, and
for the metrics variants where that CPU went, from the agent's own per-part
accounting (``explain``: ``cpu_seconds``, thread CPU time per collector, store
write, flush incl. compaction, GC).

The store packs a 1 s collector's frames every two minutes (once they fill chunks) and
everything else at its GC, every five minutes (or once the oldest frame is 8 minutes
old); a window shorter than that leaves the GC out, and the peak RSS with it (the GC is
the peak: +2.1 MiB at 110 pods before its compaction read slices, +0.5 since); the
default window (300 s, after a 20 s warm-up) includes it (the GC's fold of raw samples
into rollups only starts once data is 35 minutes old: ``--steady`` sees it).

``--steady`` measures the steady state instead: one proxy at the defaults runs for 56
minutes (a proxy without tasks beside it, idle, as the baseline); the table gives its CPU
over minutes 1-6, over 36-46 (the GC folds), and over 46-56, with RSS at the end of each
window and the peak. The NodeMetric document is fetched every 60 s from the start:
with a cluster the reporter builds it that often (the fetch runs the same build; the
PATCH through the kubernetes client is not included); ``--no-nodemetric`` leaves that
out, as the shipped config (no cluster) has no reporter. During minutes 46-56 a scraper
also fetches ``/metrics`` every 15 s (what Prometheus costs).

``--kube`` measures the agent with a cluster connection (``kube: true``) against the
shared test API server (``tests/kubeapi.py``, in this process): the Node, NodeSLO and
NodeMetric (report interval 30 s, Koordinator's minimum; ``--report-interval 60`` for its
default) are served and watched, each status PATCH validated against the CRD. Variants: no
tasks, metrics without a cluster, metrics with ``kube: true``,
everything on (shipped hooks and rules, metrics with ``kube: true``, the interference
analyser at its shipped settings, the QoS manager with ``evict_mode: api``);
``--split`` adds everything on without the QoS manager, with its fast path off, and
without the analyser (where the everything-on CPU goes); ``--kube-baseline DIR`` adds the
same ``kube: true`` runs with the code of another checkout (e.g. ``git archive <commit> |
tar -x -C DIR`` of a commit still on the ``kubernetes`` client) for a comparison in the
same run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from benchlib import BenchNode, cpu_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.kubeapi

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo import devpods, embeddedimage
from runtimeproxy.demo.scenario import DEFAULT_CONFIG


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _parts(port: int) -> dict[str, float]:
    """The metrics agent's CPU seconds per part (empty without the metrics task)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/debug/explain", timeout=10) as resp:
        doc = json.load(resp)
    tasks = doc.get("tasks", {})
    parts = {k: float(v) for k, v in tasks.get("metrics", {}).get("cpu_seconds", {}).items()}
    # The control loop's own accounting (its worker threads' CPU), where those tasks run.
    for name, part in (("qos", "qos rounds (worker)"), ("interference", "analyser steps")):
        if "cpu_seconds" in tasks.get(name, {}):
            parts[part] = float(tasks[name]["cpu_seconds"])
    return parts


def _threads_cpu(pid: int) -> dict[int, tuple[float, int]]:
    """CPU seconds and wake-ups (voluntary context switches) of each of the process's
    threads, by thread id. A wake-up costs ~0.1-0.3 ms of CPU on a VM, more than most of
    the work it wakes for."""
    out: dict[int, tuple[float, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
            wakes = next(int(line.split()[1]) for line in status.splitlines()
                         if line.startswith("voluntary_ctxt_switches:"))
            out[int(task.name)] = (cpu_seconds(pid, int(task.name)), wakes)
        except (OSError, ValueError, IndexError, StopIteration):
            continue  # a thread that ended between the listing and the read
    return out


def _thread_names(profile: Path) -> dict[int, str]:
    """Thread id -> Python thread name, from py-spy's raw lines ``thread (tid): name;...``."""
    names: dict[int, str] = {}
    for line in profile.read_text().splitlines():
        head = line.split(";", 1)[0]
        if head.startswith("thread (") and "): " in head:
            tid, _, name = head[len("thread ("):].partition("): ")
            names[int(tid)] = name.rsplit(" ", 1)[0] if ";" not in line else name
    return names


def _measure(proc: subprocess.Popen[bytes], port: int, warmup: float, window: float,
             profile: Path | None = None) -> dict[str, Any]:
    time.sleep(warmup)
    p0, c0, t0 = _parts(port), cpu_seconds(proc.pid), time.monotonic()
    th0 = _threads_cpu(proc.pid)
    spy = None
    if profile is not None:  # collapsed stacks of the whole window (py-spy reads without stopping it)
        spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "--nonblocking",
                                "--threads", "--rate", "200", "--format", "raw", "-p", str(proc.pid),
                                "-d", str(int(window)), "-o", str(profile)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(window)
    if spy is not None:
        spy.wait(timeout=60)
    p1, c1, t1 = _parts(port), cpu_seconds(proc.pid), time.monotonic()
    th1 = _threads_cpu(proc.pid)
    w0, w1 = (sum(wakes for _cpu, wakes in th.values()) for th in (th0, th1))
    if profile is not None and profile.exists():  # where the process's CPU went, by thread
        names = _thread_names(profile)
        by_name: dict[str, tuple[float, float]] = {}
        for tid, (cpu, wakes) in th1.items():
            name = names.get(tid, "(not sampled)")
            cpu0, wakes0 = th0.get(tid, (0.0, 0))
            had = by_name.get(name, (0.0, 0.0))
            by_name[name] = (had[0] + 1000.0 * (cpu - cpu0) / (t1 - t0), had[1] + (wakes - wakes0) / (t1 - t0))
        ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
        print(f"CPU by thread, ms per second and wake-ups per second ({profile.name}): "
              + ", ".join(f"{k} {v[0]:.2f} ms {v[1]:.0f} w" for k, v in ranked), flush=True)
    return {"cpu_pct": 100.0 * (c1 - c0) / (t1 - t0), "wakes": (w1 - w0) / (t1 - t0),
            "rss_mib": _status_kib(proc.pid, "VmRSS") / 1024,
            "hwm_mib": _status_kib(proc.pid, "VmHWM") / 1024,
            "parts": {k: 1000.0 * (p1[k] - p0.get(k, 0.0)) / (t1 - t0) for k in p1}}


#: About 30 ms of busybox shell arithmetic, then 50 ms asleep: a request-driven LS pod
#: whose use over the fast path's 80 ms ticks swings by more than its dead band.
NOISY = ["sh", "-c", "while :; do i=0; while [ $i -lt 25000 ]; do i=$((i+1)); done; sleep 0.05; done"]


def _run_pods(rt: Any, prefix: str, logs: Path, n: int, no_be: bool = False, busy_be: bool = False,
              noisy_ls: bool = False) -> None:
    """``n`` sleeping pods; ``busy_be``: the first (BestEffort) one spins one thread instead;
    ``noisy_ls``: the first burstable one works in bursts (``NOISY``)."""
    classes: tuple[Literal["besteffort", "burstable", "guaranteed"], ...] = (
        ("burstable", "guaranteed") if no_be else ("besteffort", "burstable", "guaranteed"))
    for i in range(n):
        uid = str(uuid.uuid4())
        qos = classes[i % len(classes)]
        sb = devpods.sandbox_config(name=f"p{i:03d}", namespace="bench", uid=uid, log_dir=str(logs),
                                    cgroup_parent=devpods.kube_cgroup_parent(prefix, qos, uid))
        sid = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sb), timeout=120).pod_sandbox_id
        spin = busy_be and i == 0 and qos == "besteffort"
        noisy = noisy_ls and i == 1 and qos == "burstable"
        command = ["sh", "-c", "while :; do :; done"] if spin else NOISY if noisy else ["sleep", "36000"]
        cc = devpods.container_config(name="c", image=embeddedimage.BUSYBOX_IMAGE, command=command)
        cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sid, config=cc, sandbox_config=sb),
                                 timeout=120).container_id
        rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=120)


#: --steady: (label, first minute, last minute, scraped) of each reported window.
STEADY_WINDOWS = (("minutes 1-6", 1, 6, False), ("minutes 36-46 (GC folds)", 36, 46, False),
                  ("minutes 46-56, scraped", 46, 56, True))


def _get(port: int, path: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as resp:
        return len(resp.read())


def _scrape(port: int, start: float, stop: threading.Event, nodemetric: bool) -> None:
    """The NodeMetric document every 60 s (as the reporter builds it with a cluster)
    unless ``nodemetric`` is false; from ``start`` (monotonic) on, /metrics every 15 s."""
    k = 0
    while not stop.wait(15):
        if time.monotonic() >= start:
            _get(port, "/metrics")
        if nodemetric and k % 4 == 0:
            _get(port, "/apis/nodemetric")
        k += 1


def _steady(node: BenchNode, nodemetric: bool) -> int:
    base, _s, _p = node.proxy("base", {"tasks": {}})
    proc, _sock, port = node.proxy("steady", {"tasks": {"metrics": {"db": str(node.base / "m.db")}}})
    t0 = time.monotonic()
    stop = threading.Event()
    last = max(w[2] for w in STEADY_WINDOWS)
    scrape_from = min(w[1] for w in STEADY_WINDOWS if w[3])
    threading.Thread(target=_scrape, args=(port, t0 + 60 * scrape_from, stop, nodemetric), daemon=True).start()
    marks: dict[int, tuple[float, float, dict[str, float], float, float]] = {}
    base_cpu: dict[int, float] = {}
    try:
        for minute in range(1, last + 1):
            time.sleep(max(t0 + 60 * minute - time.monotonic(), 0))
            marks[minute] = (time.monotonic(), cpu_seconds(proc.pid), _parts(port),
                             _status_kib(proc.pid, "VmRSS") / 1024, _status_kib(proc.pid, "VmHWM") / 1024)
            base_cpu[minute] = cpu_seconds(base.pid)
            print(f"minute {minute}: RSS {marks[minute][3]:.1f} MiB", file=sys.stderr)
    finally:
        stop.set()
    base_rss = _status_kib(base.pid, "VmRSS") / 1024
    node.stop(proc)
    node.stop(base)
    fetched = "NodeMetric fetched every 60 s" if nodemetric else "no NodeMetric fetch (no cluster)"
    print(f"\n### Metrics agent, steady state (defaults; one proxy run through all windows; {fetched})\n")
    print("| window | CPU % of a core | no-tasks proxy CPU % | RSS MiB at its end | peak RSS MiB so far |")
    print("|---|---:|---:|---:|---:|")
    parts_rows = []
    for label, a, b, _ in STEADY_WINDOWS:
        (ta, ca, pa, _, _), (tb, cb, pb, rss, hwm) = marks[a], marks[b]
        base_pct = 100 * (base_cpu[b] - base_cpu[a]) / (tb - ta)
        print(f"| {label} | {100 * (cb - ca) / (tb - ta):.2f} | {base_pct:.2f} | {rss:.1f} | {hwm:.1f} |")
        parts_rows.append((label, {k: 1000 * (pb[k] - pa.get(k, 0.0)) / (tb - ta) for k in pb}))
    print(f"\nno-tasks proxy RSS at the end: {base_rss:.1f} MiB")
    print("RSS by minute: " + ", ".join(f"{m}: {v[3]:.1f}" for m, v in marks.items()))
    _print_parts([(label, {"parts": parts}) for label, parts in parts_rows])
    return 0


BENCH_NODE = "bench-node"


def _api_server(base: Path, report_interval: int) -> tuple[Any, Path]:
    """The test API server with the node's objects, and a kubeconfig pointing at it."""
    from tests.kubeapi import KubeApiServer

    api = KubeApiServer()
    api.put("nodes", {"metadata": {"name": BENCH_NODE}, "status": {
        "capacity": {"cpu": "8", "memory": "16Gi"}, "allocatable": {"cpu": "7500m", "memory": "15Gi"}}})
    api.put("nodeslos", {"metadata": {"name": BENCH_NODE}, "spec": {
        "resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": 65}}})
    api.put("nodemetrics", {"metadata": {"name": BENCH_NODE}, "spec": {"metricCollectPolicy": {
        "reportIntervalSeconds": report_interval, "aggregateDurationSeconds": 300}}})
    kubeconfig = base / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "bench",
        "clusters": [{"name": "bench", "cluster": {"server": api.url}}],
        "users": [{"name": "agent", "user": {"token": "bench"}}],
        "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": "agent"}}]}))
    return api, kubeconfig


@dataclass
class _KubeNode:
    """One pod count's node in a ``--kube`` run: its API server, its variants (name, the
    proxy's doc, the code's directory), their environments, and every run's figures."""

    node: BenchNode
    pods: int
    api: Any
    variants: list[tuple[str, dict[str, Any], Path | None]]
    envs: dict[str, dict[str, str]]
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def _kube(node: BenchNode, args: argparse.Namespace, pods: int) -> _KubeNode:
    api, kubeconfig = _api_server(node.base, args.report_interval)
    kube = {"kube": True, "kubeconfig": str(kubeconfig), "node_name": BENCH_NODE}
    variants: list[tuple[str, dict[str, Any], Path | None]] = [  # name, tasks (then the whole doc), code
        ("no tasks", {}, None),
        ("metrics, no cluster", {"metrics": {"db": str(node.base / "a.db")}}, None),
        ("metrics, kube: true", {"metrics": {"db": str(node.base / "b.db"), **kube}}, None),
    ]
    # Everything on: the shipped hooks and rules, metrics with the cluster, the QoS manager
    # evicting through the API (its cgroup writes under this bench's own parent).
    shipped = yaml.safe_load(DEFAULT_CONFIG.read_text())
    qos = {"besteffort_dir": f"{node.prefix.strip('/')}/kubepods/besteffort", "evict_mode": "api"}

    def everything(db: str) -> dict[str, Any]:
        # The analyser at its shipped settings too (before 2026-11-29's fifth session it
        # was left out here and measured alone by bench_interference).
        return {"hooks": shipped["hooks"], "rules": shipped["rules"],
                "tasks": {"metrics": {"db": str(node.base / db), **kube},
                          "interference": shipped["tasks"]["interference"], "qos-manager": qos}}

    variants = [(name, {"tasks": tasks}, cwd) for name, tasks, cwd in variants]
    variants.append(("everything on, kube: true", everything("d.db"), None))
    envs: dict[str, dict[str, str]] = {}
    for spec in args.env:  # the same as everything on, with the unit's environment variable(s)
        name = f"everything on, kube: true, {spec}"
        variants.append((name, everything(f"env{len(envs)}.db"), None))
        envs[name] = dict(kv.split("=", 1) for kv in spec.split(","))
    for k, spec in enumerate(args.set):  # everything on with some values changed (where its CPU goes)
        doc = copy.deepcopy(everything(f"set{k}.db"))  # its sections are shared with the other variants
        for item in spec.split(","):
            dotted, _, value = item.partition("=")
            *path, leaf = dotted.split(".")
            where = doc
            for part in path:
                where = where.setdefault(part, {})
            where[leaf] = yaml.safe_load(value)
        variants.append((f"everything on, kube: true, {spec}", doc, None))
    if args.split:  # where everything-on's CPU goes: without the QoS manager, without its fast path
        no_qos = everything("f.db")
        del no_qos["tasks"]["qos-manager"]
        variants.append(("shipped hooks + metrics kube: true, no qos-manager", no_qos, None))
        no_fast = everything("g.db")
        no_fast["tasks"]["qos-manager"] = {**qos, "fast_path": False, "psi_trigger": False}
        variants.append(("everything on, fast path off", no_fast, None))
        no_analyser = everything("h.db")
        del no_analyser["tasks"]["interference"]
        variants.append(("everything on, no interference analyser", no_analyser, None))
    if args.kube_baseline:
        old = Path(args.kube_baseline)
        variants.append((f"metrics, kube: true, code of {old}",
                         {"tasks": {"metrics": {"db": str(node.base / "c.db"), **kube}}}, old))
        variants.append((f"everything on, kube: true, code of {old}", everything("e.db"), old))
    if args.only:
        variants = [v for v in variants if args.only in v[0]]
    return _KubeNode(node, pods, api, variants, envs, {name: [] for name, _, _ in variants})


def _kube_repeat(k: _KubeNode, args: argparse.Namespace, r: int) -> None:
    """Repeat ``r`` of every variant on ``k``'s node (variant A, B, ..., then A, B, ... again)."""
    patch = f"/apis/slo.koordinator.sh/v1alpha1/nodemetrics/{BENCH_NODE}/status"
    for i, (name, doc, cwd) in enumerate(k.variants):
        tag = f"k{i}" if r == 0 else f"k{i}r{r}"
        before = len(k.api.seen("PATCH", patch))
        proc, _sock, port = k.node.proxy(tag, _fresh_store(doc, r), cwd=cwd, env=k.envs.get(name))
        prof = Path(args.py_spy) / f"p{k.pods}-{tag}.txt" if args.py_spy else None
        if prof is not None:
            prof.parent.mkdir(parents=True, exist_ok=True)
        row = _measure(proc, port, args.warmup, args.window, prof)
        row["patches"] = len(k.api.seen("PATCH", patch)) - before
        k.runs[name].append(row)
        k.node.stop(proc)


def _kube_report(k: _KubeNode, args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """Print ``k``'s table (medians, each run in brackets) and parts; the median rows."""
    rows = [(name, _median_row(measured)) for name, measured in k.runs.items()]
    print(f"\n### Metrics agent with a cluster connection, {k.pods} pods x 1 container, window "
          f"{args.window:.0f} s after {args.warmup:.0f} s warm-up "
          f"(test API server, NodeMetric every {args.report_interval} s"
          f"{f'; median of {args.repeat} runs, each run in brackets' if args.repeat > 1 else ''})\n")
    print("| proxy | CPU % of a core | wake-ups /s | RSS MiB | peak RSS MiB | NodeMetric PATCHes |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in rows:
        each = _each(k.runs[name], "cpu_pct", ".2f")
        peaks = _each(k.runs[name], "hwm_mib", ".1f")
        print(f"| {name} | {row['cpu_pct']:.2f}{each} | {row['wakes']:.0f} | {row['rss_mib']:.1f} "
              f"| {row['hwm_mib']:.1f}{peaks} | {row['patches']} |")
    _print_parts(rows)
    return rows


def _each(measured: list[dict[str, Any]], key: str, fmt: str) -> str:
    """`` (a / b / c)``: each repeated run's figure (nothing for a single run)."""
    return f" ({' / '.join(format(m[key], fmt) for m in measured)})" if len(measured) > 1 else ""


def _fresh_store(doc: dict[str, Any], repeat: int) -> dict[str, Any]:
    """``doc`` with its own metrics store for a repeated run (not the first run's, which
    would start it from a filled store and a saved checkpoint)."""
    metrics = doc.get("tasks", {}).get("metrics")
    if repeat == 0 or not metrics or "db" not in metrics:
        return doc
    out = copy.deepcopy(doc)
    out["tasks"]["metrics"]["db"] = str(Path(metrics["db"]).with_suffix(f".r{repeat}.db"))
    return out


def _median_row(measured: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the repeated runs of one variant (one run: that run)."""
    if len(measured) == 1:
        return measured[0]
    row: dict[str, Any] = {key: statistics.median(m[key] for m in measured)
                           for key in ("cpu_pct", "wakes", "rss_mib", "hwm_mib", "patches")}
    parts = dict.fromkeys(part for m in measured for part in m["parts"])
    row["parts"] = {part: statistics.median(m["parts"].get(part, 0.0) for m in measured) for part in parts}
    return row


#: One-sided 95 % critical values of Student's t by degrees of freedom (repeats - 1).
_T95: dict[int, float] = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833}


def _growth(first: list[float], last: list[float], fmt: str) -> tuple[str, str]:
    """(the per-repeat growth of the per-pod cost from the first step to the last, as
    ``mean ± standard error``; the verdict). Each repeat's counts ran in one rotation, so a
    repeat's two steps are paired. "no": the growth is above zero by more than the one-sided
    95 % bound of its spread over the repeats; "yes": the mean growth is not above zero;
    otherwise "not resolved": above zero, within what the runs' spread can tell."""
    growth = [b - a for a, b in zip(first, last, strict=True)]
    mean = statistics.fmean(growth)
    if len(growth) < 2:
        return format(mean, "+" + fmt), "yes" if mean <= 0 else "no (one run)"
    se = statistics.stdev(growth) / len(growth) ** 0.5
    bound = _T95.get(len(growth) - 1, 1.645) * se
    verdict = "yes" if mean <= 0 else "no" if mean > bound else f"not resolved (bound {bound:{fmt}})"
    return f"{mean:+{fmt}} ± {se:{fmt}}", verdict


def _marginal_line(label: str, value: Callable[[dict[str, Any]], float], fmt: str,
                   medians: dict[int, dict[str, Any]], runs: dict[int, list[dict[str, Any]]]) -> None:
    """One row of the marginal table: per step the marginal of the medians (each repeat's
    in brackets), then the growth from the first step to the last and the verdict."""
    counts = sorted(medians)
    steps = list(itertools.pairwise(counts))
    repeats = min(len(runs[n]) for n in counts)

    def step(a: int, b: int, row_a: dict[str, Any], row_b: dict[str, Any]) -> float:
        return (value(row_b) - value(row_a)) / (b - a)

    med = [step(a, b, medians[a], medians[b]) for a, b in steps]
    each = [[step(a, b, runs[a][r], runs[b][r]) for r in range(repeats)] for a, b in steps]
    cells = [format(m, fmt) + (f" ({' / '.join(format(v, fmt) for v in e)})" if repeats > 1 else "")
             for m, e in zip(med, each, strict=True)]
    growth, flat = ("", "n/a (one step)") if len(steps) < 2 else _growth(each[0], each[-1], fmt)
    print(f"| {label} | " + " | ".join(cells) + f" | {growth} | {flat} |")


def _part_of(part: str) -> Callable[[dict[str, Any]], float]:
    """A run's CPU of ``part``, µs per second (0 where that code has no such part)."""
    return lambda row: 1000.0 * float(row["parts"].get(part, 0.0))


def _print_marginal(by_pods: dict[int, list[tuple[str, dict[str, Any]]]],
                    runs: dict[int, dict[str, list[dict[str, Any]]]]) -> None:
    """Per variant: the marginal cost per pod between successive pod counts, of the whole
    process (% of a core per pod) and of each part (µs of CPU per second per pod), from the
    medians; with repeats, each repeat's in brackets, and whether it is flat: the growth of
    the per-pod cost from the first step to the last, repeat by repeat (``_growth``)."""
    counts = sorted(by_pods)
    steps = list(itertools.pairwise(counts))
    for name, _ in by_pods[counts[0]]:
        medians = {n: dict(by_pods[n])[name] for n in counts}
        each = {n: runs[n][name] for n in counts}
        print(f"\n### Marginal cost per pod, {name}\n")
        print("| part | " + " | ".join(f"{a} → {b}" for a, b in steps) + " | growth, last step - first | flat? |")
        print("|---|" + "---:|" * len(steps) + "---:|---|")
        _marginal_line("whole process, % of a core", lambda row: float(row["cpu_pct"]), ".4f", medians, each)
        for part in dict.fromkeys(part for n in counts for part in medians[n]["parts"]):
            _marginal_line(f"{part}, µs/s", _part_of(part), ".1f", medians, each)
        _marginal_line("peak RSS, KiB", lambda row: 1024.0 * row["hwm_mib"], ".0f", medians, each)


def _start_pods(node: BenchNode, pods: int, args: argparse.Namespace) -> None:
    t = time.monotonic()
    _run_pods(node.runtime(), node.prefix, node.base / "logs", pods, args.no_be, args.busy_be, args.noisy_ls)
    print(f"{pods} pods running after {time.monotonic() - t:.0f} s", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", default="110",
                    help="how many pods; with --kube a comma-separated list (e.g. 30,110,250) runs each count "
                         "on its own node and prints the marginal cost per pod of the process and each part")
    ap.add_argument("--repeat", type=int, default=1,
                    help="--kube: run each variant this many times (interleaved) and report the medians")
    ap.add_argument("--warmup", type=float, default=20.0)
    ap.add_argument("--window", type=float, default=300.0)
    ap.add_argument("--steady", action="store_true", help="the 56-minute steady-state run (see the docstring)")
    ap.add_argument("--no-nodemetric", action="store_true",
                    help="--steady without the NodeMetric fetch: the shipped default (no cluster, no reporter)")
    ap.add_argument("--kube", action="store_true", help="with kube: true against the test API server")
    ap.add_argument("--kube-baseline", default="", help="--kube: also run this checkout's code (a directory)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE,...",
                    help="--kube: also everything on with these environment variables (e.g. the unit's "
                         "MALLOC_ARENA_MAX=2); repeatable")
    ap.add_argument("--set", action="append", default=[], metavar="KEY.PATH=YAML,...",
                    help="--kube: also everything on with these config values (e.g. reconcile_interval=1h or "
                         "tasks.qos-manager.psi_trigger=false); repeatable")
    ap.add_argument("--py-spy", default="", metavar="DIR",
                    help="--kube: py-spy's collapsed stacks of each variant's window into DIR/p<pods>-k<i>.txt "
                         "(pip install py-spy; it samples without stopping the proxy)")
    ap.add_argument("--only", default="", help="--kube: only the variants whose name contains this text")
    ap.add_argument("--split", action="store_true",
                    help="--kube: also everything on without the qos-manager, with its fast path off, "
                         "and without the interference analyser")
    ap.add_argument("--intervals", action="append", default=[], metavar="NAME=DUR,...",
                    help="also a variant with these collector intervals (e.g. psi=2s,schedlat=1s); repeatable;"
                         " --only-intervals: just these, after no tasks and the defaults")
    ap.add_argument("--no-be", action="store_true",
                    help="no BestEffort pod (half burstable, half guaranteed): the QoS fast path idles")
    ap.add_argument("--busy-be", action="store_true",
                    help="one BestEffort pod spins a thread (the others sleep): the QoS fast path has CPU "
                         "to take back, so it ticks at its interval (with sleeping BE pods it idles)")
    ap.add_argument("--noisy-ls", action="store_true",
                    help="one burstable pod works ~30 ms and sleeps 50 ms in turn: its use over the fast path's "
                         "ticks rises past the dead band again and again (what the follow-up ticks cost)")
    ap.add_argument("--only-intervals", action="store_true", help="leave out the schedstat variant")
    ap.add_argument("--report-interval", type=int, default=30, metavar="SECONDS",
                    help="--kube: the NodeMetric's reportIntervalSeconds (default 30, Koordinator's minimum; "
                         "its own default is 60)")
    args = ap.parse_args()
    try:
        counts = [int(n) for n in args.pods.split(",")]
    except ValueError:
        ap.error(f"--pods: {args.pods!r} is not a pod count or a comma-separated list of them")
    if any(n < 1 for n in counts) or len(set(counts)) != len(counts):
        ap.error(f"--pods: {args.pods!r}: each count must be positive and appear once")
    if len(counts) > 1 and not args.kube:
        ap.error("--pods: several counts need --kube")
    if args.repeat < 1 or (args.repeat > 1 and not args.kube):
        ap.error(f"--repeat: {args.repeat}: a positive count, above 1 only with --kube")
    args.pods = counts[0]
    if args.report_interval < 30:
        ap.error(f"--report-interval: {args.report_interval} is below the CRD's minimum, 30")
    # A SIGTERM unwinds like ^C: the node (its containerd, pods, cgroups, dirs) is removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.kube:
        with contextlib.ExitStack() as stack:
            nodes = []
            for pods in counts:  # each count on a node of its own: its pods, its cgroups, its containerd
                node = stack.enter_context(BenchNode("m"))
                _start_pods(node, pods, args)
                nodes.append(_kube(node, args, pods))
                stack.callback(nodes[-1].api.close)
            # Every node is up before the first run, and the counts take turns (rotated each
            # repeat): a host that gets busier or quieter through the run moves every count's
            # figures alike, not the last count's (the marginal costs are differences of them).
            for rep in range(args.repeat):
                turn = rep % len(nodes)
                for kn in nodes[turn:] + nodes[:turn]:
                    _kube_repeat(kn, args, rep)
            by_pods = {kn.pods: _kube_report(kn, args) for kn in nodes}
            if len(counts) > 1:
                _print_marginal(by_pods, {kn.pods: kn.runs for kn in nodes})
        return 0
    with BenchNode("m") as node:
        _start_pods(node, args.pods, args)
        if args.steady:
            return _steady(node, not args.no_nodemetric)
        rows = []
        variants: tuple[tuple[str, dict[str, Any]], ...] = (("no tasks", {}),
                    ("metrics (defaults)", {"metrics": {"db": str(node.base / "m.db")}}),
                    ("metrics, schedlat from schedstat",
                     {"metrics": {"db": str(node.base / "s.db"), "schedlat_source": "schedstat"}}))
        if args.only_intervals:
            variants = variants[:2]
        for k, spec in enumerate(args.intervals):
            collectors = {name: {"interval": dur} for name, dur in (item.split("=", 1) for item in spec.split(","))}
            variants += ((f"metrics, {spec}", {"metrics": {"db": str(node.base / f"i{k}.db"),
                                                           "collectors": collectors}}),)
        for i, (name, tasks) in enumerate(variants):
            proc, _sock, port = node.proxy(f"v{i}", {"tasks": tasks})
            rows.append((name, _measure(proc, port, args.warmup, args.window)))
            node.stop(proc)
        db_size = sum(p.stat().st_size for p in node.base.glob("m.db*"))
    print(f"\n### Metrics agent cost, {args.pods} pods x 1 container, window {args.window:.0f} s "
          f"after {args.warmup:.0f} s warm-up\n")
    print("| proxy | CPU % of a core | RSS MiB | peak RSS MiB |")
    print("|---|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r['cpu_pct']:.2f} | {r['rss_mib']:.1f} | {r['hwm_mib']:.1f} |")
    base_row, agent_row = rows[0][1], rows[1][1]
    print(f"| agent alone (defaults minus no tasks) | {agent_row['cpu_pct'] - base_row['cpu_pct']:.2f} | "
          f"{agent_row['rss_mib'] - base_row['rss_mib']:.1f} | |")
    print(f"\nstore after the run: {db_size / 2**20:.1f} MiB")
    _print_parts(rows)
    return 0

def _print_parts(rows: list[tuple[str, dict[str, Any]]]) -> None:
    measured = [(name, r["parts"]) for name, r in rows if r["parts"]]
    if not measured:
        return
    names = list(dict.fromkeys(part for _, parts in measured for part in parts))  # older code: fewer parts
    print("\n### Where the agent's CPU went (ms of CPU per second, its own accounting)\n")
    print("| part | " + " | ".join(name for name, _ in measured) + " |")
    print("|---|" + "---:|" * len(measured))
    for part in names:
        print(f"| {part} | " + " | ".join(f"{parts[part]:.2f}" if part in parts else "n/a"
                                          for _, parts in measured) + " |")


if __name__ == "__main__":
    sys.exit(main())
