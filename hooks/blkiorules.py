"""``resourceQOSStrategy.<class>.blkioQOS``: NodeSLO's block I/O config, parsed strictly.

Shape (Koordinator ``BlkIOQOS``, CRD ``slo.koordinator.sh_nodeslos``)::

    blkioQOS:
      enable: true
      blocks:
        - name: /dev/vdb          # device: a block device (/dev/<name>, <name> or <major>:<minor>)
          type: device            # device | volumegroup | podvolume
          ioCfg: {readIOPS: 0, writeIOPS: 0, readBPS: 0, writeBPS: 0, ioWeightPercent: 100,
                  readLatency: .., writeLatency: .., readLatencyPercent: .., writeLatencyPercent: ..,
                  enableUserModel: .., modelReadBPS: .., ...}

Throttles of 0 mean "no limit" (Koordinator: "0 indicates that the feature is
disabled"). The latency and cost-model fields belong to the root class's blk-iocost
(``blkio.cost.qos`` / ``cost.model``), which this agent does not write: they are
checked and kept, not applied. A bad value is a ``HookConfigError`` naming
``rules.<path>`` and the value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from runtimeproxy.config.configvalues import boolean, choice, reject_unknown
from runtimeproxy.hookapi import HookConfigError

BLOCK_TYPES: Final = ("device", "volumegroup", "podvolume")
_MAX: Final = 2**63 - 1
#: ioCfg keys: (attribute, low, high); None high = no upper bound below 2^63.
_IO_INTS: Final[Mapping[str, tuple[str, int, int]]] = {
    "readIOPS": ("read_iops", 0, _MAX),
    "writeIOPS": ("write_iops", 0, _MAX),
    "readBPS": ("read_bps", 0, _MAX),
    "writeBPS": ("write_bps", 0, _MAX),
    "ioWeightPercent": ("io_weight_percent", 1, 100),
    "readLatency": ("read_latency", 0, _MAX),
    "writeLatency": ("write_latency", 0, _MAX),
    "readLatencyPercent": ("read_latency_percent", 0, 100),
    "writeLatencyPercent": ("write_latency_percent", 0, 100),
    "modelReadBPS": ("model_read_bps", 1, _MAX),
    "modelWriteBPS": ("model_write_bps", 1, _MAX),
    "modelReadSeqIOPS": ("model_read_seq_iops", 1, _MAX),
    "modelWriteSeqIOPS": ("model_write_seq_iops", 1, _MAX),
    "modelReadRandIOPS": ("model_read_rand_iops", 1, _MAX),
    "modelWriteRandIOPS": ("model_write_rand_iops", 1, _MAX),
}


@dataclass(frozen=True, slots=True)
class IOCfg:
    read_iops: int = 0
    write_iops: int = 0
    read_bps: int = 0
    write_bps: int = 0
    #: None: not set (no weight written); 1..100.
    io_weight_percent: int | None = None
    read_latency: int | None = None
    write_latency: int | None = None
    read_latency_percent: int | None = None
    write_latency_percent: int | None = None
    enable_user_model: bool = False
    model_read_bps: int | None = None
    model_write_bps: int | None = None
    model_read_seq_iops: int | None = None
    model_write_seq_iops: int | None = None
    model_read_rand_iops: int | None = None
    model_write_rand_iops: int | None = None


@dataclass(frozen=True, slots=True)
class BlkioBlock:
    name: str
    type: str
    io: IOCfg = IOCfg()


@dataclass(frozen=True, slots=True)
class BlkioQOS:
    enable: bool = False
    blocks: tuple[BlkioBlock, ...] = ()


def _io(raw: object, path: str) -> IOCfg:
    if raw is None:
        return IOCfg()
    if not isinstance(raw, Mapping):
        raise HookConfigError(path, raw, "expected a mapping")
    reject_unknown(raw, {"enableUserModel", *_IO_INTS}, f"{path}.")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        where = f"{path}.{key}"
        if key == "enableUserModel":
            values["enable_user_model"] = boolean(value, where)
            continue
        attr, low, high = _IO_INTS[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise HookConfigError(where, value, f"expected an integer in [{low}, {high}]")
        if not low <= value <= high:
            raise HookConfigError(where, value, f"must be in [{low}, {high}]")
        values[attr] = value
    return IOCfg(**values)


def _block(raw: object, path: str) -> BlkioBlock:
    if not isinstance(raw, Mapping):
        raise HookConfigError(path, raw, "expected a mapping with name, type and ioCfg")
    reject_unknown(raw, {"name", "type", "ioCfg"}, f"{path}.")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise HookConfigError(f"{path}.name", name, "expected a non-empty string")
    kind = choice(*BLOCK_TYPES)(raw.get("type", "device"), f"{path}.type")
    return BlkioBlock(name.strip(), kind, _io(raw.get("ioCfg"), f"{path}.ioCfg"))


def parse_blkio_qos(raw: object, path: str, current: BlkioQOS) -> BlkioQOS:
    """A ``blkioQOS`` mapping merged over ``current``: ``enable`` replaces, ``blocks`` (a
    list) replaces the whole list, as a NodeSLO merge does."""
    if raw is None:
        return current
    if not isinstance(raw, Mapping):
        raise HookConfigError(path, raw, "expected a mapping")
    reject_unknown(raw, {"enable", "blocks"}, f"{path}.")
    enable, blocks = current.enable, current.blocks
    for key, value in raw.items():
        if key == "enable":
            enable = boolean(value, f"{path}.enable")
        elif key == "blocks":
            if value is None:
                blocks = ()
                continue
            if not isinstance(value, list):
                raise HookConfigError(f"{path}.blocks", value, "expected a list")
            blocks = tuple(_block(item, f"{path}.blocks[{i}]") for i, item in enumerate(value))
    return BlkioQOS(enable, blocks)
