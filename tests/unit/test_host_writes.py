"""Hooks report host writes (cgroup/resctrl files) through patches; they land in
the change log next to request changes and never force a request rewrite."""

from __future__ import annotations

import pytest

from runtimeproxy.chain.hookchain import HOST_TARGET, BoundHook, HookChain
from runtimeproxy.config.settings import FailurePolicy
from runtimeproxy.hookapi import (
    CallResult,
    ContainerContext,
    ContainerInfo,
    ContainerMeta,
    ContainerPatch,
    HostWrite,
    PodInfo,
    PodMeta,
    ResourcesPatch,
    Stage,
)
from runtimeproxy.state.store import Store

POD = PodInfo(meta=PodMeta(name="web", namespace="ns", uid="u1"), id="sb1", cgroup_parent="/kubepods/podu1")
CONTAINER = ContainerInfo(meta=ContainerMeta(name="c"), id="c1")


class Writer:
    """Writes a file at PostStartContainer, and only reports (no request change) at PreCreate."""

    def pre_create_container(self, ctx: ContainerContext) -> ContainerPatch:
        return ContainerPatch(writes=(HostWrite("/sys/fs/cgroup/cpu/x/cpu.shares", "2", "64", "be shares"),))

    def post_start_container(self, ctx: ContainerContext) -> ContainerPatch:
        return ContainerPatch(writes=(HostWrite("/sys/fs/resctrl/BE/tasks", "", "1234"),), reason="move tasks")


class BadPost:
    def post_start_container(self, ctx: ContainerContext) -> ContainerPatch:
        return ContainerPatch(resources=ResourcesPatch(cpu_shares=5))


def _chain(impl: object, stages: frozenset[Stage], policy: FailurePolicy = FailurePolicy.FAIL) -> HookChain:
    # 10 s: the sync hook waits for an executor thread; no test here is about timeouts.
    return HookChain([BoundHook("w", impl, stages, policy, 10.0)])


@pytest.mark.asyncio
async def test_writes_only_patch_is_recorded_but_does_not_change_the_request() -> None:
    chain = _chain(Writer(), frozenset({Stage.PRE_CREATE_CONTAINER}))
    outcome = await chain.run(ContainerContext(Stage.PRE_CREATE_CONTAINER, POD, CONTAINER), deadline=None)
    assert not outcome.request_changed
    assert [(c.target, c.old, c.new, c.reason) for c in outcome.changes] == [
        (HOST_TARGET + "/sys/fs/cgroup/cpu/x/cpu.shares", "2", "64", "be shares")
    ]
    assert outcome.context == ContainerContext(Stage.PRE_CREATE_CONTAINER, POD, CONTAINER)


@pytest.mark.asyncio
async def test_post_stage_may_report_writes_and_they_reach_the_pod_log() -> None:
    chain = _chain(Writer(), frozenset({Stage.POST_START_CONTAINER}))
    ctx = ContainerContext(Stage.POST_START_CONTAINER, POD, CONTAINER, result=CallResult(True))
    outcome = await chain.run(ctx, deadline=None)
    store = Store()
    store.put_pod(POD)
    store.record_changes(POD.meta.uid, outcome.changes)
    (change,) = store.changes("u1")
    assert (change.hook, change.stage, change.target, change.new, change.reason) == (
        "w", "PostStartContainer", "host:/sys/fs/resctrl/BE/tasks", "1234", "move tasks"
    )


@pytest.mark.asyncio
async def test_request_changes_at_a_post_stage_are_a_hook_failure() -> None:
    chain = _chain(BadPost(), frozenset({Stage.POST_START_CONTAINER}), FailurePolicy.IGNORE)
    ctx = ContainerContext(Stage.POST_START_CONTAINER, POD, CONTAINER, result=CallResult(True))
    outcome = await chain.run(ctx, deadline=None)
    assert outcome.changes == ()


def test_changes_of_a_removed_pod_are_not_kept() -> None:
    store = Store()
    store.put_pod(POD)
    store.remove_pod(POD.id)
    store.record_changes(POD.meta.uid, ())
    from runtimeproxy.chain.hookchain import Change

    store.record_changes(POD.meta.uid, (Change("w", "PostRemovePodSandbox", "host:/x", "", "1", ""),))
    assert store.changes(POD.meta.uid) == []
