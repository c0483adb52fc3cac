"""Keeps the node's NodeResourceTopology in the cluster equal to what ``nrt.build_nrt``
computes, and serves it on the loopback endpoint (``/apis/noderesourcetopology``).

Every ``interval`` the object is rebuilt (off the loop: it reads sysfs and kubelet's
files). With a cluster it is then compared with the object there: created when missing,
else merge-patched with only what differs (our annotations and labels, the topology
policy, our zone resources; other writers' annotations, labels and zone resources are
kept). A rebuild equal to the last one in sync makes no API call at all; the object is
re-read anyway every ``resync`` seconds to repair edits made by others. Writes (create or
patch) are at most one per ``interval``.

Nothing is written before the pods are known (``ready``: the proxy's store rebuilt and
kubelet's first pod list in): right after a restart the pod set is empty, and an NRT built
from it says ``pod-cpu-allocs: null`` and gives an LSR pod's bound CPUs back to the shared
pool, a window in which koord-scheduler can place another pod on them. Nor is a
less-informed object written over a better one: a build missing an input the last write
had (the CPU topology, kubelet's config or CPU manager checkpoint, the Node) is held back
for up to ``resync`` seconds (an input gone that long is taken as really gone).

The API client is anything with ``get_nrt``/``create_nrt``/``patch_nrt`` (``NRTClient``):
``metrics.informer.kubeclient.KubeClient`` in the agent.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable

import structlog

from metrics.collect.topology import CPUTopology
from metrics.informer.kubetypes import KubeError
from metrics.model import PodView
from metrics.report.nrt import (
    LABEL_MANAGED_BY,
    MANAGED_ANNOTATIONS,
    MANAGED_LABELS,
    MANAGED_RESOURCES,
    NRTBuild,
    NRTInputs,
    build_nrt,
    quantity_equal,
)
from metrics.report.nrtsources import (
    CPUBasicInfo,
    KubeletCPUConfig,
    SourceProblems,
    read_cpu_basic_info,
    read_cpu_manager_state,
    read_kubelet_config,
    read_memtotal,
    read_numa_memory,
)
from runtimeproxy.hookapi import HostRoots

log = structlog.get_logger("metrics.report.nrt")

JSON: Final = "application/json"
#: The object in the cluster is re-read this often even when nothing changed here.
DEFAULT_RESYNC: Final = 300.0
#: /proc/cpuinfo and friends change only with the hardware: re-read this often.
_BASIC_INFO_MAX_AGE: Final = 60.0


@runtime_checkable
class NRTClient(Protocol):
    def get_nrt(self) -> dict[str, Any] | None: ...

    def create_nrt(self, doc: Mapping[str, Any]) -> dict[str, Any]: ...

    def patch_nrt(self, patch: Mapping[str, Any]) -> dict[str, Any]: ...


# --- comparing ---------------------------------------------------------------------------
def _annotation_equal(a: str, b: str) -> bool:
    """Equal as JSON (key order and spacing do not matter), else as text."""
    try:
        return bool(json.loads(a) == json.loads(b))
    except (ValueError, RecursionError):
        return a == b


def _meta(doc: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    meta = doc.get("metadata")
    value = meta.get(key) if isinstance(meta, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def _resources(zone: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    raw = zone.get("resources")
    return [r for r in raw if isinstance(r, Mapping)] if isinstance(raw, list) else []


def merge_zones(current: Sequence[Any], desired: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Our zones, each keeping the current zone's other fields (attributes, costs) and
    resources we do not manage (GPUs...); zones we do not report are dropped."""
    by_name = {z.get("name"): z for z in current if isinstance(z, Mapping)}
    merged = []
    for zone in desired:
        old = by_name.get(zone["name"], {})
        out = {k: v for k, v in old.items() if k not in ("name", "type", "resources")}
        out.update(zone)
        others = [dict(r) for r in _resources(old) if r.get("name") not in MANAGED_RESOURCES]
        out["resources"] = sorted([*zone["resources"], *others], key=lambda r: str(r.get("name")))
        merged.append(out)
    return merged


def _resource_equal(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.get("name") == b.get("name") and all(
        quantity_equal(a.get(k), b.get(k)) for k in ("capacity", "allocatable", "available"))


def zones_equal(current: Sequence[Any], merged: Sequence[Mapping[str, Any]]) -> bool:
    if len(current) != len(merged):
        return False
    for old, new in zip(current, merged, strict=True):
        if not isinstance(old, Mapping) or old.get("name") != new["name"] or old.get("type") != new["type"]:
            return False
        old_res = {r.get("name"): r for r in _resources(old)}
        new_res = {r.get("name"): r for r in _resources(new)}
        if old_res.keys() != new_res.keys():
            return False
        if not all(_resource_equal(old_res[n], new_res[n]) for n in new_res):
            return False
    return True


def merge_patch(current: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) turning ``current`` into ``desired`` in what this
    agent owns; {} when they already agree."""
    patch: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    for key, managed in (("annotations", MANAGED_ANNOTATIONS), ("labels", MANAGED_LABELS)):
        old, new = _meta(current, key), _meta(desired, key)
        changes: dict[str, Any] = {}
        for name in managed:
            if name in new and (name not in old or not _annotation_equal(str(old[name]), new[name])):
                changes[name] = new[name]
            elif name in old and name not in new:
                changes[name] = None  # merge patch: null removes
        if changes:
            meta[key] = changes
    if meta:
        patch["metadata"] = meta
    if current.get("topologyPolicies") != desired["topologyPolicies"]:
        patch["topologyPolicies"] = desired["topologyPolicies"]
    raw_zones = current.get("zones")
    old_zones: list[Any] = raw_zones if isinstance(raw_zones, list) else []
    merged = merge_zones(old_zones, desired["zones"])
    if not zones_equal(old_zones, merged):
        patch["zones"] = merged  # a merge patch replaces lists as a whole
    return patch


def _changed_keys(patch: Mapping[str, Any]) -> list[str]:
    """What a patch changes, for the log line: annotation and label names, other fields."""
    keys = [k for k in sorted(patch) if k != "metadata"]
    meta = patch.get("metadata")
    items = meta.items() if isinstance(meta, Mapping) else ()
    return keys + sorted(str(name) for key, section in items
                         for name in (section if isinstance(section, Mapping) else [key]))


def node_owner(node: Mapping[str, Any] | None, name: str) -> dict[str, Any] | None:
    """The owner reference to the Node (None while its uid is not known)."""
    node_meta = node.get("metadata") if node is not None else None
    uid = node_meta.get("uid") if isinstance(node_meta, Mapping) else None
    if not uid or not isinstance(uid, str):
        return None
    return {"apiVersion": "v1", "kind": "Node", "name": name, "uid": uid, "controller": True,
            "blockOwnerDeletion": True}


def owner_patch(current: Mapping[str, Any], owner: Mapping[str, Any] | None) -> list[dict[str, Any]] | None:
    """The ``ownerReferences`` to write when the object has no owner reference to this
    Node yet (created before the Node was read, or owned by a deleted Node of the same
    name), keeping other owners; None when nothing is to change."""
    if owner is None:
        return None
    meta = current.get("metadata")
    refs = meta.get("ownerReferences") if isinstance(meta, Mapping) else None
    old = [dict(r) for r in refs if isinstance(r, Mapping)] if isinstance(refs, list) else []
    if any(r.get("kind") == "Node" and r.get("uid") == owner["uid"] for r in old):
        return None
    kept = [r for r in old if not (r.get("kind") == "Node" and r.get("apiVersion") == "v1")]
    return [*kept, dict(owner)]


def create_doc(desired: Mapping[str, Any], node: Mapping[str, Any] | None) -> dict[str, Any]:
    """The object to create: ours, labelled as Koordinator's and owned by the Node (when
    its uid is known), so it goes away with the Node."""
    doc: dict[str, Any] = json.loads(json.dumps(desired))
    meta = doc["metadata"]
    meta["labels"] = {**meta.get("labels", {}), LABEL_MANAGED_BY: "Koordinator"}
    owner = node_owner(node, doc["metadata"]["name"])
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return doc


# --- inputs --------------------------------------------------------------------------------
class NRTSources:
    """Reads everything ``build_nrt`` needs (blocking: from a worker thread)."""

    def __init__(
        self,
        node_name: str,
        host: HostRoots,
        topology: Callable[[], CPUTopology],
        pods: Callable[[], Sequence[PodView]],
        node: Callable[[], Mapping[str, Any] | None],
        *,
        cpu_manager_state: Path,
        kubelet_config: Path,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node_name = node_name
        self._host = host
        self._topology = topology
        self._pods = pods
        self._node = node
        self.cpu_manager_state = cpu_manager_state
        self.kubelet_config = kubelet_config
        self._clock = clock
        self.problems = SourceProblems()
        self._basic: tuple[float, CPUBasicInfo] | None = None

    def node(self) -> Mapping[str, Any] | None:
        return self._node()

    def _basic_info(self) -> CPUBasicInfo:
        now = self._clock()
        if self._basic is None or now - self._basic[0] > _BASIC_INFO_MAX_AGE:
            info = read_cpu_basic_info(self._host.proc, self._host.sys, self._host.resctrl, self.problems)
            self._basic = (now, info)
        return self._basic[1]

    def read(self) -> NRTInputs:
        memory = read_numa_memory(self._host.sys, self.problems)
        kubelet = read_kubelet_config(self.kubelet_config, self.problems)
        return NRTInputs(
            node_name=self.node_name,
            topology=self._topology(),
            memory=memory,
            memtotal=0 if memory else read_memtotal(self._host.proc, self.problems),
            pods=tuple(self._pods()),
            kubelet=kubelet if kubelet is not None else KubeletCPUConfig(),
            kubelet_known=kubelet is not None,
            cpu_state=read_cpu_manager_state(self.cpu_manager_state, self.problems),
            cpu_basic=self._basic_info(),
            node=self._node(),
        )


def known_inputs(inputs: NRTInputs) -> frozenset[str]:
    """Which of the optional inputs a build had: a build knowing less than the object
    already written must not replace it."""
    known = {"topology"} if inputs.topology.cpus else set()
    if inputs.kubelet_known:
        known.add("kubelet_config")
    if inputs.cpu_state.policy:
        known.add("cpu_manager_state")
    if inputs.node is not None:
        known.add("node")
    return frozenset(known)


# --- the reporter ---------------------------------------------------------------------------
class NRTReporter:
    def __init__(
        self,
        sources: NRTSources,
        kube: NRTClient | None,
        *,
        interval: float = 3.0,
        resync: float = DEFAULT_RESYNC,
        clock: Callable[[], float] = time.monotonic,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self._sources = sources
        self._ready = ready
        self._kube = kube
        self.interval = interval
        self._resync = resync
        self._clock = clock
        self._latest: tuple[NRTBuild, bytes] | None = None
        self._built_at = -float("inf")
        #: The desired document last found equal to (or written to) the cluster's.
        self._synced: dict[str, Any] | None = None
        self._synced_owner: dict[str, Any] | None = None
        self._checked_at = -float("inf")
        self._written_at = -float("inf")
        self._problems: set[str] = set()
        self._last_failure = ""
        self.writes = {"created": 0, "patched": 0}
        #: The inputs behind the last build and the last write; since when a poorer build is held.
        self._known: frozenset[str] = frozenset()
        self._written_known: frozenset[str] = frozenset()
        self._held_since: float | None = None
        self._waiting = ""

    @property
    def connected(self) -> bool:
        """Whether the object is written to a cluster (else only served on loopback)."""
        return self._kube is not None

    def latest(self) -> Mapping[str, Any] | None:
        return None if self._latest is None else self._latest[0].doc

    def _build(self) -> NRTBuild:
        """In a worker thread."""
        inputs = self._sources.read()
        self._known = known_inputs(inputs)
        build = build_nrt(inputs)
        for problem in build.problems:
            if problem not in self._problems:
                self._problems.add(problem)
                log.warning("nrt_input_ignored", reason=problem)
        return build

    async def rebuild(self) -> NRTBuild:
        build = await asyncio.to_thread(self._build)
        body = json.dumps(build.doc, sort_keys=True, separators=(",", ":")).encode()
        self._latest, self._built_at = (build, body), self._clock()
        return build

    async def sync_once(self) -> str:
        """Rebuild, then bring the cluster's object in line. Returns the outcome: ``local``
        (no cluster), ``unchanged`` (no API call), ``in_sync`` (read, nothing to write),
        ``deferred`` (a write is due but the last was less than ``interval`` ago),
        ``waiting`` (the pods are not known yet: no API call), ``held`` (this build knows
        less than the last write: no API call), ``created``, ``patched`` or ``failed``."""
        build = await self.rebuild()
        if self._kube is None:
            return "local"
        now = self._clock()
        if self._ready is not None and not self._ready():
            self._wait("pods not known yet (store rebuild, kubelet's first pod list)")
            return "waiting"
        if missing := self._written_known - self._known:
            if self._held_since is None:
                self._held_since = now
            if now - self._held_since < self._resync:
                self._wait(f"inputs missing that the last write had: {sorted(missing)}")
                return "held"
        self._held_since, self._waiting = None, ""
        desired = build.doc
        node = self._sources.node()
        owner = node_owner(node, self._sources.node_name)
        # The Node's uid is part of what is synced: an object created before the Node was
        # read gets its owner reference as soon as the uid is known, not at the next resync.
        if desired == self._synced and owner == self._synced_owner and now - self._checked_at < self._resync:
            return "unchanged"
        try:
            current = await asyncio.to_thread(self._kube.get_nrt)
        except KubeError as exc:
            return self._failed("get", exc)
        if current is None:
            return await self._write("created", self._kube.create_nrt, create_doc(desired, node), desired, now,
                                     owner)
        patch = merge_patch(current, desired)
        if (refs := owner_patch(current, owner)) is not None:
            patch.setdefault("metadata", {})["ownerReferences"] = refs
        if not patch:
            self._synced, self._synced_owner, self._checked_at = desired, owner, now
            self._written_known = self._known  # the cluster's object is this build
            return "in_sync"
        return await self._write("patched", self._kube.patch_nrt, patch, desired, now, owner)

    async def _write(self, outcome: str, call: Callable[[Mapping[str, Any]], dict[str, Any]],
                     body: Mapping[str, Any], desired: dict[str, Any], now: float,
                     owner: dict[str, Any] | None) -> str:
        if now - self._written_at < self.interval:
            return "deferred"
        try:
            await asyncio.to_thread(call, body)
        except KubeError as exc:
            return self._failed("create" if outcome == "created" else "patch", exc)
        self._synced, self._synced_owner, self._checked_at, self._written_at = desired, owner, now, now
        self._written_known = self._known
        self.writes[outcome] += 1
        changed = _changed_keys(body) if outcome == "patched" else ["*"]
        log.info(f"nrt_{outcome}", name=self._sources.node_name, changed=changed)
        if self._last_failure:
            self._last_failure = ""
            log.info("nrt_report_recovered")
        return outcome

    def _wait(self, reason: str) -> None:
        if reason != self._waiting:
            self._waiting = reason
            log.info("nrt_write_waiting", reason=reason)

    def _failed(self, what: str, exc: KubeError) -> str:
        # One line per distinct failure in a row, not one per interval.
        key = f"{what}:{exc}"
        if key != self._last_failure:
            self._last_failure = key
            log.error("nrt_report_failed", call=what, reason=str(exc))
        return "failed"

    async def run(self) -> None:
        """Sync every interval until cancelled."""
        while True:
            await self.sync_once()
            await asyncio.sleep(self.interval)

    async def route(self, query: dict[str, str]) -> tuple[int, str, bytes]:
        """GET handler: the object as JSON (rebuilt, not sent, when older than the interval)."""
        if self._latest is None or self._clock() - self._built_at > self.interval:
            await self.rebuild()
        assert self._latest is not None
        return 200, JSON, self._latest[1]

    def explain(self) -> Mapping[str, Any]:
        """The inputs behind the last object and the sync state."""
        build = self._latest[0] if self._latest is not None else None
        return {
            "inputs": dict(build.explain) if build is not None else None,
            "cpu_manager_state": str(self._sources.cpu_manager_state),
            "kubelet_config": str(self._sources.kubelet_config),
            "cluster": self._kube is not None,
            "writes": dict(self.writes),
            "last_failure": self._last_failure or None,
            "inputs_known": sorted(self._known),
            "waiting": self._waiting or None,
        }
