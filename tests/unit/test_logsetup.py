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

from runtimeproxy import logsetup


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
        "from runtimeproxy import logsetup\n"
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
