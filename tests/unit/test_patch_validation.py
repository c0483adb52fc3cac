"""Hook patches are validated before they reach the runtime (issue 14, item 2).

A real hook server on a unix socket answers one bad value at a time; the proxy in
front of a recording fake containerd must forward nothing invalid: under Ignore
the hook's whole patch is dropped (the backend gets kubelet's request byte for
byte) and one ``hook_failed`` line names hook, field and value; under Fail the
call is FAILED_PRECONDITION and nothing is forwarded. Local plugin hooks go
through the same check. The pure rules are pinned below that."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from criapi import cri_v1_pb2 as cri
from criapi import hook_v1alpha1_pb2 as pb
from criapi import hook_v1alpha1_pb2_grpc as pb_grpc
from runtimeproxy.chain.hookchain import BoundHook, HookChain, HookPools
from runtimeproxy.chain.validate import PatchError, PatchValidator
from runtimeproxy.config.settings import FailurePolicy
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerInfo,
    ContainerMeta,
    ContainerPatch,
    HostRoots,
    PodContext,
    PodInfo,
    PodMeta,
    PodPatch,
    ResourcesPatch,
    Stage,
)

RT = "/runtime.v1.RuntimeService/"
RUN = RT + "RunPodSandbox"
CREATE = RT + "CreateContainer"
PARENT = "/kubepods/burstable/poduid-1"

PodChange = Callable[[pb.PodSandboxHookResponse], None]
ContainerChange = Callable[[pb.ContainerResourceHookResponse], None]


class ScriptedHookServer(pb_grpc.RuntimeHookServiceServicer):
    """Answers like koordlet (pre-filled from the request), then applies the test's change."""

    def __init__(self) -> None:
        self.pod_change: PodChange = lambda resp: None
        self.container_change: ContainerChange = lambda resp: None
        self.calls = 0

    async def PreRunPodSandboxHook(self, request: Any, context: Any) -> Any:
        self.calls += 1
        resp = pb.PodSandboxHookResponse(
            labels=request.labels, annotations=request.annotations, cgroup_parent=request.cgroup_parent
        )
        resp.resources.CopyFrom(request.resources)
        self.pod_change(resp)
        return resp

    async def PreCreateContainerHook(self, request: Any, context: Any) -> Any:
        self.calls += 1
        resp = pb.ContainerResourceHookResponse(
            container_annotations=request.container_annotations,
            container_envs=request.container_envs,
            pod_cgroup_parent=request.pod_cgroup_parent,
        )
        resp.container_resources.CopyFrom(request.container_resources)
        self.container_change(resp)
        return resp


@pytest_asyncio.fixture
async def hook_server(short_dir: Path) -> AsyncIterator[tuple[ScriptedHookServer, Path]]:
    socket = short_dir / "h.sock"
    fake = ScriptedHookServer()
    server = grpc.aio.server()
    pb_grpc.add_RuntimeHookServiceServicer_to_server(fake, server)
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    yield fake, socket
    await server.stop(None)


def four_cpu_node(directory: Path) -> str:
    """A sys root with CPUs 0-3 and NUMA node 0 online (the online source, injected)."""
    root = directory / "sys"
    for sub, text in (("cpu/online", "0-3\n"), ("node/online", "0\n")):
        path = root / "devices" / "system" / sub
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


def run_payload() -> bytes:
    cfg = cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name="web-0", namespace="prod", uid="uid-1"),
        labels={"app": "web"},
        annotations={"team": "a"},
    )
    cfg.linux.cgroup_parent = PARENT
    cfg.linux.resources.cpu_shares = 1024
    return cri.RunPodSandboxRequest(config=cfg, runtime_handler="runc").SerializeToString()


def create_payload() -> bytes:
    cfg = cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name="app"), image=cri.ImageSpec(image="nginx:1"),
        annotations={"io.kubernetes.container.hash": "abc"},
    )
    cfg.envs.add(key="HOME", value=b"/root")
    cfg.linux.resources.cpu_shares = 1024
    cfg.linux.resources.cpu_quota = 100000
    sandbox = cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="web-0", namespace="prod", uid="uid-1"))
    sandbox.linux.cgroup_parent = PARENT
    req = cri.CreateContainerRequest(pod_sandbox_id="sb-unknown", config=cfg, sandbox_config=sandbox)
    return req.SerializeToString()


def _set(attr: str, value: Any) -> Callable[[Any], None]:
    def change(resp: Any) -> None:
        setattr(resp, attr, value)

    return change


def _res(field: str, value: Any) -> Callable[[Any], None]:
    def change(resp: Any) -> None:
        res = resp.resources if isinstance(resp, pb.PodSandboxHookResponse) else resp.container_resources
        setattr(res, field, value)

    return change


def _entry(attr: str, key: str, value: str) -> Callable[[Any], None]:
    def change(resp: Any) -> None:
        getattr(resp, attr)[key] = value

    return change


def _unified(key: str, value: str) -> Callable[[Any], None]:
    def change(resp: Any) -> None:
        resp.container_resources.unified[key] = value

    return change


MEGA = "x" * (1 << 20)

#: (id, method, change, field named in the log, value shown in the log)
BAD_ANSWERS: list[tuple[str, str, Callable[[Any], None], str, str]] = [
    ("pod-parent-dotdot", RUN, _set("cgroup_parent", "/../../etc/evil"), "pod.cgroup_parent", "/../../etc/evil"),
    ("pod-parent-outside-kubepods", RUN, _set("cgroup_parent", "/etc/evil"), "pod.cgroup_parent", "/etc/evil"),
    ("pod-parent-relative", RUN, _set("cgroup_parent", "kubepods/x"), "pod.cgroup_parent", "kubepods/x"),
    ("pod-parent-slice", RUN, _set("cgroup_parent", "kubepods-x.slice"), "pod.cgroup_parent", "kubepods-x.slice"),
    ("container-parent-dotdot", CREATE, _set("pod_cgroup_parent", "/kubepods/../../etc/evil"), "pod.cgroup_parent",
     "/kubepods/../../etc/evil"),
    ("cpuset-huge", CREATE, _res("cpuset_cpus", "0-99999"), "container.resources.cpuset_cpus", "0-99999"),
    ("cpuset-offline", CREATE, _res("cpuset_cpus", "2-5"), "container.resources.cpuset_cpus", "2-5"),
    ("cpuset-garbage", CREATE, _res("cpuset_cpus", "1,,2"), "container.resources.cpuset_cpus", "1,,2"),
    ("mems-offline", CREATE, _res("cpuset_mems", "1"), "container.resources.cpuset_mems", "1"),
    ("shares-2^60", CREATE, _res("cpu_shares", 2**60), "container.resources.cpu_shares", str(2**60)),
    ("shares-1", CREATE, _res("cpu_shares", 1), "container.resources.cpu_shares", "1"),
    ("quota-minus-7", CREATE, _res("cpu_quota", -7), "container.resources.cpu_quota", "-7"),
    ("quota-999", CREATE, _res("cpu_quota", 999), "container.resources.cpu_quota", "999"),
    ("period-huge", CREATE, _res("cpu_period", 1_000_001), "container.resources.cpu_period", "1000001"),
    ("memory-minus-2^62", CREATE, _res("memory_limit_in_bytes", -(2**62)), "container.resources.memory_limit_in_bytes",
     str(-(2**62))),
    ("swap-negative", CREATE, _res("memory_swap_limit_in_bytes", -2), "container.resources.memory_swap_limit_in_bytes",
     "-2"),
    ("oom-score-adj", CREATE, _res("oom_score_adj", 1001), "container.resources.oom_score_adj", "1001"),
    ("pod-shares", RUN, _res("cpu_shares", 2**60), "pod.resources.cpu_shares", str(2**60)),
    ("env-path", CREATE, _entry("container_envs", "PATH", "/evil"), "container.envs['PATH']", "'/evil'"),
    ("env-ld-preload", CREATE, _entry("container_envs", "LD_PRELOAD", "/x.so"), "container.envs['LD_PRELOAD']",
     "'/x.so'"),
    ("env-name-equals", CREATE, _entry("container_envs", "A=B", "x"), "container.envs['A=B']", "A=B"),
    ("env-name-nul", CREATE, _entry("container_envs", "A\x00B", "x"), "container.envs['A\\x00B']", "A\\x00B"),
    ("env-value-nul", CREATE, _entry("container_envs", "GOOD", "a\x00b"), "container.envs['GOOD']", "a\\x00b"),
    ("annotation-1mb", CREATE, _entry("container_annotations", "big", MEGA), "container.annotations",
     "262144 bytes"),
    ("annotation-key", CREATE, _entry("container_annotations", "bad key", "x"), "container.annotations['bad key']",
     "bad key"),
    ("annotation-key-64", RUN, _entry("annotations", "k" * 64, "x"), "pod.annotations", "k" * 64),
    ("pod-annotation-1mb", RUN, _entry("annotations", "big", MEGA), "pod.annotations", "262144 bytes"),
    ("label-value", RUN, _entry("labels", "tier", "v" * 64), "pod.labels['tier']", "v" * 64),
    ("unified-cgroup-procs", CREATE, _unified("cgroup.procs", "1"), "container.resources.unified", "cgroup.procs"),
    ("unified-path", CREATE, _unified("../../memory.max", "1"), "container.resources.unified", "../../memory.max"),
]


def _original(method: str) -> bytes:
    return run_payload() if method == RUN else create_payload()


@pytest.mark.asyncio
@pytest.mark.parametrize(("method", "change", "field", "value"), [c[1:] for c in BAD_ANSWERS],
                         ids=[c[0] for c in BAD_ANSWERS])
async def test_bad_remote_answer_under_ignore_drops_the_whole_patch(
    fake_runtime: Any, start_proxy: Any, short_dir: Path, hook_server: Any,
    method: str, change: Callable[[Any], None], field: str, value: str,
) -> None:
    server, socket = hook_server
    server.pod_change = server.container_change = _with_good_change(change)
    proxy = await start_proxy(fake_runtime, hooks=[{"name": "koordlet", "remote": str(socket)}],
                              host={"sys": four_cpu_node(short_dir)})

    with capture_logs() as logs:
        await proxy.call(method, _original(method))

    assert server.calls == 1
    # The good part of the same answer (an annotation) is dropped too: the request is untouched.
    assert [c.payload for c in fake_runtime.received(method)] == [_original(method)]
    [line] = [e for e in logs if e["event"] == "hook_failed"]
    assert line["hook"] == "koordlet"
    assert line["policy"] == "Ignore"
    assert field in line["reason"]
    assert value in line["reason"]
    assert len(line["reason"]) < 400  # a 1 MB value is not copied into the log


def _with_good_change(bad: Callable[[Any], None]) -> Callable[[Any], None]:
    def change(resp: Any) -> None:
        annotations = resp.annotations if isinstance(resp, pb.PodSandboxHookResponse) else resp.container_annotations
        annotations["koordinator.sh/good"] = "yes"
        bad(resp)

    return change


@pytest.mark.asyncio
@pytest.mark.parametrize(("method", "change", "field", "value"), [c[1:] for c in BAD_ANSWERS],
                         ids=[c[0] for c in BAD_ANSWERS])
async def test_bad_remote_answer_under_fail_rejects_the_call(
    fake_runtime: Any, start_proxy: Any, short_dir: Path, hook_server: Any,
    method: str, change: Callable[[Any], None], field: str, value: str,
) -> None:
    server, socket = hook_server
    server.pod_change = server.container_change = change
    hooks = [{"name": "koordlet", "remote": str(socket), "failure_policy": "Fail"}]
    proxy = await start_proxy(fake_runtime, hooks=hooks, host={"sys": four_cpu_node(short_dir)})

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await proxy.call(method, _original(method))

    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "'koordlet'" in err.value.details()
    assert field.split("[")[0] in err.value.details()
    assert fake_runtime.received(method) == []


@pytest.mark.asyncio
async def test_good_remote_answer_still_applies(
    fake_runtime: Any, start_proxy: Any, short_dir: Path, hook_server: Any
) -> None:
    """The validator is not a wall: in-range values a koordlet really sends get through."""
    server, socket = hook_server

    def good(resp: Any) -> None:
        resp.container_resources.cpuset_cpus = "2-3"
        resp.container_resources.cpu_quota = -1
        resp.container_resources.cpu_shares = 2
        resp.container_resources.unified["memory.high"] = "max"
        resp.container_envs["KOORD_ENV"] = "on"
        resp.pod_cgroup_parent = "/kubepods/besteffort/poduid-1"

    server.container_change = good
    hooks = [{"name": "koordlet", "remote": str(socket), "failure_policy": "Fail"}]
    proxy = await start_proxy(fake_runtime, hooks=hooks, host={"sys": four_cpu_node(short_dir)})

    await proxy.call(CREATE, create_payload())

    [req] = fake_runtime.requests(CREATE, cri.CreateContainerRequest)
    res = req.config.linux.resources
    assert (res.cpuset_cpus, res.cpu_quota, res.cpu_shares) == ("2-3", -1, 2)
    assert dict(res.unified) == {"memory.high": "max"}
    assert [(kv.key, kv.value) for kv in req.config.envs] == [("HOME", b"/root"), ("KOORD_ENV", b"on")]
    assert req.sandbox_config.linux.cgroup_parent == "/kubepods/besteffort/poduid-1"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"cpu_shares": 2**60}, "container.resources.cpu_shares"),
        ({"cpuset_cpus": "0-99999"}, "container.resources.cpuset_cpus"),
        ({"envs": {"PATH": "/evil"}}, "container.envs"),
        ({"annotations": {"big": MEGA}}, "container.annotations"),
    ],
    ids=["shares", "cpuset", "env-path", "annotation-1mb"],
)
async def test_local_hook_patch_is_validated_too(
    fake_runtime: Any, start_proxy: Any, hook_module: Any, short_dir: Path, args: dict[str, Any], field: str
) -> None:
    hooks = [{"name": "tuner", "plugin": hook_module.plugin("Patcher"), "args": args}]
    proxy = await start_proxy(fake_runtime, hooks=hooks, host={"sys": four_cpu_node(short_dir)})

    with capture_logs() as logs:
        await proxy.call(CREATE, create_payload())

    assert [c.payload for c in fake_runtime.received(CREATE)] == [create_payload()]
    [line] = [e for e in logs if e["event"] == "hook_failed"]
    assert line["hook"] == "tuner" and field in line["reason"]


# --- the rules themselves -------------------------------------------------------------

POD = PodInfo(meta=PodMeta("web-0", "prod", "uid-1"), cgroup_parent=PARENT)
CONTAINER = ContainerInfo(meta=ContainerMeta("app"))
SLICE_POD = PodInfo(meta=PodMeta("web-0", "prod", "uid-1"), cgroup_parent="kubepods-burstable-poduid_1.slice")
VALIDATOR = PatchValidator(online_cpus=lambda: frozenset(range(4)), online_mems=lambda: frozenset({0}))


def pod_check(patch: PodPatch, pod: PodInfo = POD) -> None:
    VALIDATOR.check(PodContext(Stage.PRE_RUN_POD_SANDBOX, pod), patch)


def container_check(patch: ContainerPatch, pod: PodInfo = POD) -> None:
    VALIDATOR.check(ContainerContext(Stage.PRE_CREATE_CONTAINER, pod, CONTAINER), patch)


@pytest.mark.parametrize(
    ("pod", "parent"),
    [
        (POD, "/kubepods/besteffort/poduid-1"),
        (POD, "/kubepods"),
        (PodInfo(meta=POD.meta, cgroup_parent="/koord-test-1/kubepods/burstable/p"), "/koord-test-1/kubepods/x/p"),
        (PodInfo(meta=POD.meta, cgroup_parent="/custom/pods/p"), "/custom/other"),
        (SLICE_POD, "kubepods-besteffort-poduid_1.slice"),
        (SLICE_POD, "kubepods.slice"),
    ],
)
def test_cgroup_parent_confined_under_the_pod_root_is_accepted(pod: PodInfo, parent: str) -> None:
    pod_check(PodPatch(cgroup_parent=parent), pod)
    container_check(ContainerPatch(pod_cgroup_parent=parent), pod)


@pytest.mark.parametrize(
    ("pod", "parent"),
    [
        (POD, "/../../etc/evil"),
        (POD, "/kubepods/../etc"),
        (POD, "/kubepods/./x"),
        (POD, "/kubepods//x"),
        (POD, "/kubepods/x/"),
        (POD, "/"),
        (POD, "/etc/evil"),
        (POD, "/kubepodsx/a"),
        (POD, "kubepods/burstable"),
        (POD, "kubepods-burstable.slice"),
        (POD, "/kubepods/a\nb"),
        (POD, "/kubepods/" + "a" * 256),
        (PodInfo(meta=POD.meta, cgroup_parent="/koord-test-1/kubepods/burstable/p"), "/koord-test-2/kubepods/p"),
        (PodInfo(meta=POD.meta, cgroup_parent=""), "/kubepods/p"),
        (PodInfo(meta=POD.meta, cgroup_parent="/"), "/kubepods/p"),
        (SLICE_POD, "system-evil.slice"),
        (SLICE_POD, "kubepods--x.slice"),
        (SLICE_POD, "-.slice"),
        (SLICE_POD, "/kubepods/p"),
        (SLICE_POD, "kubepods-x.scope"),
    ],
)
def test_cgroup_parent_escaping_or_malformed_is_refused(pod: PodInfo, parent: str) -> None:
    with pytest.raises(PatchError) as err:
        pod_check(PodPatch(cgroup_parent=parent), pod)
    assert err.value.field == "pod.cgroup_parent" and err.value.value == parent
    with pytest.raises(PatchError):
        container_check(ContainerPatch(pod_cgroup_parent=parent), pod)


@pytest.mark.parametrize(
    "resources",
    [
        ResourcesPatch(cpu_shares=2), ResourcesPatch(cpu_shares=262_144), ResourcesPatch(cpu_shares=0),
        ResourcesPatch(cpu_quota=-1), ResourcesPatch(cpu_quota=1000), ResourcesPatch(cpu_quota=2**44 - 1),
        ResourcesPatch(cpu_period=1000), ResourcesPatch(cpu_period=1_000_000),
        ResourcesPatch(memory_limit_in_bytes=-1), ResourcesPatch(memory_limit_in_bytes=4096),
        ResourcesPatch(memory_limit_in_bytes=2**63 - 4096), ResourcesPatch(memory_swap_limit_in_bytes=-1),
        ResourcesPatch(oom_score_adj=-1000), ResourcesPatch(oom_score_adj=1000), ResourcesPatch(oom_score_adj=0),
        ResourcesPatch(cpuset_cpus="0-3"), ResourcesPatch(cpuset_cpus=""), ResourcesPatch(cpuset_mems="0"),
        ResourcesPatch(unified={"memory.high": "max", "hugetlb.2MB.max": "0", "cpu.max": "max 100000"}),
    ],
)
def test_resources_in_range_are_accepted(resources: ResourcesPatch) -> None:
    container_check(ContainerPatch(resources=resources))
    pod_check(PodPatch(resources=resources, overhead=resources))


@pytest.mark.parametrize(
    ("resources", "field"),
    [
        (ResourcesPatch(cpu_shares=1), "cpu_shares"), (ResourcesPatch(cpu_shares=262_145), "cpu_shares"),
        (ResourcesPatch(cpu_shares=-2), "cpu_shares"), (ResourcesPatch(cpu_quota=-2), "cpu_quota"),
        (ResourcesPatch(cpu_quota=999), "cpu_quota"), (ResourcesPatch(cpu_quota=2**44), "cpu_quota"),
        (ResourcesPatch(cpu_period=999), "cpu_period"), (ResourcesPatch(cpu_period=-1), "cpu_period"),
        (ResourcesPatch(memory_limit_in_bytes=4095), "memory_limit_in_bytes"),
        (ResourcesPatch(memory_limit_in_bytes=-(2**62)), "memory_limit_in_bytes"),
        (ResourcesPatch(memory_limit_in_bytes=2**63 - 1), "memory_limit_in_bytes"),
        (ResourcesPatch(memory_swap_limit_in_bytes=-3), "memory_swap_limit_in_bytes"),
        (ResourcesPatch(oom_score_adj=-1001), "oom_score_adj"),
        (ResourcesPatch(cpu_shares=True), "cpu_shares"),
        (ResourcesPatch(cpuset_cpus="4"), "cpuset_cpus"), (ResourcesPatch(cpuset_cpus="0-99999"), "cpuset_cpus"),
        (ResourcesPatch(cpuset_cpus="3-1"), "cpuset_cpus"), (ResourcesPatch(cpuset_cpus=" "), "cpuset_cpus"),
        (ResourcesPatch(cpuset_cpus="0," * 5000), "cpuset_cpus"), (ResourcesPatch(cpuset_mems="0-1"), "cpuset_mems"),
        (ResourcesPatch(unified={"cgroup.kill": "1"}), "unified"),
        (ResourcesPatch(unified={"memory/../x.max": "1"}), "unified"),
        (ResourcesPatch(unified={"memory.high": "1\n2"}), "unified"),
        (ResourcesPatch(unified={"memory.high": "9" * 5000}), "unified"),
    ],
)
def test_resources_out_of_range_are_refused(resources: ResourcesPatch, field: str) -> None:
    with pytest.raises(PatchError) as err:
        container_check(ContainerPatch(resources=resources))
    assert err.value.field.startswith(f"container.resources.{field}")
    with pytest.raises(PatchError) as err:
        pod_check(PodPatch(overhead=resources))
    assert err.value.field.startswith(f"pod.overhead.{field}")


def test_online_cpus_come_from_the_injected_source_each_time() -> None:
    online = [frozenset({0, 1})]
    validator = PatchValidator(online_cpus=lambda: online[0], online_mems=lambda: frozenset({0}))
    patch = ContainerPatch(resources=ResourcesPatch(cpuset_cpus="2"))
    ctx = ContainerContext(Stage.PRE_CREATE_CONTAINER, POD, CONTAINER)
    with pytest.raises(PatchError, match="not online"):
        validator.check(ctx, patch)
    online[0] = frozenset({0, 1, 2})  # CPU 2 came online
    validator.check(ctx, patch)


def test_unreadable_online_cpus_fail_closed(tmp_path: Path) -> None:
    validator = PatchValidator.for_host(HostRoots(sys=tmp_path))
    ctx = ContainerContext(Stage.PRE_CREATE_CONTAINER, POD, CONTAINER)
    with pytest.raises(PatchError, match="cannot read the node's online CPUs"):
        validator.check(ctx, ContainerPatch(resources=ResourcesPatch(cpuset_cpus="0")))
    # Without NUMA in sysfs the node has one memory node, 0.
    validator.check(ctx, ContainerPatch(resources=ResourcesPatch(cpuset_mems="0")))


@pytest.mark.parametrize(
    "envs",
    [{"A": "1"}, {"_x9": ""}, {"NVIDIA_VISIBLE_DEVICES": "0,1"}, {"HOME": "/home/a"}, {"V": "x" * (128 * 1024)}],
)
def test_envs_accepted(envs: dict[str, str]) -> None:
    container_check(ContainerPatch(envs=envs))


@pytest.mark.parametrize(
    "envs",
    [{"PATH": "/evil"}, {"LD_PRELOAD": "/x"}, {"LD_LIBRARY_PATH": "/x"}, {"A=B": "1"}, {"1A": "1"}, {"": "1"},
     {"A-B": "1"}, {"A\x00": "1"}, {"A": "a\x00b"}, {"A": "x" * (128 * 1024 + 1)},
     {f"V{i}": "x" * 100_000 for i in range(3)}, {"A" * 256: "1"}],
)
def test_envs_refused(envs: dict[str, str]) -> None:
    with pytest.raises(PatchError) as err:
        container_check(ContainerPatch(envs=envs))
    assert err.value.field.startswith("container.envs")


@pytest.mark.parametrize(
    ("labels", "annotations"),
    [
        ({"app": "web", "koordinator.sh/qosClass": "BE", "a.b-c_d": ""}, {"x/y": "1"}),
        ({"k" * 63: "v" * 63}, {"p" * 253 + "/" + "n" * 63: "x" * 200_000}),
    ],
)
def test_labels_and_annotations_accepted(labels: dict[str, str], annotations: dict[str, str]) -> None:
    pod_check(PodPatch(labels=labels, annotations=annotations))
    container_check(ContainerPatch(annotations=annotations))


@pytest.mark.parametrize(
    ("labels", "annotations", "field"),
    [
        ({"k" * 64: "v"}, None, "pod.labels"),
        ({"k": "v" * 64}, None, "pod.labels"),
        ({"k": "-v"}, None, "pod.labels"),
        ({"k": "a b"}, None, "pod.labels"),
        ({"Bad.Prefix/k": "v"}, None, "pod.labels"),
        ({"/k": "v"}, None, "pod.labels"),
        (None, {"": "x"}, "pod.annotations"),
        (None, {"a/b/c": "x"}, "pod.annotations"),
        (None, {"p" * 254 + "/n": "x"}, "pod.annotations"),
        (None, {"k": "x" * (256 * 1024)}, "pod.annotations"),
    ],
)
def test_labels_and_annotations_refused(
    labels: dict[str, str] | None, annotations: dict[str, str] | None, field: str
) -> None:
    with pytest.raises(PatchError) as err:
        pod_check(PodPatch(labels=labels, annotations=annotations))
    assert err.value.field.startswith(field)


def test_error_message_shows_a_bounded_value() -> None:
    with pytest.raises(PatchError) as err:
        container_check(ContainerPatch(annotations={"k": "x" * (1 << 20)}))
    assert len(str(err.value)) < 300


# --- property: whatever a local hook returns, the chain keeps only valid patches ---------

_ANY = st.one_of(st.none(), st.integers(-(2**64), 2**64), st.text(max_size=12), st.booleans(),
                 st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=6), st.text(max_size=6),
                                                                      max_size=2))
_WILD_RESOURCES = st.builds(
    ResourcesPatch, **{name: _ANY for name in ("cpu_period", "cpu_quota", "cpu_shares", "memory_limit_in_bytes",
                                               "oom_score_adj", "cpuset_cpus", "cpuset_mems",
                                               "memory_swap_limit_in_bytes", "unified")})
_WILD_CONTAINER_PATCH = st.builds(ContainerPatch, annotations=_ANY, envs=_ANY, resources=st.none() | _WILD_RESOURCES,
                                  pod_cgroup_parent=_ANY)


class _Returns:
    def __init__(self) -> None:
        self.patch: object = None

    def pre_create_container(self, ctx: ContainerContext) -> object:
        return self.patch


@settings(max_examples=250, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_WILD_CONTAINER_PATCH)
def test_any_local_patch_is_kept_only_if_valid(patch: ContainerPatch) -> None:
    impl = _Returns()
    impl.patch = patch
    bound = BoundHook("local", impl, frozenset({Stage.PRE_CREATE_CONTAINER}), FailurePolicy.IGNORE, 5.0)
    pools = HookPools()
    try:
        chain = HookChain([bound], pools=pools, validator=VALIDATOR)
        ctx = ContainerContext(Stage.PRE_CREATE_CONTAINER, POD, CONTAINER)
        outcome = asyncio.run(chain.run(ctx, deadline=None))
    finally:
        pools.shutdown()
    try:
        VALIDATOR.check(ctx, patch)
    except Exception:
        assert outcome.patches == ()
    else:
        assert outcome.patches in ((), (("local", patch),))
