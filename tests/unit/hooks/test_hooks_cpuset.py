"""CPUSet on fixture trees (cgroup v1 and v2, a fake /sys with the online CPUs):
bound pods get their cpuset and an unset quota, unbound LS/BE pods the share
pools, and bad input fails with pod/key/value and writes nothing."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hooks.annotations import RESOURCE_STATUS
from hooks.cgroups import CgroupGoneError
from hooks.cpuset import Binding, CPUSet
from hooks.qos import QoSClass
from runtimeproxy.hookapi import (
    CallResult,
    ContainerContext,
    ContainerInfo,
    ContainerMeta,
    ContainerPatch,
    HookConfigError,
    HookError,
    HookInit,
    HostRoots,
    HostWrite,
    LivePods,
    PodContext,
    PodInfo,
    PodMeta,
    PodPatch,
    ResourcesPatch,
    Stage,
    frozen_map,
)

UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
PARENT = f"/kubepods/pod{UID}"  # Guaranteed: directly under kubepods
SYSTEMD_PARENT = f"kubepods-pod{UID.replace('-', '_')}.slice"
SYSTEMD_DIR = f"kubepods.slice/{SYSTEMD_PARENT}"
QOS = "koordinator.sh/qosClass"
Tree = Callable[[Path, str], None]


def _under(root: Path, *parts: str) -> Path:
    path = root.joinpath(*(p.lstrip("/") for p in parts))  # an absolute part must never leave the fixture
    assert path.resolve().is_relative_to(root.resolve()), path
    return path


def v1_tree(root: Path, pod_dir: str) -> None:
    for controller in ("cpu", "cpuset", "memory"):
        _under(root, controller, pod_dir).mkdir(parents=True)
    _under(root, "cpu", pod_dir, "cpu.cfs_quota_us").write_text("400000\n")
    _under(root, "cpu", pod_dir, "cpu.cfs_period_us").write_text("100000\n")


def v2_tree(root: Path, pod_dir: str) -> None:
    _under(root, pod_dir).mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    _under(root, pod_dir, "cpu.max").write_text("400000 50000\n")


def sys_tree(tmp_path: Path, online: str = "0-7") -> None:
    cpu = tmp_path / "sys" / "devices" / "system" / "cpu"
    cpu.mkdir(parents=True, exist_ok=True)
    (cpu / "online").write_text(online + "\n")


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def host(tmp_path: Path) -> HostRoots:
    return HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys",
                     resctrl=tmp_path / "resctrl")


def make_hook(tmp_path: Path, args: dict[str, Any] | None = None) -> CPUSet:
    return CPUSet(HookInit("cpuset", args or {}, "hooks[1].args", host(tmp_path)))


def pod(
    qos: str | None = "LSR",
    cpuset: str | None = "2-3",
    *,
    uid: str = UID,
    name: str = "web",
    parent: str = PARENT,
    raw: str | None = None,
) -> PodInfo:
    annotations: dict[str, str] = {}
    if raw is not None:
        annotations[RESOURCE_STATUS] = raw
    elif cpuset is not None:
        annotations[RESOURCE_STATUS] = json.dumps({"cpuset": cpuset})
    return PodInfo(
        PodMeta(name, "shop", uid),
        labels=frozen_map({} if qos is None else {QOS: qos}),
        annotations=frozen_map(annotations),
        cgroup_parent=parent,
    )


def ctr(info: PodInfo, stage: Stage = Stage.PRE_CREATE_CONTAINER) -> ContainerContext:
    return ContainerContext(stage, info, ContainerInfo(ContainerMeta("main")))


def call(hook: CPUSet, ctx: ContainerContext) -> ContainerPatch | None:
    if ctx.stage is Stage.PRE_CREATE_CONTAINER:
        return hook.pre_create_container(ctx)
    return hook.pre_update_container_resources(ctx)


CONTAINER_STAGES = [Stage.PRE_CREATE_CONTAINER, Stage.PRE_UPDATE_CONTAINER_RESOURCES]


# --- bound pods -------------------------------------------------------------------


@pytest.mark.parametrize("stage", CONTAINER_STAGES)
@pytest.mark.parametrize("tree", [v1_tree, v2_tree])
def test_bound_container_gets_cpuset_and_no_quota(tmp_path: Path, tree: Tree, stage: Stage) -> None:
    tree(tmp_path / "cgroup", PARENT)
    sys_tree(tmp_path)
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path)
    patch = call(hook, ctr(pod("LSR", "3,2"), stage))
    assert patch == ContainerPatch(
        resources=ResourcesPatch(cpuset_cpus="2-3", cpu_quota=-1),
        reason="LSR pod bound by resource-status cpuset 2-3; CFS quota unset",
    )
    assert hook.bindings == {UID: Binding(QoSClass.LSR, frozenset({2, 3}))}
    assert snapshot(tmp_path) == before  # containers: the CRI request only


def test_unset_cpu_quota_false_keeps_quota_and_needs_no_cgroup_tree(tmp_path: Path) -> None:
    sys_tree(tmp_path)  # no cgroup tree at all: the hook writes nothing in this mode
    hook = make_hook(tmp_path, {"unset_cpu_quota": False})
    assert hook.pre_create_container(ctr(pod("LSE", "4"))) == ContainerPatch(
        resources=ResourcesPatch(cpuset_cpus="4"), reason="LSE pod bound by resource-status cpuset 4"
    )
    assert hook.pre_run_pod_sandbox(PodContext(Stage.PRE_RUN_POD_SANDBOX, pod("LSE", "4"))) is None


def test_pod_without_class_label_is_bound_as_lsr(tmp_path: Path) -> None:
    sys_tree(tmp_path)
    hook = make_hook(tmp_path, {"unset_cpu_quota": False})
    patch = hook.pre_create_container(ctr(pod(None, "1", parent="/system.slice/x")))
    assert patch is not None and patch.reason == "no-class pod bound by resource-status cpuset 1"
    assert hook.bindings[UID] == Binding(QoSClass.LSR, frozenset({1}))


@pytest.mark.parametrize(
    ("tree", "file", "old", "new"),
    [(v1_tree, "cpu/{}/cpu.cfs_quota_us", "400000", "-1"), (v2_tree, "{}/cpu.max", "400000 50000", "max 50000")],
    ids=["v1", "v2"],
)
def test_pre_run_pod_sandbox_unsets_pod_quota(tmp_path: Path, tree: Tree, file: str, old: str, new: str) -> None:
    tree(tmp_path / "cgroup", PARENT)
    sys_tree(tmp_path)
    hook = make_hook(tmp_path)
    target = _under(tmp_path / "cgroup", file.format(PARENT.lstrip("/")))
    reason = "LSR pod bound by resource-status cpuset 2-3: pod CFS quota unset"
    patch = hook.pre_run_pod_sandbox(PodContext(Stage.PRE_RUN_POD_SANDBOX, pod()))
    assert patch == PodPatch(reason=reason, writes=(HostWrite(str(target.resolve()), old, new, reason),))
    assert target.read_text() == new
    assert not patch.changes_request()
    again = hook.pre_run_pod_sandbox(PodContext(Stage.PRE_RUN_POD_SANDBOX, pod()))  # idempotent
    assert again == PodPatch(reason=f"{reason} (already unset)", writes=())
    assert target.read_text() == new


def test_pre_run_pod_sandbox_systemd_v2(tmp_path: Path) -> None:
    v2_tree(tmp_path / "cgroup", SYSTEMD_DIR)
    sys_tree(tmp_path)
    hook = make_hook(tmp_path, {"cgroup_driver": "systemd", "cgroup_version": 2})
    patch = hook.pre_run_pod_sandbox(PodContext(Stage.PRE_RUN_POD_SANDBOX, pod(parent=SYSTEMD_PARENT)))
    assert patch is not None and [w.new for w in patch.writes] == ["max 50000"]
    assert _under(tmp_path / "cgroup", SYSTEMD_DIR, "cpu.max").read_text() == "max 50000"


@pytest.mark.parametrize("tree", [v1_tree, v2_tree])
def test_pre_run_pod_sandbox_ignores_unbound_pods(tmp_path: Path, tree: Tree) -> None:
    tree(tmp_path / "cgroup", PARENT)
    sys_tree(tmp_path)
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path)
    numa_only = json.dumps({"numaNodeResources": []})
    for info in (pod("LS", None), pod("BE", None), pod("LSR", ""), pod("LSR", raw=numa_only)):
        assert hook.pre_run_pod_sandbox(PodContext(Stage.PRE_RUN_POD_SANDBOX, info)) is None
    assert snapshot(tmp_path) == before


def test_pod_cgroup_gone(tmp_path: Path) -> None:
    v1_tree(tmp_path / "cgroup", PARENT)
    sys_tree(tmp_path)
    with pytest.raises(CgroupGoneError, match="does not exist"):
        make_hook(tmp_path).pre_run_pod_sandbox(PodContext(Stage.PRE_RUN_POD_SANDBOX, pod(parent="/kubepods/podx")))


# --- share pools ----------------------------------------------------------------


def _bind(hook: CPUSet, qos: str, cpuset: str, uid: str) -> None:
    assert hook.pre_create_container(ctr(pod(qos, cpuset, uid=uid, name=uid))) is not None


@pytest.mark.parametrize("tree", [v1_tree, v2_tree])
def test_computed_pools_follow_bindings(tmp_path: Path, tree: Tree) -> None:
    tree(tmp_path / "cgroup", PARENT)
    sys_tree(tmp_path, "0-7")
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path, {"reserved_cpus": "0"})
    _bind(hook, "LSR", "2-3", "lsr")
    _bind(hook, "LSE", "4", "lse")
    ls, be = pod("LS", None, uid="ls"), pod("BE", None, uid="be")
    assert hook.pre_create_container(ctr(ls)) == ContainerPatch(
        resources=ResourcesPatch(cpuset_cpus="1,5-7"),
        reason="unbound LS pod gets the LS share pool 1,5-7 "
        "(computed: online 0-7 - LSE/LSR-bound 2-4 - reserved 0)",
    )
    assert hook.pre_update_container_resources(ctr(be, Stage.PRE_UPDATE_CONTAINER_RESOURCES)) == ContainerPatch(
        resources=ResourcesPatch(cpuset_cpus="0-3,5-7"),
        reason="unbound BE pod gets the BE share pool 0-3,5-7 (computed: online 0-7 - LSE-bound 4)",
    )
    assert set(hook.bindings) == {"lsr", "lse"}  # unbound pods are not recorded

    # The LSR pod goes away: its CPUs return to the LS pool.
    hook.post_stop_pod_sandbox(PodContext(Stage.POST_STOP_POD_SANDBOX, pod(uid="lsr"), CallResult(ok=True)))
    patch = hook.pre_create_container(ctr(ls))
    assert patch is not None and patch.resources == ResourcesPatch(cpuset_cpus="1-3,5-7")
    # A failed stop keeps the binding; a remove drops it.
    hook.post_stop_pod_sandbox(
        PodContext(Stage.POST_STOP_POD_SANDBOX, pod(uid="lse"), CallResult(ok=False, code="UNKNOWN"))
    )
    assert set(hook.bindings) == {"lse"}
    hook.post_remove_pod_sandbox(PodContext(Stage.POST_REMOVE_POD_SANDBOX, pod(uid="lse"), CallResult(ok=True)))
    assert hook.bindings == {}
    patch = hook.pre_create_container(ctr(be))
    assert patch is not None and patch.resources == ResourcesPatch(cpuset_cpus="0-7")
    assert snapshot(tmp_path) == before


def test_binding_removed_from_annotation_is_forgotten(tmp_path: Path) -> None:
    sys_tree(tmp_path)
    hook = make_hook(tmp_path, {"unset_cpu_quota": False})
    _bind(hook, "LSR", "2-3", "p")
    assert hook.pre_update_container_resources(
        ctr(pod("LSR", None, uid="p"), Stage.PRE_UPDATE_CONTAINER_RESOURCES)
    ) is None  # unbound LSR: left alone
    assert hook.bindings == {}


def test_empty_computed_pool_falls_back_to_all_cpus(tmp_path: Path) -> None:
    sys_tree(tmp_path, "0-1")
    hook = make_hook(tmp_path, {"unset_cpu_quota": False, "reserved_cpus": "1"})
    _bind(hook, "LSR", "0", "lsr")
    assert hook.pre_create_container(ctr(pod("LS", None))) == ContainerPatch(
        resources=ResourcesPatch(cpuset_cpus="0-1"),
        reason="unbound LS pod gets the LS share pool 0-1 "
        "(computed: online 0-1 - LSE/LSR-bound 0 - reserved 1; that leaves no CPU, so all online CPUs)",
    )


def test_pools_from_args(tmp_path: Path) -> None:
    sys_tree(tmp_path, "0-7")
    annotation = [{"socket": 0, "node": 0, "cpuset": "0-1"}, {"socket": 1, "node": 1, "cpuset": "6-7"}]
    hook = make_hook(tmp_path, {"unset_cpu_quota": False, "ls_pool": "0-3", "be_pool": annotation})
    _bind(hook, "LSR", "2-3", "lsr")  # configured pools are taken as given
    assert hook.pre_create_container(ctr(pod("LS", None))) == ContainerPatch(
        resources=ResourcesPatch(cpuset_cpus="0-3"), reason="unbound LS pod gets the LS share pool 0-3 "
        "(from args.ls_pool 0-3)"
    )
    assert hook.pre_create_container(ctr(pod("BE", None))) == ContainerPatch(
        resources=ResourcesPatch(cpuset_cpus="0-1,6-7"), reason="unbound BE pod gets the BE share pool 0-1,6-7 "
        "(from args.be_pool 0-1,6-7)"
    )


def test_configured_pool_shrinks_with_offline_cpus(tmp_path: Path) -> None:
    sys_tree(tmp_path, "0-7")
    hook = make_hook(tmp_path, {"unset_cpu_quota": False, "ls_pool": "4-7"})
    sys_tree(tmp_path, "0-5")  # CPUs 6-7 went offline since start-up
    patch = hook.pre_create_container(ctr(pod("LS", None)))
    assert patch is not None and patch.resources == ResourcesPatch(cpuset_cpus="4-5")
    assert "limited to the online CPUs 0-5" in patch.reason
    sys_tree(tmp_path, "0-3")
    patch = hook.pre_create_container(ctr(pod("LS", None)))
    assert patch is not None and patch.resources == ResourcesPatch(cpuset_cpus="0-3")
    assert "that leaves no CPU, so all online CPUs" in patch.reason


def test_besteffort_pod_without_label_gets_be_pool(tmp_path: Path) -> None:
    sys_tree(tmp_path, "0-3")
    hook = make_hook(tmp_path, {"unset_cpu_quota": False})
    patch = hook.pre_create_container(ctr(pod(None, None, parent=f"/kubepods/besteffort/pod{UID}")))
    assert patch is not None and patch.resources == ResourcesPatch(cpuset_cpus="0-3")


@pytest.mark.parametrize("qos", ["LSR", "LSE", "SYSTEM"])
def test_unbound_non_pool_classes_are_left_alone(tmp_path: Path, qos: str) -> None:
    sys_tree(tmp_path)
    hook = make_hook(tmp_path, {"unset_cpu_quota": False})
    assert hook.pre_create_container(ctr(pod(qos, None))) is None


# --- bad input --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("{not json", "invalid JSON"),
        (json.dumps({"cpuset": "0-99999"}), "beyond the kernel limit"),
        (json.dumps({"cpuset": "0-15"}), "CPUs 8-15 that are not online"),
        (json.dumps({"cpuset": "3-1"}), "reversed"),
        (json.dumps({"cpuset": 3}), "expected a string"),
        (json.dumps(["2-3"]), "expected a JSON object"),
    ],
)
@pytest.mark.parametrize("tree", [v1_tree, v2_tree])
def test_bad_resource_status_fails_without_writes(tmp_path: Path, tree: Tree, raw: str, fragment: str) -> None:
    tree(tmp_path / "cgroup", PARENT)
    sys_tree(tmp_path, "0-7")
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path)
    info = pod("LSR", raw=raw)
    for run in (
        lambda: hook.pre_run_pod_sandbox(PodContext(Stage.PRE_RUN_POD_SANDBOX, info)),
        lambda: hook.pre_create_container(ctr(info)),
        lambda: hook.pre_update_container_resources(ctr(info, Stage.PRE_UPDATE_CONTAINER_RESOURCES)),
    ):
        with pytest.raises(HookError, match=fragment) as exc:
            run()
        message = str(exc.value)
        assert "pod shop/web" in message and RESOURCE_STATUS in message and repr(raw) in message
    assert hook.bindings == {}
    assert snapshot(tmp_path) == before


def test_bad_qos_label(tmp_path: Path) -> None:
    sys_tree(tmp_path)
    with pytest.raises(HookError, match=r"pod shop/web: label koordinator\.sh/qosClass='Gold'"):
        make_hook(tmp_path, {"unset_cpu_quota": False}).pre_create_container(ctr(pod("Gold")))


@pytest.mark.parametrize("tree", [v1_tree, v2_tree])
def test_dotdot_cgroup_parent_refused(tmp_path: Path, tree: Tree) -> None:
    tree(tmp_path / "cgroup", PARENT)
    sys_tree(tmp_path)
    before = snapshot(tmp_path)
    bad = "/kubepods/../../../../etc"
    with pytest.raises(HookError, match=r"pod shop/web: cgroup_parent '/kubepods/\.\./.*'\.\.'"):
        make_hook(tmp_path).pre_run_pod_sandbox(PodContext(Stage.PRE_RUN_POD_SANDBOX, pod(parent=bad)))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("tree", [v1_tree, v2_tree])
def test_symlink_escape_refused(tmp_path: Path, tree: Tree) -> None:
    tree(tmp_path / "cgroup", PARENT)
    sys_tree(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("cpu.max", "cpu.cfs_quota_us"):
        (outside / name).write_text("100000\n")
    kubepods = _under(tmp_path / "cgroup", "cpu" if tree is v1_tree else "", "kubepods")
    (kubepods / "evil").symlink_to(outside)
    before = snapshot(tmp_path)
    with pytest.raises(HookError, match=r"pod shop/web: cgroup_parent '/kubepods/evil'.*outside the root"):
        make_hook(tmp_path).pre_run_pod_sandbox(PodContext(Stage.PRE_RUN_POD_SANDBOX, pod(parent="/kubepods/evil")))
    assert snapshot(tmp_path) == before


def test_unreadable_online_cpus_is_a_hook_error(tmp_path: Path) -> None:
    v1_tree(tmp_path / "cgroup", PARENT)  # no fake /sys
    hook = make_hook(tmp_path)
    with pytest.raises(HookError, match=r"pod shop/web: cannot read the node's online CPUs"):
        hook.pre_create_container(ctr(pod()))
    with pytest.raises(HookError, match=r"pod shop/web: cannot read the node's online CPUs"):
        hook.pre_create_container(ctr(pod("LS", None)))


@pytest.mark.parametrize(
    ("args", "key", "value", "fragment"),
    [
        ({"ls_pol": "0-3"}, "ls_pol", "0-3", "unknown key"),
        ({"ls_pool": "0-3,"}, "ls_pool", "0-3,", "empty element"),
        ({"ls_pool": "0-15"}, "ls_pool", "0-15", "not online"),
        ({"ls_pool": ""}, "ls_pool", "", "at least one CPU"),
        ({"be_pool": 7}, "be_pool", 7, "CPU list string"),
        ({"be_pool": [{"socket": 0}]}, "be_pool", [{"socket": 0}], "item 0: expected an object"),
        ({"reserved_cpus": "a"}, "reserved_cpus", "a", "not a CPU number"),
        ({"unset_cpu_quota": "no"}, "unset_cpu_quota", "no", "true or false"),
        ({"cgroup_driver": "upstart"}, "cgroup_driver", "upstart", "cgroupfs or systemd"),
        ({"cgroup_version": 3}, "cgroup_version", 3, "auto, 1 or 2"),
    ],
)
def test_config_errors(tmp_path: Path, args: dict[str, Any], key: str, value: object, fragment: str) -> None:
    v1_tree(tmp_path / "cgroup", PARENT)
    sys_tree(tmp_path, "0-7")
    with pytest.raises(HookConfigError, match=fragment) as exc:
        make_hook(tmp_path, args)
    assert exc.value.key_path == f"hooks[1].args.{key}" and exc.value.value == value


def test_pool_args_need_the_online_cpus(tmp_path: Path) -> None:
    v1_tree(tmp_path / "cgroup", PARENT)
    with pytest.raises(HookConfigError, match="cannot check it against the node") as exc:
        make_hook(tmp_path, {"ls_pool": "0-3"})
    assert exc.value.key_path == "hooks[1].args.ls_pool"


def test_missing_cgroup_root_is_a_config_error(tmp_path: Path) -> None:
    sys_tree(tmp_path)
    with pytest.raises(HookConfigError, match="no cgroup hierarchy"):
        make_hook(tmp_path)


# --- reconciler -----------------------------------------------------------------------

CID = "cafe0001main"
LS_UID = "ls-0000-pod"
LS_PARENT = f"/kubepods/burstable/pod{LS_UID}"


def reconcile_tree(root: Path, tree: Tree, pod_dir: str, cid: str = CID, pod_cpus: str = "0-7") -> None:
    """A pod and container cgroup with the files the reconciler keeps (cpuset.cpus, the CFS quota)."""
    if not root.exists() or not _under(root, "cpu" if tree is v1_tree else "", pod_dir).exists():
        tree(root, pod_dir)
    if tree is v1_tree:
        _under(root, "cpu", pod_dir, cid).mkdir()
        _under(root, "cpu", pod_dir, cid, "cpu.cfs_quota_us").write_text("200000\n")
        _under(root, "cpuset", pod_dir, "cpuset.cpus").write_text(pod_cpus + "\n")
        _under(root, "cpuset", pod_dir, cid).mkdir()
        _under(root, "cpuset", pod_dir, cid, "cpuset.cpus").write_text("0-7\n")
    else:
        _under(root, pod_dir, "cpuset.cpus").write_text(pod_cpus + "\n")
        _under(root, pod_dir, cid).mkdir()
        _under(root, pod_dir, cid, "cpu.max").write_text("200000 50000\n")
        _under(root, pod_dir, cid, "cpuset.cpus").write_text("\n")


def cpus_file(tmp_path: Path, tree: Tree, pod_dir: str, *cid: str) -> Path:
    path = _under(tmp_path / "cgroup", "cpuset" if tree is v1_tree else "", pod_dir, *cid, "cpuset.cpus")
    assert path.is_file(), path
    return path


def quota_file(tmp_path: Path, tree: Tree, pod_dir: str, *cid: str) -> Path:
    if tree is v1_tree:
        return _under(tmp_path / "cgroup", "cpu", pod_dir, *cid, "cpu.cfs_quota_us")
    return _under(tmp_path / "cgroup", pod_dir, *cid, "cpu.max")


def rpod(info: PodInfo) -> PodContext:
    return PodContext(Stage.RECONCILE_POD_SANDBOX, replace(info, id=f"sb-{info.meta.uid}"))


def rctr(info: PodInfo, cid: str = CID) -> ContainerContext:
    return ContainerContext(Stage.RECONCILE_CONTAINER, replace(info, id=f"sb-{info.meta.uid}"),
                            ContainerInfo(ContainerMeta("main"), id=cid))


@pytest.mark.parametrize("tree", [v1_tree, v2_tree], ids=["v1", "v2"])
def test_reconcile_bound_pod(tmp_path: Path, tree: Tree) -> None:
    reconcile_tree(tmp_path / "cgroup", tree, PARENT)
    sys_tree(tmp_path)
    hook = make_hook(tmp_path)
    v1 = tree is v1_tree
    pod_patch = hook.reconcile_pod_sandbox(rpod(pod()))
    assert pod_patch is not None and not pod_patch.changes_request()
    assert pod_patch.writes == (HostWrite(
        str(quota_file(tmp_path, tree, PARENT).resolve()), "400000" if v1 else "400000 50000",
        "-1" if v1 else "max 50000", "LSR pod bound by resource-status cpuset 2-3: pod CFS quota unset"),)
    patch = hook.reconcile_container(rctr(pod()))
    assert patch is not None and not patch.changes_request()
    container_cpus = cpus_file(tmp_path, tree, PARENT, CID)
    assert {(w.target, w.old, w.new) for w in patch.writes} == {  # growing values: the widening pass writes them
        (str(container_cpus.resolve()), "0-7" if v1 else "", "2-3"),
        (str(quota_file(tmp_path, tree, PARENT, CID).resolve()), "200000" if v1 else "200000 50000",
         "-1" if v1 else "max 50000"),
    }
    assert container_cpus.read_text() == "2-3"
    assert all(Path(w.target).is_relative_to(tmp_path.resolve()) for w in patch.writes)
    # Second pass: nothing to do. The pod cgroup (0-7) already holds 2-3: never narrowed.
    before = snapshot(tmp_path)
    assert hook.reconcile_pod_sandbox(rpod(pod())) is None
    assert hook.reconcile_container(rctr(pod())) is None
    assert snapshot(tmp_path) == before
    # Drift: someone widened the container to every CPU again.
    container_cpus.write_text("0-7\n")
    repaired = hook.reconcile_container(rctr(pod()))
    assert repaired is not None and repaired.writes == (
        HostWrite(str(container_cpus.resolve()), "0-7", "2-3", "LSR pod bound by resource-status cpuset 2-3"),
    )
    assert repaired.reason == "LSR pod bound by resource-status cpuset 2-3 (reconciled)"
    assert container_cpus.read_text() == "2-3"


@pytest.mark.parametrize("tree", [v1_tree, v2_tree], ids=["v1", "v2"])
def test_reconcile_relearns_bindings_for_the_pools(tmp_path: Path, tree: Tree) -> None:
    """After a restart the binding map is empty; the pod pass (which runs before any container)
    re-learns it, so the LS pool excludes the bound CPUs again."""
    root = tmp_path / "cgroup"
    reconcile_tree(root, tree, PARENT)
    reconcile_tree(root, tree, LS_PARENT, "cafe0002ls")
    sys_tree(tmp_path, "0-7")
    hook = make_hook(tmp_path)  # a fresh hook: nothing learned yet
    ls = pod("LS", None, uid=LS_UID, name="cache", parent=LS_PARENT)
    assert hook.reconcile_pod_sandbox(rpod(ls)) is None
    hook.reconcile_pod_sandbox(rpod(pod()))
    assert hook.bindings == {UID: Binding(QoSClass.LSR, frozenset({2, 3}))}
    patch = hook.reconcile_container(rctr(ls, "cafe0002ls"))
    target = cpus_file(tmp_path, tree, LS_PARENT, "cafe0002ls")
    assert patch is not None and [(w.target, w.new) for w in patch.writes] == [(str(target.resolve()), "0-1,4-7")]
    assert patch.writes[0].reason.startswith("unbound LS pod gets the LS share pool 0-1,4-7 "
                                             "(computed: online 0-7 - LSE/LSR-bound 2-3 - reserved none)")
    # The bound pod goes away: its CPUs return to the LS pool at the next pass.
    hook.post_remove_pod_sandbox(PodContext(Stage.POST_REMOVE_POD_SANDBOX, pod(), CallResult(ok=True)))
    grown = hook.reconcile_container(rctr(ls, "cafe0002ls"))
    assert grown is not None and [(w.old, w.new) for w in grown.writes] == [("0-1,4-7", "0-7")]
    assert hook.reconcile_container(rctr(ls, "cafe0002ls")) is None


def test_reconcile_container_alone_relearns_the_binding(tmp_path: Path) -> None:
    reconcile_tree(tmp_path / "cgroup", v1_tree, PARENT)
    sys_tree(tmp_path)
    hook = make_hook(tmp_path)
    assert hook.reconcile_container(rctr(pod())) is not None
    assert hook.bindings == {UID: Binding(QoSClass.LSR, frozenset({2, 3}))}


@pytest.mark.parametrize("tree", [v1_tree, v2_tree], ids=["v1", "v2"])
def test_reconcile_widens_the_pod_first(tmp_path: Path, tree: Tree) -> None:
    reconcile_tree(tmp_path / "cgroup", tree, PARENT, pod_cpus="0-1")
    sys_tree(tmp_path)
    patch = make_hook(tmp_path).reconcile_container(rctr(pod()))
    assert patch is not None
    pod_cpus, container_cpus = cpus_file(tmp_path, tree, PARENT), cpus_file(tmp_path, tree, PARENT, CID)
    cpus_writes = [(w.target, w.old, w.new) for w in patch.writes if w.target.endswith("cpuset.cpus")]
    assert cpus_writes == [
        (str(pod_cpus.resolve()), "0-1", "0-3"),  # the parent is widened before the child is written
        (str(container_cpus.resolve()), "0-7" if tree is v1_tree else "", "2-3"),
    ]
    assert "widened first" in patch.writes[0].reason
    assert pod_cpus.read_text() == "0-3" and container_cpus.read_text() == "2-3"


def test_reconcile_leaves_an_inherited_v2_pod_cpuset_alone(tmp_path: Path) -> None:
    reconcile_tree(tmp_path / "cgroup", v2_tree, PARENT, pod_cpus="")
    sys_tree(tmp_path)
    patch = make_hook(tmp_path).reconcile_container(rctr(pod()))
    assert patch is not None
    assert cpus_file(tmp_path, v2_tree, PARENT).read_text() == "\n"
    assert cpus_file(tmp_path, v2_tree, PARENT, CID).read_text() == "2-3"


def test_reconcile_without_unset_cpu_quota_writes_only_cpusets(tmp_path: Path) -> None:
    reconcile_tree(tmp_path / "cgroup", v1_tree, PARENT)
    sys_tree(tmp_path)
    hook = make_hook(tmp_path, {"unset_cpu_quota": False})
    assert hook.executor is None  # not needed by the lifecycle stages in this mode
    assert hook.reconcile_pod_sandbox(rpod(pod())) is None
    assert hook.bindings == {UID: Binding(QoSClass.LSR, frozenset({2, 3}))}
    patch = hook.reconcile_container(rctr(pod()))
    assert patch is not None and [Path(w.target).name for w in patch.writes] == ["cpuset.cpus"]
    assert quota_file(tmp_path, v1_tree, PARENT, CID).read_text() == "200000\n"


def test_reconcile_without_cgroup_tree_is_a_hook_error(tmp_path: Path) -> None:
    sys_tree(tmp_path)
    hook = make_hook(tmp_path, {"unset_cpu_quota": False})
    with pytest.raises(HookError, match=r"pod shop/web: no cgroup hierarchy"):
        hook.reconcile_container(rctr(pod()))


@pytest.mark.parametrize("tree", [v1_tree, v2_tree], ids=["v1", "v2"])
def test_reconcile_pod_cgroup_gone(tmp_path: Path, tree: Tree) -> None:
    reconcile_tree(tmp_path / "cgroup", tree, PARENT)
    sys_tree(tmp_path)
    hook = make_hook(tmp_path)
    gone = pod(uid="gone", parent="/kubepods/podgone")
    with pytest.raises(CgroupGoneError, match=r"pod shop/web: cgroup_parent '/kubepods/podgone'.*does not exist"):
        hook.reconcile_pod_sandbox(rpod(gone))
    assert hook.bindings == {}  # its CPUs are not kept out of the pools
    with pytest.raises(CgroupGoneError, match=r"pod shop/web: cgroup_parent '/kubepods/podgone'.*does not exist"):
        hook.reconcile_container(rctr(gone))
    assert hook.bindings == {}
    with pytest.raises(CgroupGoneError, match=r"pod shop/web: container main \(cafe0009gone\).*does not exist"):
        hook.reconcile_container(rctr(pod(), "cafe0009gone"))


@pytest.mark.parametrize(
    "info",
    [pod("LSR", None), pod("LSE", None), pod("SYSTEM", None), pod("LSR", raw=json.dumps({"numaNodeResources": []}))],
    ids=["LSR-unbound", "LSE-unbound", "SYSTEM", "numa-only"],
)
def test_reconcile_not_for_this_hook(tmp_path: Path, info: PodInfo) -> None:
    reconcile_tree(tmp_path / "cgroup", v1_tree, PARENT)
    sys_tree(tmp_path)
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path)
    assert hook.reconcile_pod_sandbox(rpod(info)) is None
    assert hook.reconcile_container(rctr(info)) is None
    assert hook.reconcile_container(rctr(pod(), "")) is None  # no container id: nothing to address
    assert snapshot(tmp_path) == before


def test_reconcile_bad_annotation_is_a_hook_error(tmp_path: Path) -> None:
    reconcile_tree(tmp_path / "cgroup", v1_tree, PARENT)
    sys_tree(tmp_path)
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path)
    bad = pod("LSR", raw=json.dumps({"cpuset": "0-15"}))
    for run in (lambda: hook.reconcile_pod_sandbox(rpod(bad)), lambda: hook.reconcile_container(rctr(bad))):
        with pytest.raises(HookError, match="CPUs 8-15 that are not online"):
            run()
    assert snapshot(tmp_path) == before


def test_sweep_drops_the_bindings_of_gone_pods_their_cpus_return_to_the_pools(tmp_path: Path) -> None:
    v2_tree(tmp_path / "cgroup", PARENT)
    sys_tree(tmp_path, "0-7")
    hook = make_hook(tmp_path, {"reserved_cpus": "0"})
    _bind(hook, "LSR", "2-3", "lsr")
    _bind(hook, "LSE", "4", "lse")
    removed = hook.sweep_orphans(LivePods(frozenset({"lse"})))
    assert removed == ["cpuset binding of pod lsr dropped (pod no longer exists)"]
    assert set(hook.bindings) == {"lse"}
    patch = hook.pre_create_container(ctr(pod("LS", None, uid="ls")))
    assert patch is not None and patch.resources == ResourcesPatch(cpuset_cpus="1-3,5-7")


def test_dry_run_reports_the_reconcile_writes_and_writes_nothing(tmp_path: Path) -> None:
    reconcile_tree(tmp_path / "cgroup", v1_tree, PARENT, pod_cpus="0-1")
    sys_tree(tmp_path)
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path, {"dry_run": True})
    pod_patch = hook.reconcile_pod_sandbox(rpod(pod()))
    assert pod_patch is not None
    assert [(w.old, w.new) for w in pod_patch.writes] == [("400000", "-1 (dry-run, not written)")]
    patch = hook.reconcile_container(rctr(pod()))
    assert patch is not None
    assert sorted((Path(w.target).name, w.old, w.new) for w in patch.writes) == [
        ("cpu.cfs_quota_us", "200000", "-1 (dry-run, not written)"),
        ("cpuset.cpus", "0-1", "0-3 (dry-run, not written)"),
        ("cpuset.cpus", "0-7", "2-3 (dry-run, not written)")]
    assert snapshot(tmp_path) == before


BE_UID = "be-0000-pod"
BE_PARENT = f"/kubepods/besteffort/pod{BE_UID}"


@pytest.mark.parametrize("stage", CONTAINER_STAGES)
@pytest.mark.parametrize(("pod_cpus", "want"), [("1,6", "1,6"), ("0-7", "0-3,5-7"), ("4", "4"), ("", "0-3,5-7")],
                         ids=["suppressed", "wider", "disjoint", "inherited"])
def test_an_unbound_be_container_gets_the_pool_within_its_pod(tmp_path: Path, stage: Stage, pod_cpus: str,
                                                              want: str) -> None:
    """CPU suppression narrowed the BE pod (v1: the tier and every cgroup under it): a
    container given the whole BE pool (all but the LSE-bound 4) would be refused by the
    kernel (a cpuset wider than its parent's: EACCES, runc's create fails). It gets the
    pool within the pod's CPUs; a pod wider than the pool, or an inherited (empty) v2
    value, leaves the pool as it is; a pool disjoint from the pod gives the pod's."""
    reconcile_tree(tmp_path / "cgroup", v1_tree, BE_PARENT, pod_cpus=pod_cpus)
    sys_tree(tmp_path)
    hook = make_hook(tmp_path)
    assert hook.pre_create_container(ctr(pod("LSE", "4", uid="lse"))) is not None  # binds CPU 4
    patch = call(hook, ctr(pod("BE", None, uid=BE_UID, parent=BE_PARENT), stage))
    assert patch is not None and patch.resources == ResourcesPatch(cpuset_cpus=want), patch
    assert ("within its pod cgroup's" in patch.reason) == (want != "0-3,5-7"), patch.reason


@pytest.mark.parametrize(("pod_cpus", "want"), [("1,6", "1,6"), ("0-7", "0-3,5-7")], ids=["suppressed", "wider"])
def test_reconcile_keeps_an_unbound_be_container_within_its_pod(tmp_path: Path, pod_cpus: str, want: str) -> None:
    """The reconciler's pass while BE is suppressed: the container goes within its pod's
    CPUs and the pod is never widened (its parent, the suppressed tier, would refuse it:
    on a node with BE suppressed every pass logged a refusal per BE container, and the
    refusals' back-off held the suppression's own write of that value)."""
    reconcile_tree(tmp_path / "cgroup", v1_tree, BE_PARENT, pod_cpus=pod_cpus)
    sys_tree(tmp_path)
    hook = make_hook(tmp_path)
    assert hook.pre_create_container(ctr(pod("LSE", "4", uid="lse"))) is not None
    patch = hook.reconcile_container(rctr(pod("BE", None, uid=BE_UID, parent=BE_PARENT)))
    assert patch is not None
    assert cpus_file(tmp_path, v1_tree, BE_PARENT).read_text().strip() == pod_cpus  # not widened
    assert cpus_file(tmp_path, v1_tree, BE_PARENT, CID).read_text() == want
    assert [Path(w.target).parent.name for w in patch.writes] == [CID], patch.writes
