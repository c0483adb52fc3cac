"""States informer: what the node agent knows about the cluster side of its node.

Two sources, as in koordlet: kubelet's ``/pods`` (priority values, phases) polled
every ``sync_interval``, and the API server's Node, NodeSLO and NodeMetric (named
after the node) kept current by watches. The proxy itself already knows every pod
from the CRI calls; kubelet only adds what CRI does not carry (the priority value).

Both sources are optional: without a kubeconfig the agent runs on its YAML rules,
without kubelet pods fall back to their priority-class default.
"""

from __future__ import annotations

import asyncio
import functools
import json
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import structlog

from hooks.annotations import quantity_value
from hooks.cpusets import CpuListError, parse_cpu_list
from metrics.informer.kubetypes import Kind

if TYPE_CHECKING:  # the API client is imported only when configured
    from metrics.informer.kubeclient import KubeClient

log = structlog.get_logger("metrics.informer.states")

RESERVATION_ANNOTATION: Final = "node.koordinator.sh/reservation"
READ_ONLY_KUBELET: Final = "http://127.0.0.1:10255"


@dataclass(frozen=True, slots=True)
class KubeletPod:
    name: str
    namespace: str
    uid: str
    priority: int | None
    phase: str
    qos_class: str
    priority_class_name: str
    #: Pod requests as the scheduler counts them (containers summed, max'ed with each init
    #: container, plus overhead): cores and bytes; what the Prod reclaimable estimate needs.
    cpu_request: float = 0.0
    memory_request: float = 0.0
    #: ``metadata.creationTimestamp`` as Unix time (the prediction's cold start), None: absent.
    created: float | None = None


def _quantity(raw: object) -> float:
    """A Kubernetes quantity as a float; ValueError (AnnotationError) when bad."""
    return float(quantity_value(raw))


def _str(value: object) -> str:
    return value if isinstance(value, str) else ""


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _resource_list(raw: object) -> tuple[float, float]:
    """(cpu cores, memory bytes) of a ResourceList; a missing or bad quantity counts 0."""
    values = _mapping(raw)
    out = [0.0, 0.0]
    for i, name in enumerate(("cpu", "memory")):
        try:
            out[i] = _quantity(values[name]) if name in values else 0.0
        except (ValueError, TypeError, ArithmeticError):
            out[i] = 0.0
    return out[0], out[1]


def _requests(spec: Mapping[str, Any]) -> tuple[float, float]:
    """(cpu cores, memory bytes) requested, as koordinator's ``GetPodRequest``: containers
    summed, max'ed with each init container, plus the pod overhead."""

    def of(container: object) -> tuple[float, float]:
        return _resource_list(_mapping(_mapping(container).get("resources")).get("requests"))

    def items(key: str) -> list[object]:
        value = spec.get(key)
        return value if isinstance(value, list) else []

    cpu = sum(of(c)[0] for c in items("containers"))
    memory = sum(of(c)[1] for c in items("containers"))
    for init in items("initContainers"):
        cpu, memory = max(cpu, of(init)[0]), max(memory, of(init)[1])
    overhead = _resource_list(spec.get("overhead"))
    return cpu + overhead[0], memory + overhead[1]


def _timestamp(raw: object) -> float | None:
    if not isinstance(raw, str):
        return None
    try:
        return datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _pod_of(item: object) -> KubeletPod | None:
    if not isinstance(item, Mapping):
        return None
    meta, spec, status = (_mapping(item.get(k)) for k in ("metadata", "spec", "status"))
    uid = _str(meta.get("uid"))
    if not uid:
        return None
    priority = spec.get("priority")
    cpu_request, memory_request = _requests(spec)
    return KubeletPod(
        name=_str(meta.get("name")), namespace=_str(meta.get("namespace")), uid=uid,
        priority=priority if isinstance(priority, int) and not isinstance(priority, bool) else None,
        phase=_str(status.get("phase")), qos_class=_str(status.get("qosClass")),
        priority_class_name=_str(spec.get("priorityClassName")),
        cpu_request=cpu_request, memory_request=memory_request, created=_timestamp(meta.get("creationTimestamp")),
    )


class KubeletPods:
    """``GET <url>/pods`` on kubelet: the read-only port (http://127.0.0.1:10255) or the
    authenticated one (https://<node>:10250 with a service-account bearer token)."""

    def __init__(
        self, url: str = READ_ONLY_KUBELET, *, token_path: Path | None = None, ca_path: Path | None = None,
        insecure: bool = False, timeout: float = 3.0,
    ) -> None:
        self.url = url.rstrip("/") + "/pods"
        self._token_path = token_path
        self._timeout = timeout
        self._ssl: ssl.SSLContext | None = None
        if self.url.startswith("https://"):
            self._ssl = ssl.create_default_context(cafile=str(ca_path) if ca_path else None)
            if insecure:
                # koordlet's --kubelet-insecure-tls: kubelet serving certs are often self-signed.
                self._ssl.check_hostname = False
                self._ssl.verify_mode = ssl.CERT_NONE
        self._last_problem = ""
        #: kubelet answered a pod list (even an empty one) since the start: koordlet's
        #: pods informer counts as synced from its first successful GetAllPods.
        self.answered = False

    def _request(self) -> urllib.request.Request:
        headers = {"Accept": "application/json"}
        if self._token_path is not None:
            # Read every time: projected service-account tokens are rotated on disk.
            headers["Authorization"] = "Bearer " + self._token_path.read_text().strip()
        return urllib.request.Request(self.url, headers=headers)

    def _problem(self, event: str, *, level: str = "warning", **kw: object) -> None:
        key = f"{event}:{sorted(kw.items())}"
        if key != self._last_problem:
            self._last_problem = key
            getattr(log, level)(event, url=self.url, **kw)

    def fetch(self) -> dict[str, KubeletPod] | None:
        """Pods by uid; None when there is nothing to update from (an error, or an empty
        list, which koordlet ignores too: kubelet answers it while starting)."""
        try:
            with urllib.request.urlopen(self._request(), timeout=self._timeout, context=self._ssl) as resp:
                doc = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError, RecursionError) as exc:  # deep nesting: RecursionError
            self._problem("kubelet_pods_failed", error=str(exc))
            return None
        items = doc.get("items", ()) if isinstance(doc, Mapping) else ()
        if items is None:
            items = []  # Go marshals an empty (nil) slice as null: kubelet with no pods
        if not isinstance(items, list):
            self._problem("kubelet_pods_garbled", error="no items list")
            return None
        self.answered = True
        if not items:
            # Normal on a node without pods, and while kubelet starts: not a warning.
            self._problem("kubelet_pods_empty_ignored", level="info")
            return None
        pods = {pod.uid: pod for pod in map(_pod_of, items) if pod is not None}
        if self._last_problem:
            self._last_problem = ""
            log.info("kubelet_pods_recovered", url=self.url, pods=len(pods))
        return pods


# --- node facts (pure; ValueError on bad data) --------------------------------------
def _resource(node: Mapping[str, Any], field: str, resource: str) -> float | None:
    status = node.get("status")
    values = status.get(field) if isinstance(status, Mapping) else None
    raw = values.get(resource) if isinstance(values, Mapping) else None
    if raw is None:
        return None
    try:
        return _quantity(raw)
    except (ValueError, TypeError, ArithmeticError):
        raise ValueError(f"node status.{field}.{resource}: not a quantity: {raw!r}") from None


def node_capacity_of(node: Mapping[str, Any]) -> tuple[float, int] | None:
    """(cpu cores, memory bytes) from ``status.capacity``; None when either is missing."""
    cpu, memory = _resource(node, "capacity", "cpu"), _resource(node, "capacity", "memory")
    if cpu is None or memory is None:
        return None
    return cpu, int(memory)


def annotation_reserved_cpu_of(node: Mapping[str, Any]) -> float:
    """Cores reserved by the koordinator reservation annotation (0 without one)."""
    meta = node.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    raw = annotations.get(RESERVATION_ANNOTATION) if isinstance(annotations, Mapping) else None
    if not raw:
        return 0.0
    where = f"node annotation {RESERVATION_ANNOTATION}"
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise ValueError(f"{where}: not JSON: {exc}") from None
    if not isinstance(doc, Mapping):
        raise ValueError(f"{where}: not a JSON object: {raw!r}")
    cpus = doc.get("reservedCPUs")
    if cpus:
        # An explicit CPU list wins over a quantity, as in koordlet's reservation helper.
        try:
            return float(len(parse_cpu_list(str(cpus))))
        except CpuListError as exc:
            raise ValueError(f"{where}: reservedCPUs: {exc}") from None
    resources = doc.get("resources")
    raw_cpu = resources.get("cpu") if isinstance(resources, Mapping) else None
    if raw_cpu is None:
        return 0.0
    try:
        return _quantity(raw_cpu)
    except (ValueError, TypeError, ArithmeticError):
        raise ValueError(f"{where}: resources.cpu: not a quantity: {raw_cpu!r}") from None


def kubelet_reserved_cpu_of(node: Mapping[str, Any]) -> float | None:
    """capacity - allocatable cpu in cores; None without both."""
    capacity, allocatable = _resource(node, "capacity", "cpu"), _resource(node, "allocatable", "cpu")
    if capacity is None or allocatable is None:
        return None
    return max(capacity - allocatable, 0.0)


def _spec(obj: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    spec = obj.get("spec") if obj is not None else None
    return spec if isinstance(spec, Mapping) else None


class StatesInformer:
    """Kubelet pods and the node's Node/NodeSLO/NodeMetric; accessors are thread-safe."""

    def __init__(self, kube: KubeClient | None, kubelet: KubeletPods | None, sync_interval: float = 10.0) -> None:
        if sync_interval <= 0:
            raise ValueError(f"sync_interval must be > 0 (got {sync_interval!r})")
        self._kube = kube
        self._kubelet = kubelet
        self._interval = sync_interval
        self._lock = threading.Lock()
        self._objects: dict[Kind, dict[str, Any] | None] = {}
        self._synced: set[Kind] = set()
        self._pods: Mapping[str, KubeletPod] = {}
        self._warned: set[str] = set()
        self._listeners: list[tuple[Kind, Callable[[Mapping[str, Any] | None], None]]] = []

    def on_spec_change(self, kind: Kind, listener: Callable[[Mapping[str, Any] | None], None]) -> None:
        """Call ``listener(spec or None)`` whenever ``kind``'s spec changes (in the watch
        thread; a deleted object gives None). Register before ``run``."""
        self._listeners.append((kind, listener))

    async def run(self) -> None:
        """Poll kubelet and keep the watches running until cancelled."""
        stop = threading.Event()
        if self._kube is not None:
            for kind in Kind:
                handler = functools.partial(self._on_event, kind)
                threading.Thread(
                    target=self._kube.watch, args=(kind, handler, stop), name=f"watch-{kind.value}", daemon=True
                ).start()
        try:
            while True:
                if self._kubelet is not None:
                    await self.sync_pods()
                await asyncio.sleep(self._interval)
        finally:
            stop.set()
            if self._kube is not None:
                self._kube.interrupt_watches()

    async def sync_pods(self) -> None:
        if self._kubelet is None:
            return
        pods = await asyncio.to_thread(self._kubelet.fetch)
        if pods is not None:
            with self._lock:
                self._pods = pods

    def _on_event(self, kind: Kind, etype: str, obj: dict[str, Any] | None) -> None:
        value = None if etype == "DELETED" else obj
        with self._lock:
            self._synced.add(kind)
            before = self._objects.get(kind)
            self._objects[kind] = value
        if _spec(before) != _spec(value) and kind is not Kind.NODE:
            log.info("spec_updated", kind=kind.value, present=value is not None)
            for wanted, listener in self._listeners:
                if wanted is kind:
                    try:
                        listener(_spec(value))
                    except Exception as exc:  # noqa: BLE001 - a listener bug must not stop the watch
                        log.error("spec_listener_failed", kind=kind.value, error=f"{type(exc).__name__}: {exc}")

    def _object(self, kind: Kind) -> dict[str, Any] | None:
        with self._lock:
            return self._objects.get(kind)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning("node_fact_ignored", reason=message)

    # --- accessors --------------------------------------------------------------------
    def has_synced(self, kind: Kind) -> bool:
        """Whether ``kind``'s object was listed (present or not) since the start."""
        with self._lock:
            return kind in self._synced

    def pods(self) -> Mapping[str, KubeletPod]:
        with self._lock:
            return self._pods

    def pods_listed(self) -> bool:
        """Whether kubelet's pods were listed since the start (True without kubelet)."""
        return self._kubelet is None or self._kubelet.answered

    def priority_of(self, uid: str) -> int | None:
        pod = self.pods().get(uid)
        return None if pod is None else pod.priority

    def node(self) -> Mapping[str, Any] | None:
        return self._object(Kind.NODE)

    def nodeslo_rules(self) -> Mapping[str, Any] | None:
        """The NodeSLO ``spec`` (same keys as the YAML ``rules:``), None without one."""
        return _spec(self._object(Kind.NODESLO))

    def nodemetric_spec(self) -> Mapping[str, Any] | None:
        return _spec(self._object(Kind.NODEMETRIC))

    def node_capacity(self) -> tuple[float, int] | None:
        node = self.node()
        try:
            return None if node is None else node_capacity_of(node)
        except ValueError as exc:
            self._warn_once(str(exc))
            return None

    def node_reserved_cpu(self) -> float | None:
        """max(kubelet reserved, reservation annotation) in cores (reference §4.1); a bad
        annotation is ignored (logged once), a bad capacity/allocatable gives None."""
        node = self.node()
        if node is None:
            return None
        try:
            kubelet = kubelet_reserved_cpu_of(node)
        except ValueError as exc:
            self._warn_once(str(exc))
            return None
        if kubelet is None:
            return None
        try:
            annotated = annotation_reserved_cpu_of(node)
        except ValueError as exc:
            self._warn_once(str(exc))
            annotated = 0.0
        return max(kubelet, annotated)
