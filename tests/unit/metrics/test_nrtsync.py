"""The NodeResourceTopology reporter against an in-memory API server stand-in that
applies merge patches (RFC 7386) and validates every stored object against the CRD
schema: created once, patched only with what changed, no call when nothing did,
writes rate-limited, other writers' fields kept; the loopback route."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from hooks.qos import QoSClass
from metrics.collect.topology import TopologyCollector
from metrics.informer.kubetypes import KubeApiError
from metrics.model import PodView
from metrics.report.nrtsync import NRTClient, NRTReporter, NRTSources, merge_patch
from tests.unit.metrics.crdschema import validate_nrt
from tests.unit.metrics.test_nrt import RESOURCE_STATUS, host_tree, pod

POOLS = "node.koordinator.sh/cpu-shared-pools"
ALLOCS = "node.koordinator.sh/pod-cpu-allocs"


def apply_merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = apply_merge_patch(out.get(key), value)
    return out


class FakeNRT:
    """One cluster-scoped object; every call counted; what is stored must validate."""

    def __init__(self) -> None:
        self.obj: dict[str, Any] | None = None
        self.calls: list[str] = []
        self.patches: list[dict[str, Any]] = []
        self.fail_next: KubeApiError | None = None

    def _maybe_fail(self) -> None:
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc

    def get_nrt(self) -> dict[str, Any] | None:
        self.calls.append("get")
        self._maybe_fail()
        return copy.deepcopy(self.obj)

    def create_nrt(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        self.calls.append("create")
        self._maybe_fail()
        if self.obj is not None:
            raise KubeApiError("create nrt", 409, "already exists")
        validate_nrt(doc)
        self.obj = json.loads(json.dumps(doc))
        self.obj["metadata"]["resourceVersion"] = "1"
        return copy.deepcopy(self.obj)

    def patch_nrt(self, patch: Mapping[str, Any]) -> dict[str, Any]:
        self.calls.append("patch")
        self._maybe_fail()
        assert self.obj is not None
        updated = apply_merge_patch(self.obj, json.loads(json.dumps(patch)))
        validate_nrt(updated)
        self.obj = updated
        self.patches.append(dict(patch))
        return copy.deepcopy(updated)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reporter(tmp_path: Path, pods: list[PodView], kube: NRTClient | None, clock: Clock,
             node: dict[str, Any] | None = None) -> NRTReporter:
    roots = host_tree(tmp_path)
    sources = NRTSources("node-a", roots, TopologyCollector(roots).latest, lambda: pods, lambda: node,
                         cpu_manager_state=tmp_path / "kubelet/cpu_manager_state",
                         kubelet_config=tmp_path / "kubelet/config.yaml", clock=clock)
    return NRTReporter(sources, kube, interval=3.0, resync=300.0, clock=clock)


def test_the_fake_is_an_nrt_client() -> None:
    assert isinstance(FakeNRT(), NRTClient)


@pytest.mark.asyncio
async def test_created_once_then_no_call_while_nothing_changes(tmp_path: Path) -> None:
    kube, clock = FakeNRT(), Clock()
    node = {"metadata": {"name": "node-a", "uid": "uid-node-a"}}
    nrt = reporter(tmp_path, [], kube, clock, node)
    with capture_logs() as logs:
        assert await nrt.sync_once() == "created"
    assert kube.calls == ["get", "create"]
    assert [e["event"] for e in logs] == ["nrt_created"]
    assert kube.obj is not None
    assert kube.obj["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "Koordinator"}
    assert kube.obj["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": "node-a",
                                                        "uid": "uid-node-a", "controller": True,
                                                        "blockOwnerDeletion": True}]
    for _ in range(5):
        clock.now += 3
        assert await nrt.sync_once() == "unchanged"
    assert kube.calls == ["get", "create"]  # no API call at all
    assert nrt.writes == {"created": 1, "patched": 0}


@pytest.mark.asyncio
async def test_a_change_is_patched_with_only_what_changed(tmp_path: Path) -> None:
    kube, clock = FakeNRT(), Clock()
    pods: list[PodView] = []
    nrt = reporter(tmp_path, pods, kube, clock)
    await nrt.sync_once()
    before = copy.deepcopy(kube.obj)
    assert before is not None
    pods.append(pod("u-lse", QoSClass.LSE, "2-3"))
    clock.now += 3
    with capture_logs() as logs:
        assert await nrt.sync_once() == "patched"
    assert kube.calls == ["get", "create", "get", "patch"]
    (patch,) = kube.patches
    # an LSE pod leaves both pools and appears in pod-cpu-allocs; nothing else is sent
    assert patch == {"metadata": {"annotations": {
        POOLS: '[{"socket":0,"node":0,"cpuset":"0-1,4-5"},{"socket":1,"node":1,"cpuset":"6-7"}]',
        "node.koordinator.sh/be-cpu-shared-pools":
            '[{"socket":0,"node":0,"cpuset":"0-1,4-5"},{"socket":1,"node":1,"cpuset":"6-7"}]',
        ALLOCS: '[{"namespace":"default","name":"u-lse","uid":"u-lse","cpuset":"2-3","managedByKubelet":false}]',
    }}}
    (line,) = [e for e in logs if e["event"] == "nrt_patched"]
    assert line["changed"] == sorted(patch["metadata"]["annotations"])
    assert kube.obj is not None and kube.obj["zones"] == before["zones"]
    clock.now += 3
    assert await nrt.sync_once() == "unchanged"
    assert kube.calls[-1] == "patch"


@pytest.mark.asyncio
async def test_writes_are_rate_limited_to_one_per_interval(tmp_path: Path) -> None:
    kube, clock = FakeNRT(), Clock()
    pods: list[PodView] = []
    nrt = reporter(tmp_path, pods, kube, clock)
    assert await nrt.sync_once() == "created"
    pods.append(pod("u-lsr", QoSClass.LSR, "1"))
    clock.now += 1  # less than the 3 s interval since the create
    assert await nrt.sync_once() == "deferred"
    assert kube.calls == ["get", "create", "get"]
    clock.now += 2
    assert await nrt.sync_once() == "patched"
    pods.append(pod("u-lsr2", QoSClass.LSR, "5"))
    clock.now += 2.9
    assert await nrt.sync_once() == "deferred"
    clock.now += 0.1
    assert await nrt.sync_once() == "patched"
    assert kube.calls.count("patch") == 2


@pytest.mark.asyncio
async def test_resync_rereads_and_repairs_edits_keeping_other_writers_fields(tmp_path: Path) -> None:
    kube, clock = FakeNRT(), Clock()
    nrt = reporter(tmp_path, [], kube, clock)
    await nrt.sync_once()
    assert kube.obj is not None
    # someone else: their own annotation and a GPU resource in zone node-0; and a clobbered pool
    kube.obj["metadata"]["annotations"]["example.com/other"] = "x"
    kube.obj["zones"][0]["resources"].append({"name": "nvidia.com/gpu", "capacity": "2", "allocatable": "2",
                                               "available": "1"})
    good_pools = kube.obj["metadata"]["annotations"][POOLS]
    kube.obj["metadata"]["annotations"][POOLS] = "[]"
    clock.now += 299
    assert await nrt.sync_once() == "unchanged"
    clock.now += 2
    assert await nrt.sync_once() == "patched"  # re-read after 300 s: the edit is found
    assert kube.patches[-1] == {"metadata": {"annotations": {POOLS: good_pools}}}
    assert kube.obj["metadata"]["annotations"]["example.com/other"] == "x"
    assert "nvidia.com/gpu" in [r["name"] for r in kube.obj["zones"][0]["resources"]]
    clock.now += 301
    assert await nrt.sync_once() == "in_sync"  # read, equal (GPU kept), nothing written
    assert kube.calls[-1] == "get"


def test_merge_patch_compares_annotations_as_json_and_quantities_by_value() -> None:
    desired = {"metadata": {"annotations": {POOLS: '[{"socket":0,"node":0,"cpuset":"0-3"}]'}},
               "topologyPolicies": ["None"],
               "zones": [{"name": "node-0", "type": "Node", "resources": [
                   {"name": "memory", "capacity": "1Gi", "allocatable": "1Gi", "available": "1Gi"}]}]}
    current = {"metadata": {"annotations": {POOLS: '[{"cpuset": "0-3", "node": 0, "socket": 0}]'}},
               "topologyPolicies": ["None"],
               "zones": [{"name": "node-0", "type": "Node", "resources": [
                   {"name": "memory", "capacity": 1073741824, "allocatable": "1024Mi", "available": "1Gi"}]}]}
    assert merge_patch(current, desired) == {}
    current["topologyPolicies"] = ["SingleNUMANodePodLevel"]
    current["metadata"]["annotations"][ALLOCS] = "null"  # ours, no longer produced: removed
    assert merge_patch(current, desired) == {"topologyPolicies": ["None"],
                                             "metadata": {"annotations": {ALLOCS: None}}}


@pytest.mark.asyncio
async def test_api_errors_are_logged_once_in_a_row_and_retried(tmp_path: Path) -> None:
    kube, clock = FakeNRT(), Clock()
    nrt = reporter(tmp_path, [], kube, clock)
    with capture_logs() as logs:
        for _ in range(3):
            kube.fail_next = KubeApiError("create nrt", 403, "forbidden")
            kube.calls.append("-")
            clock.now += 3
            assert await nrt.sync_once() == "failed"
        clock.now += 3
        assert await nrt.sync_once() == "created"
    failures = [e for e in logs if e["event"] == "nrt_report_failed"]
    assert len(failures) == 1 and failures[0]["call"] == "get" and "403" in failures[0]["reason"]
    assert [e["event"] for e in logs][-2:] == ["nrt_created", "nrt_report_recovered"]


@pytest.mark.asyncio
async def test_route_serves_the_object_without_a_cluster(tmp_path: Path) -> None:
    clock = Clock()
    pods = [pod("u-lse", QoSClass.LSE, "6")]
    nrt = reporter(tmp_path, pods, None, clock)
    assert await nrt.sync_once() == "local"
    status, content_type, body = await nrt.route({})
    doc = json.loads(body)
    assert (status, content_type) == (200, "application/json")
    assert doc["metadata"]["name"] == "node-a" and doc["kind"] == "NodeResourceTopology"
    assert '"cpuset":"6"' in doc["metadata"]["annotations"][ALLOCS]
    validate_nrt(doc)
    pods.append(PodView(uid="u2", namespace="ns", name="p2", sandbox_id="s", qos=QoSClass.LSR, priority=0,
                        priority_class="", cgroup_dir="", annotations={RESOURCE_STATUS: '{"cpuset":"7"}'}))
    _, _, same = await nrt.route({})
    assert same == body  # younger than the interval: not rebuilt
    clock.now += 3.5
    _, _, newer = await nrt.route({})
    assert '"uid":"u2"' in json.loads(newer)["metadata"]["annotations"][ALLOCS]
    assert nrt.explain()["inputs"]["bound_by_resource_status"] == {"default/u-lse": "6", "ns/p2": "7"}


@pytest.mark.asyncio
async def test_created_before_the_node_was_read_it_gets_its_owner_reference_once_known(tmp_path: Path) -> None:
    """At start the NRT sync can run before the informer listed the Node: the object was
    created without an owner reference and never got one (nothing else changed)."""
    kube, clock = FakeNRT(), Clock()
    node: dict[str, Any] | None = None
    roots = host_tree(tmp_path)
    sources = NRTSources("node-a", roots, TopologyCollector(roots).latest, lambda: [], lambda: node,
                         cpu_manager_state=tmp_path / "kubelet/cpu_manager_state",
                         kubelet_config=tmp_path / "kubelet/config.yaml", clock=clock)
    nrt = NRTReporter(sources, kube, interval=3.0, resync=300.0, clock=clock)
    assert await nrt.sync_once() == "created"
    assert kube.obj is not None and "ownerReferences" not in kube.obj["metadata"]
    clock.now += 3
    assert await nrt.sync_once() == "unchanged"
    other = {"apiVersion": "example.com/v1", "kind": "Thing", "name": "t", "uid": "u-t"}
    kube.obj["metadata"]["ownerReferences"] = [other]  # another writer's owner is kept
    node = {"metadata": {"name": "node-a", "uid": "uid-node-a"}}
    clock.now += 3
    with capture_logs() as logs:
        assert await nrt.sync_once() == "patched"
    assert kube.obj["metadata"]["ownerReferences"] == [other, {
        "apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": "uid-node-a", "controller": True,
        "blockOwnerDeletion": True}]
    assert kube.patches[-1] == {"metadata": {"ownerReferences": kube.obj["metadata"]["ownerReferences"]}}
    assert [e["changed"] for e in logs if e["event"] == "nrt_patched"] == [["ownerReferences"]]
    for _ in range(3):
        clock.now += 3
        assert await nrt.sync_once() == "unchanged"
    clock.now += 301  # re-read: the owner is there, nothing written
    assert await nrt.sync_once() == "in_sync"
    assert kube.calls.count("patch") == 1


def test_owner_patch_replaces_a_deleted_nodes_reference_and_keeps_others() -> None:
    from metrics.report.nrtsync import node_owner, owner_patch

    owner = node_owner({"metadata": {"uid": "new"}}, "node-a")
    assert owner is not None and node_owner({"metadata": {}}, "node-a") is None
    other = {"apiVersion": "example.com/v1", "kind": "Thing", "name": "t", "uid": "u-t"}
    stale = {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": "old"}
    assert owner_patch({"metadata": {"ownerReferences": [other, stale]}}, owner) == [other, owner]
    assert owner_patch({"metadata": {"ownerReferences": [other, owner]}}, owner) is None
    assert owner_patch({"metadata": {"ownerReferences": "garbage"}}, owner) == [owner]
    assert owner_patch({"metadata": {}}, None) is None
