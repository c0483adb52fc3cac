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

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Final, Literal, TextIO

import structlog
from structlog.typing import EventDict, Processor

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
    """(Re)configure structlog globally; safe to call again on config reload.

    Also routes the standard library's ``logging`` (grpc, asyncio, sqlite helpers)
    through the same renderer, and installs ``sys.excepthook``,
    ``threading.excepthook`` and ``sys.unraisablehook``: nothing the process prints
    bypasses the JSON log.
    """
    out = sys.stderr if stream is None else stream
    as_json = _use_json(fmt, out)
    structlog.configure(
        processors=_processors(as_json, out),
        wrapper_class=structlog.make_filtering_bound_logger(_level_number(level)),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        # Caching would pin module-level loggers to the first configuration, so
        # a reload could never change the level.
        cache_logger_on_first_use=False,
    )
    _route_stdlib_logging(as_json, stream)
    sys.excepthook = _sys_excepthook
    threading.excepthook = _thread_excepthook
    sys.unraisablehook = _unraisable_hook


# --- nothing bypasses the JSON log -------------------------------------------------

#: A repeating error (the same logger and message, the same asyncio failure) is logged
#: once per this many seconds, with the number of repeats held back in between.
REPEAT_INTERVAL: Final = 10.0


class Throttle:
    """Lets an event through once per ``interval`` seconds per key and counts the
    repeats it held back: a failure that repeats thousands of times a second (an
    accept loop out of descriptors) must not become thousands of log lines."""

    def __init__(self, interval: float = REPEAT_INTERVAL, clock: Callable[[], float] = time.monotonic) -> None:
        self._interval = interval
        self._clock = clock
        self._next: dict[object, float] = {}
        self._held: dict[object, int] = {}

    def allow(self, key: object) -> int | None:
        """None to drop this occurrence; else how many were dropped since the last one."""
        now = self._clock()
        if now < self._next.get(key, float("-inf")):
            self._held[key] = self._held.get(key, 0) + 1
            return None
        if len(self._next) > 1024:  # keys come from messages: keep the table bounded
            self._next.clear()
            self._held.clear()
        self._next[key] = now + self._interval
        return self._held.pop(key, 0)


class _ThrottleFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self._throttle = Throttle()

    def filter(self, record: logging.LogRecord) -> bool:
        held = self._throttle.allow((record.name, record.levelno, str(record.msg)))
        if held is None:
            return False
        if held:
            record.repeats_suppressed = held
        return True


def _add_stdlib_extras(_logger: Any, _name: str, event_dict: EventDict) -> EventDict:
    record = event_dict.get("_record")
    if record is not None:
        event_dict.setdefault("logger", record.name)
        held = getattr(record, "repeats_suppressed", 0)
        if held:
            event_dict["repeats_suppressed"] = held
    return event_dict


_STDLIB_HANDLER_NAME: Final = "runtimeproxy-json"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time (it may be replaced after
    ``configure``, e.g. by a test runner's capture)."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


def _route_stdlib_logging(as_json: bool, stream: TextIO | None) -> None:
    """One handler on the root logger rendering records like structlog's own lines
    (warning and above: grpc and asyncio are chatty below that)."""
    renderer: Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    pre_chain: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_stdlib_extras,
    ]
    if as_json:
        pre_chain.append(structlog.processors.format_exc_info)
    handler: logging.StreamHandler = _StderrHandler() if stream is None else logging.StreamHandler(stream)  # type: ignore[type-arg]
    handler.set_name(_STDLIB_HANDLER_NAME)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=pre_chain,
        )
    )
    handler.addFilter(_ThrottleFilter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _STDLIB_HANDLER_NAME or _is_default_stream(h)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)


def _is_default_stream(handler: logging.Handler) -> bool:
    # logging.basicConfig's (or lastResort-like) plain-text stream handlers.
    plain = not isinstance(handler.formatter, structlog.stdlib.ProcessorFormatter)
    return type(handler) is logging.StreamHandler and plain


_crash_log = structlog.get_logger("runtimeproxy.crash")


def _sys_excepthook(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    _crash_log.critical("uncaught_exception", error=_describe(exc), exc_info=(exc_type, exc, tb))


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    exc = args.exc_value if args.exc_value is not None else args.exc_type()
    name = args.thread.name if args.thread is not None else None
    _crash_log.error(
        "thread_crashed", thread=name, error=_describe(exc), exc_info=(args.exc_type, exc, args.exc_traceback)
    )


def _unraisable_hook(args: Any) -> None:
    exc = args.exc_value
    _crash_log.error(
        "unraisable_exception", message=args.err_msg or "Exception ignored in", object=repr(args.object)[:200],
        error=_describe(exc) if exc is not None else None,
        exc_info=(args.exc_type, exc, args.exc_traceback) if exc is not None else None,
    )


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def install_loop_exception_handler(loop: asyncio.AbstractEventLoop) -> None:
    """Errors asyncio reports itself (a callback that raised, a task whose exception
    nobody retrieved, a transport failure) become rate-limited JSON lines instead of
    the default handler's plain-text traceback on stderr."""
    throttle = Throttle()

    def handler(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        message = str(context.get("message") or "unhandled error in the event loop")
        held = throttle.allow((message, type(exc)))
        if held is None:
            return
        fields: dict[str, Any] = {"message": message}
        if held:
            fields["repeats_suppressed"] = held
        task = context.get("task") or context.get("future")
        if task is not None:
            name = getattr(task, "get_name", None)
            fields["task"] = name() if callable(name) else repr(task)[:200]
        if isinstance(exc, BaseException):
            fields["error"] = _describe(exc)
            fields["exc_info"] = exc
        _crash_log.error("asyncio_error", **fields)

    loop.set_exception_handler(handler)


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
