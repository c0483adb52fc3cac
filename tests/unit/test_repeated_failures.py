"""Issue 27 item 5: a pod that fails the same way at every reconcile pass is one
warning plus a counter, not a line per pass; a new cause is one warning again, and the
recovery one info line. The real chain, the real oom-score-adj hook on a /proc tree
(a write the host refuses: the symlink it will not follow), and a hook whose pod
annotation it cannot parse."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import structlog.testing

from runtimeproxy.chain.hookchain import BoundHook, HookChain, HookPools, implemented_stages
from runtimeproxy.config.settings import FailurePolicy
from runtimeproxy.hookapi import ContainerContext, HookError, Stage
from runtimeproxy.ops.repeats import RepeatFilter
from tests.unit.hooks.test_hooks_oomscoreadj import Host, ctx

PASSES = 10


class Counting:
    def __init__(self) -> None:
        self.failed = 0

    def hook_observed(self, hook: str, stage: str, result: str, seconds: float) -> None:
        pass

    def hook_failed(self, hook: str, stage: str, policy: str) -> None:
        self.failed += 1


class BadAnnotation:
    """Fails while its pod's annotation is what it cannot parse (``cause`` is the text)."""

    def __init__(self) -> None:
        self.cause: str | None = "cpuQOS='{' invalid JSON"

    def reconcile_container(self, ctx: ContainerContext) -> None:
        if self.cause is not None:
            raise HookError(f"pod ns/web: annotation {self.cause}")


@pytest.fixture
def pools() -> Iterator[HookPools]:
    pools = HookPools(workers=2, thread_name_prefix="test-repeats")
    yield pools
    pools.shutdown()


def _chain(impl: object, pools: HookPools, observer: Counting, name: str) -> HookChain:
    hook = BoundHook(name, impl, implemented_stages(impl), FailurePolicy.IGNORE, 10.0)
    return HookChain([hook], pools=pools, observer=observer)


def _lines(logs: list[dict[str, Any]], event: str, level: str = "warning") -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == event and e["log_level"] == level]


@pytest.mark.asyncio
async def test_a_bad_annotation_is_one_warning_per_cause_and_one_line_when_it_clears(pools: HookPools) -> None:
    hook, observer = BadAnnotation(), Counting()
    chain = _chain(hook, pools, observer, "group-identity")
    reconcile = ctx({})
    with structlog.testing.capture_logs() as logs:
        for _ in range(PASSES):
            await chain.run(reconcile, deadline=None)
        assert len(_lines(logs, "hook_failed")) == 1 and observer.failed == PASSES
        hook.cause = "cpuQOS='{\"enable\": 3}' not a bool"  # another cause: logged again
        for _ in range(PASSES):
            await chain.run(reconcile, deadline=None)
        hook.cause = None  # fixed
        for _ in range(PASSES):
            await chain.run(reconcile, deadline=None)
    warned = _lines(logs, "hook_failed")
    assert [w["reason"].rpartition(" ")[2] for w in warned] == ["JSON", "bool"], warned
    assert warned[1]["previous_cause_repeats"] == PASSES - 1
    assert observer.failed == 2 * PASSES, "every failure is still counted"
    recovered = _lines(logs, "hook_recovered", "info")
    assert len(recovered) == 1 and recovered[0]["repeats"] == PASSES - 1


@pytest.mark.asyncio
async def test_the_filter_outlives_a_reload(pools: HookPools) -> None:
    repeats, observer = RepeatFilter(), Counting()
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):  # a chain per reload, one filter (the App's)
            hook = BoundHook("x", BadAnnotation(), frozenset({Stage.RECONCILE_CONTAINER}), FailurePolicy.IGNORE, 10.0)
            await HookChain([hook], pools=pools, observer=observer, repeats=repeats).run(ctx({}), deadline=None)
    assert len(_lines(logs, "hook_failed")) == 1


@pytest.mark.asyncio
async def test_a_write_the_host_refuses_is_one_warning_and_one_line_when_it_works_again(
        tmp_path: Path, pools: HookPools) -> None:
    host = Host(tmp_path)
    host.spawn(100)
    outside = tmp_path / "outside"
    outside.write_text("0\n")
    target = host.proc / "100" / "oom_score_adj"
    target.unlink()
    target.symlink_to(outside)  # refused at every pass: the writer does not follow it
    observer = Counting()
    chain = _chain(host.hook(), pools, observer, "oom-score-adj")
    reconcile = ctx({"koordinator.sh/oom-score-adj": "9"})
    with structlog.testing.capture_logs() as logs:
        for _ in range(PASSES):
            await chain.run(reconcile, deadline=None)
        assert outside.read_text() == "0\n"
        target.unlink()
        target.write_text("0\n")  # the process is fine again
        for _ in range(3):
            await chain.run(reconcile, deadline=None)
    assert host.value(100) == "9"
    assert len(_lines(logs, "oom_score_adj_failed")) == 1, _lines(logs, "oom_score_adj_failed")
    assert len(_lines(logs, "hook_failed")) == 1
    assert observer.failed == PASSES
    recovered = _lines(logs, "oom_score_adj_recovered", "info")
    assert len(recovered) == 1 and recovered[0]["repeats"] == PASSES - 1
    assert len(_lines(logs, "hook_recovered", "info")) == 1


class BadEverywhere(BadAnnotation):
    """The same cause at a container's Post stages too (a remote hook that is down, say)."""

    def post_start_container(self, ctx: ContainerContext) -> None:
        self.reconcile_container(ctx)

    def post_stop_container(self, ctx: ContainerContext) -> None:
        self.reconcile_container(ctx)


@pytest.mark.asyncio
async def test_the_same_cause_at_another_stage_of_the_object_is_news(pools: HookPools) -> None:
    """What repeats is one hook at one stage for one object: the reconcile passes are
    quiet after the first, but the container's PostStop failing the same way is one
    warning of its own (an operator looks for it, and tests wait for it)."""
    hook, observer = BadEverywhere(), Counting()
    chain = _chain(hook, pools, observer, "remote")
    reconcile = ctx({})
    with structlog.testing.capture_logs() as logs:
        await chain.run(replace(reconcile, stage=Stage.POST_START_CONTAINER), deadline=None)
        for _ in range(PASSES):
            await chain.run(reconcile, deadline=None)
        await chain.run(replace(reconcile, stage=Stage.POST_STOP_CONTAINER), deadline=None)
    warned = _lines(logs, "hook_failed")
    assert [w["stage"] for w in warned] == ["PostStartContainer", "ReconcileContainer", "PostStopContainer"]
    assert observer.failed == PASSES + 2
