"""The process: wire the parts, start them in order, reload, stop gracefully.

Start order: hook chain (config errors stop us before we listen), socket, metrics
endpoint, then wait for containerd to answer Version, rebuild the store and only
then tell systemd READY=1. Stop order (SIGTERM): refuse new calls and drain the
in-flight ones within ``shutdown_grace``, stop background tasks, close channels.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import signal
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import prometheus_client
import structlog

from criapi import cri_v1_pb2 as cri
from runtimeproxy import __version__, heap
from runtimeproxy.backend import Backend, CallError
from runtimeproxy.chain import plugins
from runtimeproxy.chain.hookchain import HookChain, HookPools
from runtimeproxy.chain.remote import registration_fingerprint
from runtimeproxy.config.confignet import find_haproxy
from runtimeproxy.config.settings import ConfigError, Settings, load
from runtimeproxy.dataplane import haproxy, haproxystats
from runtimeproxy.dataplane.process import HaproxyDataPlane
from runtimeproxy.hookapi import CriCallError, Explainer, Exposition, LivePods, PodInfo, Route, RulesProvider, TaskInit
from runtimeproxy.hostwrites import FailureCollector
from runtimeproxy.lifecycle import owed
from runtimeproxy.lifecycle.handler import Lifecycle, SkipLabel
from runtimeproxy.lifecycle.sweep import sweep
from runtimeproxy.nri import ingress as nri_ingress
from runtimeproxy.ops import fdlimits, logsetup, sdnotify
from runtimeproxy.ops.backendhealth import IMAGE_FS_INFO_METHOD, VERSION_PAYLOAD, BackendMonitor, Probe
from runtimeproxy.ops.promstats import HttpEndpoint, ProxyMetrics
from runtimeproxy.ops.repeats import RepeatFilter
from runtimeproxy.ops.supervisor import Supervisor
from runtimeproxy.services import NodeServices
from runtimeproxy.state import hookpreview, statedir
from runtimeproxy.state.events import watch_events
from runtimeproxy.state.history import ChangeHistory
from runtimeproxy.state.ledger import FILE_NAME as LEDGER_FILE
from runtimeproxy.state.ledger import ObjectLedger
from runtimeproxy.state.reconcile import Reconciler
from runtimeproxy.state.resync import Resyncer, watch_reconnects
from runtimeproxy.state.store import CHANGES_PER_POD, ResyncResult, Store, resync
from runtimeproxy.transport.grpcbackend import GrpcBackend
from runtimeproxy.transport.grpcserver import INTERCEPT_SLACK, ProxyHandler, ProxyServer

log = structlog.get_logger("runtimeproxy.app")

VERSION_METHOD = "/runtime.v1.RuntimeService/Version"
_RESTART_ONLY = ("listen", "socket_mode", "backend", "metrics_listen", "max_message_bytes", "tasks",
                 "metrics_max_connections", "metrics_idle_timeout", "metrics_fd_reserve", "state_dir",
                 "data_plane", "data_plane_unit", "ingress", "nri")
#: Pods whose change history is kept on disk (each its last CHANGES_PER_POD changes).
HISTORY_PODS = 512
#: Net container allocations between young collections (CPython's default is 700); see ``run``.
#: A collector's tick holds its samples until they are written, and a young collection
#: that falls inside one visits and promotes every sample: with 10 000 the PSI tick at
#: 250 pods (~12 000 samples) set one off every time, and its cost per pod grew from 110
#: to 250 pods (issue 29). At 60 000 the largest tick at 250 pods is under a quarter of it.
GC_YOUNG_THRESHOLD = 60_000


class InterceptServer(Protocol):
    """Where the lifecycle calls arrive: kubelet's socket (gRPC transport) or HAProxy's hop."""

    async def start(self) -> None: ...
    def unlisten(self) -> None: ...
    async def stop(self, grace: float) -> None:
        """Refuse new calls, let the calls in flight finish within ``grace``."""


class App:
    def __init__(self, settings: Settings, *, config_path: Path | None, overrides: dict[str, Any]) -> None:
        self.settings = settings
        self._config_path = config_path
        self._overrides = overrides
        self.registry = prometheus_client.CollectorRegistry()
        self.metrics = ProxyMetrics(self.registry)
        self.metrics.set_build_info(__version__)
        # The process's shared services (host-write back-off and failure counts), made once
        # here and handed to every hook and task through its init object.
        self.services = NodeServices.create()
        self.registry.register(FailureCollector(self.services.write_failures))  # host writes refused
        self._pools = HookPools()  # sync hooks' threads: a bounded pool per hook, kept across reloads
        self._repeats = RepeatFilter()  # hook failures already logged, per object: kept across reloads
        # One source of rules for every hook and task: the YAML, with the NodeSLO merged
        # over it while the metrics task has one (it registers the overlay).
        self.rules = RulesProvider(settings.rules)
        self._loop: asyncio.AbstractEventLoop | None = None
        # Built here so a bad plugin or stage fails start-up, before the socket exists.
        self.chain: HookChain = plugins.build_chain(settings, pools=self._pools, observer=self.metrics,
                                                    current_rules=self.rules.current, repeats=self._repeats,
                                                    services=self.services)
        history = (ChangeHistory(Path(settings.state_dir), per_pod=CHANGES_PER_POD, max_pods=HISTORY_PODS)
                   if settings.state_dir else None)
        self.ledger = ObjectLedger(Path(settings.state_dir) / LEDGER_FILE if settings.state_dir else None)
        self.store = Store(history, self.ledger)
        self._sweep_throttle = logsetup.Throttle(600.0)  # a hook's sweep failing at every re-sync: said every 10 min
        self.backend = GrpcBackend(settings.backend, max_message_bytes=settings.max_message_bytes)
        self.data_plane = (None if settings.ingress == "nri"  # kubelet talks to containerd: no socket of ours
                           else choose_data_plane(settings, lambda: haproxy.intercepted_paths(self.chain.pre_calls)))
        #: The lifecycle's calls to containerd: gRPC, straight to it, on either data plane.
        self.lifecycle_backend: Backend = self.backend
        self.lifecycle = Lifecycle(
            store=self.store, backend=self.lifecycle_backend, chain=lambda: self.chain,
            skip_label=lambda: SkipLabel(self.settings.skip_label_key, self.settings.skip_label_value),
            mark=nri_ingress.proxy_mark(settings),
        )
        self.server: InterceptServer
        #: HAProxy's counters read off the loop before each scrape (None without HAProxy).
        self._stats_read: Callable[[], None] | None = None
        if self.data_plane is not None:
            # HAProxy owns kubelet's socket; Python gets only the lifecycle calls, on a private
            # socket, over HTTP/2: the grpc plane's server, serving those methods only.
            self.handler = ProxyHandler(backend=self.backend, lifecycle=self.lifecycle, metrics=self.metrics,
                                        intercept_only=True, max_request_bytes=settings.max_message_bytes)
            self.server = ProxyServer(listen=self.data_plane.intercept_socket, socket_mode=0o600,
                                      max_message_bytes=settings.max_message_bytes, handler=self.handler,
                                      receive_slack=INTERCEPT_SLACK)
            # Pass-through calls are counted by HAProxy; its counters are read at scrape time.
            self._stats_read = haproxystats.install(self.registry, self.metrics.cri_calls, self.metrics.cri_errors,
                                                    self.data_plane.layout.stats_socket).refresh
        elif settings.ingress == "nri":
            self.server = nri_ingress.NoSocket()
        else:
            self.handler = ProxyHandler(backend=self.backend, lifecycle=self.lifecycle, metrics=self.metrics)
            self.server = ProxyServer(listen=Path(settings.listen), socket_mode=settings.socket_mode,
                                      max_message_bytes=settings.max_message_bytes, handler=self.handler)
        self.supervisor = Supervisor()
        self.monitor = self._backend_monitor(settings)
        # The re-syncs' answers stand in for the backend probe's (``watching``).
        self.resyncer = Resyncer(store=self.store, backend=self.monitor.watching(self.backend),
                                 interval=lambda: self.settings.resync_interval, after=self._after_resync)
        self.reconciler = Reconciler(
            store=self.store, chain=lambda: self.chain, skipped=self._skipped,
            interval=lambda: self.settings.reconcile_interval,
            refresh=lambda: self.resyncer.run_once("reconcile"),
        )
        self.rules.subscribe(self._rules_changed)
        #: The NRI ingress (``ingress: nri | both``): containerd calls the chain itself.
        self.nri = nri_ingress.plugin(settings, store=self.store, chain=lambda: self.chain, skipped=self._skipped,
                                      posts=self.lifecycle.posts, settings_now=lambda: self.settings.nri,
                                      synchronized=self.reconciler.trigger)
        self.http: HttpEndpoint | None = None
        self._routes: dict[str, Route] = {"/debug/explain": self._explain_route,
                                          # the hooks' half of `koord-runtime-proxy plan` (a NodeSLO preview)
                                          hookpreview.ROUTE: hookpreview.route(lambda: self.settings, self.store,
                                                                               self._skipped)}
        self._explainers: dict[str, Explainer] = {}
        self._expositions: list[Exposition] = []
        base = TaskInit(
            name="", args={}, key_path="tasks", snapshot=self.store.snapshot,
            current_rules=self.rules.current, set_rules_overlay=self.rules.set_overlay, registry=self.registry,
            add_route=self._add_route, add_explainer=self._add_explainer, cri=self._cri_call,
            add_exposition=self._add_exposition,
            state_dir=Path(settings.state_dir) if settings.state_dir else None,
            pods_known=lambda: self._pods_known or self.resyncer.succeeded,
            reconcile_now=self._reconcile_now, services=self.services,
        )
        for name, task in plugins.build_tasks(settings, base):
            self.supervisor.add(f"task:{name}", task)
        self._stop = asyncio.Event()
        #: The store was rebuilt from the runtime since start (tasks see ``pods_known``).
        self._pods_known = False
        self._ready = False
        self._stopping = False
        self._oneshots: set[asyncio.Task[bool]] = set()
        self._reload_lock = asyncio.Lock()

    # --- start / stop ------------------------------------------------------------

    async def run(self, *, install_signals: bool = True) -> int:
        self._loop = asyncio.get_running_loop()
        if install_signals:
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, self._stop.set)
            loop.add_signal_handler(signal.SIGINT, self._stop.set)
            loop.add_signal_handler(signal.SIGHUP, self._reload_soon)
        try:
            nri_ingress.check_socket(self.settings)  # before anything listens: exit 2 naming nri.socket
            if self.data_plane is not None:
                self.data_plane.prepare()
            await self.server.start()
            await self._start_http()
        except BaseException:
            # A failed start leaves nothing behind: no socket file, no listener.
            await self.server.stop(0)
            raise
        self.supervisor.add("config-watch", self._watch_config)
        if self.data_plane is not None:
            self.supervisor.add("dataplane:haproxy", self.data_plane.run_forever)
        interval = sdnotify.watchdog_interval()
        if interval:
            self.supervisor.add("watchdog", lambda: sdnotify.watchdog_loop(interval, lambda: self._ready))
        await self.supervisor.start()
        await self._wait_backend()
        if self.data_plane is not None:
            await self.data_plane.wait_answering(self._stop)  # READY=1 only when HAProxy answers too
        if not self._stop.is_set():
            self.supervisor.add("backend-probe", self.monitor.run_forever)
            # Here, not before listening: a start-up that fails (exit 2) touches no state file.
            self.store.restore_history()
            known = self.ledger.load()  # what the last process knew: compared with containerd by the rebuild
            log.info("ledger_loaded", objects=known, path=str(self.ledger.path) if self.ledger.path else None)
            await self._rebuild_store()
            self.supervisor.add("resync", self.resyncer.run_forever)
            if self.nri is not None:  # after the rebuild: its Synchronize replaces what the rebuild learnt
                self.supervisor.add("nri", self.nri.run_forever)
            channel = self.backend.channel_for(VERSION_METHOD)
            self.supervisor.add("backend-watch", lambda: watch_reconnects(channel, self.resyncer.trigger))
            # containerd's events make the re-sync (and the Post stages it finds owed) prompt.
            self.supervisor.add("backend-events", lambda: watch_events(channel, self.resyncer.trigger_event))
            self._ready = True
            self.metrics.up.set(1)
            # First pass right away: pods created while we were down get their settings now.
            self.supervisor.add("reconciler", self.reconciler.run_forever)
            sdnotify.notify("READY=1")
            log.info("ready", hooks=[h.name for h in self.chain.hooks], ingress=self.settings.ingress)
        await self._stop.wait()
        return await self.shutdown()

    def _rules_changed(self) -> None:
        """The rules in force changed (a NodeSLO update, from a watch thread, or a
        reload): re-apply them to running pods with a reconciler pass now."""
        log.info("rules_changed", sources=self.rules.sources())
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.reconciler.trigger)

    def _reconcile_now(self) -> None:
        """A task asks for a pass (thread-safe): e.g. the QoS manager lifted the BE tier's
        quota, and batch-resource's pod quotas could not exceed it until then."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.reconciler.trigger)

    def _skipped(self, pod: PodInfo) -> bool:
        return pod.labels.get(self.settings.skip_label_key) == self.settings.skip_label_value

    def request_stop(self) -> None:
        self._stop.set()

    @property
    def ready(self) -> bool:
        return self._ready

    def _reload_soon(self) -> None:
        # Signal handlers cannot await; keep a reference so the task is owned until done.
        task = asyncio.get_running_loop().create_task(self.reload("SIGHUP"), name="reload:SIGHUP")
        self._oneshots.add(task)
        task.add_done_callback(self._oneshot_done)

    def _oneshot_done(self, task: asyncio.Task[bool]) -> None:
        """A one-shot task ended: its outcome is looked at (a bug in it is logged, never
        "Task exception was never retrieved" at exit)."""
        self._oneshots.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("task_failed", task=task.get_name(), error=f"{type(exc).__name__}: {exc}", exc_info=exc)

    async def shutdown(self) -> int:
        sdnotify.notify("STOPPING=1")
        self._stopping = True
        self.metrics.up.set(0)
        if self.data_plane is not None and self.data_plane.pid is not None:
            # New lifecycle calls: UNAVAILABLE from HAProxy at once while this process drains.
            await asyncio.to_thread(self.data_plane.intercept, False)
        # Unlisten before the "stopping" line: whoever sees it can rely on new connects failing.
        self.server.unlisten()
        log.info("stopping", grace_seconds=self.settings.shutdown_grace)
        await self.server.stop(self.settings.shutdown_grace)
        # Post stages of answered calls (they run after the reply) finish before the hooks close.
        if not await self.lifecycle.posts.settle(self.settings.shutdown_grace):
            log.warning("post_hooks_unfinished", pods=self.lifecycle.posts.pending)
        await self.supervisor.stop(timeout=5.0)
        if self.http is not None:
            await self.http.stop()
        await plugins.close_hooks(self.chain.hooks)
        await self.backend.close()
        self._pools.shutdown()
        self.store.close()
        self.ledger.save()  # the done marks of the Post stages that just ran
        if self.data_plane is not None:
            # Last: kubelet's pass-through calls keep working while Python drains. A child stops
            # now; HAProxy's systemd unit stops only with `systemctl stop` (see the units).
            await self.data_plane.stop(self.settings.shutdown_grace)
        log.info("stopped")
        return 0

    async def _start_http(self) -> None:
        if not self.settings.metrics_listen:
            return
        host, _, port = self.settings.metrics_listen.rpartition(":")
        self.http = HttpEndpoint(
            host.strip("[]"), int(port), self.registry, health=self._health_problem,
            routes=self._routes, expositions=self._expositions, after_scrape=heap.trim,
            before_scrape=self._stats_read,
            idle_timeout=self.settings.metrics_idle_timeout, max_connections=self.settings.metrics_max_connections,
            fd_reserve=self.settings.metrics_fd_reserve, stats=self.metrics.http,
        )
        try:
            await self.http.start()
        except OSError as exc:  # port in use, address not on this host, no permission
            raise ConfigError("metrics.listen", self.settings.metrics_listen,
                              f"cannot listen: {exc.strerror or exc}") from None

    # --- health ------------------------------------------------------------------

    def _backend_monitor(self, settings: Settings) -> BackendMonitor:
        """Probes on the channels the calls use; a separate image endpoint gets its own."""
        runtime = settings.backend.runtime_endpoint
        image = settings.backend.image_endpoint or runtime
        probes = [Probe("runtime", runtime, VERSION_METHOD, VERSION_PAYLOAD)]
        if image != runtime:
            probes.append(Probe("image", image, IMAGE_FS_INFO_METHOD))
        gauge = self.metrics.backend_up

        def set_up(name: str, up: bool) -> None:
            gauge.labels(backend=name).set(1 if up else 0)
            if name == "runtime" and image == runtime:
                gauge.labels(backend="image").set(1 if up else 0)  # one endpoint serves both

        set_up("runtime", False)
        set_up("image", False)
        return BackendMonitor(
            self.backend, probes, interval=settings.backend.probe_interval,
            unhealthy_after=settings.backend.unhealthy_after, set_up=set_up,
        )

    def _health_problem(self) -> str | None:
        """Why /healthz is 503, or None. Only the loopback endpoint asks: the systemd
        watchdog follows ``ready`` alone (restarting the proxy cannot bring containerd back)."""
        if self._stopping:
            return "stopping"
        if not self._ready:
            return "starting: waiting for the backend to answer Version"
        return self.monitor.problem() or nri_ingress.problem(self.nri)

    async def _wait_backend(self) -> None:
        """Poll Version until containerd answers; calls meanwhile fail UNAVAILABLE."""
        delay, logged = 0.1, False
        payload = cri.VersionRequest(version="v1").SerializeToString()
        while not self._stop.is_set():
            try:
                reply = await self.backend.unary(VERSION_METHOD, payload, timeout=2.0)
            except CallError as exc:
                if not logged:
                    log.warning("backend_unavailable", endpoint=self.settings.backend.runtime_endpoint, error=str(exc))
                    logged = True
                # wait_for, not wait([ensure_future(...)]): the waiter is cancelled at the timeout
                # instead of left pending, one more per retry, until the stop.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), timeout=delay)
                delay = min(delay * 2, 2.0)
                continue
            version = cri.VersionResponse.FromString(reply.payload)
            log.info("backend_ready", runtime=version.runtime_name, version=version.runtime_version,
                     api=version.runtime_api_version)
            return

    async def _rebuild_store(self) -> None:
        try:
            result = await resync(self.store, self.backend)
        except CallError as exc:
            # Lazy per-object loading still covers what the rebuild missed; the first re-sync settles.
            log.error("store_rebuild_failed", error=str(exc))
            return
        self._pods_known = True
        owed_now = await self._after_resync(result)  # what happened while we were down
        # Change history restored from disk for pods removed while we were down goes now.
        log.info("store_rebuilt", pods=result.pods_added, containers=result.containers_added,
                 history_pruned=self.store.prune_changes(), ledger=len(self.ledger), owed_post_stages=owed_now)

    async def _after_resync(self, result: ResyncResult) -> int:
        """Level-triggered: the Post stages owed after stops and removals containerd shows
        (runtimeproxy.lifecycle.owed), then the hooks' host sweep (runtimeproxy.lifecycle.sweep).
        Returns how many Post stages were queued."""
        queued = owed.settle(self.ledger, self.store, self.lifecycle, result)
        pods, _ = self.store.snapshot()
        live = result.listed_uids | {p.meta.uid for p in pods.values()} | self.lifecycle.pending_uids()
        await sweep(self.chain.hooks, LivePods(frozenset(live)), self._sweep_throttle)
        return queued

    # --- reload ------------------------------------------------------------------

    async def reload(self, trigger: str) -> bool:
        """Validate, build, swap; on any error keep the running config. One at a time (a
        SIGHUP and a file change at once): the second builds on what the first swapped in."""
        async with self._reload_lock:
            return await self._reload(trigger)

    async def _reload(self, trigger: str) -> bool:
        try:
            # Off the loop: reading, validating and building take 90-170 ms (plugins import,
            # files are read) that the CRI calls in flight must not wait for.
            settings, chain = await asyncio.to_thread(self._prepare_reload)
        except ConfigError as exc:
            self.metrics.config_reloaded(False)
            log.error("config_reload_rejected", trigger=trigger, error=str(exc), kept="previous config")
            return False
        stale = [k for k in _RESTART_ONLY if getattr(settings, k) != getattr(self.settings, k)]
        if stale:
            log.warning("config_needs_restart", keys=stale)
        old, running = self.chain, self.settings
        self.chain, self.settings = chain, settings
        if self.nri is not None:
            self.nri.chain_changed()  # a hook at a stage with no event subscribed yet: register again
        self.rules.set_base(settings.rules)
        logsetup.configure(level=settings.log_level, fmt=settings.log_format)  # type: ignore[arg-type]
        self.metrics.config_reloaded(True)
        if self.data_plane is not None:
            # What needs a restart (listen, backend, ...) stays as running: HAProxy must not
            # send pass-through calls to another containerd than the lifecycle calls go to.
            await self.data_plane.apply(dataclasses.replace(
                settings, **{k: getattr(running, k) for k in _RESTART_ONLY}))
        self.reconciler.trigger()
        log.info("config_reloaded", trigger=trigger, hooks=[h.name for h in chain.hooks])
        await plugins.close_hooks(old.hooks)
        return True

    def _prepare_reload(self) -> tuple[Settings, HookChain]:
        """The new settings and chain (in a worker thread); ConfigError if any of it is refused."""
        settings = load(self._config_path, self._overrides)
        # Tasks restart only with the process, but a value ``run`` would refuse must be
        # refused now: under Restart=always it would leave the node without a runtime.
        plugins.validate_tasks(settings)
        chain = plugins.build_chain(settings, pools=self._pools, observer=self.metrics,
                                    current_rules=self.rules.current, repeats=self._repeats, services=self.services)
        return settings, chain

    def _fingerprint(self) -> tuple[object, ...]:
        path = self._config_path
        stat: tuple[int, int] | None = None
        if path is not None and path.exists():
            st = path.stat()
            stat = (st.st_mtime_ns, st.st_size)
        hookdir = self.settings.hookserver_dir
        return stat, registration_fingerprint(Path(hookdir)) if hookdir else ()

    async def _watch_config(self) -> None:
        """Poll, because inotify on a file that editors replace is unreliable."""
        last = self._fingerprint()
        while True:
            await asyncio.sleep(self.settings.reload_poll_interval)
            current = self._fingerprint()
            if current != last:
                last = current
                await self.reload("file-change")

    # --- debug -------------------------------------------------------------------

    def _add_route(self, path: str, handler: Route) -> None:
        if self.http is not None:
            raise RuntimeError(f"route {path!r} added after the HTTP endpoint started")
        if path in self._routes:
            raise ValueError(f"route {path!r} is already served")
        self._routes[path] = handler

    def _add_exposition(self, render: Exposition) -> None:
        if self.http is not None:
            raise RuntimeError("exposition added after the HTTP endpoint started")
        self._expositions.append(render)

    def _add_explainer(self, name: str, explainer: Explainer) -> None:
        if name in self._explainers:
            raise ValueError(f"explainer {name!r} is already registered")
        self._explainers[name] = explainer

    async def _cri_call(self, method: str, payload: bytes, timeout: float) -> bytes:
        try:
            reply = await self.backend.unary(method, payload, timeout=timeout)
        except CallError as exc:
            raise CriCallError(method, exc.code.name, exc.details or str(exc)) from exc
        return reply.payload

    def _task_views(self, pod: PodInfo | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, explainer in self._explainers.items():
            try:
                out[name] = dict(explainer(pod))
            except Exception as exc:  # noqa: BLE001 - an explainer bug must not break explain
                out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        return out

    async def _explain_route(self, query: dict[str, str]) -> tuple[int, str, bytes]:
        if not query.get("pod"):
            known_pods, known_containers = self.store.ids()
            store = {"pods": len(known_pods), "containers": len(known_containers)}
            body: dict[str, Any] = {"node": True, "store": store, "tasks": self._task_views(None),
                                    "ingress": nri_ingress.describe(self.settings, self.nri)}
            return 200, "application/json", json.dumps(body, indent=2, default=str).encode()
        namespace, _, name = query.get("pod", "").partition("/")
        pod = self.store.find_pod(namespace, name) if name else None
        if pod is None:
            return 404, "application/json", json.dumps({"error": f"pod {query.get('pod', '')!r} not known"}).encode()
        body = {
            "pod": f"{namespace}/{name}",
            "uid": pod.meta.uid,
            "sandbox_id": pod.id,
            "cgroup_parent": pod.cgroup_parent,
            "ingress": nri_ingress.describe(self.settings, self.nri),
            "changes": [asdict(c) for c in self.store.changes(pod.meta.uid)],
            "tasks": self._task_views(pod),
        }
        return 200, "application/json", json.dumps(body, indent=2, default=str).encode()


def choose_data_plane(
    settings: Settings, intercepted: Callable[[], tuple[str, ...]]
) -> HaproxyDataPlane | None:
    """HAProxy when configured (``data_plane: haproxy``, the default); None for the
    in-process gRPC transport (``data_plane: grpc``, only when chosen). No fallback: the
    configuration was refused at parse time without the binary, and a binary removed
    since is a ConfigError too (exit 2), never the other data plane.
    ``intercepted``: the lifecycle paths HAProxy sends to Python (the chain's, at each render)."""
    if settings.data_plane != "haproxy":
        return None
    binary = find_haproxy()
    if binary is None:
        raise ConfigError("data_plane", "haproxy", "the haproxy binary is not installed: apt install haproxy,"
                          " or set data_plane: grpc")
    return HaproxyDataPlane(binary, settings, intercepted)


def announce(settings: Settings) -> None:
    """At every start: which file (or the built-in default) runs, and one warning per
    risk ``allow_insecure`` accepted that is present."""
    log.info("config_loaded", source=settings.source or "settings")
    for risk in settings.accepted_risks:
        log.warning("insecure_setting_allowed", risk=risk)
    for key in settings.deprecated:
        log.warning("config_key_deprecated", key=key)


def run(settings: Settings, *, config_path: Path | None, overrides: dict[str, Any]) -> int:
    logsetup.configure(level=settings.log_level, fmt=settings.log_format)  # type: ignore[arg-type]
    heap.limit_arenas()
    old, new = fdlimits.raise_nofile_limit()
    if new != old:
        log.info("nofile_limit_raised", old=old, new=new)
    # One proxy per state dir, for the life of the process (exit 2 naming the holder's pid).
    state_lock = statedir.claim(Path(settings.state_dir)) if settings.state_dir else None

    async def main() -> int:
        logsetup.install_loop_exception_handler(asyncio.get_running_loop())
        app = App(settings, config_path=config_path, overrides=overrides)
        announce(settings)  # after App(): a config error stays the first line on stderr
        # What exists now (modules, protobuf descriptors, config, plugins) lives as long
        # as the process: out of the cyclic collector's reach, a full collection walks
        # only what was allocated since. Here, not in App: tests run many Apps in one process.
        gc.freeze()
        # The steady state makes almost no cycles (320 young collections in a minute at 110
        # pods found 575 objects) but its short-lived samples and dicts set off a young
        # collection four times a second and an older one every three seconds: a larger
        # young generation lets them die first (issue 29: the collector's CPU 0.83 ->
        # 0.32 ms a second; each young collection ~1.3 ms, six times a minute).
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        return await app.run()

    try:
        return asyncio.run(main())
    finally:
        if state_lock is not None:
            state_lock.release()
