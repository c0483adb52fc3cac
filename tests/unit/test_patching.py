"""Between CRI messages and the hook API: contexts read out of requests, patches
written back (unknown fields kept), update merging, and change records."""

from __future__ import annotations

import pytest
from google.protobuf.unknown_fields import UnknownFieldSet

from criapi import cri_v1_pb2 as cri
from runtimeproxy.chain import patching
from runtimeproxy.chain.hookchain import Change, apply_patch
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerMeta,
    ContainerPatch,
    PodContext,
    PodMeta,
    PodPatch,
    Resources,
    ResourcesPatch,
    Stage,
)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def unknown(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def sandbox_config() -> cri.PodSandboxConfig:
    cfg = cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name="web-0", namespace="prod", uid="uid-1", attempt=2),
        labels={"app": "web"}, annotations={"team": "a"},
    )
    cfg.linux.cgroup_parent = "/kubepods/burstable/poduid-1"
    cfg.linux.resources.cpu_shares = 2048
    cfg.linux.overhead.memory_limit_in_bytes = 1 << 20
    return cfg


def container_config() -> cri.ContainerConfig:
    cfg = cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name="app", attempt=1), image=cri.ImageSpec(image="nginx:1"),
        labels={"l": "1"}, annotations={"a": "1"},
    )
    cfg.envs.add(key="PATH", value=b"/bin")
    cfg.envs.add(key="HOME", value=b"/root")
    cfg.envs.add(key="LANG", value=b"C")
    res = cfg.linux.resources
    res.cpu_period, res.cpu_quota, res.cpu_shares = 100000, 200000, 1024
    res.memory_limit_in_bytes, res.oom_score_adj = 1 << 30, -997
    res.cpuset_cpus, res.cpuset_mems = "0-7", "0"
    res.unified["memory.high"] = "max"
    return cfg


# --- reading contexts -------------------------------------------------------------------


def test_pod_info_from_config() -> None:
    pod = patching.pod_info(sandbox_config(), runtime_handler="runc", sandbox_id="sb-1")
    assert pod.meta == PodMeta(name="web-0", namespace="prod", uid="uid-1", attempt=2)
    assert (pod.id, pod.runtime_handler, pod.cgroup_parent) == ("sb-1", "runc", "/kubepods/burstable/poduid-1")
    assert pod.labels == {"app": "web"}
    assert pod.annotations == {"team": "a"}
    assert pod.resources == Resources(cpu_shares=2048)
    assert pod.overhead == Resources(memory_limit_in_bytes=1 << 20)
    with pytest.raises(TypeError):
        pod.labels["x"] = "y"  # type: ignore[index]


def test_container_info_from_config() -> None:
    info = patching.container_info(container_config(), container_id="c-1")
    assert info.meta == ContainerMeta(name="app", attempt=1)
    assert (info.id, info.image) == ("c-1", "nginx:1")
    assert info.envs == {"PATH": "/bin", "HOME": "/root", "LANG": "C"}
    assert info.resources == Resources(
        cpu_period=100000, cpu_quota=200000, cpu_shares=1024, memory_limit_in_bytes=1 << 30, oom_score_adj=-997,
        cpuset_cpus="0-7", cpuset_mems="0", unified={"memory.high": "max"},
    )


def test_env_values_that_are_not_utf8_do_not_break_reading() -> None:
    assert patching.envs_map([cri.KeyValue(key="X", value=b"\xff")]) == {"X": "\ufffd"}


def test_resources_round_trip() -> None:
    res = Resources(cpu_period=1, cpu_quota=-1, cpu_shares=2, memory_limit_in_bytes=3, oom_score_adj=4,
                    cpuset_cpus="1", cpuset_mems="0", memory_swap_limit_in_bytes=5, unified={"a": "b"})
    out = cri.LinuxContainerResources(unified={"stale": "x"})
    patching.resources_to_pb(res, out)
    assert patching.resources_from_pb(out) == res
    assert dict(out.unified) == {"a": "b"}


# --- writing patches ----------------------------------------------------------------------


def test_create_patch_keeps_unknown_fields() -> None:
    resources = container_config().linux.resources.SerializeToString() + unknown(1901, b"res-future")
    linux = unknown(1, resources) + unknown(1902, b"linux-future")
    config = container_config()
    config.ClearField("linux")
    config_bytes = config.SerializeToString() + unknown(15, linux) + unknown(1903, b"config-future")
    payload = cri.CreateContainerRequest(pod_sandbox_id="sb-1", sandbox_config=sandbox_config()).SerializeToString()
    payload += unknown(2, config_bytes) + unknown(1904, b"top-future")
    req = cri.CreateContainerRequest.FromString(payload)
    assert req.config.linux.resources.cpu_shares == 1024  # the hand-built bytes parse as intended

    patching.apply_create_patch(req, ContainerPatch(resources=ResourcesPatch(cpu_shares=2), envs={"NEW": "1"},
                                                    annotations={"b": "2"}))
    out = cri.CreateContainerRequest.FromString(req.SerializeToString())

    assert out.config.linux.resources.cpu_shares == 2
    assert out.config.envs[-1] == cri.KeyValue(key="NEW", value=b"1")
    assert dict(out.config.annotations) == {"a": "1", "b": "2"}

    def unknowns(message: object) -> list[tuple[int, bytes]]:
        return [(f.field_number, f.data) for f in UnknownFieldSet(message)]

    assert unknowns(out) == [(1904, b"top-future")]
    assert unknowns(out.config) == [(1903, b"config-future")]
    assert unknowns(out.config.linux) == [(1902, b"linux-future")]
    assert unknowns(out.config.linux.resources) == [(1901, b"res-future")]


def test_envs_update_existing_in_place_and_append_new() -> None:
    req = cri.CreateContainerRequest(config=container_config())
    patching.apply_create_patch(req, ContainerPatch(envs={"NEW": "n", "HOME": "/home/app", "ZZ": "z"}))
    assert [(kv.key, kv.value) for kv in req.config.envs] == [
        ("PATH", b"/bin"), ("HOME", b"/home/app"), ("LANG", b"C"), ("NEW", b"n"), ("ZZ", b"z"),
    ]


def test_resources_patch_touches_only_set_fields() -> None:
    req = cri.CreateContainerRequest(config=container_config(), sandbox_config=sandbox_config())
    before = cri.CreateContainerRequest()
    before.CopyFrom(req)
    patching.apply_create_patch(
        req, ContainerPatch(resources=ResourcesPatch(cpu_quota=-1, cpuset_cpus="2-3", unified={"cpu.idle": "1"}),
                            pod_cgroup_parent="/kubepods/besteffort/poduid-1"),
    )
    res = req.config.linux.resources
    assert (res.cpu_quota, res.cpuset_cpus) == (-1, "2-3")
    assert (res.cpu_period, res.cpu_shares, res.memory_limit_in_bytes, res.oom_score_adj, res.cpuset_mems) == (
        100000, 1024, 1 << 30, -997, "0",
    )
    assert dict(res.unified) == {"memory.high": "max", "cpu.idle": "1"}
    assert req.sandbox_config.linux.cgroup_parent == "/kubepods/besteffort/poduid-1"
    assert req.config.envs == before.config.envs
    assert req.config.annotations == before.config.annotations


def test_empty_patch_changes_nothing() -> None:
    req = cri.CreateContainerRequest(config=container_config(), sandbox_config=sandbox_config())
    before = req.SerializeToString()
    patching.apply_create_patch(req, ContainerPatch(resources=ResourcesPatch()))
    assert req.SerializeToString() == before


def test_pod_patch() -> None:
    req = cri.RunPodSandboxRequest(config=sandbox_config(), runtime_handler="runc")
    patching.apply_pod_patch(
        req,
        PodPatch(labels={"qos": "BE"}, annotations={"team": "b"}, cgroup_parent="/kubepods/besteffort/poduid-1",
                 resources=ResourcesPatch(cpu_quota=50000), overhead=ResourcesPatch(cpu_shares=10)),
    )
    cfg = req.config
    assert dict(cfg.labels) == {"app": "web", "qos": "BE"}
    assert dict(cfg.annotations) == {"team": "b"}
    assert cfg.linux.cgroup_parent == "/kubepods/besteffort/poduid-1"
    assert (cfg.linux.resources.cpu_shares, cfg.linux.resources.cpu_quota) == (2048, 50000)
    assert (cfg.linux.overhead.memory_limit_in_bytes, cfg.linux.overhead.cpu_shares) == (1 << 20, 10)
    assert req.runtime_handler == "runc"


def test_update_patch_reports_what_it_cannot_carry() -> None:
    req = cri.UpdateContainerResourcesRequest(container_id="c-1")
    req.linux.cpu_quota = 50000
    dropped = patching.apply_update_patch(
        req, ContainerPatch(annotations={"x": "y"}, envs={"E": "1"}, resources=ResourcesPatch(cpu_shares=2),
                            pod_cgroup_parent="/elsewhere"),
    )
    assert dropped == ["envs", "pod_cgroup_parent"]
    assert (req.linux.cpu_quota, req.linux.cpu_shares) == (50000, 2)
    assert dict(req.annotations) == {"x": "y"}
    assert patching.apply_update_patch(req, ContainerPatch(resources=ResourcesPatch(cpu_quota=1))) == []


# --- UpdateContainerResources merging -------------------------------------------------------


STORED = Resources(cpu_period=100000, cpu_quota=200000, cpu_shares=1024, memory_limit_in_bytes=1 << 30,
                   oom_score_adj=-997, cpuset_cpus="0-7", cpuset_mems="0", unified={"memory.high": "max"})


def test_merge_update_zero_means_unchanged() -> None:
    update = cri.LinuxContainerResources(cpu_quota=-1, cpuset_cpus="2-3", unified={"cpu.idle": "1"})
    merged = patching.merge_update(STORED, update)
    assert merged == Resources(
        cpu_period=100000, cpu_quota=-1, cpu_shares=1024, memory_limit_in_bytes=1 << 30, oom_score_adj=-997,
        cpuset_cpus="2-3", cpuset_mems="0", unified={"memory.high": "max", "cpu.idle": "1"},
    )


def test_merge_update_keeps_oom_score_adj_and_takes_full_sets() -> None:
    update = cri.LinuxContainerResources(
        cpu_period=50000, cpu_quota=25000, cpu_shares=512, memory_limit_in_bytes=1 << 29, oom_score_adj=1000,
        cpuset_cpus="1", cpuset_mems="1", unified={"memory.high": "1G"},
    )
    merged = patching.merge_update(STORED, update)
    assert merged.oom_score_adj == -997  # not updatable through UpdateContainerResources
    assert (merged.cpu_period, merged.cpu_quota, merged.cpu_shares) == (50000, 25000, 512)
    assert (merged.memory_limit_in_bytes, merged.cpuset_cpus, merged.cpuset_mems) == (1 << 29, "1", "1")
    assert merged.unified == {"memory.high": "1G"}
    assert patching.merge_update(STORED, cri.LinuxContainerResources()) == STORED


# --- contexts after a patch, and the change records ------------------------------------------


def _container_ctx() -> ContainerContext:
    cfg = container_config()
    pod = patching.pod_info(sandbox_config(), runtime_handler="runc", sandbox_id="sb-1")
    return ContainerContext(Stage.PRE_CREATE_CONTAINER, pod, patching.container_info(cfg))


def test_apply_patch_records_old_to_new_with_hook_and_reason() -> None:
    ctx = _container_ctx()
    patch = ContainerPatch(
        annotations={"a": "1", "b": "2"},  # "a" is unchanged: not recorded
        envs={"HOME": "/home/app"},
        resources=ResourcesPatch(cpu_shares=2, cpu_quota=200000, unified={"memory.high": "1G", "cpu.idle": "1"}),
        pod_cgroup_parent="/kubepods/besteffort/poduid-1",
        reason="BE pod",
    )
    new_ctx, changes = apply_patch(ctx, patch, "qos")
    stage = "PreCreateContainer"
    assert changes == [
        Change("qos", stage, "container.annotations[b]", "", "2", "BE pod"),
        Change("qos", stage, "container.envs[HOME]", "/root", "/home/app", "BE pod"),
        Change("qos", stage, "container.resources.cpu_shares", "1024", "2", "BE pod"),
        Change("qos", stage, "container.resources.unified[memory.high]", "max", "1G", "BE pod"),
        Change("qos", stage, "container.resources.unified[cpu.idle]", "", "1", "BE pod"),
        Change("qos", stage, "pod.cgroup_parent", "/kubepods/burstable/poduid-1", "/kubepods/besteffort/poduid-1",
               "BE pod"),
    ]
    assert isinstance(new_ctx, ContainerContext)
    assert new_ctx.container.resources.cpu_shares == 2
    assert new_ctx.container.resources.unified == {"memory.high": "1G", "cpu.idle": "1"}
    assert new_ctx.container.envs["HOME"] == "/home/app"
    # The context handed in is frozen and unchanged.
    assert ctx.container.resources.cpu_shares == 1024
    assert ctx.container.envs["HOME"] == "/root"


def test_apply_pod_patch_records_changes() -> None:
    pod = patching.pod_info(sandbox_config(), runtime_handler="runc")
    ctx = PodContext(Stage.PRE_RUN_POD_SANDBOX, pod)
    new_ctx, changes = apply_patch(
        ctx, PodPatch(labels={"qos": "BE"}, overhead=ResourcesPatch(cpu_shares=10), reason="r"), "h"
    )
    assert [(c.target, c.old, c.new) for c in changes] == [
        ("pod.labels[qos]", "", "BE"), ("pod.overhead.cpu_shares", "0", "10"),
    ]
    assert isinstance(new_ctx, PodContext)
    assert new_ctx.pod.labels == {"app": "web", "qos": "BE"}


def test_apply_patch_rejects_the_wrong_patch_type() -> None:
    with pytest.raises(TypeError):
        apply_patch(_container_ctx(), PodPatch(labels={"x": "y"}), "h")
