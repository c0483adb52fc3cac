"""blkio (strategy): the BE and LS class tiers' per-device throttles and weights from
blkioQOS every round, through the real manager on fixture v1 / v2 trees and an injected
/sys: a rule change followed with no pod of the class, removal of a dropped device,
a wrong device named, dry-run and explain, systemd names, pods under another parent,
and no throttle files (one line, idle)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from structlog.testing import capture_logs

from hooks.cgroups import CgroupLayout
from hooks.executor import CgroupExecutor
from hooks.qos import QoSClass
from hooks.rules import Rules, parse_rules
from metrics.model import PodView
from metrics.qos.blkio import BlkioTiers, blkio
from metrics.qos.evict import CriEvictor
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.qos.strategy import StrategyInit
from metrics.qos.suppress import SuppressConfig
from metrics.store.tsdb import TSDB
from runtimeproxy.hookapi import HookConfigError, HostRoots

NOW = 5_000.0
V1_FILES = ("blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device",
            "blkio.throttle.read_iops_device", "blkio.throttle.write_iops_device")


async def _no_runtime(method: str, payload: bytes, timeout: float) -> bytes:
    return b""


def blocks(cls: str = "beClass", name: str = "/dev/vdb", **io: int) -> dict[str, Any]:
    return {"resourceQOSStrategy": {cls: {"blkioQOS": {"enable": True, "blocks": [
        {"name": name, "type": "device", "ioCfg": io}]}}}}


def sys_tree(root: Path) -> Path:
    for name, devno in (("vdb", "253:16"), ("loop3", "7:3")):
        (root / "class/block" / name).mkdir(parents=True)
        (root / "class/block" / name / "dev").write_text(devno + "\n")
        (root / "dev/block" / devno).mkdir(parents=True)
    return root


class Env:
    def __init__(self, tmp: Path, *, version: int = 1, weight: str | None = None, dry_run: bool = False,
                 driver: str = "cgroupfs", dirs: tuple[str, ...] | None = None, files: bool = True,
                 besteffort: str = "kubepods/besteffort") -> None:
        self.root = tmp / "cgroup"
        self.base = self.root / "blkio" if version == 1 else self.root
        if version == 2:
            self.root.mkdir(parents=True)
            (self.root / "cgroup.controllers").write_text("cpu io memory\n")
        else:
            (self.root / "cpu").mkdir(parents=True)
        default = (("kubepods.slice", "kubepods.slice/kubepods-burstable.slice",
                    "kubepods.slice/kubepods-besteffort.slice") if driver == "systemd"
                   else ("kubepods", "kubepods/burstable", "kubepods/besteffort"))
        for rel in dirs if dirs is not None else default:
            d = self.base / rel
            d.mkdir(parents=True, exist_ok=True)
            for name in (V1_FILES if version == 1 else ("io.max",)) if files else ():
                (d / name).write_text("")
            if weight:
                (d / weight).write_text("default 100\n" if version == 2 else "")
        self.rules: Rules = parse_rules({})
        self.pods: list[PodView] = []
        self.store = TSDB(tmp / "m.db", clock=lambda: NOW)
        executor = CgroupExecutor(CgroupLayout(self.root, version=version, driver=driver))  # type: ignore[arg-type]
        config = ManagerConfig(dry_run=dry_run, suppress=SuppressConfig(besteffort_dir=PurePosixPath(besteffort)))
        init = StrategyInit(name="blkio", args={}, key_path="strategies[0]", config=config, topology=[],
                            executor=executor, host=HostRoots(cgroup=self.root, sys=sys_tree(tmp / "sys")))
        self.strategy = blkio(init)
        self.manager = QoSManager(reader=self.store, pods=lambda: self.pods, topology=[], executor=executor,
                                  evictor=CriEvictor(_no_runtime), rules=lambda: self.rules, config=config,
                                  clock=lambda: NOW, strategies=[self.strategy])

    def read(self, rel: str, name: str) -> str:
        return (self.base / rel / name).read_text().strip()

    def snapshot(self) -> dict[Path, str]:
        return {p: p.read_text() for p in self.root.rglob("*") if p.is_file()}

    def explain(self) -> Any:
        return self.manager.explain()["strategies"].get("blkio")


@pytest.fixture
def envs(tmp_path: Path, closing: Callable[[Env], Env]) -> Callable[..., Env]:
    return lambda **kw: closing(Env(tmp_path, **kw))


@pytest.mark.asyncio
async def test_v1_be_tier_gets_the_throttles_with_no_pod_at_all(envs: Any) -> None:
    env = envs(weight="blkio.bfq.weight_device")
    env.rules = parse_rules(blocks(readBPS=1048576, writeIOPS=300, ioWeightPercent=50))
    await env.manager.run_once()
    assert env.read("kubepods/besteffort", "blkio.throttle.read_bps_device") == "253:16 1048576"
    assert env.read("kubepods/besteffort", "blkio.throttle.write_iops_device") == "253:16 300"
    assert env.read("kubepods/besteffort", "blkio.bfq.weight_device") == "253:16 50"
    assert env.read("kubepods/burstable", "blkio.throttle.read_bps_device") == ""  # LS has no blocks
    assert env.read("kubepods", "blkio.throttle.read_bps_device") == ""  # the root every pod shares: free
    entry = env.explain()
    reasons = " ".join(a["reason"] for a in entry["plan"]["actions"])
    assert "BE class resourceQOSStrategy.beClass.blkioQOS.blocks[0] /dev/vdb (253:16): readBPS 1048576" in reasons
    assert entry["plan"]["inputs"]["tiers"]["kubepods/besteffort"] == {"class": "BE", "devices": ["253:16"],
                                                                      "removed": []}
    assert {a["target"].split(":", 1)[1]: a["result"] for a in entry["applied"] if a["result"] == "written"} == {
        "blkio.throttle.read_bps_device[253:16]": "written", "blkio.throttle.write_iops_device[253:16]": "written",
        "blkio.bfq.weight_device[253:16]": "written"}  # the 0s (no limit) were already so: unchanged
    await env.manager.run_once()
    assert {a["result"] for a in env.explain()["applied"]} == {"unchanged"}  # idempotent


@pytest.mark.asyncio
async def test_v2_ls_tier_io_max_and_a_rule_change_followed_in_a_round(envs: Any) -> None:
    env = envs(version=2, weight="io.weight")
    env.rules = parse_rules(blocks("lsClass", readIOPS=500, ioWeightPercent=80))
    await env.manager.run_once()
    assert env.read("kubepods/burstable", "io.max") == "253:16 rbps=max wbps=max riops=500 wiops=max"
    assert env.read("kubepods/burstable", "io.weight") == "253:16 80"
    assert env.read("kubepods/besteffort", "io.max") == ""
    env.rules = parse_rules(blocks("lsClass", readIOPS=700))
    await env.manager.run_once()
    assert env.read("kubepods/burstable", "io.max") == "253:16 rbps=max wbps=max riops=700 wiops=max"


@pytest.mark.asyncio
async def test_a_dropped_device_gets_its_limits_removed(envs: Any) -> None:
    env = envs()
    env.rules = parse_rules(blocks(readBPS=1048576))
    await env.manager.run_once()
    assert env.read("kubepods/besteffort", "blkio.throttle.read_bps_device") == "253:16 1048576"
    env.rules = parse_rules(blocks(name="/dev/loop3", writeBPS=4096))  # vdb no longer named
    await env.manager.run_once()
    assert env.read("kubepods/besteffort", "blkio.throttle.read_bps_device") == "253:16 0"
    assert env.read("kubepods/besteffort", "blkio.throttle.write_bps_device") == "7:3 4096"
    assert env.explain()["plan"]["inputs"]["tiers"]["kubepods/besteffort"]["removed"] == ["253:16"]
    env.rules = parse_rules({"resourceQOSStrategy": {"beClass": {"blkioQOS": {"enable": False}}}})
    await env.manager.run_once()
    assert env.read("kubepods/besteffort", "blkio.throttle.write_bps_device") == "7:3 0"
    assert isinstance(env.strategy, BlkioTiers) and env.strategy.applied == {}
    await env.manager.run_once()
    assert env.explain()["plan"]["reason"] == "blkioQOS not enabled for any class"


@pytest.mark.asyncio
async def test_an_unknown_device_is_named_once_and_nothing_written_for_its_tier(envs: Any) -> None:
    env = envs()
    env.rules = parse_rules({"resourceQOSStrategy": {
        "beClass": blocks(name="/dev/sdq", readBPS=1)["resourceQOSStrategy"]["beClass"],
        "lsClass": blocks(readBPS=2)["resourceQOSStrategy"]["beClass"]}})
    with capture_logs() as logs:
        await env.manager.run_once()
        await env.manager.run_once()
    refused = [e for e in logs if e["event"] == "blkio_block_refused"]
    assert len(refused) == 1 and refused[0]["block"] == "resourceQOSStrategy.beClass.blkioQOS.blocks[0].name"
    assert refused[0]["value"] == "/dev/sdq"
    assert "beClass.blkioQOS.blocks[0].name='/dev/sdq': no block device" in env.explain()["plan"]["reason"]
    assert env.read("kubepods/besteffort", "blkio.throttle.read_bps_device") == ""
    assert env.read("kubepods/burstable", "blkio.throttle.read_bps_device") == "253:16 2"  # the other class goes on


@pytest.mark.asyncio
async def test_dry_run_writes_nothing_and_explains(envs: Any) -> None:
    env = envs(dry_run=True)
    env.rules = parse_rules(blocks(readBPS=1048576))
    before = env.snapshot()
    await env.manager.run_once()
    assert env.snapshot() == before
    applied = env.explain()["applied"]
    assert [(a["target"], a["value"], a["result"]) for a in applied if a["value"]] == [
        ("kubepods/besteffort:blkio.throttle.read_bps_device[253:16]", 1048576, "dry-run")]


@pytest.mark.asyncio
async def test_systemd_tiers_and_pods_under_another_parent(envs: Any) -> None:
    env = envs(version=2, driver="systemd", dirs=(
        "kubepods.slice", "kubepods.slice/kubepods-besteffort.slice", "run1.slice/kubepods.slice",
        "run1.slice/kubepods.slice/kubepods-besteffort.slice"))
    env.pods = [PodView(uid="u", namespace="ns", name="p", sandbox_id="sb", qos=QoSClass.BE, priority=0,
                        priority_class="",
                        cgroup_dir="run1.slice/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podu.slice",
                        kube_qos="besteffort")]
    env.rules = parse_rules(blocks(writeBPS=2048))
    await env.manager.run_once()
    want = "253:16 rbps=max wbps=2048 riops=max wiops=max"
    assert env.read("kubepods.slice/kubepods-besteffort.slice", "io.max") == want
    assert env.read("run1.slice/kubepods.slice/kubepods-besteffort.slice", "io.max") == want


@pytest.mark.asyncio
async def test_no_throttle_files_is_one_line_and_idle(envs: Any) -> None:
    with capture_logs() as logs:
        env = envs(version=2, files=False)
        env.rules = parse_rules(blocks(readBPS=1))
        before = env.snapshot()
        await env.manager.run_once()
        await env.manager.run_once()
    assert [e["event"] for e in logs if e["event"].startswith("blkio")] == ["blkio_tiers_unsupported"]
    assert env.snapshot() == before and env.explain() is None


def test_args_are_refused_naming_the_key(tmp_path: Path) -> None:
    (tmp_path / "cgroup").mkdir()
    init = StrategyInit(name="blkio", args={"x": 1}, key_path="tasks.qos-manager.strategies[3].args",
                        config=ManagerConfig(), topology=[],
                        executor=CgroupExecutor(CgroupLayout(tmp_path / "cgroup", version=2)))
    with pytest.raises(HookConfigError) as exc:
        blkio(init)
    assert exc.value.key_path == "tasks.qos-manager.strategies[3].args"


@pytest.mark.asyncio
async def test_tiers_come_from_the_configured_root_never_kubepods_at_the_hierarchy_root(envs: Any) -> None:
    """Issue 28 item 9: kubelet's cgroupRoot is /custom; a /kubepods tree at the hierarchy
    root is another tenant's (a decoy here): neither probed for support nor written."""
    env = envs(dirs=("kubepods", "kubepods/besteffort", "kubepods/burstable", "custom/kubepods",
                     "custom/kubepods/besteffort", "custom/kubepods/burstable"),
               besteffort="custom/kubepods/besteffort")
    env.rules = parse_rules(blocks(readBPS=4096))
    decoy = {p: p.read_text() for p in (env.base / "kubepods").rglob("*") if p.is_file()}
    await env.manager.run_once()
    assert env.read("custom/kubepods/besteffort", "blkio.throttle.read_bps_device") == "253:16 4096"
    assert {p: p.read_text() for p in (env.base / "kubepods").rglob("*") if p.is_file()} == decoy
    assert set(env.explain()["plan"]["inputs"]["tiers"]) == {"custom/kubepods/besteffort", "custom/kubepods/burstable"}


@pytest.mark.asyncio
async def test_while_off_a_round_reads_no_tier_and_turning_it_on_writes_in_the_next(
        envs: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: a disabled strategy costs nothing (after the one-time support probe)."""
    from metrics.qos.blkio import BlkioTiers

    probed: list[object] = []
    exists = BlkioTiers._exists
    monkeypatch.setattr(BlkioTiers, "_exists", staticmethod(lambda *a: probed.append(a[1]) or exists(*a)))
    env = envs(version=2, weight="io.weight")
    await env.manager.run_once()  # detects support
    probed.clear()
    await env.manager.run_once()
    assert probed == []
    env.rules = parse_rules(blocks("lsClass", readIOPS=500))
    await env.manager.run_once()
    assert env.read("kubepods/burstable", "io.max") == "253:16 rbps=max wbps=max riops=500 wiops=max"
    assert probed
