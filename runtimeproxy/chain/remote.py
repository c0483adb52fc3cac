"""Remote hooks: Koordinator hook servers (koordlet) as ordinary links of the hook chain.

Why this module exists: Koordinator's runtime-proxy lets out-of-process "hook
servers" register in ``/etc/runtime/hookserver.d/*.json`` and calls them over the
``runtime.v1alpha1.RuntimeHookService`` gRPC API. To be a drop-in replacement we
read the same files and speak the same protocol, but each server becomes a normal
hook: it sees the same frozen context, answers with the same typed patch, and
fails with ``HookError`` so the chain applies its Fail/Ignore policy and names it.
Unlike Koordinator (which calls only the first matching server, in map order) all
registered servers run, in file-name order.

Patch semantics (``pod_patch`` / ``container_patch``): koordlet answers with the
request values pre-filled, other servers may answer only what they change. So a
response field becomes a patch field only if it is *set* (non-zero / non-empty;
``cpu_quota`` -1 is non-zero, so it counts as set) *and* differs from the request.
Consequently a server cannot reset a value to 0 / "" through this API. Map entries
(labels, annotations, envs, ``unified``) that are new or differ are merged; keys
cannot be deleted. An empty cgroup parent means "no change". ``hugepage_limits`` are
not represented in the hook API and are ignored. Pod-level ``resources`` of a
``PodSandboxHookResponse`` become ``PodPatch.resources``; Koordinator's proxy
ignores them, we keep them because the RunPodSandbox request can carry them.
Patches are only returned for patchable stages (``Stage.patchable``); for the other
stages the server is called to observe or veto (by an error status) and its answer
is dropped. Nothing changed means ``None``.

Resources equal to ``Resources()`` (nothing set) are left out of requests rather
than sent as an empty message, like an absent ``LinuxContainerResources`` in CRI.
"""

from __future__ import annotations

import asyncio
import json
import types
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import DecodeError, Message

from criapi import hook_v1alpha1_pb2 as pb
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerPatch,
    HookError,
    PodContext,
    PodPatch,
    Resources,
    ResourcesPatch,
    Stage,
    frozen_map,
)

REMOTE_STAGES: Final[frozenset[Stage]] = frozenset(
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

SERVICE: Final = "runtime.v1alpha1.RuntimeHookService"
MAX_MESSAGE_BYTES: Final = 16 * 1024 * 1024
_CHANNEL_OPTIONS: Final = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
_UNIX_PREFIX: Final = "unix://"

_Response = TypeVar("_Response", pb.PodSandboxHookResponse, pb.ContainerResourceHookResponse)


def rpc_path(stage: Stage) -> str:
    """The gRPC method path of a stage: ``PreCreateContainer`` → ``/…/PreCreateContainerHook``."""
    if stage not in REMOTE_STAGES:
        raise ValueError(f"stage {stage.value} has no RuntimeHookService method")
    return f"/{SERVICE}/{stage.value}Hook"


def socket_path(endpoint: str) -> str:
    """Normalize ``/path`` or ``unix:///path`` to ``/path``; ValueError otherwise."""
    path = endpoint.removeprefix(_UNIX_PREFIX)
    if not path.startswith("/"):
        raise ValueError(
            f"remote hook endpoint must be an absolute unix socket path, got {endpoint!r}"
        )
    return path


# ---------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------


def resources_message(res: Resources) -> pb.LinuxContainerResources:
    return pb.LinuxContainerResources(
        cpu_period=res.cpu_period,
        cpu_quota=res.cpu_quota,
        cpu_shares=res.cpu_shares,
        memory_limit_in_bytes=res.memory_limit_in_bytes,
        oom_score_adj=res.oom_score_adj,
        cpuset_cpus=res.cpuset_cpus,
        cpuset_mems=res.cpuset_mems,
        unified=dict(res.unified),
        memory_swap_limit_in_bytes=res.memory_swap_limit_in_bytes,
    )


def _put_resources(target: pb.LinuxContainerResources, res: Resources) -> None:
    if res != Resources():
        target.CopyFrom(resources_message(res))


def _pod_meta(ctx: PodContext | ContainerContext) -> pb.PodSandboxMetadata:
    meta = ctx.pod.meta
    return pb.PodSandboxMetadata(
        name=meta.name, uid=meta.uid, namespace=meta.namespace, attempt=meta.attempt
    )


def pod_request(ctx: PodContext) -> pb.PodSandboxHookRequest:
    pod = ctx.pod
    req = pb.PodSandboxHookRequest(
        pod_meta=_pod_meta(ctx),
        runtime_handler=pod.runtime_handler,
        labels=dict(pod.labels),
        annotations=dict(pod.annotations),
        cgroup_parent=pod.cgroup_parent,
    )
    _put_resources(req.overhead, pod.overhead)
    _put_resources(req.resources, pod.resources)
    return req


def container_request(ctx: ContainerContext) -> pb.ContainerResourceHookRequest:
    pod, container = ctx.pod, ctx.container
    req = pb.ContainerResourceHookRequest(
        pod_meta=_pod_meta(ctx),
        container_meta=pb.ContainerMetadata(
            name=container.meta.name, attempt=container.meta.attempt, id=container.id
        ),
        container_annotations=dict(container.annotations),
        pod_annotations=dict(pod.annotations),
        pod_labels=dict(pod.labels),
        pod_cgroup_parent=pod.cgroup_parent,
        container_envs=dict(container.envs),
    )
    _put_resources(req.container_resources, container.resources)
    _put_resources(req.pod_resources, pod.resources)
    return req


# ---------------------------------------------------------------------------
# Responses → patches
# ---------------------------------------------------------------------------


def _int_change(old: int, new: int) -> int | None:
    return new if new != 0 and new != old else None


def _str_change(old: str, new: str) -> str | None:
    return new if new and new != old else None


def _map_change(old: Mapping[str, str], new: Mapping[str, str]) -> Mapping[str, str] | None:
    changed = {key: value for key, value in new.items() if old.get(key) != value}
    return frozen_map(changed) if changed else None


def resources_patch(
    old: pb.LinuxContainerResources, new: pb.LinuxContainerResources
) -> ResourcesPatch | None:
    """Fields of ``new`` that are set and differ from ``old``; ``None`` if none."""
    patch = ResourcesPatch(
        cpu_period=_int_change(old.cpu_period, new.cpu_period),
        cpu_quota=_int_change(old.cpu_quota, new.cpu_quota),
        cpu_shares=_int_change(old.cpu_shares, new.cpu_shares),
        memory_limit_in_bytes=_int_change(old.memory_limit_in_bytes, new.memory_limit_in_bytes),
        oom_score_adj=_int_change(old.oom_score_adj, new.oom_score_adj),
        cpuset_cpus=_str_change(old.cpuset_cpus, new.cpuset_cpus),
        cpuset_mems=_str_change(old.cpuset_mems, new.cpuset_mems),
        memory_swap_limit_in_bytes=_int_change(
            old.memory_swap_limit_in_bytes, new.memory_swap_limit_in_bytes
        ),
        unified=_map_change(old.unified, new.unified),
    )
    return None if patch.is_empty() else patch


def pod_patch(
    req: pb.PodSandboxHookRequest, resp: pb.PodSandboxHookResponse, *, reason: str = ""
) -> PodPatch | None:
    """What ``resp`` changes in ``req`` (see the module docstring), or ``None``."""
    patch = PodPatch(
        labels=_map_change(req.labels, resp.labels),
        annotations=_map_change(req.annotations, resp.annotations),
        cgroup_parent=_str_change(req.cgroup_parent, resp.cgroup_parent),
        resources=resources_patch(req.resources, resp.resources),
        reason=reason,
    )
    return None if patch == PodPatch(reason=reason) else patch


def container_patch(
    req: pb.ContainerResourceHookRequest,
    resp: pb.ContainerResourceHookResponse,
    *,
    reason: str = "",
) -> ContainerPatch | None:
    """What ``resp`` changes in ``req`` (see the module docstring), or ``None``."""
    patch = ContainerPatch(
        annotations=_map_change(req.container_annotations, resp.container_annotations),
        envs=_map_change(req.container_envs, resp.container_envs),
        resources=resources_patch(req.container_resources, resp.container_resources),
        pod_cgroup_parent=_str_change(req.pod_cgroup_parent, resp.pod_cgroup_parent),
        reason=reason,
    )
    return None if patch == ContainerPatch(reason=reason) else patch


# ---------------------------------------------------------------------------
# The hook
# ---------------------------------------------------------------------------


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


class RemoteHook:
    """A hook that forwards its stages to a Koordinator hook server on a unix socket.

    Only the configured stages exist as attributes (the chain discovers a hook's
    stages by ``getattr``), so the per-stage methods below are declared, not
    defined, on the class and bound per instance in ``__init__``.
    """

    pre_run_pod_sandbox: Callable[[PodContext], Coroutine[Any, Any, PodPatch | None]]
    post_stop_pod_sandbox: Callable[[PodContext], Coroutine[Any, Any, None]]
    pre_create_container: Callable[[ContainerContext], Coroutine[Any, Any, ContainerPatch | None]]
    pre_start_container: Callable[[ContainerContext], Coroutine[Any, Any, None]]
    post_start_container: Callable[[ContainerContext], Coroutine[Any, Any, None]]
    post_stop_container: Callable[[ContainerContext], Coroutine[Any, Any, None]]
    pre_update_container_resources: Callable[
        [ContainerContext], Coroutine[Any, Any, ContainerPatch | None]
    ]

    def __init__(self, *, name: str, endpoint: str, stages: frozenset[Stage]) -> None:
        unsupported = stages - REMOTE_STAGES
        if unsupported:
            names = ", ".join(sorted(stage.value for stage in unsupported))
            raise ValueError(f"remote hook {name}: stages not in RuntimeHookService: {names}")
        self.name = name
        self.endpoint = socket_path(endpoint)
        self.stages = stages
        self.reason = f"remote hook server {self.endpoint}"
        self._channel: grpc.aio.Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        for stage in stages:
            setattr(self, stage.method_name, getattr(self, f"_{stage.method_name}"))

    def __repr__(self) -> str:
        stages = ",".join(sorted(stage.value for stage in self.stages))
        return f"RemoteHook(name={self.name!r}, endpoint={self.endpoint!r}, stages={stages})"

    async def close(self) -> None:
        """Close the channel (if it was opened on the running loop; otherwise drop it)."""
        channel, loop = self._channel, self._loop
        self._channel = self._loop = None
        if channel is not None and loop is asyncio.get_running_loop():
            await channel.close(None)

    # -- stage implementations (bound in __init__ for configured stages) --

    async def _pre_run_pod_sandbox(self, ctx: PodContext) -> PodPatch | None:
        return await self._pod_call(Stage.PRE_RUN_POD_SANDBOX, ctx)

    async def _post_stop_pod_sandbox(self, ctx: PodContext) -> None:
        await self._pod_call(Stage.POST_STOP_POD_SANDBOX, ctx)

    async def _pre_create_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        return await self._container_call(Stage.PRE_CREATE_CONTAINER, ctx)

    async def _pre_start_container(self, ctx: ContainerContext) -> None:
        await self._container_call(Stage.PRE_START_CONTAINER, ctx)

    async def _post_start_container(self, ctx: ContainerContext) -> None:
        await self._container_call(Stage.POST_START_CONTAINER, ctx)

    async def _post_stop_container(self, ctx: ContainerContext) -> None:
        await self._container_call(Stage.POST_STOP_CONTAINER, ctx)

    async def _pre_update_container_resources(self, ctx: ContainerContext) -> ContainerPatch | None:
        return await self._container_call(Stage.PRE_UPDATE_CONTAINER_RESOURCES, ctx)

    # -- plumbing --

    async def _pod_call(self, stage: Stage, ctx: PodContext) -> PodPatch | None:
        req = pod_request(ctx)
        resp = await self._invoke(stage, req, pb.PodSandboxHookResponse)
        return pod_patch(req, resp, reason=self.reason) if stage.patchable else None

    async def _container_call(self, stage: Stage, ctx: ContainerContext) -> ContainerPatch | None:
        req = container_request(ctx)
        resp = await self._invoke(stage, req, pb.ContainerResourceHookResponse)
        return container_patch(req, resp, reason=self.reason) if stage.patchable else None

    async def _invoke(
        self, stage: Stage, request: Message, response_type: type[_Response]
    ) -> _Response:
        # The answer is decoded here, not by grpc: grpc turns a decoding error into a None
        # response plus a stdlib-logged traceback; we want one HookError that says what happened.
        call = self._get_channel().unary_unary(rpc_path(stage), request_serializer=_serialize)
        try:
            raw = await call(request, wait_for_ready=False)
        except grpc.aio.AioRpcError as err:
            raise HookError(f"{self.reason}: {err.code().name}: {err.details()}") from err
        if not isinstance(raw, bytes):
            raise HookError(f"{self.reason}: unexpected response type {type(raw).__name__}")
        try:
            return response_type.FromString(raw)
        except DecodeError as err:
            kind = response_type.__name__
            raise HookError(f"{self.reason}: answer is not a {kind} ({len(raw)} bytes): {err}") from err

    def _get_channel(self) -> grpc.aio.Channel:
        """The channel for the running loop; a grpc.aio channel is bound to the loop
        it was created on, so a new loop (tests, restart) gets a new channel."""
        loop = asyncio.get_running_loop()
        if self._channel is None or self._loop is not loop:
            self._channel = grpc.aio.insecure_channel(
                _UNIX_PREFIX + self.endpoint, options=_CHANNEL_OPTIONS
            )
            self._loop = loop
        return self._channel


# ---------------------------------------------------------------------------
# Registration files (/etc/runtime/hookserver.d/*.json)
# ---------------------------------------------------------------------------

FailurePolicy = Literal["Fail", "Ignore"]
FIELD_ENDPOINT: Final = "remote-endpoint"
FIELD_POLICY: Final = "failure-policy"
FIELD_HOOKS: Final = "runtime-hooks"
# Koordinator treats an empty (or absent) policy as Ignore.
_POLICIES: Final[Mapping[str, FailurePolicy]] = types.MappingProxyType(
    {"Fail": "Fail", "Ignore": "Ignore", "": "Ignore"}
)
_STAGES_BY_NAME: Final[Mapping[str, Stage]] = types.MappingProxyType(
    {stage.value: stage for stage in Stage}
)


@dataclass(frozen=True)
class Registration:
    """One hook server registration file. ``name`` is the file stem."""

    name: str
    path: Path
    endpoint: str
    failure_policy: FailurePolicy
    stages: frozenset[Stage]

    def hook(self) -> RemoteHook:
        return RemoteHook(name=self.name, endpoint=self.endpoint, stages=self.stages)


def _json_files(directory: Path) -> list[Path]:
    try:
        entries = list(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(
        (p for p in entries if p.name.endswith(".json") and p.is_file()), key=lambda p: p.name
    )


def _field_error(path: Path, field: str, value: object, message: str) -> str:
    return f"{path}: {field}: {message} (got {value!r})"


def _endpoint_field(path: Path, data: Mapping[str, object], errors: list[str]) -> str:
    value = data.get(FIELD_ENDPOINT)
    if not isinstance(value, str) or not value:
        errors.append(_field_error(path, FIELD_ENDPOINT, value, "missing or empty"))
        return ""
    try:
        socket_path(value)
    except ValueError:
        errors.append(_field_error(path, FIELD_ENDPOINT, value, "not an absolute unix socket path"))
    return value


def _policy_field(path: Path, data: Mapping[str, object], errors: list[str]) -> FailurePolicy:
    value = data.get(FIELD_POLICY, "")
    policy = _POLICIES.get(value) if isinstance(value, str) else None
    if policy is None:
        errors.append(_field_error(path, FIELD_POLICY, value, "must be Fail or Ignore"))
        return "Ignore"
    return policy


def _stages_field(path: Path, data: Mapping[str, object], errors: list[str]) -> frozenset[Stage]:
    value = data.get(FIELD_HOOKS, [])
    if not isinstance(value, list):
        errors.append(_field_error(path, FIELD_HOOKS, value, "must be a list of hook types"))
        return frozenset()
    stages: set[Stage] = set()
    for item in value:
        stage = _STAGES_BY_NAME.get(item) if isinstance(item, str) else None
        if stage is None:
            errors.append(_field_error(path, FIELD_HOOKS, item, "unknown hook type"))
        elif stage not in REMOTE_STAGES:
            errors.append(
                _field_error(path, FIELD_HOOKS, item, "not supported by RuntimeHookService")
            )
        else:
            stages.add(stage)
    return frozenset(stages)


def _load_file(path: Path) -> Registration | list[str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # ValueError: JSON and UTF-8; RecursionError: deep nesting
        return [f"{path}: invalid JSON file: {err}"]
    if not isinstance(data, dict):
        return [_field_error(path, "(top level)", type(data).__name__, "must be a JSON object")]
    errors: list[str] = []
    endpoint = _endpoint_field(path, data, errors)
    policy = _policy_field(path, data, errors)
    stages = _stages_field(path, data, errors)
    if errors:
        return errors
    return Registration(
        name=path.stem, path=path, endpoint=endpoint, failure_policy=policy, stages=stages
    )


def load_registrations(directory: Path) -> tuple[list[Registration], list[str]]:
    """Registrations from ``directory/*.json`` sorted by file name (the chain order),
    plus one error string per problem in a bad file (bad files are skipped).
    A missing directory is not an error."""
    registrations: list[Registration] = []
    errors: list[str] = []
    for path in _json_files(directory):
        loaded = _load_file(path)
        if isinstance(loaded, Registration):
            registrations.append(loaded)
        else:
            errors.extend(loaded)
    return registrations, errors


def registration_fingerprint(directory: Path) -> tuple[tuple[str, int, int], ...]:
    """``(file name, mtime_ns, size)`` of each registration file, for cheap change polling."""
    out: list[tuple[str, int, int]] = []
    for path in _json_files(directory):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        out.append((path.name, st.st_mtime_ns, st.st_size))
    return tuple(out)
