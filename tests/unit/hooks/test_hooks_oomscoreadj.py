"""oom-score-adj on fixture cgroup (v1, v2) and /proc trees: koordlet's annotation
semantics (per-container spec, then pod-wide value), every process of the container,
only differing values written, bad input naming annotation and value with nothing
written, dry-run, and the reconcile pass picking up new processes and changed values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hooks.dryrun import DRY_RUN_SUFFIX
from hooks.oomscoreadj import (
    OOM_SCORE_ADJ,
    OOM_SCORE_ADJ_SPEC,
    OOMAnnotationError,
    OOMScoreAdj,
    container_oom_score_adj,
)
from runtimeproxy.hookapi import (
    CallResult,
    ContainerContext,
    ContainerInfo,
    ContainerMeta,
    HookConfigError,
    HookError,
    HookInit,
    HostRoots,
    LivePods,
    PodInfo,
    PodMeta,
    Stage,
    frozen_map,
)

UID = "1f2e3d4c-5b6a-4789-8abc-def012345678"
PARENT = f"/kubepods/burstable/pod{UID}"
CID = "c0ffee" * 8


def _cgroup_dir(root: Path, version: int) -> Path:
    base = root / "cpu" if version == 1 else root
    directory = base / "kubepods" / "burstable" / f"pod{UID}" / CID
    directory.mkdir(parents=True)
    if version == 2:
        (root / "cgroup.controllers").write_text("cpu memory\n")
    else:
        (root / "memory").mkdir()
    return directory


class Host:
    """A cgroup tree with the container's cgroup.procs and a /proc tree with oom_score_adj files."""

    def __init__(self, tmp_path: Path, version: int = 1) -> None:
        self.cgroup = tmp_path / "cgroup"
        self.proc = tmp_path / "proc"
        self.proc.mkdir()
        self.procs_file = _cgroup_dir(self.cgroup, version) / "cgroup.procs"
        self.procs_file.write_text("")
        self.roots = HostRoots(cgroup=self.cgroup, proc=self.proc)

    def spawn(self, pid: int, value: int = 0) -> None:
        (self.proc / str(pid)).mkdir()
        (self.proc / str(pid) / "oom_score_adj").write_text(f"{value}\n")
        pids = self.procs_file.read_text().split()
        self.procs_file.write_text("".join(f"{p}\n" for p in [*pids, str(pid)]))

    def value(self, pid: int) -> str:
        return (self.proc / str(pid) / "oom_score_adj").read_text().strip()

    def hook(self, **args: Any) -> OOMScoreAdj:
        return OOMScoreAdj(HookInit(name="oom-score-adj", args=args, key_path="hooks[0].args", host=self.roots))


def ctx(annotations: dict[str, str], *, name: str = "app", stage: Stage = Stage.RECONCILE_CONTAINER,
        result: CallResult | None = None) -> ContainerContext:
    pod = PodInfo(PodMeta("web", "ns", UID), id="sb1", cgroup_parent=PARENT, annotations=frozen_map(annotations))
    return ContainerContext(stage, pod, ContainerInfo(ContainerMeta(name), id=CID), result)


# --- parsing -------------------------------------------------------------------------


@pytest.mark.parametrize(("annotations", "container", "want"), [
    ({}, "app", None),
    ({OOM_SCORE_ADJ: ""}, "app", None),
    ({OOM_SCORE_ADJ: "500"}, "app", (500, OOM_SCORE_ADJ)),
    ({OOM_SCORE_ADJ: "-1000"}, "app", (-1000, OOM_SCORE_ADJ)),
    ({OOM_SCORE_ADJ: "+7"}, "app", (7, OOM_SCORE_ADJ)),
    ({OOM_SCORE_ADJ_SPEC: '{"app": -200, "side": 900}'}, "app", (-200, OOM_SCORE_ADJ_SPEC)),
    ({OOM_SCORE_ADJ_SPEC: '{"app": -200}', OOM_SCORE_ADJ: "300"}, "app", (-200, OOM_SCORE_ADJ_SPEC)),
    ({OOM_SCORE_ADJ_SPEC: '{"app": -200}', OOM_SCORE_ADJ: "300"}, "side", (300, OOM_SCORE_ADJ)),
    ({OOM_SCORE_ADJ_SPEC: '{"app": -200}'}, "side", None),
    ({OOM_SCORE_ADJ_SPEC: "", OOM_SCORE_ADJ: "1"}, "app", (1, OOM_SCORE_ADJ)),
])
def test_annotation_semantics(annotations: dict[str, str], container: str, want: tuple[int, str] | None) -> None:
    """The per-container spec wins, a spec without the container falls back to the pod value (koordlet)."""
    assert container_oom_score_adj(annotations, container) == want


@pytest.mark.parametrize(("annotations", "key", "text"), [
    ({OOM_SCORE_ADJ: "1001"}, OOM_SCORE_ADJ, "outside [-1000, 1000]"),
    ({OOM_SCORE_ADJ: "-1001"}, OOM_SCORE_ADJ, "outside"),
    ({OOM_SCORE_ADJ: "5.0"}, OOM_SCORE_ADJ, "not an integer"),
    ({OOM_SCORE_ADJ: " 5"}, OOM_SCORE_ADJ, "not an integer"),
    ({OOM_SCORE_ADJ: "1_0"}, OOM_SCORE_ADJ, "not an integer"),
    ({OOM_SCORE_ADJ_SPEC: "{app: 1}"}, OOM_SCORE_ADJ_SPEC, "invalid JSON"),
    ({OOM_SCORE_ADJ_SPEC: "[1]"}, OOM_SCORE_ADJ_SPEC, "expected a JSON object"),
    ({OOM_SCORE_ADJ_SPEC: '{"app": "5"}'}, OOM_SCORE_ADJ_SPEC, "not an integer"),
    ({OOM_SCORE_ADJ_SPEC: '{"app": true}'}, OOM_SCORE_ADJ_SPEC, "not an integer"),
    ({OOM_SCORE_ADJ_SPEC: '{"app": 1.5}'}, OOM_SCORE_ADJ_SPEC, "not an integer"),
    ({OOM_SCORE_ADJ_SPEC: '{"side": 2000}'}, OOM_SCORE_ADJ_SPEC, "2000 is outside"),
    ({OOM_SCORE_ADJ_SPEC: '{"app": 1}', OOM_SCORE_ADJ: "x"}, None, None),  # the spec decides: no error
])
def test_bad_annotations_name_key_and_value(annotations: dict[str, str], key: str | None, text: str | None) -> None:
    if key is None or text is None:
        assert container_oom_score_adj(annotations, "app") == (1, OOM_SCORE_ADJ_SPEC)
        return
    with pytest.raises(OOMAnnotationError) as err:
        container_oom_score_adj(annotations, "app")
    assert key in str(err.value) and repr(annotations[key]) in str(err.value) and text in str(err.value)


# --- the hook on fixture trees -----------------------------------------------------------


@pytest.mark.parametrize("version", [1, 2])
def test_every_process_gets_the_value_and_only_changes_are_reported(tmp_path: Path, version: int) -> None:
    host = Host(tmp_path, version)
    host.spawn(100, 0)
    host.spawn(101, 0)
    host.spawn(102, 500)  # already right
    patch = host.hook().reconcile_container(ctx({OOM_SCORE_ADJ: "500"}))
    assert patch is not None
    assert [(w.target, w.old, w.new) for w in patch.writes] == [
        (str(host.proc / "100" / "oom_score_adj"), "0", "500"),
        (str(host.proc / "101" / "oom_score_adj"), "0", "500"),
    ]
    assert OOM_SCORE_ADJ in patch.reason and "500" in patch.reason
    assert [host.value(p) for p in (100, 101, 102)] == ["500", "500", "500"]
    assert host.hook().reconcile_container(ctx({OOM_SCORE_ADJ: "500"})) is None  # idempotent


def test_reconcile_picks_up_a_new_process_and_a_changed_annotation(tmp_path: Path) -> None:
    host = Host(tmp_path)
    hook = host.hook()
    host.spawn(100)
    assert hook.post_start_container(ctx({OOM_SCORE_ADJ: "-500"}, stage=Stage.POST_START_CONTAINER)) is not None
    host.spawn(101)  # forked later
    patch = hook.reconcile_container(ctx({OOM_SCORE_ADJ: "-500"}))
    assert patch is not None and [w.target for w in patch.writes] == [str(host.proc / "101" / "oom_score_adj")]
    assert host.value(101) == "-500"
    patch = hook.reconcile_container(ctx({OOM_SCORE_ADJ_SPEC: json.dumps({"app": 250})}))
    assert patch is not None and len(patch.writes) == 2 and OOM_SCORE_ADJ_SPEC in patch.reason
    assert [host.value(p) for p in (100, 101)] == ["250", "250"]


def test_no_annotation_no_write(tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.spawn(100, 3)
    assert host.hook().reconcile_container(ctx({})) is None
    assert host.hook().reconcile_container(ctx({OOM_SCORE_ADJ_SPEC: '{"other": 5}'})) is None
    assert host.value(100) == "3"


def test_bad_annotation_is_an_error_and_writes_nothing(tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.spawn(100, 0)
    hook = host.hook()
    with pytest.raises(HookError) as err:
        hook.reconcile_container(ctx({OOM_SCORE_ADJ: "2000"}))
    assert f"{OOM_SCORE_ADJ}='2000'" in str(err.value) and "ns/web" in str(err.value) and "app" in str(err.value)
    assert not err.value.repeat
    assert host.value(100) == "0"
    with pytest.raises(HookError) as again:
        hook.reconcile_container(ctx({OOM_SCORE_ADJ: "2000"}))
    assert again.value.repeat  # the same bad value at the next pass: not a new warning


def test_failed_start_and_a_stopped_container_do_nothing(tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.spawn(100)
    failed = CallResult(ok=False, code="UNKNOWN")
    assert host.hook().post_start_container(ctx({OOM_SCORE_ADJ: "1"}, stage=Stage.POST_START_CONTAINER,
                                                result=failed)) is None
    host.procs_file.write_text("")  # no process left
    assert host.hook().reconcile_container(ctx({OOM_SCORE_ADJ: "1"})) is None
    assert host.value(100) == "0"


def test_a_process_gone_between_listing_and_writing_is_skipped(tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.spawn(100)
    host.spawn(101)
    (host.proc / "100" / "oom_score_adj").unlink()
    (host.proc / "100").rmdir()
    patch = host.hook().reconcile_container(ctx({OOM_SCORE_ADJ: "9"}))
    assert patch is not None and [w.target for w in patch.writes] == [str(host.proc / "101" / "oom_score_adj")]


def test_writes_stay_under_the_proc_root(tmp_path: Path) -> None:
    """A symlinked oom_score_adj is not followed, and a missing one is not created."""
    host = Host(tmp_path)
    host.spawn(100)
    outside = tmp_path / "outside"
    outside.write_text("0\n")
    (host.proc / "100" / "oom_score_adj").unlink()
    (host.proc / "100" / "oom_score_adj").symlink_to(outside)
    with pytest.raises(HookError):
        host.hook().reconcile_container(ctx({OOM_SCORE_ADJ: "9"}))
    assert outside.read_text() == "0\n"


def test_cgroup_parent_escape_is_refused(tmp_path: Path) -> None:
    host = Host(tmp_path)
    c = ctx({OOM_SCORE_ADJ: "9"})
    bad = ContainerContext(c.stage, PodInfo(c.pod.meta, cgroup_parent="/../../etc", annotations=c.pod.annotations),
                           c.container)
    with pytest.raises(HookError, match=r"contains a '\.\.' component"):
        host.hook().reconcile_container(bad)


def test_dry_run_reports_the_plan_once_and_writes_nothing(tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.spawn(100, 0)
    hook = host.hook(dry_run=True)
    patch = hook.reconcile_container(ctx({OOM_SCORE_ADJ: "700"}))
    assert patch is not None and patch.writes[0].new == "700" + DRY_RUN_SUFFIX
    assert patch.writes[0].reason.startswith("dry-run: ")
    assert host.value(100) == "0"
    assert hook.reconcile_container(ctx({OOM_SCORE_ADJ: "700"})) is None  # reported already
    changed = hook.reconcile_container(ctx({OOM_SCORE_ADJ: "600"}))
    assert changed is not None and changed.writes[0].new == "600" + DRY_RUN_SUFFIX
    assert host.value(100) == "0"


@pytest.mark.parametrize(("args", "key"), [
    ({"dry_run": "yes"}, "hooks[0].args.dry_run"),
    ({"bogus": 1}, "hooks[0].args.bogus"),
    ({"cgroup_driver": "x"}, "hooks[0].args.cgroup_driver"),
])
def test_bad_args_name_the_key(tmp_path: Path, args: dict[str, Any], key: str) -> None:
    host = Host(tmp_path)
    with pytest.raises(HookConfigError) as err:
        host.hook(**args)
    assert err.value.key_path == key


def test_many_processes_are_one_explain_entry(tmp_path: Path) -> None:
    """A container of many processes must not push every other change out of the pod's history."""
    host = Host(tmp_path)
    for pid in range(100, 110):
        host.spawn(pid, 0 if pid % 2 else 5)
    patch = host.hook().reconcile_container(ctx({OOM_SCORE_ADJ: "-10"}))
    assert patch is not None and len(patch.writes) == 1
    write = patch.writes[0]
    assert write.target == str(host.proc) + "/{100,101,102,103,...}/oom_score_adj"
    assert (write.old, write.new) == ("0,5", "-10") and "10 of 10 process(es)" in write.reason
    assert all(host.value(pid) == "-10" for pid in range(100, 110))


def test_sweep_forgets_the_bad_annotations_of_gone_pods(tmp_path: Path) -> None:
    host = Host(tmp_path)
    host.spawn(100, 0)
    hook = host.hook()
    with pytest.raises(HookError):
        hook.reconcile_container(ctx({OOM_SCORE_ADJ: "2000"}))
    assert hook.sweep_orphans(LivePods(frozenset({UID}))) == []
    assert len(hook.sweep_orphans(LivePods(frozenset()))) == 1
    with pytest.raises(HookError) as again:
        hook.reconcile_container(ctx({OOM_SCORE_ADJ: "2000"}))
    assert not again.value.repeat  # forgotten: a pod with that uid would be told again
