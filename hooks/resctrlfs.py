"""resctrl (Intel RDT / AMD QoS): LLC ways and memory bandwidth per group.

The resctrl hooks turn NodeSLO percentages (``catRangeStartPercent`` …
``catRangeEndPercent``, ``mbaPercent``) into a ``schemata`` file. The masks
depend on the machine (``info/L3/cbm_mask``, ``min_cbm_bits``, the cache ids
in the root ``schemata``), and the kernel rejects a non-contiguous or too small
mask with a bare EINVAL, so masks are built and validated here, against the
host's own ``info/``. Everything happens under an injected root, confined like
cgroup writes, and reported as ``Write`` records. Like the cgroup executor, every
change (a file written, a group made or removed) first checks the calling hook's
deadline (``runtimeproxy.hostwrites.check_deadline``): a hook past it changes nothing.

Many hosts (VMs, AMD without QoS, this CI machine) have no resctrl. That is
not an error for the proxy: ``present`` says so, and every operation raises
``ResctrlNotSupported`` — a specific error a hook can catch and report once.
"""

from __future__ import annotations

import errno
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Final

from hooks.executor import Confinement, Write
from runtimeproxy.hookapi import HookError
from runtimeproxy.hostwrites import check_deadline

_GROUP: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_RESERVED: Final = frozenset({"info", "mon_groups", "mon_data"})


class ResctrlError(HookError):
    """A resctrl value, group name or write is wrong."""


class ResctrlNotSupported(ResctrlError):
    """The host has no resctrl (or no L3 CAT) under the configured root."""


Schemata = Mapping[str, Mapping[int, str]]  # resource ("L3", "MB") → cache id → value


def _entries(line: str, where: str) -> tuple[str, dict[int, str]]:
    resource, sep, rest = line.strip().partition(":")
    if not sep or not resource:
        raise ResctrlError(f"{where}: line {line!r} is not '<resource>:<id>=<value>;...'")
    entries: dict[int, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(";"))):
        cache_id, eq, value = item.partition("=")
        if not eq or not cache_id.strip().isdigit() or not value.strip():
            raise ResctrlError(f"{where}: {item!r} in line {line!r} is not '<cache id>=<value>'")
        entries[int(cache_id)] = value.strip()
    return resource.strip(), entries


def parse_schemata(text: str, where: str = "schemata") -> dict[str, dict[int, str]]:
    """``"L3:0=ff;1=ff\\nMB:0=100"`` → ``{"L3": {0: "ff", 1: "ff"}, "MB": {0: "100"}}``."""
    result: dict[str, dict[int, str]] = {}
    for line in text.splitlines():
        if line.strip():
            resource, entries = _entries(line, where)
            result.setdefault(resource, {}).update(entries)
    return result


def format_schemata(schemata: Schemata) -> str:
    return "".join(
        f"{res}:" + ";".join(f"{i}={v}" for i, v in sorted(entries.items())) + "\n" for res, entries in schemata.items()
    )


def is_contiguous(mask: int) -> bool:
    """True for masks like 0b0111000 (one run of ones)."""
    if mask <= 0:
        return False
    low = mask & -mask
    return (mask + low) & mask == 0


class ResctrlFS:
    """The resctrl filesystem under ``root`` (``/sys/fs/resctrl`` on a host)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._confine = Confinement(root)

    @property
    def present(self) -> bool:
        return (self.root / "info" / "L3" / "cbm_mask").is_file()

    def require(self) -> None:
        if not self.present:
            raise ResctrlNotSupported(f"resctrl is not available: {self.root / 'info/L3/cbm_mask'} does not exist")

    def _info(self, *parts: str) -> str | None:
        try:
            return (self.root / "info" / PurePosixPath(*parts)).read_text().strip()
        except OSError:
            return None

    def cbm_mask(self) -> int:
        self.require()
        raw = self._info("L3", "cbm_mask") or ""
        try:
            mask = int(raw, 16)
        except ValueError:
            raise ResctrlError(f"{self.root}/info/L3/cbm_mask: {raw!r} is not a hex mask") from None
        if not is_contiguous(mask):
            raise ResctrlError(f"{self.root}/info/L3/cbm_mask: {raw!r} is not a contiguous mask")
        return mask

    def min_cbm_bits(self) -> int:
        raw = self._info("L3", "min_cbm_bits")
        return int(raw) if raw and raw.isdigit() else 1

    def mb_supported(self) -> bool:
        return (self.root / "info" / "MB").is_dir()

    def cache_ids(self, resource: str = "L3") -> tuple[int, ...]:
        """Cache ids of ``resource`` as the root group's ``schemata`` lists them."""
        self.require()
        try:
            text = (self.root / "schemata").read_text()
        except OSError as exc:
            raise ResctrlError(f"cannot read {self.root / 'schemata'}: {exc.strerror}") from exc
        ids = tuple(sorted(parse_schemata(text, str(self.root / "schemata")).get(resource, {})))
        if not ids:
            raise ResctrlError(f"{self.root / 'schemata'} has no {resource} line")
        return ids

    def l3_mask(self, start_percent: int, end_percent: int) -> int:
        """Koordinator's CalculateCatL3MaskValue: ways = bits of cbm_mask,
        mask = (1 << ceil(ways*end/100)) - (1 << ceil(ways*start/100))."""
        if not 0 <= start_percent < end_percent <= 100:
            raise ResctrlError(f"LLC range {start_percent}-{end_percent}%: need 0 <= start < end <= 100")
        ways = self.cbm_mask().bit_length()
        start_way, end_way = math.ceil(ways * start_percent / 100), math.ceil(ways * end_percent / 100)
        mask = (1 << end_way) - (1 << start_way)
        self.check_l3_mask(mask, f"LLC range {start_percent}-{end_percent}%")
        return mask

    def check_l3_mask(self, mask: int, where: str) -> None:
        cbm = self.cbm_mask()
        if not is_contiguous(mask):
            raise ResctrlError(f"{where}: L3 mask {mask:x} is empty or not contiguous")
        if mask & ~cbm:
            raise ResctrlError(f"{where}: L3 mask {mask:x} is outside cbm_mask {cbm:x}")
        if mask.bit_count() < self.min_cbm_bits():
            raise ResctrlError(f"{where}: L3 mask {mask:x} has fewer than min_cbm_bits={self.min_cbm_bits()} ways")

    def mb_value(self, percent: int) -> int:
        """MBA percent rounded up to ``info/MB/bandwidth_gran``, at least ``min_bandwidth``."""
        if not 1 <= percent <= 100:
            raise ResctrlError(f"MBA percent {percent}: need 1..100")
        gran = int(self._info("MB", "bandwidth_gran") or 10) or 10
        minimum = int(self._info("MB", "min_bandwidth") or 10)
        return min(100, max(minimum, math.ceil(percent / gran) * gran))

    def build_schemata(self, start_percent: int, end_percent: int, mba_percent: int) -> str:
        """``L3:<id>=<mask>;...`` (plus ``MB:<id>=<pct>;...`` where MBA exists)."""
        mask = f"{self.l3_mask(start_percent, end_percent):x}"
        schemata: dict[str, dict[int, str]] = {"L3": dict.fromkeys(self.cache_ids("L3"), mask)}
        if self.mb_supported():
            schemata["MB"] = dict.fromkeys(self.cache_ids("MB"), str(self.mb_value(mba_percent)))
        return format_schemata(schemata)

    def validate_schemata(self, text: str, where: str = "schemata") -> dict[str, dict[int, str]]:
        """Parse and check a schemata (e.g. from an annotation) against this host."""
        parsed = parse_schemata(text, where)
        for resource, entries in parsed.items():
            if resource not in ("L3", "MB"):
                raise ResctrlError(f"{where}: resource {resource!r} is not supported (L3, MB)")
            known = set(self.cache_ids(resource))
            for cache_id, value in entries.items():
                if cache_id not in known:
                    raise ResctrlError(f"{where}: {resource} cache id {cache_id} does not exist (have {sorted(known)})")
                if resource == "L3":
                    try:
                        mask = int(value, 16)
                    except ValueError:
                        raise ResctrlError(f"{where}: L3 mask {value!r} is not hex") from None
                    self.check_l3_mask(mask, where)
                elif not value.isdigit() or not 1 <= int(value) <= 100:
                    raise ResctrlError(f"{where}: MB value {value!r} must be 1..100")
        return parsed

    def group_dir(self, name: str) -> Path:
        if not _GROUP.fullmatch(name) or name in _RESERVED or ".." in name:
            raise ResctrlError(f"resctrl group name {name!r} is not allowed")
        try:
            return self._confine(PurePosixPath(name), f"resctrl group {name!r}")
        except HookError as exc:
            raise ResctrlError(str(exc)) from exc

    def ensure_group(self, name: str) -> bool:
        """Create the group if missing; True if it was created."""
        self.require()
        path = self.group_dir(name)
        if path.is_dir():
            return False
        check_deadline(str(path), "mkdir")
        try:
            path.mkdir()
        except FileExistsError:
            return False
        except OSError as exc:
            raise ResctrlError(f"cannot create resctrl group {path}: {exc.strerror}") from exc
        return True

    def remove_group(self, name: str) -> bool:
        """Remove a group (its tasks fall back to the root group); False if absent."""
        path = self.group_dir(name)
        if not os.path.lexists(path):
            return False
        check_deadline(str(path), "rmdir")
        try:
            path.rmdir()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise ResctrlError(f"cannot remove resctrl group {path}: {exc.strerror}") from exc
        return True

    def _group_file(self, name: str, file: str) -> Path:
        self.require()
        path = self.group_dir(name)
        if not path.is_dir():
            raise ResctrlError(f"resctrl group {path} does not exist")
        target = path / file
        if target.is_symlink():
            raise ResctrlError(f"{target} is a symlink; refusing to follow it")
        return target

    def plan_schemata(self, name: str, text: str, reason: str) -> Write:
        """What ``write_schemata`` would do (validated, read, compared), without writing:
        ``changed`` False when every given entry already holds."""
        target = self._group_file(name, "schemata")
        wanted = self.validate_schemata(text, f"schemata for group {name!r}")
        old = target.read_text().strip() if target.exists() else None
        current = parse_schemata(old or "", str(target))
        if all(current.get(res, {}).get(i, "").lower().lstrip("0") == v.lower().lstrip("0")
               for res, entries in wanted.items() for i, v in entries.items()):
            return Write(target, old, text.strip(), reason, changed=False)
        return Write(target, old, format_schemata(wanted).strip(), reason)

    def write_schemata(self, name: str, text: str, reason: str) -> Write:
        """Validate and write; unchanged when every given entry already holds."""
        planned = self.plan_schemata(name, text, reason)
        if planned.changed:
            _write_text(planned.target_path, planned.new + "\n", f"resctrl group {name!r}")
        return planned

    def plan_tasks(self, name: str, pids: Iterable[int], reason: str) -> Write:
        """The pids ``add_tasks`` would move (those not in the group yet), without writing."""
        target = self._group_file(name, "tasks")
        old = target.read_text() if target.exists() else ""
        present = {int(p) for p in old.split() if p.isdigit()}
        missing = sorted(set(pids) - present)
        return Write(target, " ".join(map(str, sorted(present))), " ".join(map(str, missing)), reason,
                     changed=bool(missing))

    def add_tasks(self, name: str, pids: Iterable[int], reason: str) -> Write:
        """Move ``pids`` into the group (one write per pid, as the kernel wants);
        pids already there are skipped, pids that exited are ignored."""
        target = self._group_file(name, "tasks")
        old = target.read_text() if target.exists() else ""
        present = {int(p) for p in old.split() if p.isdigit()}
        wanted = set(pids)
        bad = sorted(p for p in wanted if p <= 0)
        if bad:
            raise ResctrlError(f"resctrl group {name!r}: invalid pid {bad[0]}")
        added: list[int] = []
        for pid in sorted(wanted - present):
            try:
                _write_text(target, f"{pid}\n", f"resctrl group {name!r}", append=True)
            except ResctrlError as exc:
                if isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.ESRCH:
                    continue
                raise
            added.append(pid)
        new = " ".join(map(str, added))
        return Write(target, " ".join(map(str, sorted(present))), new, reason, changed=bool(added))


def _write_text(path: Path, text: str, source: str, append: bool = False) -> None:
    # O_CREAT: the kernel creates these files with the group; fixture trees may not.
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC)
    check_deadline(str(path), text.strip())
    try:
        fd = os.open(path, flags, 0o644)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        raise ResctrlError(f"{source}: writing {text.strip()!r} to {path} refused: {exc.strerror}") from exc
