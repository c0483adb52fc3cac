"""Issue 17 end to end for the strategies: the shipped config lists every new one
enabled, and with no NodeSLO section they write nothing and evict no one, even on a
busy node; the node-level evictors honour dry-run (no stop, the plan explained with
its inputs)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from hooks.cgroups import CgroupLayout
from hooks.executor import CgroupExecutor
from hooks.rules import parse_rules
from metrics import model
from metrics.model import Sample, labels
from metrics.qos.evict import CriEvictor
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.qos.strategy import StrategyInit, load_strategies, parse_specs
from metrics.store.tsdb import TSDB
from runtimeproxy.hookapi import HostRoots
from tests.unit.metrics.qos.test_qos_nodeevict import FakeRuntime, pod

SHIPPED = Path(__file__).resolve().parents[4] / "systemd" / "config.yaml"
KEY = "tasks.qos-manager.strategies"
NOW = 5_000.0
ISSUE17 = {"memory-qos", "blkio", "system-config", "cpu-evict", "allocatable-evict"}
VM = {"min_free_kbytes": "67584", "watermark_scale_factor": "10"}


def shipped_tasks() -> dict[str, object]:
    doc = yaml.safe_load(SHIPPED.read_text())
    tasks: dict[str, object] = doc["tasks"]
    return tasks


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TSDB]:
    db = TSDB(tmp_path / "m.db", clock=lambda: NOW)
    # a node at 95% CPU for a minute, batch pods asking for more than any allocatable
    db.write([Sample(model.NODE_CPU_USAGE, 7.6, ts=NOW - i) for i in range(60)])
    db.write([Sample(model.POD_CPU_USAGE, 3.0, labels(pod_uid=u), NOW - 0.5) for u in ("x", "y")])
    db.flush()
    yield db
    db.close()


def v2_tree(root: Path) -> None:
    root.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu cpuset memory io\n")
    for rel in ("kubepods", "kubepods/burstable", "kubepods/besteffort", "kubepods/besteffort/podx",
                "kubepods/besteffort/pody"):
        d = root / rel
        d.mkdir(parents=True, exist_ok=True)
        for name, value in {"memory.min": "0", "memory.low": "0", "memory.high": "max", "memory.max": "max",
                            "io.max": "", "io.weight": "default 100", "cpu.max": "max 100000",
                            "cpu.weight": "100", "cpuset.cpus": "0-7"}.items():
            (d / name).write_text(value + "\n")


def snapshot(*roots: Path) -> dict[Path, str]:
    return {p: p.read_text() for r in roots for p in r.rglob("*") if p.is_file()}


def test_the_shipped_config_lists_every_new_strategy_and_collector_enabled() -> None:
    tasks = shipped_tasks()
    qos = tasks["qos-manager"]
    assert isinstance(qos, dict)
    specs = parse_specs(qos["strategies"], KEY)
    assert ISSUE17 <= {s.name for s in specs if s.enabled}
    metrics = tasks["metrics"]
    assert isinstance(metrics, dict) and metrics["collectors"]["resctrl-monitor"] == {"enabled": True}


@pytest.mark.asyncio
async def test_with_no_nodeslo_section_the_shipped_strategies_write_and_evict_nothing(tmp_path: Path,
                                                                                      store: TSDB) -> None:
    root, proc, sys = tmp_path / "cgroup", tmp_path / "proc", tmp_path / "sys"
    v2_tree(root)
    (proc / "sys" / "vm").mkdir(parents=True)
    for name, value in VM.items():
        (proc / "sys" / "vm" / name).write_text(value + "\n")
    sys.mkdir()
    qos = shipped_tasks()["qos-manager"]
    assert isinstance(qos, dict)
    executor = CgroupExecutor(CgroupLayout(root, version=2))
    config = ManagerConfig(capacity_cores=8.0, node_name="n1")
    init = StrategyInit(name="", args={}, key_path=KEY, config=config, topology=[], executor=executor,
                        host=HostRoots(cgroup=root, proc=proc, sys=sys, resctrl=tmp_path / "resctrl"),
                        state_dir=tmp_path / "state")
    loaded = load_strategies(parse_specs(qos["strategies"], KEY), init)
    assert ISSUE17 <= {s.name for s in loaded.enabled}
    runtime = FakeRuntime()
    pods = [pod("x", batch_milli=60_000, batch_mem=64 << 30), pod("y", batch_milli=60_000, batch_mem=64 << 30)]
    manager = QoSManager(reader=store, pods=lambda: pods, topology=[], executor=executor,
                         evictor=CriEvictor(runtime), rules=lambda: parse_rules({}), config=config,
                         clock=lambda: NOW, strategies=loaded.enabled)
    before = snapshot(root, proc, sys)
    await manager.run_once()
    await manager.run_once()
    assert snapshot(root, proc, sys) == before
    assert runtime.stopped == []
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").iterdir())


@pytest.mark.asyncio
@pytest.mark.parametrize(("name", "rules", "args", "owner"), [
    ("cpu-evict", {"resourceUsedThresholdWithBE": {"enable": True, "cpuEvictThresholdPercent": 80,
                                                   "cpuEvictTimeWindowSeconds": 5}}, {}, "cpu_evict"),
    ("allocatable-evict", {"resourceUsedThresholdWithBE": {"enable": True,
                                                           "cpuAllocatableEvictThresholdPercent": 110}},
     {"batch_cpu_milli": 10_000}, None),
])
async def test_node_level_eviction_in_dry_run_stops_nothing_and_explains(tmp_path: Path, store: TSDB, name: str,
                                                                         rules: dict[str, object],
                                                                         args: dict[str, object],
                                                                         owner: str | None) -> None:
    (tmp_path / "cgroup" / "cpu").mkdir(parents=True)
    executor = CgroupExecutor(CgroupLayout(tmp_path / "cgroup", version=1))
    config = ManagerConfig(capacity_cores=8.0, node_name="n1", dry_run=True)
    init = StrategyInit(name="", args={}, key_path=KEY, config=config, topology=[], executor=executor)
    loaded = load_strategies(parse_specs([{"name": name, "args": args}], KEY), init)
    runtime = FakeRuntime()
    pods = [pod("x", batch_milli=6_000), pod("y", batch_milli=6_000)]
    manager = QoSManager(reader=store, pods=lambda: pods, topology=[], executor=executor,
                         evictor=CriEvictor(runtime), rules=lambda: parse_rules(rules), config=config,
                         clock=lambda: NOW, strategies=loaded.enabled)
    await manager.run_once()
    assert runtime.stopped == []
    out = manager.explain()
    assert out["dry_run"]
    entries = [e for e in out["strategies"].values() if e.get("applied")]
    assert entries, out["strategies"]
    for entry in entries:
        assert {a["result"] for a in entry["applied"]} == {"dry-run"}
        assert entry["plan"]["inputs"]  # the plan shows what it read
    if owner is not None:
        assert out["strategies"][owner]["plan"]["inputs"]["release_cores"] > 0
