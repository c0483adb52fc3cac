"""Resctrl: last-level cache ways and memory bandwidth per QoS class (Intel RDT / AMD QoS).

Why: co-located BE pods thrash the shared L3 cache and the memory bus of the
latency-sensitive pods next to them; CPU isolation alone does not stop that.
Koordinator's answer, kept here with Koordinator's names so that koordlet and
this proxy agree on the same groups:

* **Class groups** ``LSR``, ``LS``, ``BE`` directly under the resctrl root (koordlet's
  ``ResctrlReconcile`` names; LSE pods share LSR's group). A class gets its group
  only when its ``resourceQOSStrategy.<class>.resctrlQOS.enable`` is true, and
  only when a pod of that class needs it (created lazily). Its ``schemata``
  comes from the rule: the L3 mask of ``catRangeStartPercent`` ..
  ``catRangeEndPercent`` (Koordinator's ``CalculateCatL3MaskValue`` over the
  bits of ``info/L3/cbm_mask``, for every cache id of the root schemata's L3
  line) and ``MB`` = ``mbaPercent`` rounded up to ``info/MB/bandwidth_gran``.
  Defaults (Koordinator): LSR/LS 0-100 %, BE 0-30 %, MBA 100 %, all disabled.
  A class disabled after a group was made for it gets Koordinator's None config
  (0-100 %, 100 %) written at the next reconcile: no restriction left behind.
* **Pod groups** ``koordlet-<pod uid>`` for pods with the annotation
  ``node.koordinator.sh/resctrl`` (the Koordinator runtime hook's format,
  ``apis/extension`` ``ResctrlConfig``)::

      {"llc": {"schemata": {"range": [start%, end%]},
               "schemataPerCache": [{"cacheID": 0, "range": [start%, end%]}]},
       "mb":  {"schemata": {"percent": p},
               "schemataPerCache": [{"cacheID": 0, "percent": p}]}}

  Everything is optional (a missing part means the whole cache, 100 %); per-cache
  entries override the all-caches value. Extension (not in Koordinator): a
  ``schemata`` may be a raw schemata line, ``"L3:0=ff;1=ff"`` / ``"MB:0=50"``, checked
  against the host (contiguous mask inside ``cbm_mask``, at least
  ``min_cbm_bits``, known cache ids). A pod with the annotation uses its own
  group whatever its class (koordlet skips such pods in the class groups).
  Malformed JSON, an unknown key, a range outside 0 <= start < end <= 100, a
  percent outside 1..100 or a bad mask is a HookError naming the pod, the key
  and the value, and nothing is written.

Stages:

* ``PostStartContainer`` — the container's threads (``tasks`` of its cgroup in
  the cpu controller on v1; ``cgroup.threads``, else ``cgroup.procs``, on v2)
  are added to its pod or class group, which is created and given its
  schemata first if needed.
* ``ReconcileContainer`` — the same: threads missing from the group (moved out
  by hand, or started while the proxy was down) are re-added, the schemata is
  kept true. A container without a cgroup or without threads is skipped (it
  is not running; nothing is created for it).
* ``ReconcilePodSandbox`` — the pod's class group (created if needed) and its
  own group (if it exists) get their schemata rewritten when they drifted. A
  rule change applies this way: a reload builds a new instance and the
  reconciler runs right after.
* ``PostStopPodSandbox`` / ``PostRemovePodSandbox`` — the pod's own group is
  removed (the kernel moves any task left back to the root group). Class
  groups are never removed.

Every change (group created or removed, schemata, thread ids added) is reported
in the patch's ``writes``; a repeat call that finds everything true reports
nothing (returns ``None``).

When the host has no resctrl (no ``info/L3/cbm_mask`` under the root: VMs, AMD
without QoS, resctrl not mounted) the hook logs ``resctrl_absent`` once and
returns ``None`` at every stage: no error, no write.

args: ``cgroup_driver`` (cgroupfs | systemd, default cgroupfs), ``cgroup_version``
(auto | 1 | 2, default auto), ``class_group_prefix`` (default ``""``: groups ``LSR``,
``LS``, ``BE`` as koordlet names them) and ``pod_group_prefix`` (default
``"koordlet-"``), for sites that want other names.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any, Final

import structlog

from hooks.annotations import AnnotationError
from hooks.cgroups import CgroupError, CgroupLayout, PathEscapeError, container_cgroup_dir
from hooks.dryrun import DryRunLedger, dry_run_arg, patch_reason
from hooks.executor import Confinement
from hooks.hookargs import cgroup_args, host_writes
from hooks.proctasks import parse_ids, read_nofollow
from hooks.qos import QoSClass, pod_name
from hooks.resctrlfs import ResctrlError, ResctrlFS, ResctrlNotSupported, format_schemata
from hooks.rules import LiveRules, ResctrlQOS, Rules
from runtimeproxy.config.configvalues import reject_unknown
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerPatch,
    HookConfigError,
    HookError,
    HookInit,
    HostWrite,
    LivePods,
    PodContext,
    PodInfo,
    PodPatch,
)

RESCTRL_ANNOTATION: Final = "node.koordinator.sh/resctrl"
DEFAULT_POD_GROUP_PREFIX: Final = "koordlet-"
_ARGS: Final = frozenset({"cgroup_driver", "cgroup_version", "class_group_prefix", "pod_group_prefix", "dry_run"})
_PREFIX: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
#: QoS class → (class group suffix, rules key for messages). LSE shares LSR's group.
_CLASS_GROUPS: Final = {
    QoSClass.LSE: ("LSR", "lsrClass"),
    QoSClass.LSR: ("LSR", "lsrClass"),
    QoSClass.LS: ("LS", "lsClass"),
    QoSClass.BE: ("BE", "beClass"),
}
_SECTIONS: Final = {"llc": ("L3", "range"), "mb": ("MB", "percent")}  # annotation key → (resource, value key)
_SHOWN: Final = 200
_FULL: Final = ResctrlQOS()  # Koordinator's None config: 0-100 % LLC, 100 % MBA

log = structlog.get_logger("hooks.resctrl")


def _int(value: object, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise AnnotationError(f"{where}: expected an integer in [{low}, {high}], got {value!r}")
    return value


def _object(value: object, where: str, known: frozenset[str]) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise AnnotationError(f"{where}: expected a JSON object, got {type(value).__name__}")
    unknown = set(value) - known
    if unknown:
        raise AnnotationError(f"{where}: unknown key {sorted(unknown)[0]!r} (known: {', '.join(sorted(known))})")
    return value


def _range(value: object, where: str) -> tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise AnnotationError(f"{where}: expected [startPercent, endPercent], got {value!r}")
    start = _int(value[0], f"{where}[0]", 0, 100)
    end = _int(value[1], f"{where}[1]", 0, 100)
    if start >= end:
        raise AnnotationError(f"{where}: need 0 <= start < end <= 100, got {value!r}")
    return start, end


class Resctrl:
    """Stages: PostStartContainer, ReconcileContainer, ReconcilePodSandbox,
    PostStopPodSandbox, PostRemovePodSandbox; and ``sweep_orphans`` (pod groups of gone pods)."""

    def __init__(self, init: HookInit) -> None:
        args: dict[str, Any] = dict(init.args)
        reject_unknown(args, _ARGS, f"{init.key_path}.")
        driver, version = cgroup_args(init, args)
        self.class_group_prefix = self._prefix(init, args, "class_group_prefix", "", allow_empty=True)
        self.pod_group_prefix = self._prefix(init, args, "pod_group_prefix", DEFAULT_POD_GROUP_PREFIX,
                                             allow_empty=False)
        self._rules = LiveRules(init)
        self.dry_run = dry_run_arg(init, args)
        self._ledger = DryRunLedger("resctrl")
        self.fs = ResctrlFS(init.host.resctrl)
        try:
            self.layout = CgroupLayout(init.host.cgroup, version, driver)
        except CgroupError as exc:
            raise HookConfigError(f"{init.key_path}.cgroup_version", version, str(exc)) from exc
        self._confine = Confinement(self.layout.root)
        self._lock = threading.Lock()
        self._absent_logged = False
        self._check_rules()

    @property
    def rules(self) -> Rules:
        """The rules in force now: the YAML, with the NodeSLO merged over it when there is one."""
        return self._rules()

    @staticmethod
    def _prefix(init: HookInit, args: Mapping[str, Any], key: str, default: str, *, allow_empty: bool) -> str:
        value = args.get(key, default)
        if not isinstance(value, str) or not (_PREFIX.fullmatch(value) or (allow_empty and value == "")):
            raise HookConfigError(f"{init.key_path}.{key}", value,
                                  "expected a resctrl group name prefix ([A-Za-z0-9][A-Za-z0-9_.-]*)")
        return value

    def _check_rules(self) -> None:
        """On a host with resctrl, an enabled class whose LLC range gives no valid
        mask (e.g. fewer ways than ``min_cbm_bits``) fails the (re)load."""
        if not self.fs.present:
            return
        for qos in (QoSClass.LSR, QoSClass.LS, QoSClass.BE):
            rule = self.rules.for_class(qos).resctrl_qos
            if not rule.enable:
                continue
            try:
                self.fs.l3_mask(rule.cat_range_start_percent, rule.cat_range_end_percent)
            except ResctrlNotSupported:
                return
            except ResctrlError as exc:
                key = _CLASS_GROUPS[qos][1]
                value = (rule.cat_range_start_percent, rule.cat_range_end_percent)
                raise HookConfigError(f"rules.resourceQOSStrategy.{key}.resctrlQOS", value, str(exc)) from exc

    # --- what a pod wants -----------------------------------------------------------

    def class_group(self, qos: QoSClass) -> str | None:
        """The class group of ``qos`` (``None`` for SYSTEM and unclassed pods)."""
        entry = _CLASS_GROUPS.get(qos)
        return None if entry is None else self.class_group_prefix + entry[0]

    def pod_group(self, pod: PodInfo) -> str:
        """``koordlet-<uid>``, checked: a uid that is not a plain name is refused."""
        name = self.pod_group_prefix + pod.meta.uid
        if name in {self.class_group_prefix + g for g, _ in _CLASS_GROUPS.values()}:
            raise HookError(f"pod {pod_name(pod)}: pod uid {pod.meta.uid!r} would name a class group")
        try:
            self.fs.group_dir(name)
        except ResctrlError as exc:
            raise HookError(f"pod {pod_name(pod)}: pod uid {pod.meta.uid!r}: {exc}") from exc
        return name

    def class_schemata(self, qos: QoSClass, rule: ResctrlQOS) -> str:
        try:
            return self.fs.build_schemata(rule.cat_range_start_percent, rule.cat_range_end_percent, rule.mba_percent)
        except ResctrlNotSupported:
            raise
        except ResctrlError as exc:
            key = _CLASS_GROUPS[qos][1]
            raise HookError(f"rules.resourceQOSStrategy.{key}.resctrlQOS: {exc}") from exc

    def annotation_schemata(self, raw: str) -> str:
        """The pod group's schemata from ``node.koordinator.sh/resctrl``. Raises
        AnnotationError (or ResctrlError for a mask the host cannot take)."""
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise AnnotationError(f"invalid JSON: {exc}") from exc
        except RecursionError:  # "[[[[...": json's decoder recurses per level
            raise AnnotationError("invalid JSON: nested too deeply") from None
        data = _object(data, "annotation", frozenset(_SECTIONS))
        full_mask = f"{self.fs.l3_mask(0, 100):x}"
        schemata: dict[str, dict[int, str]] = {"L3": dict.fromkeys(self.fs.cache_ids("L3"), full_mask)}
        if self.fs.mb_supported():
            schemata["MB"] = dict.fromkeys(self.fs.cache_ids("MB"), str(self.fs.mb_value(100)))
        for section, (resource, value_key) in _SECTIONS.items():
            if section not in data:
                continue
            body = _object(data[section], section, frozenset({"schemata", "schemataPerCache"}))
            if resource not in schemata:
                continue  # no MBA on this host: bandwidth settings cannot apply
            entries = schemata[resource]
            if "schemata" in body:
                config = body["schemata"]
                if isinstance(config, str):
                    raw_entries = self.fs.validate_schemata(config, f"{section}.schemata {config!r}")
                    if set(raw_entries) - {resource}:
                        raise AnnotationError(f"{section}.schemata: only {resource} lines belong here, got {config!r}")
                    entries.update(raw_entries.get(resource, {}))
                else:
                    config = _object(config, f"{section}.schemata", frozenset({value_key}))
                    if value_key in config:
                        entries.update(dict.fromkeys(entries, self._value(resource, config[value_key],
                                                                           f"{section}.schemata.{value_key}")))
            per_cache = body.get("schemataPerCache", [])
            if not isinstance(per_cache, list):
                raise AnnotationError(f"{section}.schemataPerCache: expected a list, got {per_cache!r}")
            seen: set[int] = set()
            for i, item in enumerate(per_cache):
                where = f"{section}.schemataPerCache[{i}]"
                item = _object(item, where, frozenset({"cacheID", value_key}))
                cache_id = _int(item.get("cacheID", 0), f"{where}.cacheID", 0, 2**31)
                if cache_id not in entries:
                    raise AnnotationError(f"{where}.cacheID: cache id {cache_id} does not exist "
                                          f"(have {sorted(entries)})")
                if cache_id in seen:
                    raise AnnotationError(f"{where}.cacheID: cache id {cache_id} given twice")
                seen.add(cache_id)
                if value_key in item:
                    entries[cache_id] = self._value(resource, item[value_key], f"{where}.{value_key}")
        return format_schemata(schemata)

    def _value(self, resource: str, value: object, where: str) -> str:
        if resource == "L3":
            start, end = _range(value, where)
            try:
                return f"{self.fs.l3_mask(start, end):x}"
            except ResctrlNotSupported:
                raise
            except ResctrlError as exc:
                raise AnnotationError(f"{where}: {exc}") from exc
        return str(self.fs.mb_value(_int(value, where, 1, 100)))

    def desired(self, pod: PodInfo) -> tuple[str, str, str, bool] | None:
        """(group, schemata, reason, is the pod's own group) or ``None`` when the pod
        gets no group. Every check happens here, before anything is written."""
        raw = pod.annotations.get(RESCTRL_ANNOTATION)
        if raw is not None:
            group = self.pod_group(pod)
            try:
                schemata = self.annotation_schemata(raw)
            except ResctrlNotSupported:
                raise
            except (AnnotationError, ResctrlError) as exc:
                shown = raw if len(raw) <= _SHOWN else raw[:_SHOWN] + "..."
                raise HookError(f"pod {pod_name(pod)}: annotation {RESCTRL_ANNOTATION}={shown!r}: {exc}") from exc
            return group, schemata, f"pod annotation {RESCTRL_ANNOTATION}: group {group}", True
        qos = self.rules.qos_of(pod)
        class_group = self.class_group(qos)
        if class_group is None:
            return None
        rule = self.rules.for_class(qos).resctrl_qos
        if not rule.enable:
            return None
        reason = (f"{qos.value} pod: class rule resctrlQOS LLC {rule.cat_range_start_percent}-"
                  f"{rule.cat_range_end_percent}% MBA {rule.mba_percent}%: group {class_group}")
        return class_group, self.class_schemata(qos, rule), reason, False

    # --- host side ---------------------------------------------------------------------

    def _absent(self) -> bool:
        if self.fs.present:
            return False
        self._say_absent()
        return True

    def _say_absent(self) -> None:
        with self._lock:
            if self._absent_logged:
                return
            self._absent_logged = True
        log.warning("resctrl_absent", root=str(self.fs.root),
                    detail=f"{self.fs.root / 'info/L3/cbm_mask'} does not exist: resctrl hook does nothing")

    def _group_writes(self, group: str, schemata: str, reason: str, *, create: bool) -> list[HostWrite]:
        if self.dry_run:
            return self._planned_group_writes(group, schemata, reason, create=create)
        writes: list[HostWrite] = []
        if create and self.fs.ensure_group(group):
            writes.append(HostWrite(str(self.fs.group_dir(group)), "", "created", reason))
        writes.extend(host_writes([self.fs.write_schemata(group, schemata, reason)]))
        return writes

    def _planned_group_writes(self, group: str, schemata: str, reason: str, *, create: bool) -> list[HostWrite]:
        """Dry run: the group that would be made and the schemata that would change,
        reported once (``hooks.dryrun``). A group not made yet has the root's schemata."""
        planned: list[HostWrite] = []
        exists = self.fs.group_dir(group).is_dir()
        if create and not exists:
            planned.append(HostWrite(str(self.fs.group_dir(group)), "", "created", reason))
        if exists:
            planned.extend(host_writes([self.fs.plan_schemata(group, schemata, reason)]))
        elif create:
            target = self.fs.group_dir(group) / "schemata"
            planned.append(HostWrite(str(target), "", schemata.strip(), reason))
        return list(self._ledger.report(planned, group=group))

    def _task_writes(self, group: str, threads: list[int], why: str) -> list[HostWrite]:
        if not self.dry_run:
            return list(host_writes([self.fs.add_tasks(group, threads, why)]))
        if self.fs.group_dir(group).is_dir():
            planned = self.fs.plan_tasks(group, threads, why)
            old, moved = planned.old or "", planned.new
        else:  # the group would be made: every thread moves in
            old, moved = "", " ".join(map(str, sorted(set(threads))))
        if not moved:
            return []
        target = str(self.fs.group_dir(group) / "tasks")
        return list(self._ledger.report([HostWrite(target, old, moved, why)], group=group))

    def container_threads(self, pod: PodInfo, container_id: str) -> list[int] | None:
        """Thread ids of the container's cgroup; ``None`` when the cgroup does not exist."""
        try:
            relative = container_cgroup_dir(pod.cgroup_parent, container_id, self.layout.driver)
        except CgroupError as exc:
            raise HookError(f"pod {pod_name(pod)}: {exc}") from exc
        source = f"pod {pod_name(pod)}: cgroup_parent {pod.cgroup_parent!r}, container {container_id!r}"
        names: tuple[str, ...] = ("cgroup.threads", "cgroup.procs")  # v2: threads, as resctrl wants
        if self.layout.version == 1:
            relative, names = PurePosixPath("cpu", relative), ("tasks",)
        directory = self._confine(relative, source)
        if not directory.is_dir():
            return None
        for name in names:
            path = directory / name
            if path.is_symlink():
                raise PathEscapeError(f"{source}: {path} is a symlink; refusing to follow it")
            if path.is_file():
                try:
                    return parse_ids(read_nofollow(path))
                except OSError as exc:
                    raise CgroupError(f"{source}: cannot read {path}: {exc.strerror}") from exc
        raise CgroupError(f"{source}: {directory} has none of {', '.join(names)}")

    def _container(self, ctx: ContainerContext, *, gone_is_error: bool) -> ContainerPatch | None:
        if self._absent():
            return None
        pod = ctx.pod
        try:
            wanted = self.desired(pod)
            if wanted is None:
                return None
            group, schemata, reason, _own = wanted
            threads = self.container_threads(pod, ctx.container.id)
            if threads is None:
                if gone_is_error:
                    raise HookError(f"pod {pod_name(pod)}: container {ctx.container.meta.name} "
                                    f"({ctx.container.id}): its cgroup does not exist")
                return None
            if not threads:
                return None
            writes = self._group_writes(group, schemata, reason, create=True)
            why = f"{reason}: threads of container {ctx.container.meta.name}"
            writes.extend(self._task_writes(group, threads, why))
        except ResctrlNotSupported:
            self._say_absent()
            return None
        except ResctrlError as exc:
            raise HookError(f"pod {pod_name(pod)}: {exc}") from exc
        reason = patch_reason(reason) if self.dry_run else reason
        return ContainerPatch(reason=reason, writes=tuple(writes)) if writes else None

    # --- stages ---------------------------------------------------------------------------

    def host_support(self) -> tuple[str, str]:
        """check-config's plan: whether resctrl is mounted with L3 CAT."""
        if self.fs.present:
            return "on", f"resctrl at {self.fs.root}"
        return "off", f"{self.fs.root / 'info/L3/cbm_mask'} does not exist: resctrl hook does nothing"

    def post_start_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        if ctx.result is not None and not ctx.result.ok:
            return None
        return self._container(ctx, gone_is_error=True)

    def reconcile_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        return self._container(ctx, gone_is_error=False)

    def reconcile_pod_sandbox(self, ctx: PodContext) -> PodPatch | None:
        if self._absent():
            return None
        pod = ctx.pod
        try:
            wanted = self.desired(pod)
            if wanted is None:
                return self._reset_disabled_class(pod)
            group, schemata, reason, own = wanted
            if own and not self.fs.group_dir(group).is_dir():
                return None  # made when a container of the pod runs; a stopped pod gets none back
            writes = self._group_writes(group, schemata, reason, create=not own)
        except ResctrlNotSupported:
            self._say_absent()
            return None
        except ResctrlError as exc:
            raise HookError(f"pod {pod_name(pod)}: {exc}") from exc
        reason = patch_reason(reason) if self.dry_run else reason
        return PodPatch(reason=reason, writes=tuple(writes)) if writes else None

    def _reset_disabled_class(self, pod: PodInfo) -> PodPatch | None:
        """A class whose resctrlQOS is now disabled but whose group exists gets the
        None config (whole cache, full bandwidth), as koordlet does."""
        qos = self.rules.qos_of(pod)
        group = self.class_group(qos)
        if group is None or not self.fs.group_dir(group).is_dir():
            return None
        reason = f"{qos.value} pod: class resctrlQOS disabled: group {group} gets the whole cache and bandwidth"
        writes = self._group_writes(group, self.class_schemata(qos, _FULL), reason, create=False)
        return PodPatch(reason=reason, writes=tuple(writes)) if writes else None

    def _remove(self, ctx: PodContext) -> PodPatch | None:
        if ctx.result is not None and not ctx.result.ok:
            return None
        if self._absent():
            return None
        group = self.pod_group(ctx.pod)
        path = self.fs.group_dir(group)
        try:
            removed = self.fs.remove_group(group)
        except ResctrlError as exc:
            raise HookError(f"pod {pod_name(ctx.pod)}: {exc}") from exc
        if not removed:
            return None
        reason = f"pod {pod_name(ctx.pod)} {ctx.stage.value}: its resctrl group {group} is removed"
        return PodPatch(reason=reason, writes=(HostWrite(str(path), "present", "removed", reason),))

    def post_stop_pod_sandbox(self, ctx: PodContext) -> PodPatch | None:
        return self._remove(ctx)

    def post_remove_pod_sandbox(self, ctx: PodContext) -> PodPatch | None:
        return self._remove(ctx)

    def sweep_orphans(self, live: LivePods) -> list[str]:
        """Pod groups (``<pod_group_prefix><uid>``) of pods that no longer exist: removed
        (their tasks, if any, fall back to the root group). Class groups stay."""
        if self._absent():
            return []
        removed: list[str] = []
        classes = {self.class_group_prefix + g for g, _ in _CLASS_GROUPS.values()}
        try:
            names = sorted(entry.name for entry in os.scandir(self.fs.root) if entry.is_dir(follow_symlinks=False))
        except OSError as exc:
            raise HookError(f"resctrl sweep: cannot list {self.fs.root}: {exc.strerror}") from exc
        for name in names:
            uid = name.removeprefix(self.pod_group_prefix)
            if uid == name or not uid or uid in live.uids or name in classes:
                continue
            try:
                if self.fs.remove_group(name):
                    removed.append(f"{self.fs.group_dir(name)}: pod {uid} no longer exists")
            except ResctrlError as exc:
                log.warning("resctrl_orphan_not_removed", group=name, error=str(exc))
        return removed


__all__ = ["RESCTRL_ANNOTATION", "AnnotationError", "Resctrl"]
