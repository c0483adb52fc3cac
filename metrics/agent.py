"""The metrics task (entry point ``metrics`` in ``koord_runtime_proxy.tasks``).

One supervised coroutine owns the node's measurements: a loop per collection
interval (the collectors sharing it run one after the other in one dedicated worker
thread, which also writes the batch and flushes the store at ``flush_interval``), the
store's GC, the states informer and, with a cluster, the NodeMetric reporter. Derived
series (system usage, the best-effort aggregate) are computed right after the pod
collector, in the same job as the node collector, so they never mix samples of
different seconds.

The agent is provided (``TaskInit.provide``) to the tasks that declare they need it
(``needs = ("metrics",)``: the QoS manager, the interference analyser), so they read
the same store and pod views instead of measuring everything a second time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector as PromCollector

from hooks.qos import QoSClass
from hooks.rules import LiveRules, Rules
from metrics import checkplan
from metrics import model as m
from metrics.analysis.predictor_task import PredictionTask
from metrics.collect.advisor import AdvisorCollector, AdvisorHealth
from metrics.collect.base import Collector
from metrics.collect.be import BEAggregator
from metrics.collect.cgroupfs import PodCollector
from metrics.collect.hostapp import HostAppCollector, parse_host_apps
from metrics.collect.memlat import MemLatencyCollector
from metrics.collect.procfs import NodeCollector
from metrics.collect.registry import GROUP, Built, load_collectors
from metrics.collect.topology import TopologyCollector
from metrics.informer.kubetypes import Kind, KubeSettings, KubeUnavailable
from metrics.informer.nodeslo import NodeSLOKeeper
from metrics.informer.pods import PodViews
from metrics.informer.states import KubeletPods, StatesInformer
from metrics.model import PodView, Sample
from metrics.report.events import WARNING, EventRecorder
from metrics.report.nrtsync import NRTClient, NRTReporter, NRTSources
from metrics.report.promexport import StoreValues, register_exporter
from metrics.report.reporter import NodeMetricReporter
from metrics.settings import MetricsSettings, parse_metrics, validate_metrics
from metrics.store.tsdb import TSDB, GCResult, TSDBError
from metrics.topcmd import pod_meta_record
from runtimeproxy import heap
from runtimeproxy.hookapi import HookConfigError, PodInfo, TaskInit

if TYPE_CHECKING:  # the API client: imported only when configured
    from metrics.informer.kubeclient import KubeClient

log = structlog.get_logger("metrics.agent")

_T = TypeVar("_T")


#: Pod views are rebuilt when the set of pods/containers changes, and at least this often
#: (priorities from kubelet and rule changes arrive without a CRI call).
_VIEWS_MAX_AGE: Final = 10.0


class MetricsAgent:
    def __init__(self, init: TaskInit, settings: MetricsSettings) -> None:
        self.settings = settings
        self._init = init
        self._rules = LiveRules(base=init.rules, current=init.current_rules, owner=init.name)
        try:
            tiers = settings.tiers
            self.tsdb = TSDB.open_or_reset(
                settings.db, retention=settings.retention, max_bytes=settings.max_bytes, raw_retention=tiers.raw,
                rollup_step=tiers.step, coarse_step=tiers.coarse_step, coarse_after=tiers.coarse_after,
            )
        except TSDBError as exc:
            raise HookConfigError(f"{init.key_path}.db", str(settings.db), str(exc)) from exc
        self.kube = _connect(settings)
        #: Events on pods and the node (no-op without a cluster), shared with the QoS manager.
        self.events = EventRecorder(self.kube, settings.node_name)
        kubelet = _kubelet(settings)
        self.informer = (
            StatesInformer(self.kube, kubelet, sync_interval=settings.kubelet.sync_interval)
            if self.kube is not None or kubelet is not None else None
        )
        self.nodeslo = NodeSLOKeeper(init.rules, init.state_dir, self._nodeslo_apply, self._nodeslo_rejected)
        if self.informer is not None:
            self.informer.on_spec_change(Kind.NODESLO, self._nodeslo_changed)
        self.views = PodViews(init.snapshot, driver=settings.cgroup_driver, guaranteed=self._guaranteed,
                              priority_of=self._priority)
        self._pods: list[PodView] = []
        self._views_key: object = None
        #: The views were built from a complete pod set: the proxy's store rebuilt and
        #: kubelet's first pod list in. Nothing is published (NodeMetric, NRT, the
        #: restored prediction) before: right after a restart both are still empty.
        self._views_complete = False
        self._views_at = 0.0
        self._meta_dirty = False
        self._meta_written: object = None
        # The registry's collectors in tick order (phase, then name: the node before host
        # applications before pods, whose tick computes the derived series).
        try:
            built = load_collectors(settings, init.host, self.tsdb, f"{init.key_path}.collectors")
        except BaseException:  # a factory refused its args: the process exits, the store closes
            self.tsdb.close()
            raise
        self.node = _builtin(built, "node", NodeCollector)
        self.pod_collector = _builtin(built, "pods", PodCollector)
        self.topology = _builtin(built, "topology", TopologyCollector)
        self.hostapps = _builtin(built, "hostapps", HostAppCollector)
        self.be = BEAggregator(init.host, besteffort_dir=settings.besteffort_dir)
        self.collectors: list[Collector] = [b.collector for b in built.values()]
        self._phases = {name: b.phase for name, b in built.items()}
        # External advisors last: each scrapes in its own thread, the tick takes the last result.
        self.advisors = [AdvisorCollector(spec) for spec in settings.advisors]
        self.collectors += self.advisors
        memlat = built["memlat"].collector if "memlat" in built else None
        self.memlat = memlat if isinstance(memlat, MemLatencyCollector) else None
        if init.registry is not None:
            exporter = register_exporter(init.registry, StoreValues(self.tsdb.newest_values), self.pods,
                                         settings.node_name)
            init.add_exposition(exporter.render)
            init.registry.register(_StoreHealth(self.tsdb))
            if self.advisors:
                init.registry.register(AdvisorHealth(self.advisors))
        self.prediction = (PredictionTask(settings.prediction, settings.prediction_checkpoint, self.tsdb, self.pods,
                                          self.informer, ready=self.pods_complete)
                           if settings.prediction.enabled else None)
        if self.prediction is not None and init.registry is not None:
            init.registry.register(self.prediction.gauges(settings.node_name))
        self.reporter = NodeMetricReporter(self.tsdb, self.pods, self.informer, self.kube,
                                           prediction=self.prediction.latest if self.prediction is not None else None,
                                           ready=self.pods_complete)
        init.add_route("/apis/nodemetric", self.reporter.route)
        self.nrt = NRTReporter(
            NRTSources(settings.node_name, init.host, self.topology.latest, self.pods,
                       lambda: self.informer.node() if self.informer is not None else None,
                       cpu_manager_state=settings.kubelet_cpu_manager_state, kubelet_config=settings.kubelet_config),
            _nrt_client(self.kube) if settings.nrt_report else None, interval=settings.nrt_interval,
            ready=self.pods_complete)
        init.add_route("/apis/noderesourcetopology", self.nrt.route)
        init.add_explainer("metrics", self.explain)
        self.ticks: dict[str, int] = {c.name: 0 for c in self.collectors}
        #: CPU seconds spent per part (a collector's name, "store", "flush", "gc"), measured
        #: with the worker thread's clock: what the agent costs the node, and where.
        self.cpu_seconds: dict[str, float] = dict.fromkeys([*self.ticks, "store", "flush", "gc"], 0.0)
        self._cost_lock = threading.Lock()
        self._flushed_at = 0.0
        self._errors: set[str] = set()
        if self.kube is not None:
            # The last good NodeSLO is in force from the start, before the NodeSLO is listed.
            self.nodeslo.restore()

    # --- views -------------------------------------------------------------------

    def rules(self) -> Rules:
        """The rules in force: the NodeSLO merged over the YAML ``rules:`` while there is
        one, else the YAML (the process's one rules provider; parsed once per change)."""
        return self._rules()

    def _nodeslo_changed(self, spec: Mapping[str, Any] | None) -> None:
        """The NodeSLO changed (watch thread): the keeper puts it in force, or keeps the
        last good one when it does not parse (``metrics.informer.nodeslo``)."""
        self.nodeslo.update(spec)

    def _nodeslo_apply(self, spec: Mapping[str, Any] | None, overlay: Mapping[str, Any] | None) -> None:
        """Register the NodeSLO as the rules overlay of every hook and task."""
        self._init.set_rules_overlay("nodeslo", overlay)
        self._host_apps_from(spec)

    def _nodeslo_rejected(self, exc: HookConfigError, applied: str) -> None:
        log.warning("nodeslo_rejected", key=exc.key_path, value=repr(exc.value)[:200], reason=exc.message,
                    applied=applied)
        self.events.record(self.events.node(), WARNING, "NodeSLORejected",
                           f"{exc.key_path}={repr(exc.value)[:200]}: {exc.message}; the {applied} applies")

    def _host_apps_from(self, spec: Mapping[str, Any] | None) -> None:
        """A NodeSLO's ``hostApplications`` replace the YAML's; a refused item is logged
        (field and value) and left out, the others are measured."""
        if spec is None or spec.get("hostApplications") is None:
            self.hostapps.set_apps(self.settings.host_applications)
            return
        apps, problems = parse_host_apps(spec.get("hostApplications"), self.settings.cgroup_driver)
        for problem in problems:
            log.warning("host_application_refused", reason=problem, source="nodeslo")
        self.hostapps.set_apps(apps)

    def _guaranteed(self) -> QoSClass:
        return self.rules().guaranteed_class

    def _priority(self, uid: str) -> int | None:
        return self.informer.priority_of(uid) if self.informer is not None else None

    def pods(self) -> list[PodView]:
        """The pod views of the last pod tick (cheap: no rebuild)."""
        return self._pods

    def pods_complete(self) -> bool:
        """Whether the pod views were built from a complete pod set (see ``_views_complete``)."""
        return self._views_complete

    def refresh_pods(self) -> list[PodView]:
        # Read before the snapshot: a store rebuilt in between is seen at the next tick.
        complete = self._init.pods_known() and (self.informer is None or self.informer.pods_listed())
        pods, containers = self._init.snapshot()
        key = (complete, frozenset(pods), frozenset(containers))
        now = time.monotonic()
        if key != self._views_key or now - self._views_at > _VIEWS_MAX_AGE:
            self._pods = self.views.current()
            self._views_key, self._views_at, self._views_complete = key, now, complete
            self._meta_dirty = True  # written by the pod tick, in its worker thread
        return self._pods

    # --- loops -------------------------------------------------------------------

    async def run(self) -> None:
        # One worker thread for every collector tick and flush: a tick wakes the same
        # (warm) thread, ticks never overlap, and the store sees one writer thread.
        worker = ThreadPoolExecutor(1, thread_name_prefix="metrics")
        stopping = False
        try:
            async with asyncio.TaskGroup() as group:
                for interval, collectors in _by_interval(self.collectors).items():
                    names = "+".join(c.name for c in collectors)
                    group.create_task(self._collect_loop(interval, collectors, worker), name=f"collect:{names}")
                group.create_task(self._every(self.settings.gc_interval, self._gc), name="tsdb:gc")
                if self.prediction is not None:
                    group.create_task(self._guarded("prediction", self.prediction.run), name="prediction")
                if self.kube is not None:
                    # Without a cluster nobody is sent the document: the loopback route
                    # builds it on request instead of every report interval.
                    group.create_task(self._guarded("nodemetric", self.reporter.run), name="nodemetric")
                if self.nrt.connected:
                    group.create_task(self._guarded("nrt", self.nrt.run), name="nrt")
                if self.informer is not None:
                    group.create_task(self._guarded("informer", self.informer.run), name="informer")
        except asyncio.CancelledError:  # only the supervisor's stop cancels the task
            stopping = True
            raise
        finally:
            # Cancelled (shutdown) or crashed: let a running tick end, close the
            # collectors' open files, keep what was measured. At shutdown the store
            # is closed (WAL checkpointed and removed); after a crash the supervisor
            # runs this again on the same store.
            await asyncio.to_thread(self._stop_worker, worker)
            await asyncio.to_thread(self.events.close)
            await asyncio.to_thread(self.tsdb.close if stopping else self.tsdb.flush)

    def _stop_worker(self, worker: ThreadPoolExecutor) -> None:
        worker.shutdown(wait=True, cancel_futures=True)
        for collector in self.collectors:
            collector.close()
        self.be.close()

    async def _guarded(self, name: str, job: Callable[[], Awaitable[None]]) -> None:
        """Keep a side job (reporting, API watches) from taking the collectors down with it."""
        delay = 1.0
        while True:
            try:
                await job()
            except Exception as exc:  # logged with its traceback, then retried
                log.exception("agent_job_failed", job=name, error=str(exc), retry_in=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 60.0)

    async def _collect_loop(self, interval: float, collectors: Sequence[Collector], worker: Executor) -> None:
        """The collectors sharing ``interval``, one after the other in one worker job:
        node before pods, so the derived series use the same tick's figures. The loop
        hands the tick over and does not wait for it: being woken once more per tick
        costs the loop ~0.2 ms of CPU on a VM. A tick that raised fails this task (the
        supervisor restarts it) at the next interval; one still running then makes the
        next tick skip rather than queue."""
        next_at = time.monotonic()
        running: Future[None] | None = None
        while True:
            if running is not None and running.done():
                running.result()  # a tick that raised: fail here, as if awaited
                running = None
            if running is None:
                # The store snapshot is read on the loop (the store is mutated there).
                pods = self.refresh_pods() if self.pod_collector in collectors else self._pods
                running = worker.submit(self._tick, collectors, time.time(), pods)
            next_at += interval
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind (slow disk, suspended VM): skip, do not burst
                next_at, delay = time.monotonic(), 0.0
            await asyncio.sleep(delay)

    def _tick(self, collectors: Sequence[Collector], now: float, pods: Sequence[PodView]) -> None:
        """One collection, in the worker thread: the reads, the derived series and the
        store's batch and flush (which may wait on a compaction) stay off the loop
        that serves kubelet."""
        samples: list[Sample] = []
        for collector in collectors:
            started = time.thread_time()
            samples += self._collect(collector, now, pods)
            if collector is self.pod_collector:
                samples += self._derived(pods)
            self._account(collector.name, time.thread_time() - started)
            self.ticks[collector.name] += 1
        started = time.thread_time()
        if self.pod_collector in collectors and self._meta_dirty:
            self._meta_dirty = False
            meta = pod_meta_record(pods)
            if meta != self._meta_written:  # views are rebuilt every 10 s, mostly unchanged
                self.tsdb.put_kv(m.KV_POD_META, meta)
                self._meta_written = meta
        # A batch this fills is flushed below, timed as the flush: flushed inside the
        # write, its cost was the store's at 250 pods and the flush's at 110.
        self.tsdb.write(samples, now, flush_full=False)
        if self.topology in collectors:
            record = self.topology.as_record()
            if record is not None:
                self.tsdb.put_kv(m.KV_NODE_CPU_INFO, record)
        self._account("store", time.thread_time() - started)
        # Ticks jitter by a few ms: 0.9 keeps a 1 s flush on every 1 s tick.
        if self.tsdb.batch_full or time.monotonic() - self._flushed_at >= 0.9 * self.settings.flush_interval:
            self._flushed_at = time.monotonic()
            self._timed("flush", self.tsdb.flush)

    def _account(self, part: str, seconds: float) -> None:
        with self._cost_lock:  # the collector worker and GC's thread both add
            self.cpu_seconds[part] += seconds

    def _timed(self, part: str, job: Callable[[], _T]) -> _T:
        """``job`` in this (worker) thread, its CPU time added to ``part``."""
        started = time.thread_time()
        try:
            return job()
        finally:
            self._account(part, time.thread_time() - started)

    def _collect(self, collector: Collector, now: float, pods: Sequence[PodView]) -> list[Sample]:
        try:
            return collector.collect(now, pods)
        except Exception as exc:
            key = f"{collector.name}:{type(exc).__name__}"
            if key not in self._errors:
                self._errors.add(key)
                log.exception("collector_failed", collector=collector.name, error=str(exc))
            return []

    def _derived(self, pods: Sequence[PodView]) -> list[Sample]:
        return self.be.samples(self.node.latest(), self.pod_collector.latest(), pods, self.hostapps.latest())

    async def _every(self, interval: float, job: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval)
            await job()

    async def _gc(self) -> None:
        result = await asyncio.to_thread(self._timed, "gc", self._gc_and_trim)
        log.info("tsdb_gc", **dataclasses.asdict(result))

    def _gc_and_trim(self) -> GCResult:
        result = self.tsdb.gc()
        # Compaction and GC allocate and free megabytes; glibc keeps freed heap pages
        # unless asked to give them back (every 5 min: ~1 ms).
        heap.trim()
        return result

    # --- explain -----------------------------------------------------------------

    def explain(self, pod: PodInfo | None) -> Mapping[str, Any]:
        now = time.time()
        if pod is None:
            out: dict[str, Any] = {"db": str(self.settings.db), "ticks": dict(self.ticks), "pods": len(self._pods),
                                   "cpu_seconds": {k: round(v, 3) for k, v in self.cpu_seconds.items()},
                                   "store": self.tsdb.state(), "noderesourcetopology": self.nrt.explain(),
                                   "events": self.events.explain(), "nodeslo": self.nodeslo.explain()}
            for metric in (m.NODE_CPU_USAGE, m.NODE_MEMORY_USED, m.SYSTEM_CPU_USAGE, m.BE_CPU_USAGE,
                           m.BE_CPU_LIMIT):
                last = self.tsdb.last(metric, m.NO_LABELS, max_age=60, now=now)
                out[metric] = None if last is None else round(last.value, 4)
            out["host_applications"] = [app.name for app in self.hostapps.apps]
            out["memlat"] = None if self.memlat is None else self.memlat.explain()
            # the registry's result: what runs, how often, in which order within a tick
            out["collectors"] = {c.name: {"interval": c.interval, "phase": self._phases.get(c.name)}
                                 for c in self.collectors}
            if self.advisors:
                out["advisors"] = {a.spec.name: a.explain() for a in self.advisors}
            if self.prediction is not None:
                out["prediction"] = self.prediction.explain()
            return out
        labels = m.labels(pod_uid=pod.meta.uid)
        view: dict[str, Any] = {}
        for metric in (m.POD_CPU_USAGE, m.POD_MEMORY_USED, m.POD_MEMORY_CACHE, m.POD_CPU_THROTTLED):
            last = self.tsdb.last(metric, labels, max_age=60, now=now)
            view[metric] = None if last is None else round(last.value, 4)
        return view


class _StoreHealth(PromCollector):
    """``koord_runtime_proxy_store_degraded`` (1 while the store's file cannot be
    written and it serves from memory) and the samples dropped meanwhile."""

    def __init__(self, tsdb: TSDB) -> None:
        self._tsdb = tsdb

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return self._families(0, 0)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return self._families(int(self._tsdb.degraded is not None), self._tsdb.dropped_samples)

    @staticmethod
    def _families(degraded: int, dropped: int) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily("koord_runtime_proxy_store_degraded",
                                "1 while the metrics store cannot write its file (serving from memory)",
                                value=degraded)
        yield CounterMetricFamily("koord_runtime_proxy_store_dropped_samples",
                                  "Samples dropped to bound memory while the metrics store was degraded",
                                  value=dropped)


def _builtin(built: Mapping[str, Built], name: str, kind: type[_T]) -> _T:
    """A collector the agent reads directly (its plugin is ``required``, so it is there)."""
    entry = built.get(name)
    if entry is None or not isinstance(entry.collector, kind):
        raise HookConfigError(f"tasks.metrics.collectors.{name}", name,
                              f"the {GROUP} entry point must build a {kind.__name__}")
    return entry.collector


def _by_interval(collectors: Sequence[Collector]) -> dict[float, list[Collector]]:
    """Collectors grouped by interval, each group in the given order."""
    groups: dict[float, list[Collector]] = {}
    for collector in collectors:
        groups.setdefault(collector.interval, []).append(collector)
    return groups


def _connect(settings: MetricsSettings) -> KubeClient | None:
    if not settings.kube:
        return None
    from metrics.informer.kubeclient import KubeClient  # the API client: only when asked for

    kube_settings = KubeSettings(node_name=settings.node_name,
                                 kubeconfig=Path(settings.kubeconfig) if settings.kubeconfig else None)
    try:
        return KubeClient.connect(kube_settings)
    except KubeUnavailable as exc:
        # Not a config error: the node keeps measuring and serving NodeMetric locally.
        log.warning("kube_unavailable", reason=exc.reason)
        return None


def _nrt_client(kube: KubeClient | None) -> NRTClient | None:
    return kube  # KubeClient implements NRTClient (get_nrt, create_nrt, patch_nrt)


def _kubelet(settings: MetricsSettings) -> KubeletPods | None:
    k = settings.kubelet
    if not k.url:
        return None
    return KubeletPods(k.url, token_path=Path(k.token_path) if k.token_path else None,
                       ca_path=Path(k.ca_path) if k.ca_path else None, insecure=k.insecure)


def metrics_task(init: TaskInit) -> Callable[[], Awaitable[None]]:
    """Entry point: validate ``tasks.metrics``, build the agent, provide it to the tasks
    built on it (``init.provide``; they read it as ``metrics.handles.AgentHandle``),
    return its loop."""
    settings = parse_metrics(init.args, init.key_path)
    agent = MetricsAgent(init, settings)
    init.provide(agent)
    return agent.run


# check-config and reload validate ``tasks.metrics`` through this, without building the agent.
metrics_task.validate = validate_metrics  # type: ignore[attr-defined]
# check-config's plan (runtimeproxy.chain.plugins.plan_tasks): what run would build here.
metrics_task.plan = checkplan.metrics_plan  # type: ignore[attr-defined]
