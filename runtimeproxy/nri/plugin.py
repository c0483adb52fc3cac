"""The agent as an NRI plugin: containerd calls the hook chain at each lifecycle event.

One connection at a time to containerd's NRI socket (``nri.socket``): register as
``<index>-<name>``, answer Configure with the events the store and the chain need,
rebuild the store from Synchronize, then serve events. On EOF (containerd restarted)
or a handshake that does not complete, reconnect with back-off: containerd keeps
nothing about a plugin, so each connection registers and synchronises afresh.

Stage map (docs/nri.md has the table and what each stage cannot do here):

=============================  ===============================  ==========================
CRI stage                      NRI event                        effect of the chain
=============================  ===============================  ==========================
Pre/PostRunPodSandbox          RUN_POD_SANDBOX (task created,   host writes; request changes
                               not started)                     dropped (no pod adjustment)
PreCreateContainer             CreateContainer                  ContainerAdjustment
PostCreateContainer            POST_CREATE_CONTAINER            observe
PreStartContainer              START_CONTAINER                  veto / host writes
PostStartContainer             POST_START_CONTAINER             observe / host writes
PreUpdateContainerResources    UpdateContainer                  ContainerUpdate (itself)
PostUpdateContainerResources   POST_UPDATE_CONTAINER            observe
Pre/PostStopContainer          StopContainer (after the exit)   observe
Pre/PostRemoveContainer        REMOVE_CONTAINER                 observe
Pre/PostStopPodSandbox         STOP_POD_SANDBOX (after stop)    observe
Pre/PostRemovePodSandbox       REMOVE_POD_SANDBOX (after)       observe
=============================  ===============================  ==========================

An error reply fails the CRI call for CreateContainer, RUN_POD_SANDBOX, START_CONTAINER
and UpdateContainer (a Fail-policy hook's veto); on the other events containerd only
logs it, so those never answer with an error. Every reply leaves within
``nri.chain_deadline``, under containerd's ``plugin_request_timeout``: past it a
Fail hook fails the call, an Ignore hook loses its patch, and the plugin stays connected.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

import structlog

from criapi import cri_v1_pb2 as cri
from criapi import nri_v1alpha1_pb2 as nri
from runtimeproxy.chain.hookchain import HOST_TARGET, HookChain, HookFailed, Outcome
from runtimeproxy.config.ingress import NriSettings
from runtimeproxy.hookapi import CallResult, ContainerContext, ContainerInfo, Context, PodContext, PodInfo, Stage
from runtimeproxy.lifecycle.posthooks import PostQueue
from runtimeproxy.nri import convert, wire
from runtimeproxy.ops import logsetup
from runtimeproxy.state.ledger import Transition
from runtimeproxy.state.store import Store

log = structlog.get_logger("runtimeproxy.nri")


def _nothing() -> None:
    """No done mark to set (an object the ledger does not track)."""

#: Annotation the proxy ingress puts on what it forwarded when both ingresses run:
#: the NRI ingress leaves those objects' hooks to it (no hook runs twice).
PROXY_MARK: Final = "runtimeproxy.koordinator.sh/ingress"
PROXY_MARK_VALUE: Final = "cri-proxy"

E = nri.Event
#: Events the store needs whatever the chain has: pods and containers coming and going.
STORE_EVENTS: Final = (E.RUN_POD_SANDBOX, E.STOP_POD_SANDBOX, E.REMOVE_POD_SANDBOX, E.CREATE_CONTAINER,
                       E.POST_START_CONTAINER, E.POST_UPDATE_CONTAINER, E.STOP_CONTAINER, E.REMOVE_CONTAINER)
#: Events subscribed only when the chain has a hook at their stage.
STAGE_EVENTS: Final = {Stage.POST_CREATE_CONTAINER: E.POST_CREATE_CONTAINER,
                       Stage.PRE_START_CONTAINER: E.START_CONTAINER,
                       Stage.PRE_UPDATE_CONTAINER_RESOURCES: E.UPDATE_CONTAINER}
#: (Pre, Post) stages run on events that come after the fact (nothing left to veto).
_AFTER: Final[dict[int, tuple[Stage, Stage]]] = {
    E.STOP_POD_SANDBOX: (Stage.PRE_STOP_POD_SANDBOX, Stage.POST_STOP_POD_SANDBOX),
    E.REMOVE_POD_SANDBOX: (Stage.PRE_REMOVE_POD_SANDBOX, Stage.POST_REMOVE_POD_SANDBOX),
    E.STOP_CONTAINER: (Stage.PRE_STOP_CONTAINER, Stage.POST_STOP_CONTAINER),
    E.REMOVE_CONTAINER: (Stage.PRE_REMOVE_CONTAINER, Stage.POST_REMOVE_CONTAINER),
}
#: What explain adds to a recorded request change NRI could not carry.
NOT_APPLIED: Final = "not applied: NRI 0.6.1 has no pod sandbox adjustment"
BACKOFF_MAX: Final = 5.0
#: Configure and Synchronize follow registration at once; containerd serves one
#: connecting plugin at a time, so a handshake this late is dead (reference 9.1).
HANDSHAKE_TIMEOUT: Final = 10.0


def event_mask(chain: HookChain) -> int:
    events = set(STORE_EVENTS)
    events.update(ev for stage, ev in STAGE_EVENTS.items() if chain.for_stage(stage))
    return sum(1 << (int(ev) - 1) for ev in events)


@dataclass(frozen=True, slots=True)
class PluginInit:
    settings: Callable[[], NriSettings]
    store: Store
    chain: Callable[[], HookChain]
    skipped: Callable[[PodInfo], bool]
    posts: PostQueue
    #: /proc (oom_score_adj written after start: NRI 0.6.1 cannot adjust it).
    proc: Path = Path("/proc")
    #: Called after each Synchronize rebuilt the store (the reconciler's first pass).
    synchronized: Callable[[], None] = lambda: None


class NriPlugin:
    def __init__(self, init: PluginInit) -> None:
        self._init = init
        self._store = init.store
        self.connected = asyncio.Event()
        #: oom_score_adj the chain decided at creation, written once the process exists.
        self._oom: dict[str, int] = {}
        self._handlers: Mapping[str, Callable[[bytes, float | None], Awaitable[bytes]]] = {
            "Configure": self._configure,
            "Synchronize": self._synchronize,
            "Shutdown": self._shutdown,
            "CreateContainer": self._create_container,
            "UpdateContainer": self._update_container,
            "StopContainer": self._stop_container,
            "StateChange": self._state_change,
        }
        self._synced = asyncio.Event()
        self._warned: set[tuple[Stage, tuple[str, ...]]] = set()
        self._conn: wire.Connection | None = None
        #: The event mask containerd took at Configure (it takes none later).
        self._mask = 0
        self._resubscribe = False

    # --- connection ---------------------------------------------------------------

    async def run_forever(self) -> None:
        delay, failures = 0.2, 0
        while True:
            started = time.monotonic()
            try:
                await self._one_connection()
            except (OSError, wire.ProtocolError, wire.RpcError, TimeoutError) as exc:
                failures += 1
                # One line per streak: containerd down for a minute is not 300 lines.
                emit = log.error if failures == 1 else log.debug
                emit("nri_disconnected", socket=self._init.settings().socket, error=f"{type(exc).__name__}: {exc}")
            else:
                failures = 0
                if self._resubscribe:
                    self._resubscribe, delay = False, 0.05
                else:
                    log.warning("nri_disconnected", socket=self._init.settings().socket, error="closed by containerd")
            self.connected.clear()
            if time.monotonic() - started > 30:
                delay = 0.2  # it had been up: retry fast
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)

    async def _one_connection(self) -> None:
        settings = self._init.settings()
        conn = await wire.Connection.open(settings.socket, self._handle)
        self._conn = conn
        self._synced = asyncio.Event()
        serving = asyncio.create_task(conn.serve(), name="nri-reader")
        try:
            await conn.call("RegisterPlugin", nri.RegisterPluginRequest(
                plugin_name=settings.plugin_name, plugin_idx=settings.plugin_index), nri.Empty, timeout=5.0)
            # A Synchronize that never comes (or failed) leaves an open, dead connection.
            synced = asyncio.create_task(self._synced.wait())
            await asyncio.wait({serving, synced}, timeout=HANDSHAKE_TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
            synced.cancel()
            if not self._synced.is_set() and serving.done():
                serving.result()  # the reader's error, if it had one
                raise ConnectionError("closed by containerd during the handshake")
            if not self._synced.is_set():
                raise TimeoutError("no Synchronize from containerd after registering")
            self.connected.set()
            log.info("nri_connected", socket=settings.socket,
                     plugin=f"{settings.plugin_index}-{settings.plugin_name}")
            await serving
        finally:
            conn.close()
            if not serving.done():
                serving.cancel()

    @property
    def socket(self) -> str:
        return self._init.settings().socket

    def chain_changed(self) -> None:
        """A reload swapped the chain. containerd takes the event mask only at Configure:
        when the new chain needs other events, register again (Synchronize rebuilds the
        store; nothing is lost)."""
        conn, mask = self._conn, event_mask(self._init.chain())
        if conn is None or conn.closed.is_set() or mask == self._mask:
            return
        log.info("nri_resubscribing", events=hex(mask), was=hex(self._mask))
        self._resubscribe = True
        conn.close()

    async def _handle(self, method: str, payload: bytes, timeout: float | None) -> bytes:
        handler = self._handlers.get(method)
        if handler is None:
            raise wire.RpcError(wire.UNIMPLEMENTED, f"method {method}")
        with logsetup.scoped(nri_method=method):
            return await handler(payload, timeout)

    def _deadline(self, timeout: float | None) -> float:
        budget = self._init.settings().chain_deadline
        if timeout is not None:
            budget = min(budget, timeout * 0.75)
        return time.monotonic() + budget

    # --- handshake ----------------------------------------------------------------

    async def _configure(self, payload: bytes, _: float | None) -> bytes:
        req = nri.ConfigureRequest.FromString(payload)
        mask = self._mask = event_mask(self._init.chain())
        log.info("nri_configured", runtime=req.runtime_name, version=req.runtime_version, events=hex(mask))
        return nri.ConfigureResponse(events=mask).SerializeToString()

    async def _synchronize(self, payload: bytes, _: float | None) -> bytes:
        req = nri.SynchronizeRequest.FromString(payload)
        store = self._store
        pods = {p.id: convert.pod_info(p) for p in req.pods}
        # A sandbox without a task (pid 0) is stopped: NOTREADY, as the reconciler expects.
        ready = {p.id: cri.SANDBOX_READY if p.pid else cri.SANDBOX_NOTREADY for p in req.pods}
        containers = {c.id: c for c in req.containers}
        known_pods, known_containers = store.ids()
        for cid in set(known_containers) - set(containers):
            store.remove_container(cid)
        for sid in set(known_pods) - set(pods):
            store.remove_pod(sid)
        for pod in pods.values():
            store.put_pod(pod, ready[pod.id])
        for c in containers.values():
            store.put_container(c.pod_sandbox_id, convert.container_info(c), convert.cri_state(c.state))
        log.info("nri_synchronized", pods=len(pods), containers=len(containers),
                 history_pruned=store.prune_changes())
        self._synced.set()
        self._init.synchronized()
        return b""

    async def _shutdown(self, _payload: bytes, _timeout: float | None) -> bytes:
        return b""

    # --- events -------------------------------------------------------------------

    def _ours(self, pod: PodInfo, annotations: Mapping[str, str]) -> bool:
        """Whether this ingress runs the hooks: not for opted-out pods, nor for objects
        the proxy ingress forwarded (it ran them; ``ingress: both``)."""
        return not self._init.skipped(pod) and annotations.get(PROXY_MARK) != PROXY_MARK_VALUE

    async def _pre(self, ctx: Context, timeout: float | None) -> Outcome | None:
        """The Pre stage of an event containerd waits for; None when it has no hooks. A
        Fail hook's failure becomes an error reply: containerd fails the CRI call."""
        chain = self._init.chain()
        if not chain.for_stage(ctx.stage):
            return None
        deadline = self._deadline(timeout)
        try:  # a Pre hook sees what the pod's earlier Post hooks did, but not past our deadline
            await asyncio.wait_for(self._init.posts.wait(ctx.pod.meta.uid), max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            log.warning("post_hooks_still_running", stage=ctx.stage.value, ingress="nri")
        try:
            return await chain.run(ctx, deadline=deadline)
        except HookFailed as exc:
            log.error("cri_call_rejected", hook=exc.hook, stage=exc.stage.value, reason=exc.reason, ingress="nri")
            raise wire.RpcError(wire.UNKNOWN, str(exc)) from exc

    def _claim(self, event: int, object_id: str) -> tuple[bool, Callable[[], None]]:
        """Whether a stop or removal event runs its stages, and what marks them done: for an
        object the ledger tracks the transition is the ledger's to run once
        (runtimeproxy.lifecycle.owed), so the event claims it, unless the re-sync found it first."""
        ledger = self._store.ledger
        if ledger is None or not ledger.tracks(object_id):
            return True, _nothing
        transition: Transition = "stop" if event in (E.STOP_CONTAINER, E.STOP_POD_SANDBOX) else "remove"
        if not ledger.claim(object_id, transition):
            log.debug("post_stage_already_run", transition=transition, ingress="nri")
            return False, _nothing
        return True, functools.partial(ledger.done, object_id, transition)

    def _post(self, ctx: Context, *, pre: Stage | None = None, done: Callable[[], None] | None = None) -> None:
        """``ctx``'s (Post) stage after the reply, queued behind the pod's earlier ones;
        with ``pre``, that stage first (events after the fact: nothing to wait for);
        ``done`` once they ran (at once without a hook at either stage)."""
        chain = self._init.chain()
        stages = [s for s in (pre, ctx.stage) if s is not None and chain.for_stage(s)]
        if not stages:
            if done is not None:
                done()
            return

        async def run() -> None:
            try:
                await run_stages()
            finally:
                if done is not None:
                    done()

        async def run_stages() -> None:
            for stage in stages:
                try:
                    outcome = await self._init.chain().run(
                        replace(ctx, stage=stage, result=None if stage is pre else ctx.result), deadline=None)
                except HookFailed as exc:
                    log.error("pre_hook_failed" if stage is pre else "post_hook_failed", hook=exc.hook,
                              stage=exc.stage.value, reason=exc.reason, ingress="nri")
                    continue
                self._store.record_changes(ctx.pod.meta.uid, outcome.changes)

        self._init.posts.add(ctx.pod.meta.uid, run)

    def _record(self, pod: PodInfo, outcome: Outcome | None) -> None:
        if outcome is not None:
            self._store.record_changes(pod.meta.uid, outcome.changes)

    def _pod(self, pb: nri.PodSandbox) -> PodInfo:
        pod = self._store.pod(pb.id) or convert.pod_info(pb)
        logsetup.bind_pod(namespace=pod.meta.namespace, name=pod.meta.name, uid=pod.meta.uid)
        return pod

    async def _create_container(self, payload: bytes, timeout: float | None) -> bytes:
        req = nri.CreateContainerRequest.FromString(payload)
        pod = self._pod(req.pod)
        container = convert.container_info(req.container)
        logsetup.bind_container(name=container.meta.name, id=container.id)
        self._store.put_container(pod.id, container, cri.CONTAINER_CREATED)
        resp = nri.CreateContainerResponse()
        if not self._ours(pod, req.container.annotations):
            return resp.SerializeToString()
        outcome = await self._pre(ContainerContext(Stage.PRE_CREATE_CONTAINER, pod, container), timeout)
        if outcome is None:
            return resp.SerializeToString()
        assert isinstance(outcome.context, ContainerContext)
        final = outcome.context.container
        cannot = convert.adjustment(container, final, resp.adjust)
        if outcome.context.pod.cgroup_parent != pod.cgroup_parent:
            cannot.append("pod_cgroup_parent")  # the sandbox exists already
        if final.resources.oom_score_adj != container.resources.oom_score_adj:
            self._oom[container.id] = final.resources.oom_score_adj
            cannot.remove("oom_score_adj")  # written after start instead
        if cannot:
            self._not_applicable(Stage.PRE_CREATE_CONTAINER, cannot)
        self._store.put_container(pod.id, final, cri.CONTAINER_CREATED)
        self._record(pod, outcome)
        log.info("nri_call", call="CreateContainer", changes=[f"{c.hook}:{c.target}={c.new}"
                                                               for c in outcome.changes])
        return resp.SerializeToString()

    async def _update_container(self, payload: bytes, timeout: float | None) -> bytes:
        req = nri.UpdateContainerRequest.FromString(payload)
        pod = self._pod(req.pod)
        asked = convert.resources_from_nri(req.linux_resources)
        rec = self._store.container(req.container.id)
        base = rec.info if rec is not None else convert.container_info(req.container)
        merged = replace(base, resources=replace(asked, oom_score_adj=base.resources.oom_score_adj))
        resp = nri.UpdateContainerResponse()
        if not self._ours(pod, req.container.annotations):
            return resp.SerializeToString()
        ctx = ContainerContext(Stage.PRE_UPDATE_CONTAINER_RESOURCES, pod, merged)
        outcome = await self._pre(ctx, timeout)
        if outcome is None:
            return resp.SerializeToString()
        assert isinstance(outcome.context, ContainerContext)
        upd, cannot = convert.update(req.container.id, merged.resources, outcome.context.container.resources)
        if upd is not None:
            resp.update.append(upd)
        if cannot:
            self._not_applicable(Stage.PRE_UPDATE_CONTAINER_RESOURCES, cannot)
        self._record(pod, outcome)
        return resp.SerializeToString()

    async def _stop_container(self, payload: bytes, timeout: float | None) -> bytes:
        req = nri.StopContainerRequest.FromString(payload)
        await self._after(E.STOP_CONTAINER, req.pod, req.container)
        return nri.StopContainerResponse().SerializeToString()

    async def _state_change(self, payload: bytes, timeout: float | None) -> bytes:
        ev = nri.StateChangeEvent.FromString(payload)
        has_container = ev.HasField("container")
        if ev.event == E.RUN_POD_SANDBOX:
            await self._run_pod_sandbox(ev.pod, timeout)
        elif ev.event in _AFTER:
            await self._after(ev.event, ev.pod, ev.container if has_container else None)
        elif has_container:
            await self._container_state(ev.event, ev.pod, ev.container, timeout)
        return b""

    async def _run_pod_sandbox(self, pb: nri.PodSandbox, timeout: float | None) -> None:
        pod = convert.pod_info(pb)
        logsetup.bind_pod(namespace=pod.meta.namespace, name=pod.meta.name, uid=pod.meta.uid)
        self._store.put_pod(pod, cri.SANDBOX_READY)
        if not self._ours(pod, pb.annotations):
            return
        outcome = await self._pre(PodContext(Stage.PRE_RUN_POD_SANDBOX, pod), timeout)
        if outcome is not None and outcome.request_changed:
            # No pod adjustment in NRI: the sandbox's config is fixed by now. Host writes stand;
            # explain says which changes did not reach containerd.
            self._not_applicable(Stage.PRE_RUN_POD_SANDBOX,
                                 sorted({c.target for c in outcome.changes if not c.target.startswith(HOST_TARGET)}))
            outcome = replace(outcome, changes=tuple(
                c if c.target.startswith(HOST_TARGET) else replace(c, reason=f"{c.reason} [{NOT_APPLIED}]")
                for c in outcome.changes))
        self._record(pod, outcome)
        self._post(PodContext(Stage.POST_RUN_POD_SANDBOX, pod, CallResult(True)))

    async def _container_state(self, event: int, pb_pod: nri.PodSandbox, pb: nri.Container,
                               timeout: float | None) -> None:
        pod = self._pod(pb_pod)
        rec = self._store.container(pb.id)
        container = rec.info if rec is not None else convert.container_info(pb)
        logsetup.bind_container(name=container.meta.name, id=container.id)
        ours = self._ours(pod, pb.annotations)
        if event == E.START_CONTAINER and ours:
            self._record(pod, await self._pre(ContainerContext(Stage.PRE_START_CONTAINER, pod, container), timeout))
        elif event == E.POST_CREATE_CONTAINER and ours:
            self._post(ContainerContext(Stage.POST_CREATE_CONTAINER, pod, container, CallResult(True)))
        elif event == E.POST_START_CONTAINER:
            self._store.set_container_state(pb.id, cri.CONTAINER_RUNNING)
            oom = self._oom.pop(pb.id, None)
            if oom is not None and ours:
                self._write_oom_score_adj(pb.pid, oom)
            if ours:
                self._post(ContainerContext(Stage.POST_START_CONTAINER, pod, container, CallResult(True)))
        elif event == E.POST_UPDATE_CONTAINER:
            applied = convert.resources_from_nri(pb.linux.resources, container.resources.oom_score_adj)
            self._store.update_container_resources(pb.id, applied)
            if ours:
                self._post(ContainerContext(Stage.POST_UPDATE_CONTAINER_RESOURCES, pod,
                                            replace(container, resources=applied), CallResult(True)))

    def _not_applicable(self, stage: Stage, fields: list[str]) -> None:
        """What NRI could not carry: a warning the first time per stage and fields, then
        debug (every BE pod's PreRunPodSandbox would repeat it)."""
        key = (stage, tuple(fields))
        emit = log.debug if key in self._warned else log.warning
        self._warned.add(key)
        emit("patch_not_applicable", ingress="nri", stage=stage.value, fields=fields)

    def _write_oom_score_adj(self, pid: int, value: int) -> None:
        """What NRI 0.6.1 cannot adjust, set on the host once the process exists (the
        value passed the chain's validator: -1000..1000)."""
        path = self._init.proc / str(pid) / "oom_score_adj"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
            try:
                os.write(fd, str(value).encode())
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("oom_score_adj_failed", pid=pid, value=value, error=str(exc), ingress="nri")
            return
        log.info("oom_score_adj_set", pid=pid, value=value, ingress="nri")

    async def _after(self, event: int, pb_pod: nri.PodSandbox, pb: nri.Container | None) -> None:
        """Stop/remove events: containerd sends them after the fact, so the Pre stage can
        only observe (its Fail policy is logged, not relayed): both stages run after the
        reply, Pre then Post, and containerd's exit and teardown paths do not wait for them."""
        pre, post = _AFTER[event]
        pod = self._pod(pb_pod)
        ctx: Context
        if pb is None:
            ctx = PodContext(pre, pod)
        else:
            rec = self._store.container(pb.id)
            container: ContainerInfo = rec.info if rec is not None else convert.container_info(pb)
            logsetup.bind_container(name=container.meta.name, id=container.id)
            ctx = ContainerContext(pre, pod, container)
        annotations = pb.annotations if pb is not None else pb_pod.annotations
        if self._ours(pod, annotations):
            run, done = self._claim(event, pb_pod.id if pb is None else pb.id)
            if run:
                self._post(replace(ctx, stage=post, result=CallResult(True)), pre=pre, done=done)
        if event == E.STOP_POD_SANDBOX:
            self._store.set_pod_state(pb_pod.id, cri.SANDBOX_NOTREADY)
        elif event == E.REMOVE_POD_SANDBOX:
            self._store.remove_pod(pb_pod.id)
        elif event == E.STOP_CONTAINER and pb is not None:
            self._store.set_container_state(pb.id, cri.CONTAINER_EXITED)
            self._oom.pop(pb.id, None)
        elif pb is not None:
            self._store.remove_container(pb.id)
