"""Post hooks run after the reply, in call order per pod.

A Post hook cannot change the reply (the backend call has happened; a failure is
reported, not relayed), so kubelet does not wait for it: the reply goes out as soon as
the backend answered and the store is updated, and the Post stage runs right after it.
Measured on the shipped chain (docs/benchmarks.md): ~2 ms of hook time per pod lifecycle
left the reply path, on calls of which the proxy's own cost is the point of issue 15.

What still holds: one pod's Post stages run one after another in call order, and a
Pre stage with hooks on that pod runs only once the earlier Post stages are done (a Pre
hook sees what the Post hooks before it left). A call with no Pre hook does not wait:
nothing of ours runs before it, and its own Post stage queues behind the others. A
drain waits for them too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger("runtimeproxy.posthooks")


class PostQueue:
    """Per-pod chains of background Post-stage runs."""

    def __init__(self) -> None:
        self._last: dict[str, asyncio.Task[None]] = {}

    @property
    def pending(self) -> int:
        """Pods with Post stages still to run."""
        return len(self._last)

    def add(self, key: str, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work`` after the pending Post stages of pod ``key`` (the current task's
        context is copied: the call's log bindings go with it)."""
        before = self._last.get(key)

        async def run() -> None:
            if before is not None:
                await asyncio.wait([before])
            try:
                await work()
            except Exception:  # the chain reports hook failures itself; this is a bug, kept visible
                log.exception("post_hooks_internal_error")

        task = asyncio.get_running_loop().create_task(run(), name=f"post-hooks:{key}")
        self._last[key] = task
        task.add_done_callback(lambda done: self._forget(key, done))

    def _forget(self, key: str, task: asyncio.Task[None]) -> None:
        if self._last.get(key) is task:
            del self._last[key]

    async def wait(self, key: str) -> None:
        """Until the Post stages pending for pod ``key`` are done."""
        task = self._last.get(key)
        if task is not None:
            await asyncio.wait([task])

    async def settle(self, timeout: float | None = None) -> bool:
        """Until every pending Post stage is done (a drain); False if ``timeout`` ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._last:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            await asyncio.wait(list(self._last.values()), timeout=remaining)
        return True
