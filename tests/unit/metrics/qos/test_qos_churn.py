"""Issue 28 item 10: nothing the QoS manager keeps per pod outlives the pod.

60 rounds on a fixture cgroup v1 tree, through the real manager, fast path and store,
with every round replacing a quarter of the pods (new uids, new cgroups; the old ones
removed): some pods carry bad annotations (warned once), some BE pods carry a quota of
their own above the tier (clamped), burst keeps buckets per container. After the churn,
everything keyed by pod, container or cgroup holds only what the live pods need: the
node's age and churn do not grow it.
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from hooks.annotations import RESOURCE_STATUS
from hooks.cgroups import CgroupLayout
from hooks.executor import CgroupExecutor
from hooks.qos import QoSClass
from hooks.rules import parse_rules
from metrics import model
from metrics.collect.cgroupfs import CgroupReader
from metrics.collect.topology import CPUInfo
from metrics.model import ContainerView, PodView, Sample, labels
from metrics.qos import builtin
from metrics.qos.burst import ANNOTATION as BURST_ANNOTATION
from metrics.qos.evict import CriEvictor
from metrics.qos.fastpath import FastPath, FastPathConfig
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.qos.strategy import StrategyInit, load_strategies, parse_specs
from metrics.store.tsdb import TSDB

NOW = 5_000.0
TOPOLOGY = [CPUInfo(cpu=i, core=i % 4, socket=0, numa=0) for i in range(8)]
RULES = parse_rules({"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressPolicy": "cfsQuota",
                                                     "cpuSuppressThresholdPercent": 40},
                     "cpuBurstStrategy": {"policy": "auto"}})
LIVE = 12
ROUNDS = 60


async def _no_runtime(method: str, payload: bytes, timeout: float) -> bytes:
    return b""


class Tree:
    def __init__(self, root: Path) -> None:
        self.root = root
        for d in ("", "kubepods", "kubepods/besteffort", "kubepods/burstable"):
            self._dir(d, quota=-1)

    def _dir(self, d: str, quota: int) -> None:
        for controller, files in (("cpu", {"cpu.cfs_quota_us": str(quota), "cpu.cfs_period_us": "100000",
                                            "cpu.cfs_burst_us": "0"}),
                                  ("cpuset", {"cpuset.cpus": "0-7"}), ("cpuacct", {"cpuacct.usage": "0"})):
            (self.root / controller / d).mkdir(parents=True, exist_ok=True)
            for name, value in files.items():
                (self.root / controller / d / name).write_text(value + "\n")

    def pod(self, n: int) -> PodView:
        be = n % 2 == 1
        kube = "besteffort" if be else "burstable"
        d = f"kubepods/{kube}/pod{n}"
        annotations = {}
        if n % 5 == 0:
            annotations[BURST_ANNOTATION] = "{not json"
        if n % 7 == 0:
            annotations[RESOURCE_STATUS] = "{bad"
        qos = QoSClass.BE if be else QoSClass.LSE if n % 7 == 0 else QoSClass.LS
        ctr = ContainerView(f"c{n}", "main", f"{d}/c{n}", cpu_quota=200_000, cpu_period=100_000)
        for cg in (d, ctr.cgroup_dir):
            self._dir(cg, quota=300_000 if be else 200_000)
        return PodView(uid=f"u{n}", namespace="ns", name=f"p{n}", sandbox_id=f"s{n}", qos=qos, priority=0,
                       priority_class="", cgroup_dir=d, kube_qos=kube, annotations=annotations, containers=(ctr,))

    def remove(self, pod: PodView) -> None:
        for controller in ("cpu", "cpuset", "cpuacct"):
            shutil.rmtree(self.root / controller / pod.cgroup_dir)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TSDB]:
    db = TSDB(tmp_path / "m.db", clock=lambda: NOW)
    yield db
    db.close()


@pytest.mark.asyncio
async def test_pod_churn_leaves_no_state_behind(tmp_path: Path, store: TSDB) -> None:
    tree = Tree(tmp_path / "cgroup")
    numbers = itertools.count()
    pods = [tree.pod(next(numbers)) for _ in range(LIVE)]
    executor = CgroupExecutor(CgroupLayout(tree.root))
    config = ManagerConfig(reserved_cores=0.5)
    init = StrategyInit(name="", args={}, key_path="strategies", config=config, topology=TOPOLOGY,
                        executor=executor, writer=store)
    loaded = load_strategies(parse_specs(["cpu-suppress", "cpu-burst", "be-evict"], "strategies"), init)
    manager = QoSManager(reader=store, pods=lambda: list(pods), topology=TOPOLOGY, executor=executor,
                         evictor=CriEvictor(_no_runtime), rules=lambda: RULES, config=config, clock=lambda: NOW,
                         strategies=loaded.enabled)
    clock = [0.0]
    fast = FastPath(manager, cgroups=CgroupReader(tree.root), rules=lambda: RULES,
                    config=FastPathConfig(interval=0.1), clock=lambda: clock[0], wall=lambda: NOW)
    for round_ in range(ROUNDS):
        for i in range(0, LIVE, 4):  # a quarter of the pods go, as many new ones come
            slot = (round_ + i) % LIVE
            tree.remove(pods[slot])
            pods[slot] = tree.pod(next(numbers))
        # Heavy LS use: the tier quota moves (children read and clamped), BE is suppressed.
        load = 0.2 + (round_ % 3) * 0.6
        store.write([Sample(model.NODE_CPU_USAGE, LIVE * load, ts=NOW - 0.5)]
                    + [Sample(model.POD_CPU_USAGE, load, labels(pod_uid=p.uid), NOW - 0.5) for p in pods]
                    + [Sample(model.CONTAINER_CPU_USAGE, load, labels(pod_uid=p.uid, container_id=c.id), NOW - 0.5)
                       for p in pods for c in p.containers])
        await manager.run_once()
        for _ in range(2):
            clock[0] += 0.1
            await fast.tick()

    live = {p.uid for p in pods}
    containers = {c.id for p in pods for c in p.containers}
    cgroups = {d for p in pods for d in (p.cgroup_dir, *(c.cgroup_dir for c in p.containers))}
    suppress, burst = manager.suppress, loaded.enabled[1]
    assert suppress is not None and isinstance(burst, builtin.CPUBurst)
    # what a strategy warned about once, clamped, or keeps per container
    assert suppress._warned <= live, suppress._warned - live
    assert {c.pod_uid for c in suppress._clamps._originals.values()} <= live | {""}
    assert burst.inner._warned <= live, burst.inner._warned - live
    assert set(burst.inner._buckets) | burst.inner._raised | burst.inner._bursted <= containers
    assert {cg for cg, _ in burst.paths._paths} <= cgroups
    # the manager's own: writes found in place, failing writes, explain
    assert {v[2] for v in manager._verified._at.values()} <= live | {""}
    assert len(manager._verified) <= 3 * len(cgroups) + 3
    assert len(manager._failing) <= len(cgroups) + 3
    assert len(manager._explain) <= 5
    assert fast._warned <= live | {"root", "tier:kubepods", "tier:besteffort"}
