"""A reconcile pass hands its objects to one worker thread (``HookChain.run_each``,
``hookbatch.Sweep``), and each object keeps what it had with one hand-off of its own:
its outcome, its hooks' timeouts and policies, its log fields."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import structlog.contextvars
import structlog.testing

from runtimeproxy.chain.hookchain import BoundHook, HookChain, HookFailed, Outcome, implemented_stages
from runtimeproxy.config.settings import FailurePolicy
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerInfo,
    ContainerMeta,
    ContainerPatch,
    Context,
    HostWrite,
    PodInfo,
    PodMeta,
    Stage,
)
from tests.unit.test_hookbatch import Busy, Counting

#: A stuck hook's sleep; a pass must go on long before it ends.
SLEEP = 3.0


def _ctx(n: int) -> ContainerContext:
    pod = PodInfo(meta=PodMeta(name=f"web-{n}", namespace="prod", uid=f"uid-{n}"), id=f"sb-{n}")
    return ContainerContext(Stage.RECONCILE_CONTAINER, pod, ContainerInfo(id=f"c-{n}", meta=ContainerMeta(name="app")))


def _fields(ctx: Context) -> dict[str, str]:
    return {"pod_name": ctx.pod.meta.name}


class Keeper:
    """Reports a write for odd objects; notes its thread and the log fields bound when called."""

    def __init__(self, name: str, *, stuck_on: str = "", fail_on: str = "") -> None:
        self.name, self.stuck_on, self.fail_on = name, stuck_on, fail_on
        self.threads: list[int] = []
        self.bound: list[dict[str, Any]] = []

    def reconcile_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        self.threads.append(threading.get_ident())
        self.bound.append(dict(structlog.contextvars.get_contextvars()))
        if ctx.pod.meta.name == self.stuck_on:
            time.sleep(SLEEP)
        if ctx.pod.meta.name == self.fail_on:
            raise RuntimeError("refused")
        if int(ctx.pod.meta.name.rsplit("-", 1)[1]) % 2:
            return ContainerPatch(writes=(HostWrite(f"/x/{ctx.container.id}", "1", "2", self.name),))
        return None


class AsyncKeeper:
    name = "async"

    async def reconcile_container(self, ctx: ContainerContext) -> None:
        return None


def bind(impl: object, name: str, *, policy: FailurePolicy = FailurePolicy.IGNORE, timeout: float = 10.0
         ) -> BoundHook:
    return BoundHook(name, impl, implemented_stages(impl), policy, timeout)


@pytest.fixture
def pools() -> Iterator[Counting]:
    pools = Counting()
    yield pools
    pools.shutdown()


def _summary(result: Outcome | HookFailed) -> tuple[str, ...]:
    if isinstance(result, HookFailed):
        return ("failed", result.hook, result.reason)
    return ("ok", *(f"{c.hook}:{c.target}" for c in result.changes), *(f"failed:{h}" for h in result.failed))


@pytest.mark.asyncio
async def test_a_pass_is_one_hand_off_with_the_outcomes_of_one_call_per_object(pools: Counting) -> None:
    a, b = Keeper("a"), Keeper("b")
    chain = HookChain([bind(a, "a"), bind(b, "b")], pools=pools)
    ctxs = [_ctx(n) for n in range(6)]
    swept = await chain.run_each(ctxs, _fields)
    assert pools.keys == ["stage:ReconcileContainer"]  # one hand-off for six objects
    assert len(set(a.threads + b.threads)) == 1
    one_by_one = [await chain.run(ctx, deadline=None) for ctx in ctxs]
    assert [_summary(r) for r in swept] == [_summary(r) for r in one_by_one]
    assert [_summary(r) for r in swept][:2] == [("ok",), ("ok", "a:host:/x/c-1", "b:host:/x/c-1")]
    # Each object's hooks ran with its own log fields, none left over from the one before.
    assert [d.get("pod_name") for d in a.bound[:6]] == [f"web-{n}" for n in range(6)]
    assert all(d.get("hook") in (None, "a") for d in a.bound)


@pytest.mark.asyncio
async def test_a_stuck_hook_stops_the_sweep_and_the_objects_after_it_run_one_by_one(pools: Counting) -> None:
    a, b = Keeper("a", stuck_on="web-2"), Keeper("b")
    chain = HookChain([bind(a, "a", timeout=0.2), bind(b, "b")], pools=pools)
    ctxs = [_ctx(n) for n in range(5)]
    start = time.monotonic()
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        results = await chain.run_each(ctxs, _fields)
    assert time.monotonic() - start < SLEEP / 2  # the pass did not wait for the stuck hook
    assert [_summary(r) for r in results] == [
        ("ok",), ("ok", "a:host:/x/c-1", "b:host:/x/c-1"),
        ("ok", "failed:a"),  # a timed out (Ignore); b then ran alone for it and found nothing to write
        ("ok", "a:host:/x/c-3", "b:host:/x/c-3"), ("ok",)]
    failed = [e for e in logs if e["event"] == "hook_failed"]
    assert [(e["hook"], e["reason"], e["pod_name"]) for e in failed] == [("a", "timed out after 0.200s", "web-2")]
    # web-3 and web-4 each had their own hand-offs, after the sweep's; the stuck call counts as overdue.
    assert pools.keys[0] == "stage:ReconcileContainer" and len(pools.keys) > 1
    assert pools.overdue("stage:ReconcileContainer") == 1


@pytest.mark.asyncio
async def test_a_fail_policy_failure_fails_that_object_only(pools: Counting) -> None:
    a = Keeper("a", fail_on="web-1")
    chain = HookChain([bind(a, "a", policy=FailurePolicy.FAIL)], pools=pools)
    results = await chain.run_each([_ctx(n) for n in range(3)], _fields)
    assert [_summary(r) for r in results] == [("ok",), ("failed", "a", "RuntimeError: refused"), ("ok",)]
    assert pools.keys == ["stage:ReconcileContainer"]


@pytest.mark.asyncio
async def test_an_async_hook_or_a_busy_pool_means_one_call_per_object(pools: Counting) -> None:
    a = Keeper("a")
    chain = HookChain([bind(a, "a"), bind(AsyncKeeper(), "async")], pools=pools)
    results = await chain.run_each([_ctx(n) for n in range(3)], _fields)
    assert pools.keys == ["a", "a", "a"]  # each object's sync hook on its own hand-off
    assert [_summary(r) for r in results] == [("ok",), ("ok", "a:host:/x/c-1"), ("ok",)]
    busy = Busy()
    try:
        chain = HookChain([bind(Keeper("a"), "a"), bind(Keeper("b"), "b")], pools=busy)
        results = await chain.run_each([_ctx(n) for n in range(2)], _fields)
        assert busy.keys[0] == "stage:ReconcileContainer" and busy.keys.count("a") == 2
        assert [_summary(r) for r in results] == [("ok",), ("ok", "a:host:/x/c-1", "b:host:/x/c-1")]
    finally:
        busy.shutdown()


@pytest.mark.asyncio
async def test_contexts_of_different_stages_are_refused(pools: Counting) -> None:
    chain = HookChain([bind(Keeper("a"), "a")], pools=pools)
    other = ContainerContext(Stage.POST_START_CONTAINER, _ctx(1).pod, _ctx(1).container)
    with pytest.raises(ValueError, match="same stage"):
        await chain.run_each([_ctx(0), other], _fields)
    assert await chain.run_each([], _fields) == []
