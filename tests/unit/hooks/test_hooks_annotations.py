"""Strict parsing of resource-status and extended-resource-spec annotations."""

from __future__ import annotations

import json

import pytest

from hooks.annotations import (
    BATCH_CPU,
    BATCH_MEMORY,
    EXTENDED_RESOURCE_SPEC,
    RESOURCE_STATUS,
    AnnotationError,
    extended_resource_spec,
    parse_quantity,
    resource_status,
)
from runtimeproxy.hookapi import HookError, PodInfo, PodMeta, frozen_map


def _pod(annotations: dict[str, str]) -> PodInfo:
    return PodInfo(PodMeta("job-1", "batch", "uid-2"), annotations=frozen_map(annotations))


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        (1000, 1000),
        ("1000", 1000),
        ("1k", 1000),
        ("2", 2),
        ("1Gi", 2**30),
        ("512Mi", 512 * 2**20),
        ("1G", 10**9),
        ("500m", 1),  # Quantity.Value() rounds up
        ("2000m", 2),
        ("1.5", 2),
        ("2e3", 2000),
        ("1E", 10**18),
        (0, 0),
        (1.5, 2),
    ],
)
def test_quantities(raw: object, value: int) -> None:
    assert parse_quantity(raw) == value


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (-1, "negative"),
        ("-1Gi", "negative"),
        ("abc", "not a Kubernetes quantity"),
        ("1Gb", "unknown unit suffix"),
        ("", "not a Kubernetes quantity"),
        (True, "got bool"),
        ([1], "got list"),
        (None, "got NoneType"),
        ("1e999", "out of range"),
        (float("inf"), "not finite"),
    ],
)
def test_bad_quantities(raw: object, fragment: str) -> None:
    with pytest.raises(AnnotationError, match=fragment):
        parse_quantity(raw, "limits.x")


def test_resource_status() -> None:
    raw = json.dumps({"cpuset": "2-3", "numaNodeResources": [{"node": 1, "resources": {"cpu": "2"}}]})
    status = resource_status(_pod({RESOURCE_STATUS: raw}))
    assert status is not None
    assert status.cpuset == "2-3" and status.cpus == {2, 3}
    assert status.numa_node_resources[0].node == 1
    assert status.numa_node_resources[0].resources["cpu"] == 2
    assert resource_status(_pod({})) is None
    empty = resource_status(_pod({RESOURCE_STATUS: "{}"}))
    assert empty is not None and empty.cpus == frozenset()


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("{bad", "invalid JSON"),
        ("[]", "expected a JSON object"),
        ('{"cpuset": 3}', "cpuset: expected a string"),
        ('{"cpuset": "3-1"}', "reversed"),
        ('{"cpuset": "0-99999"}', "beyond the kernel limit"),
        ('{"numaNodeResources": {}}', "expected a list"),
        ('{"numaNodeResources": [{"node": -1}]}', "node: expected a NUMA node"),
        ('{"numaNodeResources": [{"node": 0, "resources": {"cpu": "-2"}}]}', "negative"),
    ],
)
def test_bad_resource_status_names_pod_key_value(raw: str, fragment: str) -> None:
    with pytest.raises(HookError, match=fragment) as info:
        resource_status(_pod({RESOURCE_STATUS: raw}))
    message = str(info.value)
    assert "pod batch/job-1" in message and RESOURCE_STATUS in message and repr(raw) in message


def test_extended_resource_spec_ints_and_strings() -> None:
    raw = json.dumps(
        {
            "containers": {
                "main": {"requests": {BATCH_CPU: 1000, BATCH_MEMORY: "1Gi"}, "limits": {BATCH_CPU: "2k"}},
                "side": {"requests": {BATCH_CPU: "500"}},
            }
        }
    )
    spec = extended_resource_spec(_pod({EXTENDED_RESOURCE_SPEC: raw}))
    assert spec is not None
    assert spec.containers["main"].requests == {BATCH_CPU: 1000, BATCH_MEMORY: 2**30}
    assert spec.containers["main"].limits == {BATCH_CPU: 2000}
    assert spec.containers["side"].limits == {}
    assert spec.total("requests", BATCH_CPU) == 1500
    assert spec.total("limits", BATCH_CPU) is None  # "side" has no limit: unbounded
    assert extended_resource_spec(_pod({})) is None


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ("not json", "invalid JSON"),
        ('{"containers": []}', "containers: expected an object"),
        ('{"containers": {"main": 1}}', "containers.main: expected an object"),
        ('{"containers": {"main": {"requests": []}}}', "containers.main.requests: expected an object"),
        ('{"containers": {"main": {"requests": {"kubernetes.io/batch-cpu": -5}}}}', "negative"),
        ('{"containers": {"main": {"limits": {"kubernetes.io/batch-memory": "1XB"}}}}', "unknown unit"),
        ('{"containers": {"main": {"limits": {"kubernetes.io/batch-cpu": true}}}}', "got bool"),
        ('{"containers": {"main": {"limit": {}}}}', "unknown key 'limit'"),
    ],
)
def test_bad_extended_resource_spec(raw: str, fragment: str) -> None:
    with pytest.raises(HookError, match=fragment) as info:
        extended_resource_spec(_pod({EXTENDED_RESOURCE_SPEC: raw}))
    message = str(info.value)
    assert "pod batch/job-1" in message and EXTENDED_RESOURCE_SPEC in message and repr(raw) in message


def test_long_values_are_shortened_in_errors() -> None:
    raw = "x" * 5000
    with pytest.raises(HookError) as info:
        extended_resource_spec(_pod({EXTENDED_RESOURCE_SPEC: raw}))
    assert len(str(info.value)) < 600


def test_a_spec_is_parsed_once_and_shared_while_errors_name_each_pod() -> None:
    raw = '{"containers": {"main": {"requests": {"kubernetes.io/batch-cpu": "1500"}}}}'
    first = extended_resource_spec(_pod({EXTENDED_RESOURCE_SPEC: raw}))
    other = PodInfo(PodMeta("job-2", "batch", "uid-3"), annotations=frozen_map({EXTENDED_RESOURCE_SPEC: raw}))
    assert first is not None and extended_resource_spec(other) is first  # one parse, immutable, shared
    assert dict(first.containers["main"].requests) == {BATCH_CPU: 1500}
    bad = '{"containers": {"main": 1}}'
    for name in ("job-1", "job-2"):  # a failed parse is not cached: every pod's error names that pod
        pod = PodInfo(PodMeta(name, "batch", "uid-9"), annotations=frozen_map({EXTENDED_RESOURCE_SPEC: bad}))
        with pytest.raises(HookError, match=f"pod batch/{name}"):
            extended_resource_spec(pod)
