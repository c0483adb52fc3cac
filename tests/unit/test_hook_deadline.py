"""A sync hook past its deadline writes nothing, and stuck hooks cannot starve
the others. Real files under a tmp cgroup root, written through the executor."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, MutableMapping
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from structlog.testing import capture_logs

from hooks.cgroups import CPU_SHARES, CgroupError, CgroupLayout
from hooks.executor import CgroupExecutor, Update
from runtimeproxy.chain.hookchain import BoundHook, HookChain, HookFailed, HookPools
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

POD = PodInfo(meta=PodMeta(name="web", namespace="ns", uid="u1"), id="sb1", cgroup_parent="/kubepods/podu1")
CTX = ContainerContext(Stage.PRE_CREATE_CONTAINER, POD, ContainerInfo(meta=ContainerMeta(name="c"), id="c1"))
CGROUP = PurePosixPath("kubepods/podu1")
#: Generous: a well-behaved hook on a loaded machine must still make it.
GOOD_TIMEOUT = 5.0


@pytest.fixture
def pools() -> Iterator[HookPools]:
    pools = HookPools()
    yield pools
    pools.shutdown()


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at teardown: stuck hooks return, so no test leaves a thread blocked."""
    event = threading.Event()
    yield event
    event.set()


def _bind(name: str, impl: object, timeout: float, policy: FailurePolicy = FailurePolicy.IGNORE) -> BoundHook:
    return BoundHook(name, impl, frozenset({Stage.PRE_CREATE_CONTAINER}), policy, timeout)


class LateWriter:
    """Sleeps past its timeout, then writes cpu.shares through the executor."""

    def __init__(self, executor: CgroupExecutor, sleep: float) -> None:
        self.executor, self.sleep = executor, sleep
        self.done = threading.Event()
        self.error: BaseException | None = None

    def pre_create_container(self, ctx: ContainerContext) -> ContainerPatch:
        try:
            time.sleep(self.sleep)
            self.executor.apply([Update(CGROUP, CPU_SHARES, 512, "late")])
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self.done.set()
        return ContainerPatch()


def _cgroup_tree(tmp_path: Path) -> tuple[CgroupExecutor, Path]:
    root = tmp_path / "cg"
    (root / CGROUP).mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu\n")
    target = root / CGROUP / "cpu.weight"
    target.write_text("100\n")
    return CgroupExecutor(CgroupLayout(root, 2)), target


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", [FailurePolicy.IGNORE, FailurePolicy.FAIL])
async def test_a_sync_hook_past_its_timeout_writes_nothing(
    tmp_path: Path, pools: HookPools, policy: FailurePolicy
) -> None:
    executor, target = _cgroup_tree(tmp_path)
    hook = LateWriter(executor, sleep=0.3)
    chain = HookChain([_bind("late", hook, 0.05, policy)], pools=pools)
    with capture_logs() as logs:
        if policy is FailurePolicy.FAIL:
            with pytest.raises(HookFailed, match="timed out"):
                await chain.run(CTX, deadline=None)
        else:
            outcome = await chain.run(CTX, deadline=None)
            assert outcome.patches == ()
        assert hook.done.wait(10)
    assert target.read_text() == "100\n"
    assert isinstance(hook.error, HookError) and "past its deadline" in str(hook.error)
    refused = [e for e in logs if e["event"] == "host_write_refused"]
    assert len(refused) == 1 and refused[0]["log_level"] == "warning"
    assert refused[0]["target"] == str((target).resolve()) and refused[0]["value"] == "20"


@pytest.mark.asyncio
async def test_a_hook_in_time_still_writes(tmp_path: Path, pools: HookPools) -> None:
    executor, target = _cgroup_tree(tmp_path)
    hook = LateWriter(executor, sleep=0)
    await HookChain([_bind("prompt", hook, GOOD_TIMEOUT)], pools=pools).run(CTX, deadline=None)
    assert hook.error is None and target.read_text() == "20"


class Stuck:
    def __init__(self, release: threading.Event) -> None:
        self.release = release
        self.calls = 0

    def pre_create_container(self, ctx: ContainerContext) -> None:
        self.calls += 1
        self.release.wait(30)


class Good:
    def pre_create_container(self, ctx: ContainerContext) -> ContainerPatch:
        return ContainerPatch(annotations={"good": "ran"})


@pytest.mark.asyncio
async def test_five_stuck_hooks_do_not_starve_a_sixth(pools: HookPools, release: threading.Event) -> None:
    stuck = [_bind(f"stuck{i}", Stuck(release), 0.05) for i in range(5)]
    chain = HookChain([*stuck, _bind("good", Good(), GOOD_TIMEOUT)], pools=pools)
    outcome = await chain.run(CTX, deadline=None)
    assert [name for name, _ in outcome.patches] == ["good"]
    assert isinstance(outcome.context, ContainerContext)
    assert outcome.context.container.annotations == {"good": "ran"}


@pytest.mark.asyncio
async def test_a_hook_with_too_many_stuck_calls_fails_fast(release: threading.Event) -> None:
    pools = HookPools(max_overdue=2)
    impl = Stuck(release)
    chain = HookChain([_bind("stuck", impl, 0.05, FailurePolicy.FAIL)], pools=pools)
    try:
        for _ in range(2):
            with pytest.raises(HookFailed, match="timed out"):
                await chain.run(CTX, deadline=None)
        patient = HookChain([_bind("stuck", impl, GOOD_TIMEOUT, FailurePolicy.FAIL)], pools=pools)
        start = time.monotonic()
        with pytest.raises(HookFailed, match=r"2 earlier call.* still running past their deadline"):
            await patient.run(CTX, deadline=None)
        assert time.monotonic() - start < GOOD_TIMEOUT / 2  # refused, not queued until its timeout
        assert impl.calls == 2
        release.set()
        deadline = time.monotonic() + 10
        while pools.overdue("stuck") and time.monotonic() < deadline:
            time.sleep(0.01)
        await patient.run(CTX, deadline=None)  # the stuck calls returned: the hook runs again
        assert impl.calls == 3
    finally:
        pools.shutdown()


def _hook_failed(logs: list[MutableMapping[str, Any]]) -> list[str]:
    return [e["log_level"] for e in logs if e["event"] == "hook_failed"]


class Repeating:
    """Fails like a hook whose host write keeps failing: the second error is a repeat."""

    def __init__(self) -> None:
        self.calls = 0

    def pre_create_container(self, ctx: ContainerContext) -> None:
        self.calls += 1
        cause = CgroupError("writing '2' to cpu.weight refused: Invalid argument")
        cause.repeat = self.calls > 1
        raise HookError(f"pod web: {cause}") from cause


@pytest.mark.asyncio
async def test_a_repeated_write_failure_is_not_warned_again(pools: HookPools) -> None:
    chain = HookChain([_bind("r", Repeating(), GOOD_TIMEOUT)], pools=pools)
    with capture_logs() as logs:
        for _ in range(3):
            await chain.run(CTX, deadline=None)
    assert _hook_failed(logs) == ["warning", "debug", "debug"]
    failing = HookChain([_bind("r", Repeating(), GOOD_TIMEOUT, FailurePolicy.FAIL)], pools=pools)
    repeats = []
    for _ in range(2):
        with pytest.raises(HookFailed) as info:
            await failing.run(CTX, deadline=None)
        repeats.append(info.value.repeat)
    assert repeats == [False, True]


@pytest.mark.asyncio
async def test_no_hook_runs_after_the_pools_shut_down() -> None:
    pools = HookPools()
    pools.shutdown()
    hook = Good()
    chain = HookChain([_bind("good", hook, GOOD_TIMEOUT, FailurePolicy.FAIL)], pools=pools)
    with pytest.raises(HookFailed, match="shut down"):
        await chain.run(CTX, deadline=None)
