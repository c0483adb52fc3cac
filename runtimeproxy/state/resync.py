"""Keeping the store true to containerd: periodic and on-reconnect re-syncs.

Pods and containers can come and go without a call through the proxy: removed
directly at containerd, or created while the proxy answered UNAVAILABLE (kubelet
gave up, containerd finished). A store that keeps them makes ``explain`` answer for
dead pods, the reconciler warn about their gone cgroups, and the metrics count them.
So the store is re-synced every ``resync_interval``, when the backend connection is
back after a loss, before every reconciler pass, and, while a re-sync fails, every
couple of seconds until one succeeds. A re-sync costs two List calls (see
``store.resync``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Final

import grpc
import grpc.aio
import structlog

from runtimeproxy.backend import Backend, CallError
from runtimeproxy.state.store import ResyncResult, Store, resync

log = structlog.get_logger("runtimeproxy.resync")

#: Retry period while re-syncs fail (the backend is down or refusing).
RETRY_INTERVAL: Final = 2.0
#: After a containerd event, how long to gather the events that follow before re-syncing:
#: a burst (a pod removed with its containers, a node drained) costs one or two re-syncs.
EVENT_GATHER: Final = 0.1


class Resyncer:
    def __init__(self, *, store: Store, backend: Backend, interval: Callable[[], float],
                 after: Callable[[ResyncResult], Awaitable[object]] | None = None) -> None:
        self._store = store
        #: What follows a re-sync, under its lock (the Post stages owed, the host sweep).
        self._after = after
        self._backend = backend
        self._interval = interval
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._failing = False
        self._reason = "reconnect"
        #: A re-sync succeeded at least once (the store is complete: see ``TaskInit.pods_known``).
        self.succeeded = False

    def trigger(self) -> None:
        """Re-sync now (the backend connection came back)."""
        self._reason = "reconnect"
        self._wake.set()

    def trigger_event(self, topic: str) -> None:
        """containerd published an event after which the store may be stale
        (runtimeproxy.state.events): re-sync soon; a burst shares one re-sync."""
        if not self._wake.is_set():
            self._reason = "event"
        self._wake.set()

    async def run_once(self, reason: str) -> ResyncResult | None:
        """One re-sync; None when the backend did not answer (warned once per streak)."""
        async with self._lock:
            try:
                result = await resync(self._store, self._backend)
            except CallError as exc:
                if not self._failing:
                    self._failing = True
                    log.warning("store_resync_failed", reason=reason, error=str(exc))
                return None
            if self._after is not None:
                await self._after(result)
        recovered, self._failing = self._failing, False
        self.succeeded = True
        # States learnt here changed behind the proxy's back (a container exited by itself).
        emit = log.info if result.changed or result.states_changed or recovered else log.debug
        emit("store_resynced", reason=reason, pods=result.pods, containers=result.containers,
             pods_added=result.pods_added, pods_dropped=result.pods_dropped,
             containers_added=result.containers_added, containers_dropped=result.containers_dropped,
             states_changed=result.states_changed)
        return result

    async def run_forever(self) -> None:
        """Started right after the start-up rebuild, so it waits first."""
        timeout, reason = self._interval(), "interval"
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=timeout)
                reason = self._reason
                if reason == "event":
                    await asyncio.sleep(EVENT_GATHER)  # the rest of a burst (a pod's containers, many pods)
            except TimeoutError:
                pass
            self._wake.clear()  # a trigger during the re-sync below runs another one
            ok = await self.run_once(reason) is not None
            timeout = self._interval() if ok else min(RETRY_INTERVAL, self._interval())
            reason = "interval" if ok else "retry"


async def watch_reconnects(channel: grpc.aio.Channel, on_reconnect: Callable[[], None]) -> None:
    """Call ``on_reconnect`` each time the channel is READY again after leaving READY
    (containerd restarted, or was unreachable for a while). Watching the channel's
    state costs no calls; after a loss it asks the channel to reconnect (grpc's
    back-off, at most ``backend.max_reconnect_backoff``)."""
    state = channel.get_state(try_to_connect=False)
    lost = state is grpc.ChannelConnectivity.TRANSIENT_FAILURE
    seen_ready = state is grpc.ChannelConnectivity.READY
    while True:
        await channel.wait_for_state_change(state)
        state = channel.get_state(try_to_connect=False)
        if state is grpc.ChannelConnectivity.READY:
            if lost:
                log.debug("backend_reconnected")
                on_reconnect()
            lost, seen_ready = False, True
        elif state is grpc.ChannelConnectivity.TRANSIENT_FAILURE or seen_ready:
            lost = True
            if state is grpc.ChannelConnectivity.IDLE:
                # A lost connection goes IDLE and would wait for the next call; ask for a
                # reconnect now, so the re-sync does not depend on kubelet's traffic.
                state = channel.get_state(try_to_connect=True)
