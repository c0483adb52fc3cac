"""resctrl writes honour the calling hook's deadline like cgroup writes do: a sync
hook past its timeout (still running in its worker thread) changes nothing under
the resctrl root, neither a schemata, nor tasks, nor a group. Fixture tree (no
resctrl on this machine), written through ``ResctrlFS`` and a real ``HookChain``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextvars import copy_context
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hooks.resctrlfs import ResctrlFS
from runtimeproxy.chain.hookchain import BoundHook, HookChain, HookPools
from runtimeproxy.config.settings import FailurePolicy
from runtimeproxy.hookapi import ContainerContext, ContainerInfo, ContainerMeta, PodInfo, PodMeta, Stage
from runtimeproxy.hostwrites import HOOK_DEADLINE, HookDeadlineError
from tests.unit.hooks.test_hooks_resctrlfs import make_resctrl

POD = PodInfo(meta=PodMeta(name="web", namespace="ns", uid="u1"), id="sb1", cgroup_parent="/kubepods/podu1")
CTX = ContainerContext(Stage.PRE_CREATE_CONTAINER, POD, ContainerInfo(meta=ContainerMeta(name="c"), id="c1"))
SCHEMATA = "L3:0=f;1=f\nMB:0=50;1=50\n"


def _tree(tmp_path: Path) -> ResctrlFS:
    fs = make_resctrl(tmp_path / "resctrl")
    (fs.root / "LS").mkdir()
    (fs.root / "LS" / "schemata").write_text("L3:0=fff;1=fff\nMB:0=100;1=100\n")
    (fs.root / "LS" / "tasks").write_text("")
    return fs


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): (p.read_text() if p.is_file() else "<dir>") for p in sorted(root.rglob("*"))}


def _past_deadline(call: Callable[[], object]) -> object:
    """``call()`` as a hook whose call's deadline has just passed."""

    def run() -> object:
        HOOK_DEADLINE.set(time.monotonic() - 0.001)
        return call()

    return copy_context().run(run)


@pytest.mark.parametrize("change", ["write_schemata", "add_tasks", "ensure_group", "remove_group"])
def test_a_resctrl_change_past_the_deadline_is_refused_and_writes_nothing(tmp_path: Path, change: str) -> None:
    fs = _tree(tmp_path)
    calls: dict[str, Callable[[], object]] = {
        "write_schemata": lambda: fs.write_schemata("LS", SCHEMATA, "late"),
        "add_tasks": lambda: fs.add_tasks("LS", [4242], "late"),
        "ensure_group": lambda: fs.ensure_group("BE"),
        "remove_group": lambda: fs.remove_group("LS"),
    }
    if change == "remove_group":  # the kernel's groups are dirs with kernel files; a fixture's must be empty
        for f in ("schemata", "tasks"):
            (fs.root / "LS" / f).unlink()
    before = _snapshot(fs.root)
    with capture_logs() as logs, pytest.raises(HookDeadlineError, match="past its deadline"):
        _past_deadline(calls[change])
    assert _snapshot(fs.root) == before
    refused = [e for e in logs if e["event"] == "host_write_refused"]
    assert len(refused) == 1 and refused[0]["log_level"] == "warning"
    assert refused[0]["target"].startswith(str(fs.root))


def test_in_time_and_outside_hook_calls_resctrl_writes_go_through(tmp_path: Path) -> None:
    fs = _tree(tmp_path)

    def in_time() -> object:
        HOOK_DEADLINE.set(time.monotonic() + 30)
        return fs.write_schemata("LS", SCHEMATA, "in time")

    assert copy_context().run(in_time).changed  # type: ignore[attr-defined]
    assert "L3:0=f;1=f" in (fs.root / "LS" / "schemata").read_text()
    assert fs.ensure_group("BE") and fs.add_tasks("BE", [7], "no hook call: the QoS manager").changed
    assert (fs.root / "BE" / "tasks").read_text() == "7\n"


class LateResctrl:
    """A sync hook that sleeps past its timeout, then changes resctrl."""

    def __init__(self, fs: ResctrlFS, sleep: float) -> None:
        self.fs, self.sleep = fs, sleep
        self.done = threading.Event()
        self.error: BaseException | None = None

    def pre_create_container(self, ctx: ContainerContext) -> None:
        try:
            time.sleep(self.sleep)
            self.fs.ensure_group("BE")
            self.fs.write_schemata("LS", SCHEMATA, "late")
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self.done.set()


@pytest.fixture
def pools() -> Iterator[HookPools]:
    pools = HookPools()
    yield pools
    pools.shutdown()


@pytest.mark.asyncio
async def test_a_sync_hook_past_its_timeout_changes_no_resctrl_group(tmp_path: Path, pools: HookPools) -> None:
    fs = _tree(tmp_path)
    before = _snapshot(fs.root)
    hook = LateResctrl(fs, sleep=0.3)
    bound = BoundHook("late", hook, frozenset({Stage.PRE_CREATE_CONTAINER}), FailurePolicy.IGNORE, 0.05)
    outcome = await HookChain([bound], pools=pools).run(CTX, deadline=None)
    assert outcome.patches == ()
    assert hook.done.wait(10)
    assert isinstance(hook.error, HookDeadlineError)
    assert _snapshot(fs.root) == before, "no BE group, LS schemata untouched"
