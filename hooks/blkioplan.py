"""What the ``blkio`` hook and the ``blkio`` QoS strategy (``metrics.qos.blkio``) share:
support detection, and the updates of one ``blkioQOS`` block on one cgroup (or their
removal). Its own module so the strategy need not import the hook plugin (import-linter:
metrics use hooks' shared modules, never a concrete hook)."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final

import structlog

from hooks.blkiodev import THROTTLES, WEIGHT_FILES, io_max, io_max_value, resolve_device, throttle, weight
from hooks.blkiorules import BlkioBlock
from hooks.cgroups import CgroupGoneError
from hooks.executor import CgroupExecutor, Update
from hooks.qos import QoSClass

_CLASS_KEY: Final = {QoSClass.LSE: "lsrClass", QoSClass.LSR: "lsrClass", QoSClass.LS: "lsClass",
                     QoSClass.BE: "beClass", QoSClass.SYSTEM: "systemClass"}
#: Class -> its kube-QoS tier (cgroupfs, systemd name): the ``blkio`` QoS strategy's targets.
TIERS: Final = {QoSClass.BE: ("besteffort", "kubepods-besteffort.slice"),
                QoSClass.LS: ("burstable", "kubepods-burstable.slice")}
log = structlog.get_logger("hooks.blkioplan")

_CFG_KEYS: Final = {"read_bps": "readBPS", "write_bps": "writeBPS", "read_iops": "readIOPS", "write_iops": "writeIOPS"}


class SaidOnce:
    """Causes warned about already (a block's problem is said once, not at every pass)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said: set[str] = set()

    def __call__(self, key: str) -> bool:
        """True the first time ``key`` comes."""
        with self._lock:
            if key in self._said:
                return False
            self._said.add(key)
            return True


def device_block(block: BlkioBlock, where: str, once: SaidOnce) -> bool:
    """Only ``type: device`` blocks are acted on; any other type is skipped, said once."""
    if block.type == "device":
        return True
    if once(f"type:{block.type}:{block.name}"):
        log.warning("blkio_block_unsupported", block=where, name=block.name, type=block.type,
                    reason="volumegroup / podvolume need koordlet's local storage inventory; skipped")
    return False


@dataclass(frozen=True, slots=True)
class Support:
    throttle: bool
    weight: tuple[str, str | None, int, int] | None
    where: str
    version: int

    def describe(self) -> str:
        if not self.throttle:
            return f"block I/O QoS off: no {'io.max' if self.version == 2 else 'blkio throttle files'} in {self.where}"
        weights = self.weight[0] if self.weight else "none (ioWeightPercent ignored)"
        return f"cgroup v{self.version} throttles in {self.where}; weight file: {weights}"


def detect_support(executor: CgroupExecutor, probe: PurePosixPath, source: str) -> Support:
    """The throttle and weight files in ``probe`` (a cgroup dir that must exist)."""
    version = executor.layout.version
    file = (throttle("read_bps", "0:0") if version == 1 else io_max("0:0"))
    path = executor.path(probe, file, source)
    if not path.parent.is_dir():
        raise CgroupGoneError(f"{source}: cgroup {path.parent} does not exist (gone or not created yet)")
    chosen = None
    for candidate in WEIGHT_FILES[version]:
        if executor.path(probe, weight(*candidate[:2], "0:0", *candidate[2:]), source).is_file():
            chosen = candidate
            break
    return Support(path.is_file(), chosen, str(path.parent), version)


def block_field(qos: QoSClass, index: int) -> str:
    return f"resourceQOSStrategy.{_CLASS_KEY[qos]}.blkioQOS.blocks[{index}]"


def block_updates(index: int, block: BlkioBlock, qos: QoSClass, target: PurePosixPath, source: str,
                  support: Support, sys_root: Path) -> tuple[str, list[Update]]:
    """(major:minor, the updates) of one ``type: device`` block on ``target``; a name that is
    not a device of this node raises ``DeviceError``."""
    where = block_field(qos, index)
    dev = resolve_device(block.name, sys_root)
    io = block.io
    why = f"{qos.value} class {where} {block.name} ({dev})"
    limits = {k: getattr(io, k) for k in THROTTLES}
    shown = ", ".join(f"{_CFG_KEYS[k]} {v}" for k, v in limits.items())
    updates: list[Update] = []
    if support.version == 1:
        updates.extend(Update(target, throttle(k, dev), v, f"{why}: {_CFG_KEYS[k]} {v} (0: no limit)", source)
                       for k, v in limits.items())
    else:
        updates.append(Update(target, io_max(dev), io_max_value(limits), f"{why}: {shown} (0: max)", source))
    if io.io_weight_percent is not None and support.weight is not None:
        file, controller, low, high = support.weight
        updates.append(Update(target, weight(file, controller, dev, low, high), io.io_weight_percent,
                              f"{why}: ioWeightPercent {io.io_weight_percent}", source))
    return dev, updates


def removal_updates(target: PurePosixPath, devices: Iterable[str], why: str, source: str,
                    support: Support) -> list[Update]:
    """The limits of ``devices`` removed on ``target`` (0 / max)."""
    updates: list[Update] = []
    for dev in sorted(devices):
        if support.version == 1:
            updates.extend(Update(target, throttle(k, dev), 0, why, source) for k in THROTTLES)
        else:
            updates.append(Update(target, io_max(dev), io_max_value({}), why, source))
    return updates
