"""QoS class from label or cgroup parent; priority class from label or value."""

from __future__ import annotations

import pytest

from hooks.qos import (
    KubeQoS,
    PriorityClass,
    QoSClass,
    default_priority_class,
    kube_qos_from_cgroup_parent,
    pod_priority_class,
    pod_qos,
    priority_class,
    priority_class_of_value,
    qos_class,
)
from runtimeproxy.hookapi import HookError, PodInfo, PodMeta, frozen_map


def _pod(labels: dict[str, str] | None = None, parent: str = "") -> PodInfo:
    return PodInfo(PodMeta("web", "prod", "uid-1"), labels=frozen_map(labels), cgroup_parent=parent)


@pytest.mark.parametrize("value", ["LSE", "LSR", "LS", "BE", "SYSTEM"])
def test_label_wins(value: str) -> None:
    assert qos_class({"koordinator.sh/qosClass": value}, "/kubepods/besteffort/podx") is QoSClass(value)


@pytest.mark.parametrize(
    ("parent", "kube"),
    [
        ("/kubepods/besteffort/pod1234", KubeQoS.BESTEFFORT),
        ("kubepods/burstable/pod1234", KubeQoS.BURSTABLE),
        ("/kubepods/pod1234", KubeQoS.GUARANTEED),
        ("kubepods-besteffort-pod12_34.slice", KubeQoS.BESTEFFORT),
        ("kubepods-burstable-pod12_34.slice", KubeQoS.BURSTABLE),
        ("kubepods-pod12_34.slice", KubeQoS.GUARANTEED),
        ("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice", KubeQoS.BESTEFFORT),
        ("/kubepods.slice/kubepods-pod1.slice", KubeQoS.GUARANTEED),
        ("/system.slice/foo.service", None),
        ("", None),
    ],
)
def test_kube_qos_from_cgroup_parent(parent: str, kube: KubeQoS | None) -> None:
    assert kube_qos_from_cgroup_parent(parent) is kube


@pytest.mark.parametrize(
    ("parent", "qos"),
    [
        ("/kubepods/besteffort/pod1", QoSClass.BE),
        ("/kubepods/burstable/pod1", QoSClass.LS),
        ("/kubepods/pod1", QoSClass.LSR),
        ("kubepods-besteffort-pod1.slice", QoSClass.BE),
        ("/elsewhere", QoSClass.NONE),
    ],
)
def test_without_label_from_cgroup_parent(parent: str, qos: QoSClass) -> None:
    assert qos_class({}, parent) is qos
    assert pod_qos(_pod(parent=parent)) is qos


def test_guaranteed_mapping_is_configurable() -> None:
    assert qos_class({}, "/kubepods/pod1", guaranteed=QoSClass.LS) is QoSClass.LS
    assert pod_qos(_pod(parent="kubepods-pod1.slice"), guaranteed=QoSClass.LSE) is QoSClass.LSE


def test_empty_label_is_absent() -> None:
    assert qos_class({"koordinator.sh/qosClass": ""}, "/kubepods/besteffort/p") is QoSClass.BE


def test_unknown_label_names_pod_label_and_value() -> None:
    with pytest.raises(HookError, match=r"pod prod/web: label koordinator.sh/qosClass='be': unknown QoS class"):
        pod_qos(_pod({"koordinator.sh/qosClass": "be"}))


@pytest.mark.parametrize(
    ("value", "cls"),
    [
        (9000, PriorityClass.PROD),
        (9999, PriorityClass.PROD),
        (7500, PriorityClass.MID),
        (5000, PriorityClass.BATCH),
        (3999, PriorityClass.FREE),
        (8999, PriorityClass.NONE),
        (0, PriorityClass.NONE),
        (10000, PriorityClass.NONE),
    ],
)
def test_priority_bands(value: int, cls: PriorityClass) -> None:
    assert priority_class_of_value(value) is cls
    assert priority_class({}, value) is cls


def test_priority_label_wins_and_defaults() -> None:
    assert priority_class({"koordinator.sh/priority-class": "koord-batch"}, 9500) is PriorityClass.BATCH
    assert priority_class({}) is PriorityClass.NONE
    assert PriorityClass.PROD.band == (9000, 9999)
    assert PriorityClass.MID.default_priority == 7500
    assert PriorityClass.NONE.band is None and PriorityClass.NONE.default_priority == 0
    assert default_priority_class(QoSClass.BE) is PriorityClass.BATCH
    assert default_priority_class(QoSClass.LSR) is PriorityClass.PROD
    assert default_priority_class(QoSClass.NONE) is PriorityClass.NONE


def test_unknown_priority_label_is_a_hook_error() -> None:
    pod = _pod({"koordinator.sh/priority-class": "gold"})
    with pytest.raises(HookError, match=r"prod/web: label koordinator.sh/priority-class='gold'"):
        pod_priority_class(pod)
