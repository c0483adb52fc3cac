"""The reconciler: keep what the hooks set true after the CRI call is long gone.

Lifecycle hooks run once per call. Drift comes later: a manual write to a cgroup
file, pods created while the proxy was down, a rule change. Every pass walks the
store's pods and containers and runs the chain's ``ReconcilePodSandbox`` and
``ReconcileContainer`` stages, where hooks recompute the desired state with the
same code as at creation and rewrite only what differs, reporting their writes.
It runs right after start-up, every ``reconcile_interval``, and at once after a
config reload. The core stays generic: it never knows what a hook writes.

Each pass first re-syncs the store with containerd (``refresh``), and leaves alone
what kubelet is tearing down: NOTREADY sandboxes and CREATED/EXITED containers have
no cgroup to keep (kubelet removes it first), so visiting them would only warn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from runtimeproxy.chain.hookchain import HOST_TARGET, HookChain, HookFailed
from runtimeproxy.hookapi import ContainerContext, Context, PodContext, PodInfo, Stage
from runtimeproxy.ops import logsetup
from runtimeproxy.state.store import Store

log = structlog.get_logger("runtimeproxy.reconcile")


@dataclass(frozen=True, slots=True)
class PassResult:
    pods: int
    containers: int
    writes: int
    failures: int


class Reconciler:
    def __init__(
        self,
        *,
        store: Store,
        chain: Callable[[], HookChain],
        skipped: Callable[[PodInfo], bool],
        interval: Callable[[], float],
        refresh: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self._store = store
        self._refresh = refresh
        self._chain = chain
        self._skipped = skipped
        self._interval = interval
        self._wake = asyncio.Event()

    def trigger(self) -> None:
        """Run a pass now (after a reload: rules may have changed)."""
        self._wake.set()

    async def run_forever(self) -> None:
        while True:
            self._wake.clear()
            await self.run_once()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self._interval())
            except TimeoutError:
                pass

    async def run_once(self) -> PassResult:
        chain = self._chain()
        pod_hooks = chain.for_stage(Stage.RECONCILE_POD_SANDBOX)
        container_hooks = chain.for_stage(Stage.RECONCILE_CONTAINER)
        if not pod_hooks and not container_hooks:
            return PassResult(0, 0, 0, 0)
        if self._refresh is not None:
            await self._refresh()
        pods, containers = self._store.snapshot()
        counts = [0, 0]  # writes, failures
        pods = {sid: pod for sid, pod in pods.items() if self._store.active_pod(sid)}
        live = [pod for pod in pods.values() if not self._skipped(pod)]
        if pod_hooks:
            for pod in live:
                if self._store.active_pod(pod.id):  # checked again: earlier hooks of this pass took time
                    await self._one(chain, PodContext(Stage.RECONCILE_POD_SANDBOX, pod), counts)
        n_containers = 0
        if container_hooks:
            for pod_id, container in containers.values():
                owner = pods.get(pod_id)
                if owner is None or self._skipped(owner):
                    continue
                if not (self._store.active_pod(pod_id) and self._store.active_container(container.id)):
                    continue
                n_containers += 1
                await self._one(chain, ContainerContext(Stage.RECONCILE_CONTAINER, owner, container), counts)
        result = PassResult(len(live) if pod_hooks else 0, n_containers, counts[0], counts[1])
        # One line per pass; quiet at info when nothing drifted.
        emit = log.info if result.writes or result.failures else log.debug
        emit("reconcile_pass", pods=result.pods, containers=result.containers, writes=result.writes,
             failures=result.failures)
        return result

    async def _one(self, chain: HookChain, ctx: Context, counts: list[int]) -> None:
        pod = ctx.pod
        bound = {"pod_namespace": pod.meta.namespace, "pod_name": pod.meta.name, "pod_uid": pod.meta.uid}
        if isinstance(ctx, ContainerContext):
            bound |= {"container_name": ctx.container.meta.name, "container_id": ctx.container.id}
        with logsetup.scoped(**bound):
            try:
                outcome = await chain.run(ctx, deadline=None)
            except HookFailed as exc:
                counts[1] += 1
                # A repeat (or the object torn down meanwhile) was logged once already, or is no fault.
                emit = log.debug if exc.repeat else log.error
                emit("reconcile_failed", hook=exc.hook, stage=exc.stage.value, reason=exc.reason)
                return
            writes = [c for c in outcome.changes if c.target.startswith(HOST_TARGET)]
            counts[0] += len(writes)
            if writes:
                self._store.record_changes(pod.meta.uid, tuple(writes))
                log.info("reconcile_repaired", changes=[f"{c.hook}:{c.target}={c.new}" for c in writes])
