"""Block I/O QoS of the class tiers (koordlet's BlkIOReconcile, reference §4): strategy ``blkio``.

Every round, from ``resourceQOSStrategy.<class>.blkioQOS.blocks`` (``hooks.blkiorules``):

* the BE class's blocks on ``kubepods/besteffort``, the LS class's on ``kubepods/burstable``
  (systemd: ``kubepods.slice/kubepods-{besteffort,burstable}.slice``): the whole tier shares
  the limit, as koordlet throttles the QoS directory;
* per ``type: device`` block (name resolved to ``major:minor`` through the injected
  ``/sys``): v1 ``blkio.throttle.{read,write}_{bps,iops}_device``, v2 ``io.max``, plus the
  weight file (``ioWeightPercent``) where the kernel has one — the same files and values
  as the ``blkio`` hook, which keeps LSR / LSE pods (their own cgroups) and shares its
  helpers with this module (``hooks.blkio``);
* a device this strategy limited that no block names any more (or whose class was
  disabled) gets its limits removed (0 / ``max``).

The tiers are the ones under the configured root (``metrics.qos.tierroot``: the parent of
``besteffort_dir``, never ``/kubepods`` as such) and those above the pods' cgroups (a node
whose pods live under another parent). A tier's limits depend only on the
rules, so unlike the hook (which wrote them as it saw a pod of the class) they follow a
rule change within a round, also while the class has no pod.

A block name that is not a device of this node: that class's tier gets nothing this
round, the plan's reason names ``resourceQOSStrategy.beClass.blkioQOS.blocks[i].name``
and the value, and one warning is logged per name. ``volumegroup`` / ``podvolume``
blocks need koordlet's local-storage inventory: skipped, one log line. Support is
detected once, when the ``kubepods`` cgroup exists (the throttle files there); without
them one line ``blkio_tiers_unsupported`` and the strategy stays idle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Final

import structlog

from hooks.blkiodev import DeviceError, io_max, throttle
from hooks.blkioplan import (
    TIERS,
    SaidOnce,
    Support,
    block_field,
    block_updates,
    detect_support,
    device_block,
    removal_updates,
)
from hooks.cgroups import CgroupError
from hooks.executor import CgroupExecutor, Update
from hooks.qos import QoSClass
from hooks.rules import Rules
from metrics.model import PodView
from metrics.qos.plan import Outcome, Plan, Priority, SetCgroup
from metrics.qos.podmemo import PodListMemo
from metrics.qos.strategy import Input, RoundContext, RoundInputs, Strategy, StrategyInit
from metrics.qos.tierroot import DEFAULT_BESTEFFORT, configured_root, kubepods_root
from runtimeproxy.hookapi import HookConfigError

log = structlog.get_logger("metrics.qos.blkio")

NAME: Final = "blkio"
_CLASSES: Final = (QoSClass.LSR, QoSClass.LS, QoSClass.BE, QoSClass.SYSTEM)


@dataclass(frozen=True, slots=True)
class TierDirs:
    """What one round found: support, and the class tiers that exist."""

    support: Support | None
    tiers: dict[PurePosixPath, QoSClass] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {"support": self.support.describe() if self.support is not None else None,
                "tiers": {str(t): c.value for t, c in sorted(self.tiers.items())}}


def tier_of(root: PurePosixPath, qos: QoSClass) -> PurePosixPath:
    names = TIERS[qos]
    return root / names[1 if root.name.endswith(".slice") else 0]


def _pod_roots(pods: Sequence[PodView]) -> frozenset[PurePosixPath]:
    roots: set[PurePosixPath] = set()
    for pod in pods:
        found = kubepods_root(PurePosixPath(pod.cgroup_dir.strip("/"))) if pod.cgroup_dir else None
        if found is not None:
            roots.add(found)
    return frozenset(roots)


class BlkioTiers(Strategy):
    name = "blkio"
    #: Nobody else writes the tiers' blkio files: between resctrl and memory-qos.
    priority = Priority.RESCTRL + 3

    def __init__(self, driver: str, sys_root: Path, root: PurePosixPath | None = None) -> None:
        self.root = root if root is not None else configured_root(DEFAULT_BESTEFFORT, driver)
        self.sys_root = sys_root
        self.support: Support | None = None
        #: tier -> devices whose limits this strategy set (to remove them when no rule names them).
        self.applied: dict[PurePosixPath, set[str]] = {}
        self._planned: dict[PurePosixPath, set[str]] = {}
        self._once = SaidOnce()
        #: The kubepods roots above the pods' cgroups, walked once per pod list (every pod's
        #: path parsed and its parents walked each round cost a third of the strategy's round).
        self._pod_roots = PodListMemo(_pod_roots)
        self.dirs: Input[TierDirs] = Input("blkio_tiers", self._read, TierDirs.describe)
        self.reads = (self.dirs,)

    def _detect(self, executor: CgroupExecutor, probe: PurePosixPath) -> Support | None:
        if self.support is not None:
            return self.support
        try:
            self.support = detect_support(executor, probe, f"blkio: {probe}")
        except CgroupError:
            return None  # no kubepods cgroup yet
        chosen = self.support.weight
        event = "blkio_tiers_detected" if self.support.throttle else "blkio_tiers_unsupported"
        log.info(event, where=self.support.where, weight=chosen[0] if chosen else None,
                 detail=self.support.describe())
        return self.support

    def _read(self, ctx: RoundContext) -> TierDirs:
        if (self.support is not None and not self.applied
                and not any(ctx.rules.for_class(c).blkio_qos.enable for c in _CLASSES)):
            # Off, nothing of ours to remove: ``plan`` writes nothing, so nothing is read
            # (issue 29: a disabled strategy costs nothing; ~1 ms a round at 110 pods).
            return TierDirs(self.support)
        roots = {self.root, *self._pod_roots(ctx.pods)}
        support = self.support
        if support is None:
            for root in sorted(roots):
                support = self._detect(ctx.executor, root)
                if support is not None:
                    break
        if support is None or not support.throttle:
            return TierDirs(support)
        tiers: dict[PurePosixPath, QoSClass] = {}
        for root in sorted(roots):
            for qos in TIERS:
                tier = tier_of(root, qos)
                if self._exists(ctx.executor, tier, support):
                    tiers[tier] = qos
        return TierDirs(support, tiers)

    @staticmethod
    def _exists(executor: CgroupExecutor, tier: PurePosixPath, support: Support) -> bool:
        probe = throttle("read_bps", "0:0") if support.version == 1 else io_max("0:0")
        try:
            return executor.path(tier, probe).is_file()
        except CgroupError:
            return False

    def _class_updates(self, qos: QoSClass, tier: PurePosixPath, rules: Rules, support: Support,
                       problems: list[str]) -> tuple[list[Update], set[str]] | None:
        """The tier's updates and the devices limited; None: a block is wrong, nothing for it."""
        cfg = rules.for_class(qos).blkio_qos
        source = f"kube-QoS tier {tier}"
        updates: list[Update] = []
        devices: set[str] = set()
        for index, block in enumerate(cfg.blocks if cfg.enable else ()):
            where = block_field(qos, index)
            if not device_block(block, where, self._once):
                continue
            try:
                dev, done = block_updates(index, block, qos, tier, source, support, self.sys_root)
            except DeviceError as exc:
                problems.append(f"{where}.name={block.name!r}: {exc}: nothing written on {tier}")
                if self._once(f"dev:{block.name}"):
                    log.warning("blkio_block_refused", block=f"{where}.name", value=block.name, error=str(exc))
                return None
            devices.add(dev)
            updates.extend(done)
        stale = self.applied.get(tier, set()) - devices
        why = f"{qos.value} class: no blkioQOS block names the device any more: limit removed"
        updates.extend(removal_updates(tier, stale, why, source, support))
        return updates, devices

    def plan(self, inputs: RoundInputs) -> Plan:
        found = inputs[self.dirs]
        info: dict[str, Any] = {"support": found.support.describe() if found.support is not None else None}
        self._planned = {}
        if found.support is None:
            return Plan(NAME, self.priority, (), info, f"no {self.root} cgroup yet: support not detected")
        if not found.support.throttle:
            return Plan(NAME, self.priority, (), info, f"block I/O QoS off: {found.support.describe()}")
        rules = inputs.rules
        if not any(rules.for_class(c).blkio_qos.enable for c in _CLASSES) and not self.applied:
            return Plan(NAME, self.priority, (), info, "blkioQOS not enabled for any class")
        actions: list[SetCgroup] = []
        problems: list[str] = []
        tiers: dict[str, Any] = {}
        for tier, qos in sorted(found.tiers.items()):
            planned = self._class_updates(qos, tier, rules, found.support, problems)
            if planned is None:
                continue
            updates, devices = planned
            self._planned[tier] = devices
            tiers[str(tier)] = {"class": qos.value, "devices": sorted(devices),
                                "removed": sorted(self.applied.get(tier, set()) - devices)}
            actions.extend(SetCgroup(u.cgroup, u.resource, u.value, u.reason) for u in updates)
        info["tiers"] = tiers
        reason = "; ".join(problems) if problems else f"class tiers from blkioQOS: {len(actions)} file(s)"
        return Plan(NAME, self.priority, tuple(actions), info, reason)

    def after(self, plan: Plan, outcomes: Sequence[Outcome], inputs: RoundInputs) -> None:
        failed = {o.action.cgroup for o in outcomes
                  if isinstance(o.action, SetCgroup) and o.result.startswith("failed")}
        for tier, devices in self._planned.items():
            if tier in failed:
                continue  # kept: its removals are planned again next round
            if devices:
                self.applied[tier] = set(devices)
            else:
                self.applied.pop(tier, None)

    def enabled(self, rules: Rules) -> bool:
        return self.support is None or self.support.throttle

    def off_reason(self, rules: Rules) -> str:
        return "" if self.enabled(rules) else "no blkio throttle files (io.max / blkio.throttle.*) on this host"


def blkio(init: StrategyInit) -> BlkioTiers:
    if init.args:
        raise HookConfigError(init.key_path, dict(init.args), "blkio takes no args")
    driver = init.executor.layout.driver
    return BlkioTiers(driver, init.host.sys, configured_root(init.config.suppress.besteffort_dir, driver))
