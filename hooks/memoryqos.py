"""Memory QoS: memory.min / memory.low / memory.high per container and pod.

Why: on a co-located node the kernel reclaims memory from whoever it finds first; a
latency-sensitive pod's page cache and anon memory go as easily as a batch job's.
koordlet's memory QoS (``CgroupReconcile``, reference §4.4) protects a share of each
container's request (``memory.min``: never reclaimed, ``memory.low``: reclaimed last)
and throttles it before its limit (``memory.high``: direct reclaim above it), from
``resourceQOSStrategy.<class>.memoryQOS`` and the pod annotation
``koordinator.sh/memoryQOS``. Formulas and the annotation: ``hooks.memoryqoscalc``.

Inputs, per container (the proxy never sees a pod spec, so the request comes from what
the node has): a BE pod's ``kubernetes.io/batch-memory`` request/limit from
``node.koordinator.sh/extended-resource-spec`` (as koordlet); else a ``memory`` entry
there; else the limit from the CRI request (or the container cgroup's memory limit) and
the request from kubelet's own ``memory.min`` in the CRI ``unified`` map (kubelet's
MemoryQoS gate sets it to the request), or = the limit for a Guaranteed pod, else 0
(koordlet: "use 0 if requests.memory is not set"). An unlimited container's
``memory.high`` is measured against ``args.node_allocatable_memory`` (koordlet: the
Node's allocatable) or, unset, the node's MemTotal.

Writes, at PostStartContainer and ReconcileContainer (the container's cgroup exists
then), as one leveled update: the pod (min/low of its containers' summed requests,
Anolis extras), the container (min, low, high, extras) — the pod raised before the
container, the container lowered before the pod. The kube-QoS tiers (``kubepods``,
burstable, besteffort: min/low = the sum of their pods') are the QoS strategy
``memory-qos`` (``metrics.qos.memoryqos``), which sees every pod every round; a hook
sees only the pods it is called for (all of them only after a reconciler pass).

Support is detected once, at the first container, and logged in one line: the
``memory.min`` file in the pod's parent cgroup (cgroup v2: upstream; v1: only Anolis
kernels have it). Without it the hook is off: nothing written, nothing more logged.
The Anolis-only files (wmark_*, priority, use_priority_oom; oom.group on v1) are
written only where they exist. Nothing is written while no class rule and no pod
annotation enables memory QoS; once one did, a pod whose config is off gets koordlet's
None values back (min 0, low 0, high max).

args: ``cgroup_driver``, ``cgroup_version`` (as every cgroup hook),
``node_allocatable_memory`` (bytes, default: MemTotal), ``dry_run`` (bool, default
false: nothing is written; each planned write is reported once per planned value,
``(dry-run, not written)`` in ``explain`` and one ``hook_dry_run`` log line, as every
hook's dry-run, ``hooks.dryrun``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Final

import structlog

from hooks.annotations import BATCH_MEMORY, extended_resource_spec
from hooks.cgroups import (
    MEMORY_LIMIT,
    CgroupError,
    CgroupGoneError,
    Resource,
    container_cgroup_dir,
    pod_cgroup_dir,
)
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
from hooks.memoryqoscalc import (
    EXTRAS,
    MEMORY_HIGH,
    MEMORY_LOW,
    MEMORY_MIN,
    MEMORY_QOS_ANNOTATION,
    UNLIMITED,
    MemorySpec,
    MemoryValues,
    container_values,
    describe,
    disabled_values,
    pod_config,
    pod_values,
)
from hooks.qos import KubeQoS, QoSClass, kube_qos_from_cgroup_parent, pod_name
from hooks.rules import LiveRules, MemoryQOS, Rules
from runtimeproxy.config.configvalues import reject_unknown
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerInfo,
    ContainerPatch,
    HookConfigError,
    HookError,
    HookInit,
    HostWrite,
    LivePods,
    PodContext,
    PodInfo,
)

_ARGS: Final = frozenset({"cgroup_driver", "cgroup_version", "node_allocatable_memory", "dry_run"})
_SHOWN: Final = 200
_CLASSES: Final = (QoSClass.LSR, QoSClass.LS, QoSClass.BE, QoSClass.SYSTEM)

log = structlog.get_logger("hooks.memoryqos")


@dataclass(frozen=True, slots=True)
class Support:
    """What the kernel offers, detected once: the files present in ``where``."""

    files: frozenset[str]
    where: str
    version: int

    @property
    def enabled(self) -> bool:
        return MEMORY_MIN.name in self.files

    def describe(self) -> str:
        if not self.enabled:
            return (f"memory QoS off: cgroup v{self.version} without memory.min in {self.where} "
                    "(upstream v1 has none; Anolis kernels add it)")
        return f"memory QoS files in {self.where}: {', '.join(sorted(self.files))}"


@dataclass(slots=True)
class _PodRecord:
    cgroup: PurePosixPath
    kube: KubeQoS | None
    config: MemoryQOS
    containers: dict[str, MemorySpec] = field(default_factory=dict)


def meminfo_total(text: str) -> int:
    """MemTotal in bytes from /proc/meminfo text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            return int(parts[1]) * 1024 if len(parts) >= 2 and parts[1].isdigit() else 0
    return 0


class MemoryQoS:
    """Stages: PostStartContainer, ReconcileContainer, PostStopPodSandbox."""

    def __init__(self, init: HookInit) -> None:
        args: dict[str, Any] = dict(init.args)
        reject_unknown(args, _ARGS, f"{init.key_path}.")
        allocatable = args.get("node_allocatable_memory")
        if allocatable is not None and (isinstance(allocatable, bool) or not isinstance(allocatable, int)
                                        or allocatable <= 0):
            raise HookConfigError(f"{init.key_path}.node_allocatable_memory", allocatable,
                                  "expected a positive number of bytes")
        self.dry_run = dry_run_arg(init, args)
        self._allocatable: int | None = allocatable
        self._meminfo = init.host.proc / "meminfo"
        self._rules = LiveRules(init)
        self.executor = CgroupExecutor(cgroup_layout(init, args), backoff=init.services.write_backoff)
        self._lock = threading.Lock()
        self._support: Support | None = None
        self._pods: dict[str, _PodRecord] = {}
        self._ledger = DryRunLedger("memory-qos")
        self._was_enabled = any(self.rules.for_class(c).memory_qos.enable for c in _CLASSES)

    @property
    def rules(self) -> Rules:
        return self._rules()

    @property
    def support(self) -> Support | None:
        """What was detected at the first container (``None`` before)."""
        return self._support

    @property
    def allocatable(self) -> int:
        if self._allocatable is None:
            try:
                self._allocatable = meminfo_total(self._meminfo.read_text())
            except OSError as exc:
                log.warning("memory_qos_no_meminfo", path=str(self._meminfo), error=str(exc),
                            effect="memory.high of unlimited containers stays max")
                self._allocatable = 0
        return self._allocatable

    # --- decisions ---------------------------------------------------------------

    def config(self, pod: PodInfo) -> tuple[MemoryQOS, str, QoSClass]:
        qos = self.rules.qos_of(pod)
        raw = pod.annotations.get(MEMORY_QOS_ANNOTATION)
        try:
            cfg, why = pod_config(self.rules.for_class(qos).memory_qos, qos, raw)
        except ValueError as exc:
            shown = raw if raw is None or len(raw) <= _SHOWN else raw[:_SHOWN] + "..."
            raise HookError(f"pod {pod_name(pod)}: annotation {MEMORY_QOS_ANNOTATION}={shown!r}: {exc}") from exc
        return cfg, why, qos

    def container_spec(self, pod: PodInfo, container: ContainerInfo, qos: QoSClass, kube: KubeQoS | None,
                       cgroup: PurePosixPath) -> MemorySpec:
        """The container's memory request and limit, from the best source the node has."""
        spec = extended_resource_spec(pod)  # HookError naming pod/key/value when malformed
        res = spec.containers.get(container.meta.name) if spec is not None else None
        if res is not None:
            for name in ((BATCH_MEMORY,) if qos is QoSClass.BE else ()) + ("memory",):
                if name in res.requests or name in res.limits:
                    limit = res.limits.get(name, UNLIMITED)
                    return MemorySpec(res.requests.get(name, 0), limit if limit > 0 else UNLIMITED,
                                      f"{name} from node.koordinator.sh/extended-resource-spec")
        limit = container.resources.memory_limit_in_bytes
        limit_from = "CRI memory_limit_in_bytes"
        if limit <= 0:
            try:
                current = MEMORY_LIMIT.parse(self.executor.read(cgroup, MEMORY_LIMIT), self.executor.layout.version)
                limit, limit_from = int(current), "container cgroup memory limit"
            except (CgroupError, ValueError):
                limit = UNLIMITED
        limit = limit if limit > 0 else UNLIMITED
        kubelet_min = container.resources.unified.get("memory.min", "")
        if kubelet_min.isdigit():
            return MemorySpec(int(kubelet_min), limit, f"request = kubelet's unified memory.min; limit: {limit_from}")
        if kube is KubeQoS.GUARANTEED and limit > 0:
            return MemorySpec(limit, limit, f"Guaranteed pod: request = limit ({limit_from})")
        return MemorySpec(0, limit, f"no memory request known (0); limit: {limit_from}")

    def _detect(self, pod_dir: PurePosixPath, source: str) -> Support:
        with self._lock:
            if self._support is not None:
                return self._support
            probe = pod_dir.parent if len(pod_dir.parts) > 1 else pod_dir
            path = self.executor.path(probe, MEMORY_MIN, source)
            if not path.parent.is_dir():
                raise CgroupGoneError(f"{source}: cgroup {path.parent} does not exist (gone or not created yet)")
            files = frozenset(r.name for r in (MEMORY_MIN, MEMORY_LOW, MEMORY_HIGH, *EXTRAS)
                              if self.executor.path(probe, r, source).is_file())
            self._support = Support(files, str(path.parent), self.executor.layout.version)
            log.info("memory_qos_detected", enabled=self._support.enabled, where=self._support.where,
                     files=sorted(files), detail=self._support.describe())
            return self._support

    def _updates(self, cgroup: PurePosixPath, values: MemoryValues, why: str, source: str,
                 files: frozenset[str]) -> list[Update]:
        wanted: list[tuple[Resource, int]] = [(MEMORY_MIN, values.min), (MEMORY_LOW, values.low)]
        if values.high is not None:
            wanted.append((MEMORY_HIGH, values.high))
        wanted.extend(values.extras)
        return [Update(cgroup, r, v, f"{r.name} {v if v != UNLIMITED else 'max'}: {why}", source)
                for r, v in wanted if r.name in files]

    def plan(self, pod: PodInfo, container: ContainerInfo) -> list[list[Update]] | None:
        """The leveled update for a container (tiers, pod, container); None when the hook
        has nothing to do (memory QoS never enabled, or the kernel lacks it)."""
        cfg, why, qos = self.config(pod)
        if not cfg.enable and not self._was_enabled:
            return None
        try:
            pod_dir = pod_cgroup_dir(pod.cgroup_parent, self.executor.layout.driver)
            cdir = container_cgroup_dir(pod.cgroup_parent, container.id, self.executor.layout.driver)
        except CgroupError as exc:
            raise HookError(f"pod {pod_name(pod)}: {exc}") from exc
        source = f"pod {pod_name(pod)}: cgroup_parent {pod.cgroup_parent!r}"
        support = self._detect(pod_dir, source)
        if not support.enabled:
            return None
        if cfg.enable:
            self._was_enabled = True
        kube = kube_qos_from_cgroup_parent(pod.cgroup_parent)
        spec = self.container_spec(pod, container, qos, kube, cdir)
        with self._lock:
            record = self._pods.get(pod.meta.uid)
            if record is None or record.cgroup != pod_dir:
                record = self._pods[pod.meta.uid] = _PodRecord(pod_dir, kube, cfg)
            record.config = cfg
            record.containers[container.meta.name] = spec
            specs = list(record.containers.values())
        label = qos.value or "no-class"
        inputs = f"{label} pod, {why}: {describe(cfg)}"
        if cfg.enable:
            cvalues = container_values(spec, cfg, self.allocatable)
            pvalues = pod_values(specs, cfg)
        else:
            cvalues = pvalues = disabled_values()
            inputs = f"{label} pod, {why}: memory QoS off, koordlet's None values"
        levels: list[list[Update]] = []
        total = sum(max(s.request, 0) for s in specs)
        levels.append(self._updates(pod_dir, pvalues, f"{inputs}; pod request {total} (sum of containers)",
                                    source, support.files))
        limit = "none" if spec.limit == UNLIMITED else str(spec.limit)
        levels.append(self._updates(cdir, cvalues, f"{inputs}; request {spec.request}, limit {limit} "
                                    f"({spec.source}), allocatable {self.allocatable}", source, support.files))
        return levels

    # --- stages --------------------------------------------------------------------

    def _apply(self, ctx: ContainerContext, reconcile: bool) -> ContainerPatch | None:
        levels = self.plan(ctx.pod, ctx.container)
        if levels is None:
            return None
        reason = levels[-1][0].reason if levels[-1] else "memory QoS"
        if self.dry_run:
            planned = self._ledger.report(planned_writes(self.executor, [u for level in levels for u in level]),
                                          pod=pod_name(ctx.pod), container=ctx.container.meta.name)
            return ContainerPatch(reason=patch_reason(reason), writes=planned) if planned else None
        writes: tuple[HostWrite, ...] = host_writes(self.executor.leveled_update(levels))
        if reconcile and not writes:
            return None
        return ContainerPatch(reason=f"{reason}{' (reconciled)' if reconcile else ''}", writes=writes)

    def host_support(self) -> HostSupport:
        """check-config's plan: whether this host's memory cgroups have memory.min."""
        try:
            support = self._detect(kubepods_probe(self.executor.layout), PROBE_SOURCE)
        except CgroupError as exc:
            return unknown_until_a_pod(exc)
        return ("on" if support.enabled else "off"), support.describe()

    def post_start_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        return self._apply(ctx, reconcile=False)

    def reconcile_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        return self._apply(ctx, reconcile=True)

    def sweep_orphans(self, live: LivePods) -> list[str]:
        """Saved per-pod records of pods that no longer exist (a PostStopPodSandbox missed)."""
        with self._lock:
            gone = [uid for uid in self._pods if uid not in live.uids]
            for uid in gone:
                del self._pods[uid]
        return [f"memory-qos record of pod {uid} dropped (pod no longer exists)" for uid in gone]

    def post_stop_pod_sandbox(self, ctx: PodContext) -> None:
        """The pod's record goes (its containers' requests)."""
        with self._lock:
            self._pods.pop(ctx.pod.meta.uid, None)
