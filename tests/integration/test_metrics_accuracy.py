"""Issue 4 on a real node: the metrics task inside the real proxy, real containerd pods.

A container spinning under a 0.5-CPU CFS quota must be reported at 0.5 ± 0.05
cores; a container holding 100 MiB of anonymous memory within 5 %; the node total
must be consistent with the pods' sum. The numbers are read back from the store
file the proxy writes (read-only, as ``top`` does), from /metrics and from the
NodeMetric document on the loopback port.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from criapi import cri_v1_pb2 as cri
from metrics import model
from metrics.tsdb import TSDB
from runtimeproxy.demo import kubelet_creates_pod_cgroup

MIB = 1 << 20
DB_DIR = Path(tempfile.mkdtemp(prefix="krpt-metrics-"))


@pytest.fixture(scope="module")
def proxy_config() -> dict[str, Any]:
    return {"tasks": {"metrics": {
        "db": str(DB_DIR / "metrics.db"),
        "flush_interval": "500ms",
        "report_interval": "2s",
        "intervals": {"psi": "2s", "schedlat": "2s"},
        "node_name": "krpt-node",
    }}}


@pytest.fixture(scope="module", autouse=True)
def _remove_db_dir() -> Iterator[None]:
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


def _store() -> TSDB:
    return TSDB.open_readonly(DB_DIR / "metrics.db")


def _wait_window(workload: dict[str, Any], seconds: float) -> float:
    """Sleep until the workload has run ``seconds`` (plus a flush); return now."""
    remaining = workload["started"] + seconds + 1.5 - time.time()
    if remaining > 0:
        time.sleep(remaining)
    return time.time()


def _get(proxy: Any, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.metrics_port}{path}", timeout=5) as resp:
        body: bytes = resp.read()
    return body.decode()


def _container_labels(pod: cri.PodSandboxConfig, cid: str) -> model.Labels:
    return model.labels(pod_uid=pod.metadata.uid, container_id=cid)


def test_spinner_under_half_a_cpu_is_reported_at_half_a_core(workload: dict[str, Any]) -> None:
    now = _wait_window(workload, 8)
    store = _store()
    try:
        agg = store.aggregate(model.CONTAINER_CPU_USAGE, _container_labels(workload["spin_pod"], workload["spin"]),
                              now - 5, now)
        pod_agg = store.aggregate(model.POD_CPU_USAGE, model.labels(pod_uid=workload["spin_pod"].metadata.uid),
                                  now - 5, now)
        throttled = store.aggregate(model.CONTAINER_CPU_THROTTLED,
                                    _container_labels(workload["spin_pod"], workload["spin"]), now - 5, now)
    finally:
        store.close()
    assert agg is not None and agg.count >= 3, agg
    assert abs(agg.avg - 0.5) <= 0.05, agg
    assert pod_agg is not None and abs(pod_agg.avg - 0.5) <= 0.05, pod_agg
    # A spinner capped by CFS is throttled in (nearly) every period.
    assert throttled is not None and throttled.avg > 0.5, throttled


def test_holder_of_100_mib_is_reported_within_5_percent(workload: dict[str, Any]) -> None:
    now = _wait_window(workload, 6)
    store = _store()
    try:
        last = store.last(model.CONTAINER_MEMORY_USED, _container_labels(workload["mem_pod"], workload["holder"]),
                          max_age=5, now=now)
    finally:
        store.close()
    assert last is not None
    assert abs(last.value - 100 * MIB) <= 0.05 * 100 * MIB, last.value / MIB


def test_node_total_is_consistent_with_the_pods(workload: dict[str, Any]) -> None:
    now = _wait_window(workload, 8)
    store = _store()
    try:
        node = store.aggregate(model.NODE_CPU_USAGE, model.NO_LABELS, now - 5, now)
        capacity = store.last(model.NODE_CPU_CAPACITY, model.NO_LABELS, max_age=5, now=now)
        pods = store.aggregate_all(model.POD_CPU_USAGE, now - 5, now)
        system = store.aggregate(model.SYSTEM_CPU_USAGE, model.NO_LABELS, now - 5, now)
        node_mem = store.last(model.NODE_MEMORY_USED, model.NO_LABELS, max_age=5, now=now)
        pod_mem = store.aggregate_all(model.POD_MEMORY_USED, now - 5, now)
    finally:
        store.close()
    assert node is not None and capacity is not None and system is not None and node_mem is not None
    pods_sum = sum(a.avg for a in pods.values())
    assert 0.45 <= pods_sum, pods  # the spinner alone is 0.5
    # The node sees every pod's CPU plus whatever else runs (sampling windows differ a little).
    assert node.avg >= pods_sum - 0.1, (node, pods_sum)
    assert node.avg <= capacity.value + 0.05
    assert system.avg >= 0.0
    assert abs(system.avg - max(node.avg - pods_sum, 0.0)) <= 0.15, (system, node, pods_sum)
    assert node_mem.value >= sum(a.last for a in pod_mem.values())


def test_prometheus_exposes_koordlet_names(proxy: Any, workload: dict[str, Any]) -> None:
    _wait_window(workload, 3)
    text = _get(proxy, "/metrics")
    assert 'koordlet_node_used_cpu_cores{node="krpt-node"}' in text
    spin_uid = workload["spin_pod"].metadata.uid
    assert any(spin_uid in line and line.startswith("koord_runtime_proxy_pod_cpu_usage_cores")
               for line in text.splitlines()), text[-2000:]


def test_nodemetric_document_on_loopback(proxy: Any, workload: dict[str, Any]) -> None:
    _wait_window(workload, 5)
    doc = json.loads(_get(proxy, "/apis/nodemetric"))
    status = doc.get("status", doc)
    assert "nodeUsage" in status["nodeMetric"]
    names = {(p["namespace"], p["name"]) for p in status["podsMetric"]}
    assert ("krp-test", "spinner") in names and ("krp-test", "holder") in names


def test_top_reads_the_store(workload: dict[str, Any]) -> None:
    _wait_window(workload, 4)
    out = subprocess.run([sys.executable, "-m", "runtimeproxy.cli", "top", "--db", str(DB_DIR / "metrics.db"),
                          "--window", "3"], capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[1]: line for line in out.stdout.splitlines()[1:] if line.startswith("krp-test")}
    assert "spinner" in lines and "holder" in lines, out.stdout
