"""What every host write shares with the core: the calling hook's deadline and
the exporter of the failure counter.

* **Deadline** — a sync hook runs in a worker thread that no timeout can stop.
  The chain puts the call's deadline in ``HOOK_DEADLINE`` (a contextvar, copied
  into the worker thread), and every writer calls ``check_deadline`` right before
  it writes: once the chain has given up on a call (rejected or forwarded the CRI
  request) the hook can no longer change the host behind its back.
* **Failures** — ``NodeServices.write_failures`` (``runtimeproxy.services``) counts
  refused writes by cause (errno name); ``FailureCollector`` exposes the app's one as
  ``koord_runtime_proxy_host_write_failures_total{cause}``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextvars import ContextVar

import structlog
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from runtimeproxy.hookapi import HookError
from runtimeproxy.services import FailureCounter

log = structlog.get_logger("runtimeproxy.hostwrites")

#: ``time.monotonic()`` deadline of the hook call running in this context; None outside one.
HOOK_DEADLINE: ContextVar[float | None] = ContextVar("hook_deadline", default=None)


class HookDeadlineError(HookError):
    """A hook tried to write after its call's deadline: the write was refused."""


def check_deadline(target: str, value: str = "") -> None:
    """Raise ``HookDeadlineError`` (and log the refused write) when the hook call
    running in this context is past its deadline. A no-op outside hook calls."""
    deadline = HOOK_DEADLINE.get()
    if deadline is None:
        return
    late = time.monotonic() - deadline
    if late < 0:
        return
    log.warning("host_write_refused", target=target, value=value, late_seconds=round(late, 3),
                reason="the hook call is past its deadline")
    raise HookDeadlineError(f"writing {value!r} to {target} refused: the hook call is {late:.3f}s past its deadline")


class FailureCollector(Collector):
    """``koord_runtime_proxy_host_write_failures_total{cause}`` from a ``FailureCounter``."""

    def __init__(self, counter: FailureCounter) -> None:
        self._counter = counter

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "koord_runtime_proxy_host_write_failures",
            "Host (cgroup) writes the kernel refused, by cause (errno name).",
            labels=["cause"],
        )
        for cause, count in sorted(self._counter.counts().items()):
            family.add_metric([cause], count)
        yield family


def is_repeat(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) repeats a failure already
    logged (``HookError.repeat``): log it below warning."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, HookError) and seen.repeat:
            return True
        seen = seen.__cause__
    return False
