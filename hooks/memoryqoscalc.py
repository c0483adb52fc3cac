"""Memory QoS arithmetic, pure: koordlet's CgroupReconcile formulas (reference §4.4).

No file is touched here; ``hooks.memoryqos`` reads the inputs and writes the results.

* Per pod config: the class's ``memoryQOS`` (LSE uses LSR's) merged with the pod
  annotation ``koordinator.sh/memoryQOS`` = ``{"policy": "default|auto|none", <MemoryQOS
  fields>}``: ``none`` turns memory QoS off for the pod, ``auto`` starts from koordlet's
  class defaults (enabled whatever the rules say), ``default`` (or no policy) from the
  class config in the rules (which must enable it); explicit fields override either.
* Container: ``memory.min = req*minLimitPercent/100``, ``memory.low =
  req*lowLimitPercent/100`` (at least min), ``memory.high = floor((req +
  (limit-req)*throttlingPercent/100)/PAGE)*PAGE`` with limit = node allocatable when
  unlimited, ``max`` when throttlingPercent is 0; Anolis extras wmark_ratio,
  wmark_scale_factor (= wmarkScalePermill), wmark_min_adj, priority, use_priority_oom,
  oom.group as configured.
* Pod: min/low from the sum of its containers' requests; no high.
* Kube-QoS tiers: ``kubepods/burstable`` and ``kubepods/besteffort`` get the sum of
  their pods' min/low, the ``kubepods`` root the sum of all pods (``tier_sums``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Final

from hooks.annotations import load_object
from hooks.cgroups import MEMORY_UNLIMITED_V1, PAGE_SIZE, CgroupError, Resource, Value, Version
from hooks.qos import KubeQoS, QoSClass
from hooks.rules import MemoryQOS, parse_memory_qos
from runtimeproxy.hookapi import HookConfigError

MEMORY_QOS_ANNOTATION: Final = "koordinator.sh/memoryQOS"
POLICIES: Final = ("default", "auto", "none")
UNLIMITED: Final = -1


# --- the files ------------------------------------------------------------------


def _bytes_check(name: str) -> Any:
    def check(value: Value) -> Value:
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise CgroupError(f"{name}: expected bytes >= 0 (or -1 for max), got {value!r}")
        if value == -1 or value >= MEMORY_UNLIMITED_V1:
            return -1
        return value - value % PAGE_SIZE  # the kernel keeps pages: compare what it reads back

    return check


def _bytes_render(value: Value, _version: Version, _current: str | None) -> str:
    return "max" if value == -1 else str(value)


def _bytes_parse(text: str, _version: Version) -> Value:
    token = text.split()[0] if text.split() else "0"
    if token == "max":
        return -1
    number = int(token)
    return -1 if number >= MEMORY_UNLIMITED_V1 else number


def _int_check(name: str, low: int, high: int) -> Any:
    def check(value: Value) -> Value:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise CgroupError(f"{name}: expected an integer in [{low}, {high}], got {value!r}")
        return value

    return check


def _int_render(value: Value, _version: Version, _current: str | None) -> str:
    return str(value)


def _int_parse(text: str, _version: Version) -> Value:
    return int(text.split()[0]) if text.split() else 0


def _bytes(name: str) -> Resource:
    return Resource(name, ("memory", name), name, _bytes_check(name), _bytes_render, _bytes_parse)


def _int(name: str, low: int, high: int) -> Resource:
    return Resource(name, ("memory", name), name, _int_check(name, low, high), _int_render, _int_parse)


#: Upstream v2 files (and Anolis v1 backports): the protection and throttling of a memcg.
MEMORY_MIN: Final = _bytes("memory.min")
MEMORY_LOW: Final = _bytes("memory.low")
MEMORY_HIGH: Final = _bytes("memory.high")
#: Anolis-only files (v1 and v2), written only where the kernel has them.
MEMORY_WMARK_RATIO: Final = _int("memory.wmark_ratio", 0, 100)
MEMORY_WMARK_SCALE_FACTOR: Final = _int("memory.wmark_scale_factor", 1, 1000)
MEMORY_WMARK_MIN_ADJ: Final = _int("memory.wmark_min_adj", -25, 50)
MEMORY_PRIORITY: Final = _int("memory.priority", 0, 12)
MEMORY_USE_PRIORITY_OOM: Final = _int("memory.use_priority_oom", 0, 1)
#: Upstream on v2; Anolis on v1.
MEMORY_OOM_GROUP: Final = _int("memory.oom.group", 0, 1)

EXTRAS: Final = (MEMORY_WMARK_RATIO, MEMORY_WMARK_SCALE_FACTOR, MEMORY_WMARK_MIN_ADJ, MEMORY_PRIORITY,
                 MEMORY_USE_PRIORITY_OOM, MEMORY_OOM_GROUP)


# --- the config ------------------------------------------------------------------


def koordlet_default(qos: QoSClass) -> MemoryQOS:
    """koordlet's ``DefaultMemoryQOS(qos)`` (reference §3), enabled: what ``policy: auto`` uses."""
    if qos in (QoSClass.LSE, QoSClass.LSR, QoSClass.LS):
        return MemoryQOS(enable=True, wmark_ratio=95, wmark_scale_permill=20, wmark_min_adj=-25)
    if qos is QoSClass.BE:
        return MemoryQOS(enable=True, wmark_ratio=95, wmark_scale_permill=20, wmark_min_adj=50)
    return MemoryQOS(enable=True)


def parse_pod_memory_qos(raw: str) -> tuple[str, Mapping[str, Any]]:
    """``koordinator.sh/memoryQOS`` → (policy, the MemoryQOS fields it sets). Raises ValueError
    (``HookConfigError`` is turned into one naming the field and value)."""
    data = load_object(raw)
    policy = data.pop("policy", "default")
    if policy not in POLICIES:
        raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {policy!r}")
    if "enable" in data:
        raise ValueError("enable: not a pod-level field (use policy: auto or none)")
    try:
        parse_memory_qos(data, "memoryQOS", MemoryQOS())
    except HookConfigError as exc:
        raise ValueError(f"{exc.key_path.removeprefix('memoryQOS.')}: {exc.message}, got {exc.value!r}") from None
    return str(policy), data


def pod_config(class_config: MemoryQOS, qos: QoSClass, annotation: str | None) -> tuple[MemoryQOS, str]:
    """The pod's effective memory QoS config and where it came from. ``class_config`` is the
    class's config as ``Rules.for_class`` gives it (disabled = koordlet's None config)."""
    if annotation is None:
        return class_config, "class rule" if class_config.enable else "class rule (disabled)"
    policy, fields = parse_pod_memory_qos(annotation)
    if policy == "none":
        return MemoryQOS(), f"pod annotation {MEMORY_QOS_ANNOTATION} policy none"
    base = koordlet_default(qos) if policy == "auto" else class_config
    merged = parse_memory_qos(fields, "memoryQOS", base) if fields else base
    where = "koordlet class defaults" if policy == "auto" else "class rule"
    what = f"pod annotation {MEMORY_QOS_ANNOTATION} policy {policy} over {where}"
    return merged, what if merged.enable else f"{what} (disabled)"


# --- the values ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MemorySpec:
    """A container's memory request and limit in bytes (limit -1: none) and where they came from."""

    request: int
    limit: int
    source: str = ""


@dataclass(frozen=True, slots=True)
class MemoryValues:
    """What one cgroup gets; ``high`` -1 = max, ``None`` = not written (pods, tiers)."""

    min: int
    low: int
    high: int | None = None
    extras: tuple[tuple[Resource, int], ...] = ()


def extras_of(cfg: MemoryQOS) -> tuple[tuple[Resource, int], ...]:
    """The Anolis knobs a config sets (koordlet writes them per pod and container)."""
    return (
        (MEMORY_WMARK_RATIO, cfg.wmark_ratio),
        (MEMORY_WMARK_SCALE_FACTOR, cfg.wmark_scale_permill),
        (MEMORY_WMARK_MIN_ADJ, cfg.wmark_min_adj),
        (MEMORY_PRIORITY, cfg.priority),
        (MEMORY_USE_PRIORITY_OOM, cfg.priority_enable),
        (MEMORY_OOM_GROUP, cfg.oom_kill_group),
    )


def protection(request: int, cfg: MemoryQOS) -> tuple[int, int]:
    """(memory.min, memory.low) of a request: low is never below min."""
    request = max(request, 0)
    low_min = request * cfg.min_limit_percent // 100
    low = request * cfg.low_limit_percent // 100
    return low_min, max(low, low_min)


def memory_high(spec: MemorySpec, cfg: MemoryQOS, allocatable: int) -> int:
    """floor((req + (limit - req) * throttlingPercent / 100) / PAGE) * PAGE; -1 (max) when
    throttlingPercent is 0; an unlimited container is measured against ``allocatable``."""
    if cfg.throttling_percent == 0:
        return UNLIMITED
    limit = spec.limit if spec.limit > 0 else allocatable
    if limit <= 0:
        return UNLIMITED
    request = min(max(spec.request, 0), limit)
    high = request + (limit - request) * cfg.throttling_percent // 100
    return high // PAGE_SIZE * PAGE_SIZE


def container_values(spec: MemorySpec, cfg: MemoryQOS, allocatable: int) -> MemoryValues:
    low_min, low = protection(spec.request, cfg)
    return MemoryValues(low_min, low, memory_high(spec, cfg, allocatable), extras_of(cfg))


def pod_values(specs: Iterable[MemorySpec], cfg: MemoryQOS) -> MemoryValues:
    low_min, low = protection(sum(max(s.request, 0) for s in specs), cfg)
    return MemoryValues(low_min, low, None, extras_of(cfg))


def disabled_values() -> MemoryValues:
    """koordlet's None config written back where memory QoS was on and is now off."""
    return container_values(MemorySpec(0, UNLIMITED), MemoryQOS(), 0)


@dataclass(frozen=True, slots=True)
class PodProtection:
    """A pod's cgroup, its kube QoS and its (min, low): the input of ``tier_sums``."""

    cgroup: PurePosixPath
    kube: KubeQoS
    min: int
    low: int


def tiers_of(cgroup: PurePosixPath, kube: KubeQoS) -> tuple[PurePosixPath, PurePosixPath | None]:
    """(kubepods root, its burstable/besteffort tier or None for Guaranteed) of a pod cgroup."""
    if kube is KubeQoS.GUARANTEED:
        return cgroup.parent, None
    return cgroup.parent.parent, cgroup.parent


def tier_sums(pods: Iterable[PodProtection]) -> dict[PurePosixPath, tuple[int, int]]:
    """The kube-QoS directories' (min, low): each tier the sum of its pods, the kubepods
    root the sum of every pod below it (koordlet: Guaranteed pods sit in the root)."""
    sums: dict[PurePosixPath, tuple[int, int]] = {}
    for pod in pods:
        root, tier = tiers_of(pod.cgroup, pod.kube)
        for where in (root, tier):
            if where is not None:
                have = sums.get(where, (0, 0))
                sums[where] = (have[0] + pod.min, have[1] + pod.low)
    return sums


def describe(cfg: MemoryQOS) -> str:
    """The config's inputs in koordlet's words, for reasons and explain."""
    fields = {_camel(f.name): getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "enable"}
    return ", ".join(f"{k}={v}" for k, v in fields.items())


def _camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(w.capitalize() for w in rest)
