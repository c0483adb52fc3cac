"""Shared fixtures for the in-process proxy tests.

* ``FakeRuntime``: a fake containerd, i.e. a grpc.aio server on a unix socket with
  one generic handler that records the raw request bytes, the invocation metadata
  and the deadline it saw, and answers configurable raw bytes, statuses and
  metadata (unary and server-streaming, including methods no CRI version knows).
* ``start_proxy``: the real ``runtimeproxy.app.App`` on a unix socket in front of
  a fake runtime, with a raw-bytes grpc.aio client channel to it.
* ``hook_module``: a plugin module written to a temp dir and put on ``sys.path``,
  so hooks are configured exactly as operators configure them (``module:attr``).
* ``FakeHookServer``: a minimal Koordinator RuntimeHookService v1alpha1 server.

Tests never import from ``tests``: everything shared is reached through fixtures; the one
exception is ``tests/kubeapi.py``, the local API server stand-in shared with bench/.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import grpc.aio
import pytest
import pytest_asyncio
import structlog
import yaml

from criapi import cri_v1_pb2 as cri
from criapi import hook_v1alpha1_pb2 as hookpb
from criapi import hook_v1alpha1_pb2_grpc as hookpb_grpc
from runtimeproxy.app import App
from runtimeproxy.config import settings as config
from runtimeproxy.config.confignet import find_haproxy
from tests import tmpnames

RT = "/runtime.v1.RuntimeService/"
IMG = "/runtime.v1.ImageService/"
EVENTS_METHOD = RT + "GetContainerEvents"
FUTURE_UNARY = RT + "SomeFutureMethod"
FUTURE_STREAM = "/runtime.v1.RuntimeService/SomeFutureStream"
STREAMING_METHODS = frozenset({EVENTS_METHOD, FUTURE_STREAM})
BIG_MESSAGES = 32 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", BIG_MESSAGES),
    ("grpc.max_receive_message_length", BIG_MESSAGES),
]


# ---------------------------------------------------------------------------
# Protobuf wire helpers (exposed through the ``wire`` fixture)
# ---------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _length_delimited(number: int, payload: bytes) -> bytes:
    """One length-delimited field (wire type 2), e.g. an unknown string or a sub-message."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _rpc_status(code: int, message: str) -> bytes:
    """A serialized google.rpc.Status (code=1, message=2) as grpc-status-details-bin carries it."""
    return _varint(1 << 3) + _varint(code) + _length_delimited(2, message.encode())


class Wire:
    varint = staticmethod(_varint)
    field = staticmethod(_length_delimited)
    rpc_status = staticmethod(_rpc_status)


@pytest.fixture
def wire() -> type[Wire]:
    return Wire


# ---------------------------------------------------------------------------
# Fake containerd
# ---------------------------------------------------------------------------


@dataclass
class Answer:
    """How the fake answers one method. ``code`` None means OK."""

    payload: bytes = b""
    code: grpc.StatusCode | None = None
    details: str = ""
    initial_metadata: tuple[tuple[str, str | bytes], ...] = ()
    trailing_metadata: tuple[tuple[str, str | bytes], ...] = ()
    delay: float = 0.0
    #: Messages of a server-streaming answer.
    stream: tuple[bytes, ...] = ()


@dataclass
class Received:
    method: str
    payload: bytes
    metadata: tuple[tuple[str, str | bytes], ...]
    time_remaining: float | None

    def md(self, key: str) -> list[str | bytes]:
        return [v for k, v in self.metadata if k == key]


AnswerSource = Answer | Callable[[bytes], Answer]


def event(container_id: str, kind: int) -> bytes:
    return cri.ContainerEventResponse(
        container_id=container_id, container_event_type=kind, created_at=1000 + kind
    ).SerializeToString()


def _default_answers() -> dict[str, AnswerSource]:
    empty = Answer()
    answers: dict[str, AnswerSource] = {
        RT + "Version": Answer(
            cri.VersionResponse(
                version="0.1.0", runtime_name="fake-containerd", runtime_version="v1.7-fake",
                runtime_api_version="v1",
            ).SerializeToString()
        ),
        RT + "ListPodSandbox": empty,
        RT + "ListContainers": empty,
        RT + "RunPodSandbox": Answer(cri.RunPodSandboxResponse(pod_sandbox_id="sb-1").SerializeToString()),
        RT + "CreateContainer": Answer(cri.CreateContainerResponse(container_id="ctr-1").SerializeToString()),
        RT + "PodSandboxStatus": Answer(code=grpc.StatusCode.NOT_FOUND, details="sandbox not found"),
        RT + "ContainerStatus": Answer(code=grpc.StatusCode.NOT_FOUND, details="container not found"),
        EVENTS_METHOD: Answer(stream=tuple(event(f"c{i}", i) for i in range(3))),
    }
    for name in (
        "StartContainer", "StopContainer", "RemoveContainer", "StopPodSandbox", "RemovePodSandbox",
        "UpdateContainerResources", "Status",
    ):
        answers[RT + name] = empty
    return answers


class FakeRuntime:
    """A raw-bytes fake of containerd's CRI endpoint. Methods without an answer
    are UNIMPLEMENTED, as in a real server."""

    def __init__(self) -> None:
        self.answers: dict[str, AnswerSource] = _default_answers()
        self.calls: list[Received] = []
        self.path: Path | None = None
        self._server: grpc.aio.Server | None = None

    # -- configuration and inspection --

    def answer(self, method: str, source: AnswerSource) -> None:
        self.answers[method] = source

    def received(self, method: str) -> list[Received]:
        return [c for c in self.calls if c.method == method]

    def requests(self, method: str, message_type: type[Any]) -> list[Any]:
        return [message_type.FromString(c.payload) for c in self.received(method)]

    def methods(self) -> list[str]:
        return [c.method for c in self.calls]

    # -- server --

    async def start(self, path: Path) -> None:
        server = grpc.aio.server(options=CHANNEL_OPTIONS)
        server.add_generic_rpc_handlers((_FakeHandler(self),))
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        self.path, self._server = path, server

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(None)
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    # -- handlers --

    def _record(self, method: str, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Answer:
        metadata = tuple((m.key, m.value) for m in context.invocation_metadata() or ())
        self.calls.append(Received(method, request, metadata, context.time_remaining()))
        source = self.answers[method]
        return source(request) if callable(source) else source

    async def unary(self, method: str, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        answer = self._record(method, request, context)
        if answer.delay:
            await asyncio.sleep(answer.delay)
        if answer.initial_metadata:
            await context.send_initial_metadata(answer.initial_metadata)
        if answer.code is not None:
            await context.abort(answer.code, answer.details, answer.trailing_metadata)
        if answer.trailing_metadata:
            context.set_trailing_metadata(answer.trailing_metadata)
        return answer.payload

    async def stream(
        self, method: str, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        answer = self._record(method, request, context)
        if answer.initial_metadata:
            await context.send_initial_metadata(answer.initial_metadata)
        for message in answer.stream:
            yield message
        if answer.code is not None:
            await context.abort(answer.code, answer.details, answer.trailing_metadata)
        if answer.trailing_metadata:
            context.set_trailing_metadata(answer.trailing_metadata)


class _FakeHandler(grpc.GenericRpcHandler):
    def __init__(self, fake: FakeRuntime) -> None:
        self._fake = fake

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if method not in self._fake.answers:
            return None
        fake = self._fake
        if method in STREAMING_METHODS:

            async def stream(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[bytes]:
                async for message in fake.stream(method, request, context):
                    yield message

            return grpc.unary_stream_rpc_method_handler(stream)

        async def unary(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            return await fake.unary(method, request, context)

        return grpc.unary_unary_rpc_method_handler(unary)


def need_haproxy() -> None:
    """Skip without haproxy, except under CI (scripts/setup-host.sh installs it): fail there."""
    if find_haproxy() is None:
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail("haproxy is not installed; scripts/setup-host.sh installs it (apt install haproxy)")
        pytest.skip("haproxy is not installed (apt install haproxy)")


@pytest.fixture(params=["grpc", "haproxy"])
def plane(request: pytest.FixtureRequest) -> str:
    """Each data plane in turn (``data_plane=`` for ``start_proxy``)."""
    if request.param == "haproxy":
        need_haproxy()
    return str(request.param)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """Unix socket paths are limited to ~107 bytes; tmp_path may be longer."""
    path = tmpnames.mkdtemp()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest_asyncio.fixture
async def fake_runtime(short_dir: Path) -> AsyncIterator[FakeRuntime]:
    fake = FakeRuntime()
    await fake.start(short_dir / "ctrd.sock")
    yield fake
    await fake.stop()


@pytest_asyncio.fixture
async def idle_runtime() -> AsyncIterator[FakeRuntime]:
    """A fake runtime that is not serving yet: the test calls ``start(path)``."""
    fake = FakeRuntime()
    yield fake
    await fake.stop()


@pytest.fixture
def answer() -> type[Answer]:
    """The ``Answer`` type, for ``fake.answer(method, answer(payload=...))``."""
    return Answer


# ---------------------------------------------------------------------------
# The proxy under test
# ---------------------------------------------------------------------------


async def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
def wait_until() -> Callable[[Callable[[], bool], float, str], Awaitable[None]]:
    return wait_for


@dataclass
class Proxy:
    app: App
    task: asyncio.Task[int]
    channel: grpc.aio.Channel
    socket: Path
    fake: FakeRuntime
    config_path: Path | None = None

    async def call(
        self, method: str, payload: bytes = b"", *, timeout: float | None = 5.0,
        metadata: Sequence[tuple[str, str | bytes]] | None = None,
    ) -> bytes:
        try:
            response: bytes = await self.channel.unary_unary(method)(payload, timeout=timeout, metadata=metadata)
        finally:
            await self.app.lifecycle.posts.settle()  # Post stages run after the reply: tests read what they did
        return response

    def unary(self, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
        return self.channel.unary_unary(method)

    def unary_stream(self, method: str) -> grpc.aio.UnaryStreamMultiCallable:
        return self.channel.unary_stream(method)

    def sample(self, name: str, labels: dict[str, str]) -> float:
        value = self.app.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def calls_total(self, method: str, path: str) -> float:
        return self.sample("koord_runtime_proxy_cri_calls_total", {"method": method, "path": path})

    async def http_get(self, target: str) -> tuple[int, bytes]:
        """A GET against the proxy's metrics/debug endpoint, on the loop (the
        endpoint runs on this loop, so a blocking client would deadlock)."""
        assert self.app.http is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", self.app.http.port)
        writer.write(f"GET {target} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout=5)
        writer.close()
        await writer.wait_closed()
        head, _, body = raw.partition(b"\r\n\r\n")
        return int(head.split(b" ")[1]), body


ProxyFactory = Callable[..., Awaitable[Proxy]]


def _listening(app: App, socket: Path) -> bool:
    """Both endpoints bound: the gRPC socket file appears before the metrics/health
    endpoint is started, so the socket alone does not make ``http_get`` safe yet."""
    if not socket.exists():
        return False
    if not app.settings.metrics_listen:
        return True
    try:
        return app.http is not None and app.http.port > 0
    except RuntimeError:  # constructed, not started yet
        return False


def proxy_settings(
    dir_: Path, backend_path: Path, hooks: Sequence[dict[str, Any]] = (), **extra: Any
) -> dict[str, Any]:
    data: dict[str, Any] = {
        "listen": str(dir_ / "p.sock"),
        "backend": {"runtime_endpoint": str(backend_path), "max_reconnect_backoff": "500ms"},
        "metrics": {"listen": "127.0.0.1:0"},
        "hookserver_dir": "",
        "hooks": list(hooks),
        "shutdown_grace": "1s",
        "reload_poll_interval": "1h",
        "state_dir": str(dir_ / "state"),  # never the host's /var/lib
        # The lifecycle layer's tests run on the in-process transport; the data-plane tests
        # (test_dataplane_wire, test_dataplane_metrics) ask for each data plane.
        "data_plane": "grpc",
    }
    data.update(extra)
    return data


@pytest_asyncio.fixture
async def start_proxy(short_dir: Path) -> AsyncIterator[ProxyFactory]:
    """``await start_proxy(fake, hooks=[...], backend_path=None, wait_ready=True, config_file=False,
    **top_level_settings)``: the App in front of ``fake`` (or of ``backend_path``)."""
    started: list[Proxy] = []
    saved_logging = structlog.get_config()

    async def start(
        fake: FakeRuntime,
        *,
        hooks: Sequence[dict[str, Any]] = (),
        backend_path: Path | None = None,
        wait_ready: bool = True,
        config_file: bool = False,
        **extra: Any,
    ) -> Proxy:
        backend_path = backend_path if backend_path is not None else fake.path
        assert backend_path is not None
        data = proxy_settings(short_dir, backend_path, hooks, **extra)
        config_path: Path | None = None
        if config_file:
            config_path = short_dir / "config.yaml"
            config_path.write_text(yaml.safe_dump(data))
            settings = config.load(config_path)
        else:
            settings = config.from_mapping(data)
        app = App(settings, config_path=config_path, overrides={})
        task = asyncio.create_task(app.run(install_signals=False))
        socket = Path(settings.listen)
        channel = grpc.aio.insecure_channel(f"unix://{socket}", options=CHANNEL_OPTIONS)
        proxy = Proxy(app, task, channel, socket, fake, config_path)
        started.append(proxy)
        ready = (lambda: app.ready or task.done()) if wait_ready else (lambda: _listening(app, socket) or task.done())
        await wait_for(ready, 10.0, "the proxy to start")
        if task.done():
            task.result()  # surface a start-up exception
            raise AssertionError("the proxy stopped during start-up")
        return proxy

    yield start
    try:
        for proxy in started:
            await proxy.channel.close()
            proxy.app.request_stop()
            assert await asyncio.wait_for(proxy.task, timeout=15) == 0
    finally:
        structlog.configure(**saved_logging)


# ---------------------------------------------------------------------------
# Hook plugins, as an operator would install them: a module on sys.path
# ---------------------------------------------------------------------------

HOOK_MODULE_SOURCE = '''
"""Test hooks. Each records what it saw in EVENTS: (hook name, stage, context)."""

import asyncio
import time

from runtimeproxy.hookapi import (
    ContainerContext, ContainerPatch, HookConfigError, HookError, PodPatch, ResourcesPatch,
)

EVENTS = []
ENDED = []


def seen(hook):
    return [ctx for name, _, ctx in EVENTS if name == hook]


class Tagger:
    """Appends its name to the comma-separated annotation args.key (default "order")."""

    def __init__(self, init):
        self.name = init.name
        self.key = init.args.get("key", "order")

    def _tagged(self, annotations):
        before = annotations.get(self.key, "")
        return {self.key: f"{before},{self.name}" if before else self.name}

    def pre_run_pod_sandbox(self, ctx):
        EVENTS.append((self.name, ctx.stage.value, ctx))
        return PodPatch(annotations=self._tagged(ctx.pod.annotations), reason=f"tag by {self.name}")

    def pre_create_container(self, ctx):
        EVENTS.append((self.name, ctx.stage.value, ctx))
        return ContainerPatch(annotations=self._tagged(ctx.container.annotations), reason=f"tag by {self.name}")


class Patcher:
    """Returns the patch described by its args (cpu_shares, cpuset_cpus, envs, annotations, cgroup_parent)."""

    def __init__(self, init):
        unknown = set(init.args) - {"cpu_shares", "cpuset_cpus", "envs", "annotations", "cgroup_parent", "reason"}
        if unknown:
            raise HookConfigError(f"{init.key_path}.{sorted(unknown)[0]}", sorted(unknown), "unknown key")
        self.name = init.name
        self.args = dict(init.args)

    def _resources(self):
        if "cpu_shares" not in self.args and "cpuset_cpus" not in self.args:
            return None
        return ResourcesPatch(cpu_shares=self.args.get("cpu_shares"), cpuset_cpus=self.args.get("cpuset_cpus"))

    def pre_run_pod_sandbox(self, ctx):
        EVENTS.append((self.name, ctx.stage.value, ctx))
        return PodPatch(
            annotations=self.args.get("annotations"), cgroup_parent=self.args.get("cgroup_parent"),
            reason=self.args.get("reason", self.name),
        )

    def pre_create_container(self, ctx):
        EVENTS.append((self.name, ctx.stage.value, ctx))
        return ContainerPatch(
            annotations=self.args.get("annotations"), envs=self.args.get("envs"), resources=self._resources(),
            reason=self.args.get("reason", self.name),
        )


class Failer:
    def __init__(self, init):
        self.name = init.name

    def pre_run_pod_sandbox(self, ctx):
        EVENTS.append((self.name, ctx.stage.value, ctx))
        raise HookError("refusing on purpose")

    def pre_create_container(self, ctx):
        EVENTS.append((self.name, ctx.stage.value, ctx))
        raise HookError("refusing on purpose")

    def post_run_pod_sandbox(self, ctx):
        EVENTS.append((self.name, ctx.stage.value, ctx))
        raise HookError("too late to refuse")


class Sleeper:
    """Async: sleeps args.seconds, then tags the annotation "slept"."""

    def __init__(self, init):
        self.name = init.name
        self.seconds = float(init.args.get("seconds", 1.0))

    async def pre_run_pod_sandbox(self, ctx):
        EVENTS.append((self.name, ctx.stage.value, ctx))
        try:
            await asyncio.sleep(self.seconds)
        finally:  # finished, timed out or cancelled: when did it stop?
            ENDED.append((self.name, time.monotonic()))
        return PodPatch(annotations={"slept": self.name})


class PostSleeper:
    """Sync: PostRunPodSandbox sleeps args.seconds; every stage notes when it ended in ENDED."""

    def __init__(self, init):
        self.name = init.name
        self.seconds = float(init.args.get("seconds", 1.0))

    def post_run_pod_sandbox(self, ctx):
        EVENTS.append((self.name, ctx.stage.value, ctx))
        time.sleep(self.seconds)
        ENDED.append((f"{ctx.stage.value}:{ctx.pod.meta.uid}", time.monotonic()))

    def pre_create_container(self, ctx):
        EVENTS.append((self.name, ctx.stage.value, ctx))
        ENDED.append((f"{ctx.stage.value}:{ctx.pod.meta.uid}", time.monotonic()))

    def post_create_container(self, ctx):
        EVENTS.append((self.name, ctx.stage.value, ctx))
        time.sleep(self.seconds)
        ENDED.append((f"{ctx.stage.value}:{ctx.pod.meta.uid}", time.monotonic()))


class SyncSleeper:
    """Blocking sleep in the hook thread (the chain must not wait for it past its timeout)."""

    def __init__(self, init):
        self.name = init.name
        self.seconds = float(init.args.get("seconds", 1.0))

    def pre_run_pod_sandbox(self, ctx):
        EVENTS.append((self.name, ctx.stage.value, ctx))
        time.sleep(self.seconds)
        return PodPatch(annotations={"slept": self.name})


class Observer:
    """Records every stage it is called for; changes nothing."""

    def __init__(self, init):
        self.name = init.name

    def _see(self, ctx):
        EVENTS.append((self.name, ctx.stage.value, ctx))

    pre_run_pod_sandbox = post_run_pod_sandbox = _see
    pre_stop_pod_sandbox = post_stop_pod_sandbox = _see
    pre_remove_pod_sandbox = post_remove_pod_sandbox = _see
    pre_create_container = post_create_container = _see
    pre_start_container = post_start_container = _see
    pre_update_container_resources = post_update_container_resources = _see
    pre_stop_container = post_stop_container = _see
    pre_remove_container = post_remove_container = _see


class NoStages:
    def __init__(self, init):
        self.name = init.name


def not_a_factory_value():
    return None


NOT_CALLABLE = 42
'''


@dataclass
class HookModule:
    name: str
    module: ModuleType

    def plugin(self, attr: str) -> str:
        return f"{self.name}:{attr}"

    @property
    def events(self) -> list[tuple[str, str, Any]]:
        events: list[tuple[str, str, Any]] = self.module.EVENTS
        return events

    @property
    def ended(self) -> list[tuple[str, float]]:
        """(hook, time.monotonic()) when an async Sleeper stopped sleeping."""
        ended: list[tuple[str, float]] = self.module.ENDED
        return ended

    def seen(self, hook: str) -> list[Any]:
        return [ctx for name, _, ctx in self.events if name == hook]


@pytest.fixture
def hook_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HookModule]:
    """A fresh plugin module per test (unique name, so no state leaks between tests)."""
    name = f"krp_test_hooks_{uuid.uuid4().hex[:12]}"
    directory = tmp_path / "plugins"
    directory.mkdir()
    (directory / f"{name}.py").write_text(HOOK_MODULE_SOURCE)
    monkeypatch.syspath_prepend(str(directory))
    module = importlib.import_module(name)
    yield HookModule(name, module)
    sys.modules.pop(name, None)


# ---------------------------------------------------------------------------
# Koordinator hook servers (RuntimeHookService v1alpha1)
# ---------------------------------------------------------------------------


@dataclass
class FakeHookServer(hookpb_grpc.RuntimeHookServiceServicer):
    """Answers like koordlet (response pre-filled from the request) plus its own
    change: containers get ``cpuset`` and the annotation ``<name>=yes``, pods the
    annotation. Records every request."""

    name: str
    cpuset: str = "2-3"
    calls: list[tuple[str, Any]] = field(default_factory=list)

    async def PreRunPodSandboxHook(self, request: Any, context: Any) -> Any:
        self.calls.append(("PreRunPodSandboxHook", request))
        resp = hookpb.PodSandboxHookResponse(
            labels=request.labels, annotations=request.annotations, cgroup_parent=request.cgroup_parent
        )
        resp.annotations[self.name] = "yes"
        return resp

    async def PreCreateContainerHook(self, request: Any, context: Any) -> Any:
        self.calls.append(("PreCreateContainerHook", request))
        resp = hookpb.ContainerResourceHookResponse(
            container_annotations=request.container_annotations,
            container_envs=request.container_envs,
            pod_cgroup_parent=request.pod_cgroup_parent,
        )
        resp.container_resources.CopyFrom(request.container_resources)
        resp.container_resources.cpuset_cpus = self.cpuset
        resp.container_annotations[self.name] = "yes"
        return resp


@pytest_asyncio.fixture
async def hook_servers() -> AsyncIterator[Callable[[Path, str], Awaitable[FakeHookServer]]]:
    servers: list[grpc.aio.Server] = []

    async def start(path: Path, name: str) -> FakeHookServer:
        fake = FakeHookServer(name)
        server = grpc.aio.server()
        hookpb_grpc.add_RuntimeHookServiceServicer_to_server(fake, server)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        servers.append(server)
        return fake

    yield start
    for server in servers:
        await server.stop(None)


def registration(endpoint: Path, stages: Sequence[str], policy: str = "Ignore") -> str:
    return json.dumps({"remote-endpoint": str(endpoint), "failure-policy": policy, "runtime-hooks": list(stages)})


@pytest.fixture
def registration_json() -> Callable[..., str]:
    return registration
