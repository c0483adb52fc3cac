"""Issue 4 on a real node: the metrics task inside the real proxy, real containerd pods.

A container spinning under a 0.5-CPU CFS quota must be reported as the kernel
accounts it (its cgroup's ``cpuacct.usage``, read by the test every few ms, over the
same intervals as the collector's samples) within 0.03 cores, and at most its quota:
on a loaded host the spinner gets less than its 0.5 cores, and a comparison with
the quota instead of the kernel's accounting then fails for the host, not the
collector (0.445 vs 0.5 seen twice). A container holding 100 MiB of anonymous memory within 5 %; the node total
must be consistent with the pods' sum. The numbers are read back from the store
file the proxy writes (read-only, as ``top`` does), from /metrics and from the
NodeMetric document on the loopback port.
"""

from __future__ import annotations

import bisect
import itertools
import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from criapi import cri_v1_pb2 as cri
from metrics import model
from metrics.store.tsdb import TSDB
from runtimeproxy.demo.scenario import kubelet_creates_pod_cgroup
from tests import tmpnames

MIB = 1 << 20
#: The pod and node collectors' sampling interval: every window below is sized from it.
POD_INTERVAL = 1.0
#: Samples each comparison needs (consecutive pairs bracketed by the kernel reads).
ROWS = 4
#: How long to wait for them on a loaded host (the agent's ticks and the reads can both lag).
PATIENCE = 60.0
#: Made by ``_remove_db_dir`` (not at import: a module collected but not run left it behind).
DB_DIR = tmpnames.unique("metrics")


@pytest.fixture(scope="module")
def proxy_config() -> dict[str, Any]:
    return {"tasks": {"metrics": {
        "db": str(DB_DIR / "metrics.db"),
        "flush_interval": "500ms",
        "report_interval": "2s",
        "intervals": {"psi": "2s", "schedlat": "2s", "pods": f"{POD_INTERVAL}s", "node": f"{POD_INTERVAL}s"},
        "node_name": "krpt-node",
    }}}


@pytest.fixture(scope="module", autouse=True)
def _remove_db_dir() -> Iterator[None]:
    DB_DIR.mkdir(mode=0o700)
    yield
    shutil.rmtree(DB_DIR, ignore_errors=True)


@pytest.fixture(scope="module")
def workload(proxy: Any, module_pods: Any) -> dict[str, Any]:
    """Two pods through the proxy: a 0.5-CPU spinner and a 100 MiB anonymous-memory holder."""
    rt = proxy.runtime()
    spin_pod = module_pods.sandbox("spinner", qos="burstable")
    kubelet_creates_pod_cgroup(spin_pod.linux.cgroup_parent)
    spin_sid = module_pods.run(rt, spin_pod)
    spin = module_pods.create(rt, spin_sid, spin_pod, module_pods.container(
        "spin", command=("sh", "-c", "while :; do :; done"),
        resources=cri.LinuxContainerResources(cpu_period=100000, cpu_quota=50000)))
    module_pods.start(rt, spin)
    mem_pod = module_pods.sandbox("holder", qos="burstable")
    kubelet_creates_pod_cgroup(mem_pod.linux.cgroup_parent)
    mem_sid = module_pods.run(rt, mem_pod)
    # dd reads 100 MiB of zeros into one buffer (touching every page), then blocks
    # writing it to a pipe nobody reads: the buffer stays resident as anonymous memory.
    holder = module_pods.create(rt, mem_sid, mem_pod, module_pods.container(
        "hold", command=("sh", "-c", "dd if=/dev/zero bs=104857600 count=1 | sleep 3600")))
    module_pods.start(rt, holder)
    started = time.time()
    return {"spin_pod": spin_pod, "spin": spin, "mem_pod": mem_pod, "holder": holder, "started": started}


class KernelUsage:
    """The spinner's ``cpuacct.usage`` and CFS counters (``cpu.stat``), read every few
    ms with the wall clock around each read, so the kernel's accounting over any
    interval of the collector's samples can be interpolated."""

    def __init__(self, usage_file: Path, cpu_stat: Path) -> None:
        self._file = usage_file
        self._stat = cpu_stat
        self.times: list[float] = []
        self.usage_ns: list[int] = []
        #: (nr_periods, nr_throttled) at each read.
        self.cfs: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kernel-usage", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            before = time.time()
            value = int(self._file.read_text())
            stat = dict(line.split() for line in self._stat.read_text().splitlines())
            after = time.time()
            if after - before < 0.005:  # descheduled mid-read: the instant is unknown
                self.times.append((before + after) / 2)
                self.usage_ns.append(value)
                self.cfs.append((int(stat["nr_periods"]), int(stat["nr_throttled"])))

    def wait_covering(self, seconds: float) -> float:
        """Sleep until the reads cover the last ``seconds``; return now."""
        while not self.times or self.times[0] > time.time() - seconds:
            time.sleep(0.1)
        return time.time()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def bracketed(self, t: float) -> bool:
        """Whether reads close around ``t`` (within 0.25 s) pin the kernel's counter there:
        a sample at a moment the reader thread was descheduled is not compared."""
        times = list(self.times)
        i = bisect.bisect_left(times, t)
        return 0 < i < len(times) and times[i] - times[i - 1] < 0.25

    def _at(self, t: float, series: list[float]) -> float:
        """``series`` at wall time ``t``, interpolated between the two nearest reads."""
        i = bisect.bisect_left(self.times, t)
        assert 0 < i < len(self.times), f"{t} is outside the reads ({self.times[0]}..{self.times[-1]})"
        t0, t1, v0, v1 = self.times[i - 1], self.times[i], series[i - 1], series[i]
        assert t1 - t0 < 0.25, f"no read of the spinner's cgroup for {t1 - t0:.3f}s around {t}"
        return v0 + (v1 - v0) * (t - t0) / (t1 - t0)

    def cores(self, start: float, end: float) -> float:
        usage = [float(u) for u in self.usage_ns]
        return (self._at(end, usage) - self._at(start, usage)) / 1e9 / (end - start)

    def throttled(self, start: float, end: float) -> tuple[float, float]:
        """(CFS periods, throttled periods) between the two instants."""
        periods = [float(p) for p, _ in self.cfs]
        throttled = [float(t) for _, t in self.cfs]
        return (self._at(end, periods) - self._at(start, periods),
                self._at(end, throttled) - self._at(start, throttled))


@pytest.fixture(scope="module")
def kernel_usage(workload: dict[str, Any]) -> Iterator[KernelUsage]:
    rel = workload["spin_pod"].linux.cgroup_parent.lstrip("/")
    reads = KernelUsage(Path("/sys/fs/cgroup/cpuacct") / rel / workload["spin"] / "cpuacct.usage",
                        Path("/sys/fs/cgroup/cpu") / rel / workload["spin"] / "cpu.stat")
    yield reads
    reads.stop()


def _store() -> TSDB:
    return TSDB.open_readonly(DB_DIR / "metrics.db")


def _get(proxy: Any, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.metrics_port}{path}", timeout=5) as resp:
        body: bytes = resp.read()
    return body.decode()


def _mean(values: Iterable[float]) -> float:
    items = list(values)
    return sum(items) / len(items)


def _container_labels(pod: cri.PodSandboxConfig, cid: str) -> model.Labels:
    return model.labels(pod_uid=pod.metadata.uid, container_id=cid)


def _spinner_samples(workload: dict[str, Any], kernel_usage: KernelUsage) -> tuple[
        list[tuple[float, float]], dict[float, float], dict[float, float]]:
    """The spinner's container CPU samples (and its pod's, and the throttled share) since
    the kernel reads began, once ``ROWS`` consecutive pairs are bracketed by reads: waits
    on the store (polled at the sampling interval), not for a fixed time."""
    labels = _container_labels(workload["spin_pod"], workload["spin"])
    pod_labels = model.labels(pod_uid=workload["spin_pod"].metadata.uid)
    deadline = time.monotonic() + PATIENCE
    while True:
        kernel_usage.wait_covering(0.1)
        since = kernel_usage.times[0] + 0.05
        store = _store()
        try:
            end = time.time()
            points = [p for p in store.points(model.CONTAINER_CPU_USAGE, labels, since, end)]
            pod = dict(store.points(model.POD_CPU_USAGE, pod_labels, since, end))
            throttled = dict(store.points(model.CONTAINER_CPU_THROTTLED, labels, since, end))
        finally:
            store.close()
        pairs = [(a, b) for a, b in itertools.pairwise(points)
                 if kernel_usage.bracketed(a[0]) and kernel_usage.bracketed(b[0])]
        if len(pairs) >= ROWS and sum(1 for _, (ts, _v) in pairs if ts in pod and ts in throttled) >= ROWS:
            return points, pod, throttled
        assert time.monotonic() < deadline, f"{len(pairs)} bracketed sample pairs after {PATIENCE}s: {points}"
        time.sleep(POD_INTERVAL)


def test_spinner_is_reported_as_the_kernel_accounts_it(workload: dict[str, Any], kernel_usage: KernelUsage) -> None:
    """Each collector sample is the container's cores since the previous one: pair it
    with the kernel's CPU time between the two samples' instants."""
    points, pod, throttled = _spinner_samples(workload, kernel_usage)
    pairs = [(a, b) for a, b in itertools.pairwise(points)
             if kernel_usage.bracketed(a[0]) and kernel_usage.bracketed(b[0])]
    # (sample time, collector's cores, kernel's cores over the same interval)
    rows = [(ts, value, kernel_usage.cores(prev, ts)) for (prev, _), (ts, value) in pairs]
    assert len(rows) >= ROWS, points
    collected, kernel = _mean(v for _, v, _ in rows), _mean(k for _, _, k in rows)
    assert abs(collected - kernel) <= 0.03, rows
    assert 0.1 < kernel <= 0.5 + 0.03, rows  # it ran, and CFS held it to its quota
    # The pod holds only the spinner: the same cores (its own samples, same ticks).
    pod_rows = [(pod[ts], k) for ts, _, k in rows if ts in pod]
    assert len(pod_rows) >= 3, (pod, rows)
    assert abs(_mean(v for v, _ in pod_rows) - _mean(k for _, k in pod_rows)) <= 0.03, pod_rows
    # The throttled share of CFS periods, as the kernel counted them in the same
    # intervals (on an idle host nearly every period; on a loaded one fewer).
    cfs = [(throttled[ts], *kernel_usage.throttled(prev, ts)) for (prev, _), (ts, _v) in pairs if ts in throttled]
    assert len(cfs) >= 3, (throttled, points)
    periods = sum(n for _, n, _ in cfs)
    assert periods > 5, cfs  # a quota'd spinner that ran: CFS periods elapsed
    assert abs(_mean(r for r, _, _ in cfs) - sum(t for _, _, t in cfs) / periods) <= 0.15, cfs


def _eventually(check: Callable[[], tuple[bool, Any]], what: str) -> Any:
    """``check()`` -> (done, detail), polled at the sampling interval until done (the
    store's state, not a fixed wait); AssertionError with the last detail after PATIENCE."""
    deadline = time.monotonic() + PATIENCE
    while True:
        done, detail = check()
        if done:
            return detail
        assert time.monotonic() < deadline, f"{what} after {PATIENCE}s: {detail}"
        time.sleep(POD_INTERVAL)


def test_holder_of_100_mib_is_reported_within_5_percent(workload: dict[str, Any]) -> None:
    labels = _container_labels(workload["mem_pod"], workload["holder"])

    def check() -> tuple[bool, Any]:  # dd fills its buffer at its own pace on a loaded host
        store = _store()
        try:
            last = store.last(model.CONTAINER_MEMORY_USED, labels, max_age=3 * POD_INTERVAL + 2, now=time.time())
        finally:
            store.close()
        return last is not None and abs(last.value - 100 * MIB) <= 0.05 * 100 * MIB, last

    _eventually(check, "the holder's memory within 5 % of 100 MiB")


def test_node_total_is_consistent_with_the_pods(workload: dict[str, Any], kernel_usage: KernelUsage) -> None:
    window = ROWS * POD_INTERVAL + 1  # at least ROWS samples of each series at the sampling interval
    spin_labels = model.labels(pod_uid=workload["spin_pod"].metadata.uid)

    def check() -> tuple[bool, Any]:
        kernel_usage.wait_covering(window + 1)
        now = time.time() - 0.5  # the newest samples, bracketed by reads on both sides
        store = _store()
        try:
            read = (store.aggregate(model.NODE_CPU_USAGE, model.NO_LABELS, now - window, now),
                    store.last(model.NODE_CPU_CAPACITY, model.NO_LABELS, max_age=window, now=now),
                    store.aggregate_all(model.POD_CPU_USAGE, now - window, now),
                    store.aggregate(model.SYSTEM_CPU_USAGE, model.NO_LABELS, now - window, now),
                    store.last(model.NODE_MEMORY_USED, model.NO_LABELS, max_age=window, now=now),
                    store.aggregate_all(model.POD_MEMORY_USED, now - window, now),
                    # one sample before the window: the first sample's interval starts there
                    store.points(model.POD_CPU_USAGE, spin_labels, now - window - 2 * POD_INTERVAL, now))
        finally:
            store.close()
        node, capacity, pods, system, node_mem, _, points = read
        spinner = pods.get(spin_labels)
        pairs = [(a, b) for a, b in itertools.pairwise(points)
                 if b[0] >= now - window and kernel_usage.bracketed(a[0]) and kernel_usage.bracketed(b[0])]
        done = (node is not None and node.count >= ROWS and capacity is not None and system is not None
                and node_mem is not None and spinner is not None and spinner.count >= ROWS
                and len(pairs) >= ROWS - 1)
        return done, (*read, pairs)

    node, capacity, pods, system, node_mem, pod_mem, _, pairs = _eventually(check, f"{ROWS} samples of node and pods")
    pods_sum = sum(a.avg for a in pods.values())
    # The pods' sum is the spinner's plus the holder's (which sleeps): the spinner's samples
    # against the kernel's accounting over each sample's own interval (its quota, 0.5, on
    # an idle host; less, and varying, on a loaded one, so one average over a window
    # bracketed differently does not compare).
    others = pods_sum - pods[spin_labels].avg
    collected = _mean(v for _, (_, v) in pairs) + others
    kernel = _mean(kernel_usage.cores(a, b) for (a, _), (b, _) in pairs)
    assert kernel - 0.05 <= collected <= kernel + 0.1, (pairs, pods, kernel)
    # The node sees every pod's CPU plus whatever else runs (sampling windows differ a little).
    assert node.avg >= pods_sum - 0.1, (node, pods_sum)
    assert node.avg <= capacity.value + 0.05
    assert system.avg >= 0.0
    assert abs(system.avg - max(node.avg - pods_sum, 0.0)) <= 0.15, (system, node, pods_sum)
    assert node_mem.value >= sum(a.last for a in pod_mem.values())


def test_prometheus_exposes_koordlet_names(proxy: Any, workload: dict[str, Any]) -> None:
    spin_uid = workload["spin_pod"].metadata.uid

    def check() -> tuple[bool, Any]:
        text = _get(proxy, "/metrics")
        return ('koordlet_node_used_cpu_cores{node="krpt-node"}' in text
                and any(spin_uid in line and line.startswith("koord_runtime_proxy_pod_cpu_usage_cores")
                        for line in text.splitlines())), text[-2000:]

    _eventually(check, "koordlet's node metric and the spinner's pod metric on /metrics")


def test_nodemetric_document_on_loopback(proxy: Any, workload: dict[str, Any]) -> None:
    def check() -> tuple[bool, Any]:
        doc = json.loads(_get(proxy, "/apis/nodemetric"))
        status = doc.get("status", doc)
        names = {(p["namespace"], p["name"]) for p in status.get("podsMetric", [])}
        return ("nodeUsage" in status.get("nodeMetric", {})
                and ("krp-test", "spinner") in names and ("krp-test", "holder") in names), status

    _eventually(check, "both pods in the NodeMetric document")


def test_top_reads_the_store(workload: dict[str, Any]) -> None:
    def check() -> tuple[bool, Any]:
        out = subprocess.run([sys.executable, "-m", "runtimeproxy.cli", "top", "--db", str(DB_DIR / "metrics.db"),
                              "--window", str(3 * POD_INTERVAL)], capture_output=True, text=True, timeout=30,
                             check=False)
        assert out.returncode == 0, out.stderr
        lines = {line.split()[1]: line for line in out.stdout.splitlines()[1:] if line.startswith("krp-test")}
        return "spinner" in lines and "holder" in lines, out.stdout

    _eventually(check, "both pods in top")
