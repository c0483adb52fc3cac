"""resctrl-monitor collector on a fixture resctrl tree (this host has none): LLC occupancy
and bandwidth rates per class group and per pod group, worked by hand; counters that go
back, "Unavailable", a missing mount (one log line, nothing else); and the scrape under
koordlet's names."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from hooks.qos import QoSClass
from metrics.agent import MetricsAgent, metrics_task
from metrics.collect.resctrlmon import ResctrlMonitorCollector
from metrics.model import (
    POD_RESCTRL_LLC,
    POD_RESCTRL_MB,
    RESCTRL_LLC,
    RESCTRL_MB,
    RESCTRL_MB_TOTAL,
    PodView,
    Sample,
)
from metrics.report.promexport import LatestValues, register_exporter
from metrics.store.tsdb import TSDB
from runtimeproxy.hookapi import HostRoots, TaskInit

MiB = 1 << 20
WEB = PodView(uid="u-web", namespace="shop", name="web", sandbox_id="sb", qos=QoSClass.LSR, priority=9500,
              priority_class="koord-prod", cgroup_dir="kubepods/podu-web")
JOB = PodView(uid="u-job", namespace="batch", name="job", sandbox_id="sb2", qos=QoSClass.BE, priority=5000,
              priority_class="koord-batch", cgroup_dir="kubepods/besteffort/podu-job")


def mon(group: Path, cache_id: str, llc: int | str, total: int | str, local: int | str) -> None:
    d = group / "mon_data" / f"mon_L3_{cache_id}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "llc_occupancy").write_text(f"{llc}\n")
    (d / "mbm_total_bytes").write_text(f"{total}\n")
    (d / "mbm_local_bytes").write_text(f"{local}\n")


def tree(root: Path) -> Path:
    (root / "info" / "L3_MON").mkdir(parents=True)
    (root / "info" / "L3_MON" / "mon_features").write_text("llc_occupancy\nmbm_total_bytes\nmbm_local_bytes\n")
    for group in ("LSR", "LS", "BE"):
        (root / group).mkdir()
    return root


def by_key(samples: list[Sample], metric: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {s.labels: s.value for s in samples if s.metric == metric}


def test_class_and_pod_groups_llc_and_bandwidth_rates_by_hand(tmp_path: Path) -> None:
    root = tree(tmp_path / "resctrl")
    mon(root / "BE", "00", 6 * MiB, 1_000_000, 400_000)
    mon(root / "BE", "01", 2 * MiB, 5_000_000, 5_000_000)
    mon(root / "koordlet-u-web", "00", 3 * MiB, 0, 0)  # the resctrl hook's pod group
    mon(root / "BE" / "mon_groups" / "koordlet-u-job", "00", MiB, 100, 100)  # a monitoring group under BE
    collector = ResctrlMonitorCollector(root)
    first = collector.collect(100.0, [WEB, JOB])
    llc = by_key(first, RESCTRL_LLC)
    assert llc == {(("cache_id", "0"), ("qos", "BE")): 6 * MiB, (("cache_id", "1"), ("qos", "BE")): 2 * MiB}
    assert by_key(first, POD_RESCTRL_LLC) == {(("cache_id", "0"), ("pod_uid", "u-web")): 3 * MiB,
                                              (("cache_id", "0"), ("pod_uid", "u-job")): MiB}
    assert by_key(first, RESCTRL_MB) == {}  # a rate needs two reads
    assert by_key(first, RESCTRL_MB_TOTAL)[(("cache_id", "0"), ("mb_type", "mbm_total_bytes"), ("qos", "BE"))] == 1e6
    mon(root / "BE", "00", 7 * MiB, 21_000_000, 10_400_000)
    mon(root / "BE", "01", 2 * MiB, 4_000_000, 5_500_000)  # total went back (group re-created): no rate
    mon(root / "koordlet-u-web", "00", 3 * MiB, 50_000_000, 25_000_000)
    second = collector.collect(110.0, [WEB, JOB])
    rates = by_key(second, RESCTRL_MB)
    # (21 000 000 - 1 000 000) B / 10 s = 2 000 000 B/s; local (10 400 000 - 400 000) / 10 = 1 000 000 B/s
    assert rates == {(("cache_id", "0"), ("mb_type", "mbm_total_bytes"), ("qos", "BE")): 2_000_000.0,
                     (("cache_id", "0"), ("mb_type", "mbm_local_bytes"), ("qos", "BE")): 1_000_000.0,
                     (("cache_id", "1"), ("mb_type", "mbm_local_bytes"), ("qos", "BE")): 50_000.0}
    pod_rates = by_key(second, POD_RESCTRL_MB)
    # web: 50 000 000 B / 10 s = 5 000 000 B/s total, 2 500 000 B/s local; job unchanged: 0
    assert pod_rates[(("cache_id", "0"), ("mb_type", "mbm_total_bytes"), ("pod_uid", "u-web"))] == 5_000_000.0
    assert pod_rates[(("cache_id", "0"), ("mb_type", "mbm_local_bytes"), ("pod_uid", "u-web"))] == 2_500_000.0
    assert pod_rates[(("cache_id", "0"), ("mb_type", "mbm_total_bytes"), ("pod_uid", "u-job"))] == 0.0
    assert all(s.ts == 110.0 for s in second)


def test_unavailable_counters_and_gone_pods(tmp_path: Path) -> None:
    root = tree(tmp_path / "resctrl")
    mon(root / "LS", "0", "Unavailable", "Unavailable", 10)
    mon(root / "koordlet-u-web", "0", MiB, 10, 10)
    collector = ResctrlMonitorCollector(root)
    first = collector.collect(1.0, [WEB])
    assert by_key(first, RESCTRL_LLC) == {}  # Unavailable: no sample, not a 0
    assert [s.labels for s in first if s.metric == RESCTRL_MB_TOTAL] == [
        (("cache_id", "0"), ("mb_type", "mbm_local_bytes"), ("qos", "LS"))]
    assert by_key(first, POD_RESCTRL_LLC)
    assert by_key(collector.collect(2.0, []), POD_RESCTRL_LLC) == {}  # the pod is gone: its group is not read
    assert all(key[0] != str(root / "koordlet-u-web") for key in collector._last)


def test_garbage_is_one_log_line_per_file_not_a_sample(tmp_path: Path) -> None:
    root = tree(tmp_path / "resctrl")
    mon(root / "LSR", "0", "lots", 10, 10)
    collector = ResctrlMonitorCollector(root)
    with capture_logs() as logs:
        collector.collect(1.0, [])
        collector.collect(2.0, [])
    skipped = [e for e in logs if e["event"] == "sample_skipped"]
    assert len(skipped) == 1 and "llc_occupancy" in skipped[0]["path"]
    assert "'lots' is not an integer" in skipped[0]["reason"]


def test_no_resctrl_is_one_line_and_nothing_else(tmp_path: Path) -> None:
    with capture_logs() as logs:
        collector = ResctrlMonitorCollector(tmp_path / "nothing")
        assert collector.collect(1.0, [WEB]) == [] and collector.collect(2.0, [WEB]) == []
    assert [e["event"] for e in logs] == ["resctrl_monitor_unavailable"]
    # resctrl mounted with CAT but no monitoring (no info/L3_MON): the same
    (tmp_path / "cat" / "info" / "L3").mkdir(parents=True)
    mon(tmp_path / "cat" / "BE", "0", MiB, 1, 1)
    assert ResctrlMonitorCollector(tmp_path / "cat").collect(1.0, []) == []


def test_scraped_under_koordlets_names(tmp_path: Path) -> None:
    root = tree(tmp_path / "resctrl")
    mon(root / "BE", "0", 6 * MiB, 1_000, 0)
    mon(root / "koordlet-u-web", "0", MiB, 0, 0)
    collector = ResctrlMonitorCollector(root)
    latest = LatestValues(clock=lambda: 100.0)
    latest.update(collector.collect(90.0, [WEB]))
    mon(root / "BE", "0", 6 * MiB, 11_000, 0)
    latest.update(collector.collect(100.0, [WEB]))
    exporter = register_exporter(CollectorRegistry(), latest, lambda: [WEB], "node-a")
    got: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(exporter.render().decode()):
        for sample in family.samples:
            got.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    assert got["koordlet_resctrl_llc_occupancy"] == [({"node": "node-a", "cache_id": "0", "qos": "BE"}, 6 * MiB)]
    assert ({"node": "node-a", "cache_id": "0", "qos": "BE", "mb_type": "mbm_total_bytes"}, 1000.0) in got[
        "koordlet_resctrl_memory_bandwidth"]  # (11 000 - 1 000) B / 10 s
    assert got["koord_runtime_proxy_pod_resctrl_llc_occupancy_bytes"] == [
        ({"node": "node-a", "pod_uid": "u-web", "pod_name": "web", "pod_namespace": "shop", "cache_id": "0"}, MiB)]


@pytest.mark.asyncio
@pytest.mark.parametrize("mounted", [True, False])
async def test_the_metrics_task_runs_it_only_where_resctrl_monitoring_exists(tmp_path: Path, mounted: bool) -> None:
    host = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys",
                     resctrl=tmp_path / "resctrl")
    (host.proc).mkdir()
    (host.proc / "stat").write_text("cpu  100 0 50 800 0 0 0 0 0 0\ncpu0 100 0 50 800 0 0 0 0 0 0\n")
    (host.proc / "meminfo").write_text("MemTotal:  8000 kB\nMemFree:  1000 kB\nMemAvailable:  3000 kB\n")
    (host.sys / "devices/system/cpu").mkdir(parents=True)
    (host.sys / "devices/system/cpu/online").write_text("0\n")
    for controller in ("cpu", "cpuacct", "memory", "cpuset"):
        (host.cgroup / controller).mkdir(parents=True)
    if mounted:
        mon(tree(host.resctrl) / "BE", "0", 6 * MiB, 0, 0)
    provided: list[object] = []  # what the task hands the tasks built on it: its agent
    init = TaskInit(name="metrics", key_path="tasks.metrics", provide=provided.append,
                    snapshot=lambda: ({}, {}), host=host,
                    add_route=lambda _p, _h: None, add_explainer=lambda _name, _explainer: None,
                    args={"db": str(tmp_path / "m.db"), "schedlat_source": "off", "cpi": False,
                          "intervals": {"node": "100ms", "pods": "100ms", "resctrl": "100ms", "topology": "1h"}})
    with capture_logs() as logs:
        run = metrics_task(init)
    agent = provided[0]
    assert isinstance(agent, MetricsAgent)
    assert ("resctrl-monitor" in agent.ticks) is mounted
    assert ([e for e in logs if e["event"] == "resctrl_monitor_unavailable"] != []) is not mounted
    if not mounted:
        return
    task = asyncio.create_task(run())
    try:
        for _ in range(300):
            if agent.ticks["resctrl-monitor"] >= 2:
                break
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    with TSDB.open_readonly(tmp_path / "m.db") as db:
        assert db.series(RESCTRL_LLC) == [(("cache_id", "0"), ("qos", "BE"))]
