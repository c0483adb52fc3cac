"""What the proxy knows about pods and containers, and how it relearns it.

Stop/Start/Update calls carry only an id, so hooks at those stages need the
context saved at Run/Create time. After a proxy restart the store is rebuilt from
the backend (list + verbose status), including cgroup parents, resources and envs,
which Koordinator's proxy loses. Records are immutable; the store only swaps them.

``resync`` keeps it true afterwards: objects removed or created behind the proxy's
back (directly at containerd, or while the proxy answered UNAVAILABLE) are dropped or
learnt, and states (ready/not ready, created/running/exited) follow containerd's. It
costs two List calls; verbose status is asked only for objects the store lacks.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final

import structlog

from criapi import cri_v1_pb2 as cri
from runtimeproxy.backend import Backend, CallError, Code
from runtimeproxy.chain.hookchain import Change
from runtimeproxy.chain.patching import container_info, pod_info
from runtimeproxy.hookapi import ContainerInfo, PodInfo, Resources, frozen_map

if TYPE_CHECKING:
    from runtimeproxy.state.history import ChangeHistory
    from runtimeproxy.state.ledger import ObjectLedger

log = structlog.get_logger("runtimeproxy.store")

RUNTIME: Final = "/runtime.v1.RuntimeService/"
CHANGES_PER_POD: Final = 256
#: Removed ids remembered so a resync whose List predates the removal does not bring them back.
_REMOVED_KEPT: Final = 4096
#: States the reconciler leaves alone: kubelet removes their cgroups first.
INACTIVE_POD_STATES: Final = frozenset({cri.SANDBOX_NOTREADY})
INACTIVE_CONTAINER_STATES: Final = frozenset({cri.CONTAINER_CREATED, cri.CONTAINER_EXITED})


@dataclass(frozen=True, slots=True)
class ContainerRecord:
    pod_id: str
    info: ContainerInfo


class Store:
    """Single-writer (the event loop); readers in other threads use ``snapshot()``.

    States are CRI enum values (``cri.SANDBOX_READY``, ``cri.CONTAINER_RUNNING``...);
    ``None`` = not known yet (treated as active). Every write bumps a sequence number
    and stamps the object, so a resync can tell what changed after its List calls.
    """

    def __init__(self, history: ChangeHistory | None = None, ledger: ObjectLedger | None = None) -> None:
        self._pods: dict[str, PodInfo] = {}
        self._containers: dict[str, ContainerRecord] = {}
        self._changes: dict[str, collections.deque[Change]] = {}
        self._pod_states: dict[str, int] = {}
        self._container_states: dict[str, int] = {}
        self._seq = 0
        self._stamps: dict[str, int] = {}
        self._removed: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._history = history
        #: Every object put here, with its context, for the Post stages owed after a stop or
        #: a removal (runtimeproxy.lifecycle.owed); kept across restarts in state_dir.
        self.ledger = ledger

    def restore_history(self) -> int:
        """Load the change history kept on disk (at start, before the rebuild); returns pods restored."""
        if self._history is None:
            return 0
        restored = self._history.load()
        for uid, changes in restored.items():
            self._changes[uid] = collections.deque(changes[-CHANGES_PER_POD:], maxlen=CHANGES_PER_POD)
        return len(restored)

    def close(self) -> None:
        if self._history is not None:
            self._history.close()

    # --- sequence stamps (for resync) ----------------------------------------------

    def mark(self) -> int:
        return self._seq

    def _stamp(self, object_id: str) -> None:
        self._seq += 1
        self._stamps[object_id] = self._seq

    def _forget(self, object_id: str) -> None:
        self._seq += 1
        self._stamps.pop(object_id, None)
        self._removed[object_id] = self._seq
        self._removed.move_to_end(object_id)
        while len(self._removed) > _REMOVED_KEPT:
            self._removed.popitem(last=False)

    def last_write(self, object_id: str) -> int:
        """The sequence number of the object's last write or removal (0: none since start)."""
        return max(self._stamps.get(object_id, 0), self._removed.get(object_id, 0))

    def changed_since(self, object_id: str, mark: int) -> bool:
        """Written or removed after ``mark``: a List taken at ``mark`` is stale for it."""
        return self._stamps.get(object_id, 0) > mark or self._removed.get(object_id, 0) > mark

    # --- pods and containers -----------------------------------------------------

    def put_pod(self, pod: PodInfo, state: int | None = None) -> None:
        self._pods[pod.id] = pod
        if state is not None:
            self._pod_states[pod.id] = state
        self._stamp(pod.id)
        if self.ledger is not None and pod.id:
            self.ledger.learn("pod", pod.id, pod, stopped=self._pod_states.get(pod.id) == cri.SANDBOX_NOTREADY)

    def pod(self, sandbox_id: str) -> PodInfo | None:
        return self._pods.get(sandbox_id)

    def set_pod_state(self, sandbox_id: str, state: int) -> None:
        if sandbox_id in self._pods and self._pod_states.get(sandbox_id) != state:
            self._pod_states[sandbox_id] = state
            self._stamp(sandbox_id)

    def pod_state(self, sandbox_id: str) -> int | None:
        return self._pod_states.get(sandbox_id)

    def remove_pod(self, sandbox_id: str) -> PodInfo | None:
        for cid in [c for c, rec in self._containers.items() if rec.pod_id == sandbox_id]:
            self.remove_container(cid)
        pod = self._pods.pop(sandbox_id, None)
        self._pod_states.pop(sandbox_id, None)
        self._forget(sandbox_id)
        if pod is not None and not any(p.meta.uid == pod.meta.uid for p in self._pods.values()):
            self._changes.pop(pod.meta.uid, None)
            if self._history is not None:
                self._history.forget(pod.meta.uid)
        return pod

    def put_container(self, pod_id: str, info: ContainerInfo, state: int | None = None) -> None:
        self._containers[info.id] = ContainerRecord(pod_id, info)
        if state is not None:
            self._container_states[info.id] = state
        self._stamp(info.id)
        if self.ledger is not None and info.id:
            self.ledger.learn("container", pod_id, info,
                              stopped=self._container_states.get(info.id) == cri.CONTAINER_EXITED)

    def container(self, container_id: str) -> ContainerRecord | None:
        return self._containers.get(container_id)

    def set_container_state(self, container_id: str, state: int) -> None:
        if container_id in self._containers and self._container_states.get(container_id) != state:
            self._container_states[container_id] = state
            self._stamp(container_id)

    def container_state(self, container_id: str) -> int | None:
        return self._container_states.get(container_id)

    def update_container_resources(self, container_id: str, resources: Resources) -> None:
        rec = self._containers.get(container_id)
        if rec is not None:
            self._containers[container_id] = new = replace(rec, info=replace(rec.info, resources=resources))
            self._stamp(container_id)
            if self.ledger is not None:
                self.ledger.learn("container", rec.pod_id, new.info, stopped=False)  # known: context refreshed

    def remove_container(self, container_id: str) -> ContainerRecord | None:
        self._container_states.pop(container_id, None)
        self._forget(container_id)
        return self._containers.pop(container_id, None)

    def active_pod(self, sandbox_id: str) -> bool:
        return self._pod_states.get(sandbox_id) not in INACTIVE_POD_STATES

    def active_container(self, container_id: str) -> bool:
        return self._container_states.get(container_id) not in INACTIVE_CONTAINER_STATES

    def ids(self) -> tuple[list[str], list[str]]:
        return list(self._pods), list(self._containers)

    def snapshot(self) -> tuple[dict[str, PodInfo], dict[str, tuple[str, ContainerInfo]]]:
        """Copies, safe to hand to other threads (collectors, reconcilers)."""
        return dict(self._pods), {cid: (rec.pod_id, rec.info) for cid, rec in self._containers.items()}

    # --- change log (what explain shows) -----------------------------------------

    def record_changes(self, pod_uid: str, changes: tuple[Change, ...]) -> None:
        """Keep a pod's change log; ignored once the pod is gone (Post of RemovePodSandbox)."""
        if changes and any(p.meta.uid == pod_uid for p in self._pods.values()):
            self._changes.setdefault(pod_uid, collections.deque(maxlen=CHANGES_PER_POD)).extend(changes)
            if self._history is not None:
                self._history.append(pod_uid, changes)
            for c in changes:  # what `explain` shows, also in the debug log
                log.debug("change_recorded", hook=c.hook, stage=c.stage, target=c.target, old=c.old, new=c.new,
                          reason=c.reason)

    def changes(self, pod_uid: str) -> list[Change]:
        return list(self._changes.get(pod_uid, ()))

    def prune_changes(self) -> int:
        """Drop change logs of pods the store no longer has (e.g. removed while the proxy
        was down, after a rebuild); returns how many."""
        live = {p.meta.uid for p in self._pods.values()}
        gone = [uid for uid in self._changes if uid not in live]
        for uid in gone:
            del self._changes[uid]
            if self._history is not None:
                self._history.forget(uid)
        return len(gone)

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


async def _status(
    backend: Backend, method: str, request: Any, response_type: type[Any], timeout: float, *,
    event: str, **ids: str,
) -> Any | None:
    """A status call's reply, or ``None``: NOT_FOUND is the object gone (said by the caller's
    result), any other failure is logged as ``event`` with the object's id."""
    try:
        return await _call(backend, method, request, response_type, timeout)
    except CallError as exc:
        if exc.code is not Code.NOT_FOUND:
            log.warning(event, error=str(exc), **ids)
        return None


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
    resp = await _status(
        backend, "PodSandboxStatus", cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True),
        cri.PodSandboxStatusResponse, timeout, event="store_load_pod_failed", sandbox_id=sandbox_id,
    )
    if resp is None:
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
    resp = await _status(
        backend, "ContainerStatus", cri.ContainerStatusRequest(container_id=container_id, verbose=True),
        cri.ContainerStatusResponse, timeout, event="store_load_container_failed", container_id=container_id,
    )
    if resp is None:
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


@dataclass(frozen=True, slots=True)
class ResyncResult:
    pods: int
    containers: int
    pods_added: int
    pods_dropped: int
    containers_added: int
    containers_dropped: int
    states_changed: int
    #: What containerd listed (id -> CRI state), the store's mark taken before the List
    #: calls (``Store.changed_since``: an object written after it is not judged by this
    #: List) and the uids of the pods listed: what the Post stages owed after a stop or a
    #: removal and the host sweep are computed from (runtimeproxy.lifecycle.owed).
    pod_states: Mapping[str, int] = field(default_factory=dict)
    container_states: Mapping[str, int] = field(default_factory=dict)
    mark: int = 0
    own_writes: frozenset[int] = frozenset()
    listed_uids: frozenset[str] = frozenset()

    @property
    def changed(self) -> bool:
        return bool(self.pods_added or self.pods_dropped or self.containers_added or self.containers_dropped)


class _OwnWrites:
    """The sequence numbers of the re-sync's own store writes (``with own: store.put_...``):
    what the proxy wrote after the List began is judged later, what the re-sync wrote is not."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._before = 0
        self.seqs: set[int] = set()

    def __enter__(self) -> None:
        self._before = self._store.mark()

    def __exit__(self, *_: object) -> None:
        self.seqs.update(range(self._before + 1, self._store.mark() + 1))


async def resync(store: Store, backend: Backend, *, timeout: float = 5.0) -> ResyncResult:
    """Make the store match containerd: drop what it no longer lists, learn what it
    lists that the store lacks (verbose status, as at start), take its states. Objects
    the proxy itself wrote after the List calls began are left as they are."""
    mark = store.mark()
    own = _OwnWrites(store)
    listed_pods = await _call(
        backend, "ListPodSandbox", cri.ListPodSandboxRequest(), cri.ListPodSandboxResponse, timeout
    )
    listed_containers = await _call(
        backend, "ListContainers", cri.ListContainersRequest(), cri.ListContainersResponse, timeout
    )
    pod_states = {p.id: int(p.state) for p in listed_pods.items}
    containers = {c.id: c for c in listed_containers.containers}
    known_pods, known_containers = store.ids()
    counts = collections.Counter[str]()
    for sid in known_pods:
        if sid not in pod_states and not store.changed_since(sid, mark):
            with own:
                store.remove_pod(sid)
            counts["pods_dropped"] += 1
    for cid in known_containers:
        if cid not in containers and store.container(cid) is not None and not store.changed_since(cid, mark):
            with own:
                store.remove_container(cid)
    counts["containers_dropped"] = sum(1 for cid in known_containers
                                       if cid not in containers and store.container(cid) is None)
    for sid, state in pod_states.items():
        if store.changed_since(sid, mark):
            continue
        if store.pod(sid) is not None:
            counts["states_changed"] += store.pod_state(sid) != state
            with own:
                store.set_pod_state(sid, state)
            continue
        pod = await load_pod(backend, sid, timeout=timeout)
        if pod is not None and not store.changed_since(sid, mark):
            with own:
                store.put_pod(pod, state)
            counts["pods_added"] += 1
    for cid, c in containers.items():
        if store.changed_since(cid, mark):
            continue
        if store.container(cid) is not None:
            counts["states_changed"] += store.container_state(cid) != c.state
            with own:
                store.set_container_state(cid, int(c.state))
            continue
        rec = await load_container(backend, cid, timeout=timeout)
        if rec is not None and not store.changed_since(cid, mark):
            with own:
                store.put_container(rec.pod_id or c.pod_sandbox_id, rec.info, int(c.state))
            counts["containers_added"] += 1
    pods, all_containers = store.ids()
    return ResyncResult(
        pods=len(pods), containers=len(all_containers), pods_added=counts["pods_added"],
        pods_dropped=counts["pods_dropped"], containers_added=counts["containers_added"],
        containers_dropped=counts["containers_dropped"], states_changed=counts["states_changed"],
        pod_states=pod_states, container_states={cid: int(c.state) for cid, c in containers.items()}, mark=mark,
        own_writes=frozenset(own.seqs),
        listed_uids=frozenset(p.metadata.uid for p in listed_pods.items if p.metadata.uid),
    )

