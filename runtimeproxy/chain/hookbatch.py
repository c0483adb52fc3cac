"""Consecutive sync hooks of one stage, run in one worker thread: one hand-off, not one per hook.

Each sync hook used to cost a hand-off to its worker thread and back to the loop: two
wake-ups that took 0.12-0.3 ms under a pod start's load while the hooks' own work on a
PreCreateContainer was 28 + 26 + 0 µs (docs/benchmarks.md, session 13). A run of sync
hooks now goes to the worker thread once; the thread calls them in order, checks and
validates each result and applies each patch for the next hook, exactly as the chain
does on the loop.

What each hook had alone still holds:
- its own deadline (``min(timeout, the call's deadline)`` from when it starts):
  ``HOOK_DEADLINE`` is set before each call, so past it the hook writes nothing; a hook
  that returns late counts as timed out (its patch dropped);
- the loop waits for the hook running *now* only until that hook's deadline: then it
  stops the batch (no later hook starts in that thread), reports the timeout under the
  hook's policy, and the chain runs the hooks after it one by one;
- its failure policy, observation (``hook_observed``) and log line, applied on the loop
  in order from the recorded ``Step`` outcomes (``HookChain.run``).
The thread is one of the stage's pool (``HookPools`` key ``stage:<Stage>``): a batch stuck
in a hook holds that pool's threads, not another hook's; with too many stuck, the chain
falls back to one hand-off per hook (each under its own pool).

A ``Sweep`` runs the same sync hooks over many contexts, one ``Batch`` after another in
one worker thread: a reconcile pass is one hand-off per stage, not one per object (issue
29: at 110 pods a pass that re-checks every object cost ~0.3 ms of CPU per object in
hand-offs and loop steps, more than the hooks' own checks). Each object keeps all of the
above; the loop watches the batch running now, and one past its deadline stops the sweep
(the objects after it run one by one, as without a sweep).
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import structlog

from runtimeproxy.hookapi import Context, Patch
from runtimeproxy.hostwrites import HOOK_DEADLINE

StepResult = Literal["ok", "error", "timeout"]


@dataclass(frozen=True, slots=True)
class Step:
    """One hook's outcome in a batch; ``ctx`` is what the next hook saw."""

    index: int
    result: StepResult
    patch: Patch | None
    error: Exception | None
    seconds: float
    budget: float
    ctx: Context
    #: What the patch changed (``chain.Change`` records).
    changes: tuple[object, ...] = ()


class HookSpec(Protocol):
    """What a batch needs of a bound hook (``chain.BoundHook`` has it)."""

    @property
    def name(self) -> str: ...
    @property
    def impl(self) -> object: ...
    @property
    def timeout(self) -> float: ...


#: (hook, context, raw result) -> the checked and validated patch (raises on a bad one).
Check = Callable[[Any, Context, object], "Patch | None"]
#: (context, patch, hook name) -> the context the next hook sees, and what changed.
Apply = Callable[[Context, Patch, str], "tuple[Context, Sequence[object]]"]
#: The hook's failure stops the batch (its policy is Fail).
Stops = Callable[[Any], bool]


class Batch:
    """Runs in the worker thread (``__call__``); the loop reads its progress under a lock."""

    def __init__(self, hooks: Sequence[HookSpec], ctx: Context, deadline: float | None,
                 check: Check, apply: Apply, stops: Stops) -> None:
        self.hooks = tuple(hooks)
        self._ctx = ctx
        self._deadline = deadline
        self._check, self._apply, self._stops = check, apply, stops
        self._lock = threading.Lock()
        self._steps: list[Step] = []
        #: (index, that hook's own deadline) while a hook runs.
        self._running: tuple[int, float] | None = None
        self._stopped = False
        self._queued = time.monotonic()

    def budget(self, index: int, now: float) -> float:
        timeout: float = self.hooks[index].timeout
        return timeout if self._deadline is None else min(timeout, self._deadline - now)

    def __call__(self) -> None:
        ctx = self._ctx
        method_name = ctx.stage.method_name
        for index, hook in enumerate(self.hooks):
            now = time.monotonic()
            # The first hook's budget runs from the submit, as a lone hook's does (time in the queue counts).
            budget = self.budget(index, self._queued if index == 0 else now)
            start = time.perf_counter()
            hook_deadline = (self._queued if index == 0 else now) + budget
            if not self._start(index, hook_deadline):
                return
            step = self._one(index, hook, ctx, method_name, budget, hook_deadline, start)
            if not self._record(step):  # the loop gave up waiting for this hook: its outcome is not ours
                return
            if step.result != "ok" and self._stops(hook):
                return
            ctx = step.ctx

    def _start(self, index: int, hook_deadline: float) -> bool:
        with self._lock:
            if self._stopped:
                return False
            self._running = (index, hook_deadline)
            return True

    def _record(self, step: Step) -> bool:
        with self._lock:
            if self._stopped:
                return False
            self._steps.append(step)
            self._running = None
            return True

    def _one(self, index: int, hook: HookSpec, ctx: Context, method_name: str, budget: float,
             hook_deadline: float, start: float) -> Step:
        if budget <= 0 or time.monotonic() >= hook_deadline:
            return Step(index, "timeout", None, None, time.perf_counter() - start, budget, ctx)
        HOOK_DEADLINE.set(hook_deadline)
        structlog.contextvars.bind_contextvars(hook=hook.name)
        try:
            patch = self._check(hook, ctx, getattr(hook.impl, method_name)(ctx))
        except Exception as exc:  # noqa: BLE001 - a plugin may raise anything; its policy decides (on the loop)
            return Step(index, "error", None, exc, time.perf_counter() - start, budget, ctx)
        seconds = time.perf_counter() - start
        if time.monotonic() > hook_deadline:
            return Step(index, "timeout", None, None, seconds, budget, ctx)
        if patch is None:
            return Step(index, "ok", None, None, seconds, budget, ctx)
        after, changes = self._apply(ctx, patch, hook.name)
        return Step(index, "ok", patch, None, seconds, budget, after, tuple(changes))

    def wait_for(self) -> float:
        """Seconds the loop may still wait for the hook running now (or about to start)."""
        now = time.monotonic()
        with self._lock:
            if self._running is not None:
                return self._running[1] - now
            index = len(self._steps)
        if index >= len(self.hooks):
            return 0.05  # all recorded: the thread is returning
        return self.budget(index, now) if index else self._queued + self.budget(0, self._queued) - now

    def overdue(self) -> tuple[list[Step], int] | None:
        """If the hook the loop waits for is past its deadline: stop the batch (atomically
        with the thread's recording, so a hook that just finished is not called late) and
        return the outcomes so far and that hook's index; else None."""
        now = time.monotonic()
        with self._lock:
            if self._running is not None:
                index, until = self._running
            else:
                index = len(self._steps)
                if index >= len(self.hooks) or index > 0:
                    return None  # all done, or the next hook is starting: it sets its own deadline
                until = self._queued + self.budget(0, self._queued)
            if until > now:
                return None
            self._stopped = True
            return list(self._steps), index

    def stop(self) -> tuple[list[Step], int]:
        """No later hook starts: the outcomes recorded so far, and the index of the hook
        that has none (the one running or about to start; ``len(hooks)`` when all ran)."""
        with self._lock:
            self._stopped = True
            pending = self._running[0] if self._running is not None else len(self._steps)
            return list(self._steps), pending


#: context -> the log fields bound while its hooks run (the object they are about).
Fields = Callable[[Context], Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class Expired:
    """The batch the loop stopped because its running hook passed its deadline."""

    index: int  # of the context in the sweep
    batch: Batch
    steps: list[Step]
    pending: int


class Sweep:
    """Batches of the same hooks over ``ctxs``, in order, in one worker thread (``__call__``)."""

    def __init__(self, make: Callable[[Context], Batch], ctxs: Sequence[Context], fields: Fields,
                 first_timeout: float) -> None:
        self._make, self._ctxs, self._fields = make, tuple(ctxs), fields
        self._first_timeout = first_timeout
        self._lock = threading.Lock()
        self._done: list[Batch] = []
        self._current: Batch | None = None
        self._stopped = False
        #: The loop stopped the sweep at a hook past its deadline, which still holds the thread.
        self._stuck = False
        self._queued = time.monotonic()

    def __call__(self) -> None:
        for ctx in self._ctxs:
            batch = self._make(ctx)
            with self._lock:
                if self._stopped:
                    return
                self._current = batch
            # A context copy per object: its log fields (and the hook name each step binds)
            # do not leak into the next object's lines.
            contextvars.copy_context().run(self._run, ctx, batch)
            if not self._record(batch):
                return

    def _record(self, batch: Batch) -> bool:
        """Keep a finished batch's outcomes for the loop, unless the loop took it over (``overdue``)."""
        with self._lock:
            self._current = None
            if self._stopped:
                return False
            self._done.append(batch)
            return True

    def _run(self, ctx: Context, batch: Batch) -> None:
        structlog.contextvars.bind_contextvars(**self._fields(ctx))
        batch()

    def wait_for(self) -> float:
        """Seconds the loop may wait before checking ``overdue`` again."""
        with self._lock:
            batch = self._current
        if batch is not None:
            return batch.wait_for()
        return self._first_timeout  # between objects, or not started: a new batch's first hook has this

    def overdue(self) -> Expired | None:
        """If the hook running now is past its deadline (or the sweep waited in the queue
        past the first hook's budget): stop the sweep and return that batch's outcomes."""
        with self._lock:
            if self._stopped:
                return None
            batch = self._current
            if batch is None:
                if self._done or time.monotonic() < self._queued + self._first_timeout:
                    return None
                batch = self._make(self._ctxs[0])  # never started: its first hook timed out in the queue
                steps: list[Step] = []
                pending = 0
            else:
                expired = batch.overdue()
                if expired is None:
                    return None
                steps, pending = expired
            self._stopped = self._stuck = True
            return Expired(len(self._done), batch, steps, pending)

    def stuck(self) -> bool:
        """For ``HookPools``: this call holds its thread past a deadline."""
        with self._lock:
            return self._stuck

    def finish(self) -> list[tuple[Batch, list[Step], int]]:
        """No later object starts: each completed batch with its outcomes and pending index."""
        with self._lock:
            self._stopped = True
            done = list(self._done)
        return [(batch, *batch.stop()) for batch in done]
