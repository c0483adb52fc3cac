"""The four QoS hooks under the real reconciler: one pass over a store holding a BE
batch pod, an LSR cpuset-bound pod and an LS pod writes every managed cgroup file,
the next pass writes nothing, and after a manual write to *every* managed file one
pass repairs them all and records each change (old -> new) in the pod's change log.

The store is filled as the proxy fills it: each pod and container goes through the
lifecycle stages of the same chain first, and the container's resources are what the
chain forwarded (so cpu-normalization's quota is already divided, and batch-resource
and cpu-normalization must agree on it instead of rewriting each other every pass).
Everything lives in fixture trees under tmp_path (cgroup v1 and v2, a fake /sys).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from hooks.annotations import BATCH_CPU, BATCH_MEMORY, EXTENDED_RESOURCE_SPEC, RESOURCE_STATUS
from hooks.batchresource import BatchResource
from hooks.cgroups import shares_to_weight
from hooks.cpunormalization import CPUNormalization
from hooks.cpuset import CPUSet
from hooks.groupidentity import GroupIdentity
from runtimeproxy.chain.hookchain import HOST_TARGET, BoundHook, HookChain, implemented_stages
from runtimeproxy.chain.validate import PatchValidator
from runtimeproxy.config.settings import FailurePolicy
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerInfo,
    ContainerMeta,
    HookInit,
    HostRoots,
    PodContext,
    PodInfo,
    PodMeta,
    Resources,
    Stage,
    frozen_map,
)
from runtimeproxy.state.reconcile import Reconciler
from runtimeproxy.state.store import Store

QOS = "koordinator.sh/qosClass"
GI = 2**30
UNLIMITED_V1 = "9223372036854771712"
RULES = {
    "resourceQOSStrategy": {
        "lsrClass": {"cpuQOS": {"enable": True}},
        "lsClass": {"cpuQOS": {"enable": True}},
        "beClass": {"cpuQOS": {"enable": True}},
    }
}
BATCH_SPEC = {"containers": {"main": {"requests": {BATCH_CPU: 1000, BATCH_MEMORY: "1Gi"},
                                      "limits": {BATCH_CPU: 2000, BATCH_MEMORY: "1Gi"}}}}


@dataclass(frozen=True)
class FixturePod:
    pod: PodInfo
    container_id: str
    kubelet: Resources  # what kubelet asks for at CreateContainer

    @property
    def pod_dir(self) -> str:
        return self.pod.cgroup_parent

    @property
    def container_dir(self) -> str:
        return f"{self.pod.cgroup_parent}/{self.container_id}"


def _pod(name: str, qos: str, parent: str, annotations: dict[str, str]) -> PodInfo:
    return PodInfo(PodMeta(name, "shop", f"uid-{name}"), id=f"sb-{name}", labels=frozen_map({QOS: qos}),
                   annotations=frozen_map(annotations), cgroup_parent=parent)


BE = FixturePod(_pod("batch", "BE", "/kubepods/besteffort/poduid-batch",
                     {EXTENDED_RESOURCE_SPEC: json.dumps(BATCH_SPEC)}), "c0batch", Resources(cpu_shares=2))
LSR = FixturePod(_pod("pinned", "LSR", "/kubepods/poduid-pinned", {RESOURCE_STATUS: json.dumps({"cpuset": "2-3"})}),
                 "c0pinned", Resources(cpu_period=100_000, cpu_quota=200_000, cpu_shares=2048))
LS = FixturePod(_pod("web", "LS", "/kubepods/burstable/poduid-web", {}), "c0web",
                Resources(cpu_period=100_000, cpu_quota=120_000, cpu_shares=512))
PODS = (BE, LSR, LS)
PARENTS = ("/kubepods", "/kubepods/besteffort", "/kubepods/burstable")


def _under(root: Path, *parts: str) -> Path:
    path = root.joinpath(*(p.lstrip("/") for p in parts))  # a cgroup parent is absolute: never leave the fixture
    assert path.resolve().is_relative_to(root.resolve()), path
    return path


# What a fresh cgroup holds before anyone wrote to it. v1 has group identity (cpu.bvt_warp_ns);
# the v2 tree is an upstream kernel with only cpu.idle, so the fallback is exercised there.
V1_FILES = {"cpu": {"cpu.shares": "1024", "cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000",
                    "cpu.bvt_warp_ns": "0"},
            "memory": {"memory.limit_in_bytes": UNLIMITED_V1},
            "cpuset": {"cpuset.cpus": "0-7"}}
V2_FILES = {"cpu.weight": "100", "cpu.max": "max 100000", "memory.max": "max", "cpuset.cpus": "", "cpu.idle": "0"}


def v1_tree(root: Path) -> None:
    for directory in (*PARENTS, *(p.pod_dir for p in PODS), *(p.container_dir for p in PODS)):
        for controller, files in V1_FILES.items():
            _under(root, controller, directory).mkdir(parents=True, exist_ok=True)
            for name, value in files.items():
                _under(root, controller, directory, name).write_text(value + "\n")


def v2_tree(root: Path) -> None:
    root.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for directory in (*PARENTS, *(p.pod_dir for p in PODS), *(p.container_dir for p in PODS)):
        _under(root, directory).mkdir(parents=True, exist_ok=True)
        for name, value in V2_FILES.items():
            _under(root, directory, name).write_text(value + "\n")


def managed(root: Path, v1: bool) -> dict[Path, tuple[str, str]]:
    """Every file the hooks keep, with its desired value and a manual write to drift it."""

    def f(directory: str, v1_file: str, v2_file: str) -> Path:
        if v1:
            controller, name = v1_file.split("/")
            return _under(root, controller, directory, name)
        return _under(root, directory, v2_file)

    def quota(value: int) -> str:
        return str(value) if v1 else f"{'max' if value == -1 else value} 100000"

    shares = "1024" if v1 else str(shares_to_weight(1024))
    files = {
        # batch-resource: BE pod (PreRunPodSandbox values) and its container (200000 / 1.2, as forwarded)
        f(BE.pod_dir, "cpu/cpu.shares", "cpu.weight"): (shares, "4" if v1 else "7"),
        f(BE.pod_dir, "cpu/cpu.cfs_quota_us", "cpu.max"): (quota(200_000), quota(900_000)),
        f(BE.pod_dir, "memory/memory.limit_in_bytes", "memory.max"): (str(GI), str(4096 * 1000)),
        f(BE.container_dir, "cpu/cpu.shares", "cpu.weight"): (shares, "4" if v1 else "7"),
        f(BE.container_dir, "cpu/cpu.cfs_quota_us", "cpu.max"): (quota(166_667), quota(300_000)),
        f(BE.container_dir, "memory/memory.limit_in_bytes", "memory.max"): (str(GI), str(4096 * 1000)),
        # cpuset: the BE pool, the LSR binding with unset quotas, the LS pool
        f(BE.container_dir, "cpuset/cpuset.cpus", "cpuset.cpus"): ("0-7", "0-3"),
        f(LSR.pod_dir, "cpu/cpu.cfs_quota_us", "cpu.max"): (quota(-1), quota(400_000)),
        f(LSR.container_dir, "cpuset/cpuset.cpus", "cpuset.cpus"): ("2-3", "0-7"),
        f(LSR.container_dir, "cpu/cpu.cfs_quota_us", "cpu.max"): (quota(-1), quota(200_000)),
        f(LS.container_dir, "cpuset/cpuset.cpus", "cpuset.cpus"): ("0-1,4-7", "0-7"),
        # cpu-normalization: kubelet's 120000 / 1.2, written as forwarded
        f(LS.container_dir, "cpu/cpu.cfs_quota_us", "cpu.max"): (quota(100_000), quota(120_000)),
    }
    # group-identity: bvt per class on v1; on v2 only the BE pod, through cpu.idle
    if v1:
        files[f(BE.pod_dir, "cpu/cpu.bvt_warp_ns", "")] = ("-1", "0")
        files[f(LSR.pod_dir, "cpu/cpu.bvt_warp_ns", "")] = ("2", "0")
        files[f(LS.pod_dir, "cpu/cpu.bvt_warp_ns", "")] = ("2", "-1")
    else:
        files[f(BE.pod_dir, "", "cpu.idle")] = ("1", "0")
    for path, (want, drift) in files.items():
        assert path.is_file() and want != drift, path
    return files


def owner(path: Path, root: Path) -> FixturePod:
    rel = str(path.resolve().relative_to(root.resolve()))
    return next(p for p in PODS if p.pod_dir.lstrip("/") in rel)


def confined(targets: Iterable[str], root: Path) -> bool:
    """Every reported target is a file under the fixture root."""
    return all(Path(target).is_relative_to(root.resolve()) for target in targets)


def build_chain(tmp_path: Path) -> HookChain:
    host = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys",
                     resctrl=tmp_path / "resctrl")
    # The shipped order: quotas and cpusets first, then normalization, then group identity.
    impls: list[tuple[str, object]] = [
        ("batch-resource", BatchResource(HookInit("batch-resource", {}, "hooks[0].args", host, RULES))),
        ("cpuset", CPUSet(HookInit("cpuset", {}, "hooks[1].args", host, RULES))),
        ("cpu-normalization", CPUNormalization(HookInit("cpu-normalization", {"ratio": "1.2"}, "hooks[2].args",
                                                        host, RULES))),
        ("group-identity", GroupIdentity(HookInit("group-identity", {}, "hooks[3].args", host, RULES))),
    ]
    bound = [BoundHook(name, impl, implemented_stages(impl), FailurePolicy.FAIL, 5.0) for name, impl in impls]
    return HookChain(bound, validator=PatchValidator.for_host(host))


async def admit(chain: HookChain, store: Store) -> None:
    """RunPodSandbox and CreateContainer through the chain, the store keeping what was forwarded."""
    for fixture in PODS:
        outcome = await chain.run(PodContext(Stage.PRE_RUN_POD_SANDBOX, fixture.pod), deadline=None)
        assert isinstance(outcome.context, PodContext)
        store.put_pod(fixture.pod)
        created = await chain.run(
            ContainerContext(Stage.PRE_CREATE_CONTAINER, fixture.pod,
                             ContainerInfo(ContainerMeta("main"), resources=fixture.kubelet)),
            deadline=None,
        )
        assert isinstance(created.context, ContainerContext)
        forwarded = replace(created.context.container, id=fixture.container_id)
        store.put_container(fixture.pod.id, forwarded)


@pytest.mark.asyncio
@pytest.mark.parametrize("tree", [v1_tree, v2_tree], ids=["v1", "v2"])
async def test_one_pass_repairs_every_managed_file(tmp_path: Path, tree: Callable[[Path], None]) -> None:
    root = tmp_path / "cgroup"
    tree(root)
    cpu = tmp_path / "sys" / "devices" / "system" / "cpu"
    cpu.mkdir(parents=True)
    (cpu / "online").write_text("0-7\n")
    files = managed(root, tree is v1_tree)
    chain = build_chain(tmp_path)
    store = Store()
    await admit(chain, store)
    _, containers = store.snapshot()
    assert containers[BE.container_id][1].resources.cpu_quota == 166_667  # 200000 batch quota / 1.2
    assert containers[LSR.container_id][1].resources.cpu_quota == -1  # bound: unset by cpuset
    assert containers[LS.container_id][1].resources.cpu_quota == 100_000  # 120000 / 1.2
    # A restart / reload: new hook instances, nothing learned in memory (cpuset's bindings are
    # re-learned by the pod pass, which runs before any container, so the LS pool is right).
    reloaded = build_chain(tmp_path)
    reconciler = Reconciler(store=store, chain=lambda: reloaded, skipped=lambda pod: False, interval=lambda: 10.0)

    first = await reconciler.run_once()  # the containers were never created by a runtime: all written now
    assert (first.pods, first.containers, first.failures) == (3, 3, 0)
    assert first.writes > 0
    for path, (want, _) in files.items():
        assert path.read_text().strip() == want, path

    second = await reconciler.run_once()
    assert (second.writes, second.failures) == (0, 0)  # nothing drifted: nothing rewritten or reported

    before = {fixture.pod.meta.uid: len(store.changes(fixture.pod.meta.uid)) for fixture in PODS}
    for path, (_, drift) in files.items():
        path.write_text(drift + "\n")  # an operator's manual write to every managed file
    repaired = await reconciler.run_once()
    assert (repaired.failures, repaired.writes) == (0, len(files))
    for path, (want, _) in files.items():
        assert path.read_text().strip() == want, path
    for fixture in PODS:
        new = store.changes(fixture.pod.meta.uid)[before[fixture.pod.meta.uid]:]
        assert all(c.target.startswith(HOST_TARGET) for c in new)
        assert all(c.stage in ("ReconcilePodSandbox", "ReconcileContainer") for c in new)
        logged = {(c.target.removeprefix(HOST_TARGET), c.old, c.new) for c in new}
        expected = {(str(path.resolve()), drift, path.read_text()) for path, (_, drift) in files.items()
                    if owner(path, root) is fixture}
        assert logged == expected, fixture.pod.meta.name
        assert confined((target for target, _, _ in logged), tmp_path)
    hooks_seen = {c.hook for fixture in PODS for c in store.changes(fixture.pod.meta.uid)}
    assert hooks_seen == {"batch-resource", "cpuset", "cpu-normalization", "group-identity"}

    assert (await reconciler.run_once()).writes == 0
