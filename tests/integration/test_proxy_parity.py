"""Through the proxy, kubelet sees exactly what containerd says.

Every CRI method kubelet uses is called twice, back-to-back on the same objects:
once straight to the fixture containerd and once through the real proxy process
(no hooks configured). Replies are compared as raw bytes. The only exception are
stats replies, whose counters and sampling timestamps change between any two calls
(see ``VOLATILE_STATS``); those are compared after zeroing exactly those fields.
Errors must carry the same status code and details both ways.
"""

from __future__ import annotations

import base64
import json
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format, text_format
from google.protobuf.message import Message

from criapi import cri_v1_pb2 as cri
from runtimeproxy.dataplane import haproxy
from runtimeproxy.demo.embedded import EmbeddedContainerd, runtime_stub
from tests.unit import h2raw

RT = "/runtime.v1.RuntimeService/"


@pytest.fixture(scope="module")
def proxy_config(data_plane: dict[str, Any]) -> dict[str, Any]:
    """Every test here runs through both data planes (the in-process gRPC server, HAProxy)."""
    return data_plane
IMG = "/runtime.v1.ImageService/"

#: Fields of stats replies that are samples taken at call time: a cumulative CPU
#: counter, memory/fs usage that moves with every page the kernel touches, and the
#: sampling timestamps. Their presence is still compared, only the value is zeroed.
VOLATILE_STATS = frozenset({
    "timestamp", "usage_core_nano_seconds", "usage_nano_cores", "working_set_bytes", "available_bytes",
    "usage_bytes", "rss_bytes", "page_faults", "major_page_faults", "used_bytes", "inodes_used",
    "swap_available_bytes", "swap_usage_bytes",
})


class Pair:
    """The same call on two channels: straight to containerd, and through the proxy."""

    def __init__(self, direct: grpc.Channel, proxied: grpc.Channel) -> None:
        self.direct = direct
        self.proxied = proxied

    def unary(self, method: str, request: Message) -> tuple[bytes, bytes]:
        payload = request.SerializeToString()
        a = self.direct.unary_unary(method)(payload, timeout=30)
        b = self.proxied.unary_unary(method)(payload, timeout=30)
        return a, b

    def same_bytes(self, method: str, request: Message) -> bytes:
        """For replies without map fields: the bytes must be identical."""
        a, b = self.unary(method, request)
        assert b == a, f"{method}: proxied reply differs from direct reply"
        return a

    def same_message(self, method: str, request: Message, reply_type: type[Message]) -> Message:
        """For replies with map fields (labels, annotations, verbose info): containerd
        writes Go maps in random order, so even two direct calls differ in byte order.
        Same length, and equal once parsed (protobuf compares maps by content)."""
        a, b = self.unary(method, request)
        direct, proxied = reply_type.FromString(a), reply_type.FromString(b)
        assert len(b) == len(a) and proxied == direct, f"{method}: proxied reply differs from direct reply"
        return direct

    def error(self, method: str, request: Message, *, stream: bool = False) -> tuple[grpc.StatusCode, str]:
        """Both calls must fail the same way; returns (code, details)."""
        payload = request.SerializeToString()
        outcomes = []
        for channel in (self.direct, self.proxied):
            try:
                if stream:
                    list(channel.unary_stream(method)(payload, timeout=10))
                else:
                    channel.unary_unary(method)(payload, timeout=10)
            except grpc.RpcError as exc:
                outcomes.append((exc.code(), exc.details()))
            else:
                outcomes.append((grpc.StatusCode.OK, ""))
        assert outcomes[1] == outcomes[0], f"{method}: direct {outcomes[0]} vs proxied {outcomes[1]}"
        return outcomes[0]

    def same_items(self, method: str, request: Message, reply_type: type[Message], field: str,
                   mask: Callable[[Message], Message] = lambda m: m) -> Message:
        """For list replies: containerd lists from Go maps, so the order is random.
        The same items (each compared by content, maps included), in any order."""
        a, b = self.unary(method, request)
        direct, proxied = mask(reply_type.FromString(a)), mask(reply_type.FromString(b))
        key: Callable[[Any], str] = lambda item: getattr(item, "id", "") or item.attributes.id  # noqa: E731
        assert sorted_items(proxied, field, key) == sorted_items(direct, field, key), f"{method}: items differ"
        return direct


def mask_stats(msg: Message) -> Message:
    """Zero the VOLATILE_STATS fields (recursively), keeping their presence."""
    for field, value in msg.ListFields():
        repeated = field.is_repeated
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            continue
        if field.name in VOLATILE_STATS and not repeated:
            if field.message_type is None:
                setattr(msg, field.name, 0)
            else:
                value.SetInParent()
                value.value = 0
            continue
        if field.message_type is not None:
            for item in value if repeated else [value]:
                mask_stats(item)
    return msg


def sorted_items(msg: Message, field: str, key: Callable[[Any], str]) -> list[bytes]:
    """Items of a list reply in a stable order (containerd lists from Go maps)."""
    return [item.SerializeToString(deterministic=True) for item in sorted(getattr(msg, field), key=key)]


@pytest.fixture(scope="module")
def pair(
    containerd: EmbeddedContainerd, proxy: Any, cri_channel_factory: Callable[[Path | str], grpc.Channel]
) -> Pair:
    return Pair(cri_channel_factory(containerd.socket), proxy.channel())


@pytest.fixture(scope="module")
def running(module_pods: Any, proxy: Any) -> Iterator[dict[str, Any]]:
    """A pod with one running container, created through the proxy."""
    rt = proxy.runtime()
    pod = module_pods.sandbox("parity-read")
    sid = module_pods.run(rt, pod)
    cfg = module_pods.container(
        "app", envs={"FOO": "bar"},
        resources=cri.LinuxContainerResources(cpu_shares=512, memory_limit_in_bytes=64 << 20),
    )
    cid = module_pods.create(rt, sid, pod, cfg)
    module_pods.start(rt, cid)
    yield {"sid": sid, "cid": cid, "pod": pod, "cfg": cfg}


def test_runtime_and_image_info_are_byte_identical(pair: Pair, busybox_image: str) -> None:
    version = cri.VersionResponse.FromString(pair.same_bytes(RT + "Version", cri.VersionRequest(version="v1")))
    assert version.runtime_name == "containerd"
    status = cri.StatusResponse.FromString(pair.same_bytes(RT + "Status", cri.StatusRequest()))
    assert {c.type for c in status.status.conditions} == {"RuntimeReady", "NetworkReady"}
    verbose = pair.same_message(RT + "Status", cri.StatusRequest(verbose=True), cri.StatusResponse)
    assert verbose.info, "verbose Status carries containerd's config"

    # RuntimeConfig is newer than containerd 1.6: whatever containerd answers, the proxy answers.
    code, details = pair.error(RT + "RuntimeConfig", cri.RuntimeConfigRequest())
    if code is grpc.StatusCode.OK:
        pair.same_bytes(RT + "RuntimeConfig", cri.RuntimeConfigRequest())
    else:
        assert code is grpc.StatusCode.UNIMPLEMENTED and "RuntimeConfig" in details

    image = cri.ImageStatusResponse.FromString(
        pair.same_bytes(IMG + "ImageStatus", cri.ImageStatusRequest(image=cri.ImageSpec(image=busybox_image))))
    assert busybox_image in image.image.repo_tags
    pair.same_message(IMG + "ImageStatus", cri.ImageStatusRequest(image=cri.ImageSpec(image=busybox_image),
                                                                verbose=True), cri.ImageStatusResponse)
    missing = pair.same_bytes(IMG + "ImageStatus", cri.ImageStatusRequest(image=cri.ImageSpec(image="nope:0")))
    assert not cri.ImageStatusResponse.FromString(missing).HasField("image")

    listed = pair.same_items(IMG + "ListImages", cri.ListImagesRequest(), cri.ListImagesResponse, "images")
    assert {busybox_image, "docker.io/koord/pause:test"} <= {t for i in listed.images for t in i.repo_tags}
    pair.same_items(IMG + "ListImages", cri.ListImagesRequest(filter=cri.ImageFilter(
        image=cri.ImageSpec(image=busybox_image))), cri.ListImagesResponse, "images")

    a, b = pair.unary(IMG + "ImageFsInfo", cri.ImageFsInfoRequest())
    fs_direct, fs_proxied = cri.ImageFsInfoResponse.FromString(a), cri.ImageFsInfoResponse.FromString(b)
    assert fs_direct.image_filesystems[0].fs_id.mountpoint
    assert mask_stats(fs_proxied) == mask_stats(fs_direct)


def test_object_reads_are_byte_identical(pair: Pair, running: dict[str, Any]) -> None:
    sid, cid = running["sid"], running["cid"]
    for verbose in (False, True):
        pod = pair.same_message(RT + "PodSandboxStatus", cri.PodSandboxStatusRequest(
            pod_sandbox_id=sid, verbose=verbose), cri.PodSandboxStatusResponse)
        assert pod.status.state == cri.SANDBOX_READY and bool(pod.info) is verbose
        ctr = pair.same_bytes(RT + "ContainerStatus", cri.ContainerStatusRequest(container_id=cid, verbose=verbose))
        assert cri.ContainerStatusResponse.FromString(ctr).status.state == cri.CONTAINER_RUNNING

    by_id = pair.same_message(RT + "ListPodSandbox", cri.ListPodSandboxRequest(
        filter=cri.PodSandboxFilter(id=sid)), cri.ListPodSandboxResponse)
    assert [p.id for p in by_id.items] == [sid]
    every = pair.same_items(RT + "ListPodSandbox", cri.ListPodSandboxRequest(), cri.ListPodSandboxResponse, "items")
    assert sid in {p.id for p in every.items}

    in_pod = pair.same_bytes(RT + "ListContainers", cri.ListContainersRequest(
        filter=cri.ContainerFilter(pod_sandbox_id=sid)))
    assert [c.id for c in cri.ListContainersResponse.FromString(in_pod).containers] == [cid]
    every = pair.same_items(RT + "ListContainers", cri.ListContainersRequest(), cri.ListContainersResponse,
                            "containers")
    assert cid in {c.id for c in every.containers}

    out = pair.same_bytes(RT + "ExecSync", cri.ExecSyncRequest(
        container_id=cid, cmd=["sh", "-c", "echo out $FOO; echo err >&2; exit 3"], timeout=10))
    reply = cri.ExecSyncResponse.FromString(out)
    assert (reply.stdout, reply.stderr, reply.exit_code) == (b"out bar\n", b"err\n", 3)


def test_stats_match_except_sampled_counters(pair: Pair, running: dict[str, Any]) -> None:
    sid, cid = running["sid"], running["cid"]

    a, b = pair.unary(RT + "ContainerStats", cri.ContainerStatsRequest(container_id=cid))
    direct = cri.ContainerStatsResponse.FromString(a)
    assert direct.stats.attributes.id == cid and direct.stats.cpu.usage_core_nano_seconds.value > 0
    assert mask_stats(cri.ContainerStatsResponse.FromString(b)) == mask_stats(direct)

    for flt in (cri.ContainerStatsFilter(id=cid), cri.ContainerStatsFilter()):
        listed = pair.same_items(RT + "ListContainerStats", cri.ListContainerStatsRequest(filter=flt),
                                 cri.ListContainerStatsResponse, "stats", mask_stats)
        assert cid in {s.attributes.id for s in listed.stats}

    a, b = pair.unary(RT + "PodSandboxStats", cri.PodSandboxStatsRequest(pod_sandbox_id=sid))
    pod_stats = cri.PodSandboxStatsResponse.FromString(a)
    assert pod_stats.stats.attributes.id == sid
    assert [c.attributes.id for c in pod_stats.stats.linux.containers] == [cid]
    assert mask_stats(cri.PodSandboxStatsResponse.FromString(b)) == mask_stats(pod_stats)

    listed = pair.same_items(RT + "ListPodSandboxStats", cri.ListPodSandboxStatsRequest(
        filter=cri.PodSandboxStatsFilter(id=sid)), cri.ListPodSandboxStatsResponse, "stats", mask_stats)
    assert [s.attributes.id for s in listed.stats] == [sid]


def test_errors_are_relayed_unchanged(pair: Pair) -> None:
    code, details = pair.error(RT + "ContainerStatus", cri.ContainerStatusRequest(container_id="no-such-container"))
    assert code is grpc.StatusCode.NOT_FOUND and "no-such-container" in details
    # Intercepted methods relay containerd's error too when the object is unknown.
    code, details = pair.error(RT + "StopContainer", cri.StopContainerRequest(container_id="no-such-container"))
    assert code is grpc.StatusCode.NOT_FOUND and "no-such-container" in details
    code, _ = pair.error(RT + "UpdateContainerResources", cri.UpdateContainerResourcesRequest(
        container_id="no-such-container", linux=cri.LinuxContainerResources(cpu_shares=10)))
    assert code is grpc.StatusCode.NOT_FOUND
    # containerd 1.6 has no event stream; kubelet falls back to relisting on this exact status.
    code, details = pair.error(RT + "GetContainerEvents", cri.GetEventsRequest(), stream=True)
    assert code is grpc.StatusCode.UNIMPLEMENTED, details
    assert details == "method GetContainerEvents not implemented"


# --- write methods: the same lifecycle twice, directly and through the proxy --------


def _normalized(msg: Message, ids: dict[str, str]) -> str:
    """Text form with ids replaced by role names and wall-clock timestamps zeroed."""
    msg = type(msg).FromString(msg.SerializeToString())
    status = getattr(msg, "status", None)
    if status is not None:
        for name in ("created_at", "started_at", "finished_at"):
            if hasattr(status, name):
                setattr(status, name, 0)
    text = text_format.MessageToString(msg)
    for real, role in ids.items():
        text = text.replace(real, role)
    return text


def _error(call: Callable[[], object], ids: dict[str, str]) -> str:
    try:
        call()
    except grpc.RpcError as exc:
        details = exc.details() or ""
        for real, role in ids.items():
            details = details.replace(real, role)
        return f"{exc.code().name}: {details}"
    return "OK"


def _lifecycle(rt: Any, pods: Any, pod: cri.PodSandboxConfig, cfg: cri.ContainerConfig) -> list[tuple[str, str]]:
    """Run kubelet's sequence of calls; return a transcript free of ids and times."""
    out: list[tuple[str, str]] = []
    sid = pods.run(rt, pod)
    ids = {sid: "<sandbox>"}
    pod_status = lambda: rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=sid), timeout=10)  # noqa: E731
    out.append(("RunPodSandbox", _normalized(pod_status(), ids)))

    cid = pods.create(rt, sid, pod, cfg)
    ids[cid] = "<container>"
    status = lambda: rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=10)  # noqa: E731
    out.append(("CreateContainer", _normalized(status(), ids)))
    rt_empty = rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=60)
    out.append(("StartContainer", _normalized(rt_empty, ids) + _normalized(status(), ids)))

    update = cri.UpdateContainerResourcesRequest(
        container_id=cid, linux=cri.LinuxContainerResources(cpu_shares=300, memory_limit_in_bytes=96 << 20))
    out.append(("UpdateContainerResources", _normalized(rt.UpdateContainerResources(update, timeout=30), ids)))
    out.append(("cgroup", pods.cgroup_value(pod, cid, "cpu", "cpu.shares") + " "
                + pods.cgroup_value(pod, cid, "memory", "memory.limit_in_bytes")))

    stop = rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0), timeout=30)
    out.append(("StopContainer", _normalized(stop, ids) + _normalized(status(), ids)))
    out.append(("RemoveContainer", _normalized(rt.RemoveContainer(
        cri.RemoveContainerRequest(container_id=cid), timeout=30), ids) + _error(status, ids)))
    out.append(("StopContainer(removed)", _error(lambda: rt.StopContainer(
        cri.StopContainerRequest(container_id=cid, timeout=0), timeout=30), ids)))

    out.append(("StopPodSandbox", _normalized(rt.StopPodSandbox(
        cri.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=60), ids) + _normalized(pod_status(), ids)))
    out.append(("RemovePodSandbox", _normalized(rt.RemovePodSandbox(
        cri.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=60), ids) + _error(pod_status, ids)))
    listed = rt.ListPodSandbox(cri.ListPodSandboxRequest(filter=cri.PodSandboxFilter(id=sid)), timeout=10)
    out.append(("ListPodSandbox(removed)", _normalized(listed, ids)))
    return out


def _verbose_config(info: Any, message: Message) -> Message:
    """containerd's verbose ``info.config`` (Go JSON of the CRI struct) as a message.

    Go encodes the env values (``bytes`` in this proto, ``string`` in Go) as plain
    text; protobuf JSON expects base64, so they are re-encoded first."""
    config = json.loads(info["info"])["config"]
    for env in config.get("envs", []):
        env["value"] = base64.b64encode(env.get("value", "").encode()).decode()
    json_format.ParseDict(config, message, ignore_unknown_fields=False)
    return message


def test_lifecycle_through_proxy_matches_direct(
    pods: Any, proxy: Any, containerd: EmbeddedContainerd,
    cri_channel_factory: Callable[[Path | str], grpc.Channel],
) -> None:
    direct = runtime_stub(cri_channel_factory(containerd.socket))
    proxied = proxy.runtime()
    pod = pods.sandbox("parity-life", annotations={"a": "b"}, labels={"app": "parity"})
    cfg = pods.container("app", envs={"FOO": "bar", "EMPTY": ""}, annotations={"c": "d"},
                         resources=cri.LinuxContainerResources(cpu_shares=512, cpu_quota=50000,
                                                               cpu_period=100000, memory_limit_in_bytes=64 << 20))
    # The same kubelet requests, first straight to containerd, then through the proxy.
    expected = _lifecycle(direct, pods, pod, cfg)
    got = _lifecycle(proxied, pods, pod, cfg)
    for (step, want), (_, have) in zip(expected, got, strict=True):
        assert have == want, f"{step} differs through the proxy"
    assert dict(expected)["cgroup"] == f"300 {96 << 20}"
    assert "CONTAINER_EXITED" in dict(expected)["StopContainer"]
    assert dict(expected)["RemoveContainer"].startswith("NOT_FOUND")
    # The proxied run really went through the proxy's interception path: every lifecycle call
    # with the gRPC transport; behind HAProxy (no hooks here) only those the store needs to
    # see (runtimeproxy.dataplane.haproxy.STORE_CALLS), the rest straight to containerd.
    intercepted = {e["method"] for e in proxy.events("cri_call", pod_name="parity-life", result="OK")}
    if proxy.config()["data_plane"] == "grpc":
        assert intercepted == {"RunPodSandbox", "CreateContainer", "StartContainer", "UpdateContainerResources",
                               "StopContainer", "RemoveContainer", "StopPodSandbox", "RemovePodSandbox"}
    else:
        assert intercepted == haproxy.STORE_CALLS


def test_requests_reach_containerd_unchanged_without_hooks(pods: Any, proxy: Any) -> None:
    rt = proxy.runtime()
    pod = pods.sandbox("parity-unchanged", annotations={"example.koordinator.sh/cpu-shares": "700"})
    cfg = pods.container("app", envs={"FOO": "bar", "PATH_X": "/a b/c"},
                         resources=cri.LinuxContainerResources(cpu_shares=512, cpu_quota=20000, cpu_period=100000,
                                                               memory_limit_in_bytes=32 << 20))
    sid = pods.run(rt, pod)
    cid = pods.create(rt, sid, pod, cfg)
    pod_info = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=sid, verbose=True), timeout=10).info
    assert _verbose_config(pod_info, cri.PodSandboxConfig()) == pod
    ctr_info = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid, verbose=True), timeout=10).info
    assert _verbose_config(ctr_info, cri.ContainerConfig()) == cfg


# --- routing on :path alone, whatever :authority holds ------------------------------

#: ``:authority`` values kubelet's gRPC clients send or could: grpc-go 1.49 (kubelet 1.26)
#: sends the socket path as it is, newer grpc-go percent-encodes it, others send
#: ``localhost`` or nothing. ``{socket}``: the proxy's socket path.
AUTHORITIES = {
    "absent": None, "empty": "", "localhost": "localhost", "socket-path": "{socket}",
    "percent-encoded": "{quoted}",
}
VERSION_REQUEST = cri.VersionRequest(version="v1").SerializeToString()
NOT_CRI = "/containerd.services.version.v1.Version/Version"
NOT_CRI_MESSAGE = b"koord-runtime-proxy relays only the CRI services"


def _authority(name: str, socket: Path) -> str | None:
    value = AUTHORITIES[name]
    if value is None:
        return None
    return value.format(socket=socket, quoted=urllib.parse.quote(str(socket), safe=""))


def _header_block(frames: list[h2raw.Frame]) -> bytes:
    return b"".join(f.payload for f in frames if f.type == h2raw.HEADERS)


@pytest.mark.parametrize("authority", list(AUTHORITIES))
def test_routing_depends_on_path_alone_whatever_the_authority(
    containerd: EmbeddedContainerd, proxy: Any, authority: str
) -> None:
    """The same method, reply and refusal through the proxy for every ``:authority``
    (raw HTTP/2: a grpc client cannot leave it out), on both data planes."""
    value = _authority(authority, proxy.socket)
    if value is None and proxy.config()["data_plane"] == "grpc":
        # grpc core refuses a request without :authority (and host) before any routing: a
        # reset stream. gRPC clients always send one; HAProxy serves it (below).
        frames = h2raw.unary(proxy.socket, RT + "Version", VERSION_REQUEST, authority=None)
        assert [f.type for f in frames] == [h2raw.RST_STREAM]
        return

    def through(socket: Path, method: str, request: bytes, value: str | None = value) -> list[h2raw.Frame]:
        return h2raw.unary(socket, method, request, timeout=30, authority=value)

    # Pass-through, both services: the reply containerd gives directly.
    direct = h2raw.reply_message(through(containerd.socket, RT + "Version", VERSION_REQUEST, "localhost"))
    assert direct is not None and cri.VersionResponse.FromString(direct).runtime_name == "containerd"
    assert h2raw.reply_message(through(proxy.socket, RT + "Version", VERSION_REQUEST)) == direct
    status = cri.ImageStatusRequest(image=cri.ImageSpec(image="krp-test/no-such-image:1")).SerializeToString()
    direct = h2raw.reply_message(through(containerd.socket, IMG + "ImageStatus", status, "localhost"))
    assert h2raw.reply_message(through(proxy.socket, IMG + "ImageStatus", status)) == direct == b""
    # Intercepted (RunPodSandbox goes through Python on both planes): it reaches the
    # lifecycle, which relays containerd's refusal of an empty config.
    before = len(proxy.events("cri_call", method="RunPodSandbox"))
    frames = through(proxy.socket, RT + "RunPodSandbox", b"")
    assert [(f.type, f.flags & h2raw.END_STREAM) for f in frames] == [(h2raw.HEADERS, h2raw.END_STREAM)]
    assert b"grpc-status" in _header_block(frames)
    assert len(proxy.events("cri_call", method="RunPodSandbox")) == before + 1
    # Not CRI: answered by the proxy itself (HAProxy's or the gRPC server's UNIMPLEMENTED).
    frames = through(proxy.socket, NOT_CRI, b"")
    assert len(frames) == 1 and NOT_CRI_MESSAGE in _header_block(frames), frames


def test_authority_and_path_are_never_read_as_one(containerd: EmbeddedContainerd, proxy: Any) -> None:
    """``:authority: x/runtime.v1.RuntimeService`` + ``:path: /Version`` is no CRI call,
    although HAProxy's absolute URI reads ``http://x/runtime.v1.RuntimeService/Version``."""
    frames = h2raw.unary(proxy.socket, "/Version", VERSION_REQUEST, authority="x/runtime.v1.RuntimeService")
    assert len(frames) == 1 and NOT_CRI_MESSAGE in _header_block(frames), frames
    # And a CRI :path keeps its method whatever the authority adds in front of it.
    frames = h2raw.unary(proxy.socket, RT + "Version", VERSION_REQUEST, authority="x/runtime.v1.ImageService")
    message = h2raw.reply_message(frames)
    assert message is not None and cri.VersionResponse.FromString(message).runtime_name == "containerd"
    # An authority beyond haproxy.MAX_AUTHORITY keeps HAProxy's own split of the URI: with
    # a "/" in it the path read (and relayed) is no CRI method, so HAProxy refuses it
    # itself; no server ever gets a path other than the one routed on.
    if proxy.config()["data_plane"] == "haproxy":
        frames = h2raw.unary(proxy.socket, RT + "Version", VERSION_REQUEST, authority="/a" * 600)
        assert len(frames) == 1 and NOT_CRI_MESSAGE in _header_block(frames), frames


@pytest.mark.parametrize("authority", [name for name, value in AUTHORITIES.items() if value is not None])
def test_a_kubelet_lifecycle_with_any_authority_matches_direct(
    pods: Any, proxy: Any, containerd: EmbeddedContainerd, authority: str,
    cri_channel_factory: Callable[[Path | str], grpc.Channel],
) -> None:
    """kubelet's whole pod lifecycle through a gRPC client whose ``:authority`` is set
    (``grpc.default_authority``; ``socket-path`` is what kubelet 1.26 sends)."""
    channel = grpc.insecure_channel(f"unix://{proxy.socket}", options=[
        ("grpc.default_authority", _authority(authority, proxy.socket))])
    try:
        direct = runtime_stub(cri_channel_factory(containerd.socket))
        pod = pods.sandbox(f"parity-auth-{authority}")
        cfg = pods.container("app", resources=cri.LinuxContainerResources(cpu_shares=512))
        expected = _lifecycle(direct, pods, pod, cfg)
        got = _lifecycle(runtime_stub(channel), pods, pod, cfg)
        for (step, want), (_, have) in zip(expected, got, strict=True):
            assert have == want, f"{step} differs through the proxy with :authority {authority}"
        assert {e["method"] for e in proxy.events("cri_call", pod_name=f"parity-auth-{authority}", result="OK")} \
            >= {"RunPodSandbox", "CreateContainer"}
    finally:
        channel.close()
