"""memory-qos (strategy): the kube-QoS tiers' memory.min/low = Σ of their pods', from every
pod of the pod list each round, on fixture v2 trees through the real manager (hand-worked
sums), a tier emptied back to 0, nothing before memory QoS is enabled, dry-run and explain,
and the v1 "off" path (one log line, nothing written)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from structlog.testing import capture_logs

from hooks.cgroups import CgroupLayout
from hooks.executor import CgroupExecutor
from hooks.memoryqos import MemoryQoS
from hooks.qos import QoSClass
from hooks.rules import Rules, parse_rules
from metrics.model import PodView
from metrics.qos.evict import CriEvictor
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.qos.memoryqos import MemoryQoSTiers, memory_qos
from metrics.qos.strategy import StrategyInit
from metrics.qos.suppress import SuppressConfig
from metrics.store.tsdb import TSDB
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerInfo,
    ContainerMeta,
    HookConfigError,
    HookInit,
    HostRoots,
    PodInfo,
    PodMeta,
    Resources,
    Stage,
    frozen_map,
)

NOW = 5_000.0
MiB = 1 << 20
GiB = 1 << 30
LS_ON = {"resourceQOSStrategy": {"lsClass": {"memoryQOS": {"enable": True, "minLimitPercent": 50}}}}
FILES = ("memory.min", "memory.low", "memory.high")


async def _no_runtime(method: str, payload: bytes, timeout: float) -> bytes:
    return b""


def pod(uid: str, cgroup: str, kube: str, annotations: dict[str, str] | None = None) -> PodView:
    return PodView(uid=uid, namespace="ns", name=f"p-{uid}", sandbox_id=f"sb-{uid}", qos=QoSClass.LS, priority=0,
                   priority_class="", cgroup_dir=cgroup, kube_qos=kube, annotations=annotations or {})


class Env:
    def __init__(self, tmp: Path, *, version: int = 2, files: tuple[str, ...] = FILES, dry_run: bool = False,
                 driver: str = "cgroupfs", besteffort: str = "kubepods/besteffort") -> None:
        self.root = tmp / "cgroup"
        self.base = self.root if version == 2 else self.root / "memory"
        self.files = files
        if version == 2:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / "cgroup.controllers").write_text("cpu memory io\n")
        else:
            (self.root / "cpu").mkdir(parents=True, exist_ok=True)
        tiers = (("kubepods.slice", "kubepods.slice/kubepods-burstable.slice",
                  "kubepods.slice/kubepods-besteffort.slice") if driver == "systemd"
                 else ("kubepods", "kubepods/burstable", "kubepods/besteffort"))
        for rel in tiers:
            self.mkdir(rel)
        self.rules: Rules = parse_rules(LS_ON)
        self.pods: list[PodView] = []
        self.store = TSDB(tmp / "m.db", clock=lambda: NOW)
        executor = CgroupExecutor(CgroupLayout(self.root, version=version, driver=driver))  # type: ignore[arg-type]
        config = ManagerConfig(dry_run=dry_run, suppress=SuppressConfig(besteffort_dir=PurePosixPath(besteffort)))
        init = StrategyInit(name="memory-qos", args={}, key_path="strategies[0]", config=config, topology=[],
                            executor=executor, host=HostRoots(cgroup=self.root))
        self.strategy = memory_qos(init)
        self.manager = QoSManager(reader=self.store, pods=lambda: self.pods, topology=[], executor=executor,
                                  evictor=CriEvictor(_no_runtime), rules=lambda: self.rules, config=config,
                                  clock=lambda: NOW, strategies=[self.strategy])

    def mkdir(self, rel: str, min_: int = 0, low: int = 0) -> None:
        d = self.base / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.max").write_text("max\n")
        for name in self.files:
            (d / name).write_text({"memory.min": f"{min_}\n", "memory.low": f"{low}\n"}.get(name, "max\n"))

    def get(self, rel: str, name: str) -> int:
        return int((self.base / rel / name).read_text())

    def tier(self, rel: str) -> tuple[int, int]:
        return self.get(rel, "memory.min"), self.get(rel, "memory.low")

    def snapshot(self) -> dict[Path, str]:
        return {p: p.read_text() for p in self.root.rglob("*") if p.is_file()}


@pytest.fixture
def envs(tmp_path: Path, closing: Callable[[Env], Env]) -> Callable[..., Env]:
    return lambda **kw: closing(Env(tmp_path, **kw))


def four_pods(env: Env) -> None:
    """Pods as the hook left them (memory.min, memory.low of each pod cgroup)."""
    env.mkdir("kubepods/burstable/poda", 512 * MiB, 800 * MiB)
    env.mkdir("kubepods/burstable/podb", 1 * GiB, 1 * GiB)
    env.mkdir("kubepods/besteffort/podc", 256 * MiB, 256 * MiB)
    env.mkdir("kubepods/podd", 1 * GiB, 2 * GiB)  # Guaranteed: directly in the root
    env.pods = [pod("a", "kubepods/burstable/poda", "burstable"), pod("b", "kubepods/burstable/podb", "burstable"),
                pod("c", "kubepods/besteffort/podc", "besteffort"), pod("d", "kubepods/podd", "guaranteed")]


@pytest.mark.asyncio
async def test_tier_sums_from_every_pod_worked_by_hand(envs: Any) -> None:
    env = envs()
    four_pods(env)
    env.mkdir("kubepods/burstable/podx", 4 * GiB, 4 * GiB)  # not a pod the node knows: not counted
    await env.manager.run_once()
    # burstable: min 512 MiB + 1 GiB = 536870912 + 1073741824 = 1610612736
    #            low 800 MiB + 1 GiB = 838860800 + 1073741824 = 1912602624
    assert env.tier("kubepods/burstable") == (1_610_612_736, 1_912_602_624)
    assert env.tier("kubepods/besteffort") == (268_435_456, 268_435_456)  # 256 MiB
    # kubepods: min 1610612736 + 268435456 + 1073741824 (Guaranteed) = 2952790016
    #           low 1912602624 + 268435456 + 2147483648 (Guaranteed) = 4328521728
    assert env.tier("kubepods") == (2_952_790_016, 4_328_521_728)
    entry = env.manager.explain()["strategies"]["memory_qos"]
    tiers = entry["plan"]["inputs"]["tiers"]
    assert tiers["kubepods/burstable"] == {"pods": 2, "min": 1_610_612_736, "low": 1_912_602_624, "current": [0, 0]}
    assert tiers["kubepods"]["pods"] == 4 and "lsClass" not in entry["plan"]["inputs"]["why"]
    assert "enabled for LS" in entry["plan"]["inputs"]["why"]
    assert {a["result"] for a in entry["applied"]} == {"written"}
    levels = entry["plan"]["actions"][0]["levels"]
    assert [sorted({i["target"].split(":")[0] for i in lv}) for lv in levels] == [
        ["kubepods"], ["kubepods/besteffort", "kubepods/burstable"]]  # the root first, then the tiers


@pytest.mark.asyncio
async def test_pods_leaving_lower_the_sums_and_an_empty_tier_goes_to_zero(envs: Any) -> None:
    env = envs()
    four_pods(env)
    await env.manager.run_once()
    env.pods = [p for p in env.pods if p.uid != "b"]  # b deleted
    await env.manager.run_once()
    assert env.tier("kubepods/burstable") == (512 * MiB, 800 * MiB)
    (env.base / "kubepods/besteffort/podc/memory.min").unlink()  # c's cgroup torn down (listed still): skipped
    await env.manager.run_once()
    assert env.tier("kubepods/besteffort") == (0, 0)
    assert env.manager.explain()["strategies"]["memory_qos"]["plan"]["inputs"]["skipped"] == ["ns/p-c"]
    env.pods = [p for p in env.pods if p.uid == "d"]
    await env.manager.run_once()
    assert env.tier("kubepods/burstable") == (0, 0)
    assert env.tier("kubepods") == (1 * GiB, 2 * GiB)


@pytest.mark.asyncio
async def test_nothing_until_a_rule_or_an_annotation_enables_it(envs: Any) -> None:
    env = envs()
    four_pods(env)
    env.rules = parse_rules({})
    before = env.snapshot()
    await env.manager.run_once()
    assert env.snapshot() == before
    assert "not enabled" in env.manager.explain()["strategies"]["memory_qos"]["plan"]["reason"]
    assert env.manager.explain()["inputs"]["memory_qos_tiers"]["pods"] == 0  # off: no pod file was read
    env.pods[0] = pod("a", "kubepods/burstable/poda", "burstable", {"koordinator.sh/memoryQOS": '{"policy":"none"}'})
    await env.manager.run_once()
    assert env.snapshot() == before  # policy none opts out, it does not turn anything on
    env.pods[0] = pod("a", "kubepods/burstable/poda", "burstable", {"koordinator.sh/memoryQOS": '{"policy":"auto"}'})
    await env.manager.run_once()
    assert env.tier("kubepods/burstable") == (1_610_612_736, 1_912_602_624)


@pytest.mark.asyncio
async def test_once_enabled_the_sums_keep_following_the_pods(envs: Any) -> None:
    env = envs()
    four_pods(env)
    await env.manager.run_once()
    env.rules = parse_rules({})  # memory QoS turned off: the hook resets the pods to 0
    for rel in ("kubepods/burstable/poda", "kubepods/burstable/podb", "kubepods/besteffort/podc", "kubepods/podd"):
        env.mkdir(rel)
    await env.manager.run_once()
    assert env.tier("kubepods") == (0, 0) and env.tier("kubepods/burstable") == (0, 0)


@pytest.mark.asyncio
async def test_dry_run_writes_nothing_and_explains_the_plan(envs: Any) -> None:
    env = envs(dry_run=True)
    four_pods(env)
    before = env.snapshot()
    await env.manager.run_once()
    assert env.snapshot() == before
    applied = env.manager.explain()["strategies"]["memory_qos"]["applied"]
    assert [a["result"] for a in applied] == ["dry-run"]
    items = {i["target"]: i["value"] for a in applied for lv in a["levels"] for i in lv}
    assert items["kubepods/burstable:memory.min"] == 1_610_612_736


@pytest.mark.asyncio
async def test_v1_without_memory_min_is_off_with_one_line(envs: Any) -> None:
    with capture_logs() as logs:
        env = envs(version=1, files=())
        four_pods(env)
        before = env.snapshot()
        await env.manager.run_once()
        await env.manager.run_once()
    assert [e["event"] for e in logs if e["event"].startswith("memory_qos")] == ["memory_qos_tiers_unsupported"]
    assert "cgroup v1 without memory.min" in next(e for e in logs if e["event"].startswith("memory_qos"))["detail"]
    assert env.snapshot() == before
    assert isinstance(env.strategy, MemoryQoSTiers) and env.strategy.supported is False
    assert env.manager.explain()["strategies"].get("memory_qos") is None  # idle: nothing planned


@pytest.mark.asyncio
async def test_systemd_layout(envs: Any) -> None:
    env = envs(driver="systemd")
    slice_ = "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-poda.slice"
    env.mkdir(slice_, 512 * MiB, 800 * MiB)
    env.pods = [pod("a", slice_, "burstable")]
    await env.manager.run_once()
    assert env.tier("kubepods.slice/kubepods-burstable.slice") == (512 * MiB, 800 * MiB)
    assert env.tier("kubepods.slice") == (512 * MiB, 800 * MiB)
    assert env.tier("kubepods.slice/kubepods-besteffort.slice") == (0, 0)


def test_args_are_refused_naming_the_key(tmp_path: Path) -> None:
    (tmp_path / "cgroup").mkdir()
    executor = CgroupExecutor(CgroupLayout(tmp_path / "cgroup", version=2))
    init = StrategyInit(name="memory-qos", args={"x": 1}, key_path="tasks.qos-manager.strategies[7].args",
                        config=ManagerConfig(), topology=[], executor=executor)
    with pytest.raises(HookConfigError) as exc:
        memory_qos(init)
    assert exc.value.key_path == "tasks.qos-manager.strategies[7].args"


@pytest.mark.asyncio
async def test_pods_under_another_parent_are_detected_and_summed_there(envs: Any, tmp_path: Path) -> None:
    env = envs()
    shutil.rmtree(env.base / "kubepods")  # no kubepods at the hierarchy root: only the run's own
    env.strategy.supported = None
    env.mkdir("run1/kubepods")
    env.mkdir("run1/kubepods/burstable")
    env.mkdir("run1/kubepods/burstable/poda", 512 * MiB, 800 * MiB)
    env.pods = [pod("a", "run1/kubepods/burstable/poda", "burstable")]
    await env.manager.run_once()
    assert env.tier("run1/kubepods/burstable") == (512 * MiB, 800 * MiB)
    assert env.tier("run1/kubepods") == (512 * MiB, 800 * MiB)


@pytest.mark.asyncio
async def test_hook_then_strategy_give_koordlets_tier_sums_from_the_requests(envs: Any, tmp_path: Path) -> None:
    """The split (hook: pods and containers; strategy: tiers) ends where koordlet's
    CgroupReconcile does: tier = sum of request x minLimitPercent / 100 over its pods."""
    env = envs()
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal:  16384000 kB\n")
    hook = MemoryQoS(HookInit("memory-qos", {}, "hooks[0].args", HostRoots(cgroup=env.root, proc=tmp_path / "proc"),
                              LS_ON))
    for uid, request in (("a", 1 * GiB), ("b", 3 * GiB)):
        env.mkdir(f"kubepods/burstable/pod{uid}")
        env.mkdir(f"kubepods/burstable/pod{uid}/c{uid}")
        info = PodInfo(PodMeta(f"p-{uid}", "ns", uid), id="sb", cgroup_parent=f"/kubepods/burstable/pod{uid}",
                       annotations=frozen_map({}))
        res = Resources(memory_limit_in_bytes=4 * GiB, unified=frozen_map({"memory.min": str(request)}))
        hook.reconcile_container(ContainerContext(Stage.RECONCILE_CONTAINER, info,
                                                  ContainerInfo(ContainerMeta("app"), id=f"c{uid}", resources=res)))
        env.pods.append(pod(uid, f"kubepods/burstable/pod{uid}", "burstable"))
    assert env.tier("kubepods/burstable") == (0, 0)  # the hook leaves the tiers
    await env.manager.run_once()
    # (1 GiB + 3 GiB) x minLimitPercent 50 / 100 = 2 GiB; lowLimitPercent 0 => low = min
    assert env.tier("kubepods/burstable") == (2 * GiB, 2 * GiB)
    assert env.tier("kubepods") == (2 * GiB, 2 * GiB)


@pytest.mark.asyncio
async def test_tiers_come_from_the_configured_root_never_kubepods_at_the_hierarchy_root(envs: Any) -> None:
    """Issue 28 item 9: kubelet's cgroupRoot is /custom; the /kubepods tree at the hierarchy
    root (made by Env) is another tenant's, with its own memory.min/low: left alone."""
    env = envs(besteffort="custom/kubepods/besteffort")
    for rel in ("kubepods", "kubepods/burstable", "kubepods/besteffort"):
        env.mkdir(rel, 3 * GiB, 3 * GiB)  # the other tenant's protection
    for rel in ("custom/kubepods", "custom/kubepods/burstable", "custom/kubepods/besteffort"):
        env.mkdir(rel)
    env.mkdir("custom/kubepods/burstable/poda", 512 * MiB, 800 * MiB)
    env.pods = [pod("a", "custom/kubepods/burstable/poda", "burstable")]
    decoy = {p: p.read_text() for p in (env.base / "kubepods").rglob("*") if p.is_file()}
    await env.manager.run_once()
    assert env.tier("custom/kubepods/burstable") == (512 * MiB, 800 * MiB)
    assert env.tier("custom/kubepods") == (512 * MiB, 800 * MiB)
    assert {p: p.read_text() for p in (env.base / "kubepods").rglob("*") if p.is_file()} == decoy
