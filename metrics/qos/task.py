"""The QoS manager task (entry point ``qos-manager`` in ``koord_runtime_proxy.tasks``).

Builds the manager on the metrics agent's store, pod views, topology and rules (so
nothing is measured twice), adds the fast path and the PSI triggers, and exposes
the plans through ``explain``. It declares ``needs = ("metrics",)`` and
``after = ("interference",)``: the core builds it after them, whatever the YAML order.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Final

import structlog

from hooks.cgroups import CgroupError, CgroupLayout
from hooks.executor import CgroupExecutor
from metrics import checkplan
from metrics.collect.cgroupfs import CgroupReader
from metrics.handles import INTERFERENCE, AgentHandle, metrics_agent
from metrics.informer.kubetypes import EvictionRefused, KubeError
from metrics.model import PodView
from metrics.qos import previewroute
from metrics.qos.evict import CriEvictor, EvictConfig, EvictionError, Evictor
from metrics.qos.evictevents import RecordingEvictor
from metrics.qos.fastpath import FastPath, FastPathConfig
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.qos.psitrigger import PsiTriggers
from metrics.qos.settings import QoSSettings, parse_qos
from metrics.qos.strategy import StrategyInit, VerdictSource, load_strategies
from metrics.qos.suppress import SuppressConfig
from metrics.report.events import WARNING, EventRecorder
from metrics.settings import METRICS_TASK, validate_qos
from runtimeproxy.hookapi import HookConfigError, TaskInit

if TYPE_CHECKING:  # the API client: imported only when configured
    from metrics.informer.kubeclient import KubeClient

log = structlog.get_logger("metrics.qos.task")


class ApiEvictor:
    """Evicts through the Eviction API (PodDisruptionBudgets are honoured)."""

    def __init__(self, kube: KubeClient) -> None:
        self._kube = kube

    async def evict(self, pod: PodView, reason: str) -> None:
        try:
            await asyncio.to_thread(self._kube.evict, pod.namespace, pod.name, pod.uid, reason)
        except EvictionRefused as exc:
            raise EvictionError(f"pod {pod.key}: eviction refused: {exc}") from exc
        except KubeError as exc:
            raise EvictionError(f"pod {pod.key}: eviction API failed: {exc}") from exc


def _evictor(init: TaskInit, settings: QoSSettings, agent: AgentHandle) -> Evictor:
    mode = settings.evict_mode or ("api" if agent.kube is not None else "cri")
    log.info("evict_mode", mode=mode, configured=settings.evict_mode or "default (api with a cluster, else cri)")
    if mode == "cri":
        if agent.kube is not None:
            # Chosen explicitly next to a kubelet: a stop it undoes (restartPolicy), not an eviction.
            log.warning("evict_mode_cri_with_kubelet", detail="pods are stopped through the CRI and kubelet restarts "
                        "them; the pod object shows no eviction (evict_mode: api evicts through the API)")
        return CriEvictor(init.cri)
    if agent.kube is None:
        raise HookConfigError(f"{init.key_path}.evict_mode", "api",
                              "needs a cluster connection (tasks.metrics.kube: true)")
    return ApiEvictor(agent.kube)


def _interference(init: TaskInit) -> VerdictSource | None:
    """The interference analyser when enabled (``after``: it is built before this task)."""
    found = init.needed.get(INTERFERENCE)
    return found if isinstance(found, VerdictSource) else None


def _write_failed_event(events: EventRecorder, strategy: str, target: str, cause: str) -> None:
    """A QoS write (mostly the BE suppression's) that cannot be applied: a Node event."""
    events.record(events.node(), WARNING, "QoSWriteFailed", f"{strategy}: cannot write {target}: {cause}")


def _reserved(settings: QoSSettings, agent: AgentHandle) -> float:
    if settings.reserved_cpu:
        return settings.reserved_cpu
    from_node = agent.informer.node_reserved_cpu() if agent.informer is not None else None
    return from_node or 0.0


def _suppress_config(settings: QoSSettings, besteffort_dir: str, collect_interval: float) -> SuppressConfig:
    """With the fast path, two paths decide the BE limit: a drop holds growth until the
    loop's store inputs are all newer than it, and growth moves in steps (no flapping)."""
    if not settings.fast_path:
        return SuppressConfig(besteffort_dir=PurePosixPath(besteffort_dir))
    return SuppressConfig(besteffort_dir=PurePosixPath(besteffort_dir),
                          hold_after_drop=2 * collect_interval, growth_step=FAST_PATH_GROWTH_STEP)


#: With the fast path on: a growth of the BE limit below 5 % of the node is not written.
FAST_PATH_GROWTH_STEP: Final = 0.05


def qos_task(init: TaskInit) -> Callable[[], Awaitable[None]]:
    settings = parse_qos(init.args, init.key_path)
    agent = metrics_agent(init)
    try:
        layout = CgroupLayout(init.host.cgroup, "auto", settings.cgroup_driver)
    except CgroupError as exc:
        raise HookConfigError(f"{init.key_path}.cgroup_driver", settings.cgroup_driver, str(exc)) from exc
    agent.topology.collect(time.time(), [])  # the CPU list is needed before the first round
    cpus = agent.topology.latest().cpus
    config = ManagerConfig(
        interval=settings.interval, collect_interval=agent.settings.intervals.pods, dry_run=settings.dry_run,
        node_name=agent.settings.node_name, reserved_cores=_reserved(settings, agent),
        suppress=_suppress_config(settings, settings.besteffort_dir or agent.settings.besteffort_dir,
                                  agent.settings.intervals.pods),
        evict=EvictConfig(collect_interval=agent.settings.intervals.pods,
                          cpu_cool_down=settings.cpu_evict_cool_down,
                          memory_cool_down=settings.memory_evict_cool_down),
    )
    executor = CgroupExecutor(layout, backoff=init.services.write_backoff)
    strategy_init = StrategyInit(name="", args={}, key_path=f"{init.key_path}.strategies", config=config,
                                 topology=cpus, executor=executor, host=init.host, state_dir=init.state_dir,
                                 writer=agent.tsdb, agent=agent, interference=_interference(init),
                                 reconcile_now=init.reconcile_now)
    loaded = load_strategies(settings.strategies, strategy_init)
    log.info("qos_strategies", enabled=[s.name for s in loaded.enabled], disabled=[s.name for s in loaded.disabled])
    manager = QoSManager(
        reader=agent.tsdb, pods=agent.pods, topology=cpus, executor=executor,
        evictor=RecordingEvictor(_evictor(init, settings, agent), agent.events), rules=agent.rules, config=config,
        registry=init.registry, writer=agent.tsdb, strategies=loaded.enabled,
        on_write_failed=functools.partial(_write_failed_event, agent.events),
    )
    fast = FastPath(manager, cgroups=CgroupReader(init.host.cgroup), rules=agent.rules,
                    config=FastPathConfig(interval=settings.fast_interval, idle_interval=settings.interval)
                    ) if settings.fast_path and manager.suppress_strategy is not None else None
    init.add_explainer("qos", manager.explain)
    previewroute.add_route(init, manager, strategy_init, settings.strategies, agent)  # koord-runtime-proxy plan

    async def run() -> None:
        if loaded.disabled:  # listed but off: undo what an earlier run left (e.g. sysctls)
            await asyncio.to_thread(manager.release, loaded.disabled)
        triggers = _triggers(init.host.proc, settings) if fast is not None else None
        try:
            if triggers is not None and fast is not None:
                wake_fast = fast.wake

                def on_fire() -> None:
                    wake_fast()
                    manager.wake()

                triggers.start(asyncio.get_running_loop(), on_fire)
            async with asyncio.TaskGroup() as group:
                group.create_task(manager.run(), name="qos:manager")
                if fast is not None:
                    group.create_task(fast.run(), name="qos:fastpath")
        finally:
            if triggers is not None:
                triggers.close()
            # Not in a thread: a cancelled task may not await; these are a few small writes.
            manager.release()

    return run


# check-config and reload validate ``tasks.qos-manager`` through this, without building anything.
qos_task.validate = validate_qos  # type: ignore[attr-defined]
qos_task.plan = checkplan.qos_plan  # type: ignore[attr-defined]
# What it builds on, as data: the core builds those first, whatever the order under ``tasks:``.
qos_task.needs = (METRICS_TASK,)  # type: ignore[attr-defined]
qos_task.after = (INTERFERENCE,)  # type: ignore[attr-defined]


def _triggers(proc: Path, settings: QoSSettings) -> PsiTriggers | None:
    if not settings.psi_trigger:
        return None
    triggers = PsiTriggers()
    triggers.register(proc / "pressure" / "cpu")
    return triggers
