"""Resctrl on a fixture resctrl tree (with ``info/``) and fake cgroup v1 / v2 trees:
class groups and schemata from the rules, pod groups from the annotation,
container threads added once and re-added after drift, pod groups removed,
absence said once, and bad input failing with pod/key/value and no write."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from hooks.resctrl import RESCTRL_ANNOTATION, Resctrl
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
    Stage,
    frozen_map,
)

UID = "9a8b7c6d-5e4f-4321-8765-0a1b2c3d4e5f"
CID = "c0ffee0123456789"
QOS = "koordinator.sh/qosClass"
PARENTS = {
    "LSR": f"/kubepods/pod{UID}",
    "LSE": f"/kubepods/pod{UID}",
    "LS": f"/kubepods/burstable/pod{UID}",
    "BE": f"/kubepods/besteffort/pod{UID}",
    "SYSTEM": f"/kubepods/burstable/pod{UID}",
}
ALL_ON = {
    "resourceQOSStrategy": {
        "lsrClass": {"resctrlQOS": {"enable": True}},
        "lsClass": {"resctrlQOS": {"enable": True}},
        "beClass": {"resctrlQOS": {"enable": True}},
    }
}
PIDS = (101, 102, 103)
Tree = Callable[[Path], None]


def _under(root: Path, *parts: str) -> Path:
    path = root.joinpath(*(p.lstrip("/") for p in parts))  # an absolute part must never leave the fixture
    assert path.resolve().is_relative_to(root.resolve()), path
    return path


def make_resctrl(root: Path, *, cbm: str = "fff", min_bits: int = 1, mb: bool = True) -> None:
    (root / "info" / "L3").mkdir(parents=True)
    (root / "info" / "L3" / "cbm_mask").write_text(cbm + "\n")
    (root / "info" / "L3" / "min_cbm_bits").write_text(f"{min_bits}\n")
    text = f"L3:0={cbm};1={cbm}\n"
    if mb:
        (root / "info" / "MB").mkdir()
        (root / "info" / "MB" / "bandwidth_gran").write_text("10\n")
        (root / "info" / "MB" / "min_bandwidth").write_text("10\n")
        text += "MB:0=100;1=100\n"
    (root / "schemata").write_text(text)
    (root / "tasks").write_text("1\n2\n")


def _containers(base: Path, task_file: str) -> None:
    for parent in set(PARENTS.values()):
        directory = _under(base, parent, CID)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / task_file).write_text("".join(f"{p}\n" for p in PIDS))


def v1_tree(root: Path) -> None:
    _containers(root / "cpu", "tasks")
    (root / "memory").mkdir()


def v2_tree(root: Path) -> None:
    root.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    _containers(root, "cgroup.procs")


TREES = [v1_tree, v2_tree]


def task_file(tmp_path: Path, tree: Tree, parent: str) -> Path:
    if tree is v1_tree:
        return _under(tmp_path / "cgroup", "cpu", parent, CID, "tasks")
    return _under(tmp_path / "cgroup", parent, CID, "cgroup.procs")


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): ("<dir>" if p.is_dir() else p.read_text())
            for p in sorted(root.rglob("*"))}


@pytest.fixture(autouse=True)
def kernel_rmdir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """resctrl's rmdir removes a group with its (virtual) files; a fixture
    directory holds real files, so emulate the kernel under the fixture root."""
    original = pathlib.Path.rmdir
    root = (tmp_path / "resctrl").resolve()

    def rmdir(self: Path) -> None:
        if self.resolve().parent == root and self.is_dir():
            for child in self.iterdir():
                if child.is_file():
                    child.unlink()
        original(self)

    monkeypatch.setattr(pathlib.Path, "rmdir", rmdir)
    yield


def make_hook(tmp_path: Path, args: dict[str, Any] | None = None, rules: dict[str, Any] | None = None) -> Resctrl:
    host = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys",
                     resctrl=tmp_path / "resctrl")
    return Resctrl(HookInit("resctrl", args or {}, "hooks[4].args", host, ALL_ON if rules is None else rules))


def pod(qos: str | None, parent: str | None = None, annotation: object = None, uid: str = UID) -> PodInfo:
    annotations = {}
    if annotation is not None:
        annotations[RESCTRL_ANNOTATION] = annotation if isinstance(annotation, str) else json.dumps(annotation)
    return PodInfo(
        PodMeta("api", "prod", uid),
        id="sandbox1",
        labels=frozen_map({} if qos is None or qos == "" else {QOS: qos}),
        annotations=frozen_map(annotations),
        cgroup_parent=parent if parent is not None else PARENTS[qos or "LS"],
    )


def cctx(info: PodInfo, stage: Stage = Stage.POST_START_CONTAINER, ok: bool = True) -> ContainerContext:
    result = CallResult(ok, "OK" if ok else "UNKNOWN") if stage is not Stage.RECONCILE_CONTAINER else None
    return ContainerContext(stage, info, ContainerInfo(ContainerMeta("app"), id=CID), result)


def pctx(info: PodInfo, stage: Stage = Stage.RECONCILE_POD_SANDBOX) -> PodContext:
    result = None if stage is Stage.RECONCILE_POD_SANDBOX else CallResult(True)
    return PodContext(stage, info, result)


def group(tmp_path: Path, name: str) -> Path:
    return tmp_path / "resctrl" / name


def tasks_of(tmp_path: Path, name: str) -> list[int]:
    return [int(t) for t in group(tmp_path, name).joinpath("tasks").read_text().split()]


# --- class groups ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("qos", "name", "schemata"),
    [("LSR", "LSR", "L3:0=fff;1=fff\nMB:0=100;1=100\n"), ("LSE", "LSR", "L3:0=fff;1=fff\nMB:0=100;1=100\n"),
     ("LS", "LS", "L3:0=fff;1=fff\nMB:0=100;1=100\n"),
     # Koordinator default BE range 0-30 %: 12 ways, ceil(3.6) = 4 ways -> f
     ("BE", "BE", "L3:0=f;1=f\nMB:0=100;1=100\n"),
     # no label: the class comes from the kube QoS in the cgroup parent
     ("", "LS", "L3:0=fff;1=fff\nMB:0=100;1=100\n")],
)
@pytest.mark.parametrize("tree", TREES)
def test_class_group_default_rules(tmp_path: Path, tree: Tree, qos: str, name: str, schemata: str) -> None:
    make_resctrl(tmp_path / "resctrl")
    tree(tmp_path / "cgroup")
    hook = make_hook(tmp_path)
    patch = hook.post_start_container(cctx(pod(qos)))
    directory = group(tmp_path, name).resolve()
    assert isinstance(patch, ContainerPatch)
    assert [(w.target, w.old, w.new) for w in patch.writes] == [
        (str(directory), "", "created"),
        (str(directory / "schemata"), "", schemata.strip()),
        (str(directory / "tasks"), "", "101 102 103"),
    ]
    assert all(Path(w.target).is_relative_to(tmp_path.resolve()) for w in patch.writes)
    label = qos or "LS"
    assert patch.reason.startswith(f"{label} pod: class rule resctrlQOS LLC ")
    assert patch.reason.endswith(f"group {name}")
    assert (directory / "schemata").read_text() == schemata
    assert tasks_of(tmp_path, name) == list(PIDS)
    assert sorted(p.name for p in (tmp_path / "resctrl").iterdir()) == sorted({"info", "schemata", "tasks", name})


@pytest.mark.parametrize(
    ("rules", "qos", "schemata"),
    [
        ({"beClass": {"resctrlQOS": {"enable": True, "catRangeEndPercent": 30, "mbaPercent": 50}}}, "BE",
         "L3:0=f;1=f\nMB:0=50;1=50\n"),
        # 10-50 %: ways ceil(1.2)=2 .. ceil(6)=6 -> 0b111100; MBA 25 rounds up to the 10 % granularity
        ({"lsClass": {"resctrlQOS": {"enable": True, "catRangeStartPercent": 10, "catRangeEndPercent": 50,
                                     "mbaPercent": 25}}}, "LS", "L3:0=3c;1=3c\nMB:0=30;1=30\n"),
        ({"lsrClass": {"resctrlQOS": {"enable": True, "catRangeStartPercent": 50, "mbaPercent": 5}}}, "LSR",
         "L3:0=fc0;1=fc0\nMB:0=10;1=10\n"),
    ],
)
def test_class_group_custom_rules(tmp_path: Path, rules: dict[str, Any], qos: str, schemata: str) -> None:
    make_resctrl(tmp_path / "resctrl")
    v1_tree(tmp_path / "cgroup")
    hook = make_hook(tmp_path, rules={"resourceQOSStrategy": rules})
    assert hook.post_start_container(cctx(pod(qos))) is not None
    assert group(tmp_path, qos).joinpath("schemata").read_text() == schemata


def test_class_group_without_mba(tmp_path: Path) -> None:
    make_resctrl(tmp_path / "resctrl", mb=False)
    v2_tree(tmp_path / "cgroup")
    make_hook(tmp_path).post_start_container(cctx(pod("BE")))
    assert group(tmp_path, "BE").joinpath("schemata").read_text() == "L3:0=f;1=f\n"


@pytest.mark.parametrize("tree", TREES)
def test_only_enabled_classes_get_groups(tmp_path: Path, tree: Tree) -> None:
    make_resctrl(tmp_path / "resctrl")
    tree(tmp_path / "cgroup")
    before = snapshot(tmp_path)
    rules = {"resourceQOSStrategy": {"beClass": {"resctrlQOS": {"enable": True}}}}
    hook = make_hook(tmp_path, rules=rules)
    for qos in ("LSR", "LS", "SYSTEM"):
        assert hook.post_start_container(cctx(pod(qos))) is None
        assert hook.reconcile_container(cctx(pod(qos), Stage.RECONCILE_CONTAINER)) is None
        assert hook.reconcile_pod_sandbox(pctx(pod(qos))) is None
    assert snapshot(tmp_path) == before
    assert hook.post_start_container(cctx(pod("BE"))) is not None
    # Koordinator's defaults: every class disabled -> the hook does nothing at all
    defaults = make_hook(tmp_path, rules={})
    assert defaults.post_start_container(cctx(pod("LS"))) is None
    assert not group(tmp_path, "LS").exists()


@pytest.mark.parametrize("tree", TREES)
def test_idempotent(tmp_path: Path, tree: Tree) -> None:
    make_resctrl(tmp_path / "resctrl")
    tree(tmp_path / "cgroup")
    hook = make_hook(tmp_path)
    assert hook.post_start_container(cctx(pod("BE"))) is not None
    before = snapshot(tmp_path)
    assert hook.post_start_container(cctx(pod("BE"))) is None
    assert hook.reconcile_container(cctx(pod("BE"), Stage.RECONCILE_CONTAINER)) is None
    assert hook.reconcile_pod_sandbox(pctx(pod("BE"))) is None
    assert snapshot(tmp_path) == before
    assert tasks_of(tmp_path, "BE") == list(PIDS)  # each thread written once


def test_kernel_shows_full_schemata_no_rewrite(tmp_path: Path) -> None:
    make_resctrl(tmp_path / "resctrl")
    v1_tree(tmp_path / "cgroup")
    hook = make_hook(tmp_path)
    hook.post_start_container(cctx(pod("BE")))
    group(tmp_path, "BE").joinpath("schemata").write_text("    L3:0=00f;1=00f\n    MB:0=100;1=100\n")
    assert hook.reconcile_pod_sandbox(pctx(pod("BE"))) is None


# --- tasks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tree", TREES)
def test_drift_repaired_at_reconcile(tmp_path: Path, tree: Tree) -> None:
    make_resctrl(tmp_path / "resctrl")
    tree(tmp_path / "cgroup")
    hook = make_hook(tmp_path)
    hook.post_start_container(cctx(pod("LS")))
    tasks = group(tmp_path, "LS") / "tasks"
    tasks.write_text("101\n103\n")  # 102 moved out by hand
    patch = hook.reconcile_container(cctx(pod("LS"), Stage.RECONCILE_CONTAINER))
    assert isinstance(patch, ContainerPatch)
    assert [(w.target, w.old, w.new) for w in patch.writes] == [(str(tasks.resolve()), "101 103", "102")]
    assert sorted(tasks_of(tmp_path, "LS")) == list(PIDS)
    assert hook.reconcile_container(cctx(pod("LS"), Stage.RECONCILE_CONTAINER)) is None


@pytest.mark.parametrize("tree", TREES)
def test_new_threads_and_lost_group_repaired(tmp_path: Path, tree: Tree) -> None:
    make_resctrl(tmp_path / "resctrl")
    tree(tmp_path / "cgroup")
    hook = make_hook(tmp_path)
    hook.post_start_container(cctx(pod("BE")))
    task_file(tmp_path, tree, PARENTS["BE"]).write_text("101\n102\n103\n104\n")
    patch = hook.reconcile_container(cctx(pod("BE"), Stage.RECONCILE_CONTAINER))
    assert patch is not None and [w.new for w in patch.writes] == ["104"]
    # a group removed by hand (or a container started while the proxy was down) is rebuilt
    Path.rmdir(group(tmp_path, "BE"))
    patch = hook.reconcile_container(cctx(pod("BE"), Stage.RECONCILE_CONTAINER))
    assert patch is not None and [w.new for w in patch.writes] == ["created", "L3:0=f;1=f\nMB:0=100;1=100",
                                                                   "101 102 103 104"]


def test_v2_prefers_cgroup_threads(tmp_path: Path) -> None:
    make_resctrl(tmp_path / "resctrl")
    v2_tree(tmp_path / "cgroup")
    procs = task_file(tmp_path, v2_tree, PARENTS["BE"])
    procs.parent.joinpath("cgroup.threads").write_text("101\n111\n112\n102\n103\n")
    make_hook(tmp_path).post_start_container(cctx(pod("BE")))
    assert tasks_of(tmp_path, "BE") == [101, 102, 103, 111, 112]  # every thread, not only the leaders


def test_v1_reads_the_cpu_controller(tmp_path: Path) -> None:
    make_resctrl(tmp_path / "resctrl")
    v1_tree(tmp_path / "cgroup")
    other = _under(tmp_path / "cgroup", "memory", PARENTS["BE"], CID)
    other.mkdir(parents=True)
    (other / "tasks").write_text("999\n")
    make_hook(tmp_path).post_start_container(cctx(pod("BE")))
    assert tasks_of(tmp_path, "BE") == list(PIDS)


def test_systemd_driver(tmp_path: Path) -> None:
    make_resctrl(tmp_path / "resctrl")
    (tmp_path / "cgroup").mkdir()
    (tmp_path / "cgroup" / "cgroup.controllers").write_text("cpu\n")
    uid_ = UID.replace("-", "_")
    directory = _under(tmp_path / "cgroup", "kubepods.slice", "kubepods-besteffort.slice",
                       f"kubepods-besteffort-pod{uid_}.slice", f"cri-containerd-{CID}.scope")
    directory.mkdir(parents=True)
    (directory / "cgroup.procs").write_text("7\n")
    hook = make_hook(tmp_path, {"cgroup_driver": "systemd", "cgroup_version": 2})
    hook.post_start_container(cctx(pod("BE", f"kubepods-besteffort-pod{uid_}.slice")))
    assert tasks_of(tmp_path, "BE") == [7]


@pytest.mark.parametrize("tree", TREES)
def test_container_cgroup_missing(tmp_path: Path, tree: Tree) -> None:
    make_resctrl(tmp_path / "resctrl")
    tree(tmp_path / "cgroup")
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path)
    gone = pod("BE", "/kubepods/besteffort/podgone")
    with pytest.raises(HookError, match=r"pod prod/api: container app \(c0ffee0123456789\): its cgroup does not"):
        hook.post_start_container(cctx(gone))
    assert hook.reconcile_container(cctx(gone, Stage.RECONCILE_CONTAINER)) is None  # not running: skipped
    task_file(tmp_path, tree, PARENTS["BE"]).write_text("")  # exited: no threads, nothing created
    assert hook.reconcile_container(cctx(pod("BE"), Stage.RECONCILE_CONTAINER)) is None
    assert snapshot(tmp_path) == {**before, str(task_file(tmp_path, tree, PARENTS["BE"]).relative_to(tmp_path)): ""}


def test_failed_start_does_nothing(tmp_path: Path) -> None:
    make_resctrl(tmp_path / "resctrl")
    v1_tree(tmp_path / "cgroup")
    assert make_hook(tmp_path).post_start_container(cctx(pod("BE"), ok=False)) is None
    assert not group(tmp_path, "BE").exists()


# --- rule changes ---------------------------------------------------------------------------


def test_rule_change_applies_through_a_new_instance(tmp_path: Path) -> None:
    make_resctrl(tmp_path / "resctrl")
    v1_tree(tmp_path / "cgroup")
    make_hook(tmp_path).post_start_container(cctx(pod("BE")))
    schemata = group(tmp_path, "BE") / "schemata"
    assert schemata.read_text() == "L3:0=f;1=f\nMB:0=100;1=100\n"
    wider = {"resourceQOSStrategy": {"beClass": {"resctrlQOS": {"enable": True, "catRangeEndPercent": 50,
                                                                "mbaPercent": 60}}}}
    reloaded = make_hook(tmp_path, rules=wider)
    patch = reloaded.reconcile_pod_sandbox(pctx(pod("BE")))
    assert isinstance(patch, PodPatch)
    assert patch.writes == (HostWrite(str(schemata.resolve()), "L3:0=f;1=f\nMB:0=100;1=100",
                                      "L3:0=3f;1=3f\nMB:0=60;1=60", patch.reason),)
    assert reloaded.reconcile_pod_sandbox(pctx(pod("BE"))) is None
    # disabled now: the existing group is opened up (Koordinator's None config), tasks stay where they are
    disabled = make_hook(tmp_path, rules={})
    patch = disabled.reconcile_pod_sandbox(pctx(pod("BE")))
    assert patch is not None and [w.new for w in patch.writes] == ["L3:0=fff;1=fff\nMB:0=100;1=100"]
    assert "class resctrlQOS disabled" in patch.reason
    assert disabled.reconcile_pod_sandbox(pctx(pod("BE"))) is None
    assert disabled.post_start_container(cctx(pod("BE"))) is None


def test_schemata_drift_repaired(tmp_path: Path) -> None:
    make_resctrl(tmp_path / "resctrl")
    v2_tree(tmp_path / "cgroup")
    hook = make_hook(tmp_path)
    hook.post_start_container(cctx(pod("BE")))
    (group(tmp_path, "BE") / "schemata").write_text("L3:0=fff;1=f\nMB:0=100;1=100\n")
    patch = hook.reconcile_pod_sandbox(pctx(pod("BE")))
    assert patch is not None and [w.new for w in patch.writes] == ["L3:0=f;1=f\nMB:0=100;1=100"]
    # the container stage keeps it true as well
    (group(tmp_path, "BE") / "schemata").write_text("L3:0=fff;1=fff\n")
    patch = hook.reconcile_container(cctx(pod("BE"), Stage.RECONCILE_CONTAINER))
    assert patch is not None and [w.new for w in patch.writes] == ["L3:0=f;1=f\nMB:0=100;1=100"]


def test_reconcile_pod_creates_class_group_lazily(tmp_path: Path) -> None:
    make_resctrl(tmp_path / "resctrl")
    v1_tree(tmp_path / "cgroup")
    patch = make_hook(tmp_path).reconcile_pod_sandbox(pctx(pod("LS")))
    assert patch is not None and [w.new for w in patch.writes] == ["created", "L3:0=fff;1=fff\nMB:0=100;1=100"]
    assert not group(tmp_path, "BE").exists() and not group(tmp_path, "LSR").exists()


# --- pod groups ----------------------------------------------------------------------------------

POD_GROUP = f"koordlet-{UID}"


@pytest.mark.parametrize(
    ("annotation", "schemata"),
    [
        ({}, "L3:0=fff;1=fff\nMB:0=100;1=100\n"),
        ({"llc": {"schemata": {"range": [0, 50]}}, "mb": {"schemata": {"percent": 45}}},
         "L3:0=3f;1=3f\nMB:0=50;1=50\n"),
        ({"llc": {"schemata": {"range": [0, 50]}, "schemataPerCache": [{"cacheID": 1, "range": [50, 100]}]},
          "mb": {"schemataPerCache": [{"cacheID": 0, "percent": 20}]}},
         "L3:0=3f;1=fc0\nMB:0=20;1=100\n"),
        ({"llc": {"schemataPerCache": [{"range": [0, 10]}]}}, "L3:0=3;1=fff\nMB:0=100;1=100\n"),  # cacheID 0
        # extension: raw schemata lines, checked against the host
        ({"llc": {"schemata": "L3:0=ff;1=ff0"}, "mb": {"schemata": "MB:1=30"}}, "L3:0=ff;1=ff0\nMB:0=100;1=30\n"),
    ],
)
@pytest.mark.parametrize("tree", TREES)
def test_pod_group_from_annotation(tmp_path: Path, tree: Tree, annotation: dict[str, Any], schemata: str) -> None:
    make_resctrl(tmp_path / "resctrl")
    tree(tmp_path / "cgroup")
    hook = make_hook(tmp_path, rules={})  # no class rule needed: the annotation alone asks for a group
    info = pod("LS", annotation=annotation)
    patch = hook.post_start_container(cctx(info))
    directory = group(tmp_path, POD_GROUP).resolve()
    assert patch is not None and [w.target for w in patch.writes] == [
        str(directory), str(directory / "schemata"), str(directory / "tasks")]
    assert patch.reason == f"pod annotation {RESCTRL_ANNOTATION}: group {POD_GROUP}"
    assert (directory / "schemata").read_text() == schemata
    assert tasks_of(tmp_path, POD_GROUP) == list(PIDS)
    assert not group(tmp_path, "LS").exists()  # the pod's own group instead of its class group
    assert hook.post_start_container(cctx(info)) is None
    assert hook.reconcile_pod_sandbox(pctx(info)) is None


def test_pod_group_mb_ignored_without_mba(tmp_path: Path) -> None:
    make_resctrl(tmp_path / "resctrl", mb=False)
    v1_tree(tmp_path / "cgroup")
    annotation = {"llc": {"schemata": {"range": [0, 50]}}, "mb": {"schemata": {"percent": 40}}}
    make_hook(tmp_path).post_start_container(cctx(pod("BE", annotation=annotation)))
    assert group(tmp_path, POD_GROUP).joinpath("schemata").read_text() == "L3:0=3f;1=3f\n"


@pytest.mark.parametrize("stage", [Stage.POST_REMOVE_POD_SANDBOX, Stage.POST_STOP_POD_SANDBOX])
@pytest.mark.parametrize("tree", TREES)
def test_pod_group_removed(tmp_path: Path, tree: Tree, stage: Stage) -> None:
    make_resctrl(tmp_path / "resctrl")
    tree(tmp_path / "cgroup")
    hook = make_hook(tmp_path)
    info = pod("LS", annotation={"llc": {"schemata": {"range": [0, 50]}}})
    hook.post_start_container(cctx(info))
    hook.post_start_container(cctx(pod("BE")))  # a class group, which stays
    method = getattr(hook, stage.method_name)
    patch = method(pctx(info, stage))
    directory = group(tmp_path, POD_GROUP).resolve()
    assert isinstance(patch, PodPatch)
    assert patch.writes == (HostWrite(str(directory), "present", "removed", patch.reason),)
    assert not directory.exists() and group(tmp_path, "BE").is_dir()
    assert method(pctx(info, stage)) is None  # already gone
    assert method(pctx(pod("BE"), stage)) is None  # no own group: class groups are never removed
    assert group(tmp_path, "BE").is_dir()
    # after the stop, the reconciler does not bring the group back (its containers are gone)
    assert hook.reconcile_pod_sandbox(pctx(info)) is None
    assert not directory.exists()


def test_stop_that_failed_keeps_the_group(tmp_path: Path) -> None:
    make_resctrl(tmp_path / "resctrl")
    v1_tree(tmp_path / "cgroup")
    hook = make_hook(tmp_path)
    info = pod("LS", annotation={})
    hook.post_start_container(cctx(info))
    failed = PodContext(Stage.POST_STOP_POD_SANDBOX, info, CallResult(False, "UNKNOWN", "boom"))
    assert hook.post_stop_pod_sandbox(failed) is None
    assert group(tmp_path, POD_GROUP).is_dir()


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("{bad", "invalid JSON"),
        ("[]", "annotation: expected a JSON object"),
        (json.dumps({"llc": {"schemata": {"range": [0, 101]}}}), r"llc\.schemata\.range\[1\]: expected an integer"),
        (json.dumps({"llc": {"schemata": {"range": [50, 50]}}}), "need 0 <= start < end <= 100"),
        (json.dumps({"llc": {"schemata": {"range": [-1, 50]}}}), r"llc\.schemata\.range\[0\]"),
        (json.dumps({"llc": {"schemata": {"range": [10]}}}), r"expected \[startPercent, endPercent\]"),
        (json.dumps({"llc": {"schemata": {"range": [0, True]}}}), "expected an integer"),
        (json.dumps({"mb": {"schemata": {"percent": 0}}}), r"mb\.schemata\.percent: expected an integer in \[1, 100\]"),
        (json.dumps({"mb": {"schemata": {"percent": 150}}}), r"mb\.schemata\.percent"),
        (json.dumps({"mb": {"schemata": {"percent": "50"}}}), r"mb\.schemata\.percent"),
        (json.dumps({"llc": {"schemata": "L3:0=f0f"}}), "not contiguous"),
        (json.dumps({"llc": {"schemata": "L3:0=1fff"}}), "outside cbm_mask"),
        (json.dumps({"llc": {"schemata": "L3:7=f"}}), "cache id 7 does not exist"),
        (json.dumps({"llc": {"schemata": "MB:0=50"}}), "only L3 lines belong here"),
        (json.dumps({"llc": {"schemataPerCache": [{"cacheID": 5, "range": [0, 10]}]}}), "cache id 5 does not exist"),
        (json.dumps({"llc": {"schemataPerCache": [{"cacheID": 0, "range": [0, 10]},
                                                  {"cacheID": 0, "range": [0, 20]}]}}), "given twice"),
        (json.dumps({"llc": {"schemataPerCache": {"cacheID": 0}}}), "expected a list"),
        (json.dumps({"llc": {"schemata": {"percent": 50}}}), "unknown key 'percent'"),
        (json.dumps({"l3": {}}), "unknown key 'l3'"),
    ],
)
@pytest.mark.parametrize("tree", TREES)
def test_bad_annotation_fails_without_writes(tmp_path: Path, tree: Tree, raw: str, fragment: str) -> None:
    make_resctrl(tmp_path / "resctrl")
    tree(tmp_path / "cgroup")
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path)
    for call in (lambda: hook.post_start_container(cctx(pod("BE", annotation=raw))),
                 lambda: hook.reconcile_container(cctx(pod("BE", annotation=raw), Stage.RECONCILE_CONTAINER)),
                 lambda: hook.reconcile_pod_sandbox(pctx(pod("BE", annotation=raw)))):
        with pytest.raises(HookError, match=fragment) as exc:
            call()
        message = str(exc.value)
        assert "pod prod/api" in message and RESCTRL_ANNOTATION in message and repr(raw) in message
    assert snapshot(tmp_path) == before


def test_range_too_narrow_for_min_cbm_bits(tmp_path: Path) -> None:
    make_resctrl(tmp_path / "resctrl", min_bits=2)
    v1_tree(tmp_path / "cgroup")
    before = snapshot(tmp_path)
    raw = json.dumps({"llc": {"schemata": {"range": [0, 5]}}})  # ceil(0.6) = 1 way
    with pytest.raises(HookError, match=r"llc\.schemata\.range: .*fewer than min_cbm_bits=2"):
        make_hook(tmp_path, rules={}).post_start_container(cctx(pod("BE", annotation=raw)))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("uid", ["../../x", "a/b", "..", "a..b", "info", "a b", "x\ny"])
def test_pod_uid_confined(tmp_path: Path, uid: str) -> None:
    make_resctrl(tmp_path / "resctrl")
    v1_tree(tmp_path / "cgroup")
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path, {"pod_group_prefix": "koordlet-"} if uid != "info" else {"pod_group_prefix": "i"})
    info = pod("BE", annotation={}, uid=uid if uid != "info" else "nfo")
    for call in (lambda: hook.post_start_container(cctx(info)),
                 lambda: hook.reconcile_pod_sandbox(pctx(info)),
                 lambda: hook.post_remove_pod_sandbox(pctx(info, Stage.POST_REMOVE_POD_SANDBOX)),
                 lambda: hook.post_stop_pod_sandbox(pctx(info, Stage.POST_STOP_POD_SANDBOX))):
        with pytest.raises(HookError, match=r"pod prod/api: pod uid .*not allowed"):
            call()
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "x").exists()


def test_pod_uid_cannot_name_a_class_group(tmp_path: Path) -> None:
    make_resctrl(tmp_path / "resctrl")
    v1_tree(tmp_path / "cgroup")
    hook = make_hook(tmp_path, {"class_group_prefix": "koordlet-"})
    with pytest.raises(HookError, match="would name a class group"):
        hook.post_start_container(cctx(pod("BE", annotation={}, uid="BE")))
    assert not group(tmp_path, "koordlet-BE").exists()


@pytest.mark.parametrize("tree", TREES)
def test_dotdot_cgroup_parent_refused(tmp_path: Path, tree: Tree) -> None:
    make_resctrl(tmp_path / "resctrl")
    tree(tmp_path / "cgroup")
    before = snapshot(tmp_path)
    with pytest.raises(HookError, match=r"pod prod/api: cgroup_parent '/kubepods/besteffort/\.\./\.\./\.\./x'"):
        make_hook(tmp_path).post_start_container(cctx(pod("BE", "/kubepods/besteffort/../../../x")))
    assert snapshot(tmp_path) == before


def test_group_symlink_escape_refused(tmp_path: Path) -> None:
    make_resctrl(tmp_path / "resctrl")
    v1_tree(tmp_path / "cgroup")
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "resctrl" / "BE").symlink_to(outside)
    with pytest.raises(HookError, match=r"pod prod/api: .*outside the root"):
        make_hook(tmp_path).post_start_container(cctx(pod("BE")))
    assert list(outside.iterdir()) == []


def test_bad_qos_label(tmp_path: Path) -> None:
    make_resctrl(tmp_path / "resctrl")
    v1_tree(tmp_path / "cgroup")
    with pytest.raises(HookError, match=r"pod prod/api: label koordinator\.sh/qosClass='be'"):
        make_hook(tmp_path).post_start_container(cctx(pod("be", PARENTS["BE"])))


# --- resctrl absent ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["no-root", "no-info"])
@pytest.mark.parametrize("tree", TREES)
def test_absent_says_so_once_and_does_nothing(tmp_path: Path, tree: Tree, layout: str) -> None:
    tree(tmp_path / "cgroup")
    if layout == "no-info":
        (tmp_path / "resctrl").mkdir()
        (tmp_path / "resctrl" / "schemata").write_text("L3:0=fff\n")
    before = snapshot(tmp_path)
    with capture_logs() as logs:
        hook = make_hook(tmp_path)
        for annotation in (None, {}, "{bad"):
            info = pod("BE", annotation=annotation)
            assert hook.post_start_container(cctx(info)) is None
            assert hook.reconcile_container(cctx(info, Stage.RECONCILE_CONTAINER)) is None
            assert hook.reconcile_pod_sandbox(pctx(info)) is None
            assert hook.post_stop_pod_sandbox(pctx(info, Stage.POST_STOP_POD_SANDBOX)) is None
            assert hook.post_remove_pod_sandbox(pctx(info, Stage.POST_REMOVE_POD_SANDBOX)) is None
    absent = [e for e in logs if e["event"] == "resctrl_absent"]
    assert len(absent) == 1 and absent[0]["log_level"] == "warning"
    assert absent[0]["root"] == str(tmp_path / "resctrl")
    assert snapshot(tmp_path) == before


# --- configuration ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "key_path", "value"),
    [
        ({"cgroup_drivr": "systemd"}, "hooks[4].args.cgroup_drivr", "systemd"),
        ({"cgroup_driver": "x"}, "hooks[4].args.cgroup_driver", "x"),
        ({"cgroup_version": 3}, "hooks[4].args.cgroup_version", 3),
        ({"pod_group_prefix": ""}, "hooks[4].args.pod_group_prefix", ""),
        ({"pod_group_prefix": "../"}, "hooks[4].args.pod_group_prefix", "../"),
        ({"class_group_prefix": 1}, "hooks[4].args.class_group_prefix", 1),
    ],
)
def test_config_errors(tmp_path: Path, args: dict[str, Any], key_path: str, value: object) -> None:
    make_resctrl(tmp_path / "resctrl")
    v1_tree(tmp_path / "cgroup")
    with pytest.raises(HookConfigError) as exc:
        make_hook(tmp_path, args)
    assert exc.value.key_path == key_path and exc.value.value == value


def test_rule_the_host_cannot_take_fails_the_load(tmp_path: Path) -> None:
    make_resctrl(tmp_path / "resctrl", min_bits=2)
    v1_tree(tmp_path / "cgroup")
    rules = {"resourceQOSStrategy": {"beClass": {"resctrlQOS": {"enable": True, "catRangeEndPercent": 5}}}}
    with pytest.raises(HookConfigError, match="min_cbm_bits") as exc:
        make_hook(tmp_path, rules=rules)
    assert exc.value.key_path == "rules.resourceQOSStrategy.beClass.resctrlQOS" and exc.value.value == (0, 5)
    rules["resourceQOSStrategy"]["beClass"]["resctrlQOS"]["enable"] = False
    make_hook(tmp_path, rules=rules)  # a disabled class is not checked


def test_class_group_prefix(tmp_path: Path) -> None:
    make_resctrl(tmp_path / "resctrl")
    v1_tree(tmp_path / "cgroup")
    hook = make_hook(tmp_path, {"class_group_prefix": "koordlet-", "pod_group_prefix": "proxy-pod-"})
    hook.post_start_container(cctx(pod("LSE")))
    hook.post_start_container(cctx(pod("BE", annotation={})))
    assert group(tmp_path, "koordlet-LSR").is_dir() and group(tmp_path, f"proxy-pod-{UID}").is_dir()


def test_missing_cgroup_root_is_a_config_error(tmp_path: Path) -> None:
    make_resctrl(tmp_path / "resctrl")
    with pytest.raises(HookConfigError, match="no cgroup hierarchy"):
        make_hook(tmp_path)


# --- orphan sweep ---------------------------------------------------------------------


def test_sweep_removes_pod_groups_of_gone_pods_only(tmp_path: Path) -> None:
    """``sweep_orphans``: a ``koordlet-<uid>`` group whose pod is not live goes; the live
    pod's group, the class groups and resctrl's own directories stay."""
    make_resctrl(tmp_path / "resctrl")
    v2_tree(tmp_path / "cgroup")
    hook = make_hook(tmp_path)
    assert hook.post_start_container(cctx(pod("LS", annotation={"llc": {"schemata": {"range": [0, 50]}}}))) is not None
    gone = "0f0e0d0c-0b0a-4908-8706-050403020100"
    for name in (f"koordlet-{gone}", "LSR", "BE"):
        make_group = group(tmp_path, name)
        make_group.mkdir()
        (make_group / "tasks").write_text("")
    (tmp_path / "resctrl" / "mon_groups").mkdir()
    before = sorted(p.name for p in (tmp_path / "resctrl").iterdir())

    removed = hook.sweep_orphans(LivePods(frozenset({UID})))

    assert removed == [f"{group(tmp_path, 'koordlet-' + gone)}: pod {gone} no longer exists"]
    assert sorted(p.name for p in (tmp_path / "resctrl").iterdir()) == [
        n for n in before if n != f"koordlet-{gone}"]
    assert group(tmp_path, f"koordlet-{UID}").is_dir()
    assert hook.sweep_orphans(LivePods(frozenset({UID}))) == []
    # Nothing live at all: the last pod group goes too; class groups stay.
    assert len(hook.sweep_orphans(LivePods(frozenset()))) == 1
    assert group(tmp_path, "LSR").is_dir() and group(tmp_path, "BE").is_dir()


def test_sweep_without_resctrl_does_nothing(tmp_path: Path) -> None:
    v2_tree(tmp_path / "cgroup")
    hook = make_hook(tmp_path)
    assert hook.sweep_orphans(LivePods(frozenset())) == []


# --- dry run ---------------------------------------------------------------------------------


def test_dry_run_reports_group_schemata_and_tasks_and_writes_nothing(tmp_path: Path) -> None:
    """``dry_run: true`` (the NodeSLO preview builds hooks so): a missing class group is
    reported as created with its schemata and threads, a drifted one as the values that
    would change; no file or directory appears or changes."""
    make_resctrl(tmp_path / "resctrl")
    v1_tree(tmp_path / "cgroup")
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path, {"dry_run": True})
    patch = hook.reconcile_container(cctx(pod("BE"), Stage.RECONCILE_CONTAINER))
    assert patch is not None and patch.reason.startswith("dry-run: ")
    assert [(Path(w.target).name, w.old, w.new) for w in patch.writes] == [
        ("BE", "", "created (dry-run, not written)"),
        ("schemata", "", "L3:0=f;1=f\nMB:0=100;1=100 (dry-run, not written)"),
        ("tasks", "", "101 102 103 (dry-run, not written)")]
    assert snapshot(tmp_path) == before and not group(tmp_path, "BE").exists()

    make_hook(tmp_path).post_start_container(cctx(pod("BE")))  # the group, made for real
    (group(tmp_path, "BE") / "tasks").write_text("101\n")
    (group(tmp_path, "BE") / "schemata").write_text("L3:0=fff;1=fff\nMB:0=100;1=100\n")
    before = snapshot(tmp_path)
    drift = make_hook(tmp_path, {"dry_run": True}).reconcile_container(cctx(pod("BE"), Stage.RECONCILE_CONTAINER))
    assert drift is not None
    assert [(Path(w.target).name, w.old, w.new) for w in drift.writes] == [
        ("schemata", "L3:0=fff;1=fff\nMB:0=100;1=100", "L3:0=f;1=f\nMB:0=100;1=100 (dry-run, not written)"),
        ("tasks", "101", "102 103 (dry-run, not written)")]
    assert snapshot(tmp_path) == before
