"""Between CRI messages and the hook API: read contexts out, write patches in.

This is the only place that knows both the protobuf shapes and the hook types,
so hooks stay independent of the CRI version. Patches are written onto the parsed
request in chain order; fields a patch leaves as ``None`` are not touched, and
protobuf keeps unknown fields, so a newer kubelet's fields survive.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from criapi import cri_v1_pb2 as cri
from runtimeproxy.hookapi import (
    ContainerInfo,
    ContainerMeta,
    ContainerPatch,
    PodInfo,
    PodMeta,
    PodPatch,
    Resources,
    ResourcesPatch,
    frozen_map,
)

_INT_FIELDS = (
    "cpu_period", "cpu_quota", "cpu_shares", "memory_limit_in_bytes", "oom_score_adj",
    "memory_swap_limit_in_bytes",
)


def resources_from_pb(res: cri.LinuxContainerResources) -> Resources:
    return Resources(
        cpu_period=res.cpu_period,
        cpu_quota=res.cpu_quota,
        cpu_shares=res.cpu_shares,
        memory_limit_in_bytes=res.memory_limit_in_bytes,
        oom_score_adj=res.oom_score_adj,
        cpuset_cpus=res.cpuset_cpus,
        cpuset_mems=res.cpuset_mems,
        memory_swap_limit_in_bytes=res.memory_swap_limit_in_bytes,
        unified=frozen_map(res.unified),
    )


def resources_to_pb(res: Resources, out: cri.LinuxContainerResources) -> None:
    for name in _INT_FIELDS:
        setattr(out, name, getattr(res, name))
    out.cpuset_cpus = res.cpuset_cpus
    out.cpuset_mems = res.cpuset_mems
    out.unified.clear()
    out.unified.update(res.unified)


def pod_info(cfg: cri.PodSandboxConfig, *, runtime_handler: str, sandbox_id: str = "") -> PodInfo:
    meta = cfg.metadata
    linux = cfg.linux
    return PodInfo(
        meta=PodMeta(name=meta.name, namespace=meta.namespace, uid=meta.uid, attempt=meta.attempt),
        id=sandbox_id,
        labels=frozen_map(cfg.labels),
        annotations=frozen_map(cfg.annotations),
        runtime_handler=runtime_handler,
        cgroup_parent=linux.cgroup_parent,
        resources=resources_from_pb(linux.resources),
        overhead=resources_from_pb(linux.overhead),
    )


def envs_map(envs: Iterable[cri.KeyValue]) -> Mapping[str, str]:
    # CRI env values are bytes on the wire; kubelet only ever sends UTF-8.
    return frozen_map({kv.key: kv.value.decode("utf-8", "replace") for kv in envs})


def container_info(cfg: cri.ContainerConfig, *, container_id: str = "") -> ContainerInfo:
    return ContainerInfo(
        meta=ContainerMeta(name=cfg.metadata.name, attempt=cfg.metadata.attempt),
        id=container_id,
        labels=frozen_map(cfg.labels),
        annotations=frozen_map(cfg.annotations),
        resources=resources_from_pb(cfg.linux.resources),
        envs=envs_map(cfg.envs),
        image=cfg.image.image,
    )


def _apply_resources(patch: ResourcesPatch | None, out: cri.LinuxContainerResources) -> None:
    if patch is None:
        return
    for name in (*_INT_FIELDS, "cpuset_cpus", "cpuset_mems"):
        value = getattr(patch, name)
        if value is not None:
            setattr(out, name, value)
    if patch.unified:
        out.unified.update(patch.unified)


def apply_pod_patch(req: cri.RunPodSandboxRequest, patch: PodPatch) -> None:
    cfg = req.config
    if patch.labels:
        cfg.labels.update(patch.labels)
    if patch.annotations:
        cfg.annotations.update(patch.annotations)
    if patch.cgroup_parent is not None:
        cfg.linux.cgroup_parent = patch.cgroup_parent
    _apply_resources(patch.resources, cfg.linux.resources)
    _apply_resources(patch.overhead, cfg.linux.overhead)


def _apply_envs(envs: Mapping[str, str] | None, out: Iterable[cri.KeyValue], cfg: cri.ContainerConfig) -> None:
    if not envs:
        return
    pending = dict(envs)
    for kv in out:
        if kv.key in pending:
            kv.value = pending.pop(kv.key).encode()
    for key, value in pending.items():
        cfg.envs.add(key=key, value=value.encode())


def apply_create_patch(req: cri.CreateContainerRequest, patch: ContainerPatch) -> None:
    cfg = req.config
    if patch.annotations:
        cfg.annotations.update(patch.annotations)
    _apply_envs(patch.envs, cfg.envs, cfg)
    _apply_resources(patch.resources, cfg.linux.resources)
    if patch.pod_cgroup_parent is not None:
        req.sandbox_config.linux.cgroup_parent = patch.pod_cgroup_parent


def apply_update_patch(req: cri.UpdateContainerResourcesRequest, patch: ContainerPatch) -> list[str]:
    """Returns the patch parts that UpdateContainerResources cannot carry (to log them)."""
    if patch.annotations:
        req.annotations.update(patch.annotations)
    _apply_resources(patch.resources, req.linux)
    dropped = []
    if patch.envs:
        dropped.append("envs")
    if patch.pod_cgroup_parent is not None:
        dropped.append("pod_cgroup_parent")
    return dropped


def merge_update(stored: Resources, update: cri.LinuxContainerResources) -> Resources:
    """The container's resources after an UpdateContainerResources call.

    kubelet sends the full desired set, but other callers send only some fields:
    zero values mean "unchanged", as Koordinator treats them (cpu_quota -1 is set)."""
    new = resources_from_pb(update)
    merged = {
        name: getattr(new, name) if getattr(new, name) else getattr(stored, name)
        for name in (*_INT_FIELDS, "cpuset_cpus", "cpuset_mems")
    }
    merged["oom_score_adj"] = stored.oom_score_adj
    unified = dict(stored.unified)
    unified.update(new.unified)
    return Resources(unified=frozen_map(unified), **merged)
