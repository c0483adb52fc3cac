"""The strategy interface and registry: a new strategy is one module and one entry
point; it is planned from declared inputs (read once per round), arbitrated by its
declared priority and explained; the config lists, orders and disables strategies."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hooks.cgroups import CgroupLayout
from hooks.executor import CgroupExecutor
from hooks.qos import QoSClass
from hooks.rules import Rules, parse_rules
from metrics import model
from metrics.collect.topology import CPUInfo
from metrics.model import ContainerView, PodView, Sample, labels
from metrics.qos.evict import CriEvictor
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.qos.strategy import GROUP, StrategyInit, load_strategies, parse_specs
from metrics.store.tsdb import TSDB
from runtimeproxy.hookapi import HookConfigError, HostRoots
from tests.unit.metrics.qos import tinystrategy

NOW = 5_000.0
TOPOLOGY = [CPUInfo(cpu=i, core=i % 4, socket=0, numa=0) for i in range(8)]
BE_DIR = "kubepods/besteffort"
TINY = importlib.metadata.EntryPoint("tiny", "tests.unit.metrics.qos.tinystrategy:tiny", GROUP)
TINY_TOO = importlib.metadata.EntryPoint("tiny-too", "tests.unit.metrics.qos.tinystrategy:tiny", GROUP)
KEY = "tasks.qos-manager.strategies"


def make_pod(uid: str, qos: QoSClass, kube: str) -> PodView:
    d = f"kubepods/{kube}/pod{uid}"
    return PodView(uid=uid, namespace="ns", name=uid, sandbox_id=uid, qos=qos, priority=5500, priority_class="",
                   cgroup_dir=d, kube_qos=kube, containers=(ContainerView(f"c{uid}", "main", f"{d}/c{uid}"),))


LS = make_pod("a", QoSClass.LS, "burstable")
BE = make_pod("c", QoSClass.BE, "besteffort")


def build_tree(root: Path) -> None:
    files = {"cpu": {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"},
             "cpuset": {"cpuset.cpus": "0-7", "cpuset.mems": "0"}}
    dirs = ["", "kubepods", BE_DIR, "kubepods/burstable"]
    dirs += [d for p in (LS, BE) for d in (p.cgroup_dir, p.containers[0].cgroup_dir)]
    for controller, names in files.items():
        for d in dirs:
            (root / controller / d).mkdir(parents=True, exist_ok=True)
            for name, value in names.items():
                (root / controller / d / name).write_text(value + "\n")


async def _no_runtime(method: str, payload: bytes, timeout: float) -> bytes:
    return b""


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TSDB]:
    db = TSDB(tmp_path / "m.db", clock=lambda: NOW)
    db.write([Sample(model.NODE_CPU_USAGE, 4.0, ts=NOW - 0.5),
              Sample(model.NODE_MEMORY_USED, 500.0, ts=NOW - 0.5),
              Sample(model.NODE_MEMORY_TOTAL, 1000.0, ts=NOW - 0.5),
              Sample(model.POD_CPU_USAGE, 2.0, labels(pod_uid="a"), NOW - 0.5),
              Sample(model.POD_CPU_USAGE, 1.0, labels(pod_uid="c"), NOW - 0.5)])
    yield db
    db.close()


def base_init(root: Path, executor: CgroupExecutor) -> StrategyInit:
    host = HostRoots(cgroup=root, proc=root / "proc", sys=root / "sys", resctrl=root / "resctrl")
    return StrategyInit(name="", args={}, key_path=KEY, config=ManagerConfig(reserved_cores=0.5),
                        topology=TOPOLOGY, executor=executor, host=host)


def installed_plus(*extra: importlib.metadata.EntryPoint) -> list[Any]:
    return [*importlib.metadata.entry_points(group=GROUP), *extra]


@pytest.mark.asyncio
async def test_a_strategy_from_an_entry_point_is_planned_arbitrated_and_explained(tmp_path: Path,
                                                                                  store: TSDB) -> None:
    root = tmp_path / "cgroup"
    build_tree(root)
    executor = CgroupExecutor(CgroupLayout(root))
    specs = parse_specs(["be-evict", "cpu-suppress", {"name": "tiny", "args": {"quota": 40_000}},
                         {"name": "tiny-too", "args": {"quota": 30_000}}], KEY)
    loaded = load_strategies(specs, base_init(root, executor), installed_plus(TINY, TINY_TOO))
    assert [s.name for s in loaded.enabled] == ["be-evict", "cpu-suppress", "tiny", "tiny-too"]
    rules: list[Rules] = [parse_rules({"resourceUsedThresholdWithBE": {"enable": True}})]
    manager = QoSManager(reader=store, pods=lambda: [LS, BE], topology=TOPOLOGY, executor=executor,
                         evictor=CriEvictor(_no_runtime), rules=lambda: rules[0],
                         config=ManagerConfig(reserved_cores=0.5), clock=lambda: NOW, strategies=loaded.enabled)
    tinystrategy.READS.clear()
    await manager.run_once()
    # tiny (35) beats suppress (30) on the BE quota, and tiny-too (35) by name
    assert (root / "cpu" / BE_DIR / "cpu.cfs_quota_us").read_text().strip() == "40000"
    # suppress still owns the cpuset: 8 x 65% - 2.0 - max(4 - 3, 0.5) = 2.2 -> 3 CPUs (a HT pair first)
    assert (root / "cpuset" / BE_DIR / "cpuset.cpus").read_text().strip() == "0-1,4"
    assert tinystrategy.READS == [NOW]  # declared by two strategies, read once
    out = manager.explain()
    tiny = out["strategies"]["tiny"]
    assert tiny["owner"] == "tiny" and tiny["reads"] == ["node", "tiny_pods"]
    assert tiny["plan"]["priority"] == "35" and tiny["plan"]["inputs"] == {"pods": 2, "node_cpu_used": 4.0}
    assert [a["result"] for a in tiny["applied"]] == ["written"]
    assert [r["winner"] for r in out["strategies"]["tiny-too"]["rejected"]] == ["tiny"]
    suppress_lost = [r for r in out["strategies"]["cpu_suppress"]["rejected"] if r["winner"] == "tiny"]
    assert [r["action"]["target"] for r in suppress_lost] == [f"{BE_DIR}:cpu.cfs_quota_us"]
    assert out["inputs"]["tiny_pods"] == {"pods": 2} and out["order"] == [s.name for s in loaded.enabled]
    # not enabled for these rules: nothing read, nothing planned, its explain entries gone
    rules[0] = parse_rules({})
    await manager.run_once()
    assert tinystrategy.READS == [NOW]
    out = manager.explain()
    assert set(out["idle"]) == {"tiny", "tiny-too"} and "tiny" not in out["strategies"]
    assert "tiny_pods" not in out["inputs"]


def test_without_a_list_every_installed_strategy_runs_in_the_documented_order(tmp_path: Path) -> None:
    executor = CgroupExecutor(CgroupLayout(tmp_path, version=1))
    loaded = load_strategies(None, base_init(tmp_path, executor), installed_plus(TINY))
    names = [s.name for s in loaded.enabled]
    # no resctrl mount under the injected root: that strategy says so and stays out
    assert names == ["be-evict", "allocatable-evict", "cpu-evict", "cpu-suppress", "interference", "cpu-burst",
                     "memory-qos", "blkio", "system-config", "tiny"]
    assert loaded.disabled == []


def test_a_listed_but_disabled_strategy_is_built_aside(tmp_path: Path) -> None:
    executor = CgroupExecutor(CgroupLayout(tmp_path, version=1))
    specs = parse_specs(["cpu-suppress", {"name": "tiny", "enabled": False}], KEY)
    loaded = load_strategies(specs, base_init(tmp_path, executor), installed_plus(TINY))
    assert [s.name for s in loaded.enabled] == ["cpu-suppress"] and [s.name for s in loaded.disabled] == ["tiny"]


@pytest.mark.parametrize(("raw", "where", "value"), [
    ("cpu-suppress", KEY, "cpu-suppress"),
    (["cpu-suppress", "cpu-suppress"], f"{KEY}[1]", "cpu-suppress"),
    ([{"name": "tiny", "enabled": "yes"}], f"{KEY}[0].enabled", "yes"),
    ([{"name": "tiny", "priority": 3}], f"{KEY}[0].priority", 3),
    ([7], f"{KEY}[0]", 7),
])
def test_bad_strategy_lists_name_the_entry(raw: object, where: str, value: object) -> None:
    with pytest.raises(HookConfigError) as err:
        parse_specs(raw, KEY)
    assert (err.value.key_path, err.value.value) == (where, value)


def test_an_unknown_strategy_names_the_installed_ones(tmp_path: Path) -> None:
    executor = CgroupExecutor(CgroupLayout(tmp_path, version=1))
    specs = parse_specs(["cpu-suppress", "no-such"], KEY)
    with pytest.raises(HookConfigError) as err:
        load_strategies(specs, base_init(tmp_path, executor))
    assert err.value.key_path == f"{KEY}[1]" and "cpu-suppress" in err.value.message


@pytest.mark.asyncio
async def test_the_rounds_keep_the_be_window_between_them(tmp_path: Path, store: TSDB) -> None:
    """Issue 29: the BE eviction window (300 s) is read whole once, then only what is new."""
    root = tmp_path / "cgroup"
    build_tree(root)
    executor = CgroupExecutor(CgroupLayout(root))
    loaded = load_strategies(parse_specs(["be-evict"], KEY), base_init(root, executor), installed_plus())
    rules = parse_rules({"resourceUsedThresholdWithBE": {"enable": True, "cpuEvictTimeWindowSeconds": 300}})
    now = [NOW]
    manager = QoSManager(reader=store, pods=lambda: [LS, BE], topology=TOPOLOGY, executor=executor,
                         evictor=CriEvictor(_no_runtime), rules=lambda: rules,
                         config=ManagerConfig(reserved_cores=0.5), clock=lambda: now[0], strategies=loaded.enabled)
    for i in range(3):
        store.write([Sample(m, 1.0 + i, ts=now[0] - 0.5) for m in
                     (model.BE_CPU_USAGE, model.BE_CPU_REQUEST, model.BE_CPU_LIMIT)])
        store.flush()
        await manager.run_once()
        assert manager.explain()["inputs"]["be_cpu_window"]["samples"] == i + 1
        now[0] += 1
    (view,) = manager._kept._views.values()
    assert view is not None and (view.full_reads, view.partial_reads) == (1, 2)  # type: ignore[attr-defined]
