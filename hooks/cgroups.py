"""Where a pod's or container's cgroup files are, on v1 or v2, cgroupfs or systemd.

Hooks speak in resources ("cpu.shares = 512 on this pod"); the host speaks in
files whose names, places and formats differ between cgroup v1 and v2 and
between kubelet's cgroup drivers. This module owns that translation, as data:

* ``CgroupLayout`` — the injected root, its cgroup version (detected) and driver.
* ``cgroup_dir`` — a pod or container cgroup as a path *relative* to the
  hierarchy, built from the CRI ``cgroup_parent`` and container id. Input is
  untrusted: ``..``, control characters and odd ids are rejected here, and the
  executor additionally confines the resolved path under the root.
* ``Resource`` descriptors — v1 controller/file, v2 file, range check, and the
  value mapping (cpu.shares ↔ cpu.weight, quota ↔ cpu.max, -1 ↔ "max").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final, Literal

from hooks.cpusets import CpuListError, format_cpu_list, parse_cpu_list
from runtimeproxy.chain.validate import MAX_SHARES as MAX_SHARES  # one range for hook writes and patches
from runtimeproxy.chain.validate import MIN_SHARES as MIN_SHARES
from runtimeproxy.hookapi import HookError, TargetGoneError

Version = Literal[1, 2]
Driver = Literal["cgroupfs", "systemd"]
Value = int | str

DEFAULT_CFS_PERIOD: Final = 100_000
PAGE_SIZE: Final = 4096
MEMORY_UNLIMITED_V1: Final = 2**63 - PAGE_SIZE  # what v1 shows for "no limit"
_CONTAINER_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")


class CgroupError(HookError):
    """A cgroup path or value is wrong, or the host refused a write."""


class PathEscapeError(CgroupError):
    """A cgroup parent, id or annotation would lead outside the configured root."""


class CgroupGoneError(CgroupError, TargetGoneError):
    """The cgroup directory does not exist (the pod or container is gone)."""


class NotSupportedError(CgroupError):
    """The cgroup exists but this kernel/hierarchy has no such file."""


class CgroupLayout:
    """A cgroup hierarchy root with its version and driver.

    ``version="auto"`` detects: v2 when ``<root>/cgroup.controllers`` exists
    (unified), else v1 (including hybrid hosts, whose controller-less v2 tree at
    ``<root>/unified`` holds nothing we write)."""

    def __init__(self, root: Path, version: Version | Literal["auto"] = "auto", driver: Driver = "cgroupfs") -> None:
        if driver not in ("cgroupfs", "systemd"):
            raise CgroupError(f"unknown cgroup driver {driver!r} (cgroupfs or systemd)")
        self.root = root
        self.driver: Driver = driver
        self.version: Version = detect_version(root) if version == "auto" else version
        if self.version not in (1, 2):
            raise CgroupError(f"unknown cgroup version {version!r} (1, 2 or auto)")

    def __repr__(self) -> str:
        return f"CgroupLayout({str(self.root)!r}, version={self.version}, driver={self.driver!r})"


def detect_version(root: Path) -> Version:
    if (root / "cgroup.controllers").is_file():
        return 2
    if not root.is_dir():
        raise CgroupError(f"no cgroup hierarchy at {root} (directory missing)")
    if any((root / c).is_dir() for c in ("cpu", "cpu,cpuacct", "memory", "cpuset")):
        return 1
    raise CgroupError(f"no cgroup hierarchy at {root}: neither cgroup.controllers (v2) nor v1 controller dirs")


def _check_components(text: str, what: str) -> list[str]:
    if _CONTROL.search(text):
        raise PathEscapeError(f"{what} {text!r} contains control characters")
    parts = [p for p in text.split("/") if p]
    for part in parts:
        if part in (".", ".."):
            raise PathEscapeError(f"{what} {text!r} contains a {part!r} component")
    return parts


def _expand_slice(name: str, what: str, full: str) -> list[str]:
    """systemd ``a-b-c.slice`` lives at ``a.slice/a-b.slice/a-b-c.slice``."""
    stem = name.removesuffix(".slice")
    if not stem or stem.startswith("-") or stem.endswith("-") or "--" in stem:
        raise PathEscapeError(f"{what} {full!r}: {name!r} is not a valid systemd slice name")
    words = stem.split("-")
    return ["-".join(words[: i + 1]) + ".slice" for i in range(len(words))]


def pod_cgroup_dir(cgroup_parent: str, driver: Driver) -> PurePosixPath:
    """The pod cgroup relative to a hierarchy root, from the CRI cgroup parent.

    cgroupfs: ``/kubepods/burstable/pod<uid>`` → ``kubepods/burstable/pod<uid>``.
    systemd: ``kubepods-burstable-pod<uid_>.slice`` → ``kubepods.slice/kubepods-burstable.slice/...``;
    a parent that already has ``/`` is taken as a path."""
    what = "cgroup_parent"
    parts = _check_components(cgroup_parent, what)
    if not parts:
        raise PathEscapeError(f"{what} {cgroup_parent!r} is empty: refusing to write at the cgroup root")
    if driver == "systemd" and len(parts) == 1 and parts[0].endswith(".slice"):
        parts = _expand_slice(parts[0], what, cgroup_parent)
    return PurePosixPath(*parts)


def container_cgroup_dir(cgroup_parent: str, container_id: str, driver: Driver) -> PurePosixPath:
    """containerd's container cgroup: ``<pod>/<id>`` (cgroupfs) or ``<pod>/cri-containerd-<id>.scope`` (systemd)."""
    if not _CONTAINER_ID.fullmatch(container_id) or ".." in container_id:
        raise PathEscapeError(f"container id {container_id!r} is not a valid container id")
    pod = pod_cgroup_dir(cgroup_parent, driver)
    leaf = f"cri-containerd-{container_id}.scope" if driver == "systemd" else container_id
    return pod / leaf


# --- resources -----------------------------------------------------------------


def _int_value(value: Value, low: int, high: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CgroupError(f"{name}: expected an integer, got {value!r}")
    if not low <= value <= high:
        raise CgroupError(f"{name}: {value} is outside [{low}, {high}]")
    return value


def shares_to_weight(shares: int) -> int:
    """runc/Koordinator: ``1 + ((shares - 2) * 9999) / 262142``, clamped to [1, 10000]."""
    return max(1, min(10_000, 1 + ((shares - 2) * 9999) // 262_142))


def _plain_int(text: str) -> int:
    return int(text.split()[0]) if text.split() else 0


def _max_or_int(text: str) -> int:
    token = text.split()[0] if text.split() else "max"
    return -1 if token == "max" else int(token)


def _cpu_max_period(current: str | None) -> int:
    fields = (current or "").split()
    return int(fields[1]) if len(fields) == 2 and fields[1].isdigit() else DEFAULT_CFS_PERIOD


def _cpu_max_quota(current: str | None) -> str:
    fields = (current or "").split()
    return fields[0] if fields else "max"


@dataclass(frozen=True, slots=True)
class Resource:
    """One logical cgroup knob.

    ``check`` validates a logical value; ``render`` turns it into the file text for
    a version (given the current text, for files holding two values like cpu.max);
    ``parse`` reads a file's text back into a comparable logical value."""

    name: str
    v1: tuple[str, str] | None  # (controller, file)
    v2: str | None
    check: Callable[[Value], Value]
    render: Callable[[Value, Version, str | None], str]
    parse: Callable[[str, Version], Value]

    def file(self, version: Version) -> tuple[str | None, str]:
        """(v1 controller or None, file name); NotSupportedError if the version lacks it."""
        if version == 1 and self.v1 is not None:
            return self.v1
        if version == 2 and self.v2 is not None:
            return None, self.v2
        raise NotSupportedError(f"{self.name} has no cgroup v{version} equivalent")


def _same_int(value: Value, _version: Version, _current: str | None) -> str:
    return str(value)


def _check_shares(value: Value) -> Value:
    return _int_value(value, MIN_SHARES, MAX_SHARES, "cpu.shares")


def _render_shares(value: Value, version: Version, _current: str | None) -> str:
    return str(value) if version == 1 else str(shares_to_weight(int(value)))


def _check_quota(value: Value) -> Value:
    quota = _int_value(value, -1, 2**62, "cpu.cfs_quota_us")
    if 0 <= quota < 1000:
        raise CgroupError(f"cpu.cfs_quota_us: {quota} is below the kernel minimum 1000 (use -1 for no limit)")
    return quota


def _render_quota(value: Value, version: Version, current: str | None) -> str:
    if version == 1:
        return str(value)
    return f"{'max' if value == -1 else value} {_cpu_max_period(current)}"


def _check_period(value: Value) -> Value:
    return _int_value(value, 1000, 1_000_000, "cpu.cfs_period_us")


def _render_period(value: Value, version: Version, current: str | None) -> str:
    return str(value) if version == 1 else f"{_cpu_max_quota(current)} {value}"


def _parse_period(text: str, version: Version) -> Value:
    return _plain_int(text) if version == 1 else _cpu_max_period(text)


def _check_memory(value: Value) -> Value:
    limit = _int_value(value, -1, 2**63 - 1, "memory.limit_in_bytes")
    return -1 if limit in (-1, 0) or limit >= MEMORY_UNLIMITED_V1 else limit - limit % PAGE_SIZE


def _render_memory(value: Value, version: Version, _current: str | None) -> str:
    return ("max" if version == 2 else "-1") if value == -1 else str(value)


def _parse_memory(text: str, _version: Version) -> Value:
    value = _max_or_int(text)
    return -1 if value >= MEMORY_UNLIMITED_V1 else value


def _check_cpu_list(name: str) -> Callable[[Value], Value]:
    def check(value: Value) -> Value:
        if not isinstance(value, str):
            raise CgroupError(f"{name}: expected a CPU list string, got {value!r}")
        try:
            return format_cpu_list(parse_cpu_list(value))
        except CpuListError as exc:
            raise CgroupError(f"{name}: {exc}") from exc

    return check


def _render_text(value: Value, _version: Version, _current: str | None) -> str:
    return str(value)


def _parse_cpu_list(text: str, _version: Version) -> Value:
    try:
        return format_cpu_list(parse_cpu_list(text))
    except CpuListError:
        return text.strip()


def _ranged(name: str, low: int, high: int) -> Callable[[Value], Value]:
    return lambda value: _int_value(value, low, high, name)


def _parse_int(text: str, _version: Version) -> Value:
    return _plain_int(text)


def _parse_quota(text: str, version: Version) -> Value:
    return _plain_int(text) if version == 1 else _max_or_int(text)


def _parse_shares(text: str, version: Version) -> Value:
    return _plain_int(text)  # v1 shares or v2 weight: compared against the rendered value


CPU_SHARES: Final = Resource("cpu.shares", ("cpu", "cpu.shares"), "cpu.weight", _check_shares, _render_shares,
                             _parse_shares)
CPU_CFS_QUOTA: Final = Resource("cpu.cfs_quota_us", ("cpu", "cpu.cfs_quota_us"), "cpu.max", _check_quota,
                                _render_quota, _parse_quota)
CPU_CFS_PERIOD: Final = Resource("cpu.cfs_period_us", ("cpu", "cpu.cfs_period_us"), "cpu.max", _check_period,
                                 _render_period, _parse_period)
MEMORY_LIMIT: Final = Resource("memory.limit_in_bytes", ("memory", "memory.limit_in_bytes"), "memory.max",
                               _check_memory, _render_memory, _parse_memory)
CPUSET_CPUS: Final = Resource("cpuset.cpus", ("cpuset", "cpuset.cpus"), "cpuset.cpus", _check_cpu_list("cpuset.cpus"),
                              _render_text, _parse_cpu_list)
CPUSET_MEMS: Final = Resource("cpuset.mems", ("cpuset", "cpuset.mems"), "cpuset.mems", _check_cpu_list("cpuset.mems"),
                              _render_text, _parse_cpu_list)
CPU_BVT_WARP_NS: Final = Resource("cpu.bvt_warp_ns", ("cpu", "cpu.bvt_warp_ns"), "cpu.bvt_warp_ns",
                                  _ranged("cpu.bvt_warp_ns", -1, 2), _same_int, _parse_int)
CPU_IDLE: Final = Resource("cpu.idle", ("cpu", "cpu.idle"), "cpu.idle", _ranged("cpu.idle", 0, 1), _same_int,
                           _parse_int)

RESOURCES: Final = {r.name: r for r in (CPU_SHARES, CPU_CFS_QUOTA, CPU_CFS_PERIOD, MEMORY_LIMIT, CPUSET_CPUS,
                                        CPUSET_MEMS, CPU_BVT_WARP_NS, CPU_IDLE)}


def comparable(resource: Resource, value: Value, version: Version) -> Value:
    """The logical value as ``parse`` would read it back after writing ``value``."""
    if resource is CPU_SHARES and version == 2:
        return shares_to_weight(int(value))
    return value
