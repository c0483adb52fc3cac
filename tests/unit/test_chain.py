"""HookChain on its own: order, what each hook sees, policies, timeouts, the
caller's deadline, threads and what the outcome records."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import structlog.testing

from runtimeproxy.chain.hookchain import BoundHook, Change, HookChain, HookFailed, HookPools, implemented_stages
from runtimeproxy.config.settings import FailurePolicy
from runtimeproxy.hookapi import (
    CallResult,
    ContainerContext,
    ContainerInfo,
    ContainerMeta,
    ContainerPatch,
    HookError,
    PodContext,
    PodInfo,
    PodMeta,
    PodPatch,
    Resources,
    ResourcesPatch,
    Stage,
    TargetGoneError,
)

POD = PodInfo(meta=PodMeta(name="web-0", namespace="prod", uid="uid-1"), id="sb-1", labels={"app": "web"},
              cgroup_parent="/kubepods/burstable/poduid-1")
CONTAINER = ContainerInfo(meta=ContainerMeta(name="app"), resources=Resources(cpu_shares=1024, cpu_quota=100000),
                          annotations={"a": "1"})
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


def create_ctx() -> ContainerContext:
    return ContainerContext(Stage.PRE_CREATE_CONTAINER, POD, CONTAINER)


class Observer:
    def __init__(self) -> None:
        self.observed: list[tuple[str, str, str]] = []
        self.failed: list[tuple[str, str, str]] = []
        self.seconds: list[float] = []

    def hook_observed(self, hook: str, stage: str, result: str, seconds: float) -> None:
        self.observed.append((hook, stage, result))
        self.seconds.append(seconds)

    def hook_failed(self, hook: str, stage: str, policy: str) -> None:
        self.failed.append((hook, stage, policy))


@pytest.fixture
def pools() -> Iterator[HookPools]:
    pools = HookPools(workers=2, thread_name_prefix="test-hooks")
    yield pools
    pools.shutdown()


def bind(name: str, impl: object, *, policy: FailurePolicy = FailurePolicy.IGNORE, timeout: float = 10.0,
         stages: frozenset[Stage] | None = None) -> BoundHook:
    # A generous default: a sync hook waits for an executor thread, and a hook that is
    # not about timeouts must not time out on a loaded machine (timeout tests pass one).
    return BoundHook(name, impl, stages if stages is not None else implemented_stages(impl), policy, timeout)


class Fn:
    """A hook whose pre_create_container is the given function (sync or async)."""

    def __init__(self, fn: Any) -> None:
        self.pre_create_container = fn


class Recording:
    """Records the contexts it saw; returns a fixed patch."""

    def __init__(self, patch: ContainerPatch | None = None) -> None:
        self.patch = patch
        self.seen: list[ContainerContext] = []

    def pre_create_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        self.seen.append(ctx)
        return self.patch


# --- order and what hooks see ---------------------------------------------------------


def test_for_stage_keeps_config_order_and_filters(pools: HookPools) -> None:
    class PodAndContainer:
        def pre_run_pod_sandbox(self, ctx: PodContext) -> None: ...
        def pre_create_container(self, ctx: ContainerContext) -> None: ...

    hooks = [
        bind("z", PodAndContainer()),
        bind("a", Recording()),
        bind("m", PodAndContainer(), stages=frozenset({Stage.PRE_RUN_POD_SANDBOX})),
    ]
    chain = HookChain(hooks, pools=pools)
    assert [h.name for h in chain.for_stage(Stage.PRE_CREATE_CONTAINER)] == ["z", "a"]
    assert [h.name for h in chain.for_stage(Stage.PRE_RUN_POD_SANDBOX)] == ["z", "m"]
    assert chain.for_stage(Stage.POST_STOP_CONTAINER) == ()
    assert implemented_stages(PodAndContainer()) == {Stage.PRE_RUN_POD_SANDBOX, Stage.PRE_CREATE_CONTAINER}


@pytest.mark.asyncio
async def test_later_hooks_see_earlier_patches_and_changes_are_recorded(pools: HookPools) -> None:
    def shares(ctx: ContainerContext) -> ContainerPatch:
        return ContainerPatch(resources=ResourcesPatch(cpu_shares=512), reason="be small")

    async def quota_from_shares(ctx: ContainerContext) -> ContainerPatch:
        return ContainerPatch(resources=ResourcesPatch(cpu_quota=ctx.container.resources.cpu_shares * 100),
                              reason="quota follows shares")

    last = Recording(ContainerPatch(annotations={"b": "2"}, pod_cgroup_parent="/kubepods/besteffort/poduid-1"))
    chain = HookChain([bind("shares", Fn(shares)), bind("quota", Fn(quota_from_shares)), bind("last", last)],
                      pools=pools)

    outcome = await chain.run(create_ctx(), deadline=None)

    [seen] = last.seen
    assert seen.container.resources == Resources(cpu_shares=512, cpu_quota=51200)
    assert isinstance(outcome.context, ContainerContext)
    assert outcome.context.container.resources == Resources(cpu_shares=512, cpu_quota=51200)
    assert outcome.context.container.annotations == {"a": "1", "b": "2"}
    assert outcome.context.pod.cgroup_parent == "/kubepods/besteffort/poduid-1"
    assert [name for name, _ in outcome.patches] == ["shares", "quota", "last"]
    stage = "PreCreateContainer"
    assert outcome.changes == (
        Change("shares", stage, "container.resources.cpu_shares", "1024", "512", "be small"),
        Change("quota", stage, "container.resources.cpu_quota", "100000", "51200", "quota follows shares"),
        Change("last", stage, "container.annotations[b]", "", "2", ""),
        Change("last", stage, "pod.cgroup_parent", "/kubepods/burstable/poduid-1", "/kubepods/besteffort/poduid-1",
               ""),
    )


@pytest.mark.asyncio
async def test_noop_and_none_results_record_nothing(pools: HookPools) -> None:
    same = ContainerPatch(resources=ResourcesPatch(cpu_shares=1024), annotations={"a": "1"})
    chain = HookChain([bind("none", Recording(None)), bind("same", Recording(same))], pools=pools)
    ctx = create_ctx()
    outcome = await chain.run(ctx, deadline=None)
    assert outcome.patches == ()
    assert outcome.changes == ()
    assert outcome.context == ctx


@pytest.mark.asyncio
async def test_pod_stage_chain(pools: HookPools) -> None:
    class Labeler:
        def __init__(self, value: str) -> None:
            self.value = value

        def pre_run_pod_sandbox(self, ctx: PodContext) -> PodPatch:
            return PodPatch(labels={"seen": ctx.pod.labels.get("seen", "") + self.value})

    chain = HookChain([bind("x", Labeler("x")), bind("y", Labeler("y"))], pools=pools)
    outcome = await chain.run(PodContext(Stage.PRE_RUN_POD_SANDBOX, POD), deadline=None)
    assert isinstance(outcome.context, PodContext)
    assert outcome.context.pod.labels == {"app": "web", "seen": "xy"}
    assert [(c.hook, c.old, c.new) for c in outcome.changes] == [("x", "", "x"), ("y", "x", "xy")]


# --- policies -------------------------------------------------------------------------


def boom(ctx: ContainerContext) -> None:
    raise HookError("cgroup write refused")


@pytest.mark.asyncio
async def test_fail_policy_stops_the_chain(pools: HookPools) -> None:
    after = Recording()
    observer = Observer()
    chain = HookChain([bind("boom", Fn(boom), policy=FailurePolicy.FAIL), bind("after", after)],
                      pools=pools, observer=observer)
    with pytest.raises(HookFailed) as err:
        await chain.run(create_ctx(), deadline=None)
    assert err.value.hook == "boom"
    assert err.value.stage is Stage.PRE_CREATE_CONTAINER
    assert err.value.reason == "HookError: cgroup write refused"
    assert err.value.deadline is False
    assert "'boom'" in str(err.value) and "PreCreateContainer" in str(err.value)
    assert after.seen == []
    assert observer.observed == [("boom", "PreCreateContainer", "error")]
    assert observer.failed == [("boom", "PreCreateContainer", "Fail")]


@pytest.mark.asyncio
async def test_ignore_policy_goes_on(pools: HookPools) -> None:
    before = Recording(ContainerPatch(annotations={"before": "y"}))
    after = Recording(ContainerPatch(annotations={"after": "y"}))
    observer = Observer()
    chain = HookChain([bind("before", before), bind("boom", Fn(boom)), bind("after", after)],
                      pools=pools, observer=observer)
    outcome = await chain.run(create_ctx(), deadline=None)
    assert after.seen[0].container.annotations == {"a": "1", "before": "y"}
    assert [name for name, _ in outcome.patches] == ["before", "after"]
    assert observer.observed == [
        ("before", "PreCreateContainer", "ok"), ("boom", "PreCreateContainer", "error"),
        ("after", "PreCreateContainer", "ok"),
    ]
    assert observer.failed == [("boom", "PreCreateContainer", "Ignore")]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("result", "message"),
    [
        ("not a patch", "returned str, expected ContainerPatch or None"),
        (PodPatch(labels={"x": "y"}), "returned PodPatch, expected ContainerPatch or None"),
    ],
)
async def test_wrong_result_type_is_a_hook_failure(pools: HookPools, result: object, message: str) -> None:
    chain = HookChain([bind("bad", Fn(lambda ctx: result), policy=FailurePolicy.FAIL)], pools=pools)
    with pytest.raises(HookFailed) as err:
        await chain.run(create_ctx(), deadline=None)
    assert message in err.value.reason


@pytest.mark.asyncio
async def test_patch_at_an_unpatchable_stage_is_a_hook_failure(pools: HookPools) -> None:
    class Starter:
        def pre_start_container(self, ctx: ContainerContext) -> ContainerPatch:
            return ContainerPatch(annotations={"x": "y"})

    chain = HookChain([bind("starter", Starter(), policy=FailurePolicy.FAIL)], pools=pools)
    with pytest.raises(HookFailed) as err:
        await chain.run(ContainerContext(Stage.PRE_START_CONTAINER, POD, CONTAINER), deadline=None)
    assert "cannot be patched" in err.value.reason
    ignoring = HookChain([bind("starter", Starter())], pools=pools)
    outcome = await ignoring.run(ContainerContext(Stage.PRE_START_CONTAINER, POD, CONTAINER), deadline=None)
    assert outcome.patches == ()


@pytest.mark.asyncio
async def test_post_stage_hooks_get_the_result(pools: HookPools) -> None:
    seen: list[CallResult | None] = []

    class Post:
        async def post_create_container(self, ctx: ContainerContext) -> None:
            seen.append(ctx.result)

    chain = HookChain([bind("post", Post())], pools=pools)
    failed = CallResult(ok=False, code="UNAVAILABLE", message="gone")
    await chain.run(ContainerContext(Stage.POST_CREATE_CONTAINER, POD, CONTAINER, result=failed), deadline=None)
    assert seen == [failed]


# --- time -----------------------------------------------------------------------------


SLEEPY_SECONDS = 5.0
#: A chain that honours the timeout returns in milliseconds; one that waits for the hook
#: takes at least SLEEPY_SECONDS. The bound sits between the two, seconds above the first,
#: so a stall on a loaded CI machine cannot fail a correct chain (speed is for benchmarks).
RETURNS_WITHIN = 4.0


async def sleepy(ctx: ContainerContext) -> ContainerPatch:
    await asyncio.sleep(SLEEPY_SECONDS)
    return ContainerPatch(annotations={"slept": "yes"})


@pytest.mark.asyncio
async def test_hook_timeout(pools: HookPools) -> None:
    observer = Observer()
    chain = HookChain([bind("sleepy", Fn(sleepy), policy=FailurePolicy.FAIL, timeout=0.05)],
                      pools=pools, observer=observer)
    start = time.monotonic()
    with pytest.raises(HookFailed) as err:
        await chain.run(create_ctx(), deadline=None)
    assert time.monotonic() - start < RETURNS_WITHIN
    assert err.value.reason == "timed out after 0.050s"
    assert err.value.deadline is True
    assert observer.observed == [("sleepy", "PreCreateContainer", "timeout")]
    assert observer.seconds[0] < RETURNS_WITHIN


@pytest.mark.asyncio
async def test_hook_timeout_ignored(pools: HookPools) -> None:
    after = Recording(ContainerPatch(annotations={"after": "y"}))
    chain = HookChain([bind("sleepy", Fn(sleepy), timeout=0.05), bind("after", after)], pools=pools)
    start = time.monotonic()
    outcome = await chain.run(create_ctx(), deadline=None)
    assert time.monotonic() - start < RETURNS_WITHIN
    assert [name for name, _ in outcome.patches] == ["after"]


@pytest.mark.asyncio
async def test_callers_deadline_caps_the_hook_timeout(pools: HookPools) -> None:
    chain = HookChain([bind("sleepy", Fn(sleepy), policy=FailurePolicy.FAIL, timeout=30)], pools=pools)
    start = time.monotonic()
    with pytest.raises(HookFailed) as err:
        await chain.run(create_ctx(), deadline=time.monotonic() + 0.1)
    assert time.monotonic() - start < RETURNS_WITHIN
    assert err.value.deadline is True
    assert "timed out" in err.value.reason


@pytest.mark.asyncio
async def test_expired_deadline_does_not_call_the_hook(pools: HookPools) -> None:
    hook = Recording(ContainerPatch(annotations={"x": "y"}))
    observer = Observer()
    chain = HookChain([bind("late", hook)], pools=pools, observer=observer)
    outcome = await chain.run(create_ctx(), deadline=time.monotonic() - 1)
    assert hook.seen == []
    assert outcome.patches == ()
    assert observer.observed == [("late", "PreCreateContainer", "timeout")]


@pytest.mark.asyncio
async def test_cancellation_is_not_swallowed_by_ignore(pools: HookPools) -> None:
    started = asyncio.Event()

    async def wait_forever(ctx: ContainerContext) -> None:
        started.set()
        await asyncio.sleep(30)

    after = Recording()
    chain = HookChain([bind("wait", Fn(wait_forever), timeout=60), bind("after", after)], pools=pools)
    task = asyncio.create_task(chain.run(create_ctx(), deadline=None))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert after.seen == []


# --- threads --------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_sync_hooks_run_in_the_executor_with_the_callers_context(pools: HookPools) -> None:
    where: dict[str, tuple[str, str]] = {}

    def sync_hook(ctx: ContainerContext) -> None:
        where["sync"] = (threading.current_thread().name, REQUEST_ID.get())

    async def async_hook(ctx: ContainerContext) -> None:
        where["async"] = (threading.current_thread().name, REQUEST_ID.get())

    chain = HookChain([bind("s", Fn(sync_hook)), bind("a", Fn(async_hook))], pools=pools)
    REQUEST_ID.set("req-42")
    await chain.run(create_ctx(), deadline=None)
    assert where["sync"][0].startswith("test-hooks")
    assert where["async"][0] == threading.current_thread().name
    assert where["sync"][1] == where["async"][1] == "req-42"


class GoneWhileReconciling:
    """Raises what a cgroup writer raises when the pod's cgroup vanished under it."""

    def reconcile_container(self, ctx: ContainerContext) -> None:
        raise TargetGoneError("cgroup /kubepods/podx is gone")

    def pre_create_container(self, ctx: ContainerContext) -> None:
        raise TargetGoneError("cgroup /kubepods/podx is gone")


@pytest.mark.asyncio
async def test_an_object_gone_during_a_reconcile_pass_is_not_warned(pools: HookPools) -> None:
    """A pod torn down (behind the proxy's back) while a reconcile pass reaches it is
    not a fault: debug only, still counted as the hook's failure. A cgroup gone at a
    lifecycle stage stays a warning."""
    observer = Observer()
    chain = HookChain([bind("gone", GoneWhileReconciling())], pools=pools, observer=observer)
    with structlog.testing.capture_logs() as logs:
        await chain.run(ContainerContext(Stage.RECONCILE_CONTAINER, POD, CONTAINER), deadline=None)
        await chain.run(create_ctx(), deadline=None)
    failed = [(e["log_level"], e["stage"]) for e in logs if e["event"] == "hook_failed"]
    assert failed == [("debug", "ReconcileContainer"), ("warning", "PreCreateContainer")]
    assert observer.failed == [("gone", "ReconcileContainer", "Ignore"), ("gone", "PreCreateContainer", "Ignore")]
