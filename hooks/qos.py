"""Koordinator QoS and priority classes of a pod, as seen at the CRI level.

Every isolation hook first asks "what class is this pod?". Koordinator answers
from the pod label ``koordinator.sh/qosClass``; pods without it fall back to
their Kubernetes QoS class. The proxy never sees the pod spec, but kubelet puts
the Kubernetes QoS into the cgroup parent it sends (``/kubepods/besteffort/...``
or ``kubepods-besteffort-pod<uid>.slice``), so that is where we read it.

A label value Koordinator does not know is an error naming the pod and value,
not a silent "no class": a typo in ``qosClass`` would otherwise quietly give a
pod the wrong isolation.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from runtimeproxy.hookapi import HookError, PodInfo

QOS_LABEL: Final = "koordinator.sh/qosClass"
PRIORITY_CLASS_LABEL: Final = "koordinator.sh/priority-class"


class QoSClass(enum.Enum):
    LSE = "LSE"
    LSR = "LSR"
    LS = "LS"
    BE = "BE"
    SYSTEM = "SYSTEM"
    NONE = ""


class KubeQoS(enum.Enum):
    GUARANTEED = "Guaranteed"
    BURSTABLE = "Burstable"
    BESTEFFORT = "BestEffort"


def pod_name(pod: PodInfo) -> str:
    """``namespace/name`` for error messages."""
    return f"{pod.meta.namespace}/{pod.meta.name}"


def parse_qos_label(value: str) -> QoSClass:
    """Label value → class; ``""`` is ``NONE``; anything else unknown raises ValueError."""
    try:
        return QoSClass(value)
    except ValueError:
        known = ", ".join(c.value for c in QoSClass if c.value)
        raise ValueError(f"unknown QoS class {value!r} (known: {known})") from None


def _kube_qos_of_component(part: str) -> KubeQoS | None:
    if part in ("besteffort", "kubepods-besteffort.slice") or part.startswith("kubepods-besteffort-"):
        return KubeQoS.BESTEFFORT
    if part in ("burstable", "kubepods-burstable.slice") or part.startswith("kubepods-burstable-"):
        return KubeQoS.BURSTABLE
    return None


def kube_qos_from_cgroup_parent(cgroup_parent: str) -> KubeQoS | None:
    """Kubernetes QoS class from a kubelet cgroup parent (cgroupfs or systemd names);
    ``None`` when the parent is not under ``kubepods`` at all."""
    parts = [p for p in cgroup_parent.split("/") if p]
    for part in parts:
        kube = _kube_qos_of_component(part)
        if kube is not None:
            return kube
    if any(p == "kubepods" or p.startswith("kubepods.") or p.startswith("kubepods-") for p in parts):
        return KubeQoS.GUARANTEED
    return None


_FROM_KUBE: Final = {KubeQoS.BESTEFFORT: QoSClass.BE, KubeQoS.BURSTABLE: QoSClass.LS}


def qos_class(
    labels: Mapping[str, str], cgroup_parent: str, *, guaranteed: QoSClass = QoSClass.LSR
) -> QoSClass:
    """The pod's class: the label if set, else derived from the kube QoS in the
    cgroup parent (Guaranteed → ``guaranteed``, LSR as in Koordinator). Raises
    ValueError for an unknown label value."""
    label = labels.get(QOS_LABEL, "")
    if label:
        return parse_qos_label(label)
    kube = kube_qos_from_cgroup_parent(cgroup_parent)
    if kube is None:
        return QoSClass.NONE
    return _FROM_KUBE.get(kube, guaranteed)


def pod_qos(pod: PodInfo, *, guaranteed: QoSClass = QoSClass.LSR) -> QoSClass:
    """``qos_class`` for a pod, with a HookError naming the pod, label and value."""
    try:
        return qos_class(pod.labels, pod.cgroup_parent, guaranteed=guaranteed)
    except ValueError as exc:
        raise HookError(f"pod {pod_name(pod)}: label {QOS_LABEL}={pod.labels.get(QOS_LABEL)!r}: {exc}") from exc


@dataclass(frozen=True, slots=True)
class _Band:
    low: int
    high: int
    default: int


class PriorityClass(enum.Enum):
    PROD = "koord-prod"
    MID = "koord-mid"
    BATCH = "koord-batch"
    FREE = "koord-free"
    NONE = ""

    @property
    def band(self) -> tuple[int, int] | None:
        """Inclusive priority value range, ``None`` for ``NONE``."""
        band = _BANDS.get(self)
        return None if band is None else (band.low, band.high)

    @property
    def default_priority(self) -> int:
        band = _BANDS.get(self)
        return 0 if band is None else band.default


_BANDS: Final = {
    PriorityClass.PROD: _Band(9000, 9999, 9500),
    PriorityClass.MID: _Band(7000, 7999, 7500),
    PriorityClass.BATCH: _Band(5000, 5999, 5500),
    PriorityClass.FREE: _Band(3000, 3999, 3500),
}


def priority_class_of_value(priority: int) -> PriorityClass:
    """The band a pod priority value falls in (``NONE`` outside every band)."""
    for cls, band in _BANDS.items():
        if band.low <= priority <= band.high:
            return cls
    return PriorityClass.NONE


def default_priority_class(qos: QoSClass) -> PriorityClass:
    """Koordinator's default when neither label nor value says: BE → batch, classed pods → prod."""
    if qos is QoSClass.BE:
        return PriorityClass.BATCH
    if qos is QoSClass.NONE:
        return PriorityClass.NONE
    return PriorityClass.PROD


def priority_class(labels: Mapping[str, str], priority: int | None = None) -> PriorityClass:
    """From the ``koordinator.sh/priority-class`` label, else the priority value.
    Raises ValueError for an unknown label value."""
    label = labels.get(PRIORITY_CLASS_LABEL, "")
    if label:
        try:
            return PriorityClass(label)
        except ValueError:
            known = ", ".join(c.value for c in PriorityClass if c.value)
            raise ValueError(f"unknown priority class {label!r} (known: {known})") from None
    if priority is None:
        return PriorityClass.NONE
    return priority_class_of_value(priority)


def pod_priority_class(pod: PodInfo, priority: int | None = None) -> PriorityClass:
    """``priority_class`` for a pod, with a HookError naming the pod, label and value."""
    try:
        return priority_class(pod.labels, priority)
    except ValueError as exc:
        value = pod.labels.get(PRIORITY_CLASS_LABEL)
        raise HookError(f"pod {pod_name(pod)}: label {PRIORITY_CLASS_LABEL}={value!r}: {exc}") from exc
