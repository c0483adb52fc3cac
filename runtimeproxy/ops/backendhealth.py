"""Is containerd there? A cheap periodic probe behind /healthz and the backend-up gauge.

The pass-through path cannot tell: a failing call may be the caller's fault, and
adding bookkeeping to every call would cost the hottest path. So a supervised task
makes one small call per backend every ``probe_interval`` (Version on the runtime
endpoint, ImageFsInfo on a separate image endpoint) over the same channels kubelet's
calls use. A backend failing for ``unhealthy_after`` is declared lost: one warning,
its gauge goes 0 and /healthz answers 503 with the reason. The first successful
probe after that is one info line and everything flips back. A failure shorter than
the grace (a containerd restart) changes nothing visible.

A probe is skipped when the proxy's own calls on that endpoint (the re-syncs every
reconcile pass, through ``watching``) were answered within the last interval: that is
the answer the probe would get. Each probe costs ~2.6 ms of CPU in gRPC's threads on a
small VM (issue 29); a lost backend is still found as soon, since failed calls do not
count and the probe then runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import structlog
from structlog.typing import FilteringBoundLogger

from runtimeproxy.backend import IMAGE_SERVICE, Backend, CallError, Metadata, Reply

VERSION_METHOD: Final = "/runtime.v1.RuntimeService/Version"
IMAGE_FS_INFO_METHOD: Final = "/runtime.v1.ImageService/ImageFsInfo"
#: VersionRequest{version: "v1"}, serialized by hand (field 1, length 2): no protobuf work per probe.
VERSION_PAYLOAD: Final = b"\x0a\x02v1"


@dataclass(frozen=True, slots=True)
class Probe:
    """One backend to watch: ``name`` is the gauge label (runtime, image)."""

    name: str
    endpoint: str
    method: str
    payload: bytes = b""


class _State:
    def __init__(self) -> None:
        self.failing_since: float | None = None
        self.reason = ""
        self.lost = False


class BackendMonitor:
    """Probes each backend forever (``run_forever``, a supervised task); ``problem()``
    says why the proxy is unhealthy, or None."""

    def __init__(
        self,
        backend: Backend,
        probes: Sequence[Probe],
        *,
        interval: float,
        unhealthy_after: float,
        set_up: Callable[[str, bool], None],
        clock: Callable[[], float] = time.monotonic,
        logger: FilteringBoundLogger | None = None,
    ) -> None:
        self._backend = backend
        self._probes = tuple(probes)
        self._interval = interval
        self._grace = unhealthy_after
        self._set_up = set_up
        self._clock = clock
        self._log: FilteringBoundLogger = logger if logger is not None else structlog.get_logger("runtimeproxy.backend")
        self._states = {p.name: _State() for p in self._probes}
        #: Probe name -> when a watched call on its endpoint was last answered.
        self._heard: dict[str, float] = {}

    def watching(self, backend: Backend) -> Backend:
        """``backend``, with each answered call noted for the probe of its endpoint."""
        return _Watched(backend, self)

    def heard(self, method: str) -> None:
        """A call of ``method`` was answered (the image probe's endpoint serves the image
        service's methods when it has one of its own)."""
        name = "image" if method.startswith(IMAGE_SERVICE) and "image" in self._states else "runtime"
        self._heard[name] = self._clock()

    def problem(self) -> str | None:
        """The first lost backend and why, or None while every backend is reachable."""
        now = self._clock()
        for probe in self._probes:
            state = self._states[probe.name]
            if state.lost and state.failing_since is not None:
                return (
                    f"backend {probe.name} ({probe.endpoint}) unreachable for "
                    f"{now - state.failing_since:.0f}s: {state.reason}"
                )
        return None

    async def run_forever(self) -> None:
        while True:
            await self.probe_once()
            await asyncio.sleep(self._interval)

    async def probe_once(self) -> None:
        await asyncio.gather(*(self._probe(p) for p in self._probes))

    async def _probe(self, probe: Probe) -> None:
        heard = self._heard.get(probe.name)
        if heard is not None and self._clock() - heard < self._interval:
            self._answered(probe)  # a call on this endpoint was answered meanwhile
            return
        # A hung containerd (accepting, never answering) must fail the probe too.
        timeout = min(max(self._interval, 1.0), 5.0)
        try:
            await self._backend.unary(probe.method, probe.payload, timeout=timeout)
        except CallError as exc:
            # UNIMPLEMENTED still means someone answered: reachable.
            if exc.code.name != "UNIMPLEMENTED":
                self._failed(probe, str(exc))
                return
        self._answered(probe)

    def _failed(self, probe: Probe, reason: str) -> None:
        state = self._states[probe.name]
        now = self._clock()
        if state.failing_since is None:
            state.failing_since = now
        state.reason = reason
        if not state.lost and now - state.failing_since >= self._grace:
            state.lost = True
            self._set_up(probe.name, False)
            self._log.warning(
                "backend_lost", backend=probe.name, endpoint=probe.endpoint, error=reason,
                failing_for=round(now - state.failing_since, 1),
            )

    def _answered(self, probe: Probe) -> None:
        state = self._states[probe.name]
        if state.lost and state.failing_since is not None:
            self._log.info(
                "backend_recovered", backend=probe.name, endpoint=probe.endpoint,
                down_for=round(self._clock() - state.failing_since, 1),
            )
        state.failing_since = None
        state.lost = False
        state.reason = ""
        self._set_up(probe.name, True)


class _Watched:
    """A backend whose answered calls the monitor hears of (``BackendMonitor.watching``)."""

    def __init__(self, backend: Backend, monitor: BackendMonitor) -> None:
        self._backend = backend
        self._monitor = monitor

    async def unary(
        self, method: str, payload: bytes, *, timeout: float | None = None, metadata: Metadata = ()
    ) -> Reply:
        reply = await self._backend.unary(method, payload, timeout=timeout, metadata=metadata)
        self._monitor.heard(method)
        return reply
