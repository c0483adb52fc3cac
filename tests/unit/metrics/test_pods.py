"""Pod views from the proxy's store snapshot: class, priority, batch requests, cgroup dirs."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest

from hooks.qos import QoSClass
from metrics.informer.pods import PodViews
from runtimeproxy.hookapi import ContainerInfo, ContainerMeta, PodInfo, PodMeta, Resources

SPEC = "node.koordinator.sh/extended-resource-spec"
CID = "a" * 64


def _pod(name: str, parent: str, labels: Mapping[str, str] | None = None,
         annotations: Mapping[str, str] | None = None, sid: str = "") -> PodInfo:
    return PodInfo(meta=PodMeta(name=name, namespace="ns", uid=f"uid-{name}"), id=sid or f"sb-{name}",
                   labels=dict(labels or {}), annotations=dict(annotations or {}), cgroup_parent=parent)


def _views(pods: list[PodInfo], containers: dict[str, tuple[str, ContainerInfo]] | None = None,
           **kw: object) -> PodViews:
    return PodViews(lambda: ({p.id: p for p in pods}, containers or {}), **kw)  # type: ignore[arg-type]


def test_be_pod_with_batch_spec_and_container() -> None:
    batch = {"containers": {"c": {"requests": {"kubernetes.io/batch-cpu": "500",
                                               "kubernetes.io/batch-memory": "1Gi"},
                                  "limits": {"kubernetes.io/batch-cpu": "1000"}}}}
    pod = _pod("be", "/kubepods/besteffort/poduid-be", {"koordinator.sh/qosClass": "BE"}, {SPEC: json.dumps(batch)})
    ctr = ContainerInfo(meta=ContainerMeta(name="c"), id=CID, resources=Resources(cpu_quota=50000, cpu_period=100000))
    [view] = _views([pod], {CID: (pod.id, ctr)}).current()
    assert (view.qos, view.kube_qos, view.priority_class, view.priority) == (QoSClass.BE, "besteffort", "koord-batch",
                                                                             5500)
    assert view.cgroup_dir == "kubepods/besteffort/poduid-be"
    assert (view.batch_cpu_request_milli, view.batch_memory_request) == (500, 1 << 30)
    [c] = view.containers
    assert (c.cgroup_dir, c.cpu_quota, c.batch_cpu_request_milli, c.batch_cpu_limit_milli) == (
        f"kubepods/besteffort/poduid-be/{CID}", 50000, 500, 1000)


def test_guaranteed_class_and_kubelet_priority_are_used() -> None:
    pod = _pod("db", "/kubepods/poduid-db")
    [view] = _views([pod], guaranteed=lambda: QoSClass.LS, priority_of=lambda uid: 7100).current()
    assert (view.qos, view.kube_qos, view.priority, view.priority_class) == (QoSClass.LS, "guaranteed", 7100,
                                                                             "koord-mid")


def test_bad_labels_and_annotations_still_measure_the_pod(caplog: pytest.LogCaptureFixture) -> None:
    pod = _pod("odd", "/kubepods/burstable/poduid-odd",
               {"koordinator.sh/qosClass": "GOLD", "koordinator.sh/priority-class": "vip"}, {SPEC: "{not json"})
    views = _views([pod])
    [view] = views.current()
    assert (view.qos, view.priority_class, view.batch_cpu_request_milli) == (QoSClass.LS, "koord-prod", 0)
    assert views.current()[0] == view  # warnings are once per pod; the view is stable


def test_pods_without_sandbox_or_with_unsafe_parent_are_skipped() -> None:
    pods = [_pod("new", "/kubepods/burstable/podx", sid=""), _pod("evil", "/kubepods/../../etc"),
            _pod("empty", ""), _pod("ok", "/kubepods/burstable/podok")]
    pods[0] = PodInfo(meta=pods[0].meta, id="", cgroup_parent=pods[0].cgroup_parent)
    names = [v.name for v in PodViews(lambda: ({p.id or "x": p for p in pods}, {})).current()]
    assert names == ["ok"]


def test_systemd_driver_expands_slices() -> None:
    pod = _pod("s", "kubepods-burstable-pod1234.slice")
    ctr = ContainerInfo(meta=ContainerMeta(name="c"), id=CID)
    [view] = _views([pod], {CID: (pod.id, ctr)}, driver="systemd").current()
    assert view.cgroup_dir == "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice"
    assert view.containers[0].cgroup_dir.endswith(f"/cri-containerd-{CID}.scope")


def test_views_are_reused_until_a_record_the_class_or_the_priority_changes() -> None:
    """The agent asks every 10 s: unchanged inputs give the very same view object."""
    web, db = _pod("web", "/kubepods/burstable/poduid-web"), _pod("db", "/kubepods/poduid-db")
    ctr = ContainerInfo(meta=ContainerMeta(name="c"), id=CID)
    store = {"pods": {web.id: web, db.id: db}, "containers": {CID: (web.id, ctr)}}
    prio, klass = {"uid-web": 100}, [QoSClass.LSR]
    views = PodViews(lambda: (dict(store["pods"]), dict(store["containers"])),  # type: ignore[arg-type]
                     guaranteed=lambda: klass[0], priority_of=prio.get)
    first = {v.name: v for v in views.current()}
    again = {v.name: v for v in views.current()}
    assert all(again[n] is first[n] for n in first)
    store["pods"][web.id] = _pod("web", "/kubepods/burstable/poduid-web", {"koordinator.sh/qosClass": "BE"})
    changed = {v.name: v for v in views.current()}
    assert changed["web"].qos is QoSClass.BE and changed["db"] is first["db"]
    store["containers"][CID] = (web.id, ContainerInfo(meta=ContainerMeta(name="c"), id=CID,
                                                      resources=Resources(cpu_quota=1000, cpu_period=100000)))
    assert {v.name: v for v in views.current()}["web"].containers[0].cpu_quota == 1000
    prio["uid-db"] = 9100
    klass[0] = QoSClass.LS
    last = {v.name: v for v in views.current()}
    assert (last["db"].priority, last["db"].qos) == (9100, QoSClass.LS)
    del store["pods"][db.id]
    assert [v.name for v in views.current()] == ["web"]


def test_one_view_per_uid_the_newest_sandbox() -> None:
    """kubelet restarted a pod (same UID, attempt 1) and keeps the stopped sandbox until its
    garbage collection: the pod is viewed once, in its new sandbox (issue 28 item 4)."""
    from dataclasses import replace

    new = _pod("web", "/kubepods/besteffort/poduid-web", sid="sb-new")
    new = replace(new, meta=replace(new.meta, attempt=1))
    old = _pod("web", "/kubepods/besteffort/poduid-web", sid="sb-old")
    other = _pod("db", "/kubepods/poduid-db")
    views = _views([new, old, other]).current()  # the newest listed first: attempt decides
    assert [(v.name, v.sandbox_id) for v in views] == [("db", "sb-db"), ("web", "sb-new")]
