"""Block devices and the per-device blkio / io cgroup files, for the ``blkio`` hook.

* ``resolve_device`` turns a NodeSLO block name (``/dev/vdb``, ``vdb``,
  ``/dev/mapper/<name>`` or ``<major>:<minor>``) into ``major:minor`` through the
  injected ``/sys`` root (``class/block/<name>/dev``, ``dev/block/<maj:min>``,
  ``class/block/dm-*/dm/name``); a name that is not a block device of this node is a
  ``DeviceError`` naming it. Input is untrusted: no ``..``, no other slashes.
* Per-device files hold one line per device (``8:0 1048576``); writing a line changes
  only that device's entry, so each device's entry is its own ``Resource`` whose
  ``parse`` reads that device's value back (for the executor's compare-then-write).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Final

from hooks.cgroups import CgroupError, Resource, Value, Version
from runtimeproxy.errors import InputError

_DEVNO: Final = re.compile(r"(\d{1,10}):(\d{1,10})")
_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
THROTTLES: Final = ("read_bps", "write_bps", "read_iops", "write_iops")
#: v2 io.max keys of the four throttles, in koordlet's ioCfg order.
IO_MAX_KEYS: Final = {"read_bps": "rbps", "write_bps": "wbps", "read_iops": "riops", "write_iops": "wiops"}


class DeviceError(InputError, ValueError):
    """A block name that is not a block device of this node."""


def resolve_device(name: str, sys_root: Path) -> str:
    """``major:minor`` of a block device named as in NodeSLO ``blkioQOS.blocks[].name``."""
    devno = _DEVNO.fullmatch(name)
    if devno is not None:
        if not (sys_root / "dev" / "block" / name).exists():
            raise DeviceError(f"no block device {name} on this node ({sys_root}/dev/block/{name} missing)")
        return name
    short = name.removeprefix("/dev/")
    if short.startswith("mapper/"):
        return _mapper(short.removeprefix("mapper/"), name, sys_root)
    if not _NAME.fullmatch(short):
        raise DeviceError(f"{name!r} is not a block device name (/dev/<name>, <name>, /dev/mapper/<name> "
                          "or <major>:<minor>)")
    dev = sys_root / "class" / "block" / short / "dev"
    try:
        text = dev.read_text().strip()
    except OSError:
        raise DeviceError(f"no block device {name!r} on this node ({dev} missing)") from None
    if _DEVNO.fullmatch(text) is None:
        raise DeviceError(f"block device {name!r}: {dev} holds {text!r}, not <major>:<minor>")
    return text


def _mapper(mapped: str, name: str, sys_root: Path) -> str:
    if not _NAME.fullmatch(mapped):
        raise DeviceError(f"{name!r} is not a device-mapper name")
    block = sys_root / "class" / "block"
    for dm in sorted(block.glob("dm-*")):
        try:
            if (dm / "dm" / "name").read_text().strip() == mapped:
                return resolve_device(dm.name, sys_root)
        except OSError:
            continue
    raise DeviceError(f"no device-mapper device {name!r} on this node (no {block}/dm-*/dm/name says {mapped!r})")


# --- per-device files ----------------------------------------------------------------


def _lines(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, _, rest = line.strip().partition(" ")
        if key:
            out[key] = rest.strip()
    return out


def _count(name: str) -> Callable[[Value], Value]:
    def check(value: Value) -> Value:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
            raise CgroupError(f"{name}: expected an integer >= 0 (0: no limit), got {value!r}")
        return value

    return check


def throttle(kind: str, dev: str) -> Resource:
    """v1 ``blkio.throttle.<kind>_device``: ``<dev> <value>``; 0 removes the device's limit."""
    file = f"blkio.throttle.{kind}_device"

    def render(value: Value, _version: Version, _current: str | None) -> str:
        return f"{dev} {value}"

    def parse(text: str, _version: Version) -> Value:
        raw = _lines(text).get(dev, "0")
        return int(raw) if raw.isdigit() else raw

    return Resource(f"{file}[{dev}]", ("blkio", file), None, _count(file), render, parse)


def io_max(dev: str) -> Resource:
    """v2 ``io.max``: ``<dev> rbps=.. wbps=.. riops=.. wiops=..`` (``max``: no limit). The
    logical value is that text after the device, all four keys, in that order."""

    def check(value: Value) -> Value:
        if not isinstance(value, str):
            raise CgroupError(f"io.max: expected 'rbps=.. wbps=.. riops=.. wiops=..', got {value!r}")
        return _normal(value)

    def render(value: Value, _version: Version, _current: str | None) -> str:
        return f"{dev} {value}"

    def parse(text: str, _version: Version) -> Value:
        return _normal(_lines(text).get(dev, ""))

    return Resource(f"io.max[{dev}]", None, "io.max", check, render, parse)


def io_max_value(limits: dict[str, int]) -> str:
    """The io.max text of four throttles (0 = max)."""
    return " ".join(f"{IO_MAX_KEYS[k]}={limits.get(k, 0) or 'max'}" for k in THROTTLES)


def _normal(text: str) -> str:
    fields = dict(item.partition("=")[::2] for item in text.split() if "=" in item)
    return " ".join(f"{key}={fields.get(key, 'max')}" for key in IO_MAX_KEYS.values())


def weight(file: str, controller: str | None, dev: str, low: int, high: int) -> Resource:
    """A per-device weight: v1 ``blkio.cost.weight`` (Anolis iocost) or
    ``blkio.bfq.weight_device``, v2 ``io.weight``: ``<dev> <weight>``."""

    def check(value: Value) -> Value:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise CgroupError(f"{file}: expected a weight in [{low}, {high}], got {value!r}")
        return value

    def render(value: Value, _version: Version, _current: str | None) -> str:
        return f"{dev} {value}"

    def parse(text: str, _version: Version) -> Value:
        raw = _lines(text).get(dev, "")
        return int(raw) if raw.isdigit() else -1

    v1 = (controller, file) if controller is not None else None
    return Resource(f"{file}[{dev}]", v1, file if controller is None else None, check, render, parse)


#: Weight files by cgroup version, in preference order: (file, v1 controller, range).
WEIGHT_FILES: Final[dict[int, tuple[tuple[str, str | None, int, int], ...]]] = {
    1: (("blkio.cost.weight", "blkio", 1, 100), ("blkio.bfq.weight_device", "blkio", 1, 1000)),
    2: (("io.weight", None, 1, 10000),),
}
