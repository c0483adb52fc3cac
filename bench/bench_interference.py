"""Scenario benchmark: interference detection and the ``interference`` strategy.

Run by hand as root (not part of the test suite): ``.venv/bin/python bench/bench_interference.py``.
Prints Markdown tables (docs/benchmarks.md).

Through a private containerd and the real proxy (tasks metrics and interference at the
shipped intervals and settings unless ``--collect`` / ``--analyser-interval`` /
``--min-baseline`` say otherwise; qos-manager with the interference strategy, plus
cpu-suppress with ``--with-suppress``):

* an LS pod (burstable, ``sleep``; ``--ls-threads`` N adds N spinning threads of its own
  work, default 0: the probe alone, as the issue has it) and a **latency probe** in its
  container's cgroups: a
  host process moved into the container's cgroup (every v1 controller and the unified
  tree) that sleeps 1 ms in a loop and records how late it wakes (p50/p99). A host
  process rather than a busybox loop: busybox's ``usleep``/``date`` fork per iteration,
  which costs more than the lateness being measured;
* **idle**: the LS pod alone for ``--idle`` seconds (the issue's run: 600): its baseline,
  and every verdict above none in that time is a false one (suspected and confirmed
  counted apart);
* **CPU antagonist**: a BE pod with ``--hogs`` spinning threads (more runnable threads than
  CPUs); time from its StartContainer to a *confirmed* CPU verdict on the LS pod naming
  the BE pod as top culprit; the probe's p99 under interference, once with the QoS manager
  in dry-run and once acting (a second proxy on the same containerd, fresh pods);
* **memory antagonist**: a BE pod that keeps allocating (``--mem-mib`` MiB, in a loop)
  under its own memory limit, so it reclaims itself without starving the node: on a
  shared host nobody may be pushed into reclaim for a benchmark. The LS pod's memory
  verdict is reported (none expected: its memory PSI does not move), i.e. no false
  memory verdict while BE memory churns.
* ``--synthetic``: the analyser's own CPU at 110 pods (80 LS-class with every signal,
  30 BE) on a real store, anchored on the store reads alone in the same run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import yaml
from benchlib import BenchNode

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo import devpods, embeddedimage
from runtimeproxy.demo.scenario import DEFAULT_CONFIG, kubelet_creates_pod_cgroup

PROBE = r"""
import json, os, sys, time
stop = sys.argv[2]
for path in sys.argv[3:]:
    try:
        with open(path, "w") as f:
            f.write("0")
    except OSError as exc:
        print(f"probe: cannot join {path}: {exc}", file=sys.stderr)
end = time.monotonic() + float(sys.argv[1])
stamps, late = [], []
while (now := time.monotonic()) < end:
    time.sleep(0.001)
    stamps.append(now)
    late.append(time.monotonic() - now - 0.001)
    if len(late) % 256 == 0 and os.path.exists(stop):
        break
print(json.dumps({"t": stamps, "late": late}))
"""


def _doc(name: str, base: Path, prefix: str, dry_run: bool, args: argparse.Namespace) -> dict[str, Any]:
    """The shipped metrics intervals and interference settings (``--collect``,
    ``--analyser-interval``, ``--min-baseline`` override them), the QoS manager with the
    ``interference`` strategy (and cpu-suppress with ``--with-suppress``)."""
    mine: dict[str, Any] = {"name": "interference", "args": {"be_cpu_cores": args.be_cpu_cores}}
    if args.be_cpus is not None:
        mine["args"]["be_cpus"] = args.be_cpus
    metrics, analyser = shipped_settings(args)
    return {
        "rules": {"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": 65,
                                                  "cpuSuppressPolicy": "cfsQuota"}},
        "tasks": {
            "metrics": {"db": str(base / f"{name}.db"), "cpi": False, "intervals": metrics},
            "interference": analyser,
            "qos-manager": {"besteffort_dir": f"{prefix.strip('/')}/kubepods/besteffort", "dry_run": dry_run,
                            "psi_trigger": False,
                            "strategies": ["cpu-suppress", mine] if args.with_suppress else [mine]},
        },
    }


def shipped_settings(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, Any]]:
    """(metrics intervals, interference settings): the shipped config's, overridden by flags."""
    shipped = yaml.safe_load(DEFAULT_CONFIG.read_text())["tasks"]
    intervals = dict(shipped["metrics"]["intervals"])
    for item in filter(None, args.collect.split(",")):
        collector, _, every = item.partition("=")
        intervals[collector] = every
    analyser = dict(shipped["interference"])
    if args.analyser_interval:
        analyser["interval"] = args.analyser_interval
    if args.min_baseline:
        analyser["min_baseline"] = args.min_baseline
    return intervals, analyser


class Node:
    def __init__(self, bench: BenchNode, sock: Path, port: int) -> None:
        self.bench, self.rt, self.port = bench, bench.runtime(sock), port
        self.prefix = bench.prefix
        self.logs = bench.base / "logs"
        self.sandboxes: list[str] = []

    def pod(self, name: str, qos: str, qos_class: str) -> tuple[Any, str, str]:
        uid = str(uuid.uuid4())
        sb = devpods.sandbox_config(name=name, namespace="bench", uid=uid, log_dir=str(self.logs),
                                    cgroup_parent=devpods.kube_cgroup_parent(self.prefix, qos, uid),  # type: ignore[arg-type]
                                    labels={"koordinator.sh/qosClass": qos_class}, annotations={})
        kubelet_creates_pod_cgroup(sb.linux.cgroup_parent)
        sid = self.rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sb), timeout=60).pod_sandbox_id
        self.sandboxes.append(sid)
        return sb, sid, uid

    def container(self, pod: tuple[Any, str, str], name: str, command: list[str], memory: int = 0) -> str:
        cc = devpods.container_config(name=name, image=embeddedimage.BUSYBOX_IMAGE, command=command)
        if memory:
            cc.linux.resources.memory_limit_in_bytes = memory
        cid: str = self.rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=pod[1], config=cc,
                                                                      sandbox_config=pod[0]), timeout=60).container_id
        self.rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=60)
        return cid

    def stop(self, cid: str) -> None:
        self.rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0), timeout=30)

    def clean(self) -> None:
        for sid in self.sandboxes:
            self.rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=60)
            self.rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=60)

    def explain(self, pod: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/debug/explain?pod={urllib.parse.quote(pod)}"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())

    def verdict(self, pod: str) -> dict[str, Any]:
        try:
            found = self.explain(pod)
        except OSError:
            return {}
        tasks = found.get("tasks", found)
        mine = tasks.get("interference", {}).get("verdict") or {}
        return mine if isinstance(mine, dict) else {}

    def be_quota(self) -> int:
        path = Path("/sys/fs/cgroup/cpu") / self.prefix.strip("/") / "kubepods/besteffort/cpu.cfs_quota_us"
        return int(path.read_text())


def _cgroup_files(cid: str) -> list[str]:
    """The container's ``cgroup.procs`` in every hierarchy (found by its id)."""
    out = []
    for root in Path("/sys/fs/cgroup").iterdir():
        for found in root.glob(f"**/{cid}/cgroup.procs"):
            out.append(str(found))
    return out


class Probe:
    """The latency probe in the container's cgroups for up to ``seconds`` (``stop`` ends
    it early); every wake-up's lateness with its time (``time.monotonic``, the same clock
    as this process's), so windows can be cut out afterwards."""

    def __init__(self, cid: str, seconds: float, tmp: Path) -> None:
        self.stopfile = tmp / f"probe-stop-{uuid.uuid4().hex[:8]}"
        self.proc = subprocess.Popen([sys.executable, "-c", PROBE, str(seconds), str(self.stopfile),
                                      *_cgroup_files(cid)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def stop(self, timeout: float = 120, early: bool = True) -> tuple[list[float], list[float]]:
        """Its records (``early``: cut short now; else when its time is up)."""
        if early:
            self.stopfile.touch()
        out, err = self.proc.communicate(timeout=timeout)
        self.stopfile.unlink(missing_ok=True)
        if err:
            print(err.strip(), file=sys.stderr)
        found = json.loads(out)
        return found["t"], found["late"]


def window(records: tuple[list[float], list[float]], lo: float = float("-inf"),
           hi: float = float("inf")) -> dict[str, float]:
    late = sorted(v for t, v in zip(*records, strict=True) if lo <= t < hi)
    if not late:
        return {"n": 0, "p50": float("nan"), "p99": float("nan")}
    return {"n": len(late), "p50": late[len(late) // 2], "p99": late[int(len(late) * 0.99)]}


def probe(cid: str, seconds: float, tmp: Path) -> dict[str, float]:
    return window(Probe(cid, seconds, tmp).stop(timeout=seconds + 60, early=False))


class Watch(threading.Thread):
    """Polls the LS pod's verdicts every 200 ms: level changes with their time."""

    def __init__(self, node: Node, pod: str) -> None:
        super().__init__(daemon=True)
        self.node, self.pod = node, pod
        self.changes: list[tuple[float, str, str, list[str]]] = []
        self.last: dict[str, str] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.2):
            for resource, v in self.node.verdict(self.pod).items():
                level = v.get("level", "none")
                if self.last.get(resource, "none") != level:
                    culprits = [c["pod"] for c in v.get("culprits", [])]
                    self.changes.append((time.monotonic(), resource, level, culprits))
                self.last[resource] = level

    def since(self, t0: float, resource: str, level: str) -> tuple[float, list[str]] | None:
        for t, r, lv, culprits in self.changes:
            if t >= t0 and r == resource and lv == level:
                return t - t0, culprits
        return None


def scenario(bench: BenchNode, name: str, dry_run: bool, args: argparse.Namespace) -> dict[str, Any]:
    doc = _doc(name, bench.base, bench.prefix, dry_run, args)
    proc, sock, port = bench.proxy(name, doc)
    node = Node(bench, sock, port)
    out: dict[str, Any] = {}
    running: Probe | None = None
    try:
        ls = node.pod(f"ls-{name}", "burstable", "LS")
        work = " ".join(["while :; do :; done &"] * args.ls_threads) + " sleep 36000"
        ls_cid = node.container(ls, "app", ["sh", "-c", work] if args.ls_threads else ["sleep", "36000"])
        key = f"bench/ls-{name}"
        watch = Watch(node, key)
        watch.start()
        # Idle: the baseline is learnt (min_baseline samples), then every verdict is a false one.
        out["alone"] = probe(ls_cid, args.idle, bench.base)
        out["false_idle"] = [c for c in watch.changes if c[2] != "none"]
        be = node.pod(f"be-{name}", "besteffort", "BE")
        spin = " ".join(["while :; do :; done &"] * args.hogs) + " wait"
        # The probe goes on through detection, measurement, clearing and the memory phase:
        # with no work of its own the LS container's schedule latency is the probe's.
        running = Probe(ls_cid, 30 + 2 + 2 * args.measure + 45 + 60, bench.base)
        t0 = time.monotonic()
        hog = node.container(be, "hog", ["sh", "-c", spin])
        deadline = t0 + 30
        while time.monotonic() < deadline and watch.since(t0, "cpu", "confirmed") is None:
            time.sleep(0.1)
        out["cpu_confirmed"] = watch.since(t0, "cpu", "confirmed")
        out["cpu_suspected"] = watch.since(t0, "cpu", "suspected")
        out["during"] = node.explain(key).get("tasks", {}).get("interference", {})
        time.sleep(2)  # the next manager round has acted (or only planned, in dry-run)
        out["be_quota"] = node.be_quota()
        under_from = time.monotonic()
        time.sleep(args.measure)
        node.stop(hog)
        t1 = time.monotonic()
        while time.monotonic() < t1 + 40 and watch.last.get("cpu") != "none":
            time.sleep(0.2)
        out["cleared_after"] = time.monotonic() - t1 if watch.last.get("cpu") == "none" else None
        time.sleep(2)
        out["be_quota_after"] = node.be_quota()
        if args.mem_mib:
            mem = node.pod(f"mem-{name}", "besteffort", "BE")
            grow = f"while :; do head -c {args.mem_mib}m /dev/zero | tail > /dev/null; done"
            t2 = time.monotonic()
            node.container(mem, "grow", ["sh", "-c", grow], memory=args.mem_mib * 2**20 // 2)
            time.sleep(args.measure)
            out["memory_verdicts"] = [c for c in watch.changes if c[0] >= t2 and c[1] == "memory"]
        watch.halt.set()
        records = running.stop()
        out["under"] = window(records, under_from, under_from + args.measure)
        out["detecting"] = window(records, t0, under_from)
        out["explain"] = node.verdict(key)
        out["signals"] = node.explain(key).get("tasks", {}).get("interference", {}).get("signals")
    finally:
        if running is not None and running.proc.poll() is None:
            running.proc.kill()  # only on a failure: stop() has collected it otherwise
            running.proc.wait()
        node.clean()
        bench.stop(proc)
    return out


def synthetic(steps: int, psi_every: int = 1, step_every: int = 1, sched_every: int = 0) -> tuple[float, float]:
    """(ms per step of the analyser, ms per step of its store reads alone) at 110 pods;
    PSI written every ``psi_every`` s, schedule latency every ``sched_every`` s (0: with
    PSI; the shipped config: 10 and 1), usage every second; every LS pod has a CPU
    limit; the analyser steps every ``step_every`` s. Returns ms of CPU per second of
    wall time."""
    sched_every = sched_every or psi_every
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hooks.qos import QoSClass
    from metrics import model
    from metrics.analysis.interference_task import InterferenceSettings, InterferenceTask
    from metrics.model import ContainerView, PodView, Sample
    from metrics.store.tsdb import TSDB

    pods = []
    for i in range(110):
        qos = QoSClass.BE if i >= 80 else QoSClass.LS
        uid = f"pod-{i}"
        pods.append(PodView(uid=uid, namespace="bench", name=uid, sandbox_id=uid, qos=qos, priority=0,
                            priority_class="", cgroup_dir=f"kubepods/{uid}",
                            containers=(ContainerView(f"c-{i}", "main", f"kubepods/{uid}/c", cpu_quota=200_000,
                                                      cpu_period=100_000),)))
    with tempfile.TemporaryDirectory(prefix="krpint-") as tmp:
        now = [1_000_000.0]
        db = TSDB(Path(tmp) / "m.db", clock=lambda: now[0])
        task = InterferenceTask(InterferenceSettings(), db, lambda: pods)
        probe_reader = InterferenceTask(InterferenceSettings(), db, lambda: pods).signals
        psi = {model.KIND: "some", model.WINDOW: "avg10"}

        def write(t: float) -> None:
            samples = []
            for j, p in enumerate(pods):
                lb = model.labels(pod_uid=p.uid)
                samples += [Sample(model.POD_CPU_USAGE, 0.1 + j % 7 * 0.01, lb, t),
                            Sample(model.POD_MEMORY_USED, 1e8 + j, lb, t),
                            Sample(model.POD_CPU_THROTTLED, 0.0, lb, t)]
                if p.qos is not QoSClass.BE and int(t) % sched_every == 0:
                    cl = model.labels(pod_uid=p.uid, container_id=p.containers[0].id, source="ebpf")
                    samples += [Sample(model.CONTAINER_SCHED_LATENCY_P99, 0.0004 + (j % 5) * 1e-5, cl, t),
                                Sample(model.CONTAINER_SCHED_LATENCY, 0.0001, cl, t)]
                if p.qos is not QoSClass.BE and int(t) % psi_every == 0:
                    samples += [Sample(model.POD_PSI, 1.0, model.labels(pod_uid=p.uid, resource="cpu", **psi), t),
                                Sample(model.POD_PSI, 0.1, model.labels(pod_uid=p.uid, resource="memory", **psi), t)]
            db.write(samples)

        for _ in range(40):  # history to index and learn from
            now[0] += 1
            write(now[0])
            task.step(pods, now[0])
        db.flush()
        full = reads = 0.0
        for k in range(steps * step_every):
            now[0] += 1
            write(now[0])
            if k % 2 == 0:
                db.flush()
            if k % step_every:
                continue
            t = time.thread_time()
            probe_reader.observe(pods, now[0])
            reads += time.thread_time() - t
            t = time.thread_time()
            task.step(pods, now[0])
            full += time.thread_time() - t
        db.close()
    return 1000 * full / steps / step_every, 1000 * reads / steps / step_every


def baseline_memory(pods: int = 80, signals: int = 5) -> float:
    """MiB the analyser's baselines hold once full (``baseline_samples`` values for each
    of ``signals`` signals of ``pods`` LS pods: 20 min at the shipped 2 s step for the
    1 s signals), measured with tracemalloc."""
    import random
    import tracemalloc

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from metrics.analysis.interference import AnalyserConfig, Baseline

    size = AnalyserConfig().baseline_samples
    rng = random.Random(1)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = [Baseline(size) for _ in range(pods * signals)]
        for base in kept:
            for _ in range(size + 10):
                base.add(rng.random() * 1e-3)
        return (tracemalloc.get_traced_memory()[0] - before) / 2**20
    finally:
        tracemalloc.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle", type=float, default=120.0,
                    help="seconds of the LS pod alone (baseline, false verdicts; the issue's run: 600)")
    ap.add_argument("--measure", type=float, default=20.0, help="seconds of probing under interference")
    ap.add_argument("--hogs", type=int, default=6, help="spinning threads of the BE antagonist")
    ap.add_argument("--mem-mib", type=int, default=512, help="memory antagonist's allocation loop (0: skip)")
    ap.add_argument("--min-baseline", type=int, default=0, help="the analyser's min_baseline (0: shipped)")
    ap.add_argument("--collect", default="", metavar="NAME=DUR,...",
                    help="collector intervals instead of the shipped ones (e.g. psi=1s,schedlat=1s)")
    ap.add_argument("--analyser-interval", default="", help="the analyser's interval (empty: shipped)")
    ap.add_argument("--synthetic", type=int, default=300, help="steps of the 110-pod cost run (0: skip)")
    ap.add_argument("--skip-live", action="store_true")
    ap.add_argument("--be-cpu-cores", type=float, default=0.5, help="the strategy's cap (args.be_cpu_cores)")
    ap.add_argument("--be-cpus", type=int, default=None,
                    help="the strategy's args.be_cpus (0: quota only; unset: the strategy's default)")
    ap.add_argument("--only-acting", type=int, default=0, choices=(0, 1), help="1: skip the dry-run scenario")
    ap.add_argument("--ls-threads", type=int, default=0,
                    help="spinning threads of the LS pod's own work (0: the probe alone, as the issue has it)")
    ap.add_argument("--with-suppress", action="store_true",
                    help="also cpu-suppress (on a host loaded by others it floors BE at once, hiding interference)")
    args = ap.parse_args()
    if args.synthetic:
        print("\n### Analyser CPU at 110 pods (80 LS-class with a CPU limit, 30 BE)\n")
        print("| PSI collected every | schedule latency every | analyser interval | reading signals alone (anchor)"
              " ms/s | whole step ms/s | % of a core |")
        print("|---|---:|---:|---:|---:|---:|")
        # (psi, schedlat, analyser): everything every second; the shipped config; the old shipped ones
        for psi_every, sched_every, step in ((1, 1, 1), (10, 1, 1), (10, 1, 2), (10, 10, 1), (10, 10, 2)):
            full, reads = synthetic(args.synthetic, psi_every, step, sched_every)
            print(f"| {psi_every} s | {sched_every} s | {step} s | {reads:.3f} | {full:.3f} | {full / 10:.3f} |")
        print(f"\nThe baselines once full (80 LS pods x 5 signals x 600 values): {baseline_memory():.1f} MiB")
    if args.skip_live:
        return 0
    results: dict[str, dict[str, Any]] = {}
    with BenchNode("i") as bench:
        for name, dry in (("dryrun", True), ("acting", False))[args.only_acting:]:
            results[name] = scenario(bench, name, dry, args)
            print(f"{name}: {json.dumps(results[name], default=str)[:3000]}", file=sys.stderr)

    def ms(v: float) -> str:
        return f"{v * 1000:.2f}"

    intervals, analyser = shipped_settings(args)
    print(f"\n### Interference scenario ({args.hogs} spinning BE threads on {len(_cpus())} CPUs, LS pod: probe"
          f" + {args.ls_threads} spinning threads; collectors {intervals}; analyser {analyser};"
          f" be_cpu_cores {args.be_cpu_cores:g}, be_cpus {'default' if args.be_cpus is None else args.be_cpus})\n")
    print("| strategy | probe p50 / p99 ms alone | BE start -> suspected s | -> confirmed cpu s | top culprit |"
          " probe p50 / p99 ms under BE | p99 vs alone | BE quota under BE | verdict cleared after BE stop s |"
          " false verdicts idle (suspected / confirmed) |")
    print("|---|---|---:|---:|---|---|---:|---:|---:|---:|")
    for name, r in results.items():
        conf, susp = r["cpu_confirmed"], r["cpu_suspected"]
        cells = [
            "dry-run" if name == "dryrun" else "acting",
            f"{ms(r['alone']['p50'])} / {ms(r['alone']['p99'])}",
            f"{susp[0]:.1f}" if susp else "none in 30 s",
            f"{conf[0]:.1f}" if conf else "none in 30 s",
            conf[1][0] if conf and conf[1] else "-",
            f"{ms(r['under']['p50'])} / {ms(r['under']['p99'])}",
            f"{r['under']['p99'] / r['alone']['p99']:.1f}x",
            str(r["be_quota"]),
            f"{r['cleared_after']:.1f}" if r["cleared_after"] is not None else "not in 40 s",
            f"{_count(r['false_idle'], 'suspected')} suspected / {_count(r['false_idle'], 'confirmed')} confirmed"
            f" in {args.idle:.0f} s",
        ]
        print("| " + " | ".join(cells) + " |")
    for name, r in results.items():
        if args.mem_mib:
            print(f"\n{name}: memory antagonist ({args.mem_mib} MiB loop under a {args.mem_mib // 2} MiB limit): "
                  f"LS memory verdict changes {[(c[2], c[3]) for c in r.get('memory_verdicts', [])]}")
    return 0


def _count(changes: list[Any], level: str) -> int:
    """Changes to ``level`` (any resource): a suspected verdict later confirmed counts in both."""
    return sum(1 for c in changes if c[2] == level)


def _cpus() -> list[str]:
    return [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("processor")]


if __name__ == "__main__":
    sys.exit(main())
