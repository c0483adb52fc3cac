"""containerd's event stream as the re-sync's prompt (runtimeproxy.state.events): a backend
without the events service (here a CRI-only fake) is said once and the task idles; the
periodic re-sync stays. The stream itself against the real containerd:
tests/integration/test_level_posts.py."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc.aio
import pytest
import structlog.testing

from runtimeproxy.state.events import watch_events
from runtimeproxy.state.resync import Resyncer


@pytest.mark.asyncio
async def test_a_backend_without_the_events_service_is_said_once_and_the_task_idles(
    fake_runtime: Any, short_dir: Any
) -> None:
    topics: list[str] = []
    async with grpc.aio.insecure_channel(f"unix://{short_dir / 'ctrd.sock'}") as channel:
        with structlog.testing.capture_logs() as logs:
            task = asyncio.create_task(watch_events(channel, topics.append, retry=0.01))
            for _ in range(200):
                if logs:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # a retry loop would have logged again by now
            assert not task.done()
            task.cancel()
    assert [e["event"] for e in logs] == ["backend_events_unavailable"] and topics == []


@pytest.mark.asyncio
async def test_an_event_wakes_the_resyncer_with_its_reason() -> None:
    seen: list[str] = []

    class Backend:
        async def unary(self, *_: Any, **__: Any) -> Any:
            raise AssertionError("not called")

    resyncer = Resyncer(store=None, backend=Backend(), interval=lambda: 3600.0)  # type: ignore[arg-type]

    async def run_once(reason: str) -> None:
        seen.append(reason)

    resyncer.run_once = run_once  # type: ignore[assignment,method-assign]
    task = asyncio.create_task(resyncer.run_forever())
    resyncer.trigger_event("/tasks/exit")
    resyncer.trigger_event("/containers/delete")  # the same burst: one re-sync
    for _ in range(100):
        if seen:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    task.cancel()
    assert seen == ["event"]
