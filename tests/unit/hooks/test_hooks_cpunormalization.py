"""CPUNormalization: container CFS quotas divided by the node's ratio, only for
pods whose limit is a quota, exactly (no float rounding), never touching the host."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from hooks.annotations import RESOURCE_STATUS
from hooks.cgroups import CgroupGoneError
from hooks.cpunormalization import CPUNormalization, normalize_quota, parse_ratio
from hooks.cpuset import CPUSet
from runtimeproxy.chain.hookchain import apply_patch
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerInfo,
    ContainerMeta,
    ContainerPatch,
    HookConfigError,
    HookError,
    HookInit,
    HostRoots,
    HostWrite,
    PodInfo,
    PodMeta,
    Resources,
    ResourcesPatch,
    Stage,
    frozen_map,
)

UID = "11111111-2222-4333-8444-555555555555"
QOS = "koordinator.sh/qosClass"
STAGES = [Stage.PRE_CREATE_CONTAINER, Stage.PRE_UPDATE_CONTAINER_RESOURCES]


def _under(root: Path, *parts: str) -> Path:
    path = root.joinpath(*(p.lstrip("/") for p in parts))  # an absolute part must never leave the fixture
    assert path.resolve().is_relative_to(root.resolve()), path
    return path


def v1_tree(root: Path) -> None:
    for controller in ("cpu", "cpuset"):
        d = _under(root, controller, f"/kubepods/burstable/pod{UID}")
        d.mkdir(parents=True)
        (d / "cpu.cfs_quota_us").write_text("200000\n")


def v2_tree(root: Path) -> None:
    d = _under(root, f"/kubepods/burstable/pod{UID}")
    d.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu cpuset\n")
    (d / "cpu.max").write_text("200000 100000\n")


def host(tmp_path: Path) -> HostRoots:
    return HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys",
                     resctrl=tmp_path / "resctrl")


def make_hook(tmp_path: Path, args: dict[str, Any] | None = None) -> CPUNormalization:
    return CPUNormalization(HookInit("norm", {"ratio": 1.2} if args is None else args, "hooks[3].args",
                                     host(tmp_path)))


def ctx(
    quota: int,
    qos: str | None = "LS",
    stage: Stage = Stage.PRE_CREATE_CONTAINER,
    *,
    parent: str = f"/kubepods/burstable/pod{UID}",
    status: str | None = None,
) -> ContainerContext:
    annotations = {} if status is None else {RESOURCE_STATUS: status}
    info = PodInfo(PodMeta("svc", "team", UID), labels=frozen_map({} if qos is None else {QOS: qos}),
                   annotations=frozen_map(annotations), cgroup_parent=parent)
    container = ContainerInfo(ContainerMeta("app"), resources=Resources(cpu_quota=quota, cpu_period=100_000))
    return ContainerContext(stage, info, container)


def call(hook: CPUNormalization, c: ContainerContext) -> ContainerPatch | None:
    if c.stage is Stage.PRE_CREATE_CONTAINER:
        return hook.pre_create_container(c)
    return hook.pre_update_container_resources(c)


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_formula_is_exact() -> None:
    assert normalize_quota(120_000, Fraction("1.2")) == 100_000  # float division would give 100001
    assert normalize_quota(100_000, Fraction("1.2")) == 83_334
    assert normalize_quota(1100, Fraction(5)) == 1000  # kernel minimum
    assert parse_ratio("1.50") == Fraction(3, 2) and parse_ratio(2) == 2 and parse_ratio(None) is None
    assert parse_ratio(1.1) == Fraction(11, 10)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("tree", [v1_tree, v2_tree])
def test_ls_quota_is_normalized(tmp_path: Path, tree: Callable[[Path], None], stage: Stage) -> None:
    tree(tmp_path / "cgroup")
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path)
    assert call(hook, ctx(120_000, stage=stage)) == ContainerPatch(
        resources=ResourcesPatch(cpu_quota=100_000),
        reason="LS container CFS quota 120000 / cpu-normalization-ratio 1.2 = 100000",
    )
    assert call(hook, ctx(100_000, stage=stage)) == ContainerPatch(
        resources=ResourcesPatch(cpu_quota=83_334),
        reason="LS container CFS quota 100000 / cpu-normalization-ratio 1.2 = 83334",
    )
    assert snapshot(tmp_path) == before  # CRI request only, never the host


def test_ratio_as_annotation_string(tmp_path: Path) -> None:
    patch = make_hook(tmp_path, {"ratio": " 1.50 "}).pre_create_container(ctx(200_000))
    assert patch == ContainerPatch(
        resources=ResourcesPatch(cpu_quota=133_334),
        reason="LS container CFS quota 200000 / cpu-normalization-ratio 1.50 = 133334",
    )


def test_kernel_minimum(tmp_path: Path) -> None:
    hook = make_hook(tmp_path, {"ratio": 5})
    assert hook.pre_create_container(ctx(1100)) == ContainerPatch(
        resources=ResourcesPatch(cpu_quota=1000),
        reason="LS container CFS quota 1100 / cpu-normalization-ratio 5 (raised to the kernel minimum 1000)",
    )
    assert hook.pre_create_container(ctx(1000)) is None  # already at the minimum: nothing to change


@pytest.mark.parametrize(
    ("qos", "parent", "label"),
    [("LSR", f"/kubepods/pod{UID}", "LSR"), ("BE", f"/kubepods/besteffort/pod{UID}", "BE"),
     (None, f"/kubepods/burstable/pod{UID}", "LS"), (None, "/custom/pod", "no-class")],
)
def test_other_quota_classes(tmp_path: Path, qos: str | None, parent: str, label: str) -> None:
    patch = make_hook(tmp_path, {"ratio": 2}).pre_create_container(ctx(300_000, qos, parent=parent))
    assert patch == ContainerPatch(
        resources=ResourcesPatch(cpu_quota=150_000),
        reason=f"{label} container CFS quota 300000 / cpu-normalization-ratio 2 = 150000",
    )


@pytest.mark.parametrize(
    "c",
    [
        ctx(200_000, "LSE"),
        ctx(200_000, "SYSTEM"),
        ctx(200_000, "LSR", status=json.dumps({"cpuset": "2-3"})),
        ctx(200_000, "LS", status=json.dumps({"cpuset": "4"})),
        ctx(0),
        ctx(-1),
    ],
    ids=["LSE", "SYSTEM", "LSR-bound", "LS-bound", "no-quota", "unlimited"],
)
def test_left_alone(tmp_path: Path, c: ContainerContext) -> None:
    hook = make_hook(tmp_path, {"ratio": 2})
    assert hook.pre_create_container(c) is None
    assert hook.pre_update_container_resources(c) is None


def test_unbound_resource_status_is_normalized(tmp_path: Path) -> None:
    status = json.dumps({"numaNodeResources": [{"node": 0, "resources": {"cpu": "2"}}]})
    patch = make_hook(tmp_path, {"ratio": 2}).pre_create_container(ctx(200_000, status=status))
    assert patch is not None and patch.resources == ResourcesPatch(cpu_quota=100_000)


@pytest.mark.parametrize("args", [{}, {"ratio": None}, {"ratio": 1}, {"ratio": "1.0"}])
def test_disabled(tmp_path: Path, args: dict[str, Any]) -> None:
    hook = make_hook(tmp_path, args)
    for stage in STAGES:
        assert call(hook, ctx(200_000, stage=stage)) is None


def test_after_cpuset_in_chain_order(tmp_path: Path) -> None:
    """cpuset (earlier in the chain) unsets the quota of a bound pod; normalization then sees -1."""
    cpu = tmp_path / "sys" / "devices" / "system" / "cpu"
    cpu.mkdir(parents=True)
    (cpu / "online").write_text("0-7\n")
    cpuset = CPUSet(HookInit("cpuset", {"unset_cpu_quota": False}, "hooks[0].args", host(tmp_path)))
    norm = make_hook(tmp_path, {"ratio": 2})
    start = ctx(400_000, "LS")
    first = cpuset.pre_create_container(start)
    assert first is not None
    after, _ = apply_patch(start, first, "cpuset")
    assert isinstance(after, ContainerContext) and after.container.resources.cpuset_cpus == "0-7"
    second = norm.pre_create_container(after)  # LS share pool keeps the quota: still normalized
    assert second is not None and second.resources == ResourcesPatch(cpu_quota=200_000)
    bound = ctx(400_000, "LSR", status=json.dumps({"cpuset": "2-3"}))
    v1_tree(tmp_path / "cgroup")
    pinned = CPUSet(HookInit("cpuset", {}, "hooks[0].args", host(tmp_path)))
    first = pinned.pre_create_container(bound)
    assert first is not None
    after, _ = apply_patch(bound, first, "cpuset")
    assert isinstance(after, ContainerContext) and after.container.resources.cpu_quota == -1
    assert norm.pre_create_container(after) is None


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [("{oops", "invalid JSON"), (json.dumps({"cpuset": "1-0"}), "reversed")],
)
@pytest.mark.parametrize("tree", [v1_tree, v2_tree])
def test_bad_resource_status(tmp_path: Path, tree: Callable[[Path], None], raw: str, fragment: str) -> None:
    tree(tmp_path / "cgroup")
    before = snapshot(tmp_path)
    with pytest.raises(HookError, match=fragment) as exc:
        make_hook(tmp_path).pre_create_container(ctx(200_000, status=raw))
    message = str(exc.value)
    assert "pod team/svc" in message and RESOURCE_STATUS in message and repr(raw) in message
    assert snapshot(tmp_path) == before


def test_bad_qos_label(tmp_path: Path) -> None:
    with pytest.raises(HookError, match=r"pod team/svc: label koordinator\.sh/qosClass='L S'"):
        make_hook(tmp_path).pre_create_container(ctx(200_000, "L S"))


@pytest.mark.parametrize(
    ("args", "key", "fragment"),
    [
        ({"ratio": 0.5}, "ratio", r"must be in \[1.0, 5.0\]"),
        ({"ratio": 5.01}, "ratio", r"must be in \[1.0, 5.0\]"),
        ({"ratio": -1}, "ratio", r"must be in \[1.0, 5.0\]"),
        ({"ratio": "fast"}, "ratio", "expected a number"),
        ({"ratio": True}, "ratio", "expected a number"),
        ({"ratio": [1.2]}, "ratio", "expected a number"),
        ({"ratio": float("nan")}, "ratio", "finite"),
        ({"ratio": "inf"}, "ratio", "finite"),
        ({"ratio": 1.2, "period": 1}, "period", "unknown key"),
    ],
)
def test_config_errors(tmp_path: Path, args: dict[str, Any], key: str, fragment: str) -> None:
    with pytest.raises(HookConfigError, match=fragment) as exc:
        make_hook(tmp_path, args)
    assert exc.value.key_path == f"hooks[3].args.{key}"


# --- reconciler -----------------------------------------------------------------------

CID = "beef0001app"
POD_DIR = f"/kubepods/burstable/pod{UID}"


def with_container(root: Path, tree: Callable[[Path], None], cid: str = CID) -> Path:
    """The pod tree plus a container cgroup; returns the container's quota file."""
    tree(root)
    if tree is v1_tree:
        d = _under(root, "cpu", POD_DIR, cid)
        d.mkdir()
        (d / "cpu.cfs_quota_us").write_text("120000\n")
        return d / "cpu.cfs_quota_us"
    d = _under(root, POD_DIR, cid)
    d.mkdir()
    (d / "cpu.max").write_text("120000 100000\n")
    return d / "cpu.max"


def rctx(quota: int, qos: str | None = "LS", cid: str = CID, **kw: Any) -> ContainerContext:
    c = ctx(quota, qos, Stage.RECONCILE_CONTAINER, **kw)
    return replace(c, pod=replace(c.pod, id="sb-svc"), container=replace(c.container, id=cid))


@pytest.mark.parametrize("tree", [v1_tree, v2_tree], ids=["v1", "v2"])
def test_reconcile_writes_the_forwarded_quota_never_divides_twice(tmp_path: Path, tree: Callable[[Path], None]) -> None:
    target = with_container(tmp_path / "cgroup", tree)
    v1 = tree is v1_tree
    hook = make_hook(tmp_path)  # ratio 1.2
    # What the proxy forwarded at PreCreateContainer: kubelet's 120000 already divided by 1.2.
    created = hook.pre_create_container(ctx(120_000))
    assert created is not None and created.resources is not None and created.resources.cpu_quota == 100_000
    stored = rctx(100_000)
    first = hook.reconcile_container(stored)
    reason = ("LS container CFS quota 100000 as forwarded "
              "(normalized by cpu-normalization-ratio 1.2 at creation, not divided again)")
    assert first == ContainerPatch(reason=reason, writes=(HostWrite(
        str(target.resolve()), "120000" if v1 else "120000 100000", "100000" if v1 else "100000 100000", reason),))
    assert not first.changes_request()
    assert Path(first.writes[0].target).is_relative_to(tmp_path.resolve())
    for _ in range(3):  # pass after pass: 100000 stays, it is not divided again (83334, 69445, ...)
        assert hook.reconcile_container(stored) is None
    assert target.read_text() == ("100000" if v1 else "100000 100000")
    target.write_text("400000\n" if v1 else "max 100000\n")  # drift
    repaired = hook.reconcile_container(stored)
    assert repaired is not None and [(w.old, w.new) for w in repaired.writes] == [
        ("400000", "100000") if v1 else ("max 100000", "100000 100000")
    ]
    assert hook.reconcile_container(stored) is None


def test_reconcile_systemd_v2(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    pod_dir = f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice"
    scope = _under(root, pod_dir, f"cri-containerd-{CID}.scope")
    scope.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu\n")
    (scope / "cpu.max").write_text("max 100000\n")
    hook = make_hook(tmp_path, {"ratio": 2, "cgroup_driver": "systemd", "cgroup_version": 2})
    patch = hook.reconcile_container(rctx(150_000, parent=f"kubepods-burstable-pod{UID.replace('-', '_')}.slice"))
    assert patch is not None and (scope / "cpu.max").read_text() == "150000 100000"


@pytest.mark.parametrize("tree", [v1_tree, v2_tree], ids=["v1", "v2"])
def test_reconcile_cgroup_gone(tmp_path: Path, tree: Callable[[Path], None]) -> None:
    with_container(tmp_path / "cgroup", tree)
    hook = make_hook(tmp_path)
    with pytest.raises(CgroupGoneError, match=r"pod team/svc: container app \(beef0002gone\).*does not exist"):
        hook.reconcile_container(rctx(100_000, cid="beef0002gone"))
    with pytest.raises(CgroupGoneError, match=r"pod team/svc: .*cgroup_parent '/kubepods/burstable/podgone'"):
        hook.reconcile_container(rctx(100_000, parent="/kubepods/burstable/podgone"))


def test_reconcile_without_cgroup_tree_is_a_hook_error(tmp_path: Path) -> None:
    with pytest.raises(HookError, match=r"pod team/svc: no cgroup hierarchy"):
        make_hook(tmp_path).reconcile_container(rctx(100_000))


@pytest.mark.parametrize(
    ("args", "c"),
    [
        ({"ratio": 1}, rctx(100_000)),
        ({}, rctx(100_000)),
        ({"ratio": 2}, rctx(0)),
        ({"ratio": 2}, rctx(-1)),
        ({"ratio": 2}, rctx(100_000, "LSE")),
        ({"ratio": 2}, rctx(100_000, "SYSTEM")),
        ({"ratio": 2}, rctx(100_000, "LSR", status=json.dumps({"cpuset": "2-3"}))),
        ({"ratio": 2}, rctx(100_000, cid="")),
    ],
    ids=["ratio-1", "no-ratio", "no-quota", "unlimited", "LSE", "SYSTEM", "bound", "no-container-id"],
)
@pytest.mark.parametrize("tree", [v1_tree, v2_tree], ids=["v1", "v2"])
def test_reconcile_left_alone(
    tmp_path: Path, tree: Callable[[Path], None], args: dict[str, Any], c: ContainerContext
) -> None:
    with_container(tmp_path / "cgroup", tree)
    before = snapshot(tmp_path)
    assert make_hook(tmp_path, args).reconcile_container(c) is None
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    ("args", "key", "fragment"),
    [({"ratio": 2, "cgroup_driver": "upstart"}, "cgroup_driver", "cgroupfs or systemd"),
     ({"ratio": 2, "cgroup_version": 3}, "cgroup_version", "auto, 1 or 2")],
)
def test_cgroup_config_errors(tmp_path: Path, args: dict[str, Any], key: str, fragment: str) -> None:
    with pytest.raises(HookConfigError, match=fragment) as exc:
        make_hook(tmp_path, args)
    assert exc.value.key_path == f"hooks[3].args.{key}"


def test_dry_run_reports_the_reconcile_write_once_and_writes_nothing(tmp_path: Path) -> None:
    target = with_container(tmp_path / "cgroup", v1_tree)
    hook = make_hook(tmp_path, {"ratio": 1.2, "dry_run": True})
    patch = hook.reconcile_container(rctx(100_000))
    assert patch is not None and patch.reason.startswith("dry-run: LS container CFS quota 100000 as forwarded")
    assert [(w.old, w.new) for w in patch.writes] == [("120000", "100000 (dry-run, not written)")]
    assert target.read_text().strip() == "120000"
    assert hook.reconcile_container(rctx(100_000)) is None  # reported once per planned value
