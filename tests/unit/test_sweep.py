"""The host sweep (runtimeproxy.lifecycle.sweep): every hook with ``sweep_orphans`` is
given the live pods; a failing one is logged and does not stop the others."""

from __future__ import annotations

import pytest
import structlog.testing

from runtimeproxy.chain.hookchain import BoundHook, FailurePolicy
from runtimeproxy.hookapi import LivePods, OrphanSweeper
from runtimeproxy.lifecycle.sweep import sweep
from runtimeproxy.ops.logsetup import Throttle


class Saved:
    def __init__(self, *uids: str) -> None:
        self.uids = set(uids)

    def sweep_orphans(self, live: LivePods) -> list[str]:
        gone = sorted(self.uids - live.uids)
        self.uids &= live.uids
        return [f"record of {uid}" for uid in gone]


class AsyncSaved(Saved):
    async def sweep_orphans(self, live: LivePods) -> list[str]:  # type: ignore[override]
        return Saved.sweep_orphans(self, live)


class Broken:
    def sweep_orphans(self, live: LivePods) -> list[str]:
        raise OSError("resctrl went away")


class NoSweep:
    def post_stop_pod_sandbox(self, ctx: object) -> None:
        return None


def _bound(name: str, impl: object) -> BoundHook:
    return BoundHook(name, impl, frozenset(), FailurePolicy.IGNORE, 1.0)


@pytest.mark.asyncio
async def test_each_sweeping_hook_gets_the_live_pods_and_a_failure_stops_nothing() -> None:
    first, second = Saved("a", "b", "c"), AsyncSaved("b", "d")
    assert isinstance(first, OrphanSweeper) and not isinstance(NoSweep(), OrphanSweeper)
    hooks = [_bound("broken", Broken()), _bound("first", first), _bound("none", NoSweep()),
             _bound("second", second)]
    throttle = Throttle(600.0)
    with structlog.testing.capture_logs() as logs:
        assert await sweep(hooks, LivePods(frozenset({"b"})), throttle) == 3
    assert first.uids == {"b"} and second.uids == {"b"}
    assert [(e["event"], e["hook"]) for e in logs] == [
        ("orphan_sweep_failed", "broken"), ("orphans_removed", "first"), ("orphans_removed", "second")]
    assert logs[0]["error"] == "OSError: resctrl went away"
    assert logs[1]["removed"] == ["record of a", "record of c"] and logs[1]["count"] == 2
    with structlog.testing.capture_logs() as logs:
        assert await sweep(hooks, LivePods(frozenset({"b"})), throttle) == 0
    assert logs == []  # nothing removed: no line; the same failure again: held back
