"""Property-based: the pod annotations and labels the metrics side and the resctrl
hook read are untrusted input (issue 14).

Anyone who can create a pod chooses them. Arbitrary, mutated and deeply nested
values go through ``PodViews`` (store -> views for every collector and QoS task),
the cpu-burst and eviction opt-in annotations and the resctrl annotation: the
only outcomes allowed are a value (or the documented fallback) or the documented
error, never another exception, which would stop a supervised task on every
tick. The first runs found a ``RecursionError`` out of each of them.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hooks.annotations import EXTENDED_RESOURCE_SPEC
from hooks.qos import PRIORITY_CLASS_LABEL, QOS_LABEL, QoSClass
from hooks.resctrl import RESCTRL_ANNOTATION, AnnotationError, Resctrl
from hooks.resctrlfs import ResctrlError
from hooks.rules import CPUBurstStrategy
from metrics.informer.pods import PodViews
from metrics.model import PodView
from metrics.qos.burst import ANNOTATION as CPU_BURST
from metrics.qos.burst import BurstStrategy
from metrics.qos.evict import EVICTION_POLICY, allowed
from runtimeproxy.hookapi import (
    ContainerInfo,
    ContainerMeta,
    HookInit,
    HostRoots,
    PodInfo,
    PodMeta,
    Resources,
    frozen_map,
)
from tests import tmpnames
from tests.unit.jsonvalues import json_values, scalars

SETTINGS = settings(max_examples=200, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

JSON = json_values(scalars(text_size=12))
DEEP = st.integers(1, 5000).map(lambda n: "[" * n + "]" * n)
SHAPED = st.sampled_from([
    '{"containers": {"app": {"requests": {"kubernetes.io/batch-cpu": "500", "kubernetes.io/batch-memory": "1Gi"},'
    ' "limits": {"kubernetes.io/batch-cpu": 1000}}}}',
    '["BECPUEvict", "BEMemoryEvict"]', '{"policy": "auto", "cpuBurstPercent": 300}',
    '{"llc": {"start": 0, "end": 50}, "mb": {"percent": 80}}',
])
ANNOTATION_VALUE = st.one_of(
    SHAPED, JSON.map(json.dumps), DEEP, st.text(max_size=30),
    st.tuples(SHAPED, st.integers(0, 120), st.text(max_size=2)).map(lambda t: t[0][: t[1]] + t[2] + t[0][t[1] + 1:]),
)
ANNOTATIONS = st.fixed_dictionaries({}, optional={
    EXTENDED_RESOURCE_SPEC: ANNOTATION_VALUE, CPU_BURST: ANNOTATION_VALUE, EVICTION_POLICY: ANNOTATION_VALUE,
    RESCTRL_ANNOTATION: ANNOTATION_VALUE,
})
LABELS = st.fixed_dictionaries({}, optional={
    QOS_LABEL: st.sampled_from(["LS", "BE", "LSR", "LSE", "SYSTEM", ""]) | st.text(max_size=8),
    PRIORITY_CLASS_LABEL: st.sampled_from(["koord-prod", "koord-batch", "koord-free"]) | st.text(max_size=8),
})
_GOOD_PARENT = st.sampled_from(["/kubepods/besteffort/pod1", "/kubepods/pod1", "kubepods-burstable-pod1.slice"])
PARENT = st.one_of(_GOOD_PARENT, _GOOD_PARENT, _GOOD_PARENT,
                   st.sampled_from(["", "/", "/kubepods/../x", "/a\x00b"]), st.text(max_size=30))


@st.composite
def pods(draw: st.DrawFn) -> tuple[PodInfo, list[ContainerInfo]]:
    pod = PodInfo(
        meta=PodMeta(name="p", namespace="ns", uid=draw(st.sampled_from(["u1", "u2"]))),
        id=draw(st.sampled_from(["sb1", "sb1", "sb1", ""])), labels=frozen_map(draw(LABELS)),
        annotations=frozen_map(draw(ANNOTATIONS)), cgroup_parent=draw(PARENT),
    )
    containers = [
        ContainerInfo(meta=ContainerMeta(name=draw(st.sampled_from(["app", "side"]))),
                      id=draw(st.sampled_from(["c1", "", "../x", "c" * 200])),
                      resources=Resources(cpu_quota=draw(st.integers(-1, 10**6))))
        for _ in range(draw(st.integers(0, 2)))
    ]
    return pod, containers


def view(annotations: dict[str, str]) -> PodView:
    return PodView(uid="u1", namespace="ns", name="p", sandbox_id="sb1", qos=QoSClass.BE, priority=0,
                   priority_class="koord-batch", cgroup_dir="kubepods/besteffort/pod1", annotations=annotations)


@SETTINGS
@given(pods(), st.sampled_from(["cgroupfs", "systemd"]))
def test_pod_views_are_built_or_skipped_never_raised(pod: tuple[PodInfo, list[ContainerInfo]], driver: Any) -> None:
    info, containers = pod
    snapshot = ({"sb1": info}, {f"c{i}": ("sb1", c) for i, c in enumerate(containers)})
    views = PodViews(lambda: snapshot, driver=driver).current()
    for v in views:
        assert v.uid == info.meta.uid and v.batch_cpu_request_milli >= 0 and v.batch_memory_request >= 0
        assert ".." not in v.cgroup_dir.split("/")


@SETTINGS
@given(ANNOTATION_VALUE)
def test_cpu_burst_annotation_is_a_strategy_or_the_node_default(raw: str) -> None:
    node = CPUBurstStrategy()
    config = BurstStrategy().config_of(view({CPU_BURST: raw}), node)
    assert isinstance(config, CPUBurstStrategy)


@SETTINGS
@given(ANNOTATION_VALUE)
def test_eviction_policy_annotation_is_a_yes_or_no(raw: str) -> None:
    assert allowed(view({EVICTION_POLICY: raw}), "BECPUEvict") in (True, False)


@pytest.fixture(scope="module")
def resctrl_hook() -> Iterator[Resctrl]:
    root = tmpnames.mkdtemp()
    (root / "cgroup" / "cpu").mkdir(parents=True)
    (root / "resctrl").mkdir()
    host = HostRoots(cgroup=root / "cgroup", proc=root / "proc", sys=root / "sys", resctrl=root / "resctrl")
    yield Resctrl(HookInit("resctrl", {}, "hooks[0].args", host, {}))
    shutil.rmtree(root, ignore_errors=True)


@SETTINGS
@given(ANNOTATION_VALUE)
def test_resctrl_annotation_is_schemata_or_a_named_error(resctrl_hook: Resctrl, raw: str) -> None:
    before = sorted(p.name for p in resctrl_hook.fs.root.iterdir())
    try:
        schemata = resctrl_hook.annotation_schemata(raw)
    except (AnnotationError, ResctrlError) as exc:
        assert str(exc)
    else:
        assert isinstance(schemata, str)
    assert sorted(p.name for p in resctrl_hook.fs.root.iterdir()) == before  # parsing writes nothing
