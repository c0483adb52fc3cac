"""The HTTP endpoint's limits, over real TCP: a connection cap with bounded descriptors,
an idle timeout both ways, a descriptor reserve, and one warning for accept errors."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
import structlog
from prometheus_client import CollectorRegistry

from runtimeproxy.config import settings as config
from runtimeproxy.config.settings import ConfigError
from runtimeproxy.ops import fdlimits
from runtimeproxy.ops.httpendpoint import HttpEndpoint, HttpStats
from runtimeproxy.ops.promstats import ProxyMetrics

FLOOD = textwrap.dedent("""
    import socket, sys, time
    port, count = int(sys.argv[1]), int(sys.argv[2])
    if sys.argv[3:] == ["wait"]:
        sys.stdin.readline()
    held = []
    for _ in range(count):
        s = socket.socket()
        s.setblocking(False)  # past the backlog a connect would hang: knock and go on
        s.connect_ex(("127.0.0.1", port))
        held.append(s)
    print("connected", flush=True)
    time.sleep(3600)
""")


async def get(port: int, target: str = "/healthz", timeout: float = 5.0) -> tuple[int, bytes]:
    """GET, connect included within ``timeout`` (past a full backlog a connect hangs)."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(f"GET {target} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
            await writer.drain()
            data = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


async def wait_for(predicate: object, timeout: float, what: str) -> None:
    assert callable(predicate)
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def stats(registry: CollectorRegistry) -> HttpStats:
    return HttpStats(registry)


@pytest.fixture
def flood() -> Iterator[list[subprocess.Popen[str]]]:
    """Flooding clients in their own processes (so this process's descriptors count
    only the server side); killed by pid afterwards."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for pipe in (proc.stdout, proc.stdin):
            if pipe is not None:
                pipe.close()


def start_flood(
    procs: list[subprocess.Popen[str]], port: int, count: int, *, wait: bool = False
) -> subprocess.Popen[str]:
    args = [sys.executable, "-c", FLOOD, str(port), str(count)] + (["wait"] if wait else [])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
    procs.append(proc)
    return proc


async def connected(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
    assert line.strip() == "connected", line


@pytest_asyncio.fixture
async def make_endpoint(registry: CollectorRegistry, stats: HttpStats) -> AsyncIterator[object]:
    started: list[HttpEndpoint] = []

    async def make(**kwargs: object) -> HttpEndpoint:
        ep = HttpEndpoint("127.0.0.1", 0, registry, health=lambda: None, stats=stats, **kwargs)  # type: ignore[arg-type]
        await ep.start()
        started.append(ep)
        return ep

    yield make
    for ep in started:
        await ep.stop()


@pytest.mark.asyncio
async def test_connections_over_the_cap_are_not_accepted_and_fds_stay_bounded(
    make_endpoint, flood, registry: CollectorRegistry
) -> None:
    ep: HttpEndpoint = await make_endpoint(max_connections=4, idle_timeout=60.0, fd_reserve=0)
    first = start_flood(flood, ep.port, 30, wait=True)
    second = start_flood(flood, ep.port, 30, wait=True)
    baseline = fdlimits.open_fds()  # with the flooders' pipes
    for proc in (first, second):
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    await connected(first)
    await connected(second)
    await wait_for(lambda: ep.open_connections == 4, 5.0, "the cap to be reached")
    await asyncio.sleep(0.5)  # would an uncapped server take more?

    assert ep.open_connections == 4
    assert fdlimits.open_fds() - baseline <= 4 + 2, "60 waiting clients cost the server no descriptor"
    assert registry.get_sample_value("koord_runtime_proxy_http_connections") == 4
    assert registry.get_sample_value("koord_runtime_proxy_http_accept_paused_total",
                                      {"reason": "max_connections"}) >= 1
    with pytest.raises(TimeoutError):  # a new client waits behind the cap ...
        await get(ep.port, timeout=0.5)

    for proc in flood:
        os.kill(proc.pid, signal.SIGKILL)
    # ... and is served once the flooders' connections are gone.
    assert await get(ep.port, timeout=10.0) == (200, b"ok\n")
    await wait_for(lambda: ep.open_connections == 0, 10.0, "every connection to close")
    assert fdlimits.open_fds() - baseline <= 2


@pytest.mark.asyncio
async def test_idle_client_is_closed_after_the_timeout(make_endpoint, registry: CollectorRegistry) -> None:
    ep: HttpEndpoint = await make_endpoint(idle_timeout=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", ep.port)  # sends nothing at all
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with asyncio.timeout(5):
        data = await reader.read()
    writer.close()
    await writer.wait_closed()
    assert data.startswith(b"HTTP/1.1 408 ")
    assert 0.25 <= loop.time() - started < 3.0
    await wait_for(lambda: ep.open_connections == 0, 5.0, "the connection to be dropped")
    assert registry.get_sample_value("koord_runtime_proxy_http_idle_timeouts_total") == 1


@pytest.mark.asyncio
async def test_client_that_never_reads_its_response_is_dropped(make_endpoint, registry: CollectorRegistry) -> None:
    big = b"# HELP big x\n# TYPE big gauge\n" + b"big 1.0\n" * (4 << 20)  # 32 MiB: fills every buffer
    ep: HttpEndpoint = await make_endpoint(idle_timeout=0.5, expositions=[lambda: big])
    reader, writer = await asyncio.open_connection("127.0.0.1", ep.port)
    writer.transport.set_write_buffer_limits(0)
    writer.write(b"GET /metrics HTTP/1.1\r\n\r\n")
    await writer.drain()  # ... and never read
    await wait_for(lambda: ep.open_connections == 0, 10.0, "the stalled reader to be dropped")
    assert registry.get_sample_value("koord_runtime_proxy_http_idle_timeouts_total") == 1
    writer.transport.abort()
    del reader


@pytest.mark.asyncio
async def test_nothing_is_accepted_while_free_fds_are_under_the_reserve(
    make_endpoint, registry: CollectorRegistry
) -> None:
    free = [10]
    ep: HttpEndpoint = await make_endpoint(fd_reserve=64, free_fds=lambda: free[0])
    waiting = asyncio.create_task(get(ep.port, timeout=10.0))
    await asyncio.sleep(0.6)
    assert not waiting.done() and ep.open_connections == 0
    assert registry.get_sample_value("koord_runtime_proxy_http_accept_paused_total", {"reason": "fd_reserve"}) == 1
    free[0] = 1000  # descriptors came back: the waiting client is served within a recheck
    assert await waiting == (200, b"ok\n")


def exhaust_fds(hard: int) -> list[int]:
    """Lower the soft limit to just above the highest open descriptor and fill every
    hole below it: the next descriptor anyone asks for fails with EMFILE."""
    top = max(int(name) for name in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1, hard))
    fillers = []
    while True:
        try:
            fillers.append(os.open("/dev/null", os.O_RDONLY))
        except OSError as exc:
            assert exc.errno == errno.EMFILE
            return fillers


@pytest.mark.asyncio
async def test_accept_out_of_descriptors_is_one_warning_and_a_counter(
    make_endpoint, flood, registry: CollectorRegistry
) -> None:
    """A real EMFILE: this process's soft limit lowered to what it holds, a client
    in another process knocking; one warning however often accept() fails."""
    ep: HttpEndpoint = await make_endpoint(fd_reserve=0)
    proc = start_flood(flood, ep.port, 1, wait=True)
    assert proc.stdin is not None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with structlog.testing.capture_logs() as logs:
        fillers = exhaust_fds(hard)
        try:
            proc.stdin.write("go\n")  # the client knocks only now: the server has no descriptor left
            proc.stdin.flush()
            await asyncio.sleep(2.2)  # the loop retries every 0.5 s
        finally:
            for fd in fillers:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        await wait_for(lambda: ep.open_connections == 1, 5.0, "the client to be accepted once fds are back")
    failures = registry.get_sample_value("koord_runtime_proxy_http_accept_errors_total", {"error": "EMFILE"})
    assert failures is not None and failures >= 3
    warnings = [e for e in logs if e["event"] == "http_accept_failed"]
    assert len(warnings) == 1, logs
    assert warnings[0]["error"] == "EMFILE" and warnings[0]["log_level"] == "warning"


def test_soft_nofile_limit_is_raised_to_the_hard_limit() -> None:
    code = (
        "import resource\n"
        "from runtimeproxy.ops import fdlimits\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "print(fdlimits.raise_nofile_limit(), hard, fdlimits.nofile_limit())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    raised, hard, now = out.stdout.split(") ")[0] + ")", *out.stdout.split(") ")[1].split()
    assert raised == f"(256, {hard})" and now == hard


def test_limits_are_configured_under_metrics() -> None:
    settings = config.from_mapping({"metrics": {"max_connections": 8, "idle_timeout": "250ms", "fd_reserve": 0}})
    assert (settings.metrics_max_connections, settings.metrics_idle_timeout, settings.metrics_fd_reserve) == (
        8, 0.25, 0)
    default = config.from_mapping({})
    assert (default.metrics_max_connections, default.metrics_idle_timeout, default.metrics_fd_reserve) == (
        64, 5.0, 256)


@pytest.mark.parametrize(("key", "value"), [
    ("max_connections", 0), ("max_connections", "many"), ("max_connections", True), ("max_connections", 1.5),
    ("idle_timeout", "0s"), ("idle_timeout", "-1s"), ("idle_timeout", "soon"),
    ("fd_reserve", -1), ("fd_reserve", "256"),
])
def test_bad_limits_name_key_and_value(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        config.from_mapping({"metrics": {key: value}})
    assert err.value.key_path == f"metrics.{key}" and err.value.value == value
    assert str(err.value).startswith(f"metrics.{key}: ") and f"(got {value!r})" in str(err.value)


def test_process_descriptors_are_exported() -> None:
    registry = CollectorRegistry()
    ProxyMetrics(registry)
    open_fds = registry.get_sample_value("process_open_fds")
    assert open_fds is not None and abs(open_fds - fdlimits.open_fds()) <= 2
    assert registry.get_sample_value("process_max_fds") == fdlimits.nofile_limit()
