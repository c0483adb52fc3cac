"""Class resctrl groups kept in step with the rules (koordlet's ResctrlReconcile).

Groups ``LSR`` (LSE and LSR pods), ``LS`` and ``BE`` under the resctrl root get
the ``schemata`` of their class (LLC mask from ``catRange{Start,End}Percent``,
MB from ``mbaPercent``) and the thread ids of their pods' containers. A class
whose ``resctrlQOS.enable`` is false gets Koordinator's None config (whole
cache, 100 %), so disabling a class lifts its restriction, and no tasks are
moved for it. Pods with their own ``node.koordinator.sh/resctrl`` annotation are
left to the resctrl hook's pod groups, as koordlet skips them.

The runtime resctrl hook does the same per container at start; this strategy
repairs drift (threads that started later, a group edited by hand) every round.
Masks are built and validated by ``hooks.resctrlfs.ResctrlFS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Final

import structlog

from hooks.executor import confine
from hooks.qos import QoSClass
from hooks.resctrlfs import ResctrlError, ResctrlFS
from hooks.rules import Rules
from metrics.model import PodView
from metrics.qos.plan import Action, AddTasks, Plan, Priority, SetSchemata
from runtimeproxy.hookapi import HookError

log = structlog.get_logger("metrics.qos.resctrlsync")

NAME: Final = "resctrl"
POD_ANNOTATION: Final = "node.koordinator.sh/resctrl"
#: group -> classes it holds; the first class names the rules' config.
CLASS_GROUPS: Final = {
    "LSR": (QoSClass.LSR, QoSClass.LSE),
    "LS": (QoSClass.LS,),
    "BE": (QoSClass.BE,),
}


def container_threads(cgroup_root: Path, version: int, cgroup_dir: str) -> list[int]:
    """Thread ids in a container cgroup (v1: the cpu controller's ``tasks``; v2:
    ``cgroup.threads``); empty when the cgroup is gone or unreadable."""
    relative = PurePosixPath("cpu", cgroup_dir) if version == 1 else PurePosixPath(cgroup_dir)
    name = "tasks" if version == 1 else "cgroup.threads"
    try:
        path = confine(cgroup_root, relative, cgroup_dir) / name
        text = path.read_text()
    except (HookError, OSError):
        return []
    return sorted({int(t) for t in text.split() if t.isdigit() and int(t) > 0})


class ResctrlSync:
    def __init__(self, fs: ResctrlFS, cgroup_root: Path, cgroup_version: int, group_prefix: str = "") -> None:
        self.fs = fs
        self.cgroup_root = cgroup_root
        self.cgroup_version = cgroup_version
        self.group_prefix = group_prefix
        self._reported_absent = False

    def plan(self, rules: Rules, pods: Sequence[PodView]) -> Plan:
        """Reads the host (resctrl info, cgroup thread lists): run it off the event loop."""
        if not self.fs.present:
            if not self._reported_absent:
                self._reported_absent = True
                log.info("resctrl_unavailable", root=str(self.fs.root))
            return Plan(NAME, Priority.RESCTRL, (), {"present": False}, "resctrl not available on this host")
        configs = {group: rules.for_class(classes[0]).resctrl_qos for group, classes in CLASS_GROUPS.items()}
        if not any(c.enable for c in configs.values()):
            return Plan(NAME, Priority.RESCTRL, (), {"enabled": []}, "resctrlQOS disabled for every class")
        actions: list[Action] = []
        info: dict[str, object] = {}
        problems: list[str] = []
        for group, classes in CLASS_GROUPS.items():
            cfg = configs[group]
            name = self.group_prefix + group
            try:
                text = self.fs.build_schemata(cfg.cat_range_start_percent, cfg.cat_range_end_percent,
                                              cfg.mba_percent)
            except ResctrlError as exc:
                problems.append(f"{name}: {exc}")
                continue
            state = "enabled" if cfg.enable else "disabled (None config)"
            actions.append(SetSchemata(name, text, f"class {group} resctrlQOS {state}"))
            info[name] = {"enable": cfg.enable, "schemata": text.strip()}
            if cfg.enable:
                members = [p for p in pods if p.qos in classes and POD_ANNOTATION not in p.annotations]
                pids = sorted({t for p in members for c in p.containers
                               for t in container_threads(self.cgroup_root, self.cgroup_version, c.cgroup_dir)})
                if pids:
                    actions.append(AddTasks(name, tuple(pids), f"threads of class {group} pods",
                                            tuple(p.uid for p in members)))
        reason = "; ".join(problems) if problems else "class groups in step with the rules"
        return Plan(NAME, Priority.RESCTRL, tuple(actions), info, reason)


def apply_resctrl(fs: ResctrlFS, action: SetSchemata | AddTasks) -> bool:
    """Carry out one resctrl action; True when something changed."""
    if isinstance(action, SetSchemata):
        created = fs.ensure_group(action.group)
        return fs.write_schemata(action.group, action.text, action.reason).changed or created
    return fs.add_tasks(action.group, action.pids, action.reason).changed
