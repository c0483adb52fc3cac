"""Property-based: pod annotations and labels are untrusted input (issue 14).

Every parser of them is thrown arbitrary and mutated values; the only outcomes
allowed are a value or the documented error (``AnnotationError`` / ``ValueError``
naming the field, ``HookError`` naming pod, key and value), never another
exception. The parsers are pure: they take a string and touch no file.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hooks.annotations import (
    EXTENDED_RESOURCE_SPEC,
    RESOURCE_STATUS,
    AnnotationError,
    ExtendedResourceSpec,
    ResourceStatus,
    extended_resource_spec,
    parse_extended_resource_spec,
    parse_quantity,
    parse_resource_status,
    resource_status,
)
from hooks.cpusets import MAX_CPU_ID, CpuListError, parse_cpu_list
from hooks.groupidentity import parse_cpu_qos
from hooks.qos import QOS_LABEL, QoSClass, pod_qos, qos_class
from hooks.rules import CPUBurstStrategy, parse_cpu_burst
from runtimeproxy.hookapi import HookConfigError, HookError, PodInfo, PodMeta, frozen_map
from tests.unit.jsonvalues import json_values, scalars

SETTINGS = settings(max_examples=250, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# --- strategies ----------------------------------------------------------------------

_SCALARS = scalars(int_bits=70, text_size=20)
JSON = json_values(_SCALARS, width=4, key_size=10, max_leaves=20)
QUANTITY_TEXT = st.one_of(
    st.text(max_size=12),
    st.from_regex(r"[+-]?[0-9]{0,22}(\.[0-9]{0,6})?([a-zA-Z]{0,2}|[eE][+-]?[0-9]{1,4})", fullmatch=True),
)
QUANTITY = st.one_of(QUANTITY_TEXT, _SCALARS)
CPU_LIST = st.one_of(
    st.text(alphabet="0123456789,- \n", max_size=24),
    st.from_regex(r"([0-9]{1,5}(-[0-9]{1,5})?)(,[0-9]{1,5}(-[0-9]{1,5})?){0,3}", fullmatch=True),
    st.text(max_size=12),
)
RESOURCES = st.dictionaries(st.sampled_from(["kubernetes.io/batch-cpu", "kubernetes.io/batch-memory", "cpu", ""])
                            | st.text(max_size=8), QUANTITY | JSON, max_size=3)
RESOURCE_STATUS_DOC = st.fixed_dictionaries(
    {},
    optional={
        "cpuset": CPU_LIST | JSON,
        "numaNodeResources": st.lists(
            st.fixed_dictionaries({}, optional={"node": st.integers(-3, 2**65) | JSON, "resources": RESOURCES | JSON})
            | JSON,
            max_size=3,
        ) | JSON,
    },
)
CONTAINER_SPEC = st.fixed_dictionaries({}, optional={"requests": RESOURCES | JSON, "limits": RESOURCES | JSON}) | JSON
EXTENDED_SPEC_DOC = st.fixed_dictionaries(
    {}, optional={"containers": st.dictionaries(st.text(max_size=8), CONTAINER_SPEC, max_size=3) | JSON}
)


def as_annotation(doc: st.SearchStrategy[Any]) -> st.SearchStrategy[str]:
    """The shaped document as JSON, arbitrary JSON, mutated JSON text, or any text."""
    deep = st.integers(1, 5000).map(lambda n: '{"cpuset":' + "[" * n + "]" * n + "}")
    text = st.one_of(doc.map(json.dumps), JSON.map(json.dumps), st.text(max_size=40), deep)
    return st.one_of(text, st.tuples(text, st.integers(0, 40), st.text(max_size=3)).map(
        lambda t: t[0][: t[1]] + t[2] + t[0][t[1] + 1:]))


def pod(annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None,
        cgroup_parent: str = "") -> PodInfo:
    return PodInfo(PodMeta("web-0", "prod", "uid-1"), annotations=frozen_map(annotations),
                   labels=frozen_map(labels), cgroup_parent=cgroup_parent)


# --- properties ----------------------------------------------------------------------


@SETTINGS
@given(QUANTITY)
def test_quantity_is_a_bounded_integer_or_a_named_error(raw: object) -> None:
    try:
        value = parse_quantity(raw, "containers.app.requests.cpu")
    except AnnotationError as exc:
        assert str(exc).startswith("containers.app.requests.cpu: ")
    else:
        assert isinstance(value, int) and 0 <= value <= 2**63 - 1


@SETTINGS
@given(CPU_LIST)
def test_cpu_list_is_a_bounded_set_or_a_cpu_list_error(text: str) -> None:
    try:
        cpus = parse_cpu_list(text)
    except CpuListError as exc:
        assert "CPU list" in str(exc) or "CPU" in str(exc)
    else:
        assert all(0 <= cpu <= MAX_CPU_ID for cpu in cpus)


@SETTINGS
@given(as_annotation(RESOURCE_STATUS_DOC))
def test_resource_status_parses_or_names_the_field(raw: str) -> None:
    try:
        status = parse_resource_status(raw)
    except AnnotationError as exc:
        assert str(exc).split(":")[0] in ("invalid JSON", "expected a JSON object, got list", "cpuset") or str(
            exc).startswith(("expected a JSON object", "numaNodeResources"))
    else:
        assert isinstance(status, ResourceStatus)
        assert all(0 <= cpu <= MAX_CPU_ID for cpu in status.cpus)
        assert all(n.node >= 0 and all(v >= 0 for v in n.resources.values()) for n in status.numa_node_resources)


@SETTINGS
@given(as_annotation(EXTENDED_SPEC_DOC))
def test_extended_resource_spec_parses_or_names_the_field(raw: str) -> None:
    try:
        spec = parse_extended_resource_spec(raw)
    except AnnotationError as exc:
        assert str(exc).startswith(("invalid JSON", "expected a JSON object", "containers"))
    else:
        assert isinstance(spec, ExtendedResourceSpec)
        for res in spec.containers.values():
            assert all(isinstance(v, int) and v >= 0 for v in (*res.requests.values(), *res.limits.values()))
        for kind in ("requests", "limits"):
            total = spec.total(kind, "kubernetes.io/batch-cpu")
            assert total is None or total >= 0


@SETTINGS
@given(as_annotation(RESOURCE_STATUS_DOC), as_annotation(EXTENDED_SPEC_DOC))
def test_pod_level_readers_raise_hook_errors_naming_pod_and_key(status_raw: str, spec_raw: str) -> None:
    p = pod({RESOURCE_STATUS: status_raw, EXTENDED_RESOURCE_SPEC: spec_raw})
    for read, key in ((resource_status, RESOURCE_STATUS), (extended_resource_spec, EXTENDED_RESOURCE_SPEC)):
        try:
            read(p)
        except HookError as exc:
            assert str(exc).startswith(f"pod prod/web-0: annotation {key}=")
            assert len(str(exc)) < 1000  # the value is cut short


@SETTINGS
@given(st.text(max_size=30) | st.sampled_from([c.value for c in QoSClass]), st.text(max_size=60)
       | st.sampled_from(["/kubepods/besteffort/pod1", "kubepods-burstable-pod1.slice", "/kubepods/pod1"]))
def test_qos_label_is_a_class_or_a_hook_error(label: str, parent: str) -> None:
    try:
        qos = pod_qos(pod(labels={QOS_LABEL: label}, cgroup_parent=parent))
    except HookError as exc:
        assert f"label {QOS_LABEL}=" in str(exc)
    else:
        assert isinstance(qos, QoSClass)
        assert qos == qos_class({QOS_LABEL: label}, parent)


@SETTINGS
@given(as_annotation(st.fixed_dictionaries({}, optional={"enable": JSON, "groupIdentity": JSON})))
def test_cpu_qos_annotation_is_a_pair_or_a_value_error(raw: str) -> None:
    try:
        enable, identity = parse_cpu_qos(raw)
    except ValueError:
        pass  # AnnotationError is a ValueError; both carry the field in the message
    else:
        assert isinstance(enable, bool)
        assert identity is None or -1 <= identity <= 2


@SETTINGS
@given(JSON | st.fixed_dictionaries({}, optional={
    "policy": st.sampled_from(["none", "auto", "cpuBurstOnly", "x"]) | JSON,
    "cpuBurstPercent": st.integers(-5, 200_000) | JSON,
    "cfsQuotaBurstPercent": st.integers(-5, 200_000) | JSON,
    "cfsQuotaBurstPeriodSeconds": st.integers(-5, 200_000) | JSON,
    "sharePoolThresholdPercent": JSON,
}))
def test_cpu_burst_annotation_is_a_strategy_or_a_config_error(raw: object) -> None:
    try:
        burst = parse_cpu_burst(raw, "annotation koordinator.sh/cpuBurst", CPUBurstStrategy())
    except HookConfigError as exc:
        assert exc.key_path.startswith("annotation koordinator.sh/cpuBurst")
    else:
        assert isinstance(burst, CPUBurstStrategy)
