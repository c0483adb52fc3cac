"""The hook chain: run the configured hooks of one stage, in YAML order.

Order is data (the config list), never names or registration order. Each hook
sees the context as the earlier hooks left it, has its own deadline and failure
policy, and the whole chain stays inside the caller's deadline. The outcome
records every field a hook changed (hook, target, old -> new, reason) so
``explain`` and the log can say why a pod got what it got.

Sync hooks run in worker threads, which no timeout can stop. So the call's
deadline travels with it (``hostwrites.HOOK_DEADLINE``, in the context copied
into the thread) and every host write checks it: past its deadline a hook writes
nothing. Each hook has its own bounded pool (``HookPools``): a hook stuck past
its deadline holds only its own threads, and once ``max_overdue`` of its calls
are stuck, its next calls fail fast under its policy instead of queueing.

Consecutive sync hooks of a stage go to a worker thread together, in one hand-off
(``runtimeproxy.chain.hookbatch``; their pool is the stage's, ``stage:<Stage>``): each
still has its own deadline, policy and observation, and one past its deadline
stops the batch, the hooks after it running alone as above.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import Any, Final, Literal, Protocol, cast

import structlog

from runtimeproxy.chain.hookbatch import Batch, Expired, Fields, Step, Sweep
from runtimeproxy.chain.validate import PatchValidator
from runtimeproxy.config.settings import FailurePolicy
from runtimeproxy.errors import HookError
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerPatch,
    Context,
    HostRoots,
    Patch,
    PodContext,
    PodPatch,
    Resources,
    ResourcesPatch,
    Stage,
    TargetGoneError,
    frozen_map,
)
from runtimeproxy.hostwrites import HOOK_DEADLINE, is_repeat
from runtimeproxy.ops.repeats import RepeatFilter, Verdict

log = structlog.get_logger("runtimeproxy.chain")

HookResult = Literal["ok", "error", "timeout"]
#: Prefix of Change.target for writes a hook made on the host (files, not the request).
HOST_TARGET: Final = "host:"
_RECONCILE_STAGES: Final = frozenset({Stage.RECONCILE_POD_SANDBOX, Stage.RECONCILE_CONTAINER})


class HookFailed(HookError):
    """A Fail-policy hook failed: the CRI call must not be forwarded."""

    def __init__(self, hook: str, stage: Stage, reason: str, *, deadline: bool = False) -> None:
        super().__init__(f"hook {hook!r} failed at {stage.value}: {reason}")
        self.hook = hook
        self.stage = stage
        self.reason = reason
        self.deadline = deadline
        #: The failure repeats one already logged (a host write failing the same way again).
        self.repeat = False


class HookBusyError(HookError):
    """A hook has too many calls still running past their deadline to take another."""

    def __init__(self, hook: str, overdue: int) -> None:
        super().__init__(f"{overdue} earlier call(s) of hook {hook!r} still running past their deadline")


#: When a pool call is past its deadline: a ``time.monotonic()`` value, or a predicate.
Deadline = float | Callable[[], bool]


class HookPools:
    """Worker threads for sync hooks: one bounded pool per hook name, shared by
    every chain a reload builds (stuck threads outlive the chain that started them).

    A pool has ``workers`` threads for calls in time plus room for ``max_overdue``
    calls stuck past their deadline; a hook with ``max_overdue`` stuck calls is
    refused (``HookBusyError``) until one of them returns."""

    def __init__(self, *, workers: int = 4, max_overdue: int = 4, thread_name_prefix: str = "hook") -> None:
        self._workers, self._max_overdue, self._prefix = workers, max_overdue, thread_name_prefix
        self._lock = threading.Lock()
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._running: dict[str, dict[int, Deadline]] = {}  # hook -> {call: deadline}
        self._ids = itertools.count()
        self._closed = False

    def submit(self, hook: str, deadline: Deadline, call: Callable[[], object]) -> Future[object]:
        """``deadline``: a ``time.monotonic()`` value, or for a call whose deadline moves
        as it runs (a ``Sweep``: each object's hooks have their own) whether it is past one."""
        now = time.monotonic()
        with self._lock:
            if self._closed:
                raise RuntimeError("the hook pools are shut down")
            running = self._running.setdefault(hook, {})
            overdue = sum(1 for d in running.values() if _past(d, now))
            if overdue >= self._max_overdue:
                raise HookBusyError(hook, overdue)
            pool = self._pools.get(hook)
            if pool is None:
                pool = ThreadPoolExecutor(self._workers + self._max_overdue, f"{self._prefix}-{hook}")
                self._pools[hook] = pool
            call_id = next(self._ids)
            running[call_id] = deadline
        try:
            future = pool.submit(call)
        except RuntimeError:  # shut down meanwhile
            self._done(hook, call_id)
            raise
        future.add_done_callback(lambda _: self._done(hook, call_id))
        return future

    def _done(self, hook: str, call_id: int) -> None:
        with self._lock:
            self._running.get(hook, {}).pop(call_id, None)

    def overdue(self, hook: str) -> int:
        """Calls of ``hook`` still running past their deadline."""
        now = time.monotonic()
        with self._lock:
            return sum(1 for d in self._running.get(hook, {}).values() if _past(d, now))

    def shutdown(self) -> None:
        """Drop queued calls; running ones finish on their own (they can no longer write)."""
        with self._lock:
            self._closed = True
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)


def _past(deadline: Deadline, now: float) -> bool:
    return deadline() if callable(deadline) else deadline <= now


@dataclass(frozen=True, slots=True)
class BoundHook:
    """A hook instance with the settings it runs under."""

    name: str
    impl: object
    stages: frozenset[Stage]
    policy: FailurePolicy
    timeout: float


@dataclass(frozen=True, slots=True)
class Change:
    """One field a hook changed: what ``explain`` shows."""

    hook: str
    stage: str
    target: str
    old: str
    new: str
    reason: str


@dataclass(frozen=True, slots=True)
class Outcome:
    """The final context, the patches in order and what they changed."""

    context: Context
    patches: tuple[tuple[str, Patch], ...]
    changes: tuple[Change, ...]
    #: Hooks that failed or timed out under ``Ignore`` (an owed Post stage runs them again).
    failed: tuple[str, ...] = ()

    @property
    def request_changed(self) -> bool:
        """Whether the CRI request must be rewritten (host writes alone do not)."""
        return any(not c.target.startswith(HOST_TARGET) for c in self.changes)


class HookObserver(Protocol):
    def hook_observed(self, hook: str, stage: str, result: HookResult, seconds: float) -> None: ...
    def hook_failed(self, hook: str, stage: str, policy: str) -> None: ...


def implemented_stages(impl: object) -> frozenset[Stage]:
    """The stages whose method the hook object has."""
    return frozenset(s for s in Stage if callable(getattr(impl, s.method_name, None)))


class HookChain:
    """Immutable: a config reload builds a new chain and swaps it in whole."""

    def __init__(
        self,
        hooks: Sequence[BoundHook],
        *,
        pools: HookPools | None = None,
        observer: HookObserver | None = None,
        validator: PatchValidator | None = None,
        repeats: RepeatFilter | None = None,
    ) -> None:
        self.hooks = tuple(hooks)
        #: Failures already logged, per hook and object (kept across reloads by the caller).
        self._repeats = RepeatFilter() if repeats is None else repeats
        self._pools = HookPools() if pools is None else pools
        # Every patch is checked before it counts (runtimeproxy.chain.validate): no hook, local or remote, bypasses it.
        self._validator = validator if validator is not None else PatchValidator.for_host(HostRoots())
        self._observer = observer
        self._by_stage: Mapping[Stage, tuple[BoundHook, ...]] = {
            stage: tuple(h for h in self.hooks if stage in h.stages) for stage in Stage
        }
        #: Per stage, per hook: a sync method (runs in a worker thread; consecutive ones share one hand-off).
        self._sync_by_stage: Mapping[Stage, tuple[bool, ...]] = {
            stage: tuple(not inspect.iscoroutinefunction(getattr(h.impl, stage.method_name)) for h in hooks)
            for stage, hooks in self._by_stage.items()
        }

    def for_stage(self, stage: Stage) -> tuple[BoundHook, ...]:
        return self._by_stage[stage]

    @property
    def pre_calls(self) -> frozenset[str]:
        """The CRI methods with a hook at their Pre stage (it may change or refuse the
        request): with HAProxy in front these reach Python before containerd; Stop/Remove
        calls with only Post hooks go straight to containerd, their Post stages found by
        the re-sync (runtimeproxy.lifecycle.owed)."""
        return frozenset(s.call for s, hooks in self._by_stage.items() if hooks and s.is_pre and s.call is not None)

    async def run(self, ctx: Context, *, deadline: float | None, only: frozenset[str] | None = None) -> Outcome:
        """Run ``ctx.stage``'s hooks (``only``: those of these names, in order). ``deadline``
        is a ``time.monotonic()`` value."""
        patches: list[tuple[str, Patch]] = []
        changes: list[Change] = []
        failed: list[str] = []
        hooks, sync = self._by_stage[ctx.stage], self._sync_by_stage[ctx.stage]
        if only is not None:
            keep = [i for i, h in enumerate(hooks) if h.name in only]
            hooks, sync = tuple(hooks[i] for i in keep), tuple(sync[i] for i in keep)
        i = 0
        while i < len(hooks):
            end = i
            while end < len(hooks) and sync[end]:
                end += 1
            if end - i >= 2:  # a run of sync hooks: one hand-off to a worker thread (runtimeproxy.chain.hookbatch)
                ctx = await self._run_batch(hooks[i:end], ctx, deadline, patches, changes, failed)
                i = end
                continue
            hook = hooks[i]
            i += 1
            ctx = await self._run_alone(hook, ctx, deadline, patches, changes, failed)
        return Outcome(context=ctx, patches=tuple(patches), changes=tuple(changes), failed=tuple(failed))

    async def _run_alone(self, hook: BoundHook, ctx: Context, deadline: float | None,
                         patches: list[tuple[str, Patch]], changes: list[Change], failed: list[str]) -> Context:
        patch = await self._run_one(hook, ctx, deadline, failed)
        if patch is None:
            return ctx
        new_ctx, new_changes = apply_patch(ctx, patch, hook.name)
        if new_changes:
            patches.append((hook.name, patch))
            changes.extend(new_changes)
        return new_ctx

    async def _run_batch(self, run: tuple[BoundHook, ...], ctx: Context, deadline: float | None,
                         patches: list[tuple[str, Patch]], changes: list[Change], failed: list[str]) -> Context:
        batch = Batch(run, ctx, deadline, self._checked, apply_patch, _stops_chain)
        now = time.monotonic()
        steps: list[Step] = []
        pending, timed_out = 0, False
        try:
            future = self._pools.submit(f"stage:{ctx.stage.value}", now + sum(max(batch.budget(k, now), 0.0)
                                        for k in range(len(run))),
                                        functools.partial(contextvars.copy_context().run, batch))
        except HookBusyError:
            pass  # too many batches of this stage stuck: one hand-off per hook, each under its own pool
        else:
            waiting = asyncio.wrap_future(future)
            try:
                while not waiting.done():
                    expired = batch.overdue()
                    if expired is not None:
                        (steps, pending), timed_out = expired, True
                        break
                    await asyncio.wait({waiting}, timeout=max(batch.wait_for(), 0.001))
            except asyncio.CancelledError:
                batch.stop()
                raise
            if not timed_out:
                steps, pending = batch.stop()
                waiting.result()  # only a BaseException of the thread's own (each hook's Exception is a Step)
        return await self._settle(run, batch, ctx, deadline, (steps, pending, timed_out, now), patches, changes,
                                  failed)

    async def _settle(self, run: tuple[BoundHook, ...], batch: Batch, ctx: Context, deadline: float | None,
                      done: tuple[list[Step], int, bool, float], patches: list[tuple[str, Patch]],
                      changes: list[Change], failed: list[str]) -> Context:
        """On the loop, in order: each recorded step's observation, policy and patch; the
        hook the loop stopped waiting for (``done``: steps, pending index, timed out, when
        the batch was submitted) as timed out; the hooks after it one by one."""
        steps, pending, timed_out, now = done
        for step in steps:
            hook = run[step.index]
            self._observe_seconds(hook.name, ctx.stage.value, step.result, step.seconds)
            if step.result == "ok":
                self._succeeded(hook, ctx)
                if step.changes:
                    patches.append((hook.name, cast(Patch, step.patch)))
                    changes.extend(cast(tuple[Change, ...], step.changes))
                ctx = step.ctx
            elif step.result == "timeout":
                failed.append(hook.name)
                self._policy(hook, ctx, f"timed out after {step.budget:.3f}s", deadline=True)
            else:
                failed.append(hook.name)
                exc = cast(Exception, step.error)
                self._policy(hook, ctx, f"{type(exc).__name__}: {exc}", repeat=self._quiet(exc, ctx))
        rest = run[len(steps):]
        if timed_out and pending < len(run):
            hook = run[pending]
            budget = batch.budget(pending, now)
            self._observe_seconds(hook.name, ctx.stage.value, "timeout", max(budget, 0.0))
            failed.append(hook.name)
            self._policy(hook, ctx, f"timed out after {budget:.3f}s", deadline=True)
            rest = run[pending + 1:]
        for hook in rest:  # after a timeout, or when the stage's pool was busy
            ctx = await self._run_alone(hook, ctx, deadline, patches, changes, failed)
        return ctx

    async def run_each(self, ctxs: Sequence[Context], fields: Fields) -> list[Outcome | HookFailed]:
        """One stage (the same for all ``ctxs``, no deadline: a reconcile pass) over many
        objects, each outcome or ``HookFailed`` in order; ``fields``: the log fields of an
        object, bound around its hooks and its policy's lines. When every hook of the stage
        is sync, the objects go to one worker thread together (``hookbatch.Sweep``)."""
        if not ctxs:
            return []
        stage = ctxs[0].stage
        hooks = self._by_stage[stage]
        if any(c.stage is not stage for c in ctxs):
            raise ValueError("run_each: every context must be at the same stage")
        if not hooks or not all(self._sync_by_stage[stage]):
            return [await self._each_alone(ctx, fields) for ctx in ctxs]
        sweep = Sweep(lambda ctx: Batch(hooks, ctx, None, self._checked, apply_patch, _stops_chain), ctxs, fields,
                      hooks[0].timeout)
        now = time.monotonic()
        try:
            future = self._pools.submit(f"stage:{stage.value}", sweep.stuck,
                                        functools.partial(contextvars.copy_context().run, sweep))
        except HookBusyError:
            return [await self._each_alone(ctx, fields) for ctx in ctxs]
        waiting = asyncio.wrap_future(future)
        expired: Expired | None = None
        try:
            while not waiting.done():
                expired = sweep.overdue()
                if expired is not None:
                    break
                await asyncio.wait({waiting}, timeout=max(sweep.wait_for(), 0.001))
        except asyncio.CancelledError:
            sweep.finish()
            raise
        settled = sweep.finish()
        if expired is None:
            waiting.result()  # only a BaseException of the thread's own
        results: list[Outcome | HookFailed] = []
        for ctx, (batch, steps, pending) in zip(ctxs, settled, strict=False):
            results.append(await self._each_settled(hooks, batch, ctx, (steps, pending, False, now), fields))
        if expired is not None:
            results.append(await self._each_settled(hooks, expired.batch, ctxs[expired.index],
                                                    (expired.steps, expired.pending, True, now), fields))
        for ctx in ctxs[len(results):]:  # after a hook past its deadline: one by one
            results.append(await self._each_alone(ctx, fields))
        return results

    async def _each_alone(self, ctx: Context, fields: Fields) -> Outcome | HookFailed:
        with structlog.contextvars.bound_contextvars(**fields(ctx)):
            try:
                return await self.run(ctx, deadline=None)
            except HookFailed as exc:
                return exc

    async def _each_settled(self, hooks: tuple[BoundHook, ...], batch: Batch, ctx: Context,
                            done: tuple[list[Step], int, bool, float], fields: Fields) -> Outcome | HookFailed:
        patches: list[tuple[str, Patch]] = []
        changes: list[Change] = []
        failed: list[str] = []
        with structlog.contextvars.bound_contextvars(**fields(ctx)):
            try:
                end = await self._settle(hooks, batch, ctx, None, done, patches, changes, failed)
            except HookFailed as exc:
                return exc
        return Outcome(context=end, patches=tuple(patches), changes=tuple(changes), failed=tuple(failed))

    def _checked(self, hook: BoundHook, ctx: Context, result: object) -> Patch | None:
        patch = _check_result(hook, ctx, result)
        if patch is not None:
            self._validator.check(ctx, patch)
        return patch

    async def _run_one(self, hook: BoundHook, ctx: Context, deadline: float | None,
                       failed: list[str]) -> Patch | None:
        budget = hook.timeout
        if deadline is not None:
            budget = min(budget, deadline - time.monotonic())
        start = time.perf_counter()
        stage = ctx.stage.value
        try:
            if budget <= 0:
                raise TimeoutError
            call_deadline = time.monotonic() + budget
            method: Callable[[Context], Any] = getattr(hook.impl, ctx.stage.method_name)
            if inspect.iscoroutinefunction(method):
                result = await asyncio.wait_for(self._invoke_async(method, ctx, call_deadline), timeout=budget)
            else:
                # No task of its own (as wait_for would make): a sync hook runs in a context
                # copy in its thread, and a task per hook costs ~20 % of this hand-off.
                async with asyncio.timeout(budget):
                    result = await self._invoke_sync(hook.name, method, ctx, call_deadline)
            patch = self._checked(hook, ctx, result)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            failed.append(hook.name)
            self._failed(hook, ctx, f"timed out after {budget:.3f}s", "timeout", start, deadline=True)
            return None
        except Exception as exc:  # noqa: BLE001 - a plugin may raise anything; its policy decides
            failed.append(hook.name)
            self._failed(hook, ctx, f"{type(exc).__name__}: {exc}", "error", start, repeat=self._quiet(exc, ctx))
            return None
        self._observe(hook.name, stage, "ok", start)
        self._succeeded(hook, ctx)
        return patch

    async def _invoke_async(self, method: Callable[[Context], Any], ctx: Context, deadline: float) -> object:
        HOOK_DEADLINE.set(deadline)  # wait_for runs us in a task of our own: a context copy
        return await method(ctx)

    async def _invoke_sync(self, hook: str, method: Callable[[Context], Any], ctx: Context, deadline: float) -> object:
        # Sync hooks usually write cgroupfs: keep that off the loop, with our contextvars
        # and the call's deadline, which every host write checks.
        call = functools.partial(contextvars.copy_context().run, _call_until, hook, method, ctx, deadline)
        return await asyncio.wrap_future(self._pools.submit(hook, deadline, call))

    def _failed(
        self, hook: BoundHook, ctx: Context, reason: str, result: HookResult, start: float, *,
        deadline: bool = False, repeat: bool = False,
    ) -> None:
        self._observe(hook.name, ctx.stage.value, result, start)
        self._policy(hook, ctx, reason, deadline=deadline, repeat=repeat)

    @staticmethod
    def _quiet(exc: Exception, ctx: Context) -> bool:
        """A failure logged before, or a reconciled object torn down meanwhile."""
        return is_repeat(exc) or (isinstance(exc, TargetGoneError) and ctx.stage in _RECONCILE_STAGES)

    def _policy(self, hook: BoundHook, ctx: Context, reason: str, *, deadline: bool = False,
                repeat: bool = False) -> None:
        """A failed hook: counted, then its policy (Fail raises ``HookFailed``, Ignore logs)."""
        if self._observer is not None:
            self._observer.hook_failed(hook.name, ctx.stage.value, hook.policy.value)  # every failure counted
        # The same object failing the same way again (every reconcile pass) is logged once:
        # a repeat only below warning; a new cause again, with the old one's repeat count.
        verdict = Verdict(log=False, repeats=0)  # a quiet failure (logged elsewhere, or gone): not remembered
        if not repeat:
            verdict = self._repeats.failed(_key(hook, ctx), "timeout" if deadline else reason)
            repeat = not verdict.log
        if hook.policy is FailurePolicy.FAIL:
            failed = HookFailed(hook.name, ctx.stage, reason, deadline=deadline)
            failed.repeat = repeat
            raise failed
        # A repeat (a host write failing the same way again) was logged by the executor.
        emit = log.debug if repeat else log.warning
        extra = {"repeats": verdict.repeats} if repeat else {"previous_cause_repeats": verdict.repeats} \
            if verdict.repeats else {}
        emit("hook_failed", hook=hook.name, stage=ctx.stage.value, policy="Ignore", reason=reason, **extra)

    def _succeeded(self, hook: BoundHook, ctx: Context) -> None:
        """The hook worked for this object: a failure logged before is over (one line)."""
        if not self._repeats.failing():
            return  # the common case, without building the key
        repeats = self._repeats.cleared(_key(hook, ctx))
        if repeats is not None:
            log.info("hook_recovered", hook=hook.name, stage=ctx.stage.value, object=_object(ctx), repeats=repeats)

    def _observe(self, hook: str, stage: str, result: HookResult, start: float) -> None:
        self._observe_seconds(hook, stage, result, time.perf_counter() - start)

    def _observe_seconds(self, hook: str, stage: str, result: HookResult, seconds: float) -> None:
        if self._observer is not None:
            self._observer.hook_observed(hook, stage, result, seconds)


def _key(hook: BoundHook, ctx: Context) -> tuple[str, str, str]:
    """What repeats: one hook at one stage for one object (a reconcile pass repeats the
    same stage; another stage of the same object, e.g. its PostStop, is news)."""
    return hook.name, ctx.stage.value, _object(ctx)


def _object(ctx: Context) -> str:
    """What a hook call is about: the container, else the pod."""
    return f"container:{ctx.container.id}" if isinstance(ctx, ContainerContext) else f"pod:{ctx.pod.meta.uid}"


def _stops_chain(hook: BoundHook) -> bool:
    return hook.policy is FailurePolicy.FAIL


def _call_until(hook: str, method: Callable[[Context], Any], ctx: Context, deadline: float) -> object:
    """Run a sync hook in its worker thread (inside a context copy) under its deadline."""
    if time.monotonic() >= deadline:  # waited in the queue past it: the caller has moved on
        raise TimeoutError
    HOOK_DEADLINE.set(deadline)
    structlog.contextvars.bind_contextvars(hook=hook)
    return method(ctx)


def _check_result(hook: BoundHook, ctx: Context, result: object) -> Patch | None:
    if result is None:
        return None
    expected: type = PodPatch if isinstance(ctx, PodContext) else ContainerPatch
    if not isinstance(result, expected):
        raise TypeError(f"returned {type(result).__name__}, expected {expected.__name__} or None")
    patch = cast(Patch, result)
    if not ctx.stage.patchable and patch.changes_request():
        # Post and id-only stages cannot change the request; only host writes may be reported there.
        raise TypeError(f"returned request changes at {ctx.stage.value}, which cannot be patched")
    return patch


def apply_patch(ctx: Context, patch: Patch, hook: str) -> tuple[Context, list[Change]]:
    """The context as the next hook should see it, and the recorded changes."""
    rec = _Recorder(hook, ctx.stage.value, patch.reason)
    for write in patch.writes:
        rec.changes.append(Change(hook, ctx.stage.value, HOST_TARGET + write.target, write.old, write.new,
                                  write.reason or patch.reason))
    if isinstance(ctx, PodContext) and isinstance(patch, PodPatch):
        pod = ctx.pod
        pod = replace(
            pod,
            labels=rec.merge("pod.labels", pod.labels, patch.labels),
            annotations=rec.merge("pod.annotations", pod.annotations, patch.annotations),
            cgroup_parent=rec.value("pod.cgroup_parent", pod.cgroup_parent, patch.cgroup_parent),
            resources=rec.resources("pod.resources", pod.resources, patch.resources),
            overhead=rec.resources("pod.overhead", pod.overhead, patch.overhead),
        )
        return replace(ctx, pod=pod), rec.changes
    if isinstance(ctx, ContainerContext) and isinstance(patch, ContainerPatch):
        c = ctx.container
        c = replace(
            c,
            annotations=rec.merge("container.annotations", c.annotations, patch.annotations),
            envs=rec.merge("container.envs", c.envs, patch.envs),
            resources=rec.resources("container.resources", c.resources, patch.resources),
        )
        pod = replace(
            ctx.pod, cgroup_parent=rec.value("pod.cgroup_parent", ctx.pod.cgroup_parent, patch.pod_cgroup_parent)
        )
        return replace(ctx, container=c, pod=pod), rec.changes
    raise TypeError(f"{type(patch).__name__} does not apply to {type(ctx).__name__}")


class _Recorder:
    def __init__(self, hook: str, stage: str, reason: str) -> None:
        self.hook, self.stage, self.reason = hook, stage, reason
        self.changes: list[Change] = []

    def _note(self, target: str, old: object, new: object) -> None:
        self.changes.append(Change(self.hook, self.stage, target, str(old), str(new), self.reason))

    def value(self, target: str, old: Any, new: Any) -> Any:
        if new is None or new == old:
            return old
        self._note(target, old, new)
        return new

    def merge(self, target: str, old: Mapping[str, str], new: Mapping[str, str] | None) -> Mapping[str, str]:
        if not new:
            return old
        merged = dict(old)
        for key, value in new.items():
            if merged.get(key) != value:
                self._note(f"{target}[{key}]", merged.get(key, ""), value)
                merged[key] = value
        return frozen_map(merged) if merged != dict(old) else old

    def resources(self, target: str, old: Resources, patch: ResourcesPatch | None) -> Resources:
        if patch is None:
            return old
        updates: dict[str, Any] = {}
        for f in fields(ResourcesPatch):
            new = getattr(patch, f.name)
            if f.name == "unified":
                updates["unified"] = self.merge(f"{target}.unified", old.unified, new)
            else:
                updates[f.name] = self.value(f"{target}.{f.name}", getattr(old, f.name), new)
        return replace(old, **updates)
