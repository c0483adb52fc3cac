"""One intercepted call, whatever the transport: count it, run the lifecycle, and turn
any failure into a ``CallError`` to relay (a bug must not end kubelet's call without a
status). Called by the gRPC server (``grpcserver``), on kubelet's socket or, behind
HAProxy, on the private interception socket."""

from __future__ import annotations

import time

import structlog

from runtimeproxy.backend import CallError, Code, Reply
from runtimeproxy.lifecycle.handler import CallInfo, Lifecycle
from runtimeproxy.ops.promstats import MethodStats

log = structlog.get_logger("runtimeproxy.intercept")


async def serve(lifecycle: Lifecycle, stats: MethodStats, method: str, request: bytes, info: CallInfo) -> Reply:
    """The lifecycle's reply; CallError for any failure (counted in ``stats``)."""
    stats.calls.inc()
    start = time.perf_counter()
    try:
        return await lifecycle.handle(method, request, info)
    except CallError as err:
        stats.error(err.code.name)
        raise
    except Exception as exc:
        log.exception("intercept_internal_error", method=method)
        stats.error("INTERNAL")
        raise CallError(Code.INTERNAL, f"koord-runtime-proxy: {type(exc).__name__}: {exc}") from exc
    finally:
        stats.duration.observe(time.perf_counter() - start)
