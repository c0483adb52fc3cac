"""logsetup tests: JSON lines carry the bound context, levels filter, scoped restores."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from runtimeproxy.ops import logsetup


@pytest.fixture(autouse=True)
def clean_structlog() -> Iterator[None]:
    structlog.contextvars.clear_contextvars()
    yield
    structlog.contextvars.clear_contextvars()
    structlog.reset_defaults()


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line]


def test_json_output_contains_bound_pod_container_and_hook() -> None:
    out = io.StringIO()
    logsetup.configure(fmt="json", stream=out)
    logsetup.bind_pod(namespace="default", name="web-0", uid="u-1")
    logsetup.bind_container(name="nginx", id="c0ffee")
    logsetup.bind_hook("cpuset")

    structlog.get_logger().info("hook_applied", changed=2)

    (event,) = lines(out)
    assert event["event"] == "hook_applied"
    assert event["changed"] == 2
    assert event["level"] == "info"
    assert event["pod_namespace"] == "default"
    assert event["pod_name"] == "web-0"
    assert event["pod_uid"] == "u-1"
    assert event["container_name"] == "nginx"
    assert event["container_id"] == "c0ffee"
    assert event["hook"] == "cpuset"
    assert event["timestamp"].endswith("Z")


def test_auto_format_is_json_for_non_tty_stream() -> None:
    out = io.StringIO()
    logsetup.configure(stream=out)
    structlog.get_logger().warning("hello")
    assert lines(out)[0]["event"] == "hello"


def test_console_format_is_not_json() -> None:
    out = io.StringIO()
    logsetup.configure(fmt="console", stream=out)
    structlog.get_logger().info("hello", pod_name="web-0")
    text = out.getvalue()
    assert "hello" in text and "web-0" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_level_filtering_and_reconfigure_applies_to_existing_logger() -> None:
    out = io.StringIO()
    log = structlog.get_logger()  # created before configure, like a module-level logger
    logsetup.configure(level="warning", fmt="json", stream=out)
    log.info("dropped")
    log.warning("kept")
    assert [e["event"] for e in lines(out)] == ["kept"]

    logsetup.configure(level="DEBUG", fmt="json", stream=out)
    log.debug("now_visible")
    assert [e["event"] for e in lines(out)] == ["kept", "now_visible"]


def test_exception_is_rendered_into_the_json_line() -> None:
    out = io.StringIO()
    logsetup.configure(fmt="json", stream=out)
    try:
        raise RuntimeError("cgroup write failed")
    except RuntimeError:
        structlog.get_logger().exception("hook_failed")
    (event,) = lines(out)
    assert "RuntimeError: cgroup write failed" in event["exception"]


def test_unknown_level_and_format_rejected() -> None:
    with pytest.raises(ValueError):
        logsetup.configure(level="verbose", stream=io.StringIO())
    with pytest.raises(ValueError):
        logsetup.configure(fmt="xml", stream=io.StringIO())  # type: ignore[arg-type]


def test_scoped_restores_previous_values() -> None:
    logsetup.bind_hook("outer")
    with logsetup.scoped(hook="inner", attempt=1):
        ctx = structlog.contextvars.get_contextvars()
        assert ctx["hook"] == "inner"
        assert ctx["attempt"] == 1
    ctx = structlog.contextvars.get_contextvars()
    assert ctx["hook"] == "outer"
    assert "attempt" not in ctx


def test_scoped_restores_on_exception() -> None:
    with pytest.raises(KeyError), logsetup.scoped(container_id="abc"):
        raise KeyError("x")
    assert "container_id" not in structlog.contextvars.get_contextvars()


def test_the_cli_process_renders_tracebacks_without_rich() -> None:
    """The CLI keeps structlog from importing rich (installed in a dev venv, ~4 MiB
    resident); console logs still carry the traceback, rendered plainly."""
    code = (
        "import sys\n"
        "import runtimeproxy.cli\n"
        "import structlog\n"
        "from runtimeproxy.ops import logsetup\n"
        "assert sys.modules['rich'] is None, 'rich importable'\n"
        "logsetup.configure(level='info', fmt='console')\n"
        "try:\n"
        "    1 / 0\n"
        "except ZeroDivisionError:\n"
        "    structlog.get_logger('t').exception('boom')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout + done.stderr
    assert "boom" in out and "ZeroDivisionError: division by zero" in out and "Traceback" in out, out


CRASHES = '''
import asyncio, logging, sys, threading
from runtimeproxy.ops import logsetup

logsetup.configure(level="info", fmt="json")

def thread_body():
    raise RuntimeError("thread bug")

t = threading.Thread(target=thread_body, name="worker-1")
t.start()
t.join()

async def main():
    logsetup.install_loop_exception_handler(asyncio.get_running_loop())
    async def task_bug():
        raise ValueError("task bug")
    task = asyncio.create_task(task_bug(), name="side-job")
    await asyncio.sleep(0.05)
    del task  # never awaited: asyncio reports it through the loop's handler
    import gc; gc.collect()
    for _ in range(500):  # a storm: one line, with the count held back
        asyncio.get_running_loop().call_soon(lambda: 1 / 0)
    await asyncio.sleep(0.05)

asyncio.run(main())
for i in range(1000):
    try:
        raise OSError(24, "Too many open files")
    except OSError:
        logging.getLogger("asyncio").error("socket.accept() out of system resource", exc_info=True)
logging.getLogger("grpc._cython.cygrpc").warning("%s: %s", "grpc", "said something")
raise SystemError("main bug")
'''


def test_every_crash_and_stdlib_record_is_one_json_line() -> None:
    """Thread, task, loop callback, stdlib logging (asyncio, grpc) and an uncaught
    exception in main: each a JSON line with its traceback inside; a storm of the same
    error is one line (the repeats are counted, not printed)."""
    done = subprocess.run([sys.executable, "-c", CRASHES], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    out = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    records = [json.loads(line) for line in out]  # every line is JSON: no plain traceback
    by_event: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_event.setdefault(rec["event"], []).append(rec)

    (thread,) = by_event["thread_crashed"]
    assert thread["thread"] == "worker-1" and "RuntimeError: thread bug" in thread["exception"]
    loop_errors = by_event["asyncio_error"]
    task_errors = [r for r in loop_errors if r.get("task") == "side-job"]
    assert len(task_errors) == 1 and "ValueError: task bug" in task_errors[0]["exception"]
    callback_errors = [r for r in loop_errors if "ZeroDivisionError" in r.get("error", "")]
    assert len(callback_errors) == 1, "500 identical loop errors are one line"
    accept = by_event["socket.accept() out of system resource"]
    assert len(accept) == 1 and accept[0]["logger"] == "asyncio" and accept[0]["level"] == "error"
    assert "OSError: [Errno 24] Too many open files" in accept[0]["exception"]
    assert by_event["grpc: said something"][0]["logger"] == "grpc._cython.cygrpc"
    (uncaught,) = by_event["uncaught_exception"]
    assert uncaught["level"] == "critical" and "SystemError: main bug" in uncaught["exception"]
    assert len(records) < 12


def test_throttle_counts_what_it_held_back() -> None:
    now = [0.0]
    throttle = logsetup.Throttle(10.0, clock=lambda: now[0])
    assert throttle.allow("k") == 0
    assert [throttle.allow("k") for _ in range(3)] == [None, None, None]
    assert throttle.allow("other") == 0
    now[0] = 10.0
    assert throttle.allow("k") == 3
    assert throttle.allow("k") is None
