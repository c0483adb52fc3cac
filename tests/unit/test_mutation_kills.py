"""Issue 27 item 7: a test for each mutation the suite let survive. Each test names the
mutation it kills (checked by applying it by hand: the test fails, then reverted)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest

from hooks.executor import PathEscapeError, confine
from metrics.qos.evict import pick
from runtimeproxy.chain.hookchain import BoundHook, HookChain, HookPools
from runtimeproxy.config.settings import FailurePolicy
from runtimeproxy.hookapi import ContainerContext, ContainerInfo, ContainerMeta, PodInfo, PodMeta, Stage
from runtimeproxy.lifecycle.posthooks import PostQueue

# --- hooks/executor.py: the confinement prefix check keeps its trailing "/" ----------


def test_a_symlink_to_a_sibling_whose_name_extends_the_roots_is_refused(tmp_path: Path) -> None:
    """Mutation: ``target.startswith(real_root.rstrip("/") + "/")`` without the ``+ "/"``:
    ``<root>X/...`` would pass as inside ``<root>``."""
    root = tmp_path / "cgroup"
    (root / "kubepods").mkdir(parents=True)
    sibling = tmp_path / "cgroupX" / "kubepods"
    sibling.mkdir(parents=True)
    (sibling / "cpu.shares").write_text("2\n")
    (root / "kubepods" / "evil").symlink_to(sibling)
    with pytest.raises(PathEscapeError, match="outside the root"):
        confine(root, PurePosixPath("kubepods/evil/cpu.shares"), "test")
    assert confine(root, PurePosixPath("kubepods"), "test") == root / "kubepods"  # inside: fine


# --- metrics/qos/evict.py: the pick stops once the need is met exactly ---------------


def test_the_eviction_pick_stops_when_the_need_is_met_exactly() -> None:
    """Mutation: ``if got >= need`` → ``if got > need`` evicts one pod too many."""
    victims = ["a", "b", "c"]
    assert pick(victims, 2.0, lambda _: 1.0) == ["a", "b"]  # type: ignore[arg-type,type-var]
    assert pick(victims, 2.5, lambda _: 1.0) == ["a", "b", "c"]  # type: ignore[arg-type,type-var]
    assert pick(victims, 0.0, lambda _: 1.0) == []  # type: ignore[arg-type,type-var]


# --- lifecycle/posthooks.py: one pod's Post stages run in call order ----------------


@pytest.mark.asyncio
async def test_one_pods_post_stages_run_in_call_order_others_do_not_wait() -> None:
    """Mutation: ``PostQueue.add`` without ``await asyncio.wait([before])``: a pod's
    second Post stage would run while its first is still running. Ordered by events."""
    queue, order = PostQueue(), []
    release = asyncio.Event()

    def work(name: str, gate: asyncio.Event | None = None):  # type: ignore[no-untyped-def]
        async def run() -> None:
            order.append(f"start {name}")
            if gate is not None:
                await gate.wait()
            order.append(f"end {name}")
        return run

    queue.add("pod-a", work("a1", release))
    queue.add("pod-a", work("a2"))
    queue.add("pod-a", work("a3"))
    queue.add("pod-b", work("b1"))
    await queue.wait("pod-b")
    assert order == ["start a1", "start b1", "end b1"], "pod a's later stages wait for a1; pod b does not"
    release.set()
    await queue.wait("pod-a")
    assert order[3:] == ["end a1", "start a2", "end a2", "start a3", "end a3"]
    assert queue.pending == 0


# --- chain/hookchain.py: a sync hook that waited in its queue past its deadline does not run


class Blocking:
    """Blocks the calls named ``blocker-N`` until ``release[N]``; notes every call it runs."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.started = threading.Semaphore(0)
        self.release = [threading.Event(), threading.Event()]

    def pre_create_container(self, ctx: ContainerContext) -> None:
        name = ctx.container.meta.name
        self.ran.append(name)
        if name.startswith("blocker-"):
            self.started.release()
            self.release[int(name[-1])].wait(30)


@pytest.fixture
def pools() -> Iterator[HookPools]:
    pools = HookPools(workers=1, max_overdue=1, thread_name_prefix="test-queue")  # two threads for the hook
    yield pools
    pools.shutdown()


def _ctx(name: str) -> ContainerContext:
    pod = PodInfo(PodMeta("web", "ns", "uid-1"), id="sb-1")
    return ContainerContext(Stage.PRE_CREATE_CONTAINER, pod, ContainerInfo(ContainerMeta(name), id=f"c-{name}"))


@pytest.mark.asyncio
async def test_a_sync_hook_call_that_waited_in_the_queue_past_its_deadline_never_runs(pools: HookPools) -> None:
    """Mutation: ``_call_until`` without its ``time.monotonic() >= deadline`` check: a call
    the chain gave up on would still run, late, once a thread takes it from the queue.

    A busy loop is what lets that happen (on time, the loop cancels the queued call): the
    test holds the loop while the call's deadline passes and a thread takes it. Ordered
    by events: one thread runs a blocker, then the late call, then a marker."""
    impl = Blocking()
    chain = HookChain([BoundHook("slow", impl, frozenset({Stage.PRE_CREATE_CONTAINER}), FailurePolicy.IGNORE, 30.0)],
                      pools=pools)
    blockers = [asyncio.create_task(chain.run(_ctx(f"blocker-{i}"), deadline=None)) for i in range(2)]
    for _ in blockers:  # both threads of the hook's pool are busy, in time
        assert await asyncio.to_thread(impl.started.acquire, True, 30)
    late = asyncio.create_task(chain.run(_ctx("late"), deadline=time.monotonic() + 0.2))
    for _ in range(3):
        await asyncio.sleep(0)  # the task submits its call (queued: no thread free)
    marker = threading.Event()
    pools.submit("slow", time.monotonic() + 30, marker.set)  # queued behind it
    # The loop is held (it cannot cancel the late call) until past its deadline ...
    time.sleep(0.3)
    impl.release[0].set()  # ... then one thread runs blocker-0 to its end, takes the late call, then the marker.
    assert marker.wait(30)
    assert "late" not in impl.ran, impl.ran
    impl.release[1].set()
    await asyncio.gather(late, *blockers)
    assert sorted(impl.ran) == ["blocker-0", "blocker-1"]
