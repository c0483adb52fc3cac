"""What the proxy knows about pods and containers, and how it relearns it.

Stop/Start/Update calls carry only an id, so hooks at those stages need the
context saved at Run/Create time. After a proxy restart the store is rebuilt from
the backend (list + verbose status), including cgroup parents, resources and envs,
which Koordinator's proxy loses. Records are immutable; the store only swaps them.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

import structlog

from criapi import cri_v1_pb2 as cri
from runtimeproxy.backend import Backend, CallError, Code
from runtimeproxy.chain import Change
from runtimeproxy.hookapi import ContainerInfo, PodInfo, Resources, frozen_map
from runtimeproxy.patching import container_info, pod_info

log = structlog.get_logger("runtimeproxy.store")

RUNTIME: Final = "/runtime.v1.RuntimeService/"
CHANGES_PER_POD: Final = 256


@dataclass(frozen=True, slots=True)
class ContainerRecord:
    pod_id: str
    info: ContainerInfo


class Store:
    """Single-writer (the event loop); readers in other threads use ``snapshot()``."""

    def __init__(self) -> None:
        self._pods: dict[str, PodInfo] = {}
        self._containers: dict[str, ContainerRecord] = {}
        self._changes: dict[str, collections.deque[Change]] = {}

    def put_pod(self, pod: PodInfo) -> None:
        self._pods[pod.id] = pod

    def pod(self, sandbox_id: str) -> PodInfo | None:
        return self._pods.get(sandbox_id)

    def remove_pod(self, sandbox_id: str) -> PodInfo | None:
        for cid in [c for c, rec in self._containers.items() if rec.pod_id == sandbox_id]:
            del self._containers[cid]
        pod = self._pods.pop(sandbox_id, None)
        if pod is not None and not any(p.meta.uid == pod.meta.uid for p in self._pods.values()):
            self._changes.pop(pod.meta.uid, None)
        return pod

    def put_container(self, pod_id: str, info: ContainerInfo) -> None:
        self._containers[info.id] = ContainerRecord(pod_id, info)

    def container(self, container_id: str) -> ContainerRecord | None:
        return self._containers.get(container_id)

    def update_container_resources(self, container_id: str, resources: Resources) -> None:
        rec = self._containers.get(container_id)
        if rec is not None:
            self._containers[container_id] = replace(rec, info=replace(rec.info, resources=resources))

    def remove_container(self, container_id: str) -> ContainerRecord | None:
        return self._containers.pop(container_id, None)

    def snapshot(self) -> tuple[dict[str, PodInfo], dict[str, tuple[str, ContainerInfo]]]:
        """Copies, safe to hand to other threads (collectors, reconcilers)."""
        return dict(self._pods), {cid: (rec.pod_id, rec.info) for cid, rec in self._containers.items()}

    def record_changes(self, pod_uid: str, changes: tuple[Change, ...]) -> None:
        """Keep a pod's change log; ignored once the pod is gone (Post of RemovePodSandbox)."""
        if changes and any(p.meta.uid == pod_uid for p in self._pods.values()):
            self._changes.setdefault(pod_uid, collections.deque(maxlen=CHANGES_PER_POD)).extend(changes)
            for c in changes:  # what `explain` shows, also in the debug log
                log.debug("change_recorded", hook=c.hook, stage=c.stage, target=c.target, old=c.old, new=c.new,
                          reason=c.reason)

    def changes(self, pod_uid: str) -> list[Change]:
        return list(self._changes.get(pod_uid, ()))

    def find_pod(self, namespace: str, name: str) -> PodInfo | None:
        """The newest sandbox of a pod (by attempt)."""
        found = [p for p in self._pods.values() if p.meta.namespace == namespace and p.meta.name == name]
        return max(found, key=lambda p: p.meta.attempt, default=None)


# --- rebuilding from the backend -------------------------------------------------


async def _call(backend: Backend, method: str, request: Any, response_type: type[Any], timeout: float) -> Any:
    reply = await backend.unary(RUNTIME + method, request.SerializeToString(), timeout=timeout)
    out = response_type()
    out.ParseFromString(reply.payload)
    return out


def _verbose_info(info: Mapping[str, str]) -> dict[str, Any]:
    try:
        data = json.loads(info.get("info", "{}"))
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _pb_from_json(data: object, message: Any) -> None:
    """Fill a message from containerd's JSON of a CRI struct (Go json tags are the
    proto field names; unknown keys are ignored rather than failing the rebuild)."""
    from google.protobuf import json_format

    if isinstance(data, dict):
        try:
            json_format.ParseDict(data, message, ignore_unknown_fields=True)
        except json_format.ParseError as exc:
            log.warning("store_rebuild_parse", message_type=type(message).__name__, error=str(exc))


def _spec_resources(spec: Mapping[str, Any]) -> Resources:
    """Resources from the OCI runtime spec, for runtimes whose info lacks the CRI config."""
    res = spec.get("linux", {}).get("resources", {}) if isinstance(spec.get("linux"), dict) else {}
    cpu = res.get("cpu", {}) or {}
    mem = res.get("memory", {}) or {}
    return Resources(
        cpu_period=int(cpu.get("period", 0) or 0),
        cpu_quota=int(cpu.get("quota", 0) or 0),
        cpu_shares=int(cpu.get("shares", 0) or 0),
        memory_limit_in_bytes=int(mem.get("limit", 0) or 0),
        cpuset_cpus=str(cpu.get("cpus", "") or ""),
        cpuset_mems=str(cpu.get("mems", "") or ""),
        unified=frozen_map(res.get("unified") or {}),
    )


async def load_pod(backend: Backend, sandbox_id: str, *, timeout: float = 5.0) -> PodInfo | None:
    """One sandbox from PodSandboxStatus(verbose)."""
    try:
        resp = await _call(
            backend, "PodSandboxStatus", cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True),
            cri.PodSandboxStatusResponse, timeout,
        )
    except CallError as exc:
        if exc.code is not Code.NOT_FOUND:
            log.warning("store_load_pod_failed", sandbox_id=sandbox_id, error=str(exc))
        return None
    info = _verbose_info(resp.info)
    cfg = cri.PodSandboxConfig()
    _pb_from_json(info.get("config"), cfg)
    status = resp.status
    # The status is authoritative for identity; the verbose config adds cgroup parent and resources.
    cfg.metadata.CopyFrom(status.metadata)
    cfg.labels.clear()
    cfg.labels.update(status.labels)
    cfg.annotations.clear()
    cfg.annotations.update(status.annotations)
    handler = status.runtime_handler or str(info.get("runtimeHandler", ""))
    return pod_info(cfg, runtime_handler=handler, sandbox_id=status.id)


async def load_container(backend: Backend, container_id: str, *, timeout: float = 5.0) -> ContainerRecord | None:
    """One container from ContainerStatus(verbose)."""
    try:
        resp = await _call(
            backend, "ContainerStatus", cri.ContainerStatusRequest(container_id=container_id, verbose=True),
            cri.ContainerStatusResponse, timeout,
        )
    except CallError as exc:
        if exc.code is not Code.NOT_FOUND:
            log.warning("store_load_container_failed", container_id=container_id, error=str(exc))
        return None
    info = _verbose_info(resp.info)
    cfg = cri.ContainerConfig()
    raw = info.get("config")
    envs = raw.get("envs") if isinstance(raw, dict) else None
    if isinstance(raw, dict) and isinstance(envs, list):
        # containerd writes KeyValue.value as a plain JSON string, but our proto field is
        # bytes, which json_format would base64-decode (failing and dropping the rest).
        raw = {k: v for k, v in raw.items() if k != "envs"}
    _pb_from_json(raw, cfg)
    for kv in envs if isinstance(envs, list) else ():
        if isinstance(kv, dict):
            cfg.envs.add(key=str(kv.get("key", "")), value=str(kv.get("value", "")).encode())
    status = resp.status
    cfg.metadata.CopyFrom(status.metadata)
    cfg.labels.clear()
    cfg.labels.update(status.labels)
    cfg.annotations.clear()
    cfg.annotations.update(status.annotations)
    if not cfg.image.image:
        cfg.image.image = status.image.image
    record = container_info(cfg, container_id=status.id)
    spec = info.get("runtimeSpec")
    if not cfg.HasField("linux") and isinstance(spec, dict):
        record = replace(record, resources=_spec_resources(spec))
    pod_id = str(info.get("sandboxID", ""))
    return ContainerRecord(pod_id=pod_id, info=record)


async def rebuild(store: Store, backend: Backend, *, timeout: float = 5.0) -> tuple[int, int]:
    """Relearn every sandbox and container; returns (pods, containers) loaded."""
    pods = await _call(backend, "ListPodSandbox", cri.ListPodSandboxRequest(), cri.ListPodSandboxResponse, timeout)
    n_pods = 0
    for item in pods.items:
        pod = await load_pod(backend, item.id, timeout=timeout)
        if pod is not None:
            store.put_pod(pod)
            n_pods += 1
    containers = await _call(
        backend, "ListContainers", cri.ListContainersRequest(), cri.ListContainersResponse, timeout
    )
    n_containers = 0
    for c in containers.containers:
        rec = await load_container(backend, c.id, timeout=timeout)
        if rec is not None:
            store.put_container(rec.pod_id or c.pod_sandbox_id, rec.info)
            n_containers += 1
    return n_pods, n_containers
