"""The suppress flap minute of ``bench_qos_round.py`` (issue 28 item 7), on a fixture tree.

An LS pod bursts to 6 cores for 100 ms every second (1 core otherwise), a BE pod uses
1 core, 8 CPUs, cfsQuota suppression at 65 %. The real fast path ticks every 100 ms on
fixture cpuacct counters; the real 1 s loop plans from the real store, whose samples
are the collectors' 1 s averages. ``flap_minute`` returns the BE tier quota after every
change in the minute (the first write, from unlimited, included).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hooks.cgroups import CgroupLayout
from hooks.executor import CgroupExecutor
from hooks.qos import QoSClass
from hooks.rules import parse_rules
from metrics import model
from metrics.collect.cgroupfs import CgroupReader
from metrics.collect.topology import CPUInfo
from metrics.model import ContainerView, PodView, Sample, labels
from metrics.qos.evict import CriEvictor
from metrics.qos.fastpath import FastPath, FastPathConfig
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.qos.suppress import SuppressConfig
from metrics.qos.task import FAST_PATH_GROWTH_STEP
from metrics.store.tsdb import TSDB

START = 5_000.0
TOPOLOGY = [CPUInfo(cpu=i, core=i % 4, socket=0, numa=0) for i in range(8)]
BE_DIR = "kubepods/besteffort"
RULES = parse_rules({"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressPolicy": "cfsQuota"}})


def _pod(uid: str, qos: QoSClass, kube: str) -> PodView:
    d = f"kubepods/{kube}/pod{uid}"
    return PodView(uid=uid, namespace="ns", name=uid, sandbox_id=uid, qos=qos, priority=0, priority_class="",
                   cgroup_dir=d, kube_qos=kube, containers=(ContainerView(f"c{uid}", "main", f"{d}/c{uid}"),))


LS, BE = _pod("a", QoSClass.LS, "burstable"), _pod("c", QoSClass.BE, "besteffort")


async def _no_runtime(method: str, payload: bytes, timeout: float) -> bytes:
    raise AssertionError("nothing is evicted here")


def _tree(root: Path) -> None:
    for d in ["", "kubepods", BE_DIR, "kubepods/burstable", LS.cgroup_dir, BE.cgroup_dir,
              LS.containers[0].cgroup_dir, BE.containers[0].cgroup_dir]:
        for controller, name, value in (("cpu", "cpu.cfs_quota_us", "-1"), ("cpuset", "cpuset.cpus", "0-7"),
                                        ("cpuacct", "cpuacct.usage", "0")):
            (root / controller / d).mkdir(parents=True, exist_ok=True)
            (root / controller / d / name).write_text(value + "\n")


async def flap_minute(hold: bool, seconds: int = 60) -> list[int]:
    suppress = SuppressConfig(hold_after_drop=2.0, growth_step=FAST_PATH_GROWTH_STEP) if hold else SuppressConfig()
    with tempfile.TemporaryDirectory(prefix="krpb-qosflap-") as tmp:
        root = Path(tmp) / "cgroup"
        _tree(root)
        clock = {"wall": START, "mono": 0.0}
        store = TSDB(Path(tmp) / "m.db", clock=lambda: START)
        try:
            manager = QoSManager(reader=store, pods=lambda: [LS, BE], topology=TOPOLOGY,
                                 executor=CgroupExecutor(CgroupLayout(root)), evictor=CriEvictor(_no_runtime),
                                 rules=lambda: RULES, clock=lambda: clock["wall"],
                                 config=ManagerConfig(reserved_cores=0.5, suppress=suppress))
            fast = FastPath(manager, cgroups=CgroupReader(root), rules=lambda: RULES,
                            config=FastPathConfig(interval=0.1), clock=lambda: clock["mono"],
                            wall=lambda: clock["wall"])
            ns = {"node": 0, "a": 0, "c": 0}
            quota_file = root / "cpu" / BE_DIR / "cpu.cfs_quota_us"
            last, changes, second = quota_file.read_text(), [], []
            for _ in range(seconds):
                for i in range(10):
                    ls = 6.0 if i == 3 else 1.0
                    clock["wall"] += 0.1
                    clock["mono"] += 0.1
                    second.append(ls)
                    for key, cores in (("node", ls + 1.2), ("a", ls), ("c", 1.0)):
                        ns[key] += round(cores * 0.1 * 1e9)
                    acct = root / "cpuacct"
                    (acct / "cpuacct.usage").write_text(f"{ns['node']}\n")
                    (acct / "kubepods" / "cpuacct.usage").write_text(f"{ns['a'] + ns['c']}\n")
                    (acct / BE_DIR / "cpuacct.usage").write_text(f"{ns['c']}\n")
                    for pod in (LS, BE):
                        (acct / pod.cgroup_dir / "cpuacct.usage").write_text(f"{ns[pod.uid]}\n")
                    await fast.tick()
                    if i == 9:
                        avg = sum(second) / len(second)
                        second = []
                        ts = clock["wall"] - 0.5
                        store.write([Sample(model.NODE_CPU_USAGE, avg + 1.2, ts=ts),
                                     Sample(model.POD_CPU_USAGE, avg, labels(pod_uid="a"), ts),
                                     Sample(model.POD_CPU_USAGE, 1.0, labels(pod_uid="c"), ts)])
                        await manager.run_once()
                    now = quota_file.read_text()
                    if now != last:
                        last = now
                        changes.append(int(now))
            return changes
        finally:
            store.close()
