"""What exactly crosses to the backend: untouched requests byte for byte, and the
caller's metadata without the per-hop headers (issue 14, "the suite must be able to fail").
"""

from __future__ import annotations

from typing import Any

import grpc
import grpc.aio
import pytest

from criapi import cri_v1_pb2 as cri
from runtimeproxy.transport.grpcbackend import _HOP_HEADERS, GrpcBackend, forwardable

RT = "/runtime.v1.RuntimeService/"
CREATE = RT + "CreateContainer"
UPDATE = RT + "UpdateContainerResources"
STATUS = RT + "Status"
KUBELET_UA = "kubelet/v1.31.0-test"


def _create_request(wire: Any) -> bytes:
    config = cri.ContainerConfig(metadata=cri.ContainerMetadata(name="app"), image=cri.ImageSpec(image="busybox"))
    config.linux.resources.cpu_shares = 512
    sandbox = cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="p", namespace="ns", uid="u-1"))
    sandbox.linux.cgroup_parent = "/kubepods/burstable/podu-1"
    # Unknown field first, then the known fields in reverse order: a parse and
    # re-serialise would move the unknown field last and sort the known ones.
    return (wire.field(1999, b"kubelet-from-the-future") + wire.field(3, sandbox.SerializeToString())
            + wire.field(2, config.SerializeToString()) + wire.field(1, b"sb-1"))


def _update_request(wire: Any, container_id: str) -> bytes:
    linux = cri.LinuxContainerResources(cpu_shares=256, memory_limit_in_bytes=64 << 20)
    return wire.field(1999, b"future") + wire.field(2, linux.SerializeToString()) + wire.field(1, container_id.encode())


@pytest.mark.asyncio
async def test_untouched_create_and_update_reach_the_backend_byte_identical(
    fake_runtime, start_proxy, hook_module, wire
) -> None:
    """Hooks run (an observer at every stage) and change nothing: the bytes kubelet sent
    are the bytes containerd gets. Only RunPodSandbox was covered before; a lifecycle
    that always re-serialised CreateContainer or UpdateContainerResources survived."""
    proxy = await start_proxy(fake_runtime, hooks=[{"name": "watch", "plugin": hook_module.plugin("Observer")}])
    # The pod first, so the container lands in the store and its update runs the hooks.
    run = cri.RunPodSandboxRequest(config=cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name="p", namespace="ns", uid="u-1")))
    run.config.linux.cgroup_parent = "/kubepods/burstable/podu-1"
    await proxy.call(RT + "RunPodSandbox", run.SerializeToString())
    create = _create_request(wire)
    assert cri.CreateContainerRequest.FromString(create).SerializeToString() != create  # the check has teeth

    reply = await proxy.call(CREATE, create)
    container_id = cri.CreateContainerResponse.FromString(reply).container_id
    update = _update_request(wire, container_id)
    assert cri.UpdateContainerResourcesRequest.FromString(update).SerializeToString() != update
    await proxy.call(UPDATE, update)

    assert [c.payload for c in fake_runtime.received(CREATE)] == [create]
    assert [c.payload for c in fake_runtime.received(UPDATE)] == [update]
    stages = [stage for _, stage, _ in hook_module.events]
    assert stages == ["PreRunPodSandbox", "PostRunPodSandbox", "PreCreateContainer", "PostCreateContainer",
                      "PreUpdateContainerResources", "PostUpdateContainerResources"], "the hooks did run"


# --- hop headers ------------------------------------------------------------------------


def test_forwardable_drops_every_hop_header_and_keeps_the_rest_in_order() -> None:
    caller = [("x-first", "1"), ("user-agent", KUBELET_UA), ("grpc-timeout", "2S"), ("grpc-encoding", "gzip"),
              ("grpc-accept-encoding", "identity,gzip"), ("x-trace-bin", b"\x00\x01"), ("x-last", "2")]
    assert {k for k, _ in caller} >= _HOP_HEADERS
    assert forwardable(caller) == (("x-first", "1"), ("x-trace-bin", b"\x00\x01"), ("x-last", "2"))
    assert forwardable(None) == ()


@pytest.fixture
def backend_seam(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[Any, ...]]]:
    """Records the metadata every call hands to the Backend seam (pass-through callables
    and ``Backend.unary``), then lets the call go on to the fake containerd.

    Through grpc core nothing would show: it drops a ``user-agent`` given as call metadata
    and never shows ``grpc-*`` headers to handlers. The seam is where another transport
    (an HTTP/2 proxy in front, a recording backend) would see them."""
    seen: list[tuple[str, tuple[Any, ...]]] = []
    unary_callable, unary = GrpcBackend.unary_callable, GrpcBackend.unary

    def recording_callable(self: GrpcBackend, method: str) -> Any:
        multi = unary_callable(self, method)

        def call(request: bytes, **kw: Any) -> Any:
            seen.append((method, tuple(kw.get("metadata") or ())))
            return multi(request, **kw)

        return call

    async def recording_unary(self: GrpcBackend, method: str, payload: bytes, **kw: Any) -> Any:
        seen.append((method, tuple(kw.get("metadata") or ())))
        return await unary(self, method, payload, **kw)

    monkeypatch.setattr(GrpcBackend, "unary_callable", recording_callable)
    monkeypatch.setattr(GrpcBackend, "unary", recording_unary)
    return seen


@pytest.mark.asyncio
async def test_caller_hop_headers_are_not_handed_to_the_backend(
    fake_runtime, start_proxy, backend_seam, wire
) -> None:
    proxy = await start_proxy(fake_runtime)
    options = [("grpc.primary_user_agent", KUBELET_UA)]
    async with grpc.aio.insecure_channel(f"unix://{proxy.socket}", options=options,
                                         compression=grpc.Compression.Gzip) as kubelet:
        for method, payload in ((STATUS, b""), (CREATE, _create_request(wire))):
            await kubelet.unary_unary(method)(payload, timeout=5, metadata=(("x-koord-trace", "t1"),))
    by_method = {method: md for method, md in backend_seam}
    assert set(by_method) >= {STATUS, CREATE}, backend_seam
    for method in (STATUS, CREATE):  # pass-through and intercepted
        assert by_method[method] == (("x-koord-trace", "t1"),), method
