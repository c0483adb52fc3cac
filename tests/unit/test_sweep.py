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


@pytest.mark.asyncio
async def test_the_sync_sweeps_share_one_worker_hand_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: each sweep is a scan of its hook's own records, shorter than a hand-off
    to a worker thread (which wakes a worker and then the loop): one for all of them, in
    the chain's order, off the loop; an async sweep is awaited on the loop."""
    import asyncio
    import threading

    threads: list[str] = []

    class Where(Saved):
        def sweep_orphans(self, live: LivePods) -> list[str]:
            threads.append(threading.current_thread().name)
            return super().sweep_orphans(live)

    hand_offs: list[str] = []
    real = asyncio.to_thread

    async def counted(func: object, /, *args: object, **kwargs: object) -> object:
        hand_offs.append(getattr(func, "__name__", repr(func)))
        return await real(func, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(asyncio, "to_thread", counted)
    sweepers = [Where("a"), Where("b"), Where("c")]
    hooks = [_bound("w0", sweepers[0]), _bound("async", AsyncSaved("d")), _bound("broken", Broken()),
             _bound("w1", sweepers[1]), _bound("w2", sweepers[2])]
    with structlog.testing.capture_logs() as logs:
        assert await sweep(hooks, LivePods(frozenset())) == 4
    assert len(hand_offs) == 1
    assert len(threads) == 3 and len(set(threads)) == 1 and threads[0] != threading.main_thread().name
    assert [(e["event"], e["hook"]) for e in logs] == [
        ("orphans_removed", "w0"), ("orphans_removed", "async"), ("orphan_sweep_failed", "broken"),
        ("orphans_removed", "w1"), ("orphans_removed", "w2")]
