"""Host memory tuning from NodeSLO ``systemStrategy`` (koordlet's SystemConfig, reference §4).

Strategy ``system-config`` keeps three host knobs at what the NodeSLO asks:

* ``/proc/sys/vm/min_free_kbytes`` = MemTotal_kB x ``minFreeKbytesFactor`` / 10000
  (MemTotal from ``/proc/meminfo``; koordlet takes the Node's memory capacity, which
  kubelet reads from the same MemTotal);
* ``/proc/sys/vm/watermark_scale_factor`` = ``watermarkScaleFactor``;
* ``/sys/kernel/mm/memcg_reaper/reap_background`` = ``memcgReapBackGround`` (Anolis
  kernels only: its absence is detected once, said in one log line, and the knob is
  never written).

Ranges are koordlet's file validators: factor fields at NodeSLO parse time
(``hooks.rules``: a bad value refuses the NodeSLO naming the field and value, nothing
is written); the computed ``min_free_kbytes`` must be in [10240, 10485760] kB, else
that knob is left alone and the plan's reason names the factor. An unset field is
not touched (there is no node-side default).

The value a knob had before our first write is saved in
``<state_dir>/qos-system-config.json`` *before* that write (so a restart after a
crash still knows it) and written back when its field or the whole section goes
away, when the strategy is listed but disabled (at start) and when the task stops.
Files live under the injected host roots (``host.proc``, ``host.sys``), confined there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Final

import structlog

from hooks.executor import Confinement
from hooks.rules import Rules, SystemStrategy
from metrics.model import PodView
from metrics.qos.plan import Action, Plan, Priority, SetFile
from metrics.qos.strategy import Input, RoundContext, RoundInputs, Strategy, StrategyInit
from runtimeproxy.hookapi import HookError
from runtimeproxy.ops.privatefiles import write_private

log = structlog.get_logger("metrics.qos.sysconfig")

NAME: Final = "system_config"
STATE_FILE: Final = "qos-system-config.json"
RESTORE: Final = "restore original"


class HostFileError(HookError):
    """A host knob could not be read or written."""


@dataclass(frozen=True, slots=True)
class Knob:
    field: str  # the NodeSLO key under systemStrategy
    attr: str  # SystemStrategy attribute
    root: str  # "proc" | "sys": the injected host root
    path: str  # relative to that root
    low: int
    high: int

    @property
    def target(self) -> str:
        return f"{self.root}:{self.path}"


MIN_FREE: Final = Knob("minFreeKbytesFactor", "min_free_kbytes_factor", "proc", "sys/vm/min_free_kbytes",
                       10 * 1024, 10 * 1024 * 1024)
WATERMARK: Final = Knob("watermarkScaleFactor", "watermark_scale_factor", "proc", "sys/vm/watermark_scale_factor",
                        10, 400)
REAP: Final = Knob("memcgReapBackGround", "memcg_reap_background", "sys", "kernel/mm/memcg_reaper/reap_background",
                   0, 1)
KNOBS: Final = (MIN_FREE, WATERMARK, REAP)


@dataclass(frozen=True, slots=True)
class HostFiles:
    """The knobs' current values (None: absent or unreadable) and MemTotal in kB."""

    values: Mapping[str, str | None]
    mem_total_kb: int | None

    def describe(self) -> dict[str, Any]:
        return {"mem_total_kb": self.mem_total_kb, **self.values}


def min_free_kbytes(mem_total_kb: int, factor: int) -> int:
    """koordlet's formula: MemTotal_kB x factor / 10000 (integer division)."""
    return mem_total_kb * factor // 10000


def _read_text(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return os.read(fd, 4096).decode("utf-8", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)


#: How long a MemTotal read is used for (memory hot-plug shows within this).
MEM_TOTAL_TTL: Final = 60.0


def read_mem_total_kb(proc: Path) -> int | None:
    text = _read_text(proc / "meminfo") or ""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None
    return None


class SystemConfig(Strategy):
    name = "system-config"
    priority = Priority.SYSTEM

    def __init__(self, roots: Mapping[str, Path], state_dir: Path | None, reap_supported: bool) -> None:
        self.roots = dict(roots)
        #: Root -> its confinement, the root resolved once (as the cgroup executor's): the
        #: knobs are read every round, and resolving the fixed root again each time was
        #: most of what confining a knob's path cost. Each knob itself is still resolved.
        self._confined: dict[Path, Confinement] = {}
        self.state_path = state_dir / STATE_FILE if state_dir is not None else None
        self.reap_supported = reap_supported
        self.knobs = tuple(k for k in KNOBS if k is not REAP or reap_supported)
        #: target -> the value before our first write (persisted).
        self.originals: dict[str, str] = self._load()
        #: (when read, MemTotal): the kernel's total changes only with memory hot-plug, so
        #: /proc/meminfo (the kernel fills in some 50 lines for it) is read once a minute,
        #: not every round; the knobs themselves are read every round (drift).
        self._mem_total: tuple[float, int | None] | None = None
        self.files: Input[HostFiles] = Input("system_files", self._read, HostFiles.describe)
        self.reads = (self.files,)

    # --- state ------------------------------------------------------------------------

    def _load(self) -> dict[str, str]:
        if self.state_path is None or not self.state_path.exists():
            return {}
        try:
            raw = json.loads(self.state_path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("system_config_state_unreadable", path=str(self.state_path), error=str(exc),
                        consequence="original values unknown: nothing will be restored")
            return {}
        known = {k.target for k in KNOBS}
        if not isinstance(raw, dict):
            return {}
        return {k: v for k, v in raw.items() if k in known and isinstance(v, str)}

    def _save(self) -> None:
        if self.state_path is None:
            return
        try:
            self.state_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_private(self.state_path, json.dumps(self.originals, sort_keys=True))
        except OSError as exc:
            raise HostFileError(f"{self.state_path}: cannot save the original values: {exc}") from exc

    # --- reading and planning ---------------------------------------------------------

    def _path(self, root: str, path: str) -> Path:
        base = self.roots.get(root)
        if base is None:
            raise HostFileError(f"{root}:{path}: no host root {root!r}")
        confined = self._confined.get(base)
        if confined is None:
            confined = self._confined[base] = Confinement(base)
        return confined(PurePosixPath(path), f"{root}:{path}")

    def _read_knob(self, knob: Knob) -> str | None:
        try:
            return _read_text(self._path(knob.root, knob.path))
        except HookError as exc:  # escapes its root (a symlink): never followed
            log.debug("system_knob_unreadable", target=knob.target, error=str(exc))
            return None

    def _read(self, ctx: RoundContext) -> HostFiles:
        values = {k.target: self._read_knob(k) for k in self.knobs}
        return HostFiles(values, self._mem_total_kb(ctx.now))

    def _mem_total_kb(self, now: float) -> int | None:
        cached = self._mem_total
        if cached is None or cached[1] is None or not 0 <= now - cached[0] < MEM_TOTAL_TTL:
            cached = self._mem_total = (now, read_mem_total_kb(self.roots["proc"]))
        return cached[1]

    def _wanted(self, knob: Knob, cfg: SystemStrategy, files: HostFiles) -> tuple[str | None, str]:
        """(value to write or None, why) for one knob."""
        raw = getattr(cfg, knob.attr)
        if raw is None:
            return None, "unset"
        value = raw
        if knob is MIN_FREE:
            if files.mem_total_kb is None:
                return None, f"systemStrategy.{knob.field}={raw}: MemTotal unknown (/proc/meminfo)"
            value = min_free_kbytes(files.mem_total_kb, raw)
        if not knob.low <= value <= knob.high:
            return None, (f"systemStrategy.{knob.field}={raw}: {knob.path.rsplit('/', 1)[-1]} {value} outside "
                          f"[{knob.low}, {knob.high}]")
        return str(value), f"systemStrategy.{knob.field}={raw}"

    def plan(self, inputs: RoundInputs) -> Plan:
        cfg = inputs.rules.system_strategy
        files = inputs[self.files]
        actions: list[Action] = []
        problems: list[str] = []
        if getattr(cfg, REAP.attr) is not None and not self.reap_supported:
            problems.append(f"systemStrategy.{REAP.field}: /sys/{REAP.path} not on this kernel (Anolis only)")
        for knob in self.knobs:
            value, why = self._wanted(knob, cfg, files)
            current = files.values.get(knob.target)
            if value is not None:
                if current is None:
                    problems.append(f"{why}: {knob.target} not readable on this host")
                else:
                    actions.append(SetFile(knob.root, knob.path, value, why))
            elif why == "unset" and knob.target in self.originals:
                actions.append(SetFile(knob.root, knob.path, self.originals[knob.target],
                                       f"{RESTORE} (systemStrategy.{knob.field} unset)"))
            elif why != "unset":
                problems.append(why)
        info = {"config": {k.field: getattr(cfg, k.attr) for k in KNOBS}, "current": dict(files.values),
                "mem_total_kb": files.mem_total_kb, "originals": dict(self.originals),
                "memcg_reaper": self.reap_supported}
        if problems:
            reason = "; ".join(problems)
        elif actions:
            reason = "host knobs as systemStrategy asks"
        else:
            reason = "systemStrategy unset: nothing to do"
        return Plan(NAME, self.priority, tuple(actions), info, reason)

    # --- carrying out -----------------------------------------------------------------

    def apply(self, action: Action) -> bool:
        if not isinstance(action, SetFile):
            return super().apply(action)
        path = self._path(action.root, action.path)
        current = _read_text(path)
        if current is None:
            raise HostFileError(f"{action.target}: {path} not readable")
        restoring = action.reason.startswith(RESTORE)
        changed = current != action.value
        if changed:
            if not restoring and action.target not in self.originals:
                self.originals[action.target] = current
                try:
                    self._save()  # before the write: a crash right after it must not lose the original
                except HostFileError:
                    del self.originals[action.target]  # not kept: the next round tries again, still unwritten
                    raise
            try:
                fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW)
                try:
                    os.write(fd, action.value.encode())
                finally:
                    os.close(fd)
            except OSError as exc:
                raise HostFileError(f"{action.target}: writing {action.value!r} to {path}: {exc}") from exc
        if restoring and self.originals.get(action.target) == action.value:
            del self.originals[action.target]
            self._save()
        return changed

    def release(self, pods: Sequence[PodView]) -> list[Action]:
        """Every saved original back (task stop; listed but disabled at start)."""
        out: list[Action] = []
        for target, value in sorted(self.originals.items()):
            root, path = target.split(":", 1)
            out.append(SetFile(root, path, value, f"{RESTORE} (system-config stopped)"))
        return out

    def enabled(self, rules: Rules) -> bool:
        return True  # also when the section is gone: originals may need restoring


def system_config(init: StrategyInit) -> SystemConfig:
    reap = init.host.sys / REAP.path
    supported = reap.exists()
    if not supported:
        log.info("memcg_reaper_unsupported", path=str(reap),
                 consequence="systemStrategy.memcgReapBackGround is never written on this host")
    return SystemConfig({"proc": init.host.proc, "sys": init.host.sys}, init.state_dir, supported)
