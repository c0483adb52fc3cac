"""Property-based: a remote hook server's answer is untrusted input (issue 14).

Arbitrary field values in a ``PodSandboxHookResponse`` / ``ContainerResourceHookResponse``
and arbitrary or mutated bytes on the wire (unknown fields, truncation, garbage) go
through what the proxy really does with them: decode, turn into a patch, validate
in the hook chain, write into the CRI request. The only outcomes allowed are a
patch that passed validation (and then yields a request whose fields are in range)
or the hook's failure (``PatchError`` / ``HookError``; ``HookFailed`` under Fail),
never another exception.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from criapi import cri_v1_pb2 as cri
from criapi import hook_v1alpha1_pb2 as pb
from runtimeproxy.chain import patching
from runtimeproxy.chain.hookchain import BoundHook, HookChain, HookFailed, HookPools
from runtimeproxy.chain.remote import SERVICE, RemoteHook, container_patch, container_request, pod_patch, pod_request
from runtimeproxy.chain.validate import (
    MAX_ANNOTATIONS_BYTES,
    MAX_ENVS_BYTES,
    MAX_QUOTA,
    MAX_SHARES,
    PatchError,
    PatchValidator,
)
from runtimeproxy.config.settings import FailurePolicy
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerInfo,
    ContainerMeta,
    ContainerPatch,
    PodContext,
    PodInfo,
    PodMeta,
    PodPatch,
    Resources,
    Stage,
)
from tests import tmpnames

SETTINGS = settings(max_examples=250, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
WIRE_SETTINGS = settings(max_examples=150, derandomize=True, deadline=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

POD = PodInfo(
    meta=PodMeta(name="web-0", namespace="prod", uid="uid-1"),
    labels={"app": "web"},
    annotations={"team": "a"},
    cgroup_parent="/kubepods/burstable/pod-uid-1",
    resources=Resources(cpu_period=100000, cpu_quota=200000, cpu_shares=2048, memory_limit_in_bytes=1 << 30),
)
CONTAINER = ContainerInfo(
    meta=ContainerMeta(name="app"), id="c-1", annotations={"note": "x"},
    resources=Resources(cpu_shares=1024, cpu_quota=100000, cpuset_cpus="0-1"), envs={"HOME": "/root"},
)
VALIDATOR = PatchValidator(online_cpus=lambda: frozenset(range(8)), online_mems=lambda: frozenset({0}))

# --- strategies ----------------------------------------------------------------------

INT64 = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([0, -1, 1, 2, 999, 1000, 262_144, 262_145, 1_000_000, 2**44, -(2**62), 2**60]),
    st.integers(min_value=0, max_value=1000),
)
TEXT = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["/../../etc/evil", "/kubepods/besteffort/p", "kubepods-x.slice", "0-99999", "0-1", "PATH",
                     "LD_PRELOAD", "A=B", "a\x00b", "memory.high", "cgroup.procs", "koordinator.sh/x", ""]),
)
#: Mostly plausible (so that many answers pass and what passes is checked), sometimes anything.
KEY = st.one_of(st.sampled_from(["team", "koordinator.sh/x", "KOORD_ENV", "memory.high", "app"]),
                st.from_regex(r"[a-z][a-z0-9]{0,8}", fullmatch=True), TEXT)
VALUE = st.one_of(st.sampled_from(["", "yes", "max", "web"]), st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True), TEXT)
MAP = st.one_of(
    st.dictionaries(KEY, VALUE, max_size=3), st.dictionaries(KEY, VALUE, max_size=3),
    st.dictionaries(TEXT, TEXT, max_size=4), st.dictionaries(st.just("big"), st.just("x" * 300_000), max_size=1),
)


@st.composite
def resources(draw: st.DrawFn) -> pb.LinuxContainerResources:
    res = pb.LinuxContainerResources()
    for name in ("cpu_period", "cpu_quota", "cpu_shares", "memory_limit_in_bytes", "oom_score_adj",
                 "memory_swap_limit_in_bytes"):
        if draw(st.booleans()):
            setattr(res, name, draw(INT64))
    for name in ("cpuset_cpus", "cpuset_mems"):
        if draw(st.booleans()):
            setattr(res, name, draw(TEXT))
    res.unified.update(draw(st.dictionaries(TEXT, TEXT, max_size=3)))
    for _ in range(draw(st.integers(0, 2))):
        res.hugepage_limits.add(page_size=draw(TEXT), limit=draw(st.integers(0, 2**64 - 1)))
    return res


@st.composite
def pod_responses(draw: st.DrawFn) -> pb.PodSandboxHookResponse:
    resp = pb.PodSandboxHookResponse()
    if draw(st.booleans()):
        resp.labels.update(draw(MAP))
    if draw(st.booleans()):
        resp.annotations.update(draw(MAP))
    if draw(st.booleans()):
        resp.cgroup_parent = draw(TEXT)
    if draw(st.booleans()):
        resp.resources.CopyFrom(draw(resources()))
    return resp


@st.composite
def container_responses(draw: st.DrawFn) -> pb.ContainerResourceHookResponse:
    resp = pb.ContainerResourceHookResponse()
    if draw(st.booleans()):
        resp.container_annotations.update(draw(MAP))
    if draw(st.booleans()):
        resp.container_envs.update(draw(MAP))
    if draw(st.booleans()):
        resp.pod_cgroup_parent = draw(TEXT)
    if draw(st.booleans()):
        resp.container_resources.CopyFrom(draw(resources()))
    return resp


def mutated(message: st.SearchStrategy[Any]) -> st.SearchStrategy[bytes]:
    """Serialized answers, mutated: bytes flipped, cut, unknown fields appended, or pure garbage."""
    raw = message.map(lambda m: m.SerializeToString())

    def flip(data: bytes, at: int, byte: int) -> bytes:
        if not data:
            return bytes([byte])
        at %= len(data)
        return data[:at] + bytes([byte]) + data[at + 1:]

    return st.one_of(
        raw,
        st.builds(flip, raw, st.integers(0, 10_000), st.integers(0, 255)),
        st.builds(lambda d, n: d[:n], raw, st.integers(0, 200)),
        # Unknown field 99 (length-delimited) and 100 (varint): a newer server's fields.
        st.builds(lambda d, b: d + b"\x9a\x06" + bytes([len(b)]) + b + b"\xa0\x06\x01", raw, st.binary(max_size=50)),
        st.binary(max_size=200),
    )


# --- what must hold for anything that passed -----------------------------------------

_BAD_COMPONENT = re.compile(r"(^|/)\.{1,2}(/|$)|//")


def _resources_in_range(res: cri.LinuxContainerResources) -> None:
    assert res.cpu_shares == 0 or 2 <= res.cpu_shares <= MAX_SHARES
    assert res.cpu_quota in (0, -1) or 1000 <= res.cpu_quota <= MAX_QUOTA
    assert res.cpu_period == 0 or 1000 <= res.cpu_period <= 1_000_000
    assert res.memory_limit_in_bytes in (0, -1) or res.memory_limit_in_bytes >= 4096
    assert -1000 <= res.oom_score_adj <= 1000
    assert all(not k.startswith("cgroup.") and "/" not in k for k in res.unified)


def _parent_confined(parent: str) -> None:
    assert not _BAD_COMPONENT.search(parent) and not parent.endswith("/")
    assert parent.startswith("/kubepods")


def check_pod_outcome(patch: PodPatch) -> None:
    req = cri.RunPodSandboxRequest()
    req.config.linux.cgroup_parent = POD.cgroup_parent
    patching.apply_pod_patch(req, patch)
    req.SerializeToString()
    _parent_confined(req.config.linux.cgroup_parent)
    _resources_in_range(req.config.linux.resources)
    assert sum(len(k) + len(v) for k, v in (patch.annotations or {}).items()) <= MAX_ANNOTATIONS_BYTES


def check_container_outcome(patch: ContainerPatch) -> None:
    req = cri.CreateContainerRequest()
    req.sandbox_config.linux.cgroup_parent = POD.cgroup_parent
    patching.apply_create_patch(req, patch)
    req.SerializeToString()
    _parent_confined(req.sandbox_config.linux.cgroup_parent)
    _resources_in_range(req.config.linux.resources)
    for kv in req.config.envs:
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", kv.key) and kv.key != "PATH" and b"\x00" not in kv.value
    assert sum(len(kv.key) + len(kv.value) for kv in req.config.envs) <= MAX_ENVS_BYTES


# --- pure: response -> patch -> validator -> CRI request ---------------------------------


@SETTINGS
@given(pod_responses())
def test_any_pod_answer_is_a_valid_patch_or_a_patch_error(resp: pb.PodSandboxHookResponse) -> None:
    ctx = PodContext(Stage.PRE_RUN_POD_SANDBOX, POD)
    patch = pod_patch(pod_request(ctx), resp)
    if patch is None:
        return
    try:
        VALIDATOR.check(ctx, patch)
    except PatchError as exc:
        assert exc.field.startswith(("pod.labels", "pod.annotations", "pod.cgroup_parent", "pod.resources"))
        return
    check_pod_outcome(patch)


@SETTINGS
@given(container_responses())
def test_any_container_answer_is_a_valid_patch_or_a_patch_error(resp: pb.ContainerResourceHookResponse) -> None:
    ctx = ContainerContext(Stage.PRE_CREATE_CONTAINER, POD, CONTAINER)
    patch = container_patch(container_request(ctx), resp)
    if patch is None:
        return
    try:
        VALIDATOR.check(ctx, patch)
    except PatchError as exc:
        assert exc.field.startswith(("container.annotations", "container.envs", "container.resources",
                                     "pod.cgroup_parent"))
        return
    check_container_outcome(patch)


@SETTINGS
@given(mutated(container_responses()))
def test_any_bytes_decode_to_an_answer_or_a_decode_error(data: bytes) -> None:
    try:
        resp = pb.ContainerResourceHookResponse.FromString(data)
    except DecodeError:
        return
    ctx = ContainerContext(Stage.PRE_CREATE_CONTAINER, POD, CONTAINER)
    patch = container_patch(container_request(ctx), resp)
    if patch is not None:
        try:
            VALIDATOR.check(ctx, patch)
        except PatchError:
            return
        check_container_outcome(patch)


@st.composite
def valid_container_responses(draw: st.DrawFn) -> pb.ContainerResourceHookResponse:
    """Answers inside every documented range: what a well-behaved koordlet sends."""
    resp = pb.ContainerResourceHookResponse()
    res = resp.container_resources
    res.cpu_shares = draw(st.integers(2, MAX_SHARES))
    res.cpu_quota = draw(st.sampled_from([-1]) | st.integers(1000, MAX_QUOTA))
    res.cpu_period = draw(st.integers(1000, 1_000_000))
    res.memory_limit_in_bytes = draw(st.sampled_from([-1]) | st.integers(4096, 2**63 - 4096))
    res.oom_score_adj = draw(st.integers(-1000, 1000))
    res.cpuset_cpus = draw(st.sampled_from(["0", "0-1", "2-7", "0,3,5-6"]))
    res.unified.update(draw(st.dictionaries(st.sampled_from(["memory.high", "cpu.max", "io.weight"]),
                                            st.from_regex(r"[a-z0-9 ]{1,12}", fullmatch=True), max_size=2)))
    resp.container_envs.update(draw(st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,12}", fullmatch=True)
                                                    .filter(lambda n: n != "PATH" and not n.startswith("LD_")),
                                                    st.text(max_size=20).filter(lambda v: "\x00" not in v),
                                                    max_size=3)))
    resp.container_annotations.update(draw(st.dictionaries(
        st.from_regex(r"([a-z]{1,8}\.)?[a-z]{1,8}/[A-Za-z0-9]{1,20}", fullmatch=True), st.text(max_size=50),
        max_size=3)))
    resp.pod_cgroup_parent = draw(st.sampled_from(["", "/kubepods/besteffort/p", "/kubepods/p", "/kubepods"]))
    return resp


@SETTINGS
@given(valid_container_responses())
def test_any_in_range_container_answer_is_accepted(resp: pb.ContainerResourceHookResponse) -> None:
    ctx = ContainerContext(Stage.PRE_CREATE_CONTAINER, POD, CONTAINER)
    patch = container_patch(container_request(ctx), resp)
    assert patch is not None
    VALIDATOR.check(ctx, patch)
    check_container_outcome(patch)


# --- on the wire: a server answering raw bytes, through RemoteHook and the chain ---------


class RawServer:
    """A RuntimeHookService that answers whatever bytes ``answer`` holds."""

    def __init__(self, socket: Path) -> None:
        self.answer = b""
        self.lock = threading.Lock()

        def reply(request: bytes, context: Any) -> bytes:
            with self.lock:
                return self.answer

        handlers = {
            name: grpc.unary_unary_rpc_method_handler(reply)  # no (de)serializers: raw bytes both ways
            for name in ("PreRunPodSandboxHook", "PreCreateContainerHook")
        }
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.server.add_insecure_port(f"unix://{socket}")
        self.server.start()


@pytest.fixture(scope="module")
def wire() -> Iterator[tuple[RawServer, asyncio.AbstractEventLoop, dict[FailurePolicy, HookChain]]]:
    directory = tmpnames.mkdtemp()
    raw = RawServer(directory / "raw.sock")
    loop = asyncio.new_event_loop()
    pools = HookPools()
    stages = frozenset({Stage.PRE_RUN_POD_SANDBOX, Stage.PRE_CREATE_CONTAINER})
    impl = RemoteHook(name="raw", endpoint=str(directory / "raw.sock"), stages=stages)
    chains = {
        policy: HookChain([BoundHook("raw", impl, stages, policy, 5.0)], pools=pools, validator=VALIDATOR)
        for policy in FailurePolicy
    }
    yield raw, loop, chains
    loop.run_until_complete(impl.close())
    loop.close()
    pools.shutdown()
    raw.server.stop(None).wait()
    shutil.rmtree(directory, ignore_errors=True)


def _through_chain(wire: Any, data: bytes, ctx: PodContext | ContainerContext) -> None:
    raw, loop, chains = wire
    with raw.lock:
        raw.answer = data
    # Ignore: the chain always ends with an outcome; whatever it kept passed validation.
    outcome = loop.run_until_complete(chains[FailurePolicy.IGNORE].run(ctx, deadline=None))
    for _, patch in outcome.patches:
        if isinstance(patch, PodPatch):
            check_pod_outcome(patch)
        else:
            assert isinstance(patch, ContainerPatch)
            check_container_outcome(patch)
    # Fail: the same answer is either accepted the same way or the call is refused.
    try:
        strict = loop.run_until_complete(chains[FailurePolicy.FAIL].run(ctx, deadline=None))
    except HookFailed as exc:
        assert exc.hook == "raw" and not outcome.patches
    else:
        assert strict.patches == outcome.patches


@WIRE_SETTINGS
@given(mutated(container_responses()))
def test_raw_container_answers_on_the_wire(wire: Any, data: bytes) -> None:
    _through_chain(wire, data, ContainerContext(Stage.PRE_CREATE_CONTAINER, POD, CONTAINER))


@WIRE_SETTINGS
@given(mutated(pod_responses()))
def test_raw_pod_answers_on_the_wire(wire: Any, data: bytes) -> None:
    _through_chain(wire, data, PodContext(Stage.PRE_RUN_POD_SANDBOX, POD))


def test_undecodable_answer_is_the_hooks_failure(wire: Any) -> None:
    """Not a property: pins that garbage on the wire fails the hook, naming the server."""
    raw, loop, chains = wire
    with raw.lock:
        raw.answer = b"\xff\xff\xff"
    ctx = ContainerContext(Stage.PRE_CREATE_CONTAINER, POD, CONTAINER)
    with pytest.raises(HookFailed) as err:
        loop.run_until_complete(chains[FailurePolicy.FAIL].run(ctx, deadline=None))
    assert err.value.hook == "raw"
    assert "answer is not a ContainerResourceHookResponse (3 bytes)" in err.value.reason
