"""Consecutive sync hooks of a stage share one worker-thread hand-off
(runtimeproxy.chain.hookbatch), and each keeps its own timeout, policy and observation."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import structlog.testing

from runtimeproxy.chain.hookchain import BoundHook, HookBusyError, HookChain, HookFailed, HookPools, implemented_stages
from runtimeproxy.config.settings import FailurePolicy
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerInfo,
    ContainerMeta,
    ContainerPatch,
    HookError,
    PodInfo,
    PodMeta,
    Stage,
)

POD = PodInfo(meta=PodMeta(name="web-0", namespace="prod", uid="uid-1"), id="sb-1")
CTX = ContainerContext(Stage.PRE_CREATE_CONTAINER, POD, ContainerInfo(meta=ContainerMeta(name="app")))
#: A sleeping hook's time; the chain must return long before it when the hook's timeout is short.
SLEEP = 3.0


class Counting(HookPools):
    """Counts hand-offs to worker threads, by pool key."""

    def __init__(self) -> None:
        super().__init__(workers=2, thread_name_prefix="test-batch")
        self.keys: list[str] = []

    def submit(self, hook: str, deadline: float, call: Callable[[], object]) -> object:  # type: ignore[override]
        self.keys.append(hook)
        return super().submit(hook, deadline, call)


class Busy(Counting):
    """Every stage batch is refused, as when too many of them are stuck."""

    def submit(self, hook: str, deadline: float, call: Callable[[], object]) -> object:  # type: ignore[override]
        if hook.startswith("stage:"):
            self.keys.append(hook)
            raise HookBusyError(hook, 4)
        return super().submit(hook, deadline, call)


@pytest.fixture
def pools() -> Iterator[Counting]:
    pools = Counting()
    yield pools
    pools.shutdown()


class Noting:
    """Notes its thread and what it saw; adds annotation ``<name>=<n seen so far>``."""

    def __init__(self, name: str, *, sleep: float = 0.0, error: Exception | None = None) -> None:
        self.name, self.sleep, self.error = name, sleep, error
        self.threads: list[int] = []
        self.seen: list[dict[str, str]] = []

    def pre_create_container(self, ctx: ContainerContext) -> ContainerPatch:
        self.threads.append(threading.get_ident())
        self.seen.append(dict(ctx.container.annotations))
        time.sleep(self.sleep)
        if self.error is not None:
            raise self.error
        return ContainerPatch(annotations={self.name: str(len(ctx.container.annotations))})


def bind(impl: Noting, *, policy: FailurePolicy = FailurePolicy.IGNORE, timeout: float = 10.0) -> BoundHook:
    return BoundHook(impl.name, impl, implemented_stages(impl), policy, timeout)


class Observer:
    def __init__(self) -> None:
        self.observed: list[tuple[str, str]] = []

    def hook_observed(self, hook: str, stage: str, result: str, seconds: float) -> None:
        self.observed.append((hook, result))

    def hook_failed(self, hook: str, stage: str, policy: str) -> None:
        return None


@pytest.mark.asyncio
async def test_consecutive_sync_hooks_share_one_hand_off_and_see_each_others_patches(pools: Counting) -> None:
    a, b, c = Noting("a"), Noting("b"), Noting("c")
    observer = Observer()
    chain = HookChain([bind(a), bind(b), bind(c)], pools=pools, observer=observer)
    outcome = await chain.run(CTX, deadline=None)
    assert pools.keys == ["stage:PreCreateContainer"]  # one hand-off, not three
    assert a.threads == b.threads == c.threads
    assert [a.seen, b.seen, c.seen] == [[{}], [{"a": "0"}], [{"a": "0", "b": "1"}]]
    assert dict(outcome.context.container.annotations) == {"a": "0", "b": "1", "c": "2"}
    assert [name for name, _ in outcome.patches] == ["a", "b", "c"]
    assert observer.observed == [("a", "ok"), ("b", "ok"), ("c", "ok")]


@pytest.mark.asyncio
async def test_a_hook_past_its_timeout_stops_the_batch_and_the_rest_run_alone(pools: Counting) -> None:
    slow, after = Noting("slow", sleep=SLEEP), Noting("after")
    observer = Observer()
    chain = HookChain([bind(slow, timeout=0.1), bind(after)], pools=pools, observer=observer)
    start = time.monotonic()
    with structlog.testing.capture_logs() as logs:
        outcome = await chain.run(CTX, deadline=None)
    assert time.monotonic() - start < SLEEP / 2  # the chain did not wait for the sleeping hook
    assert observer.observed == [("slow", "timeout"), ("after", "ok")]
    assert [e["reason"] for e in logs if e["event"] == "hook_failed"] == ["timed out after 0.100s"]
    # "after" ran on its own hand-off, in another thread, and saw no patch of the timed-out hook.
    assert pools.keys == ["stage:PreCreateContainer", "after"]
    assert after.threads != slow.threads and after.seen == [{}]
    assert dict(outcome.context.container.annotations) == {"after": "0"}


@pytest.mark.asyncio
async def test_a_timeout_with_fail_policy_fails_the_call(pools: Counting) -> None:
    slow, after = Noting("slow", sleep=SLEEP), Noting("after")
    chain = HookChain([bind(slow, policy=FailurePolicy.FAIL, timeout=0.1), bind(after)], pools=pools)
    with pytest.raises(HookFailed) as err:
        await chain.run(CTX, deadline=time.monotonic() + 5)
    assert err.value.hook == "slow" and err.value.deadline
    assert after.seen == []


@pytest.mark.asyncio
async def test_a_failing_hook_with_fail_policy_stops_the_batch(pools: Counting) -> None:
    bad, after = Noting("bad", error=HookError("no such cgroup")), Noting("after")
    chain = HookChain([bind(bad, policy=FailurePolicy.FAIL), bind(after)], pools=pools)
    with pytest.raises(HookFailed) as err:
        await chain.run(CTX, deadline=None)
    assert err.value.reason == "HookError: no such cgroup"
    assert after.seen == []


@pytest.mark.asyncio
async def test_a_failing_hook_with_ignore_policy_leaves_the_batch_going(pools: Counting) -> None:
    bad, after = Noting("bad", error=HookError("no such cgroup")), Noting("after")
    observer = Observer()
    chain = HookChain([bind(bad), bind(after)], pools=pools, observer=observer)
    with structlog.testing.capture_logs() as logs:
        outcome = await chain.run(CTX, deadline=None)
    assert observer.observed == [("bad", "error"), ("after", "ok")]
    assert [e["hook"] for e in logs if e["event"] == "hook_failed"] == ["bad"]
    assert after.threads == bad.threads and after.seen == [{}]
    assert dict(outcome.context.container.annotations) == {"after": "0"}


@pytest.mark.asyncio
async def test_with_the_stage_pool_busy_each_hook_gets_its_own_hand_off() -> None:
    pools = Busy()
    a, b = Noting("a"), Noting("b")
    try:
        outcome = await HookChain([bind(a), bind(b)], pools=pools).run(CTX, deadline=None)
    finally:
        pools.shutdown()
    assert pools.keys == ["stage:PreCreateContainer", "a", "b"]
    assert dict(outcome.context.container.annotations) == {"a": "0", "b": "1"}


@pytest.mark.asyncio
async def test_an_async_hook_splits_the_runs_in_yaml_order(pools: Counting) -> None:
    order: list[str] = []

    class Remote:
        name = "remote"

        async def pre_create_container(self, ctx: ContainerContext) -> None:
            order.append("remote")

    a, b, c = Noting("a"), Noting("b"), Noting("c")
    remote = Remote()
    hooks = [bind(a), bind(b), BoundHook("remote", remote, implemented_stages(remote), FailurePolicy.IGNORE, 10.0),
             bind(c)]
    outcome = await HookChain(hooks, pools=pools).run(CTX, deadline=None)
    assert pools.keys == ["stage:PreCreateContainer", "c"]  # a+b batched, the lone c alone
    assert order == ["remote"] and c.seen == [{"a": "0", "b": "1"}]
    assert dict(outcome.context.container.annotations) == {"a": "0", "b": "1", "c": "2"}


def test_overdue_stops_the_batch_atomically_with_the_threads_recording() -> None:
    """The loop's "past its deadline" and the thread's "done, record it, start the next"
    cannot interleave: once the loop stops the batch for hook 0, hook 0's late outcome is
    not recorded and hook 1 never starts; a hook still in time is not stopped."""
    from runtimeproxy.chain.hookbatch import Batch, Step

    a, b = Noting("a"), Noting("b")
    batch = Batch([bind(a), bind(b)], CTX, None, lambda h, c, r: None, lambda c, p, n: (c, ()), lambda h: False)
    assert batch._start(0, time.monotonic() + 5)
    assert batch.overdue() is None  # in time: keep waiting
    assert batch._record(Step(0, "ok", None, None, 0.0, 5.0, CTX))
    assert batch._start(1, time.monotonic() - 0.001)  # hook 1 running, already past its deadline
    steps, pending = batch.overdue() or ([], -1)
    assert [s.index for s in steps] == [0] and pending == 1
    assert not batch._record(Step(1, "ok", None, None, 0.0, 5.0, CTX))  # its late outcome is dropped
    assert not batch._start(1, time.monotonic() + 5)
