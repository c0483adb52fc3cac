"""Class resctrl groups on a fixture resctrl tree: schemata per class, tasks, None config."""

from __future__ import annotations

from pathlib import Path

import pytest

from hooks.qos import QoSClass
from hooks.resctrlfs import ResctrlFS
from hooks.rules import parse_rules
from metrics.model import ContainerView, PodView
from metrics.qos.plan import AddTasks, SetSchemata
from metrics.qos.resctrlsync import POD_ANNOTATION, ResctrlSync, apply_resctrl


def make_resctrl(root: Path) -> ResctrlFS:
    """12 LLC ways (cbm fff) on caches 0 and 1, MBA in steps of 10 %."""
    (root / "info" / "L3").mkdir(parents=True)
    (root / "info" / "L3" / "cbm_mask").write_text("fff\n")
    (root / "info" / "L3" / "min_cbm_bits").write_text("1\n")
    (root / "info" / "MB").mkdir()
    (root / "info" / "MB" / "bandwidth_gran").write_text("10\n")
    (root / "info" / "MB" / "min_bandwidth").write_text("10\n")
    (root / "schemata").write_text("L3:0=fff;1=fff\nMB:0=100;1=100\n")
    return ResctrlFS(root)


def pod(uid: str, qos: QoSClass, tids: list[int], cgroup: Path, annotations: dict[str, str] | None = None) -> PodView:
    cdir = f"kubepods/pod{uid}/c{uid}"
    (cgroup / "cpu" / cdir).mkdir(parents=True)
    (cgroup / "cpu" / cdir / "tasks").write_text("".join(f"{t}\n" for t in tids))
    return PodView(uid=uid, namespace="ns", name=uid, sandbox_id=uid, qos=qos, priority=0, priority_class="",
                   cgroup_dir=f"kubepods/pod{uid}", annotations=annotations or {},
                   containers=(ContainerView(f"c{uid}", "main", cdir),))


def test_absent_resctrl_is_reported_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sync = ResctrlSync(ResctrlFS(tmp_path / "none"), tmp_path, 1)
    for _ in range(2):
        plan = sync.plan(parse_rules({}), [])
    assert plan.actions == () and "not available" in plan.reason
    assert capsys.readouterr().out.count("resctrl_unavailable") == 1


def test_nothing_when_every_class_is_disabled(tmp_path: Path) -> None:
    plan = ResctrlSync(make_resctrl(tmp_path / "resctrl"), tmp_path, 1).plan(parse_rules({}), [])
    assert plan.actions == ()


def test_be_class_gets_its_mask_and_threads_others_the_none_config(tmp_path: Path) -> None:
    fs = make_resctrl(tmp_path / "resctrl")
    cgroup = tmp_path / "cgroup"
    pods = [pod("b", QoSClass.BE, [101, 102], cgroup), pod("l", QoSClass.LS, [201], cgroup),
            pod("own", QoSClass.BE, [301], cgroup, {POD_ANNOTATION: "{}"})]
    rules = parse_rules({"resourceQOSStrategy": {"beClass": {"resctrlQOS": {"enable": True, "mbaPercent": 35}}}})
    plan = ResctrlSync(fs, cgroup, 1).plan(rules, pods)
    schemata = {a.group: a.text for a in plan.actions if isinstance(a, SetSchemata)}
    # BE 0-30% of 12 ways = ways 0..3 -> f; MBA 35% rounded up to 40
    assert schemata == {"LSR": "L3:0=fff;1=fff\nMB:0=100;1=100\n", "LS": "L3:0=fff;1=fff\nMB:0=100;1=100\n",
                        "BE": "L3:0=f;1=f\nMB:0=40;1=40\n"}
    tasks = [a for a in plan.actions if isinstance(a, AddTasks)]
    assert [(t.group, t.pids, t.pod_uids) for t in tasks] == [("BE", (101, 102), ("b",))]
    for action in plan.actions:
        assert isinstance(action, SetSchemata | AddTasks)
        apply_resctrl(fs, action)
    assert (fs.root / "BE" / "schemata").read_text() == "L3:0=f;1=f\nMB:0=40;1=40\n"
    assert (fs.root / "BE" / "tasks").read_text() == "101\n102\n"
    assert not (fs.root / "LS" / "tasks").exists()
    again = [a for a in plan.actions if isinstance(a, SetSchemata | AddTasks)]
    assert not any(apply_resctrl(fs, a) for a in again)  # a second round changes nothing
