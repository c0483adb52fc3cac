"""What the NodeResourceTopology is built from, read from the host (blocking: call
these off the event loop).

- memory per NUMA node: ``/sys/devices/system/node/node<N>/meminfo`` (``MemTotal``) and
  its hugepage pools (``hugepages/hugepages-{2048,1048576}kB/nr_hugepages``);
- the kubelet static CPU manager's checkpoint ``cpu_manager_state`` (JSON:
  ``policyName``, ``defaultCpuSet``, ``entries{podUID: {container: cpuset}}``);
- the kubelet's configuration file (KubeletConfiguration YAML: ``cpuManagerPolicy``,
  ``cpuManagerPolicyOptions``, ``reservedSystemCPUs``, ``kubeReserved``/``systemReserved``,
  ``topologyManagerPolicy``, ``topologyManagerScope``) — koordlet asks kubelet's ``/configz``
  for the same fields;
- the CPU's basic info: ``/proc/cpuinfo`` (model name, vendor), turbo from intel_pstate or
  cpufreq boost, the L3 CAT mask from resctrl.

A missing file is normal (no static CPU manager, no resctrl) and yields the kubelet's
defaults. A file that is present but does not parse is one logged error per distinct
problem (``nrt_source_invalid``, naming the path and the reason) and is treated as absent.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import structlog
import yaml

from hooks.annotations import AnnotationError, quantity_value
from hooks.cpusets import CpuListError, parse_cpu_list
from metrics.collect.base import ReadError, read_file
from metrics.collect.topology import NODE_DIR

log = structlog.get_logger("metrics.report.nrt")

DEFAULT_CPU_MANAGER_STATE: Final = Path("/var/lib/kubelet/cpu_manager_state")
DEFAULT_KUBELET_CONFIG: Final = Path("/var/lib/kubelet/config.yaml")
_NODE_NAME: Final = re.compile(r"node([0-9]+)")
_MEMTOTAL: Final = re.compile(r"^Node\s+\d+\s+MemTotal:\s+(\d+)\s*kB\s*$", re.MULTILINE)
_HUGEPAGES: Final = {"hugepages-2Mi": 2048 * 1024, "hugepages-1Gi": 1048576 * 1024}
#: A checkpoint or config larger than this is refused (they are a few KiB).
_MAX_BYTES: Final = 4 * 2**20


@dataclass(frozen=True, slots=True)
class NumaMemory:
    """One NUMA node's memory in bytes: MemTotal and the hugepage pools carved from it."""

    total: int
    hugepages: Mapping[str, int] = field(default_factory=dict)  # "hugepages-2Mi" -> bytes


@dataclass(frozen=True, slots=True)
class KubeletCPUConfig:
    """The kubelet settings koord-scheduler needs (defaults: kubelet's own)."""

    cpu_manager_policy: str = "none"
    cpu_manager_options: Mapping[str, str] = field(default_factory=dict)
    #: ``reservedSystemCPUs`` as written (a CPU list); "" when not set.
    reserved_system_cpus: str = ""
    #: kubeReserved.cpu + systemReserved.cpu in cores (used without reservedSystemCPUs).
    reserved_cpu_cores: float = 0.0
    topology_manager_policy: str = "none"
    topology_manager_scope: str = "container"


@dataclass(frozen=True, slots=True)
class CPUManagerState:
    """The static CPU manager's checkpoint: policy name and pod uid -> container -> CPUs."""

    policy: str = ""
    entries: Mapping[str, Mapping[str, frozenset[int]]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CPUBasicInfo:
    cpu_model: str = ""
    vendor_id: str = ""
    turbo_enabled: bool = False
    cat_l3_cbm_mask: str = ""


class SourceProblems:
    """Logs each (path, reason) once, as an error: a corrupt checkpoint is reported
    once, not every few seconds, and again when the reason changes."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()

    def invalid(self, path: Path, reason: str) -> None:
        key = (str(path), reason)
        if key not in self._seen:
            self._seen.add(key)
            log.error("nrt_source_invalid", path=str(path), reason=reason, applied="treated as absent")


def _read_optional(path: Path, problems: SourceProblems) -> str | None:
    """The file's text; None when it does not exist (or cannot be read: logged)."""
    try:
        if path.stat().st_size > _MAX_BYTES:
            problems.invalid(path, f"larger than {_MAX_BYTES} bytes")
            return None
        return read_file(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        problems.invalid(path, exc.strerror or str(exc))
        return None
    except ReadError as exc:
        if not exc.gone:
            problems.invalid(path, exc.reason)
        return None


# --- NUMA memory ----------------------------------------------------------------------
def read_numa_memory(sys_root: Path, problems: SourceProblems) -> dict[int, NumaMemory]:
    """NUMA node id -> its memory; {} without NUMA sysfs (the builder then uses
    ``/proc/meminfo``'s total for node 0)."""
    try:
        entries = sorted((sys_root / NODE_DIR).iterdir())
    except OSError:
        return {}
    out: dict[int, NumaMemory] = {}
    for entry in entries:
        match = _NODE_NAME.fullmatch(entry.name)
        if match is None:
            continue
        path = entry / "meminfo"
        text = _read_optional(path, problems)
        found = _MEMTOTAL.search(text) if text is not None else None
        if found is None:
            if text is not None:
                problems.invalid(path, "no 'Node N MemTotal: <n> kB' line")
            continue
        pools: dict[str, int] = {}
        for name, page in _HUGEPAGES.items():
            raw = _read_optional(entry / f"hugepages/hugepages-{page // 1024}kB/nr_hugepages", problems)
            pages = raw.strip() if raw is not None else ""
            pools[name] = int(pages) * page if pages.isdigit() else 0
        out[int(match.group(1))] = NumaMemory(int(found.group(1)) * 1024, pools)
    return out


def read_memtotal(proc_root: Path, problems: SourceProblems) -> int:
    """``/proc/meminfo`` MemTotal in bytes (0 when unreadable): a host without NUMA sysfs."""
    text = _read_optional(proc_root / "meminfo", problems) or ""
    found = re.search(r"^MemTotal:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else 0


# --- kubelet CPU manager checkpoint -------------------------------------------------------
def parse_cpu_manager_state(text: str) -> CPUManagerState:
    """The checkpoint's JSON; ValueError naming the field when it is not a checkpoint."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"not a JSON object (got {type(doc).__name__})")
    policy = doc.get("policyName", "")
    if not isinstance(policy, str):
        raise ValueError(f"policyName: not a string (got {policy!r})")
    raw_entries = doc.get("entries") or {}
    if not isinstance(raw_entries, dict):
        raise ValueError(f"entries: not an object (got {type(raw_entries).__name__})")
    entries: dict[str, dict[str, frozenset[int]]] = {}
    for uid, containers in raw_entries.items():
        if not isinstance(containers, dict):
            raise ValueError(f"entries.{uid}: not an object (got {type(containers).__name__})")
        pod: dict[str, frozenset[int]] = {}
        for name, cpus in containers.items():
            if not isinstance(cpus, str):
                raise ValueError(f"entries.{uid}.{name}: not a CPU list string (got {cpus!r})")
            try:
                pod[str(name)] = parse_cpu_list(cpus)
            except CpuListError as exc:
                raise ValueError(f"entries.{uid}.{name}: {exc}") from None
        entries[str(uid)] = pod
    return CPUManagerState(policy, entries)


def read_cpu_manager_state(path: Path, problems: SourceProblems) -> CPUManagerState:
    text = _read_optional(path, problems)
    if text is None or not text.strip():
        return CPUManagerState()
    try:
        return parse_cpu_manager_state(text)
    except ValueError as exc:
        problems.invalid(path, str(exc))
        return CPUManagerState()


# --- kubelet configuration -----------------------------------------------------------
def _cores(section: object, where: str) -> float:
    raw = section.get("cpu") if isinstance(section, Mapping) else None
    if raw is None:
        return 0.0
    try:
        return float(quantity_value(raw, where))
    except AnnotationError as exc:
        raise ValueError(str(exc)) from None


def _text(doc: Mapping[str, Any], key: str, default: str) -> str:
    value = doc.get(key)
    if value is None or value == "":
        return default
    if not isinstance(value, str):
        raise ValueError(f"{key}: not a string (got {value!r})")
    return value


def parse_kubelet_config(text: str) -> KubeletCPUConfig:
    """A KubeletConfiguration YAML document; ValueError naming the field when malformed."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"not YAML: {exc}") from None
    if doc is None:
        return KubeletCPUConfig()
    if not isinstance(doc, Mapping):
        raise ValueError(f"not a mapping (got {type(doc).__name__})")
    options = doc.get("cpuManagerPolicyOptions") or {}
    if not isinstance(options, Mapping):
        raise ValueError(f"cpuManagerPolicyOptions: not a mapping (got {options!r})")
    reserved = _text(doc, "reservedSystemCPUs", "")
    if reserved:
        try:
            parse_cpu_list(reserved)
        except CpuListError as exc:
            raise ValueError(f"reservedSystemCPUs: {exc}") from None
    return KubeletCPUConfig(
        cpu_manager_policy=_text(doc, "cpuManagerPolicy", "none"),
        cpu_manager_options={str(k): str(v) for k, v in options.items()},
        reserved_system_cpus=reserved,
        reserved_cpu_cores=_cores(doc.get("kubeReserved"), "kubeReserved.cpu")
        + _cores(doc.get("systemReserved"), "systemReserved.cpu"),
        topology_manager_policy=_text(doc, "topologyManagerPolicy", "none"),
        topology_manager_scope=_text(doc, "topologyManagerScope", "container"),
    )


def read_kubelet_config(path: Path, problems: SourceProblems) -> KubeletCPUConfig | None:
    """The kubelet's settings; None when the file is absent or malformed (logged)."""
    text = _read_optional(path, problems)
    if text is None:
        return None
    try:
        return parse_kubelet_config(text)
    except ValueError as exc:
        problems.invalid(path, str(exc))
        return None


# --- CPU basic info ----------------------------------------------------------------------
def _cpuinfo_field(text: str, key: str) -> str:
    found = re.search(rf"^{re.escape(key)}\s*:\s*(.*)$", text, re.MULTILINE)
    return found.group(1).strip() if found else ""


def read_cpu_basic_info(proc_root: Path, sys_root: Path, resctrl_root: Path,
                        problems: SourceProblems) -> CPUBasicInfo:
    cpuinfo = _read_optional(proc_root / "cpuinfo", problems) or ""
    no_turbo = _read_optional(sys_root / "devices/system/cpu/intel_pstate/no_turbo", problems)
    if no_turbo is not None:
        turbo = no_turbo.strip() == "0"
    else:
        boost = _read_optional(sys_root / "devices/system/cpu/cpufreq/boost", problems)
        turbo = boost is not None and boost.strip() == "1"
    mask = _read_optional(resctrl_root / "info/L3/cbm_mask", problems)
    return CPUBasicInfo(
        cpu_model=_cpuinfo_field(cpuinfo, "model name"),
        vendor_id=_cpuinfo_field(cpuinfo, "vendor_id"),
        turbo_enabled=turbo,
        cat_l3_cbm_mask=mask.strip() if mask is not None else "",
    )


def reserved_cpu_count(cores: float) -> int:
    """The static policy reserves whole CPUs: ceil(kubeReserved + systemReserved)."""
    return math.ceil(cores - 1e-9) if cores > 0 else 0
