"""Between NRI messages and the hook API: contexts out, adjustments and updates in.

The NRI counterpart of ``runtimeproxy.chain.patching``: hooks see the same ``PodInfo``
and ``ContainerInfo`` whichever ingress ran them. What containerd adds to labels and
annotations (``io.cri-containerd.kind``, ``io.kubernetes.cri.*``) is dropped, so the
store holds what kubelet sent, as in proxy mode.

Only fields the chain changed are claimed in an adjustment: NRI treats a present
wrapper as a claim (and a second plugin claiming it fails the container), so the
request's values are never echoed back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from criapi import cri_v1_pb2 as cri
from criapi import nri_v1alpha1_pb2 as nri
from runtimeproxy.hookapi import ContainerInfo, ContainerMeta, PodInfo, PodMeta, Resources, frozen_map

_CONTAINERD_LABELS: Final = frozenset({"io.cri-containerd.kind"})
_CONTAINERD_ANNOTATION_PREFIX: Final = "io.kubernetes.cri."
IMAGE_ANNOTATION: Final = "io.kubernetes.cri.image-name"
#: kubelet's own annotation carrying the container's restart count (its CRI attempt).
RESTART_COUNT: Final = "io.kubernetes.container.restartCount"


def _labels(labels: Mapping[str, str]) -> Mapping[str, str]:
    return frozen_map({k: v for k, v in labels.items() if k not in _CONTAINERD_LABELS})


def _annotations(annotations: Mapping[str, str]) -> Mapping[str, str]:
    return frozen_map({k: v for k, v in annotations.items() if not k.startswith(_CONTAINERD_ANNOTATION_PREFIX)})


def resources_from_nri(res: nri.LinuxResources, oom_score_adj: int = 0) -> Resources:
    cpu, mem = res.cpu, res.memory
    return Resources(
        cpu_period=cpu.period.value,
        cpu_quota=cpu.quota.value,
        cpu_shares=cpu.shares.value,
        memory_limit_in_bytes=mem.limit.value,
        oom_score_adj=oom_score_adj,
        cpuset_cpus=cpu.cpus,
        cpuset_mems=cpu.mems,
        memory_swap_limit_in_bytes=mem.swap.value,
        unified=frozen_map(res.unified),
    )


def pod_info(pod: nri.PodSandbox) -> PodInfo:
    linux = pod.linux
    return PodInfo(
        meta=PodMeta(name=pod.name, namespace=pod.namespace, uid=pod.uid),
        id=pod.id,
        labels=_labels(pod.labels),
        annotations=_annotations(pod.annotations),
        runtime_handler=pod.runtime_handler,
        cgroup_parent=linux.cgroup_parent,
        resources=resources_from_nri(linux.pod_resources),
        overhead=resources_from_nri(linux.pod_overhead),
    )


def _envs(env: Iterable[str]) -> Mapping[str, str]:
    out: dict[str, str] = {}
    for item in env:
        key, _, value = item.partition("=")
        out[key] = value
    return frozen_map(out)


def container_info(c: nri.Container) -> ContainerInfo:
    attempt = c.annotations.get(RESTART_COUNT, "0")
    return ContainerInfo(
        meta=ContainerMeta(name=c.name, attempt=int(attempt) if attempt.isdigit() else 0),
        id=c.id,
        labels=_labels(c.labels),
        annotations=_annotations(c.annotations),
        resources=resources_from_nri(c.linux.resources, c.linux.oom_score_adj.value),
        envs=_envs(c.env),
        image=c.annotations.get(IMAGE_ANNOTATION, ""),
    )


_CRI_STATES: Final[dict[int, int]] = {
    nri.CONTAINER_CREATED: cri.CONTAINER_CREATED,
    nri.CONTAINER_RUNNING: cri.CONTAINER_RUNNING,
    nri.CONTAINER_PAUSED: cri.CONTAINER_RUNNING,
    nri.CONTAINER_STOPPED: cri.CONTAINER_EXITED,
}


def cri_state(state: int) -> int:
    """The CRI container state of an NRI one (what the store and the reconciler use)."""
    return _CRI_STATES.get(state, int(cri.CONTAINER_UNKNOWN))


def set_resources(old: Resources, new: Resources, out: nri.LinuxResources) -> list[str]:
    """Claim in ``out`` every field that differs; the names NRI 0.6.1 cannot apply are returned."""
    cannot: list[str] = []
    if new.cpu_shares != old.cpu_shares:
        out.cpu.shares.value = new.cpu_shares
    if new.cpu_quota != old.cpu_quota:
        out.cpu.quota.value = new.cpu_quota
    if new.cpu_period != old.cpu_period:
        out.cpu.period.value = new.cpu_period
    if new.cpuset_cpus != old.cpuset_cpus:
        out.cpu.cpus = new.cpuset_cpus
    if new.cpuset_mems != old.cpuset_mems:
        out.cpu.mems = new.cpuset_mems
    if new.memory_limit_in_bytes != old.memory_limit_in_bytes:
        out.memory.limit.value = new.memory_limit_in_bytes
    for key, value in new.unified.items():
        if old.unified.get(key) != value:
            out.unified[key] = value
    # 0.6.1: no oom_score_adj adjustment (the Post-start path writes it, see plugin);
    # swap is accepted but not applied (a memory limit sets swap to the same value).
    if new.oom_score_adj != old.oom_score_adj:
        cannot.append("oom_score_adj")
    if new.memory_swap_limit_in_bytes != old.memory_swap_limit_in_bytes:
        cannot.append("memory_swap_limit_in_bytes")
    return cannot


def adjustment(old: ContainerInfo, new: ContainerInfo, adjust: nri.ContainerAdjustment) -> list[str]:
    """The chain's net changes to a container being created, as an NRI adjustment;
    returns what 0.6.1 cannot carry."""
    for key, value in new.annotations.items():
        if old.annotations.get(key) != value:
            adjust.annotations[key] = value
    for key, value in new.envs.items():
        if old.envs.get(key) != value:
            adjust.env.add(key=key, value=value)
    return set_resources(old.resources, new.resources, adjust.linux.resources)


def update(container_id: str, old: Resources, new: Resources) -> tuple[nri.ContainerUpdate | None, list[str]]:
    """The chain's net resource changes to a running container, as an NRI update
    (None when nothing NRI can carry changed)."""
    upd = nri.ContainerUpdate(container_id=container_id)
    cannot = set_resources(old, new, upd.linux.resources)
    return (upd if upd.linux.resources.ByteSize() else None), cannot
