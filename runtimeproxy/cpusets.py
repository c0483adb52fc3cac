"""Linux CPU lists ("0-3,8,10-11"): parse, format, and check against the node.

Cpusets arrive from annotations written by a scheduler on another machine, so a
list can name CPUs this node does not have. Writing such a list to
``cpuset.cpus`` fails with a bare EINVAL deep in a hook; checking it here first
turns that into an error that says which CPUs are wrong and what the node has.
The parser is strict (no empty pieces, no reversed ranges, no strides) and
bounded, so a hostile "0-999999999" cannot make us build a huge set.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from runtimeproxy.errors import InputError

MAX_CPU_ID: Final = 8191  # the kernel's largest NR_CPUS
ONLINE_FILE: Final = Path("devices/system/cpu/online")
NODE_ONLINE_FILE: Final = Path("devices/system/node/online")
_NUMBER: Final = re.compile(r"[0-9]+")


class CpuListError(InputError, ValueError):
    """A CPU list is malformed or names CPUs the node does not have."""


def _cpu_id(text: str, cpu_list: str) -> int:
    if not _NUMBER.fullmatch(text):
        raise CpuListError(f"invalid CPU list {cpu_list!r}: {text!r} is not a CPU number")
    value = int(text)
    if value > MAX_CPU_ID:
        raise CpuListError(f"invalid CPU list {cpu_list!r}: CPU {value} is beyond the kernel limit {MAX_CPU_ID}")
    return value


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-3,8"`` → ``{0, 1, 2, 3, 8}``. Surrounding whitespace (a file's trailing
    newline) is ignored; an empty list is the empty set."""
    stripped = text.strip()
    if not stripped:
        return frozenset()
    cpus: set[int] = set()
    for piece in stripped.split(","):
        if not piece:
            raise CpuListError(f"invalid CPU list {text!r}: empty element")
        first, sep, last = piece.partition("-")
        start = _cpu_id(first, text)
        end = _cpu_id(last, text) if sep else start
        if end < start:
            raise CpuListError(f"invalid CPU list {text!r}: range {piece!r} is reversed")
        cpus.update(range(start, end + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """``{0, 1, 2, 3, 8, 10, 11}`` → ``"0-3,8,10-11"`` (the kernel's own format)."""
    ordered = sorted(set(cpus))
    pieces: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        pieces.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(pieces)


def read_online_cpus(sys_root: Path) -> frozenset[int]:
    """The node's online CPUs, from ``<sys_root>/devices/system/cpu/online``."""
    return _read_online(sys_root / ONLINE_FILE, "CPUs")


def read_online_mems(sys_root: Path) -> frozenset[int]:
    """The node's online NUMA nodes (``cpuset.mems`` ids), from
    ``<sys_root>/devices/system/node/online``; a kernel without NUMA has no such
    directory and one memory node, 0."""
    path = sys_root / NODE_ONLINE_FILE
    if not path.parent.exists():
        return frozenset({0})
    return _read_online(path, "memory nodes")


def _read_online(path: Path, what: str) -> frozenset[int]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise CpuListError(f"cannot read the node's online {what} from {path}: {exc.strerror or exc}") from exc
    ids = parse_cpu_list(text)
    if not ids:
        raise CpuListError(f"{path} lists no online {what}")
    return ids


def check_on_node(cpus: frozenset[int], online: frozenset[int], cpu_list: str) -> frozenset[int]:
    """Return ``cpus`` if every CPU is online, else raise naming the offending ones."""
    missing = cpus - online
    if missing:
        raise CpuListError(
            f"CPU list {cpu_list!r} names CPUs {format_cpu_list(missing)} that are not online "
            f"on this node (online: {format_cpu_list(online)})"
        )
    return cpus


def parse_node_cpu_list(text: str, online: frozenset[int]) -> frozenset[int]:
    """Parse and check against the node in one step."""
    return check_on_node(parse_cpu_list(text), online, text)
