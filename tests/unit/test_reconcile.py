"""The reconciler: periodic Reconcile* stages repair host drift, recorded per pod."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from runtimeproxy.chain.hookchain import BoundHook, HookChain
from runtimeproxy.config.settings import FailurePolicy
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerInfo,
    ContainerMeta,
    ContainerPatch,
    HostWrite,
    PodContext,
    PodInfo,
    PodMeta,
    PodPatch,
    Resources,
    Stage,
    frozen_map,
)
from runtimeproxy.state.reconcile import VERIFY_PASSES, Reconciler
from runtimeproxy.state.store import Store

SKIP = "runtimeproxy.koordinator.sh/skip-hookserver"


class FileKeeper:
    """Keeps <dir>/<container id> equal to the container's cpu_shares, like a cgroup file."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pods_seen: list[str] = []

    def reconcile_pod_sandbox(self, ctx: PodContext) -> None:
        self.pods_seen.append(ctx.pod.meta.name)

    def reconcile_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        path = self.root / ctx.container.id
        want = str(ctx.container.resources.cpu_shares)
        have = path.read_text() if path.exists() else ""
        if have == want:
            return None
        path.write_text(want)
        return ContainerPatch(writes=(HostWrite(str(path), have, want, "keep shares"),))


class CountingKeeper(FileKeeper):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.containers_done = 0

    def reconcile_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        patch = super().reconcile_container(ctx)
        self.containers_done += 1
        return patch


class Broken:
    def reconcile_container(self, ctx: ContainerContext) -> None:
        if ctx.pod.meta.name == "web":
            raise RuntimeError("cgroup gone")


class ChangesRequest:
    def reconcile_pod_sandbox(self, ctx: PodContext) -> PodPatch:
        return PodPatch(cgroup_parent="/elsewhere")


def _store(*extra: str) -> Store:
    store = Store()
    for name, labels in (("web", {}), ("opted-out", {SKIP: "true"}), *((n, {}) for n in extra)):
        pod = PodInfo(meta=PodMeta(name=name, namespace="ns", uid=f"u-{name}"), id=f"sb-{name}",
                      labels=frozen_map(labels))
        store.put_pod(pod)
        store.put_container(pod.id, ContainerInfo(meta=ContainerMeta(name="c"), id=f"c-{name}",
                                                  resources=Resources(cpu_shares=512)))
    return store


def _reconciler(store: Store, *hooks: BoundHook, interval: float = 30.0) -> Reconciler:
    chain = HookChain(hooks)
    return Reconciler(store=store, chain=lambda: chain,
                      skipped=lambda pod: pod.labels.get(SKIP) == "true", interval=lambda: interval)


def _bound(name: str, impl: object, policy: FailurePolicy = FailurePolicy.FAIL) -> BoundHook:
    stages = frozenset(s for s in (Stage.RECONCILE_POD_SANDBOX, Stage.RECONCILE_CONTAINER)
                       if callable(getattr(impl, s.method_name, None)))
    # 10 s: sync hooks wait for an executor thread; no test here is about timeouts.
    return BoundHook(name, impl, stages, policy, 10.0)


@pytest.mark.asyncio
async def test_pass_writes_once_then_repairs_drift_and_records_it(tmp_path: Path) -> None:
    store = _store()
    keeper = FileKeeper(tmp_path)
    rec = _reconciler(store, _bound("keeper", keeper))

    first = await rec.run_once()
    assert (first.pods, first.containers, first.writes, first.failures) == (1, 1, 1, 0)
    assert (tmp_path / "c-web").read_text() == "512"
    assert not (tmp_path / "c-opted-out").exists(), "skip-labelled pods are left alone"
    assert keeper.pods_seen == ["web"]

    assert (await rec.run_once()).writes == 0, "nothing drifted: nothing rewritten"

    (tmp_path / "c-web").write_text("2")  # an operator's manual write
    repaired = await rec.run_once()
    assert repaired.writes == 1
    assert (tmp_path / "c-web").read_text() == "512"
    log = [(c.hook, c.stage, c.old, c.new) for c in store.changes("u-web")]
    assert log == [("keeper", "ReconcileContainer", "", "512"), ("keeper", "ReconcileContainer", "2", "512")]


@pytest.mark.asyncio
async def test_failures_are_counted_and_do_not_stop_the_pass(tmp_path: Path) -> None:
    rec = _reconciler(_store("api"), _bound("broken", Broken()), _bound("keeper", FileKeeper(tmp_path)))
    result = await rec.run_once()
    assert result.failures == 1
    assert not (tmp_path / "c-web").exists(), "Fail policy stops the chain for that container"
    assert (tmp_path / "c-api").read_text() == "512", "the pass goes on with the next container"


@pytest.mark.asyncio
async def test_request_changes_at_reconcile_are_refused(tmp_path: Path) -> None:
    store = _store()
    rec = _reconciler(store, _bound("bad", ChangesRequest()))
    assert (await rec.run_once()).failures == 1
    assert store.changes("u-web") == []


@pytest.mark.asyncio
async def test_no_reconcile_hooks_means_no_pass() -> None:
    rec = _reconciler(_store())
    assert await rec.run_once() == (await rec.run_once())
    assert (await rec.run_once()).pods == 0


@pytest.mark.asyncio
async def test_trigger_runs_a_pass_before_the_interval(tmp_path: Path) -> None:
    store = _store()
    rec = _reconciler(store, _bound("keeper", FileKeeper(tmp_path)), interval=3600)
    task = asyncio.create_task(rec.run_forever())
    try:
        async with asyncio.timeout(5):
            # The first pass is over once its write is recorded (the file alone may exist
            # while the hook, in its executor thread, is still writing it).
            while not store.changes("u-web"):
                await asyncio.sleep(0.01)
            assert (tmp_path / "c-web").read_text() == "512"
            (tmp_path / "c-web").write_text("3")
            rec.trigger()
            while (tmp_path / "c-web").read_text() != "512":
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.mark.asyncio
async def test_torn_down_objects_are_left_alone(tmp_path: Path) -> None:
    """kubelet removes the cgroups of NOTREADY sandboxes and of CREATED/EXITED containers
    first: visiting them would only fail (and warn) every pass."""
    from criapi import cri_v1_pb2 as cri

    store = _store("stopped", "created", "exited", "running")
    store.set_pod_state("sb-stopped", cri.SANDBOX_NOTREADY)
    store.set_container_state("c-created", cri.CONTAINER_CREATED)
    store.set_container_state("c-exited", cri.CONTAINER_EXITED)
    store.set_container_state("c-running", cri.CONTAINER_RUNNING)
    keeper = FileKeeper(tmp_path)
    result = await _reconciler(store, _bound("keeper", keeper)).run_once()
    written = sorted(n for n in ("c-web", "c-stopped", "c-created", "c-exited", "c-running")
                     if (tmp_path / n).exists())
    assert written == ["c-running", "c-web"]
    assert sorted(keeper.pods_seen) == ["created", "exited", "running", "web"]
    assert (result.pods, result.containers) == (4, 2)


# --- issue 29: objects found in place are left out of the periodic passes for a while -------

INTERVAL = 10.0


def _timed(store: Store, *hooks: BoundHook) -> tuple[Reconciler, list[float]]:
    chain = HookChain(hooks)
    now = [1000.0]
    rec = Reconciler(store=store, chain=lambda: chain, skipped=lambda pod: pod.labels.get(SKIP) == "true",
                     interval=lambda: INTERVAL, clock=lambda: now[0])
    return rec, now


async def _periodic(rec: Reconciler, now: list[float]) -> Any:
    now[0] += INTERVAL
    return await rec.run_once(full=False)


@pytest.mark.asyncio
async def test_drift_on_an_object_found_in_place_is_put_back_within_the_bound(tmp_path: Path) -> None:
    store = _store()
    rec, now = _timed(store, _bound("keeper", FileKeeper(tmp_path)))
    await rec.run_once()  # writes c-web
    found = await _periodic(rec, now)
    assert (found.containers, found.writes) == (1, 0)  # found in place: verified from here
    (tmp_path / "c-web").write_text("2")  # changed behind our back
    for _ in range(VERIFY_PASSES - 1):
        left_out = await _periodic(rec, now)
        assert (left_out.containers, left_out.writes) == (0, 0) and left_out.skipped >= 1
    assert (tmp_path / "c-web").read_text() == "2"
    repaired = await _periodic(rec, now)  # VERIFY_PASSES intervals after it was found in place
    assert (repaired.containers, repaired.writes) == (1, 1)
    assert (tmp_path / "c-web").read_text() == "512"


@pytest.mark.asyncio
async def test_a_changed_desired_value_is_written_at_the_next_pass(tmp_path: Path) -> None:
    store = _store()
    rec, now = _timed(store, _bound("keeper", FileKeeper(tmp_path)))
    await rec.run_once()
    await _periodic(rec, now)
    assert (await _periodic(rec, now)).containers == 0  # verified: left out
    store.update_container_resources("c-web", Resources(cpu_shares=1024))  # e.g. UpdateContainerResources
    result = await _periodic(rec, now)
    assert result.writes == 1 and (tmp_path / "c-web").read_text() == "1024"


@pytest.mark.asyncio
async def test_a_new_chain_or_a_trigger_makes_the_next_pass_visit_everything(tmp_path: Path) -> None:
    store = _store()
    first = HookChain([_bound("keeper", FileKeeper(tmp_path))])
    chain = [first]
    now = [1000.0]
    rec = Reconciler(store=store, chain=lambda: chain[0], skipped=lambda pod: pod.labels.get(SKIP) == "true",
                     interval=lambda: INTERVAL, clock=lambda: now[0])
    await rec.run_once()
    now[0] += INTERVAL
    await rec.run_once(full=False)
    (tmp_path / "c-web").write_text("2")
    now[0] += INTERVAL
    assert (await rec.run_once(full=False)).containers == 0
    chain[0] = HookChain([_bound("keeper", FileKeeper(tmp_path))])  # a reload: rules may differ
    now[0] += INTERVAL
    assert (await rec.run_once(full=False)).writes == 1
    assert (tmp_path / "c-web").read_text() == "512"


@pytest.mark.asyncio
async def test_trigger_makes_the_periodic_loop_visit_everything(tmp_path: Path) -> None:
    store = _store()
    keeper = CountingKeeper(tmp_path)
    rec = _reconciler(store, _bound("keeper", keeper), interval=3600)
    task = asyncio.create_task(rec.run_forever())
    try:
        async with asyncio.timeout(5):
            while keeper.containers_done < 1:  # the first pass (it writes c-web)
                await asyncio.sleep(0.01)
            rec.trigger()
            while keeper.containers_done < 2:  # a second one finds c-web in place
                await asyncio.sleep(0.01)
            (tmp_path / "c-web").write_text("3")
            rec.trigger()  # e.g. a task's reconcile_now: the verified c-web is visited too
            while (tmp_path / "c-web").read_text() != "512":
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.mark.asyncio
async def test_an_object_whose_hook_failed_under_ignore_is_visited_again(tmp_path: Path) -> None:
    store = _store("api")
    rec, now = _timed(store, _bound("broken", Broken(), FailurePolicy.IGNORE), _bound("keeper", FileKeeper(tmp_path)))
    await rec.run_once()
    await _periodic(rec, now)  # c-api found in place; c-web's broken hook failed (ignored)
    again = await _periodic(rec, now)
    assert again.containers == 1 and again.failures == 0  # c-web only: its stage did not all take
