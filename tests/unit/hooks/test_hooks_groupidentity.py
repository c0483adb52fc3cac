"""GroupIdentity on fixture cgroup v1 and v2 trees: bvt values per class from
the rules, the cpu.idle fallback detected from the tree, the LS pod annotation,
and bad input failing with pod/key/value and writing nothing."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hooks.cgroups import CgroupGoneError, NotSupportedError
from hooks.groupidentity import CPU_QOS_ANNOTATION, GroupIdentity, Mode, parse_cpu_qos
from runtimeproxy.hookapi import (
    HookConfigError,
    HookError,
    HookInit,
    HostRoots,
    HostWrite,
    PodContext,
    PodInfo,
    PodMeta,
    PodPatch,
    Stage,
    frozen_map,
)

UID = "9a8b7c6d-5e4f-4321-8765-0a1b2c3d4e5f"
QOS = "koordinator.sh/qosClass"
BE_PARENT = f"/kubepods/besteffort/pod{UID}"
LS_PARENT = f"/kubepods/burstable/pod{UID}"
LSR_PARENT = f"/kubepods/pod{UID}"
ENABLED = {
    "resourceQOSStrategy": {
        "lsrClass": {"cpuQOS": {"enable": True}},
        "lsClass": {"cpuQOS": {"enable": True}},
        "beClass": {"cpuQOS": {"enable": True}},
    }
}
BOTH = ("cpu.bvt_warp_ns", "cpu.idle")  # Anolis kernels with 5.15+ have both
Tree = Callable[[Path, tuple[str, ...]], None]


def _under(root: Path, *parts: str) -> Path:
    path = root.joinpath(*(p.lstrip("/") for p in parts))  # an absolute part must never leave the fixture
    assert path.resolve().is_relative_to(root.resolve()), path
    return path


def _cgroups(base: Path, files: tuple[str, ...]) -> None:
    for parent in ("kubepods", "kubepods/burstable", "kubepods/besteffort"):
        for pod_dir in (parent, f"{parent}/pod{UID}"):
            directory = _under(base, pod_dir)
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "cpu.shares").write_text("1024\n")
            for name in files:
                (directory / name).write_text("0\n")


def v1_tree(root: Path, files: tuple[str, ...]) -> None:
    _cgroups(root / "cpu", files)
    (root / "memory").mkdir()


def v2_tree(root: Path, files: tuple[str, ...]) -> None:
    root.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    _cgroups(root, files)


def pod_file(tmp_path: Path, tree: Tree, parent: str, name: str) -> Path:
    return _under(tmp_path / "cgroup", "cpu" if tree is v1_tree else "", parent, name)


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def make_hook(
    tmp_path: Path, args: dict[str, Any] | None = None, rules: dict[str, Any] | None = None
) -> GroupIdentity:
    host = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys",
                     resctrl=tmp_path / "resctrl")
    return GroupIdentity(HookInit("gi", args or {}, "hooks[2].args", host, ENABLED if rules is None else rules))


def ctx(qos: str | None, parent: str, annotation: object = None) -> PodContext:
    annotations = {}
    if annotation is not None:
        annotations[CPU_QOS_ANNOTATION] = annotation if isinstance(annotation, str) else json.dumps(annotation)
    info = PodInfo(
        PodMeta("api", "prod", UID),
        labels=frozen_map({} if qos is None else {QOS: qos}),
        annotations=frozen_map(annotations),
        cgroup_parent=parent,
    )
    return PodContext(Stage.PRE_RUN_POD_SANDBOX, info)


TREES = [v1_tree, v2_tree]


# --- bvt --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("qos", "parent", "label", "value"),
    [("LSR", LSR_PARENT, "LSR", "2"), ("LSE", LSR_PARENT, "LSE", "2"), ("LS", LS_PARENT, "LS", "2"),
     ("BE", BE_PARENT, "BE", "-1"), ("SYSTEM", LS_PARENT, "SYSTEM", "0"),
     # without the label, the class comes from the kube QoS in the cgroup parent
     (None, LSR_PARENT, "LSR", "2"), (None, LS_PARENT, "LS", "2"), (None, BE_PARENT, "BE", "-1")],
)
@pytest.mark.parametrize("tree", TREES)
def test_bvt_per_class(tmp_path: Path, tree: Tree, qos: str | None, parent: str, label: str, value: str) -> None:
    tree(tmp_path / "cgroup", BOTH)
    hook = make_hook(tmp_path)
    patch = hook.pre_run_pod_sandbox(ctx(qos, parent))
    target = pod_file(tmp_path, tree, parent, "cpu.bvt_warp_ns")
    probe = target.parent.parent.resolve()
    why = (f"{label} pod: class cpuQOS disabled, group identity 0" if qos == "SYSTEM"
           else f"{label} pod: class rule cpuQOS.groupIdentity {value}")
    reason = f"{why}; kernel has cpu.bvt_warp_ns (detected in {probe})"
    if value == "0":  # already 0: nothing written, nothing reported
        assert patch == PodPatch(reason=f"{reason} (already set)")
    else:
        assert patch == PodPatch(reason=reason, writes=(HostWrite(str(target.resolve()), "0", value, reason),))
    assert target.read_text().strip() == value
    assert pod_file(tmp_path, tree, parent, "cpu.idle").read_text() == "0\n"  # bvt wins over the fallback
    assert hook.detection is not None and hook.detection.mode is Mode.BVT


@pytest.mark.parametrize("tree", TREES)
def test_idempotent(tmp_path: Path, tree: Tree) -> None:
    tree(tmp_path / "cgroup", ("cpu.bvt_warp_ns",))
    hook = make_hook(tmp_path)
    first = hook.pre_run_pod_sandbox(ctx("BE", BE_PARENT))
    assert first is not None and len(first.writes) == 1
    before = snapshot(tmp_path)
    again = hook.pre_run_pod_sandbox(ctx("BE", BE_PARENT))
    assert again is not None and again.writes == () and again.reason.endswith("(already set)")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("tree", TREES)
def test_disabled_class_gets_zero(tmp_path: Path, tree: Tree) -> None:
    tree(tmp_path / "cgroup", ("cpu.bvt_warp_ns",))
    target = pod_file(tmp_path, tree, BE_PARENT, "cpu.bvt_warp_ns")
    target.write_text("-1\n")  # left over from an earlier rule
    rules = {"resourceQOSStrategy": {"lsClass": {"cpuQOS": {"enable": True}}}}
    patch = make_hook(tmp_path, rules=rules).pre_run_pod_sandbox(ctx("BE", BE_PARENT))
    assert patch is not None and [(w.old, w.new) for w in patch.writes] == [("-1", "0")]
    assert patch.reason.startswith("BE pod: class cpuQOS disabled, group identity 0;")


def test_rule_values_come_from_the_rules(tmp_path: Path) -> None:
    v1_tree(tmp_path / "cgroup", ("cpu.bvt_warp_ns",))
    rules = {"resourceQOSStrategy": {"lsClass": {"cpuQOS": {"enable": True, "groupIdentity": 1}}}}
    patch = make_hook(tmp_path, rules=rules).pre_run_pod_sandbox(ctx("LS", LS_PARENT))
    assert patch is not None and [w.new for w in patch.writes] == ["1"]


@pytest.mark.parametrize(
    "rules",
    [{}, {"resourceQOSStrategy": {"beClass": {"cpuQOS": {"enable": True}}}, "policies": {"cpuPolicy": "coreSched"}}],
    ids=["koordinator-defaults-all-disabled", "core-sched-policy"],
)
@pytest.mark.parametrize("tree", TREES)
def test_rules_off_means_no_hook(tmp_path: Path, tree: Tree, rules: dict[str, Any]) -> None:
    tree(tmp_path / "cgroup", BOTH)
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path, rules=rules)
    assert not hook.rules_enabled
    for qos, parent in (("LSR", LSR_PARENT), ("LS", LS_PARENT), ("BE", BE_PARENT)):
        assert hook.pre_run_pod_sandbox(ctx(qos, parent)) is None
    assert hook.detection is None  # nothing to do, nothing probed
    assert snapshot(tmp_path) == before


# --- cpu.idle fallback and detection ---------------------------------------------------


@pytest.mark.parametrize("tree", TREES)
def test_idle_fallback_for_be(tmp_path: Path, tree: Tree) -> None:
    tree(tmp_path / "cgroup", ("cpu.idle",))
    hook = make_hook(tmp_path)
    patch = hook.pre_run_pod_sandbox(ctx("BE", BE_PARENT))
    target = pod_file(tmp_path, tree, BE_PARENT, "cpu.idle")
    probe = target.parent.parent.resolve()
    reason = (f"BE pod: class rule cpuQOS.groupIdentity -1: cpu.idle 1; "
              f"no cpu.bvt_warp_ns, cpu.idle fallback (detected in {probe})")
    assert patch == PodPatch(reason=reason, writes=(HostWrite(str(target.resolve()), "0", "1", reason),))
    assert target.read_text() == "1"
    assert hook.detection is not None and hook.detection.mode is Mode.IDLE
    before = snapshot(tmp_path)
    for qos, parent in (("LS", LS_PARENT), ("LSR", LSR_PARENT)):  # others untouched
        assert hook.pre_run_pod_sandbox(ctx(qos, parent)) is None
    again = hook.pre_run_pod_sandbox(ctx("BE", BE_PARENT))
    assert again is not None and again.writes == ()
    assert snapshot(tmp_path) == before


def test_idle_fallback_be_with_nonnegative_value_is_not_idle(tmp_path: Path) -> None:
    """Clearing cpu.idle also restores the weight the kernel reset (issue 28 item 5): a
    BestEffort pod's kubelet weight, cpu.shares 2 = cpu.weight 1 on v2."""
    v2_tree(tmp_path / "cgroup", ("cpu.idle", "cpu.weight"))
    target = pod_file(tmp_path, v2_tree, BE_PARENT, "cpu.idle")
    target.write_text("1\n")
    target.with_name("cpu.weight").write_text("100\n")  # what the kernel shows after the clear
    rules = {"resourceQOSStrategy": {"beClass": {"cpuQOS": {"enable": True, "groupIdentity": 0}}}}
    patch = make_hook(tmp_path, rules=rules).pre_run_pod_sandbox(ctx("BE", BE_PARENT))
    assert patch is not None and [(w.target.rsplit("/", 1)[1], w.old, w.new) for w in patch.writes] == [
        ("cpu.idle", "1", "0"), ("cpu.weight", "100", "1")]


@pytest.mark.parametrize("tree", TREES)
def test_idle_fallback_can_be_turned_off(tmp_path: Path, tree: Tree) -> None:
    tree(tmp_path / "cgroup", ("cpu.idle",))
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path, {"idle_fallback": False})
    assert hook.pre_run_pod_sandbox(ctx("BE", BE_PARENT)) is None
    assert hook.detection is not None and hook.detection.mode is Mode.NONE
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("tree", TREES)
def test_neither_file_means_nothing(tmp_path: Path, tree: Tree) -> None:
    tree(tmp_path / "cgroup", ())
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path)
    for qos, parent in (("BE", BE_PARENT), ("LS", LS_PARENT)):
        assert hook.pre_run_pod_sandbox(ctx(qos, parent)) is None
    assert hook.detection is not None and hook.detection.mode is Mode.NONE
    assert "neither" in hook.detection.describe()
    assert snapshot(tmp_path) == before


def test_detection_happens_once(tmp_path: Path) -> None:
    v1_tree(tmp_path / "cgroup", ("cpu.bvt_warp_ns",))
    hook = make_hook(tmp_path)
    assert hook.pre_run_pod_sandbox(ctx("BE", BE_PARENT)) is not None
    first = hook.detection
    # Files vanishing later do not change the cached mode: the write then fails loudly instead.
    pod_file(tmp_path, v1_tree, LS_PARENT, "cpu.bvt_warp_ns").unlink()
    with pytest.raises(NotSupportedError, match=r"pod prod/api: .*cpu\.bvt_warp_ns is not supported"):
        hook.pre_run_pod_sandbox(ctx("LS", LS_PARENT))
    assert hook.detection is first


def test_missing_parent_is_not_cached(tmp_path: Path) -> None:
    v2_tree(tmp_path / "cgroup", ("cpu.bvt_warp_ns",))
    hook = make_hook(tmp_path)
    with pytest.raises(CgroupGoneError, match=r"pod prod/api: .*does not exist"):
        hook.pre_run_pod_sandbox(ctx("BE", f"/kubepods/nowhere/pod{UID}"))
    assert hook.detection is None
    assert hook.pre_run_pod_sandbox(ctx("BE", BE_PARENT)) is not None


def test_pod_cgroup_gone(tmp_path: Path) -> None:
    v1_tree(tmp_path / "cgroup", ("cpu.bvt_warp_ns",))
    with pytest.raises(CgroupGoneError, match="does not exist"):
        make_hook(tmp_path).pre_run_pod_sandbox(ctx("BE", "/kubepods/besteffort/podgone"))


# --- the LS pod annotation ----------------------------------------------------------


@pytest.mark.parametrize(
    ("annotation", "value", "why"),
    [
        ({"enable": True, "groupIdentity": -1}, "-1", "sets group identity -1"),
        ({"enable": True, "groupIdentity": 0}, "0", "sets group identity 0"),
        ({"enable": True}, "2", "enables cpuQOS: LS class value 2"),
        ({"enable": False, "groupIdentity": 2}, "0", "disables cpuQOS: group identity 0"),
        ({}, "0", "disables cpuQOS"),
    ],
)
@pytest.mark.parametrize("tree", TREES)
def test_ls_annotation(tmp_path: Path, tree: Tree, annotation: dict[str, Any], value: str, why: str) -> None:
    tree(tmp_path / "cgroup", ("cpu.bvt_warp_ns",))
    patch = make_hook(tmp_path).pre_run_pod_sandbox(ctx("LS", LS_PARENT, annotation))
    assert patch is not None and f"LS pod annotation {CPU_QOS_ANNOTATION} {why}" in patch.reason
    assert pod_file(tmp_path, tree, LS_PARENT, "cpu.bvt_warp_ns").read_text().strip() == value


def test_ls_annotation_enables_without_rules(tmp_path: Path) -> None:
    v1_tree(tmp_path / "cgroup", ("cpu.bvt_warp_ns",))
    hook = make_hook(tmp_path, rules={})
    patch = hook.pre_run_pod_sandbox(ctx("LS", LS_PARENT, {"enable": True, "groupIdentity": 1}))
    assert patch is not None and [w.new for w in patch.writes] == ["1"]
    assert hook.pre_run_pod_sandbox(ctx("LS", LS_PARENT)) is None  # no annotation: rules say nothing


def test_annotation_ignored_for_other_classes(tmp_path: Path) -> None:
    v1_tree(tmp_path / "cgroup", ("cpu.bvt_warp_ns",))
    hook = make_hook(tmp_path)
    patch = hook.pre_run_pod_sandbox(ctx("BE", BE_PARENT, "{not even json"))
    assert patch is not None and [w.new for w in patch.writes] == ["-1"]


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("{bad", "invalid JSON"),
        ("[]", "expected a JSON object"),
        (json.dumps({"enable": "yes"}), "enable: expected true or false"),
        (json.dumps({"enable": True, "groupIdentity": 3}), r"groupIdentity: expected an integer in \[-1, 2\]"),
        (json.dumps({"enable": True, "groupIdentity": True}), "groupIdentity: expected an integer"),
        (json.dumps({"enable": True, "groupIdentity": "2"}), "groupIdentity: expected an integer"),
        (json.dumps({"enabel": True}), "unknown key 'enabel'"),
    ],
)
@pytest.mark.parametrize("tree", TREES)
def test_bad_annotation_fails_without_writes(tmp_path: Path, tree: Tree, raw: str, fragment: str) -> None:
    tree(tmp_path / "cgroup", BOTH)
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path)
    with pytest.raises(HookError, match=fragment) as exc:
        hook.pre_run_pod_sandbox(ctx("LS", LS_PARENT, raw))
    message = str(exc.value)
    assert "pod prod/api" in message and CPU_QOS_ANNOTATION in message and repr(raw) in message
    assert snapshot(tmp_path) == before


def test_parse_cpu_qos_accepts_koordinator_fields() -> None:
    assert parse_cpu_qos('{"enable": true, "groupIdentity": -1, "schedIdle": 1, "coreExpeller": false}') == (True, -1)
    assert parse_cpu_qos("{}") == (False, None)


# --- other bad input ----------------------------------------------------------------


def test_bad_qos_label(tmp_path: Path) -> None:
    v1_tree(tmp_path / "cgroup", BOTH)
    with pytest.raises(HookError, match=r"pod prod/api: label koordinator\.sh/qosClass='be'"):
        make_hook(tmp_path).pre_run_pod_sandbox(ctx("be", BE_PARENT))


@pytest.mark.parametrize("tree", TREES)
def test_dotdot_cgroup_parent_refused(tmp_path: Path, tree: Tree) -> None:
    tree(tmp_path / "cgroup", BOTH)
    before = snapshot(tmp_path)
    with pytest.raises(HookError, match=r"pod prod/api: cgroup_parent '/kubepods/besteffort/\.\./\.\./\.\./x'"):
        make_hook(tmp_path).pre_run_pod_sandbox(ctx("BE", "/kubepods/besteffort/../../../x"))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("tree", TREES)
def test_symlink_escape_refused(tmp_path: Path, tree: Tree) -> None:
    tree(tmp_path / "cgroup", BOTH)
    outside = tmp_path / "outside"
    (outside / "pod").mkdir(parents=True)
    for name in BOTH:
        (outside / name).write_text("0\n")
        (outside / "pod" / name).write_text("0\n")
    (pod_file(tmp_path, tree, "/kubepods", "evil")).symlink_to(outside)
    before = snapshot(tmp_path)
    with pytest.raises(HookError, match=r"pod prod/api: cgroup_parent '/kubepods/evil/pod'.*outside the root"):
        make_hook(tmp_path).pre_run_pod_sandbox(ctx("BE", "/kubepods/evil/pod"))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    ("args", "rules", "key_path", "value"),
    [
        ({"idle_fallbak": True}, None, "hooks[2].args.idle_fallbak", True),
        ({"idle_fallback": "yes"}, None, "hooks[2].args.idle_fallback", "yes"),
        ({"cgroup_driver": "x"}, None, "hooks[2].args.cgroup_driver", "x"),
        ({"cgroup_version": 0}, None, "hooks[2].args.cgroup_version", 0),
        ({}, {"resourceQOSStrategy": {"beClass": {"cpuQOS": {"groupIdentity": -2}}}},
         "rules.resourceQOSStrategy.beClass.cpuQOS.groupIdentity", -2),
    ],
)
def test_config_errors(
    tmp_path: Path, args: dict[str, Any], rules: dict[str, Any] | None, key_path: str, value: object
) -> None:
    v1_tree(tmp_path / "cgroup", BOTH)
    with pytest.raises(HookConfigError) as exc:
        make_hook(tmp_path, args, rules)
    assert exc.value.key_path == key_path and exc.value.value == value


def test_missing_cgroup_root_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(HookConfigError, match="no cgroup hierarchy"):
        make_hook(tmp_path)


# --- reconciler -----------------------------------------------------------------------


def rctx(qos: str | None, parent: str, annotation: object = None) -> PodContext:
    return replace(ctx(qos, parent, annotation), stage=Stage.RECONCILE_POD_SANDBOX)


@pytest.mark.parametrize("tree", TREES, ids=["v1", "v2"])
def test_reconcile_bvt_writes_once_then_repairs_drift(tmp_path: Path, tree: Tree) -> None:
    tree(tmp_path / "cgroup", ("cpu.bvt_warp_ns",))
    hook = make_hook(tmp_path)
    target = pod_file(tmp_path, tree, BE_PARENT, "cpu.bvt_warp_ns")
    probe = target.parent.parent.resolve()
    reason = f"BE pod: class rule cpuQOS.groupIdentity -1; kernel has cpu.bvt_warp_ns (detected in {probe})"
    first = hook.reconcile_pod_sandbox(rctx("BE", BE_PARENT))
    assert first == PodPatch(reason=f"{reason} (reconciled)",
                             writes=(HostWrite(str(target.resolve()), "0", "-1", reason),))
    assert not first.changes_request() and target.read_text() == "-1"
    assert Path(first.writes[0].target).is_relative_to(tmp_path.resolve())
    before = snapshot(tmp_path)
    assert hook.reconcile_pod_sandbox(rctx("BE", BE_PARENT)) is None  # nothing drifted: nothing reported
    assert snapshot(tmp_path) == before
    target.write_text("2\n")  # a manual write
    repaired = hook.reconcile_pod_sandbox(rctx("BE", BE_PARENT))
    assert repaired is not None and repaired.writes == (HostWrite(str(target.resolve()), "2", "-1", reason),)
    assert target.read_text() == "-1"
    # LS pods are kept at their class value the same way.
    ls = pod_file(tmp_path, tree, LS_PARENT, "cpu.bvt_warp_ns")
    ls_patch = hook.reconcile_pod_sandbox(rctx("LS", LS_PARENT))
    assert ls_patch is not None and [(w.old, w.new) for w in ls_patch.writes] == [("0", "2")]
    assert ls.read_text() == "2"


@pytest.mark.parametrize("tree", TREES, ids=["v1", "v2"])
def test_reconcile_idle_fallback(tmp_path: Path, tree: Tree) -> None:
    tree(tmp_path / "cgroup", ("cpu.idle",))
    hook = make_hook(tmp_path)
    target = pod_file(tmp_path, tree, BE_PARENT, "cpu.idle")
    first = hook.reconcile_pod_sandbox(rctx("BE", BE_PARENT))
    assert first is not None and [(w.target, w.old, w.new) for w in first.writes] == [
        (str(target.resolve()), "0", "1")
    ]
    assert hook.reconcile_pod_sandbox(rctx("BE", BE_PARENT)) is None
    target.write_text("0\n")
    repaired = hook.reconcile_pod_sandbox(rctx("BE", BE_PARENT))
    assert repaired is not None and [(w.old, w.new) for w in repaired.writes] == [("0", "1")]
    assert hook.reconcile_pod_sandbox(rctx("LS", LS_PARENT)) is None  # fallback: only BE pods


def test_reconcile_applies_a_rule_change(tmp_path: Path) -> None:
    v1_tree(tmp_path / "cgroup", ("cpu.bvt_warp_ns",))
    assert make_hook(tmp_path).reconcile_pod_sandbox(rctx("LS", LS_PARENT)) is not None
    rules = {"resourceQOSStrategy": {"lsClass": {"cpuQOS": {"enable": True, "groupIdentity": 1}}}}
    reloaded = make_hook(tmp_path, rules=rules)  # a reload builds the hook anew with the new rules
    patch = reloaded.reconcile_pod_sandbox(rctx("LS", LS_PARENT))
    assert patch is not None and [(w.old, w.new) for w in patch.writes] == [("2", "1")]


@pytest.mark.parametrize("tree", TREES, ids=["v1", "v2"])
def test_reconcile_pod_cgroup_gone(tmp_path: Path, tree: Tree) -> None:
    tree(tmp_path / "cgroup", ("cpu.bvt_warp_ns",))
    hook = make_hook(tmp_path)
    assert hook.reconcile_pod_sandbox(rctx("BE", BE_PARENT)) is not None
    with pytest.raises(CgroupGoneError, match=r"pod prod/api: cgroup_parent '/kubepods/besteffort/podgone'.*"
                                              r"does not exist"):
        hook.reconcile_pod_sandbox(rctx("BE", "/kubepods/besteffort/podgone"))


@pytest.mark.parametrize("tree", TREES, ids=["v1", "v2"])
def test_reconcile_nothing_to_do(tmp_path: Path, tree: Tree) -> None:
    tree(tmp_path / "cgroup", BOTH)
    before = snapshot(tmp_path)
    off = make_hook(tmp_path, rules={})
    assert off.reconcile_pod_sandbox(rctx("BE", BE_PARENT)) is None  # rules say nothing
    assert make_hook(tmp_path).reconcile_pod_sandbox(rctx("SYSTEM", LS_PARENT)) is None  # already 0
    assert snapshot(tmp_path) == before


def test_reconcile_bad_annotation_is_a_hook_error(tmp_path: Path) -> None:
    v1_tree(tmp_path / "cgroup", BOTH)
    before = snapshot(tmp_path)
    with pytest.raises(HookError, match=r"pod prod/api: annotation koordinator\.sh/cpuQOS='\{bad'"):
        make_hook(tmp_path).reconcile_pod_sandbox(rctx("LS", LS_PARENT, "{bad"))
    assert snapshot(tmp_path) == before


def test_rules_turned_off_later_reset_to_zero(tmp_path: Path) -> None:
    """Issue 14, item 10: the rules in force change under a running hook (the NodeSLO)."""
    from runtimeproxy.hookapi import RulesProvider

    v1_tree(tmp_path / "cgroup", ("cpu.bvt_warp_ns",))
    provider = RulesProvider(ENABLED)
    host = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys",
                     resctrl=tmp_path / "resctrl")
    hook = GroupIdentity(HookInit("gi", {}, "hooks[2].args", host, ENABLED, current_rules=provider.current))
    first = hook.reconcile_pod_sandbox(rctx("BE", BE_PARENT))
    assert first is not None and [w.new for w in first.writes] == ["-1"]
    off = {"resourceQOSStrategy": {c: {"cpuQOS": {"enable": False}} for c in ("lsrClass", "lsClass", "beClass")}}
    provider.set_overlay("nodeslo", off)
    assert not hook.rules_enabled
    reset = hook.reconcile_pod_sandbox(rctx("BE", BE_PARENT))
    assert reset is not None and [(w.old, w.new) for w in reset.writes] == [("-1", "0")]
    assert "turned off by the rules: reset to 0" in reset.reason
    assert hook.reconcile_pod_sandbox(rctx("BE", BE_PARENT)) is None  # stays 0, nothing more to write


@pytest.mark.parametrize("tree", TREES)
def test_dry_run_reports_the_planned_write_once_and_writes_nothing(tmp_path: Path, tree: Tree) -> None:
    """``dry_run: true`` (the NodeSLO preview builds hooks so): the value is decided as
    usual, reported as a planned write (hooks.dryrun's shape), and no file changes."""
    tree(tmp_path / "cgroup", ("cpu.bvt_warp_ns",))
    before = snapshot(tmp_path)
    hook = make_hook(tmp_path, {"dry_run": True})
    patch = hook.pre_run_pod_sandbox(ctx("BE", BE_PARENT))
    target = pod_file(tmp_path, tree, BE_PARENT, "cpu.bvt_warp_ns").resolve()
    assert patch is not None and len(patch.writes) == 1
    (write,) = patch.writes
    assert (write.target, write.old, write.new) == (str(target), "0", "-1 (dry-run, not written)")
    assert write.reason.startswith("dry-run: BE pod: class rule cpuQOS.groupIdentity -1")
    assert snapshot(tmp_path) == before
    again = hook.pre_run_pod_sandbox(ctx("BE", BE_PARENT))
    assert again is not None and again.writes == ()  # reported once per planned value


def test_dry_run_must_be_a_bool(tmp_path: Path) -> None:
    v1_tree(tmp_path / "cgroup", BOTH)
    with pytest.raises(HookConfigError, match=r"hooks\[2\]\.args\.dry_run"):
        make_hook(tmp_path, {"dry_run": "yes"})
