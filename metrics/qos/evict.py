"""BE eviction (reference §4.3): by memory usage and by BE CPU satisfaction.

Both tasks share one ``EvictionTracker``: a pod already being evicted (by either
task, this round or an earlier one until it is gone) counts as pending release,
so the two never double count or pick the same victim. Victims are ordered by
the ``koordinator.sh/eviction-priority`` annotation, the priority value, the
``koordinator.sh/priority`` label, then by usage (highest first). After a
successful eviction a task cools down (cpu 20 s, memory 4 s by default) so the
next decision sees the effect of the last one.

``Evictor`` is the "how": ``CriEvictor`` stops every container and the sandbox
through the runtime and checks nothing still runs; an API-based one is wired by the
agent. An eviction that did not take raises ``EvictionError``: it is neither counted
nor remembered (no cool-down, not pending), so the next round tries again.

A pod stays "being evicted" (pending release) until it is gone, but no longer than
``PENDING_MAX_AGE``, and not once it runs again under the same UID in a new sandbox: on a
node with a kubelet, a pod stopped through the CRI is restarted by kubelet (its
restartPolicy), which is not an eviction, and its usage is back (issue 28 item 4: the set
stuck, "covered by pods already being evicted" while usage stayed over the threshold).
Hence ``evict_mode`` defaults to ``api`` (the Eviction API, as koordlet's
``--only-evict-by-api``) when the agent has a cluster; ``cri`` there means "stop the pod's
containers now; kubelet restarts it", a relief, not an eviction.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter

from criapi import cri_v1_pb2
from hooks.rules import ResourceThresholdStrategy
from metrics.model import PodView
from metrics.qos.inputs import BECPUWindow, NodeInputs
from metrics.qos.plan import Evict, Plan, Priority
from metrics.qos.suppress import is_be, suppress_cores
from runtimeproxy.errors import PeerError
from runtimeproxy.hookapi import CriCall, CriCallError

log = structlog.get_logger("metrics.qos.evict")

CPU_NAME: Final = "be_cpu_evict"
MEMORY_NAME: Final = "be_memory_evict"
CPU_FEATURE: Final = "BECPUEvict"
MEMORY_FEATURE: Final = "BEMemoryEvict"
EVICTION_PRIORITY: Final = "koordinator.sh/eviction-priority"
EVICTION_POLICY: Final = "koordinator.sh/eviction-policy"
SUB_PRIORITY: Final = "koordinator.sh/priority"
STOP_CONTAINER: Final = "/runtime.v1.RuntimeService/StopContainer"
STOP_SANDBOX: Final = "/runtime.v1.RuntimeService/StopPodSandbox"
LIST_CONTAINERS: Final = "/runtime.v1.RuntimeService/ListContainers"
#: A pod evicted this long ago and still on the node no longer counts as being evicted
#: (seconds: four times Kubernetes' default 30 s termination grace period).
PENDING_MAX_AGE: Final = 120.0


class EvictionError(PeerError):
    """A pod could not be (fully) evicted."""


class Evictor(Protocol):
    async def evict(self, pod: PodView, reason: str) -> None:
        """Evict ``pod``; raise ``EvictionError`` if it could not be done."""


class CriEvictor:
    """Stops the pod through the runtime: each container (StopContainer, timeout 0), then
    its sandbox (StopPodSandbox), as kubelet kills a pod; then checks that nothing of it runs.

    A container that is only CREATED is not stopped by StopContainer (containerd answers
    OK and does nothing), and a pod seen at RunPodSandbox may have no container yet: an
    eviction landing before StartContainer would stop nothing and still count as done,
    and the pod, remembered as being evicted, would then run for good. Stopping the
    sandbox makes the runtime refuse any later CreateContainer/StartContainer in it; a
    container still RUNNING afterwards fails the eviction, so it is retried next round.
    """

    def __init__(self, cri: CriCall, timeout: float = 10.0) -> None:
        self._cri = cri
        self._timeout = timeout

    async def evict(self, pod: PodView, reason: str) -> None:
        failed: list[str] = []
        for ctr in pod.containers:
            request = cri_v1_pb2.StopContainerRequest(container_id=ctr.id, timeout=0).SerializeToString()
            await self._call(STOP_CONTAINER, request, ctr.name, failed)
        if pod.sandbox_id:
            stop = cri_v1_pb2.StopPodSandboxRequest(pod_sandbox_id=pod.sandbox_id).SerializeToString()
            await self._call(STOP_SANDBOX, stop, "sandbox", failed)
            failed += await self._still_running(pod)
        if failed:
            raise EvictionError(f"pod {pod.key}: stopping containers failed: {'; '.join(failed)}")

    async def _call(self, method: str, request: bytes, what: str, failed: list[str]) -> None:
        try:
            await self._cri(method, request, self._timeout)
        except CriCallError as exc:
            if exc.code != "NOT_FOUND":  # already gone is what we wanted
                failed.append(f"{what}: {exc.code}: {exc.message}")

    async def _still_running(self, pod: PodView) -> list[str]:
        """The runtime's own word, not the pod view's (it may predate a container)."""
        running = cri_v1_pb2.ContainerStateValue(state=cri_v1_pb2.CONTAINER_RUNNING)
        request = cri_v1_pb2.ListContainersRequest(filter=cri_v1_pb2.ContainerFilter(
            pod_sandbox_id=pod.sandbox_id, state=running)).SerializeToString()
        try:
            reply = cri_v1_pb2.ListContainersResponse.FromString(
                await self._cri(LIST_CONTAINERS, request, self._timeout))
        except CriCallError as exc:
            return [f"checking: {exc.code}: {exc.message}"]
        return [f"{c.metadata.name}: still running" for c in reply.containers
                if c.state == cri_v1_pb2.CONTAINER_RUNNING]


#: koordlet's eviction reasons, the ``reason`` label (bounded, unlike the log line's text).
REASONS: Final = {MEMORY_NAME: "EvictPodByNodeMemoryUsage", CPU_NAME: "EvictPodByBECPUSatisfaction",
                  "cpu_evict": "EvictPodByNodeCPUUsage", "cpu_allocatable_evict": "EvictPodByNodeCPUAllocatable",
                  "memory_allocatable_evict": "EvictPodByNodeMemoryAllocatable"}


class EvictionMetrics:
    """``koordlet_pod_eviction{node, reason}`` on a given registry (None: not exported)."""

    def __init__(self, registry: CollectorRegistry | None, node: str) -> None:
        self.node = node
        self._counter: Counter | None = None
        if registry is not None:
            self._counter = Counter("koordlet_pod_eviction", "Pods evicted by the QoS manager",
                                    labelnames=("node", "reason"), registry=registry)

    def inc(self, strategy: str) -> None:
        if self._counter is not None:
            self._counter.labels(node=self.node, reason=REASONS.get(strategy, strategy)).inc()


@dataclass(frozen=True, slots=True)
class Pending:
    uid: str
    since: float
    cpu: float  # cores
    memory: float  # bytes
    #: The sandbox stopped; the same UID in another sandbox is the pod restarted.
    sandbox_id: str = ""


class EvictionTracker:
    """Pods being evicted, shared by the tasks, until they disappear from the node, run
    again in a new sandbox (the pod views show one sandbox per UID, the newest), or
    ``PENDING_MAX_AGE`` passed."""

    def __init__(self) -> None:
        self._pending: dict[str, Pending] = {}

    def __contains__(self, uid: object) -> bool:
        return uid in self._pending

    def add(self, pending: Pending) -> None:
        self._pending[pending.uid] = pending

    def prune(self, live: Iterable[str]) -> None:
        alive = set(live)
        for uid in [u for u in self._pending if u not in alive]:
            del self._pending[uid]

    def refresh(self, pods: Iterable[PodView], now: float, max_age: float = PENDING_MAX_AGE) -> None:
        """Drop pods gone, pods running again in a new sandbox (kubelet restarted a pod
        stopped through the CRI: not evicted), and evictions older than ``max_age``."""
        live = {p.uid: p for p in pods}
        self.prune(live)
        for uid, pending in list(self._pending.items()):
            pod = live[uid]
            if pending.sandbox_id and pod.sandbox_id and pod.sandbox_id != pending.sandbox_id:
                why = "the pod runs again in a new sandbox (restarted, not evicted)"
            elif now - pending.since > max_age:
                why = f"still on the node {now - pending.since:.0f}s after its eviction"
            else:
                continue
            del self._pending[uid]
            log.warning("eviction_pending_expired", pod=pod.key, reason=why, since=pending.since)

    def pending_cpu(self) -> float:
        return sum(p.cpu for p in self._pending.values())

    def pending_memory(self) -> float:
        return sum(p.memory for p in self._pending.values())


@dataclass(frozen=True, slots=True)
class EvictConfig:
    collect_interval: float = 1.0
    cpu_cool_down: float = 20.0
    memory_cool_down: float = 4.0


def _int_annotation(values: Any, key: str) -> int:
    try:
        return int(values.get(key, 0))
    except (TypeError, ValueError):
        return 0


def allowed(pod: PodView, feature: str) -> bool:
    """``koordinator.sh/eviction-policy``: when present, a JSON list that must name the feature."""
    raw = pod.annotations.get(EVICTION_POLICY)
    if raw is None:
        return True
    try:
        names = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):  # RecursionError: "[[[[..." nested too deeply
        return False  # unreadable opt-in list: do not evict on a guess
    return isinstance(names, list) and feature in names


def order_victims(pods: Sequence[PodView], usage: Callable[[PodView], float]) -> list[PodView]:
    """Eviction-priority asc, priority asc, sub-priority asc, usage desc, name desc."""
    by_name = sorted(pods, key=lambda p: p.key, reverse=True)
    return sorted(by_name, key=lambda p: (_int_annotation(p.annotations, EVICTION_PRIORITY), p.priority,
                                         _int_annotation(p.labels, SUB_PRIORITY), -usage(p)))


def pick(victims: Sequence[PodView], need: float, amount: Callable[[PodView], float]) -> list[PodView]:
    chosen: list[PodView] = []
    got = 0.0
    for pod in victims:
        if got >= need:
            break
        chosen.append(pod)
        got += amount(pod)
    return chosen


def batch_cpu_cores(pod: PodView) -> float:
    return pod.batch_cpu_request_milli / 1000


@dataclass
class EvictRound:
    """Victims chosen so far in this round (shared by the tasks)."""

    chosen: list[PodView] = field(default_factory=list)

    def uids(self) -> set[str]:
        return {p.uid for p in self.chosen}


def round_of(scratch: dict[str, Any]) -> EvictRound:
    """The victims chosen so far this round, shared by every evicting strategy
    (``RoundInputs.scratch``): a pod picked by one task is not picked again, and
    counts towards the next task's release."""
    found = scratch.setdefault("evict.round", EvictRound())
    assert isinstance(found, EvictRound)
    return found


#: koordlet's evictors: the tasks of one evictor share its cool-down (a successful
#: eviction by any of them pauses all of them), as ``CPUEvict`` / ``MemoryEvict`` do.
EVICTOR_OF: Final[dict[str, str]] = {CPU_NAME: "cpu", MEMORY_NAME: "memory", "cpu_evict": "cpu",
                                     "cpu_allocatable_evict": "cpu", "memory_allocatable_evict": "memory"}


@dataclass
class SharedEviction:
    """What the evicting strategies share: the pods being evicted and the cool-downs."""

    tracker: EvictionTracker = field(default_factory=EvictionTracker)
    #: evictor ("cpu" | "memory") -> time of its last successful eviction.
    last: dict[str, float] = field(default_factory=dict)

    def on_evicted(self, task: str, pod: PodView, inputs: NodeInputs, action: Evict | None = None) -> None:
        """Record a successful eviction: pending release (what ``action`` counted on
        getting back; else the batch-cpu request and memory used) and the evictor's cool-down."""
        self.last[EVICTOR_OF.get(task, task)] = inputs.now
        if action is not None:
            self.tracker.add(Pending(pod.uid, inputs.now, action.released_cpu, action.released_memory, pod.sandbox_id))
            return
        self.tracker.add(Pending(pod.uid, inputs.now, batch_cpu_cores(pod), inputs.pod_memory_used.get(pod.uid, 0.0),
                                 pod.sandbox_id))

    def cooling(self, task: str, now: float, cool_down: float) -> float | None:
        """Until when ``task``'s evictor cools down (None: it does not)."""
        last = self.last.get(EVICTOR_OF.get(task, task))
        return None if last is None or now - last >= cool_down else last + cool_down


class EvictionStrategy:
    def __init__(self, cfg: EvictConfig, tracker: EvictionTracker | None = None,
                 shared: SharedEviction | None = None) -> None:
        self.cfg = cfg
        self.state = shared if shared is not None else SharedEviction(tracker or EvictionTracker())
        self.tracker = self.state.tracker

    def on_evicted(self, task: str, pod: PodView, inputs: NodeInputs) -> None:
        """Record a successful eviction: pending release and the task's cool-down."""
        self.state.on_evicted(task, pod, inputs)

    def _cooling(self, task: str, now: float, cool_down: float) -> float | None:
        return self.state.cooling(task, now, cool_down)

    def plan(self, inputs: NodeInputs, window: BECPUWindow | None, threshold: ResourceThresholdStrategy,
             current: EvictRound | None = None) -> list[Plan]:
        """Memory task first, then CPU; the CPU task sees the memory task's victims."""
        self.tracker.refresh(inputs.pods, inputs.now)
        current = current if current is not None else EvictRound()
        return [self.plan_memory(inputs, threshold, current), self.plan_cpu(inputs, window, threshold, current)]

    def _candidates(self, inputs: NodeInputs, feature: str, current: EvictRound) -> list[PodView]:
        taken = current.uids()
        return [p for p in inputs.pods if is_be(p) and p.uid not in self.tracker and p.uid not in taken
                and allowed(p, feature)]

    def plan_memory(self, inputs: NodeInputs, t: ResourceThresholdStrategy, current: EvictRound | None = None) -> Plan:
        current = current if current is not None else EvictRound()
        if not t.enable:
            return Plan(MEMORY_NAME, Priority.EVICTION, (), {"enable": False}, "disabled")
        until = self._cooling(MEMORY_NAME, inputs.now, self.cfg.memory_cool_down)
        if until is not None:
            return Plan(MEMORY_NAME, Priority.EVICTION, (), {"cool_down_until": until}, "cooling down")
        used, total = inputs.node_memory_used, inputs.node_memory_total
        if used is None or total is None or total <= 0:
            return Plan(MEMORY_NAME, Priority.EVICTION, (), {}, "no decision: node memory usage missing or stale")
        percent = used / total * 100
        info: dict[str, Any] = {"usage_percent": round(percent, 3), "threshold_percent":
                                t.memory_evict_threshold_percent, "lower_percent": t.memory_evict_lower}
        if percent < t.memory_evict_threshold_percent:
            return Plan(MEMORY_NAME, Priority.EVICTION, (), info, "below threshold")
        need = total * (percent - t.memory_evict_lower) / 100 - self.tracker.pending_memory()
        info |= {"release_bytes": need, "pending_bytes": self.tracker.pending_memory()}
        if need <= 0:
            return Plan(MEMORY_NAME, Priority.EVICTION, (), info, "covered by pods already being evicted")

        def mem(p: PodView) -> float:
            return inputs.pod_memory_used.get(p.uid, 0.0)

        victims = pick(order_victims(self._candidates(inputs, MEMORY_FEATURE, current), mem), need, mem)
        current.chosen += victims
        reason = f"node memory {percent:.1f}% >= {t.memory_evict_threshold_percent}%"
        actions = tuple(Evict(p.uid, p.key, reason, batch_cpu_cores(p), mem(p)) for p in victims)
        return Plan(MEMORY_NAME, Priority.EVICTION, actions, info, reason if actions else "no BE pod to evict")

    def plan_cpu(self, inputs: NodeInputs, window: BECPUWindow | None, t: ResourceThresholdStrategy,
                 current: EvictRound | None = None) -> Plan:
        current = current if current is not None else EvictRound()
        lower, upper = t.cpu_evict_be_satisfaction_lower_percent, t.cpu_evict_be_satisfaction_upper_percent
        if not t.enable or lower is None or upper is None:
            return Plan(CPU_NAME, Priority.EVICTION, (), {"enable": t.enable}, "disabled or satisfaction unset")
        until = self._cooling(CPU_NAME, inputs.now, self.cfg.cpu_cool_down)
        if until is not None:
            return Plan(CPU_NAME, Priority.EVICTION, (), {"cool_down_until": until}, "cooling down")
        need, info, why = self.cpu_release(inputs, window, t, lower, upper)
        if need is None:
            return Plan(CPU_NAME, Priority.EVICTION, (), info, why)
        pending = self.tracker.pending_cpu() + sum(batch_cpu_cores(p) for p in current.chosen)
        need -= pending
        info |= {"release_cores": need, "pending_cores": pending}
        if need <= 0:
            return Plan(CPU_NAME, Priority.EVICTION, (), info, "covered by pods already being evicted")

        def ratio(p: PodView) -> float:
            req = batch_cpu_cores(p)
            return inputs.pod_cpu_used.get(p.uid, 0.0) / req if req > 0 else 0.0

        # A pod without a batch-cpu request frees no request: evicting it cannot help.
        pool = [p for p in self._candidates(inputs, CPU_FEATURE, current) if batch_cpu_cores(p) > 0]
        victims = pick(order_victims(pool, ratio), need, batch_cpu_cores)
        current.chosen += victims
        actions = tuple(Evict(p.uid, p.key, why, batch_cpu_cores(p), inputs.pod_memory_used.get(p.uid, 0.0))
                        for p in victims)
        return Plan(CPU_NAME, Priority.EVICTION, actions, info, why if actions else "no BE pod to evict")

    def cpu_release(self, inputs: NodeInputs, window: BECPUWindow | None, t: ResourceThresholdStrategy,
                    lower: int, upper: int) -> tuple[float | None, dict[str, Any], str]:
        """Cores of BE request to release (None: no eviction) with the numbers and why."""
        span = max(self.cfg.collect_interval, float(t.cpu_evict_time_window_seconds or 0))
        if window is None or window.count * self.cfg.collect_interval < span / 3:
            count = 0 if window is None else window.count
            return None, {"window_seconds": span, "samples": count}, "no decision: too few BE samples in the window"
        limit_avg, limit_last = window.limit_avg, window.limit_last
        if t.cpu_evict_policy == "evictByAllocatable":
            allocatable = be_allocatable(inputs)
            if allocatable is None:
                return None, {"window_seconds": span}, "no decision: node cpu usage missing or stale"
            limit_avg = limit_last = allocatable
        info: dict[str, Any] = {"window_seconds": span, "samples": window.count, "usage_avg": window.usage_avg,
                                "request_avg": window.request_avg, "limit_avg": limit_avg, "limit_last": limit_last,
                                "policy": t.cpu_evict_policy}
        if window.request_avg <= 0 or window.request_last <= 0:
            return None, info, "no BE cpu request"
        if limit_avg >= 1 and window.usage_avg / limit_avg < t.cpu_evict_be_usage_threshold_percent / 100:
            return None, info, "BE pods do not use their limit: not starved"
        satisfaction = limit_avg / window.request_avg
        info["satisfaction"] = round(satisfaction, 4)
        if satisfaction > lower / 100:
            return None, info, f"BE satisfaction {satisfaction:.2f} above {lower}%"
        by_avg = window.request_avg * (upper / 100 - satisfaction)
        by_last = window.request_last * (upper / 100 - limit_last / window.request_last)
        need = min(by_avg, by_last)
        info |= {"release_by_avg": by_avg, "release_by_last": by_last}
        if need <= 0:
            return None, info, "BE satisfaction already recovered"
        return need, info, f"BE cpu satisfaction {satisfaction:.2f} <= {lower}%"


def be_allocatable(inputs: NodeInputs) -> float | None:
    """What BE may have now: capacity - system - non-BE usage (current values: the
    store keeps no BE-allocatable series to average)."""
    if inputs.missing_for(*(p for p in inputs.pods if not is_be(p))):
        return None
    formula = suppress_cores(inputs, ResourceThresholdStrategy(cpu_suppress_threshold_percent=100))
    return max(formula.suppress, 0.0)


async def carry_out(evictor: Evictor, pod: PodView, action: Evict, strategy: str, metrics: EvictionMetrics) -> bool:
    """Evict, with one log line and (on success) one counter increment."""
    try:
        await evictor.evict(pod, action.reason)
    except EvictionError as exc:
        log.warning("pod_eviction_failed", pod=pod.key, strategy=strategy, reason=action.reason, error=str(exc))
        return False
    log.warning("pod_evicted", pod=pod.key, strategy=strategy, reason=action.reason,
                released_cpu=action.released_cpu, released_memory=action.released_memory)
    metrics.inc(strategy)
    return True
