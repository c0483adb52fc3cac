"""containerd's event stream as a prompt for the re-sync (the re-sync stays the guarantee).

What follows a stop or a removal is found by the store's re-sync (``Resyncer``,
``runtimeproxy.lifecycle.owed``), every ``resync_interval``. To make it prompt without a
short interval, the proxy subscribes to containerd's own events service on the same
socket (``/containerd.services.events.v1.Events/Subscribe``) for the topics after which
the store may be stale (a task exited: a container or a sandbox stopped; a container
deleted: a container or a sandbox removed) and asks for a re-sync when one arrives. The
events' contents are not used: the re-sync derives what happened from containerd's
lists, so a lost, late or duplicated event changes nothing but the timing.

Measured (docs/benchmarks.md, bench/bench_resync.py): a re-sync costs ~2 ms of CPU
(proxy + containerd) at 100 pods; at a 1 s interval that is ~0.2 % of a core idle, the
stream ~0. A backend without the service (not containerd) answers UNIMPLEMENTED: said
once, and the periodic re-sync alone remains. A broken stream is re-subscribed after
``RETRY`` seconds (a restarted containerd also triggers a re-sync through
``watch_reconnects``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

import grpc
import grpc.aio
import structlog

from criapi import containerd_events_v1_pb2 as events

log = structlog.get_logger("runtimeproxy.events")

SUBSCRIBE: Final = "/containerd.services.events.v1.Events/Subscribe"
#: CRI's objects live in containerd's ``k8s.io`` namespace; any of these filters matches.
FILTERS: Final = (
    'namespace=="k8s.io",topic=="/tasks/exit"',
    'namespace=="k8s.io",topic=="/containers/delete"',
)
RETRY: Final = 2.0


async def watch_events(channel: grpc.aio.Channel, on_event: Callable[[str], None], *,
                       retry: float = RETRY) -> None:
    """Call ``on_event(topic)`` for each matching event, for as long as the task runs."""
    subscribe = channel.unary_stream(
        SUBSCRIBE, request_serializer=events.SubscribeRequest.SerializeToString,
        response_deserializer=events.Envelope.FromString,
    )
    failing = False
    while True:
        call = subscribe(events.SubscribeRequest(filters=list(FILTERS)))
        try:
            async for envelope in call:
                if failing:
                    failing = False
                    log.info("backend_events_subscribed")
                on_event(envelope.topic)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                log.info("backend_events_unavailable", reason=exc.details() or "UNIMPLEMENTED",
                         effect="stops and removals are found by the periodic re-sync alone")
                await asyncio.get_running_loop().create_future()  # idle until stopped (a return is restarted)
            if not failing:
                failing = True
                log.warning("backend_events_lost", code=exc.code().name, error=(exc.details() or "")[:200],
                            retry_seconds=retry)
        finally:
            call.cancel()
        await asyncio.sleep(retry)
