"""Interception: the eight lifecycle methods, independent of the transport.

``Lifecycle.handle(method, payload, call)`` takes request bytes and returns the
backend's reply bytes, running Pre hooks (which may patch the request), the
backend call, the store update and Post hooks (which observe the result, even a
failed one). A hook failure under the Fail policy becomes a ``CallError`` and
nothing is forwarded. When no hook changed anything the original bytes are
forwarded, so an untouched request is byte-exact.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Final

import structlog

from criapi import cri_v1_pb2 as cri
from runtimeproxy.backend import Backend, CallError, Code, Metadata, Reply
from runtimeproxy.chain import patching
from runtimeproxy.chain.hookchain import HookChain, HookFailed, Outcome
from runtimeproxy.hookapi import (
    CallResult,
    ContainerContext,
    ContainerInfo,
    ContainerPatch,
    Context,
    PodContext,
    PodInfo,
    PodPatch,
    Stage,
)
from runtimeproxy.lifecycle.posthooks import PostQueue
from runtimeproxy.ops import logsetup
from runtimeproxy.state.ledger import Transition
from runtimeproxy.state.store import Store, load_container, load_pod

log = structlog.get_logger("runtimeproxy.lifecycle")

RUNTIME: Final = "/runtime.v1.RuntimeService/"
#: Owed Post stages (runtimeproxy.lifecycle.owed) running at once: a hook pool's workers
#: (``HookPools``), so a burst neither queues past its hooks' budgets nor fills the pools.
OWED_AT_ONCE: Final = 4


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What the transport knows about the caller: its deadline and metadata."""

    timeout: float | None = None
    metadata: Metadata = ()


@dataclass(frozen=True, slots=True)
class SkipLabel:
    key: str
    value: str


_Handler = Callable[[bytes, CallInfo], Awaitable[Reply]]


class Lifecycle:
    def __init__(
        self,
        *,
        store: Store,
        backend: Backend,
        chain: Callable[[], HookChain],
        skip_label: Callable[[], SkipLabel],
        mark: Mapping[str, str] | None = None,
    ) -> None:
        self._store = store
        #: Annotations put on every RunPodSandbox/CreateContainer forwarded (``ingress: both``:
        #: the NRI ingress leaves what carries them to us, so no hook runs twice).
        self._mark = dict(mark or {})
        self._backend = backend
        self._chain = chain
        self._skip_label = skip_label
        #: Pod uid -> calls in flight that bring it into the store (Run/CreateContainer).
        self._in_flight: collections.Counter[str] = collections.Counter()
        #: Post stages run after the reply, in order per pod; a drain waits for them.
        self.posts = PostQueue()
        #: Owed Post stages in the hooks' hands at once (``run_owed``): the rest wait here.
        self._owed_slots = asyncio.Semaphore(OWED_AT_ONCE)
        self._handlers: Mapping[str, _Handler] = {
            RUNTIME + "RunPodSandbox": self._run_pod_sandbox,
            RUNTIME + "StopPodSandbox": self._stop_pod_sandbox,
            RUNTIME + "RemovePodSandbox": self._remove_pod_sandbox,
            RUNTIME + "CreateContainer": self._create_container,
            RUNTIME + "StartContainer": self._start_container,
            RUNTIME + "UpdateContainerResources": self._update_container_resources,
            RUNTIME + "StopContainer": self._stop_container,
            RUNTIME + "RemoveContainer": self._remove_container,
        }

    @property
    def methods(self) -> frozenset[str]:
        return frozenset(self._handlers)

    async def handle(self, method: str, payload: bytes, call: CallInfo) -> Reply:
        with logsetup.scoped(method=method.removeprefix(RUNTIME)):
            if method not in _CREATING:
                return await self._handlers[method](payload, call)
            uid = _creating_uid(method, payload)
            self._in_flight[uid] += 1
            try:
                return await self._handlers[method](payload, call)
            finally:
                self._in_flight[uid] -= 1
                if self._in_flight[uid] <= 0:
                    del self._in_flight[uid]

    # --- pod sandbox -------------------------------------------------------------

    async def _run_pod_sandbox(self, payload: bytes, call: CallInfo) -> Reply:
        req = cri.RunPodSandboxRequest.FromString(payload)
        pod = patching.pod_info(req.config, runtime_handler=req.runtime_handler)
        _bind_pod(pod)
        deadline = _deadline(call)
        ctx: Context = PodContext(Stage.PRE_RUN_POD_SANDBOX, pod)
        outcome = await self._pre(ctx, deadline)
        if outcome.request_changed:
            for _, patch in outcome.patches:
                assert isinstance(patch, PodPatch)
                patching.apply_pod_patch(req, patch)
        if outcome.request_changed or self._mark:
            req.config.annotations.update(self._mark)
            payload = req.SerializeToString()
        assert isinstance(outcome.context, PodContext)
        pod = outcome.context.pod

        async def after(reply: Reply) -> Context:
            sandbox_id = cri.RunPodSandboxResponse.FromString(reply.payload).pod_sandbox_id
            created = replace(pod, id=sandbox_id)
            self._store.put_pod(created, cri.SANDBOX_READY)
            self._store.record_changes(pod.meta.uid, outcome.changes)
            return PodContext(Stage.POST_RUN_POD_SANDBOX, created)  # Post hooks learn the new id

        post = PodContext(Stage.POST_RUN_POD_SANDBOX, pod)
        return await self._forward("RunPodSandbox", payload, call, deadline, post, after, outcome)

    async def _pod_by_id(self, sandbox_id: str) -> PodInfo | None:
        pod = self._store.pod(sandbox_id)
        if pod is None and sandbox_id:
            pod = await load_pod(self._backend, sandbox_id)
            if pod is not None:
                self._store.put_pod(pod)
        return pod

    async def _pod_id_only(self, name: str, payload: bytes, call: CallInfo, remove: bool) -> Reply:
        sandbox_id = (cri.RemovePodSandboxRequest if remove else cri.StopPodSandboxRequest).FromString(
            payload
        ).pod_sandbox_id
        pod = await self._pod_by_id(sandbox_id)
        if pod is None:
            return await self._plain(name, payload, call)
        _bind_pod(pod)
        deadline = _deadline(call)
        pre, post = (
            (Stage.PRE_REMOVE_POD_SANDBOX, Stage.POST_REMOVE_POD_SANDBOX)
            if remove
            else (Stage.PRE_STOP_POD_SANDBOX, Stage.POST_STOP_POD_SANDBOX)
        )
        outcome = await self._pre(PodContext(pre, pod), deadline)

        async def after(_: Reply) -> None:
            self._store.record_changes(pod.meta.uid, outcome.changes)
            self._pod_done(sandbox_id, remove)

        return await self._forward(name, payload, call, deadline, PodContext(post, pod), after, outcome)

    async def _stop_pod_sandbox(self, payload: bytes, call: CallInfo) -> Reply:
        return await self._pod_id_only("StopPodSandbox", payload, call, remove=False)

    async def _remove_pod_sandbox(self, payload: bytes, call: CallInfo) -> Reply:
        return await self._pod_id_only("RemovePodSandbox", payload, call, remove=True)

    # --- containers --------------------------------------------------------------

    async def _create_container(self, payload: bytes, call: CallInfo) -> Reply:
        req = cri.CreateContainerRequest.FromString(payload)
        pod = await self._pod_by_id(req.pod_sandbox_id)
        if pod is None:
            # The request carries the sandbox config, so hooks still get the pod's context.
            pod = patching.pod_info(req.sandbox_config, runtime_handler="", sandbox_id=req.pod_sandbox_id)
        container = patching.container_info(req.config)
        _bind_pod(pod)
        logsetup.bind_container(name=container.meta.name, id="")
        deadline = _deadline(call)
        outcome = await self._pre(ContainerContext(Stage.PRE_CREATE_CONTAINER, pod, container), deadline)
        if outcome.request_changed:
            for _, patch in outcome.patches:
                assert isinstance(patch, ContainerPatch)
                patching.apply_create_patch(req, patch)
        if outcome.request_changed or self._mark:
            req.config.annotations.update(self._mark)
            payload = req.SerializeToString()
        assert isinstance(outcome.context, ContainerContext)
        final = outcome.context
        post_ctx = ContainerContext(Stage.POST_CREATE_CONTAINER, final.pod, final.container)

        async def after(reply: Reply) -> Context:
            cid = cri.CreateContainerResponse.FromString(reply.payload).container_id
            logsetup.bind_container(name=container.meta.name, id=cid)
            created = replace(final.container, id=cid)
            self._store.put_container(req.pod_sandbox_id, created, cri.CONTAINER_CREATED)
            self._store.record_changes(pod.meta.uid, outcome.changes)
            return ContainerContext(Stage.POST_CREATE_CONTAINER, final.pod, created)  # Post hooks learn the new id

        return await self._forward("CreateContainer", payload, call, deadline, post_ctx, after, outcome)

    async def _container_by_id(self, container_id: str) -> tuple[PodInfo, ContainerInfo] | None:
        rec = self._store.container(container_id)
        if rec is None and container_id:
            rec = await load_container(self._backend, container_id)
            if rec is not None:
                self._store.put_container(rec.pod_id, rec.info)
        if rec is None:
            return None
        pod = await self._pod_by_id(rec.pod_id)
        return (pod, rec.info) if pod is not None else None

    async def _container_id_only(self, name: str, container_id: str, payload: bytes, call: CallInfo) -> Reply:
        pre, post_stage = _CONTAINER_STAGES[name]
        found = await self._container_by_id(container_id)
        if found is None:
            return await self._plain(name, payload, call)
        pod, container = found
        _bind_pod(pod)
        logsetup.bind_container(name=container.meta.name, id=container.id)
        deadline = _deadline(call)
        outcome = await self._pre(ContainerContext(pre, pod, container), deadline)

        async def after(_: Reply) -> None:
            self._store.record_changes(pod.meta.uid, outcome.changes)
            self._container_done(container_id, pre)

        post = ContainerContext(post_stage, pod, container)
        return await self._forward(name, payload, call, deadline, post, after, outcome)

    async def _start_container(self, payload: bytes, call: CallInfo) -> Reply:
        cid = cri.StartContainerRequest.FromString(payload).container_id
        return await self._container_id_only("StartContainer", cid, payload, call)

    async def _stop_container(self, payload: bytes, call: CallInfo) -> Reply:
        cid = cri.StopContainerRequest.FromString(payload).container_id
        return await self._container_id_only("StopContainer", cid, payload, call)

    async def _remove_container(self, payload: bytes, call: CallInfo) -> Reply:
        cid = cri.RemoveContainerRequest.FromString(payload).container_id
        return await self._container_id_only("RemoveContainer", cid, payload, call)

    async def _update_container_resources(self, payload: bytes, call: CallInfo) -> Reply:
        req = cri.UpdateContainerResourcesRequest.FromString(payload)
        found = await self._container_by_id(req.container_id)
        if found is None:
            return await self._plain("UpdateContainerResources", payload, call)
        pod, container = found
        _bind_pod(pod)
        logsetup.bind_container(name=container.meta.name, id=container.id)
        merged = replace(container, resources=patching.merge_update(container.resources, req.linux))
        deadline = _deadline(call)
        outcome = await self._pre(ContainerContext(Stage.PRE_UPDATE_CONTAINER_RESOURCES, pod, merged), deadline)
        if outcome.request_changed:
            for hook, patch in outcome.patches:
                assert isinstance(patch, ContainerPatch)
                dropped = patching.apply_update_patch(req, patch)
                if dropped:
                    log.warning("patch_not_applicable", hook=hook, fields=dropped)
            payload = req.SerializeToString()
        assert isinstance(outcome.context, ContainerContext)
        final = outcome.context.container

        async def after(_: Reply) -> None:
            self._store.update_container_resources(req.container_id, final.resources)
            self._store.record_changes(pod.meta.uid, outcome.changes)

        post = ContainerContext(Stage.POST_UPDATE_CONTAINER_RESOURCES, pod, final)
        return await self._forward("UpdateContainerResources", payload, call, deadline, post, after, outcome)

    # --- shared steps ------------------------------------------------------------

    def _pod_done(self, sandbox_id: str, remove: bool) -> None:
        """The store after a successful Stop/RemovePodSandbox ."""
        if remove:
            self._store.remove_pod(sandbox_id)
        else:
            self._store.set_pod_state(sandbox_id, cri.SANDBOX_NOTREADY)

    def _container_done(self, container_id: str, pre: Stage) -> None:
        """The store after a successful Start/Stop/RemoveContainer ."""
        if pre is Stage.PRE_REMOVE_CONTAINER:
            self._store.remove_container(container_id)
        elif pre in _STATE_AFTER:
            self._store.set_container_state(container_id, _STATE_AFTER[pre])

    def _skipped(self, ctx: Context) -> bool:
        skip = self._skip_label()
        return ctx.pod.labels.get(skip.key) == skip.value

    async def _pre(self, ctx: Context, deadline: float | None) -> Outcome:
        chain = self._chain()
        if self._skipped(ctx) or not chain.for_stage(ctx.stage):
            return Outcome(context=ctx, patches=(), changes=())
        await self.posts.wait(ctx.pod.meta.uid)  # a Pre hook sees what the pod's earlier Post hooks did
        try:
            return await chain.run(ctx, deadline=deadline)
        except HookFailed as exc:
            code = Code.DEADLINE_EXCEEDED if exc.deadline and _expired(deadline) else Code.FAILED_PRECONDITION
            log.error("cri_call_rejected", hook=exc.hook, stage=exc.stage.value, reason=exc.reason)
            raise CallError(code, str(exc)) from exc

    async def _plain(self, name: str, payload: bytes, call: CallInfo) -> Reply:
        """Forward without hooks (the store does not know the object)."""
        log.debug("cri_call_unknown_object", method=name)
        return await self._backend.unary(RUNTIME + name, payload, timeout=call.timeout, metadata=call.metadata)

    async def _forward(
        self,
        name: str,
        payload: bytes,
        call: CallInfo,
        deadline: float | None,
        post: Context,
        after: Callable[[Reply], Awaitable[Context | None]],
        outcome: Outcome,
    ) -> Reply:
        start = time.perf_counter()
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.001)
        try:
            reply = await self._backend.unary(RUNTIME + name, payload, timeout=timeout, metadata=call.metadata)
        except CallError as exc:
            self._post_after_reply(replace(post, result=CallResult(False, exc.code.name, exc.details)), deadline)
            log.info("cri_call", result=exc.code.name, error=exc.details, changes=len(outcome.changes))
            raise
        updated = await after(reply)
        self._post_after_reply(replace(post if updated is None else updated, result=CallResult(True)), deadline)
        log.info(
            "cri_call",
            result="OK",
            backend_ms=round((time.perf_counter() - start) * 1000, 3),
            changes=[f"{c.hook}:{c.target}={c.new}" for c in outcome.changes],
        )
        return reply

    def _post_after_reply(self, ctx: Context, deadline: float | None) -> None:
        """The Post stage, queued behind this pod's earlier ones (runtimeproxy.lifecycle.posthooks).
        After a successful stop or removal the stage is the ledger's to run once: this call
        claims it, unless the re-sync found that transition first (then it is not run again)."""
        owed = _transition(ctx)
        ledger = self._store.ledger
        if owed is not None and ledger is not None and ledger.tracks(owed[0]):
            if not ledger.claim(*owed):
                log.debug("post_stage_already_run", stage=ctx.stage.value)
                return
            self.run_owed(ctx, lambda failed: ledger.ran(*owed, failed), deadline)
            return
        if self._skipped(ctx) or not self._chain().for_stage(ctx.stage):
            return
        self.posts.add(ctx.pod.meta.uid, lambda: self._post(ctx, deadline))

    def run_owed(self, ctx: Context, ran: Callable[[frozenset[str]], None], deadline: float | None = None,
                 hooks: frozenset[str] | None = None) -> None:
        """A Post stage owed after a stop or a removal (runtimeproxy.lifecycle.owed): queued
        like a call's; ``ran(failed)`` is called once it ran (or at once when no hook has the
        stage) with the hooks that failed or timed out, which the ledger owes again.
        ``hooks``: only these (the ones that failed last time)."""
        if self._skipped(ctx) or not any(hooks is None or h.name in hooks for h in self._chain().for_stage(ctx.stage)):
            ran(frozenset())
            return

        async def work() -> None:
            # A burst (thousands owed after a start) waits here, not in the hooks' worker
            # queues: a sync hook's budget runs from its submit, so queued there it would
            # time out unrun; and the pools stay free for the calls kubelet waits on.
            failed = frozenset(h.name for h in self._chain().for_stage(ctx.stage) if hooks is None or h.name in hooks)
            try:
                async with self._owed_slots:
                    failed = await self._post_owed(ctx, deadline, hooks)
            finally:
                ran(failed)  # cancelled (a stop): all owed again, at the next start

        def queue() -> None:  # in a copy of the context: the pod's log bindings go with this stage only
            _bind_pod(ctx.pod)
            if isinstance(ctx, ContainerContext):
                logsetup.bind_container(name=ctx.container.meta.name, id=ctx.container.id)
            self.posts.add(ctx.pod.meta.uid, work)

        contextvars.copy_context().run(queue)

    async def _post_owed(self, ctx: Context, deadline: float | None, hooks: frozenset[str] | None) -> frozenset[str]:
        """Run an owed Post stage; returns the hooks that failed or timed out."""
        if self._skipped(ctx):
            return frozenset()
        chain = self._chain()
        try:
            outcome = await chain.run(ctx, deadline=deadline, only=hooks)
        except HookFailed as exc:  # a Fail hook stops the chain: it and the hooks after it did not run
            log.error("post_hook_failed", hook=exc.hook, stage=exc.stage.value, reason=exc.reason)
            names = [h.name for h in chain.for_stage(ctx.stage) if hooks is None or h.name in hooks]
            return frozenset(names[names.index(exc.hook):] if exc.hook in names else names)
        self._store.record_changes(ctx.pod.meta.uid, outcome.changes)
        return frozenset(outcome.failed)

    def pending_uids(self) -> frozenset[str]:
        """Pods with a RunPodSandbox or CreateContainer call in flight (live for the host sweep)."""
        return frozenset(self._in_flight)

    async def _post(self, ctx: Context, deadline: float | None) -> None:
        if self._skipped(ctx):
            return
        try:
            outcome = await self._chain().run(ctx, deadline=deadline)
        except HookFailed as exc:
            # The backend call already happened; a Post failure cannot undo it, so it is reported, not relayed.
            log.error("post_hook_failed", hook=exc.hook, stage=exc.stage.value, reason=exc.reason)
            return
        self._store.record_changes(ctx.pod.meta.uid, outcome.changes)


#: A container's state once these calls succeeded (the reconciler skips CREATED and EXITED).
_STATE_AFTER: Final[Mapping[Stage, int]] = {
    Stage.PRE_START_CONTAINER: cri.CONTAINER_RUNNING,
    Stage.PRE_STOP_CONTAINER: cri.CONTAINER_EXITED,
}


#: The container calls with an id only: their (Pre, Post) stages.
_CONTAINER_STAGES: Final[Mapping[str, tuple[Stage, Stage]]] = {
    "StartContainer": (Stage.PRE_START_CONTAINER, Stage.POST_START_CONTAINER),
    "StopContainer": (Stage.PRE_STOP_CONTAINER, Stage.POST_STOP_CONTAINER),
    "RemoveContainer": (Stage.PRE_REMOVE_CONTAINER, Stage.POST_REMOVE_CONTAINER),
    "UpdateContainerResources": (Stage.PRE_UPDATE_CONTAINER_RESOURCES, Stage.POST_UPDATE_CONTAINER_RESOURCES),
}
#: The calls that make a pod's objects (the host sweep must not take their pod for gone).
_CREATING: Final = frozenset({RUNTIME + "RunPodSandbox", RUNTIME + "CreateContainer"})
#: The Post stages after a stop or a removal: (object kind, transition) in the ledger.
_TRANSITIONS: Final[Mapping[Stage, Transition]] = {
    Stage.POST_STOP_POD_SANDBOX: "stop", Stage.POST_REMOVE_POD_SANDBOX: "remove",
    Stage.POST_STOP_CONTAINER: "stop", Stage.POST_REMOVE_CONTAINER: "remove",
}


def _creating_uid(method: str, payload: bytes) -> str:
    if method == RUNTIME + "RunPodSandbox":
        return str(cri.RunPodSandboxRequest.FromString(payload).config.metadata.uid)
    return str(cri.CreateContainerRequest.FromString(payload).sandbox_config.metadata.uid)


def _transition(ctx: Context) -> tuple[str, Transition] | None:
    """(object id, transition) of a successful stop or removal's Post stage."""
    transition = _TRANSITIONS.get(ctx.stage)
    if transition is None or ctx.result is None or not ctx.result.ok:
        return None
    object_id = ctx.container.id if isinstance(ctx, ContainerContext) else ctx.pod.id
    return (object_id, transition) if object_id else None


def _deadline(call: CallInfo) -> float | None:
    return None if call.timeout is None else time.monotonic() + call.timeout


def _expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _bind_pod(pod: PodInfo) -> None:
    logsetup.bind_pod(namespace=pod.meta.namespace, name=pod.meta.name, uid=pod.meta.uid)
