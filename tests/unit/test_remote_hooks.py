"""Remote hooks: a fake Koordinator hook server on a unix socket, the RemoteHook
client against it, the pure request/patch conversions and hookserver.d loading."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
import pytest_asyncio

from criapi import hook_v1alpha1_pb2 as pb
from criapi import hook_v1alpha1_pb2_grpc as pb_grpc
from runtimeproxy.chain.remote import (
    REMOTE_STAGES,
    Registration,
    RemoteHook,
    container_patch,
    container_request,
    load_registrations,
    pod_patch,
    pod_request,
    registration_fingerprint,
    rpc_path,
)
from runtimeproxy.hookapi import (
    CallResult,
    ContainerContext,
    ContainerInfo,
    ContainerMeta,
    ContainerPatch,
    HookError,
    PodContext,
    PodInfo,
    PodMeta,
    PodPatch,
    Resources,
    ResourcesPatch,
    Stage,
)
from tests import tmpnames

GIB = 1 << 30
NEW_POD_CGROUP = "/kubepods/besteffort/pod-uid-1"

# ---------------------------------------------------------------------------
# Fake koordlet
# ---------------------------------------------------------------------------


class FakeHookServer(pb_grpc.RuntimeHookServiceServicer):
    """Answers like koordlet: the response is pre-filled from the request (unless
    ``prefill`` is off, then it carries only the changed values) and then changed:
    pods get a new cgroup parent, an annotation and cpu_quota -1; containers get
    cpuset "0-1", cpu_shares 2, an annotation and an env. Records every request."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.prefill = True
        self.error: tuple[grpc.StatusCode, str] | None = None

    async def _pod(self, method: str, request: Any, context: Any) -> pb.PodSandboxHookResponse:
        self.calls.append((method, request))
        if self.error:
            await context.abort(*self.error)
        resp = pb.PodSandboxHookResponse()
        if self.prefill:
            resp.labels.update(request.labels)
            resp.annotations.update(request.annotations)
            resp.cgroup_parent = request.cgroup_parent
            resp.resources.CopyFrom(request.resources)
        resp.cgroup_parent = NEW_POD_CGROUP
        resp.annotations["koordinator.sh/touched"] = "pod"
        resp.resources.cpu_quota = -1
        return resp

    async def _container(
        self, method: str, request: Any, context: Any
    ) -> pb.ContainerResourceHookResponse:
        self.calls.append((method, request))
        if self.error:
            await context.abort(*self.error)
        resp = pb.ContainerResourceHookResponse()
        if self.prefill:
            resp.container_annotations.update(request.container_annotations)
            resp.container_resources.CopyFrom(request.container_resources)
            resp.pod_cgroup_parent = request.pod_cgroup_parent
            resp.container_envs.update(request.container_envs)
        resp.container_resources.cpuset_cpus = "0-1"
        resp.container_resources.cpu_shares = 2
        resp.container_annotations["koordinator.sh/touched"] = "container"
        resp.container_envs["KOORD_ENV"] = "on"
        return resp

    async def PreRunPodSandboxHook(self, request: Any, context: Any) -> Any:
        return await self._pod("PreRunPodSandboxHook", request, context)

    async def PostStopPodSandboxHook(self, request: Any, context: Any) -> Any:
        return await self._pod("PostStopPodSandboxHook", request, context)

    async def PreCreateContainerHook(self, request: Any, context: Any) -> Any:
        return await self._container("PreCreateContainerHook", request, context)

    async def PreStartContainerHook(self, request: Any, context: Any) -> Any:
        return await self._container("PreStartContainerHook", request, context)

    async def PostStartContainerHook(self, request: Any, context: Any) -> Any:
        return await self._container("PostStartContainerHook", request, context)

    async def PostStopContainerHook(self, request: Any, context: Any) -> Any:
        return await self._container("PostStopContainerHook", request, context)

    async def PreUpdateContainerResourcesHook(self, request: Any, context: Any) -> Any:
        return await self._container("PreUpdateContainerResourcesHook", request, context)


async def start_server(socket: Path) -> tuple[grpc.aio.Server, FakeHookServer]:
    fake = FakeHookServer()
    server = grpc.aio.server()
    pb_grpc.add_RuntimeHookServiceServicer_to_server(fake, server)
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    return server, fake


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory: unix socket paths are limited to ~107 bytes, tmp_path may be longer."""
    path = tmpnames.mkdtemp()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest_asyncio.fixture
async def koordlet(sock_dir: Path) -> AsyncIterator[tuple[FakeHookServer, Path]]:
    socket = sock_dir / "koordlet.sock"
    server, fake = await start_server(socket)
    yield fake, socket
    await server.stop(None)


def make_hook(socket: Path | str, stages: frozenset[Stage] = REMOTE_STAGES) -> RemoteHook:
    return RemoteHook(name="koordlet", endpoint=str(socket), stages=stages)


# ---------------------------------------------------------------------------
# Contexts
# ---------------------------------------------------------------------------

POD = PodInfo(
    meta=PodMeta(name="web-0", namespace="prod", uid="uid-1", attempt=1),
    labels={"app": "web", "koordinator.sh/qosClass": "LS"},
    annotations={"team": "a"},
    runtime_handler="runc",
    cgroup_parent="/kubepods/burstable/pod-uid-1",
    resources=Resources(
        cpu_period=100000, cpu_quota=200000, cpu_shares=2048, memory_limit_in_bytes=GIB
    ),
)
CONTAINER = ContainerInfo(
    meta=ContainerMeta(name="app", attempt=2),
    id="c-123",
    labels={"io.kubernetes.container.name": "app"},
    annotations={"note": "x"},
    resources=Resources(
        cpu_period=100000,
        cpu_quota=100000,
        cpu_shares=1024,
        memory_limit_in_bytes=GIB,
        cpuset_cpus="0-7",
        unified={"memory.high": "max"},
    ),
    envs={"PATH": "/bin"},
)


def pod_ctx(stage: Stage = Stage.PRE_RUN_POD_SANDBOX) -> PodContext:
    return PodContext(stage=stage, pod=POD)


def container_ctx(stage: Stage = Stage.PRE_CREATE_CONTAINER) -> ContainerContext:
    result = None if stage.is_pre else CallResult(ok=True)
    return ContainerContext(stage=stage, pod=POD, container=CONTAINER, result=result)


def expected_pod_request() -> pb.PodSandboxHookRequest:
    return pb.PodSandboxHookRequest(
        pod_meta=pb.PodSandboxMetadata(name="web-0", uid="uid-1", namespace="prod", attempt=1),
        runtime_handler="runc",
        labels={"app": "web", "koordinator.sh/qosClass": "LS"},
        annotations={"team": "a"},
        cgroup_parent="/kubepods/burstable/pod-uid-1",
        resources=pb.LinuxContainerResources(
            cpu_period=100000, cpu_quota=200000, cpu_shares=2048, memory_limit_in_bytes=GIB
        ),
    )


def expected_container_request() -> pb.ContainerResourceHookRequest:
    return pb.ContainerResourceHookRequest(
        pod_meta=pb.PodSandboxMetadata(name="web-0", uid="uid-1", namespace="prod", attempt=1),
        container_meta=pb.ContainerMetadata(name="app", attempt=2, id="c-123"),
        container_annotations={"note": "x"},
        container_resources=pb.LinuxContainerResources(
            cpu_period=100000,
            cpu_quota=100000,
            cpu_shares=1024,
            memory_limit_in_bytes=GIB,
            cpuset_cpus="0-7",
            unified={"memory.high": "max"},
        ),
        pod_resources=pb.LinuxContainerResources(
            cpu_period=100000, cpu_quota=200000, cpu_shares=2048, memory_limit_in_bytes=GIB
        ),
        pod_annotations={"team": "a"},
        pod_labels={"app": "web", "koordinator.sh/qosClass": "LS"},
        pod_cgroup_parent="/kubepods/burstable/pod-uid-1",
        container_envs={"PATH": "/bin"},
    )


def expected_pod_patch(socket: Path) -> PodPatch:
    return PodPatch(
        annotations={"koordinator.sh/touched": "pod"},
        cgroup_parent=NEW_POD_CGROUP,
        resources=ResourcesPatch(cpu_quota=-1),
        reason=f"remote hook server {socket}",
    )


def expected_container_patch(socket: Path) -> ContainerPatch:
    return ContainerPatch(
        annotations={"koordinator.sh/touched": "container"},
        envs={"KOORD_ENV": "on"},
        resources=ResourcesPatch(cpuset_cpus="0-1", cpu_shares=2),
        reason=f"remote hook server {socket}",
    )


# ---------------------------------------------------------------------------
# RemoteHook against the fake server
# ---------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("prefill", [True, False], ids=["koordlet-prefilled", "changes-only"])
async def test_pod_stage_patch_and_request(
    koordlet: tuple[FakeHookServer, Path], prefill: bool
) -> None:
    fake, socket = koordlet
    fake.prefill = prefill
    hook = make_hook(socket)
    try:
        patch = await hook.pre_run_pod_sandbox(pod_ctx())
    finally:
        await hook.close()
    assert patch == expected_pod_patch(socket)
    assert fake.calls == [("PreRunPodSandboxHook", expected_pod_request())]


@pytest.mark.asyncio
@pytest.mark.parametrize("prefill", [True, False], ids=["koordlet-prefilled", "changes-only"])
@pytest.mark.parametrize(
    "stage",
    [Stage.PRE_CREATE_CONTAINER, Stage.PRE_UPDATE_CONTAINER_RESOURCES],
    ids=lambda s: s.value,
)
async def test_container_stage_patch_and_request(
    koordlet: tuple[FakeHookServer, Path], prefill: bool, stage: Stage
) -> None:
    fake, socket = koordlet
    fake.prefill = prefill
    hook = make_hook(socket)
    try:
        patch = await getattr(hook, stage.method_name)(container_ctx(stage))
    finally:
        await hook.close()
    assert patch == expected_container_patch(socket)
    assert fake.calls == [(f"{stage.value}Hook", expected_container_request())]


@pytest.mark.asyncio
async def test_observe_only_stages_call_server_and_return_none(
    koordlet: tuple[FakeHookServer, Path],
) -> None:
    fake, socket = koordlet
    hook = make_hook(socket)
    try:
        contexts: list[PodContext | ContainerContext] = [
            pod_ctx(Stage.POST_STOP_POD_SANDBOX),
            container_ctx(Stage.PRE_START_CONTAINER),
            container_ctx(Stage.POST_START_CONTAINER),
            container_ctx(Stage.POST_STOP_CONTAINER),
        ]
        for ctx in contexts:  # not patchable: the server's changes are dropped
            assert await getattr(hook, ctx.stage.method_name)(ctx) is None
    finally:
        await hook.close()
    assert [method for method, _ in fake.calls] == [
        "PostStopPodSandboxHook",
        "PreStartContainerHook",
        "PostStartContainerHook",
        "PostStopContainerHook",
    ]
    assert fake.calls[0][1] == expected_pod_request()
    assert all(req == expected_container_request() for _, req in fake.calls[1:])


@pytest.mark.asyncio
async def test_channel_is_reused_and_reopened_after_close(
    koordlet: tuple[FakeHookServer, Path],
) -> None:
    fake, socket = koordlet
    hook = make_hook(socket, frozenset({Stage.PRE_CREATE_CONTAINER}))
    await hook.pre_create_container(container_ctx())
    channel = hook._channel
    await hook.pre_create_container(container_ctx())
    assert hook._channel is channel
    await hook.close()
    assert hook._channel is None
    await hook.pre_create_container(container_ctx())
    await hook.close()
    assert len(fake.calls) == 3


def test_hook_works_across_event_loops(sock_dir: Path) -> None:
    """A grpc.aio channel belongs to one loop; a new loop must get a new channel."""
    socket = sock_dir / "k.sock"
    hook = make_hook(socket, frozenset({Stage.PRE_CREATE_CONTAINER}))

    async def once() -> ContainerPatch | None:
        server, _ = await start_server(socket)
        try:
            return await hook.pre_create_container(container_ctx())
        finally:
            await server.stop(None)

    assert asyncio.run(once()) == expected_container_patch(socket)
    assert asyncio.run(once()) == expected_container_patch(socket)


def test_only_configured_stages_are_attributes() -> None:
    hook = make_hook(
        "/run/x.sock", frozenset({Stage.PRE_CREATE_CONTAINER, Stage.POST_STOP_POD_SANDBOX})
    )
    implemented = {stage for stage in Stage if callable(getattr(hook, stage.method_name, None))}
    assert implemented == {Stage.PRE_CREATE_CONTAINER, Stage.POST_STOP_POD_SANDBOX}
    assert inspect.iscoroutinefunction(hook.pre_create_container)
    assert asyncio.iscoroutinefunction(hook.post_stop_pod_sandbox)
    with pytest.raises(AttributeError):
        hook.pre_run_pod_sandbox  # noqa: B018
    assert not hasattr(hook, Stage.PRE_UPDATE_CONTAINER_RESOURCES.method_name)
    # another instance with other stages is unaffected
    other = make_hook("/run/x.sock", frozenset({Stage.PRE_RUN_POD_SANDBOX}))
    assert hasattr(other, "pre_run_pod_sandbox") and not hasattr(other, "pre_create_container")


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="PostCreateContainer"):
        make_hook(
            "/run/x.sock", frozenset({Stage.PRE_CREATE_CONTAINER, Stage.POST_CREATE_CONTAINER})
        )
    with pytest.raises(ValueError, match="absolute"):
        make_hook("koordlet.sock")
    hook = make_hook("unix:///run/koordlet.sock")
    assert hook.endpoint == "/run/koordlet.sock"
    assert REMOTE_STAGES == frozenset(
        {
            Stage.PRE_RUN_POD_SANDBOX,
            Stage.POST_STOP_POD_SANDBOX,
            Stage.PRE_CREATE_CONTAINER,
            Stage.PRE_START_CONTAINER,
            Stage.POST_START_CONTAINER,
            Stage.POST_STOP_CONTAINER,
            Stage.PRE_UPDATE_CONTAINER_RESOURCES,
        }
    )


def test_rpc_paths_exist_in_generated_service() -> None:
    service = pb.DESCRIPTOR.services_by_name["RuntimeHookService"]
    assert {f"/{service.full_name}/{m.name}" for m in service.methods} == {
        rpc_path(stage) for stage in REMOTE_STAGES
    }


@pytest.mark.asyncio
async def test_server_down_is_unavailable_fast(sock_dir: Path) -> None:
    socket = sock_dir / "nobody.sock"
    hook = make_hook(socket)
    started = time.monotonic()
    try:
        with pytest.raises(HookError) as info:
            await asyncio.wait_for(hook.pre_create_container(container_ctx()), timeout=5)
    finally:
        await hook.close()
    assert time.monotonic() - started < 5
    assert str(socket) in str(info.value)
    assert "UNAVAILABLE" in str(info.value)
    assert str(info.value).startswith(f"remote hook server {socket}: UNAVAILABLE: ")


@pytest.mark.asyncio
async def test_server_error_status_becomes_hook_error(
    koordlet: tuple[FakeHookServer, Path],
) -> None:
    fake, socket = koordlet
    fake.error = (grpc.StatusCode.PERMISSION_DENIED, "denied by test")
    hook = make_hook(socket)
    try:
        with pytest.raises(HookError) as info:
            await asyncio.wait_for(hook.pre_run_pod_sandbox(pod_ctx()), timeout=5)
    finally:
        await hook.close()
    assert str(info.value) == f"remote hook server {socket}: PERMISSION_DENIED: denied by test"


# ---------------------------------------------------------------------------
# Pure conversions
# ---------------------------------------------------------------------------


def test_unset_resources_are_left_out_of_requests() -> None:
    pod = PodInfo(meta=PodMeta(name="p", namespace="n", uid="u"))
    req = pod_request(PodContext(stage=Stage.PRE_RUN_POD_SANDBOX, pod=pod))
    assert not req.HasField("resources") and not req.HasField("overhead")
    creq = container_request(
        ContainerContext(
            stage=Stage.PRE_CREATE_CONTAINER, pod=pod, container=ContainerInfo(ContainerMeta("c"))
        )
    )
    assert not creq.HasField("container_resources") and not creq.HasField("pod_resources")
    assert creq.container_meta == pb.ContainerMetadata(name="c")


def test_pod_overhead_is_sent() -> None:
    pod = PodInfo(meta=PodMeta(name="p", namespace="n", uid="u"), overhead=Resources(cpu_shares=10))
    req = pod_request(PodContext(stage=Stage.PRE_RUN_POD_SANDBOX, pod=pod))
    assert req.overhead == pb.LinuxContainerResources(cpu_shares=10)


def test_echoed_response_is_no_patch() -> None:
    req = expected_pod_request()
    resp = pb.PodSandboxHookResponse(
        labels=req.labels,
        annotations=req.annotations,
        cgroup_parent=req.cgroup_parent,
        resources=req.resources,
    )
    assert pod_patch(req, resp) is None
    assert pod_patch(req, pb.PodSandboxHookResponse()) is None
    creq = expected_container_request()
    cresp = pb.ContainerResourceHookResponse(
        container_annotations=creq.container_annotations,
        container_resources=creq.container_resources,
        pod_cgroup_parent=creq.pod_cgroup_parent,
        container_envs=creq.container_envs,
    )
    assert container_patch(creq, cresp) is None
    assert container_patch(creq, pb.ContainerResourceHookResponse()) is None


def test_pod_patch_merges_labels_and_keeps_pod_resources() -> None:
    req = expected_pod_request()
    resp = pb.PodSandboxHookResponse(
        labels={"app": "web", "new": "1"},  # "app" echoed, "new" added
        annotations={"team": "b"},  # changed value
        resources=pb.LinuxContainerResources(
            cpu_shares=2, cpuset_cpus="2-3", unified={"cpu.idle": "1"}
        ),
    )
    assert pod_patch(req, resp, reason="r") == PodPatch(
        labels={"new": "1"},
        annotations={"team": "b"},
        resources=ResourcesPatch(cpu_shares=2, cpuset_cpus="2-3", unified={"cpu.idle": "1"}),
        reason="r",
    )


def test_container_patch_fields() -> None:
    req = expected_container_request()
    resp = pb.ContainerResourceHookResponse(
        container_resources=pb.LinuxContainerResources(
            cpu_quota=-1,
            memory_limit_in_bytes=GIB,  # same as request: no change
            oom_score_adj=-998,
            cpuset_mems="0",
            memory_swap_limit_in_bytes=2 * GIB,
            cpu_period=50000,
            unified={"memory.high": "max", "memory.low": "100"},
        ),
        pod_cgroup_parent="/kubepods/pod-new",
        container_envs={"PATH": "/usr/bin"},
    )
    assert container_patch(req, resp, reason="r") == ContainerPatch(
        envs={"PATH": "/usr/bin"},
        resources=ResourcesPatch(
            cpu_quota=-1,
            oom_score_adj=-998,
            cpuset_mems="0",
            memory_swap_limit_in_bytes=2 * GIB,
            cpu_period=50000,
            unified={"memory.low": "100"},
        ),
        pod_cgroup_parent="/kubepods/pod-new",
        reason="r",
    )


def test_patch_maps_are_read_only() -> None:
    req = expected_container_request()
    patch = container_patch(req, pb.ContainerResourceHookResponse(container_envs={"X": "1"}))
    assert patch is not None and patch.envs is not None
    with pytest.raises(TypeError):
        patch.envs["Y"] = "2"  # type: ignore[index]


# ---------------------------------------------------------------------------
# hookserver.d registrations
# ---------------------------------------------------------------------------


def write(directory: Path, name: str, content: object) -> Path:
    path = directory / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


GOOD = {
    "remote-endpoint": "/var/run/koordlet/koordlet.sock",
    "failure-policy": "Fail",
    "runtime-hooks": ["PreRunPodSandbox", "PreCreateContainer", "PreUpdateContainerResources"],
}


def test_good_registration(tmp_path: Path) -> None:
    path = write(tmp_path, "koordlet.json", GOOD)
    regs, errors = load_registrations(tmp_path)
    assert errors == []
    assert regs == [
        Registration(
            name="koordlet",
            path=path,
            endpoint="/var/run/koordlet/koordlet.sock",
            failure_policy="Fail",
            stages=frozenset(
                {
                    Stage.PRE_RUN_POD_SANDBOX,
                    Stage.PRE_CREATE_CONTAINER,
                    Stage.PRE_UPDATE_CONTAINER_RESOURCES,
                }
            ),
        )
    ]
    hook = regs[0].hook()
    assert hook.name == "koordlet" and hook.stages == regs[0].stages
    assert hasattr(hook, "pre_run_pod_sandbox") and not hasattr(hook, "post_stop_container")


@pytest.mark.parametrize("policy", ["", None], ids=["empty", "absent"])
def test_empty_or_absent_policy_is_ignore(tmp_path: Path, policy: str | None) -> None:
    content: dict[str, object] = {
        "remote-endpoint": "unix:///run/a.sock",
        "runtime-hooks": ["PreStartContainer"],
    }
    if policy is not None:
        content["failure-policy"] = policy
    write(tmp_path, "a.json", content)
    regs, errors = load_registrations(tmp_path)
    assert errors == []
    assert regs[0].failure_policy == "Ignore"
    assert regs[0].endpoint == "unix:///run/a.sock"


def test_registrations_sorted_by_file_name(tmp_path: Path) -> None:
    for name in ("b.json", "10-z.json", "a.json", "20-y.json"):
        write(tmp_path, name, {**GOOD, "remote-endpoint": f"/run/{name}.sock"})
    write(tmp_path, "c.txt", GOOD)  # not *.json
    write(tmp_path, "d.json.bak", GOOD)
    (tmp_path / "e.json").mkdir()  # a directory, not a file
    regs, errors = load_registrations(tmp_path)
    assert errors == []
    assert [r.name for r in regs] == ["10-z", "20-y", "a", "b"]
    assert [r.endpoint for r in regs] == [f"/run/{n}.json.sock" for n in ("10-z", "20-y", "a", "b")]


def test_missing_directory(tmp_path: Path) -> None:
    assert load_registrations(tmp_path / "nope") == ([], [])
    assert registration_fingerprint(tmp_path / "nope") == ()


BAD_FILES = {
    "bad-json": ('{"remote-endpoint": ', "invalid JSON", None),
    "deeply-nested-json": ("[" * 100_000 + "]" * 100_000, "invalid JSON", None),
    "not-object": (["PreRunPodSandbox"], "(top level)", "list"),
    "no-endpoint": ({"runtime-hooks": ["PreRunPodSandbox"]}, "remote-endpoint", None),
    "empty-endpoint": ({"remote-endpoint": ""}, "remote-endpoint", ""),
    "number-endpoint": ({"remote-endpoint": 7}, "remote-endpoint", 7),
    "relative-endpoint": ({"remote-endpoint": "koordlet.sock"}, "remote-endpoint", "koordlet.sock"),
    "bad-policy": ({**GOOD, "failure-policy": "Sometimes"}, "failure-policy", "Sometimes"),
    "lowercase-policy": ({**GOOD, "failure-policy": "fail"}, "failure-policy", "fail"),
    "unknown-stage": (
        {**GOOD, "runtime-hooks": ["PreRunPodSandbox", "PreFlight"]},
        "runtime-hooks",
        "PreFlight",
    ),
    "unsupported-stage": (
        {**GOOD, "runtime-hooks": ["PostCreateContainer"]},
        "runtime-hooks",
        "PostCreateContainer",
    ),
    "hooks-not-list": (
        {**GOOD, "runtime-hooks": "PreRunPodSandbox"},
        "runtime-hooks",
        "PreRunPodSandbox",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_registration_file(tmp_path: Path, case: str) -> None:
    content, field, value = BAD_FILES[case]
    write(tmp_path, "00-good.json", GOOD)
    path = write(tmp_path, f"{case}.json", content)
    regs, errors = load_registrations(tmp_path)
    assert [r.name for r in regs] == ["00-good"]  # the bad file is skipped, the good one kept
    assert len(errors) == 1
    assert str(path) in errors[0]
    assert field in errors[0]
    if "json" not in case:
        assert repr(value) in errors[0]


def test_all_problems_of_a_file_are_reported(tmp_path: Path) -> None:
    write(tmp_path, "x.json", {"failure-policy": "Maybe", "runtime-hooks": ["Nope"]})
    regs, errors = load_registrations(tmp_path)
    assert regs == []
    assert len(errors) == 3
    assert [e.split(": ")[1] for e in errors] == [
        "remote-endpoint",
        "failure-policy",
        "runtime-hooks",
    ]


def test_fingerprint_changes(tmp_path: Path) -> None:
    path = write(tmp_path, "a.json", GOOD)
    first = registration_fingerprint(tmp_path)
    stat = path.stat()
    assert first == (("a.json", stat.st_mtime_ns, stat.st_size),)
    assert registration_fingerprint(tmp_path) == first

    write(tmp_path, "a.json", {**GOOD, "failure-policy": "Ignore"})
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    second = registration_fingerprint(tmp_path)
    assert second != first

    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000))  # touched only
    third = registration_fingerprint(tmp_path)
    assert third != second

    write(tmp_path, "b.json", GOOD)
    assert [name for name, _, _ in registration_fingerprint(tmp_path)] == ["a.json", "b.json"]
    path.unlink()
    assert [name for name, _, _ in registration_fingerprint(tmp_path)] == ["b.json"]
