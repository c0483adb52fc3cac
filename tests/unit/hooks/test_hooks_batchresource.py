"""BatchResource on fixture cgroup v1 and v2 trees: pod cgroup writes, CRI
patches, and bad input (annotations, cgroup parents) failing without writes."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hooks.annotations import BATCH_CPU, BATCH_MEMORY, EXTENDED_RESOURCE_SPEC
from hooks.batchresource import BatchResource, milli_cpu_to_quota, milli_cpu_to_shares
from hooks.cgroups import CgroupGoneError, shares_to_weight
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerInfo,
    ContainerMeta,
    HookConfigError,
    HookError,
    HookInit,
    HostRoots,
    HostWrite,
    PodContext,
    PodInfo,
    PodMeta,
    Resources,
    ResourcesPatch,
    Stage,
    frozen_map,
)

UID = "6c8e5d2a-1b3f-4e7a-9c0d-112233445566"
PARENT = f"/kubepods/besteffort/pod{UID}"
SYSTEMD_PARENT = f"kubepods-besteffort-pod{UID.replace('-', '_')}.slice"
SYSTEMD_DIR = f"kubepods.slice/kubepods-besteffort.slice/{SYSTEMD_PARENT}"
GI = 2**30
SPEC = {
    "containers": {
        "main": {
            "requests": {BATCH_CPU: 1000, BATCH_MEMORY: "1Gi"},
            "limits": {BATCH_CPU: "2000", BATCH_MEMORY: "1Gi"},
        },
        "side": {"requests": {BATCH_CPU: "500"}, "limits": {BATCH_CPU: 500, BATCH_MEMORY: "512Mi"}},
    }
}
V1 = {"cpu": {"cpu.shares": "2", "cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"},
      "memory": {"memory.limit_in_bytes": "9223372036854771712"}}
V2 = {"cpu.weight": "1", "cpu.max": "max 100000", "memory.max": "max"}


def _under(root: Path, *parts: str) -> Path:
    path = root.joinpath(*(p.lstrip("/") for p in parts))  # never let an absolute part leave the fixture
    assert path.is_relative_to(root), path
    return path


def v1_tree(root: Path, pod_dir: str) -> None:
    for controller, files in V1.items():
        _under(root, controller, pod_dir).mkdir(parents=True)
        for name, value in files.items():
            _under(root, controller, pod_dir, name).write_text(value + "\n")
    (root / "unified").mkdir()


def v2_tree(root: Path, pod_dir: str) -> None:
    _under(root, pod_dir).mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for name, value in V2.items():
        _under(root, pod_dir, name).write_text(value + "\n")


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def make_hook(tmp_path: Path, args: dict[str, Any] | None = None, rules: dict[str, Any] | None = None) -> BatchResource:
    host = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys",
                     resctrl=tmp_path / "resctrl")
    return BatchResource(HookInit("batch", args or {}, "hooks[0].args", host, rules or {}))


def pod(spec: object = SPEC, labels: dict[str, str] | None = None, parent: str = PARENT) -> PodInfo:
    annotations = {} if spec is None else {EXTENDED_RESOURCE_SPEC: spec if isinstance(spec, str) else json.dumps(spec)}
    return PodInfo(
        PodMeta("job", "batch", UID),
        labels=frozen_map({"koordinator.sh/qosClass": "BE"} if labels is None else labels),
        annotations=frozen_map(annotations),
        cgroup_parent=parent,
    )


def pod_ctx(info: PodInfo) -> PodContext:
    return PodContext(Stage.PRE_RUN_POD_SANDBOX, info)


def ctr_ctx(info: PodInfo, name: str, stage: Stage = Stage.PRE_CREATE_CONTAINER) -> ContainerContext:
    return ContainerContext(stage, info, ContainerInfo(ContainerMeta(name)))


def test_formulas() -> None:
    assert milli_cpu_to_shares(1000) == 1024
    assert milli_cpu_to_shares(0) == 2 and milli_cpu_to_shares(1) == 2
    assert milli_cpu_to_shares(10**9) == 262144
    assert milli_cpu_to_quota(2500) == 250000
    assert milli_cpu_to_quota(5) == 1000
    assert milli_cpu_to_quota(None) == -1 and milli_cpu_to_quota(0) == -1


def test_pod_cgroup_v1(tmp_path: Path) -> None:
    v1_tree(tmp_path / "cgroup", PARENT)
    hook = make_hook(tmp_path)
    patch = hook.pre_run_pod_sandbox(pod_ctx(pod()))
    assert patch is not None
    assert patch.resources == ResourcesPatch(cpu_shares=1536, cpu_quota=250000, memory_limit_in_bytes=GI + GI // 2)
    cg = tmp_path / "cgroup"
    assert (cg / "cpu" / PARENT.lstrip("/") / "cpu.shares").read_text() == "1536"
    assert (cg / "cpu" / PARENT.lstrip("/") / "cpu.cfs_quota_us").read_text() == "250000"
    assert (cg / "memory" / PARENT.lstrip("/") / "memory.limit_in_bytes").read_text() == str(GI + GI // 2)
    assert [w.changed for w in hook.last_writes] == [True, True, True]
    cpu, memory = _under(cg.resolve(), "cpu", PARENT), _under(cg.resolve(), "memory", PARENT)
    assert patch.reason == "BE pod batch resources"
    assert patch.writes == (
        HostWrite(str(cpu / "cpu.shares"), "2", "1536", "BE pod batch resources: batch-cpu requests"),
        HostWrite(str(cpu / "cpu.cfs_quota_us"), "-1", "250000", "BE pod batch resources: batch-cpu limits"),
        HostWrite(str(memory / "memory.limit_in_bytes"), "9223372036854771712", str(GI + GI // 2),
                  "BE pod batch resources: batch-memory limits"),
    )
    again = hook.pre_run_pod_sandbox(pod_ctx(pod()))  # idempotent: nothing rewritten, nothing reported
    assert again is not None and again.resources == patch.resources
    assert again.writes == () and again.reason == "BE pod batch resources (pod cgroup already set)"
    assert [w.changed for w in hook.last_writes] == [False, False, False]


def test_pod_cgroup_v2(tmp_path: Path) -> None:
    v2_tree(tmp_path / "cgroup", PARENT)
    hook = make_hook(tmp_path)
    patch = hook.pre_run_pod_sandbox(pod_ctx(pod()))
    assert patch is not None
    d = tmp_path / "cgroup" / PARENT.lstrip("/")
    assert (d / "cpu.weight").read_text() == "59"  # 1 + (1536-2)*9999 // 262142
    assert (d / "cpu.max").read_text() == "250000 100000"
    assert (d / "memory.max").read_text() == str(GI + GI // 2)
    assert [(Path(w.target).name, w.old, w.new) for w in patch.writes] == [
        ("cpu.weight", "1", "59"), ("cpu.max", "max 100000", "250000 100000"), ("memory.max", "max", str(GI + GI // 2))
    ]
    assert all(Path(w.target).is_relative_to(tmp_path.resolve()) for w in patch.writes)
    again = hook.pre_run_pod_sandbox(pod_ctx(pod()))
    assert again is not None and again.writes == ()


def test_pod_cgroup_v2_systemd(tmp_path: Path) -> None:
    v2_tree(tmp_path / "cgroup", SYSTEMD_DIR)
    hook = make_hook(tmp_path, {"cgroup_driver": "systemd", "cgroup_version": 2})
    hook.pre_run_pod_sandbox(pod_ctx(pod(parent=SYSTEMD_PARENT)))
    assert (tmp_path / "cgroup" / SYSTEMD_DIR / "cpu.max").read_text() == "250000 100000"


def test_missing_limits_mean_unlimited(tmp_path: Path) -> None:
    v2_tree(tmp_path / "cgroup", PARENT)
    spec = {"containers": {"main": {"requests": {BATCH_CPU: 1000}, "limits": {BATCH_CPU: 1000}},
                           "side": {"requests": {BATCH_CPU: 1000}}}}
    patch = make_hook(tmp_path).pre_run_pod_sandbox(pod_ctx(pod(spec)))
    assert patch is not None and patch.resources == ResourcesPatch(cpu_shares=2048, cpu_quota=-1)
    assert [Path(w.target).name for w in patch.writes] == ["cpu.weight"]  # only what changed is reported
    d = tmp_path / "cgroup" / PARENT.lstrip("/")
    assert (d / "cpu.max").read_text() == "max 100000\n"  # unchanged: not rewritten
    assert (d / "memory.max").read_text() == "max\n"


def test_cfs_quota_suppress_policy_unsets_quota(tmp_path: Path) -> None:
    v1_tree(tmp_path / "cgroup", PARENT)
    rules = {"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressPolicy": "cfsQuota"}}
    hook = make_hook(tmp_path, rules=rules)
    patch = hook.pre_run_pod_sandbox(pod_ctx(pod()))
    assert patch is not None and patch.resources is not None and patch.resources.cpu_quota == -1
    c = hook.pre_create_container(ctr_ctx(pod(), "main"))
    assert c is not None and c.resources is not None and c.resources.cpu_quota == -1


@pytest.mark.parametrize("stage", [Stage.PRE_CREATE_CONTAINER, Stage.PRE_UPDATE_CONTAINER_RESOURCES])
def test_container_patches(tmp_path: Path, stage: Stage) -> None:
    v1_tree(tmp_path / "cgroup", PARENT)
    hook = make_hook(tmp_path)
    call = hook.pre_create_container if stage is Stage.PRE_CREATE_CONTAINER else hook.pre_update_container_resources
    main = call(ctr_ctx(pod(), "main", stage))
    assert main is not None
    assert main.resources == ResourcesPatch(cpu_shares=1024, cpu_quota=200000, memory_limit_in_bytes=GI)
    side = call(ctr_ctx(pod(), "side", stage))
    assert side is not None and side.resources == ResourcesPatch(cpu_shares=512, cpu_quota=50000,
                                                                  memory_limit_in_bytes=512 * 2**20)
    assert call(ctr_ctx(pod(), "other", stage)) is None
    assert snapshot(tmp_path / "cgroup")[f"cpu{PARENT}/cpu.shares"] == "2\n"  # containers: CRI only


def test_container_without_limits(tmp_path: Path) -> None:
    v1_tree(tmp_path / "cgroup", PARENT)
    spec = {"containers": {"main": {"requests": {BATCH_CPU: 250}}}}
    patch = make_hook(tmp_path).pre_create_container(ctr_ctx(pod(spec), "main"))
    assert patch is not None and patch.resources == ResourcesPatch(cpu_shares=256, cpu_quota=-1)


@pytest.mark.parametrize(
    "info",
    [
        pod(labels={"koordinator.sh/qosClass": "LS"}),
        pod(labels={}, parent="/kubepods/burstable/pod1"),
        pod(spec=None),
        pod(spec={"containers": {"main": {"requests": {"cpu": "1"}}}}),
        pod(spec={"containers": {}}),
    ],
    ids=["LS-label", "burstable", "no-annotation", "no-batch-resources", "no-containers"],
)
def test_not_for_this_hook(tmp_path: Path, info: PodInfo) -> None:
    v1_tree(tmp_path / "cgroup", PARENT)
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path)
    assert hook.pre_run_pod_sandbox(pod_ctx(info)) is None
    assert hook.pre_create_container(ctr_ctx(info, "main")) is None
    assert snapshot(tmp_path) == before


def test_besteffort_without_label_is_be(tmp_path: Path) -> None:
    v1_tree(tmp_path / "cgroup", PARENT)
    assert make_hook(tmp_path).pre_run_pod_sandbox(pod_ctx(pod(labels={}))) is not None


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("{not json", "invalid JSON"),
        (json.dumps({"containers": {"main": {"limits": {BATCH_CPU: -1000}}}}), "negative"),
        (json.dumps({"containers": {"main": {"limits": {BATCH_MEMORY: [1]}}}}), "got list"),
        (json.dumps({"containers": "main"}), "expected an object"),
    ],
)
@pytest.mark.parametrize("tree", [v1_tree, v2_tree])
def test_bad_annotation_writes_nothing(
    tmp_path: Path, raw: str, fragment: str, tree: Callable[[Path, str], None]
) -> None:
    tree(tmp_path / "cgroup", PARENT)
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path)
    for call in (lambda: hook.pre_run_pod_sandbox(pod_ctx(pod(raw))),
                 lambda: hook.pre_create_container(ctr_ctx(pod(raw), "main"))):
        with pytest.raises(HookError, match=fragment) as info:
            call()
        message = str(info.value)
        assert "pod batch/job" in message and EXTENDED_RESOURCE_SPEC in message and repr(raw) in message
    assert snapshot(tmp_path) == before


def test_bad_qos_label(tmp_path: Path) -> None:
    v1_tree(tmp_path / "cgroup", PARENT)
    with pytest.raises(HookError, match=r"label koordinator\.sh/qosClass='Batch'"):
        make_hook(tmp_path).pre_run_pod_sandbox(pod_ctx(pod(labels={"koordinator.sh/qosClass": "Batch"})))


@pytest.mark.parametrize("tree", [v1_tree, v2_tree])
def test_dotdot_parent_refused(tmp_path: Path, tree: Callable[[Path, str], None]) -> None:
    tree(tmp_path / "cgroup", PARENT)
    before = snapshot(tmp_path)
    bad = "/kubepods/besteffort/../../../../outside"
    with pytest.raises(HookError, match=r"pod batch/job: cgroup_parent '/kubepods/besteffort/\.\./") as info:
        make_hook(tmp_path).pre_run_pod_sandbox(pod_ctx(pod(parent=bad)))
    assert "'..'" in str(info.value)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("tree", [v1_tree, v2_tree])
def test_symlink_escape_refused(tmp_path: Path, tree: Callable[[Path, str], None]) -> None:
    tree(tmp_path / "cgroup", PARENT)
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("cpu.weight", "cpu.shares", "cpu.max", "cpu.cfs_quota_us"):
        (outside / name).write_text("1\n")
    link_base = tmp_path / "cgroup" / ("cpu" if tree is v1_tree else "") / "kubepods"
    (link_base / "evil").symlink_to(outside)
    before = snapshot(tmp_path)
    with pytest.raises(HookError, match=r"cgroup_parent '/kubepods/evil'.*outside the root"):
        make_hook(tmp_path).pre_run_pod_sandbox(pod_ctx(pod(parent="/kubepods/evil")))
    assert snapshot(tmp_path) == before


def test_pod_cgroup_gone(tmp_path: Path) -> None:
    v2_tree(tmp_path / "cgroup", PARENT)
    with pytest.raises(CgroupGoneError, match="does not exist"):
        make_hook(tmp_path).pre_run_pod_sandbox(pod_ctx(pod(parent="/kubepods/besteffort/podgone")))


@pytest.mark.parametrize(
    ("args", "rules", "key_path", "value"),
    [
        ({"cgroup_drivr": "systemd"}, {}, "hooks[0].args.cgroup_drivr", "systemd"),
        ({"cgroup_driver": "upstart"}, {}, "hooks[0].args.cgroup_driver", "upstart"),
        ({"cgroup_version": 3}, {}, "hooks[0].args.cgroup_version", 3),
        ({}, {"policies": {"cpuPolicy": "x"}}, "rules.policies.cpuPolicy", "x"),
    ],
)
def test_config_errors(
    tmp_path: Path, args: dict[str, Any], rules: dict[str, Any], key_path: str, value: object
) -> None:
    v1_tree(tmp_path / "cgroup", PARENT)
    with pytest.raises(HookConfigError) as info:
        make_hook(tmp_path, args, rules)
    assert info.value.key_path == key_path and info.value.value == value


def test_missing_cgroup_root_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(HookConfigError, match="no cgroup hierarchy"):
        make_hook(tmp_path)


# --- reconciler -----------------------------------------------------------------------

MAIN_ID = "c0ffee01main"
SIDE_ID = "c0ffee02side"


def add_containers(root: Path, pod_dir: str, *ids: str) -> None:
    """Container cgroups under a pod as kubelet/containerd leave a BE container (no limits)."""
    v2 = (root / "cgroup.controllers").exists()
    for cid in ids:
        if v2:
            _under(root, pod_dir, cid).mkdir()
            for name, value in V2.items():
                _under(root, pod_dir, cid, name).write_text(value + "\n")
            continue
        for controller, files in V1.items():
            _under(root, controller, pod_dir, cid).mkdir()
            for name, value in files.items():
                _under(root, controller, pod_dir, cid, name).write_text(value + "\n")


def trees_with_containers(tmp_path: Path, tree: Callable[[Path, str], None]) -> Path:
    cg = tmp_path / "cgroup"
    tree(cg, PARENT)
    add_containers(cg, PARENT, MAIN_ID, SIDE_ID)
    return cg


def rpod(info: PodInfo) -> PodContext:
    return PodContext(Stage.RECONCILE_POD_SANDBOX, replace(info, id="sb-job"))


def rctr(info: PodInfo, name: str, cid: str, quota: int = 0) -> ContainerContext:
    container = ContainerInfo(ContainerMeta(name), id=cid, resources=Resources(cpu_quota=quota, cpu_period=100_000))
    return ContainerContext(Stage.RECONCILE_CONTAINER, replace(info, id="sb-job"), container)


def cfile(cg: Path, tree: Callable[[Path, str], None], resource: str, *cid: str) -> Path:
    """The fixture file of a logical resource ("shares", "quota", "memory") in the pod or a container."""
    v1 = {"shares": ("cpu", "cpu.shares"), "quota": ("cpu", "cpu.cfs_quota_us"),
          "memory": ("memory", "memory.limit_in_bytes")}
    v2 = {"shares": "cpu.weight", "quota": "cpu.max", "memory": "memory.max"}
    if tree is v1_tree:
        controller, name = v1[resource]
        path = _under(cg, controller, PARENT, *cid, name)
    else:
        path = _under(cg, PARENT, *cid, v2[resource])
    assert path.resolve().is_relative_to(cg.resolve()) and path.is_file(), path
    return path


@pytest.mark.parametrize("tree", [v1_tree, v2_tree], ids=["v1", "v2"])
def test_reconcile_writes_once_then_repairs_drift(tmp_path: Path, tree: Callable[[Path, str], None]) -> None:
    cg = trees_with_containers(tmp_path, tree)
    hook = make_hook(tmp_path)
    v1 = tree is v1_tree
    # First pass: the pod as at PreRunPodSandbox, then each container's own values.
    first = hook.reconcile_pod_sandbox(rpod(pod()))
    assert first is not None and not first.changes_request()
    assert [Path(w.target).name for w in first.writes] == (
        ["cpu.shares", "cpu.cfs_quota_us", "memory.limit_in_bytes"] if v1 else ["cpu.weight", "cpu.max", "memory.max"]
    )
    main = hook.reconcile_container(rctr(pod(), "main", MAIN_ID))
    assert main is not None and not main.changes_request()
    expected = {
        "shares": "1024" if v1 else str(shares_to_weight(1024)),
        "quota": "200000" if v1 else "200000 100000",
        "memory": str(GI),
    }
    assert {Path(w.target) for w in main.writes} == {cfile(cg, tree, r, MAIN_ID).resolve() for r in expected}
    for resource, value in expected.items():
        assert cfile(cg, tree, resource, MAIN_ID).read_text() == value
    assert all(Path(w.target).is_relative_to(tmp_path.resolve()) for w in first.writes + main.writes)
    side = hook.reconcile_container(rctr(pod(), "side", SIDE_ID))
    assert side is not None and cfile(cg, tree, "memory", SIDE_ID).read_text() == str(512 * 2**20)
    # Second pass: nothing drifted, nothing written or reported.
    before = snapshot(cg)
    assert hook.reconcile_pod_sandbox(rpod(pod())) is None
    assert hook.reconcile_container(rctr(pod(), "main", MAIN_ID)) is None
    assert hook.reconcile_container(rctr(pod(), "side", SIDE_ID)) is None
    assert snapshot(cg) == before
    # A manual write to a container file and to a pod file: repaired, reported old -> new.
    drifted = cfile(cg, tree, "shares", MAIN_ID)
    drifted.write_text("4096\n" if v1 else "500\n")
    cfile(cg, tree, "memory").write_text("max\n" if not v1 else "-1\n")
    repaired_pod = hook.reconcile_pod_sandbox(rpod(pod()))
    assert repaired_pod is not None and [(Path(w.target).name, w.old, w.new) for w in repaired_pod.writes] == [
        (cfile(cg, tree, "memory").name, "max" if not v1 else "-1", str(GI + GI // 2))
    ]
    repaired = hook.reconcile_container(rctr(pod(), "main", MAIN_ID))
    assert repaired is not None
    assert repaired.writes == (
        HostWrite(str(drifted.resolve()), "4096" if v1 else "500", expected["shares"],
                  "BE container batch resources: batch-cpu requests"),
    )
    assert drifted.read_text() == expected["shares"]
    assert hook.reconcile_container(rctr(pod(), "main", MAIN_ID)) is None


def test_reconcile_systemd_v2(tmp_path: Path) -> None:
    cg = tmp_path / "cgroup"
    v2_tree(cg, SYSTEMD_DIR)
    scope = f"cri-containerd-{MAIN_ID}.scope"
    _under(cg, SYSTEMD_DIR, scope).mkdir()
    for name, value in V2.items():
        _under(cg, SYSTEMD_DIR, scope, name).write_text(value + "\n")
    hook = make_hook(tmp_path, {"cgroup_driver": "systemd", "cgroup_version": 2})
    patch = hook.reconcile_container(rctr(pod(parent=SYSTEMD_PARENT), "main", MAIN_ID))
    assert patch is not None
    assert _under(cg, SYSTEMD_DIR, scope, "cpu.max").read_text() == "200000 100000"
    assert _under(cg, SYSTEMD_DIR, "cpu.max").read_text() == "250000 100000"  # the pod, in the same leveled update


@pytest.mark.parametrize("tree", [v1_tree, v2_tree], ids=["v1", "v2"])
def test_reconcile_quota_as_forwarded(tmp_path: Path, tree: Callable[[Path, str], None]) -> None:
    """A later hook (cpu-normalization) scaled the quota in the forwarded request: that value is kept,
    so the two hooks never rewrite each other; without a forwarded quota the computed one is written."""
    cg = trees_with_containers(tmp_path, tree)
    hook = make_hook(tmp_path)
    patch = hook.reconcile_container(rctr(pod(), "main", MAIN_ID, quota=166_667))
    assert patch is not None
    quota = [w for w in patch.writes if Path(w.target) == cfile(cg, tree, "quota", MAIN_ID).resolve()]
    assert len(quota) == 1 and quota[0].new.split()[0] == "166667"
    assert quota[0].reason == ("BE container batch resources: batch-cpu limits (200000) "
                               "as forwarded to the runtime (166667)")
    assert hook.reconcile_container(rctr(pod(), "main", MAIN_ID, quota=166_667)) is None
    again = hook.reconcile_container(rctr(pod(), "main", MAIN_ID))  # nothing forwarded: the computed value
    assert again is not None and [w.new.split()[0] for w in again.writes] == ["200000"]


def test_reconcile_applies_rule_change_to_unlimited(tmp_path: Path) -> None:
    cg = trees_with_containers(tmp_path, v1_tree)
    make_hook(tmp_path).reconcile_container(rctr(pod(), "main", MAIN_ID, quota=200_000))
    rules = {"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressPolicy": "cfsQuota"}}
    hook = make_hook(tmp_path, rules=rules)  # a reload builds a new hook with the new rules
    pod_patch = hook.reconcile_pod_sandbox(rpod(pod()))
    assert pod_patch is not None and [(w.old, w.new) for w in pod_patch.writes] == [("250000", "-1")]
    patch = hook.reconcile_container(rctr(pod(), "main", MAIN_ID, quota=200_000))
    assert patch is not None and [(w.old, w.new) for w in patch.writes] == [("200000", "-1")]
    assert cfile(cg, v1_tree, "quota", MAIN_ID).read_text() == "-1"


def test_reconcile_container_narrows_children_before_the_pod(tmp_path: Path) -> None:
    """The pod's and the container's quota shrink: the container is written first (v1 refuses a
    parent quota below a child's)."""
    cg = trees_with_containers(tmp_path, v1_tree)
    cfile(cg, v1_tree, "quota").write_text("900000\n")
    cfile(cg, v1_tree, "quota", MAIN_ID).write_text("800000\n")
    patch = make_hook(tmp_path).reconcile_container(rctr(pod(), "main", MAIN_ID))
    assert patch is not None
    quotas = [(w.target, w.old, w.new) for w in patch.writes if w.target.endswith("cpu.cfs_quota_us")]
    assert quotas == [
        (str(cfile(cg, v1_tree, "quota", MAIN_ID).resolve()), "800000", "200000"),
        (str(cfile(cg, v1_tree, "quota").resolve()), "900000", "250000"),
    ]


@pytest.mark.parametrize("tree", [v1_tree, v2_tree], ids=["v1", "v2"])
def test_reconcile_cgroup_gone_is_a_hook_error(tmp_path: Path, tree: Callable[[Path, str], None]) -> None:
    trees_with_containers(tmp_path, tree)
    hook = make_hook(tmp_path)
    gone = pod(parent="/kubepods/besteffort/podvanished")
    with pytest.raises(HookError, match=r"pod batch/job: cgroup_parent '/kubepods/besteffort/podvanished'.*"
                                        r"does not exist") as info:
        hook.reconcile_pod_sandbox(rpod(gone))
    assert isinstance(info.value, CgroupGoneError)
    with pytest.raises(CgroupGoneError, match=r"pod batch/job: container main \(c0ffee03gone\).*does not exist"):
        hook.reconcile_container(rctr(pod(), "main", "c0ffee03gone"))


@pytest.mark.parametrize(
    "ctx",
    [
        rctr(pod(labels={"koordinator.sh/qosClass": "LS"}), "main", MAIN_ID),
        rctr(pod(spec=None), "main", MAIN_ID),
        rctr(pod(), "other", MAIN_ID),
        rctr(pod(), "main", ""),
    ],
    ids=["LS", "no-annotation", "container-without-batch", "no-container-id"],
)
def test_reconcile_not_for_this_hook(tmp_path: Path, ctx: ContainerContext) -> None:
    cg = trees_with_containers(tmp_path, v1_tree)
    before = snapshot(cg)
    hook = make_hook(tmp_path)
    assert hook.reconcile_container(ctx) is None
    if ctx.container.meta.name == "main" and ctx.container.id:
        assert hook.reconcile_pod_sandbox(PodContext(Stage.RECONCILE_POD_SANDBOX, ctx.pod)) is None
    assert snapshot(cg) == before


def test_idle_pod_group_keeps_kernel_weight(tmp_path: Path) -> None:
    """group-identity's cpu.idle=1 owns an idle group's weight: the kernel refuses
    cpu.shares there (EINVAL), so batch-resource leaves shares alone and sets the rest."""
    v1_tree(tmp_path / "cgroup", PARENT)
    cpu = tmp_path / "cgroup" / "cpu" / PARENT.lstrip("/")
    (cpu / "cpu.idle").write_text("1\n")
    (cpu / "cpu.shares").write_text("3\n")
    hook = make_hook(tmp_path)
    patch = hook.reconcile_pod_sandbox(pod_ctx(pod()))
    assert (cpu / "cpu.shares").read_text().strip() == "3"
    assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "250000"
    assert patch is not None
    assert [Path(w.target).name for w in patch.writes] == ["cpu.cfs_quota_us", "memory.limit_in_bytes"]


def test_dry_run_reports_the_rule_change_and_writes_nothing(tmp_path: Path) -> None:
    """``dry_run: true`` (the NodeSLO preview builds hooks so): the cfsQuota suppress
    policy's -1 quotas are reported as planned writes, once, and no file changes."""
    cg = trees_with_containers(tmp_path, v1_tree)
    make_hook(tmp_path).reconcile_container(rctr(pod(), "main", MAIN_ID, quota=200_000))
    before = snapshot(cg)
    rules = {"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressPolicy": "cfsQuota"}}
    hook = make_hook(tmp_path, {"dry_run": True}, rules=rules)
    pod_patch = hook.reconcile_pod_sandbox(rpod(pod()))
    assert pod_patch is not None and pod_patch.reason.startswith("dry-run: ")
    assert [(w.old, w.new) for w in pod_patch.writes] == [("250000", "-1 (dry-run, not written)")]
    patch = hook.reconcile_container(rctr(pod(), "main", MAIN_ID, quota=200_000))
    assert patch is not None
    # the pod's quota was reported with the pod: only the container's is new here
    assert [(Path(w.target).name, w.old, w.new) for w in patch.writes] == [
        ("cpu.cfs_quota_us", "200000", "-1 (dry-run, not written)")]
    assert snapshot(cg) == before
    assert hook.reconcile_pod_sandbox(rpod(pod())) is None, "reported once per planned value"
