"""Pods and containers as the metrics side sees them, built from the proxy's store.

The proxy sees every RunPodSandbox/CreateContainer, so it knows the pods without
asking kubelet. A pod whose labels or annotations are bad is still measured (its
class falls back to the cgroup parent's tier) — measuring must never depend on a
hook accepting the pod; the problem is reported once per pod.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import PurePosixPath

import structlog

from hooks.annotations import BATCH_CPU, BATCH_MEMORY, extended_resource_spec
from hooks.cgroups import CgroupError, Driver, container_cgroup_dir, pod_cgroup_dir
from hooks.qos import (
    KubeQoS,
    PriorityClass,
    QoSClass,
    default_priority_class,
    kube_qos_from_cgroup_parent,
    priority_class,
    qos_class,
)
from metrics.model import ContainerView, PodView
from runtimeproxy.hookapi import ContainerInfo, HookError, PodInfo, PodSnapshot

log = structlog.get_logger("metrics.informer.pods")

_KUBE_TIER = {KubeQoS.GUARANTEED: "guaranteed", KubeQoS.BURSTABLE: "burstable", KubeQoS.BESTEFFORT: "besteffort"}
#: Kubernetes priority values from kubelet's /pods, by pod uid (optional enrichment).
PriorityLookup = Callable[[str], int | None]


def _no_priority(_uid: str) -> int | None:
    return None


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """The same records (identity: they are frozen) and the same class and priority."""
    return (len(a) == len(b) and a[0] is b[0] and a[1] == b[1] and a[2] == b[2]
            and all(x is y for x, y in zip(a[3:], b[3:], strict=True)))


class PodViews:
    """Turns the store snapshot into PodViews; remembers which pods it warned about."""

    def __init__(
        self,
        snapshot: PodSnapshot,
        *,
        driver: Driver = "cgroupfs",
        guaranteed: Callable[[], QoSClass] = lambda: QoSClass.LSR,
        priority_of: PriorityLookup = _no_priority,
    ) -> None:
        self._snapshot = snapshot
        self._driver: Driver = driver
        self._guaranteed = guaranteed
        self._priority_of = priority_of
        self._warned: set[str] = set()
        #: Sandbox id -> the inputs of its last view and the view. The store's records
        #: are frozen and replaced on change, so the same objects mean the same view:
        #: the agent asks every 10 s, and rebuilding 110 views cost ~5 ms each time.
        self._memo: dict[str, tuple[tuple[object, ...], PodView | None]] = {}

    def current(self) -> list[PodView]:
        """Running pods with a sandbox id and a usable cgroup parent, sorted by namespace/name."""
        pods, containers = self._snapshot()
        by_pod: dict[str, list[ContainerInfo]] = {}
        for _cid, (pod_id, info) in containers.items():
            by_pod.setdefault(pod_id, []).append(info)
        out: list[PodView] = []
        memo: dict[str, tuple[tuple[object, ...], PodView | None]] = {}
        guaranteed = self._guaranteed()
        for sandbox_id, pod in pods.items():
            infos = by_pod.get(sandbox_id, [])
            inputs = (pod, guaranteed, self._priority_of(pod.meta.uid), *infos)
            old = self._memo.get(sandbox_id)
            if old is not None and _same(old[0], inputs):
                view = old[1]
            else:
                view = self._view(sandbox_id, pod, infos)
            memo[sandbox_id] = (inputs, view)
            if view is not None:
                out.append(view)
        self._memo = memo
        out = _newest_sandbox(out, pods)
        live = {p.uid for p in out}
        self._warned &= live | {p.meta.uid for p in pods.values()}
        out.sort(key=lambda v: (v.namespace, v.name))
        return out

    def _warn_once(self, pod: PodInfo, event: str, **kw: object) -> None:
        if pod.meta.uid not in self._warned:
            self._warned.add(pod.meta.uid)
            log.warning(event, pod=f"{pod.meta.namespace}/{pod.meta.name}", **kw)

    def _view(self, sandbox_id: str, pod: PodInfo, containers: list[ContainerInfo]) -> PodView | None:
        if not sandbox_id or not pod.id or not pod.cgroup_parent:
            return None
        try:
            pod_dir = pod_cgroup_dir(pod.cgroup_parent, self._driver)
        except CgroupError as exc:
            self._warn_once(pod, "pod_not_measured", reason=str(exc))
            return None
        try:
            qos = qos_class(pod.labels, pod.cgroup_parent, guaranteed=self._guaranteed())
        except ValueError as exc:
            self._warn_once(pod, "pod_qos_label_ignored", reason=str(exc))
            qos = qos_class({}, pod.cgroup_parent, guaranteed=self._guaranteed())
        batch = _batch_requests(pod)
        if batch is None:
            self._warn_once(pod, "pod_batch_spec_ignored", annotation="node.koordinator.sh/extended-resource-spec")
            batch = {}
        priority = self._priority_of(pod.meta.uid)
        try:
            pclass = priority_class(pod.labels, priority)
        except ValueError as exc:
            self._warn_once(pod, "pod_priority_label_ignored", reason=str(exc))
            pclass = PriorityClass.NONE
        if pclass is PriorityClass.NONE:
            pclass = default_priority_class(qos)
        kube = kube_qos_from_cgroup_parent(pod.cgroup_parent)
        return PodView(
            uid=pod.meta.uid,
            namespace=pod.meta.namespace,
            name=pod.meta.name,
            sandbox_id=sandbox_id,
            qos=qos,
            priority=priority if priority is not None else pclass.default_priority,
            priority_class=pclass.value,
            cgroup_dir=str(pod_dir),
            containers=tuple(self._containers(pod, pod_dir, containers, batch)),
            labels=dict(pod.labels),
            annotations=dict(pod.annotations),
            batch_cpu_request_milli=sum(r.get("cpu_req", 0) for r in batch.values()),
            batch_memory_request=sum(r.get("mem_req", 0) for r in batch.values()),
            kube_qos=_KUBE_TIER.get(kube, "") if kube is not None else "",
        )

    def _containers(
        self, pod: PodInfo, pod_dir: PurePosixPath, containers: list[ContainerInfo],
        batch: Mapping[str, Mapping[str, int]],
    ) -> list[ContainerView]:
        out: list[ContainerView] = []
        for info in sorted(containers, key=lambda c: c.meta.name):
            if not info.id:
                continue
            try:
                cdir = container_cgroup_dir(pod.cgroup_parent, info.id, self._driver)
            except CgroupError:
                continue
            spec = batch.get(info.meta.name, {})
            out.append(ContainerView(
                id=info.id, name=info.meta.name, cgroup_dir=str(cdir),
                cpu_quota=info.resources.cpu_quota, cpu_period=info.resources.cpu_period,
                batch_cpu_request_milli=spec.get("cpu_req", 0), batch_cpu_limit_milli=spec.get("cpu_lim", 0),
            ))
        return out


def _batch_requests(pod: PodInfo) -> dict[str, dict[str, int]] | None:
    """Container name -> batch cpu (milli) / memory (bytes) requests and cpu limit; None if bad."""
    try:
        spec = extended_resource_spec(pod)
    except HookError:
        return None
    if spec is None:
        return {}
    out: dict[str, dict[str, int]] = {}
    for name, res in spec.containers.items():
        out[name] = {
            "cpu_req": res.requests.get(BATCH_CPU, 0),
            "mem_req": res.requests.get(BATCH_MEMORY, 0),
            "cpu_lim": res.limits.get(BATCH_CPU, 0),
        }
    return out


def _newest_sandbox(views: list[PodView], pods: Mapping[str, PodInfo]) -> list[PodView]:
    """One view per pod UID: its newest sandbox (highest attempt, then the last created).
    kubelet keeps a stopped sandbox until its garbage collection, next to the one it runs
    the pod in again (same UID, same pod cgroup): counting both would measure the pod
    twice, and an eviction could pick the stopped one (issue 28 item 4)."""
    order = {sid: i for i, sid in enumerate(pods)}
    best: dict[str, PodView] = {}
    for view in views:
        old = best.get(view.uid)
        if old is None or _rank(view, pods, order) > _rank(old, pods, order):
            best[view.uid] = view
    if len(best) == len(views):
        return views
    return [v for v in views if best[v.uid] is v]


def _rank(view: PodView, pods: Mapping[str, PodInfo], order: Mapping[str, int]) -> tuple[int, int]:
    info = pods.get(view.sandbox_id)
    return (info.meta.attempt if info is not None else 0, order.get(view.sandbox_id, -1))
