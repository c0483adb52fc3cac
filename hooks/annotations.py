"""Koordinator pod annotations the isolation hooks read, parsed strictly.

The scheduler and koord-manager write these annotations; the proxy trusts
nothing in them. Each parser returns a frozen value or raises ``HookError``
naming the pod, the annotation key and the offending value, so that a bad
annotation fails one hook call with a message an operator can act on, instead
of a crash or a half-applied cgroup change.

Quantities follow Koordinator: a batch resource's *value* is what counts, i.e.
``kubernetes.io/batch-cpu: 1000`` (or ``"1000"``, ``"1k"``) is 1000 milli-cores
and ``kubernetes.io/batch-memory: "1Gi"`` is 2**30 bytes. Like Kubernetes'
``Quantity.Value()``, fractional values round up (``"500m"`` → 1).
"""

from __future__ import annotations

import functools
import json
import math
import re
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Final, TypeVar

from hooks.cpusets import CpuListError, parse_cpu_list
from hooks.qos import pod_name
from runtimeproxy.errors import InputError
from runtimeproxy.hookapi import HookError, PodInfo

T = TypeVar("T")

RESOURCE_STATUS: Final = "scheduling.koordinator.sh/resource-status"
EXTENDED_RESOURCE_SPEC: Final = "node.koordinator.sh/extended-resource-spec"
BATCH_CPU: Final = "kubernetes.io/batch-cpu"
BATCH_MEMORY: Final = "kubernetes.io/batch-memory"
MID_CPU: Final = "kubernetes.io/mid-cpu"
MID_MEMORY: Final = "kubernetes.io/mid-memory"

_SHOWN: Final = 200  # longest annotation value quoted in an error
_QUANTITY: Final = re.compile(r"(?P<num>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(?P<suffix>[a-zA-Z]*|[eE][+-]?[0-9]+)")
_BINARY: Final = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL: Final = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}


class AnnotationError(InputError, ValueError):
    """A value inside an annotation is wrong; ``where`` is its JSON path."""


def parse_quantity(raw: object, where: str = "quantity") -> int:
    """A Kubernetes quantity (JSON int, float or string like "500m", "1Gi", "2e3")
    → its integer value, rounded up. Negative values, booleans and other types raise."""
    return math.ceil(quantity_value(raw, where))


def quantity_value(raw: object, where: str = "quantity") -> Fraction:
    """A Kubernetes quantity's exact value ("500m" is 1/2); raises as ``parse_quantity``."""
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise AnnotationError(f"{where}: expected a quantity (number or string), got {type(raw).__name__} {raw!r}")
    if isinstance(raw, float) and not math.isfinite(raw):
        raise AnnotationError(f"{where}: quantity {raw!r} is not finite")
    text = str(raw).strip() if not isinstance(raw, str) else raw
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise AnnotationError(f"{where}: {raw!r} is not a Kubernetes quantity")
    suffix = match["suffix"]
    if suffix in _BINARY:
        scale = Fraction(_BINARY[suffix])
    elif suffix in _DECIMAL:
        scale = _DECIMAL[suffix]
    elif suffix[:1] in ("e", "E") and len(suffix) > 1:
        exponent = int(suffix[1:])
        if abs(exponent) > 30:
            raise AnnotationError(f"{where}: quantity {raw!r} is out of range")
        scale = Fraction(10) ** exponent
    else:
        raise AnnotationError(f"{where}: {raw!r} has an unknown unit suffix {suffix!r}")
    value = Fraction(match["num"]) * scale
    if value < 0:
        raise AnnotationError(f"{where}: quantity {raw!r} is negative")
    if value > 2**63 - 1:
        raise AnnotationError(f"{where}: quantity {raw!r} is out of range")
    return value


def _shown(value: str) -> str:
    return repr(value if len(value) <= _SHOWN else value[:_SHOWN] + "...")


def _fail(pod: PodInfo, key: str, raw: str, reason: str) -> HookError:
    # The reason quotes parsed values (a cpuset, a quantity): cut it too, so one huge
    # annotation cannot make a huge log line.
    reason = reason if len(reason) <= _SHOWN else reason[:_SHOWN] + "..."
    return HookError(f"pod {pod_name(pod)}: annotation {key}={_shown(raw)}: {reason}")


def load_object(raw: str) -> dict[str, object]:
    """An annotation value that must be a JSON object. Raises AnnotationError."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise AnnotationError(f"invalid JSON: {exc}") from exc
    except RecursionError:  # "[[[[...": json's decoder recurses per level
        raise AnnotationError("invalid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise AnnotationError(f"expected a JSON object, got {type(data).__name__}")
    return data


def _resource_list(raw: object, where: str) -> Mapping[str, int]:
    if raw is None:
        return types.MappingProxyType({})
    if not isinstance(raw, dict):
        raise AnnotationError(f"{where}: expected an object of quantities, got {type(raw).__name__}")
    return types.MappingProxyType({str(k): parse_quantity(v, f"{where}.{k}") for k, v in raw.items()})


@dataclass(frozen=True, slots=True)
class NumaNodeResource:
    node: int
    resources: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class ResourceStatus:
    """``scheduling.koordinator.sh/resource-status``: the scheduler's CPU binding."""

    cpuset: str = ""
    cpus: frozenset[int] = frozenset()
    numa_node_resources: tuple[NumaNodeResource, ...] = ()


def parse_resource_status(raw: str) -> ResourceStatus:
    """Parse the annotation value (syntax only; check CPUs against the node with
    ``hooks.cpusets.check_on_node``). Raises AnnotationError."""
    data = load_object(raw)
    cpuset = data.get("cpuset", "")
    if not isinstance(cpuset, str):
        raise AnnotationError(f"cpuset: expected a string like \"2-3\", got {type(cpuset).__name__} {cpuset!r}")
    try:
        cpus = parse_cpu_list(cpuset)
    except CpuListError as exc:
        raise AnnotationError(f"cpuset: {exc}") from exc
    numa_raw = data.get("numaNodeResources")
    numa_raw = [] if numa_raw is None else numa_raw
    if not isinstance(numa_raw, list):
        raise AnnotationError(f"numaNodeResources: expected a list, got {type(numa_raw).__name__}")
    numa: list[NumaNodeResource] = []
    for i, item in enumerate(numa_raw):
        where = f"numaNodeResources[{i}]"
        if not isinstance(item, dict):
            raise AnnotationError(f"{where}: expected an object, got {type(item).__name__}")
        node = item.get("node", 0)
        if isinstance(node, bool) or not isinstance(node, int) or node < 0:
            raise AnnotationError(f"{where}.node: expected a NUMA node number, got {node!r}")
        numa.append(NumaNodeResource(node, _resource_list(item.get("resources"), f"{where}.resources")))
    return ResourceStatus(cpuset=cpuset.strip(), cpus=cpus, numa_node_resources=tuple(numa))


def resource_status(pod: PodInfo) -> ResourceStatus | None:
    """The pod's resource status, ``None`` without the annotation; HookError when bad."""
    return _parsed(pod, RESOURCE_STATUS, parse_resource_status)


#: Longest annotation value whose parse is cached (a batch spec is ~200 bytes; a cached
#: value is kept until 256 others push it out, so this bounds the cache to ~1 MiB).
_CACHED_MAX: Final = 4096


@functools.lru_cache(maxsize=256)
def _parse_cached(parse: Callable[[str], T], raw: str) -> T:
    """Parsed values are immutable (frozen dataclasses, read-only mappings), so one parse
    serves every hook and stage of a pod: the batch spec was parsed 2-3 times per pod
    start, ~60 µs each (quantities are exact fractions). Errors are not cached."""
    return parse(raw)


def _parsed(pod: PodInfo, key: str, parse: Callable[[str], T]) -> T | None:
    """``parse`` of the pod's annotation ``key``; None when absent; a HookError naming
    the pod, the key and the value when it does not parse."""
    raw = pod.annotations.get(key)
    if raw is None:
        return None
    try:
        return _parse_cached(parse, raw) if len(raw) <= _CACHED_MAX else parse(raw)
    except AnnotationError as exc:
        raise _fail(pod, key, raw, str(exc)) from exc


@dataclass(frozen=True, slots=True)
class ContainerResources:
    """One container's extended requests and limits (resource name → value)."""

    requests: Mapping[str, int]
    limits: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class ExtendedResourceSpec:
    """``node.koordinator.sh/extended-resource-spec``: container name → resources."""

    containers: Mapping[str, ContainerResources]

    def total(self, kind: str, resource: str) -> int | None:
        """Sum of ``kind`` ("requests"/"limits") of ``resource`` over all containers;
        ``None`` if some container lacks it (unbounded, as Koordinator treats limits)."""
        total = 0
        for res in self.containers.values():
            values: Mapping[str, int] = getattr(res, kind)
            if resource not in values:
                return None
            total += values[resource]
        return total


def parse_extended_resource_spec(raw: str) -> ExtendedResourceSpec:
    """Parse the annotation value. Raises AnnotationError."""
    data = load_object(raw)
    containers = data.get("containers", {})
    if not isinstance(containers, dict):
        kind = type(containers).__name__
        raise AnnotationError(f"containers: expected an object keyed by container name, got {kind}")
    parsed: dict[str, ContainerResources] = {}
    for name, spec in containers.items():
        where = f"containers.{name}"
        if not isinstance(spec, dict):
            raise AnnotationError(f"{where}: expected an object with requests/limits, got {type(spec).__name__}")
        unknown = set(spec) - {"requests", "limits"}
        if unknown:
            raise AnnotationError(f"{where}: unknown key {sorted(unknown)[0]!r}")
        parsed[name] = ContainerResources(
            requests=_resource_list(spec.get("requests"), f"{where}.requests"),
            limits=_resource_list(spec.get("limits"), f"{where}.limits"),
        )
    return ExtendedResourceSpec(types.MappingProxyType(parsed))


def extended_resource_spec(pod: PodInfo) -> ExtendedResourceSpec | None:
    """The pod's extended resource spec, ``None`` without the annotation; HookError when bad."""
    return _parsed(pod, EXTENDED_RESOURCE_SPEC, parse_extended_resource_spec)
