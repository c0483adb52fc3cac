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

An object a pass found in place (no write, no failure) is left out of the periodic
passes that follow for ``VERIFY_PASSES`` intervals (issue 29: at 110 pods a pass over
every object every 10 s was ~1 % of a core, nearly all of it finding nothing to do),
while what its desired state is computed from stays the same: the chain (a reload
builds a new one) and the store (any pod or container added, removed, re-stated or
resized bumps its mark). Either changing, or a ``trigger`` (reload, rules changed, a
task's ``reconcile_now``), makes the next pass visit everything. So a changed desired
value is written at the next pass, and a value changed behind our back (or a process
started later by exec, for oom-score-adj and core-sched) is put back within
``VERIFY_PASSES`` intervals plus the passes' own time: 60-70 s at the default 10 s.
``run_once()`` alone (tests, start-up) always visits everything.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

import structlog

from runtimeproxy.chain.hookchain import HOST_TARGET, HookChain, HookFailed, Outcome
from runtimeproxy.hookapi import ContainerContext, Context, PodContext, PodInfo, Stage
from runtimeproxy.ops import logsetup
from runtimeproxy.state.store import Store

log = structlog.get_logger("runtimeproxy.reconcile")

#: A periodic pass re-checks an object found in place once per this many intervals (the
#: QoS manager's ``verified_for`` is 60 s, koordlet's executor cache works alike).
VERIFY_PASSES: Final = 6


@dataclass(frozen=True, slots=True)
class PassResult:
    pods: int
    containers: int
    writes: int
    failures: int
    #: Objects left out: found in place within ``VERIFY_PASSES`` intervals, nothing changed since.
    skipped: int = 0


class Reconciler:
    def __init__(
        self,
        *,
        store: Store,
        chain: Callable[[], HookChain],
        skipped: Callable[[PodInfo], bool],
        interval: Callable[[], float],
        refresh: Callable[[], Awaitable[object]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._refresh = refresh
        self._chain = chain
        self._skipped = skipped
        self._interval = interval
        self._wake = asyncio.Event()
        self._clock = clock
        #: Object id -> when a pass last found it in place, under ``_basis``.
        self._verified: dict[str, float] = {}
        #: What the verified objects' desired state was computed from: the chain, the store's mark.
        self._basis: tuple[HookChain, int] | None = None
        self._full = True

    def trigger(self) -> None:
        """Run a pass over every object now (after a reload: rules may have changed)."""
        self._full = True
        self._wake.set()

    async def run_forever(self) -> None:
        while True:
            self._wake.clear()
            full, self._full = self._full, False
            await self.run_once(full=full)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self._interval())
            except TimeoutError:
                pass

    async def run_once(self, *, full: bool = True) -> PassResult:
        """One pass; ``full=False`` (the periodic passes) leaves out the objects found in
        place less than ``VERIFY_PASSES`` intervals ago while nothing they depend on changed."""
        chain = self._chain()
        pod_hooks = chain.for_stage(Stage.RECONCILE_POD_SANDBOX)
        container_hooks = chain.for_stage(Stage.RECONCILE_CONTAINER)
        if not pod_hooks and not container_hooks:
            return PassResult(0, 0, 0, 0)
        if self._refresh is not None:
            await self._refresh()
        now, basis = self._clock(), (chain, self._store.mark())
        # Taken before the pass: a pod added while it runs makes the next pass a full one.
        verified, self._verified = self._still_verified(now, basis, full), {}
        self._basis = basis
        pods, containers = self._store.snapshot()
        counts = [0, 0, 0]  # writes, failures, skipped
        pods = {sid: pod for sid, pod in pods.items() if self._store.active_pod(sid)}
        live = [pod for pod in pods.values() if not self._skipped(pod)]
        n_pods = 0
        if pod_hooks:
            n_pods = await self._visit(chain, [(pod.id, PodContext(Stage.RECONCILE_POD_SANDBOX, pod))
                                               for pod in live if self._store.active_pod(pod.id)],
                                       verified, now, counts)
        n_containers = 0
        if container_hooks:
            todo: list[tuple[str, Context]] = []
            for pod_id, container in containers.values():
                owner = pods.get(pod_id)
                if owner is None or self._skipped(owner):
                    continue
                if not (self._store.active_pod(pod_id) and self._store.active_container(container.id)):
                    continue
                todo.append((container.id, ContainerContext(Stage.RECONCILE_CONTAINER, owner, container)))
            n_containers = await self._visit(chain, todo, verified, now, counts)
        result = PassResult(n_pods, n_containers, counts[0], counts[1], counts[2])
        # One line per pass; quiet at info when nothing drifted.
        emit = log.info if result.writes or result.failures else log.debug
        emit("reconcile_pass", pods=result.pods, containers=result.containers, writes=result.writes,
             failures=result.failures, skipped=result.skipped, full=full)
        return result

    def _still_verified(self, now: float, basis: tuple[HookChain, int], full: bool) -> dict[str, float]:
        """The objects this pass may leave out (none after a trigger or a change of basis)."""
        if full or self._basis is None or self._basis[0] is not basis[0] or self._basis[1] != basis[1]:
            return {}
        span = VERIFY_PASSES * self._interval()
        return {oid: at for oid, at in self._verified.items() if now - at < span}

    async def _visit(self, chain: HookChain, objects: list[tuple[str, Context]], verified: dict[str, float],
                     now: float, counts: list[int]) -> int:
        """Run the stage over the objects not recently found in place; how many ran. Only
        objects of this pass are carried over: nothing outlives its pod. The objects go to
        the chain together (``HookChain.run_each``: one worker-thread hand-off for a chain
        of sync hooks); one torn down meanwhile fails quietly (``TargetGoneError``)."""
        todo: list[tuple[str, Context]] = []
        for object_id, ctx in objects:
            at = verified.get(object_id)
            if at is None:
                todo.append((object_id, ctx))
                continue
            self._verified[object_id] = at
            counts[2] += 1
        results = await chain.run_each([ctx for _, ctx in todo], _log_fields)
        for (object_id, ctx), result in zip(todo, results, strict=True):
            with logsetup.scoped(**_log_fields(ctx)):
                if self._settled(ctx, result, counts):
                    self._verified[object_id] = now
        return len(todo)

    def _settled(self, ctx: Context, result: Outcome | HookFailed, counts: list[int]) -> bool:
        """Count and log one object's outcome; whether everything was found in place (no
        write, no failure)."""
        if isinstance(result, HookFailed):
            counts[1] += 1
            # A repeat (or the object torn down meanwhile) was logged once already, or is no fault.
            emit = log.debug if result.repeat else log.error
            emit("reconcile_failed", hook=result.hook, stage=result.stage.value, reason=result.reason)
            return False
        writes = [c for c in result.changes if c.target.startswith(HOST_TARGET)]
        counts[0] += len(writes)
        if writes:
            self._store.record_changes(ctx.pod.meta.uid, tuple(writes))
            log.info("reconcile_repaired", changes=[f"{c.hook}:{c.target}={c.new}" for c in writes])
        # A hook failing under Ignore did not take: checked again next pass.
        return not writes and not result.failed


def _log_fields(ctx: Context) -> dict[str, str]:
    """What an object's log lines carry (its hooks' and this pass's)."""
    pod = ctx.pod
    fields = {"pod_namespace": pod.meta.namespace, "pod_name": pod.meta.name, "pod_uid": pod.meta.uid}
    if isinstance(ctx, ContainerContext):
        fields |= {"container_name": ctx.container.meta.name, "container_id": ctx.container.id}
    return fields
