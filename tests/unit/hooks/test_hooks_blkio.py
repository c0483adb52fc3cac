"""blkio: blkioQOS rules parsed strictly, device names resolved through an injected /sys,
v1 throttle files and v2 io.max / io.weight on fixture trees for LSR / LSE pods (the class
tiers are the strategy blkio's: tests/unit/metrics/qos/test_qos_blkio.py),
removal of limits a rule drops, dry-run, and bad input named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from hooks.blkio import Blkio
from hooks.blkiodev import DeviceError, io_max, resolve_device
from hooks.blkiorules import BlkioQOS, parse_blkio_qos
from hooks.dryrun import DRY_RUN_SUFFIX
from hooks.qos import QoSClass
from hooks.rules import parse_rules, rules_from_nodeslo
from runtimeproxy.hookapi import (
    HookConfigError,
    HookError,
    HookInit,
    HostRoots,
    LivePods,
    PodContext,
    PodInfo,
    PodMeta,
    Stage,
    frozen_map,
)

UID = "0b1c2d3e-4f50-4617-8829-3a4b5c6d7e8f"
BE_PARENT = f"/kubepods/besteffort/pod{UID}"
LS_PARENT = f"/kubepods/burstable/pod{UID}"
LSR_PARENT = f"/kubepods/pod{UID}"
V1_FILES = ("blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device",
            "blkio.throttle.read_iops_device", "blkio.throttle.write_iops_device")


def blocks(cls: str = "beClass", **io: int) -> dict[str, Any]:
    return {"resourceQOSStrategy": {cls: {"blkioQOS": {"enable": True, "blocks": [
        {"name": "/dev/vdb", "type": "device", "ioCfg": io}]}}}}


def sys_tree(root: Path) -> Path:
    for name, devno in (("vdb", "253:16"), ("loop3", "7:3"), ("dm-0", "254:0")):
        (root / "class/block" / name).mkdir(parents=True)
        (root / "class/block" / name / "dev").write_text(devno + "\n")
        (root / "dev/block" / devno).mkdir(parents=True)
    (root / "class/block/dm-0/dm").mkdir()
    (root / "class/block/dm-0/dm/name").write_text("vg0-data\n")
    return root


def cgroup_tree(root: Path, version: int, weight: str | None = None) -> None:
    base = root / "blkio" if version == 1 else root
    if version == 2:
        root.mkdir(parents=True)
        (root / "cgroup.controllers").write_text("cpu io memory\n")
    else:
        (root / "cpu").mkdir(parents=True)
    for rel in ("kubepods", "kubepods/burstable", "kubepods/besteffort", BE_PARENT, LS_PARENT, LSR_PARENT):
        d = base / rel.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        for name in (V1_FILES if version == 1 else ("io.max",)):
            (d / name).write_text("")
        if weight:
            (d / weight).write_text("default 100\n" if version == 2 else "")


def make(tmp_path: Path, rules: dict[str, Any], **args: Any) -> Blkio:
    host = HostRoots(cgroup=tmp_path / "cgroup", sys=sys_tree(tmp_path / "sys"))
    return Blkio(HookInit("blkio", args, "hooks[6].args", host, rules))


def pctx(parent: str, qos: str | None = None, stage: Stage = Stage.PRE_RUN_POD_SANDBOX) -> PodContext:
    labels = {"koordinator.sh/qosClass": qos} if qos else {}
    return PodContext(stage, PodInfo(PodMeta("db", "prod", UID), cgroup_parent=parent, labels=frozen_map(labels)))


def read(tmp_path: Path, version: int, rel: str, name: str) -> str:
    base = tmp_path / "cgroup" / ("blkio" if version == 1 else "")
    return (base / rel.lstrip("/") / name).read_text().strip()


# --- rules --------------------------------------------------------------------------


def test_rules_parse_and_nodeslo_keeps_blkio() -> None:
    rules = parse_rules(blocks(readBPS=1024, ioWeightPercent=50))
    be = rules.for_class(QoSClass.BE).blkio_qos
    assert be.enable and be.blocks[0].name == "/dev/vdb" and be.blocks[0].io.read_bps == 1024
    assert be.blocks[0].io.io_weight_percent == 50 and be.blocks[0].io.write_bps == 0
    assert rules.for_class(QoSClass.LS).blkio_qos == BlkioQOS()
    spec = {"resourceQOSStrategy": blocks(writeIOPS=10)["resourceQOSStrategy"]}
    assert parse_rules(rules_from_nodeslo(spec)).for_class(QoSClass.BE).blkio_qos.blocks[0].io.write_iops == 10


@pytest.mark.parametrize(("raw", "path", "value"), [
    ({"blocks": [{"name": "/dev/vdb", "ioCfg": {"readBPS": -1}}]}, "b.blocks[0].ioCfg.readBPS", -1),
    ({"blocks": [{"name": "/dev/vdb", "ioCfg": {"ioWeightPercent": 0}}]}, "b.blocks[0].ioCfg.ioWeightPercent", 0),
    ({"blocks": [{"name": "/dev/vdb", "ioCfg": {"readBps": 1}}]}, "b.blocks[0].ioCfg.readBps", 1),
    ({"blocks": [{"name": "/dev/vdb", "type": "disk"}]}, "b.blocks[0].type", "disk"),
    ({"blocks": [{"name": ""}]}, "b.blocks[0].name", ""),
    ({"blocks": {"name": "x"}}, "b.blocks", {"name": "x"}),
    ({"enable": "yes"}, "b.enable", "yes"),
])
def test_bad_rules_are_named(raw: dict[str, Any], path: str, value: object) -> None:
    with pytest.raises(HookConfigError) as exc:
        parse_blkio_qos(raw, "b", BlkioQOS())
    assert exc.value.key_path == path and exc.value.value == value


# --- devices --------------------------------------------------------------------------


def test_resolve_device(tmp_path: Path) -> None:
    sys = sys_tree(tmp_path)
    assert resolve_device("/dev/vdb", sys) == "253:16"
    assert resolve_device("loop3", sys) == "7:3"
    assert resolve_device("7:3", sys) == "7:3"
    assert resolve_device("/dev/mapper/vg0-data", sys) == "254:0"
    for bad in ("/dev/sdz", "9:9", "../../etc", "/dev/a/b", "/dev/mapper/nope"):
        with pytest.raises(DeviceError):
            resolve_device(bad, sys)


def test_io_max_reads_back_one_device() -> None:
    res = io_max("8:0")
    text = "8:16 rbps=1 wbps=max riops=max wiops=max\n8:0 rbps=2097152 wbps=max riops=max wiops=100\n"
    assert res.parse(text, 2) == "rbps=2097152 wbps=max riops=max wiops=100"
    assert res.parse("", 2) == "rbps=max wbps=max riops=max wiops=max"


# --- the hook ---------------------------------------------------------------------------


def test_v1_lsr_pod_gets_the_throttles(tmp_path: Path) -> None:
    cgroup_tree(tmp_path / "cgroup", 1, "blkio.bfq.weight_device")
    hook = make(tmp_path, blocks("lsrClass", readBPS=1048576, writeIOPS=300, ioWeightPercent=50))
    patch = hook.pre_run_pod_sandbox(pctx(LSR_PARENT, "LSR"))
    assert patch is not None
    assert read(tmp_path, 1, LSR_PARENT, "blkio.throttle.read_bps_device") == "253:16 1048576"
    assert read(tmp_path, 1, LSR_PARENT, "blkio.throttle.write_iops_device") == "253:16 300"
    assert read(tmp_path, 1, LSR_PARENT, "blkio.bfq.weight_device") == "253:16 50"
    assert "LSR class resourceQOSStrategy.lsrClass.blkioQOS.blocks[0] /dev/vdb (253:16): readBPS 1048576" in " ".join(
        w.reason for w in patch.writes)
    assert hook.reconcile_pod_sandbox(pctx(LSR_PARENT, "LSR", Stage.RECONCILE_POD_SANDBOX)) is None  # idempotent


def test_be_and_ls_pods_are_left_to_the_strategy(tmp_path: Path) -> None:
    """The class tiers are the QoS strategy blkio's (tests/unit/metrics/qos/test_qos_blkio.py)."""
    cgroup_tree(tmp_path / "cgroup", 1)
    rules = blocks(readBPS=1048576)
    rules["resourceQOSStrategy"]["lsClass"] = rules["resourceQOSStrategy"]["beClass"]
    hook = make(tmp_path, rules)
    before = {p: p.read_text() for p in (tmp_path / "cgroup").rglob("*") if p.is_file()}
    assert hook.pre_run_pod_sandbox(pctx(BE_PARENT, "BE")) is None
    assert hook.pre_run_pod_sandbox(pctx(LS_PARENT, "LS")) is None
    assert {p: p.read_text() for p in (tmp_path / "cgroup").rglob("*") if p.is_file()} == before


def test_v2_io_max_and_weight_on_the_lsr_pod(tmp_path: Path) -> None:
    cgroup_tree(tmp_path / "cgroup", 2, "io.weight")
    hook = make(tmp_path, blocks("lsrClass", readBPS=4096, writeBPS=8192, ioWeightPercent=80))
    hook.pre_run_pod_sandbox(pctx(LSR_PARENT, "LSR"))
    assert read(tmp_path, 2, LSR_PARENT, "io.max") == "253:16 rbps=4096 wbps=8192 riops=max wiops=max"
    assert read(tmp_path, 2, LSR_PARENT, "io.weight") == "253:16 80"
    assert read(tmp_path, 2, "kubepods", "io.max") == ""  # the root every pod shares stays untouched


def test_nothing_without_rules(tmp_path: Path) -> None:
    cgroup_tree(tmp_path / "cgroup", 1)
    hook = make(tmp_path, {})
    with capture_logs() as logs:
        assert hook.pre_run_pod_sandbox(pctx(LSR_PARENT, "LSR")) is None
    assert logs == [] and hook.support is None  # not even probed


def test_a_dropped_device_gets_its_limits_removed(tmp_path: Path) -> None:
    cgroup_tree(tmp_path / "cgroup", 1)
    rules: dict[str, Any] = blocks("lsrClass", readBPS=1048576)
    current = {"rules": rules}
    host = HostRoots(cgroup=tmp_path / "cgroup", sys=sys_tree(tmp_path / "sys"))
    hook = Blkio(HookInit("blkio", {}, "hooks[6].args", host, rules, current_rules=lambda: current["rules"]))
    hook.pre_run_pod_sandbox(pctx(LSR_PARENT, "LSR"))
    assert read(tmp_path, 1, LSR_PARENT, "blkio.throttle.read_bps_device") == "253:16 1048576"
    current["rules"] = {"resourceQOSStrategy": {"lsrClass": {"blkioQOS": {"enable": False}}}}
    patch = hook.reconcile_pod_sandbox(pctx(LSR_PARENT, "LSR", Stage.RECONCILE_POD_SANDBOX))
    assert patch is not None and "limit removed" in patch.reason
    assert read(tmp_path, 1, LSR_PARENT, "blkio.throttle.read_bps_device") == "253:16 0"


def test_unknown_device_is_named_and_nothing_written(tmp_path: Path) -> None:
    cgroup_tree(tmp_path / "cgroup", 1)
    rules = blocks("lsrClass", readBPS=1)
    rules["resourceQOSStrategy"]["lsrClass"]["blkioQOS"]["blocks"][0]["name"] = "/dev/sdq"
    hook = make(tmp_path, rules)
    with pytest.raises(HookError, match=r"lsrClass\.blkioQOS\.blocks\[0\]\.name='/dev/sdq': no block device") as exc:
        hook.pre_run_pod_sandbox(pctx(LSR_PARENT, "LSR"))
    assert not exc.value.repeat
    with pytest.raises(HookError) as again:
        hook.reconcile_pod_sandbox(pctx(LSR_PARENT, "LSR", Stage.RECONCILE_POD_SANDBOX))
    assert again.value.repeat  # logged below warning by the reconciler
    assert read(tmp_path, 1, LSR_PARENT, "blkio.throttle.read_bps_device") == ""


def test_podvolume_is_skipped_with_one_line(tmp_path: Path) -> None:
    cgroup_tree(tmp_path / "cgroup", 1)
    rules = blocks("lsrClass", readBPS=1)
    rules["resourceQOSStrategy"]["lsrClass"]["blkioQOS"]["blocks"][0]["type"] = "podvolume"
    hook = make(tmp_path, rules)
    with capture_logs() as logs:
        assert hook.pre_run_pod_sandbox(pctx(LSR_PARENT, "LSR")) is None
        assert hook.reconcile_pod_sandbox(pctx(LSR_PARENT, "LSR", Stage.RECONCILE_POD_SANDBOX)) is None
    assert [e["event"] for e in logs] == ["blkio_detected", "blkio_block_unsupported"]


def test_no_throttle_files_is_off(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / "kubepods" / f"pod{UID}").mkdir(parents=True)
    hook = make(tmp_path, blocks("lsrClass", readBPS=1))
    with capture_logs() as logs:
        assert hook.pre_run_pod_sandbox(pctx(LSR_PARENT, "LSR")) is None
        assert hook.pre_run_pod_sandbox(pctx(LSR_PARENT, "LSR")) is None
    assert [e["event"] for e in logs] == ["blkio_detected"] and logs[0]["enabled"] is False


def test_dry_run(tmp_path: Path) -> None:
    cgroup_tree(tmp_path / "cgroup", 1)
    hook = make(tmp_path, blocks("lsrClass", readBPS=1048576), dry_run=True)
    with capture_logs() as logs:
        patch = hook.pre_run_pod_sandbox(pctx(LSR_PARENT, "LSR"))
        assert hook.reconcile_pod_sandbox(pctx(LSR_PARENT, "LSR", Stage.RECONCILE_POD_SANDBOX)) is None
    assert patch is not None and patch.reason.startswith("dry-run")
    assert [w.new for w in patch.writes] == ["253:16 1048576" + DRY_RUN_SUFFIX]  # for explain
    plans = [e for e in logs if e["event"] == "hook_dry_run"]
    assert len(plans) == 1 and plans[0]["hook"] == "blkio"
    assert plans[0]["writes"][0].endswith("blkio.throttle.read_bps_device: - -> 253:16 1048576")
    assert read(tmp_path, 1, LSR_PARENT, "blkio.throttle.read_bps_device") == ""


def test_bad_args(tmp_path: Path) -> None:
    cgroup_tree(tmp_path / "cgroup", 1)
    with pytest.raises(HookConfigError) as exc:
        make(tmp_path, {}, dry_run=1)
    assert exc.value.key_path == "hooks[6].args.dry_run"


def test_systemd_lsr_pod(tmp_path: Path) -> None:
    slice_ = f"kubepods-pod{UID.replace('-', '_')}.slice"
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("io\n")
    pod = root / "kubepods.slice" / slice_
    pod.mkdir(parents=True)
    for d in (root / "kubepods.slice", pod):
        (d / "io.max").write_text("")
    hook = make(tmp_path, blocks("lsrClass", writeBPS=2048), cgroup_driver="systemd")
    hook.pre_run_pod_sandbox(pctx(slice_, "LSR"))
    assert (pod / "io.max").read_text() == "253:16 rbps=max wbps=2048 riops=max wiops=max"


def test_sweep_drops_what_it_remembers_for_gone_pods(tmp_path: Path) -> None:
    """``sweep_orphans``: the limits remembered per pod cgroup go with the pod (the kernel's
    go with its cgroup); a live pod's stay, and its stale devices are still removed later."""
    cgroup_tree(tmp_path / "cgroup", 2)
    hook = make(tmp_path, blocks("lsrClass", readBPS=1048576))
    assert hook.pre_run_pod_sandbox(pctx(LSR_PARENT, "LSR")) is not None
    assert hook.sweep_orphans(LivePods(frozenset({UID}))) == []
    assert hook._applied

    removed = hook.sweep_orphans(LivePods(frozenset()))

    assert removed == [f"blkio limits remembered for {LSR_PARENT.lstrip('/')} dropped (pod no longer exists)"]
    assert not hook._applied and not hook._owners
