"""Block I/O QoS: per-device throttles and weights for a QoS class's tier and pods.

Why: one BE pod streaming to the node's disk can starve the latency-sensitive pods
reading from it; CPU and memory isolation do nothing about that. koordlet's
``BlkIOReconcile`` (reference §4) throttles the classes per device from
``resourceQOSStrategy.<class>.blkioQOS.blocks`` (``hooks.blkiorules``)::

    beClass: {blkioQOS: {enable: true, blocks: [
      {name: /dev/vdb, type: device, ioCfg: {readBPS: 104857600, writeIOPS: 2000, ioWeightPercent: 50}}]}}

Where: this hook throttles LSR / LSE pods (Guaranteed: their tier is the ``kubepods``
root, which every pod shares) in their own pod cgroup, as each is seen
(PreRunPodSandbox: kubelet created the pod cgroup before; ReconcilePodSandbox: drift,
rule changes, pods from before the proxy). The class tiers (BE → ``kubepods/besteffort``,
LS → ``kubepods/burstable``: the whole tier shares the limit, as koordlet throttles the
QoS directory) are the QoS strategy ``blkio`` (``metrics.qos.blkio``), every round from
the rules alone: a tier's limits follow a rule change within a second, also while no
pod of its class exists (koordlet's ``BlkIOReconcile`` works per class tier the same way).
The helpers (``detect_support``, ``block_updates``, ``removal_updates``) are shared: ``hooks.blkioplan``.

What, per block (``type: device``; the name resolved to ``major:minor`` through the
injected ``/sys``, see ``hooks.blkiodev``): cgroup v1 ``blkio.throttle.{read,write}_
{bps,iops}_device`` = ``<maj:min> <value>``; v2 ``io.max`` = ``<maj:min> rbps=.. wbps=..
riops=.. wiops=..`` (0 = ``max``: no limit). ``ioWeightPercent``, when set: v1
``blkio.cost.weight`` (Anolis iocost; else ``blkio.bfq.weight_device``), v2
``io.weight``, ``<maj:min> <percent>`` (100 is the kernel's default weight). A device
this hook limited that a rule no longer names (or whose class was disabled) gets its
limits removed (0 / ``max``). ``volumegroup`` and ``podvolume`` blocks need koordlet's
local-storage inventory (LVM, kubelet volumes), which this agent does not have: they are
skipped with one log line. The root class's blk-iocost QoS/model is not written.

Detected once, at the first pod, and logged in one line: the throttle files (v1
``blkio`` controller, v2 ``io.max``) and a weight file in the pod's parent cgroup.
Without throttle files the hook writes nothing. A block name that is not a device of
this node is a HookError naming ``…blkioQOS.blocks[i].name`` and the value (nothing is
written for the pod; repeats are logged below warning). Nothing is written while no
class enables ``blkioQOS``.

args: ``cgroup_driver``, ``cgroup_version``, ``dry_run`` (nothing written; each planned
write reported once per planned value, ``(dry-run, not written)`` in ``explain`` and one
``hook_dry_run`` log line, as every hook's dry-run, ``hooks.dryrun``).
"""

from __future__ import annotations

import threading
from pathlib import PurePosixPath
from typing import Any, Final

import structlog

from hooks.blkiodev import (
    DeviceError,
)
from hooks.blkioplan import SaidOnce, Support, block_field, block_updates, detect_support, device_block, removal_updates
from hooks.blkiorules import BlkioBlock
from hooks.cgroups import CgroupError, pod_cgroup_dir
from hooks.dryrun import DryRunLedger, dry_run_arg, patch_reason, planned_writes
from hooks.executor import CgroupExecutor, Update
from hooks.hookargs import (
    PROBE_SOURCE,
    HostSupport,
    cgroup_layout,
    host_writes,
    kubepods_probe,
    unknown_until_a_pod,
)
from hooks.qos import QoSClass, pod_name
from hooks.rules import LiveRules, Rules
from runtimeproxy.config.configvalues import reject_unknown
from runtimeproxy.hookapi import HookError, HookInit, HostRoots, LivePods, PodContext, PodInfo, PodPatch

_ARGS: Final = frozenset({"cgroup_driver", "cgroup_version", "dry_run"})
_CLASSES: Final = (QoSClass.LSR, QoSClass.LS, QoSClass.BE, QoSClass.SYSTEM)

log = structlog.get_logger("hooks.blkio")


class Blkio:
    """Stages: PreRunPodSandbox, ReconcilePodSandbox; and ``sweep_orphans`` (gone pods' records)."""

    def __init__(self, init: HookInit) -> None:
        args: dict[str, Any] = dict(init.args)
        reject_unknown(args, _ARGS, f"{init.key_path}.")
        self.dry_run = dry_run_arg(init, args)
        self._host: HostRoots = init.host
        self._rules = LiveRules(init)
        self.executor = CgroupExecutor(cgroup_layout(init, args), backoff=init.services.write_backoff)
        self._lock = threading.Lock()
        self._support: Support | None = None
        #: target cgroup -> devices this hook set limits on (to remove them when a rule drops one).
        self._applied: dict[PurePosixPath, set[str]] = {}
        #: target cgroup -> the uid of the pod it is (the sweep drops gone pods' entries).
        self._owners: dict[PurePosixPath, str] = {}
        self._once = SaidOnce()
        self._ledger = DryRunLedger("blkio")

    @property
    def rules(self) -> Rules:
        return self._rules()

    @property
    def support(self) -> Support | None:
        return self._support

    def _detect(self, pod_dir: PurePosixPath, source: str) -> Support:
        with self._lock:
            if self._support is not None:
                return self._support
            probe = pod_dir.parent if len(pod_dir.parts) > 1 else pod_dir
            self._support = detect_support(self.executor, probe, source)
            chosen = self._support.weight
            log.info("blkio_detected", enabled=self._support.throttle, where=self._support.where,
                     weight=chosen[0] if chosen else None, detail=self._support.describe())
            return self._support

    def target(self, pod: PodInfo, qos: QoSClass, pod_dir: PurePosixPath) -> PurePosixPath | None:
        """Where the class's limits go for this pod: its own cgroup for LSR / LSE; None for
        the others (the BE and LS tiers are the ``blkio`` QoS strategy's)."""
        return pod_dir if qos in (QoSClass.LSR, QoSClass.LSE) else None

    def _block_updates(self, index: int, block: BlkioBlock, qos: QoSClass, target: PurePosixPath,
                       source: str, support: Support) -> tuple[str, list[Update]] | None:
        where = block_field(qos, index)
        if not device_block(block, where, self._once):
            return None
        try:
            return block_updates(index, block, qos, target, source, support, self._host.sys)
        except DeviceError as exc:
            error = HookError(f"{where}.name={block.name!r}: {exc}")
            error.repeat = not self._once(f"dev:{block.name}")
            raise error from exc

    def plan(self, pod: PodInfo) -> tuple[PurePosixPath, list[Update], set[str]] | None:
        """The pod's target and the updates there (including removals of devices no rule
        names any more); None when there is nothing to do."""
        rules = self.rules
        qos = rules.qos_of(pod)
        cfg = rules.for_class(qos).blkio_qos
        if not any(rules.for_class(c).blkio_qos.enable for c in _CLASSES) and not self._applied:
            return None
        try:
            pod_dir = pod_cgroup_dir(pod.cgroup_parent, self.executor.layout.driver)
        except CgroupError as exc:
            raise HookError(f"pod {pod_name(pod)}: {exc}") from exc
        target = self.target(pod, qos, pod_dir)
        if target is None:
            return None
        source = f"pod {pod_name(pod)}: cgroup_parent {pod.cgroup_parent!r}"
        support = self._detect(pod_dir, source)
        if not support.throttle:
            return None
        updates: list[Update] = []
        devices: set[str] = set()
        for index, block in enumerate(cfg.blocks if cfg.enable else ()):
            done = self._block_updates(index, block, qos, target, source, support)
            if done is not None:
                devices.add(done[0])
                updates.extend(done[1])
        with self._lock:
            stale = sorted(self._applied.get(target, set()) - devices)
        for dev in stale:
            why = f"{qos.value or 'no-class'} class: no blkioQOS block names {dev} any more: limit removed"
            updates.extend(removal_updates(target, (dev,), why, source, support))
        if not updates:
            return None
        return target, updates, devices

    def _apply(self, pod: PodInfo, reconcile: bool) -> PodPatch | None:
        planned = self.plan(pod)
        if planned is None:
            return None
        target, updates, devices = planned
        reason = updates[0].reason
        if self.dry_run:
            dry = self._ledger.report(planned_writes(self.executor, updates), pod=pod_name(pod))
            return PodPatch(reason=patch_reason(reason), writes=dry) if dry else None
        writes = host_writes(self.executor.apply(updates))
        with self._lock:
            if devices:
                self._applied[target] = set(devices)
                self._owners[target] = pod.meta.uid
            else:
                self._applied.pop(target, None)
                self._owners.pop(target, None)
        if reconcile and not writes:
            return None
        return PodPatch(reason=f"{reason}{' (reconciled)' if reconcile else ''}", writes=writes)

    def host_support(self) -> HostSupport:
        """check-config's plan: whether this host's blkio cgroups have the throttle files."""
        try:
            support = self._detect(kubepods_probe(self.executor.layout), PROBE_SOURCE)
        except CgroupError as exc:
            return unknown_until_a_pod(exc)
        return ("on" if support.throttle else "off"), support.describe()

    def pre_run_pod_sandbox(self, ctx: PodContext) -> PodPatch | None:
        return self._apply(ctx.pod, reconcile=False)

    def reconcile_pod_sandbox(self, ctx: PodContext) -> PodPatch | None:
        return self._apply(ctx.pod, reconcile=True)

    def sweep_orphans(self, live: LivePods) -> list[str]:
        """The limits remembered for pods that no longer exist. The kernel drops a cgroup's
        throttle rules with the cgroup (kubelet removes the pod's); what stays is this hook's
        record of them, which would grow with every pod the node ever ran."""
        with self._lock:
            gone = [t for t, uid in self._owners.items() if uid not in live.uids]
            for target in gone:
                del self._owners[target]
                self._applied.pop(target, None)
        return [f"blkio limits remembered for {target} dropped (pod no longer exists)" for target in gone]
