"""The NodeResourceTopology object (topology.node.k8s.io/v1alpha1) koord-scheduler binds
LSR/LSE pods from; built purely from its inputs (no I/O: ``nrtsources`` reads them).

The object is cluster-scoped and named after the node:

- ``topologyPolicies``: one value from the kubelet's topology manager policy and scope
  (``single-numa-node`` + ``pod`` -> ``SingleNUMANodePodLevel``; unset or ``none`` -> ``None``);
- ``zones``: one ``Node`` zone per NUMA node (``node-<id>``) with ``cpu`` (its CPUs),
  ``memory`` (MemTotal minus its hugepage pools), ``hugepages-2Mi`` and ``hugepages-1Gi``;
  allocatable = available = capacity, except with the Node label
  ``node.koordinator.sh/enable-numa-reservation: "true"``, where each zone's allocatable
  gives up ceil(kubelet reserved / zones) of cpu and memory (capacity - allocatable of the Node);
- annotations, each a compact JSON string shaped like koordlet's Go structs:
  ``node.koordinator.sh/cpu-topology``, ``node.koordinator.sh/cpu-shared-pools`` (LS pool: all
  CPUs - kubelet static allocations - every resource-status cpuset - reserved - exclusive
  system-qos), ``node.koordinator.sh/be-cpu-shared-pools`` (the same but only LSE cpusets
  are taken out), ``node.koordinator.sh/pod-cpu-allocs`` (pods bound by resource-status,
  then the kubelet static CPU manager's pods, ``managedByKubelet: true``),
  ``kubelet.koordinator.sh/cpu-manager-policy``, ``node.koordinator.sh/cpu-basic-info``;
  ``node.koordinator.sh/reservation`` and ``node.koordinator.sh/system-qos-resource`` are
  copied from the Node's annotations (normalised), as koordlet does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from hooks.annotations import RESOURCE_STATUS as ANNOTATION_RESOURCE_STATUS
from hooks.annotations import AnnotationError, ResourceStatus, parse_resource_status, quantity_value
from hooks.cpusets import CpuListError, format_cpu_list, parse_cpu_list
from hooks.qos import QoSClass
from metrics.collect.topology import CPUInfo, CPUTopology
from metrics.model import PodView
from metrics.report.nrtsources import (
    CPUBasicInfo,
    CPUManagerState,
    KubeletCPUConfig,
    NumaMemory,
    reserved_cpu_count,
)

API_VERSION: Final = "topology.node.k8s.io/v1alpha1"
KIND: Final = "NodeResourceTopology"
ANNOTATION_CPU_TOPOLOGY: Final = "node.koordinator.sh/cpu-topology"
ANNOTATION_CPU_SHARED_POOLS: Final = "node.koordinator.sh/cpu-shared-pools"
ANNOTATION_BE_CPU_SHARED_POOLS: Final = "node.koordinator.sh/be-cpu-shared-pools"
ANNOTATION_POD_CPU_ALLOCS: Final = "node.koordinator.sh/pod-cpu-allocs"
ANNOTATION_CPU_MANAGER_POLICY: Final = "kubelet.koordinator.sh/cpu-manager-policy"
ANNOTATION_CPU_BASIC_INFO: Final = "node.koordinator.sh/cpu-basic-info"
ANNOTATION_RESERVATION: Final = "node.koordinator.sh/reservation"
ANNOTATION_SYSTEM_QOS: Final = "node.koordinator.sh/system-qos-resource"
LABEL_NUMA_RESERVATION: Final = "node.koordinator.sh/enable-numa-reservation"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
#: Annotations and labels this agent owns on the object (others' keys are left alone).
MANAGED_ANNOTATIONS: Final = (
    ANNOTATION_CPU_BASIC_INFO, ANNOTATION_CPU_MANAGER_POLICY, ANNOTATION_CPU_SHARED_POOLS,
    ANNOTATION_BE_CPU_SHARED_POOLS, ANNOTATION_CPU_TOPOLOGY, ANNOTATION_POD_CPU_ALLOCS,
    ANNOTATION_RESERVATION, ANNOTATION_SYSTEM_QOS,
)
MANAGED_LABELS: Final = (LABEL_NUMA_RESERVATION,)
#: Zone resources this agent owns; a zone's other resources (GPUs...) are kept.
MANAGED_RESOURCES: Final = ("cpu", "memory", "hugepages-2Mi", "hugepages-1Gi")

_TOPOLOGY_POLICIES: Final = {
    ("single-numa-node", "container"): "SingleNUMANodeContainerLevel",
    ("restricted", "container"): "RestrictedContainerLevel",
    ("best-effort", "container"): "BestEffortContainerLevel",
    ("single-numa-node", "pod"): "SingleNUMANodePodLevel",
    ("restricted", "pod"): "RestrictedPodLevel",
    ("best-effort", "pod"): "BestEffortPodLevel",
}
_BINARY_SUFFIXES: Final = ("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei")


@dataclass(frozen=True, slots=True)
class NRTInputs:
    node_name: str
    topology: CPUTopology
    #: NUMA node id -> memory; empty without NUMA sysfs (then ``memtotal`` is node 0's).
    memory: Mapping[int, NumaMemory]
    pods: Sequence[PodView] = ()
    kubelet: KubeletCPUConfig = KubeletCPUConfig()
    #: Whether ``kubelet`` came from the kubelet's config file (absent or malformed: the
    #: checkpoint's ``policyName`` tells the CPU manager policy).
    kubelet_known: bool = False
    cpu_state: CPUManagerState = CPUManagerState()
    cpu_basic: CPUBasicInfo = CPUBasicInfo()
    #: The Node object from the API server (annotations, labels, capacity); None without.
    node: Mapping[str, Any] | None = None
    memtotal: int = 0


@dataclass(frozen=True, slots=True)
class NRTBuild:
    doc: dict[str, Any]
    #: Inputs that were malformed and left out (the caller logs them once).
    problems: tuple[str, ...] = ()
    #: The inputs behind each figure, for ``explain``.
    explain: Mapping[str, Any] = field(default_factory=dict)


def _json(value: object) -> str:
    """Go's ``json.Marshal``: compact, field order kept; an empty list is ``null``."""
    if isinstance(value, list) and not value:
        return "null"
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def topology_policy(policy: str, scope: str) -> str:
    return _TOPOLOGY_POLICIES.get((policy, scope), "None")


def format_binary(value: int) -> str:
    """A byte count as Kubernetes' canonical BinarySI quantity: 2147483648 -> ``"2Gi"``,
    1536 -> ``"1536"``."""
    if -1024 < value < 1024:
        return str(value)
    exponent = 0
    while value % 1024 == 0 and exponent < len(_BINARY_SUFFIXES) - 1:
        value //= 1024
        exponent += 1
    return f"{value}{_BINARY_SUFFIXES[exponent]}"


def format_cpu(milli: int) -> str:
    """Milli-cores as Kubernetes' canonical DecimalSI quantity: 8000 -> ``"8"``, 7500 -> ``"7500m"``."""
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def take_by_topology(topology: CPUTopology, count: int) -> frozenset[int]:
    """``count`` CPUs the way the kubelet's static policy picks its reserved ones: whole
    cores first, socket by socket, lowest CPU ids first, then threads of the next core."""
    cores: dict[tuple[int, int], list[int]] = {}
    for c in topology.cpus:
        cores.setdefault((c.socket, c.core), []).append(c.cpu)
    ordered = [cpus for _, cpus in sorted(cores.items(), key=lambda item: (item[0][0], min(item[1])))]
    taken: list[int] = []
    for cpus in ordered:  # whole cores
        if count - len(taken) >= len(cpus):
            taken += sorted(cpus)
    for cpus in ordered:  # then single threads
        for cpu in sorted(cpus):
            if len(taken) < count and cpu not in taken:
                taken.append(cpu)
    return frozenset(taken[:count])


# --- inputs from the Node --------------------------------------------------------------
def _meta(obj: Mapping[str, Any] | None, key: str) -> Mapping[str, str]:
    meta = obj.get("metadata") if obj is not None else None
    value = meta.get(key) if isinstance(meta, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def _node_reservation(annotations: Mapping[str, str], topology: CPUTopology,
                      problems: list[str]) -> tuple[dict[str, Any], frozenset[int]]:
    """The Node's reservation and its CPUs: ``reservedCPUs``, else ceil(``resources.cpu``)
    CPUs taken by topology (as koordlet)."""
    raw = annotations.get(ANNOTATION_RESERVATION)
    if not raw:
        return {}, frozenset()
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError(f"not a JSON object: {raw!r}")
        out: dict[str, Any] = {k: doc[k] for k in ("resources",) if doc.get(k)}
        cpus = parse_cpu_list(str(doc.get("reservedCPUs") or ""))
        resources = doc.get("resources")
        if not cpus and isinstance(resources, dict) and resources.get("cpu") is not None:
            cpus = take_by_topology(topology, math.ceil(quantity_value(resources["cpu"], "resources.cpu")))
    except (ValueError, RecursionError, CpuListError) as exc:
        problems.append(f"node annotation {ANNOTATION_RESERVATION}={raw[:200]!r}: {exc}; ignored")
        return {}, frozenset()
    if cpus:
        out["reservedCPUs"] = format_cpu_list(cpus)
    if doc.get("applyPolicy"):
        out["applyPolicy"] = doc["applyPolicy"]
    return out, cpus


def _system_qos(annotations: Mapping[str, str], problems: list[str]) -> tuple[dict[str, Any] | None, frozenset[int]]:
    raw = annotations.get(ANNOTATION_SYSTEM_QOS)
    if not raw:
        return None, frozenset()
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError(f"not a JSON object: {raw!r}")
        cpus = parse_cpu_list(str(doc.get("cpuset") or ""))
        exclusive = doc.get("cpusetExclusive")
        if exclusive is not None and not isinstance(exclusive, bool):
            raise ValueError(f"cpusetExclusive: not true/false (got {exclusive!r})")
    except (ValueError, RecursionError, CpuListError) as exc:
        problems.append(f"node annotation {ANNOTATION_SYSTEM_QOS}={raw[:200]!r}: {exc}; ignored")
        return None, frozenset()
    out: dict[str, Any] = {}
    if cpus:
        out["cpuset"] = format_cpu_list(cpus)
    if exclusive is not None:
        out["cpusetExclusive"] = exclusive
    # koordlet: the cpuset is exclusive unless cpusetExclusive is false.
    return out, cpus if exclusive is not False else frozenset()


def _kubelet_reserved(node: Mapping[str, Any] | None) -> tuple[int, int]:
    """(cpu milli, memory bytes) the kubelet keeps: the Node's capacity - allocatable."""
    status = node.get("status") if node is not None else None
    if not isinstance(status, Mapping):
        return 0, 0
    out: list[int] = []
    for resource, scale in (("cpu", 1000), ("memory", 1)):
        try:
            cap = quantity_value(status.get("capacity", {}).get(resource, 0), resource)
            alloc = quantity_value(status.get("allocatable", {}).get(resource, 0), resource)
        except (AnnotationError, AttributeError):
            out.append(0)
            continue
        out.append(max(math.ceil((cap - alloc) * scale), 0))
    return out[0], out[1]


# --- pods ------------------------------------------------------------------------------
def _bound(pods: Sequence[PodView], problems: list[str]) -> list[tuple[PodView, ResourceStatus]]:
    out: list[tuple[PodView, ResourceStatus]] = []
    for pod in pods:
        raw = pod.annotations.get(ANNOTATION_RESOURCE_STATUS)
        if raw is None:
            continue
        try:
            status = parse_resource_status(raw)
        except AnnotationError as exc:
            problems.append(f"pod {pod.key}: annotation {ANNOTATION_RESOURCE_STATUS}: {exc}; left out")
            continue
        if status.cpus:
            out.append((pod, status))
    return out


def _pod_allocs(inputs: NRTInputs, bound: list[tuple[PodView, ResourceStatus]],
                static: bool) -> tuple[list[dict[str, Any]], frozenset[int]]:
    """The pods bound by resource-status (whose cpusets the cpuset hook applies, whatever
    their class), then the kubelet's static allocations of the pods no one else manages
    (as koordlet: LS/BE pods and resource-status pods are skipped), and the CPUs the
    latter hold."""
    allocs = [{"namespace": p.namespace, "name": p.name, "uid": p.uid, "cpuset": format_cpu_list(s.cpus),
               "managedByKubelet": False}
              for p, s in sorted(bound, key=lambda b: b[0].uid)]
    if not static:
        return allocs, frozenset()
    by_uid = {p.uid: p for p in inputs.pods}
    managed = {p.uid for p in inputs.pods if p.qos in (QoSClass.LS, QoSClass.BE)} | {p.uid for p, _ in bound}
    kubelet_cpus: set[int] = set()
    for uid in sorted(inputs.cpu_state.entries):
        if uid in managed:
            continue
        cpus = frozenset().union(*inputs.cpu_state.entries[uid].values())
        if not cpus:
            continue
        pod = by_uid.get(uid)
        allocs.append({"namespace": pod.namespace if pod else "", "name": pod.name if pod else "", "uid": uid,
                       "cpuset": format_cpu_list(cpus), "managedByKubelet": True})
        kubelet_cpus |= cpus
    return allocs, frozenset(kubelet_cpus)


def _pools(topology: CPUTopology, cpus: Iterable[int]) -> list[dict[str, Any]]:
    """A CPU set split per (socket, NUMA node), ordered by socket then node."""
    info: dict[int, CPUInfo] = {c.cpu: c for c in topology.cpus}
    groups: dict[tuple[int, int], set[int]] = {}
    for cpu in cpus:
        if cpu in info:
            groups.setdefault((info[cpu].socket, info[cpu].numa), set()).add(cpu)
    return [{"socket": s, "node": n, "cpuset": format_cpu_list(g)} for (s, n), g in sorted(groups.items())]


# --- zones -----------------------------------------------------------------------------
def _zones(inputs: NRTInputs, numa_reservation: bool) -> list[dict[str, Any]]:
    cpus_of: dict[int, int] = {}
    for c in inputs.topology.cpus:
        cpus_of[c.numa] = cpus_of.get(c.numa, 0) + 1
    memory = dict(inputs.memory) or {0: NumaMemory(inputs.memtotal)}
    ids = sorted(set(cpus_of) | set(memory))
    per_cpu, per_mem = 0, 0
    if numa_reservation and ids:
        cpu_reserved, mem_reserved = _kubelet_reserved(inputs.node)
        per_cpu, per_mem = -(-cpu_reserved // len(ids)), -(-mem_reserved // len(ids))
    zones = []
    for numa in ids:
        mem = memory.get(numa, NumaMemory(0))
        huge = {name: mem.hugepages.get(name, 0) for name in ("hugepages-1Gi", "hugepages-2Mi")}
        capacity = {"cpu": cpus_of.get(numa, 0) * 1000, "memory": max(mem.total - sum(huge.values()), 0), **huge}
        allocatable = dict(capacity)
        allocatable["cpu"] = max(capacity["cpu"] - per_cpu, 0)
        allocatable["memory"] = max(capacity["memory"] - per_mem, 0)
        resources = []
        for name in sorted(capacity):
            fmt = format_cpu if name == "cpu" else format_binary
            resources.append({"name": name, "capacity": fmt(capacity[name]),
                              "allocatable": fmt(allocatable[name]), "available": fmt(allocatable[name])})
        zones.append({"name": f"node-{numa}", "type": "Node", "resources": resources})
    return zones


# --- the object ------------------------------------------------------------------------
def _cpu_manager_policy(inputs: NRTInputs, topology: CPUTopology) -> dict[str, Any]:
    kubelet = inputs.kubelet
    policy = kubelet.cpu_manager_policy if inputs.kubelet_known else (inputs.cpu_state.policy or "none")
    out: dict[str, Any] = {"policy": policy}
    if kubelet.cpu_manager_options:
        out["options"] = dict(sorted(kubelet.cpu_manager_options.items()))
    if policy == "static":
        if kubelet.reserved_system_cpus:
            reserved = parse_cpu_list(kubelet.reserved_system_cpus)
        else:
            reserved = take_by_topology(topology, reserved_cpu_count(kubelet.reserved_cpu_cores))
        if reserved:
            out["reservedCPUs"] = format_cpu_list(reserved)
    return out


def build_nrt(inputs: NRTInputs) -> NRTBuild:
    """The whole object (what is created; a patch is computed from it by ``nrtsync``)."""
    problems: list[str] = []
    topology = inputs.topology
    all_cpus = frozenset(c.cpu for c in topology.cpus)
    node_annotations, node_labels = _meta(inputs.node, "annotations"), _meta(inputs.node, "labels")
    reservation, reserved_cpus = _node_reservation(node_annotations, topology, problems)
    system_qos, system_cpus = _system_qos(node_annotations, problems)
    policy = _cpu_manager_policy(inputs, topology)
    bound = _bound(inputs.pods, problems)
    allocs, kubelet_cpus = _pod_allocs(inputs, bound, policy["policy"] == "static")
    any_bound = frozenset().union(*(s.cpus for _, s in bound))
    lse_bound = frozenset().union(*(s.cpus for p, s in bound if p.qos is QoSClass.LSE))
    taken = kubelet_cpus | reserved_cpus | system_cpus
    ls_pool = all_cpus - taken - any_bound
    be_pool = all_cpus - taken - lse_bound
    basic = inputs.cpu_basic
    cores = {(c.socket, c.core) for c in topology.cpus}
    annotations = {
        ANNOTATION_CPU_BASIC_INFO: _json({
            "cpuModel": basic.cpu_model, "hyperThreadEnabled": len(cores) < len(topology.cpus),
            "turboEnabled": basic.turbo_enabled, "catL3CbmMask": basic.cat_l3_cbm_mask, "vendorID": basic.vendor_id,
        }),
        ANNOTATION_CPU_TOPOLOGY: _json({"detail": [{"id": c.cpu, "core": c.core, "socket": c.socket, "node": c.numa}
                                                   for c in sorted(topology.cpus, key=lambda c: c.cpu)]}),
        ANNOTATION_CPU_SHARED_POOLS: _json(_pools(topology, ls_pool)),
        ANNOTATION_BE_CPU_SHARED_POOLS: _json(_pools(topology, be_pool)),
        ANNOTATION_CPU_MANAGER_POLICY: _json(policy),
        ANNOTATION_POD_CPU_ALLOCS: _json(allocs),
        ANNOTATION_RESERVATION: _json(reservation),
    }
    if system_qos is not None:
        annotations[ANNOTATION_SYSTEM_QOS] = _json(system_qos)
    labels = {k: node_labels[k] for k in MANAGED_LABELS if node_labels.get(k)}
    numa_reservation = node_labels.get(LABEL_NUMA_RESERVATION) == "true"
    doc: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": inputs.node_name, "annotations": annotations, **({"labels": labels} if labels else {})},
        "topologyPolicies": [topology_policy(inputs.kubelet.topology_manager_policy,
                                             inputs.kubelet.topology_manager_scope)],
        "zones": _zones(inputs, numa_reservation),
    }
    explain = {
        "cpus": format_cpu_list(all_cpus),
        "bound_by_resource_status": {p.key: format_cpu_list(s.cpus) for p, s in bound},
        "kubelet_static_cpus": format_cpu_list(kubelet_cpus),
        "node_reserved_cpus": format_cpu_list(reserved_cpus),
        "system_qos_exclusive_cpus": format_cpu_list(system_cpus),
        "ls_pool": format_cpu_list(ls_pool),
        "be_pool": format_cpu_list(be_pool),
        "kubelet_config": "file" if inputs.kubelet_known else "defaults (file absent or malformed)",
        "numa_reservation": numa_reservation,
    }
    return NRTBuild(doc, tuple(problems), explain)


def quantity_equal(a: object, b: object) -> bool:
    """Two quantities with the same value (``"1Gi"`` == ``"1073741824"`` == 1073741824)."""
    try:
        return quantity_value(a) == quantity_value(b)
    except AnnotationError:
        return a == b

