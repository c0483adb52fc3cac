"""structlog configuration and the per-request log context.

Every CRI call the proxy handles belongs to one pod/container and passes through
a chain of hooks; when a hook misbehaves on one node the only question that
matters is "which pod, which container, which hook". Binding those into
contextvars once per request makes every log line below carry them, without
threading a logger through every function. The output is JSON for journald and
log shippers, and human-readable when someone runs the proxy in a terminal.

The bind helpers write into the *current* context: gRPC aio runs each RPC in its
own task, and each task owns a copy of the context, so a binding made while
handling one request never leaks into another. Use ``scoped`` for a narrower
region (e.g. one hook call) that must be undone afterwards.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, TextIO

import structlog
from structlog.typing import Processor

LogFormat = Literal["auto", "json", "console"]

_LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def _level_number(level: str) -> int:
    try:
        return _LEVELS[level.strip().lower()]
    except KeyError:
        raise ValueError(
            f"unknown log level {level!r}; use one of {sorted(_LEVELS)}"
        ) from None


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or exotic stream objects
        return False


def _use_json(fmt: LogFormat, stream: TextIO) -> bool:
    if fmt == "auto":
        return not _is_tty(stream)
    if fmt in ("json", "console"):
        return fmt == "json"
    raise ValueError(f"unknown log format {fmt!r}")


def _processors(as_json: bool, stream: TextIO) -> list[Processor]:
    shared: list[Processor] = [
        # First, so pod/container/hook keys are there for every later processor.
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if as_json:
        # Tracebacks become a plain string field so one event stays one JSON line.
        return [
            *shared,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ]
    # ConsoleRenderer formats exceptions itself (and warns if format_exc_info ran).
    return [*shared, structlog.dev.ConsoleRenderer(colors=_is_tty(stream))]


def configure(
    *,
    level: str = "info",
    fmt: LogFormat = "auto",
    stream: TextIO | None = None,
) -> None:
    """(Re)configure structlog globally; safe to call again on config reload."""
    out = sys.stderr if stream is None else stream
    structlog.configure(
        processors=_processors(_use_json(fmt, out), out),
        wrapper_class=structlog.make_filtering_bound_logger(_level_number(level)),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        # Caching would pin module-level loggers to the first configuration, so
        # a reload could never change the level.
        cache_logger_on_first_use=False,
    )


def bind_pod(*, namespace: str, name: str, uid: str) -> None:
    """Tag the current context with the pod the CRI call is about."""
    structlog.contextvars.bind_contextvars(
        pod_namespace=namespace, pod_name=name, pod_uid=uid
    )


def bind_container(*, name: str, id: str) -> None:
    """Tag the current context with the container the CRI call is about."""
    structlog.contextvars.bind_contextvars(container_name=name, container_id=id)


def bind_hook(name: str) -> None:
    """Tag the current context with the hook that is running."""
    structlog.contextvars.bind_contextvars(hook=name)


@contextmanager
def scoped(**kv: Any) -> Iterator[None]:
    """Bind ``kv`` for the ``with`` block, then restore what was bound before
    (re-binding earlier values of the same keys, unbinding new ones)."""
    with structlog.contextvars.bound_contextvars(**kv):
        yield
