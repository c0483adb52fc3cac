"""Every hook patch is checked here before it may change a CRI request.

Why: a hook's answer is untrusted input. A remote hook server (koordlet, or
anything that can write a registration into ``hookserver.d``) answering
``cgroup_parent: "/../../etc/evil"``, ``cpuset_cpus: "0-99999"``, shares 2**60 or
a 1 MB annotation must not get any of it to containerd, which would hand it to
runc and the kernel. The chain calls ``PatchValidator.check`` on every patch a
hook returns (local or remote: one validator, no path around it); a
``PatchError`` is that hook's failure, so its failure policy decides: Ignore
drops the hook's whole patch (one log line naming hook, field and value), Fail
rejects the CRI call and nothing is forwarded.

The rules are the ones the hooks apply to annotation input and the ones the
kernel and runc accept:

- ``cgroup_parent`` / ``pod_cgroup_parent``: an absolute cgroupfs path
  (``/kubepods/burstable/pod<uid>``) or a single systemd slice name
  (``kubepods-burstable-pod<uid>.slice``), of the same kind as the request's
  parent, with no ``.``/``..``/empty components or control characters, and
  confined under the kubelet's pod root that the request's parent names (its
  path up to and including the first ``kubepods`` component, else its first
  component; for a slice its first word, ``kubepods``). A request without a
  parent gets none from a hook.
- Resources (``0`` / ``""`` leave the CRI field "not set", as in CRI):
  ``cpu_shares`` 2..262144, ``cpu_quota`` -1 or 1000..2**44-1 (the kernel's
  ``max_cfs_runtime``), ``cpu_period`` 1000..1000000, memory and swap limits -1
  (unlimited) or 4096..2**63-4096, ``oom_score_adj`` -1000..1000,
  ``cpuset_cpus`` / ``cpuset_mems`` a CPU list whose CPUs / NUMA nodes are online
  on this node, ``unified`` keys cgroup v2 file names (never ``cgroup.*``:
  ``cgroup.procs`` or ``cgroup.kill`` are not resources) with single-line values.
- Labels and annotations: Kubernetes qualified-name keys (prefix <= 253, name
  <= 63); label values <= 63 in the label syntax; at most 256 KiB of
  annotation keys and values per patch (the API server's total).
- Envs: C identifier names; ``PATH`` and the dynamic loader's ``LD_*`` refused
  (a resource hook has no business choosing which binaries a container runs);
  no NUL in a value; 128 KiB per value (the kernel's MAX_ARG_STRLEN) and 256 KiB
  per patch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from runtimeproxy.cpusets import CpuListError, check_on_node, parse_cpu_list, read_online_cpus, read_online_mems
from runtimeproxy.hookapi import (
    ContainerContext,
    ContainerPatch,
    HookError,
    HostRoots,
    PodContext,
    PodPatch,
    ResourcesPatch,
)

MIN_SHARES: Final = 2
MAX_SHARES: Final = 262_144
MIN_QUOTA: Final = 1000  # the kernel's min_cfs_quota_period, in µs
MAX_QUOTA: Final = 2**44 - 1  # the kernel's max_cfs_runtime (MAX_BW), in µs
MIN_PERIOD: Final = 1000
MAX_PERIOD: Final = 1_000_000
PAGE_SIZE: Final = 4096
MAX_MEMORY: Final = 2**63 - PAGE_SIZE  # what cgroup v1 shows for "no limit"
MIN_OOM_SCORE_ADJ: Final = -1000
MAX_OOM_SCORE_ADJ: Final = 1000
MAX_PATH: Final = 4096  # PATH_MAX
MAX_NAME: Final = 255  # NAME_MAX: one cgroup directory or file name
MAX_CPU_LIST: Final = 4096  # characters of a cpuset string, before parsing
MAX_UNIFIED_VALUE: Final = 4096
MAX_ANNOTATIONS_BYTES: Final = 256 * 1024  # Kubernetes' TotalAnnotationSizeLimitB
MAX_LABEL_VALUE: Final = 63
MAX_ENV_VALUE: Final = 128 * 1024  # MAX_ARG_STRLEN: execve refuses a longer "NAME=value"
MAX_ENVS_BYTES: Final = 256 * 1024
MAX_ENV_NAME: Final = 255
_SHOWN: Final = 120  # longest value quoted in an error

_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")
_DNS_LABEL: Final = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN: Final = re.compile(rf"{_DNS_LABEL}(?:\.{_DNS_LABEL})*")
_QUALIFIED_NAME: Final = re.compile(r"[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?")
_SLICE: Final = re.compile(r"[A-Za-z0-9_.:]+(?:-[A-Za-z0-9_.:]+)*\.slice")
_ENV_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_UNIFIED_KEY: Final = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)+")
_KUBEPODS: Final = "kubepods"


class PatchError(HookError):
    """A hook's patch carries a value that must not reach the runtime.
    ``field`` names it as ``explain`` does (``container.resources.cpu_shares``)."""

    def __init__(self, field: str, value: object, message: str) -> None:
        super().__init__(f"{field}={shown(value)}: {message}")
        self.field = field
        self.value = value
        self.message = message


def shown(value: object) -> str:
    """``repr`` of a value, cut short so a 1 MB answer cannot flood the log."""
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + f"...({len(text)} chars)"


# --- numbers -----------------------------------------------------------------------


def _int(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PatchError(field, value, "expected an integer")
    return value


def _ranged(field: str, value: object, low: int, high: int, *, also: tuple[int, ...] = (0,)) -> None:
    number = _int(field, value)
    if number in also or low <= number <= high:
        return
    extra = "".join(f" or {a}" for a in also)
    raise PatchError(field, value, f"outside [{low}, {high}]{extra}")


def check_resources(prefix: str, patch: ResourcesPatch, online: Callable[[str], frozenset[int]]) -> None:
    """Each set field of ``patch`` in its kernel/runc range (``online(kind)`` gives the
    node's online "cpus" or "mems")."""
    checks = (
        ("cpu_shares", MIN_SHARES, MAX_SHARES, (0,)),
        ("cpu_quota", MIN_QUOTA, MAX_QUOTA, (0, -1)),
        ("cpu_period", MIN_PERIOD, MAX_PERIOD, (0,)),
        ("memory_limit_in_bytes", PAGE_SIZE, MAX_MEMORY, (0, -1)),
        ("memory_swap_limit_in_bytes", PAGE_SIZE, MAX_MEMORY, (0, -1)),
        ("oom_score_adj", MIN_OOM_SCORE_ADJ, MAX_OOM_SCORE_ADJ, ()),
    )
    for name, low, high, also in checks:
        value = getattr(patch, name)
        if value is not None:
            _ranged(f"{prefix}.{name}", value, low, high, also=also)
    for name, kind in (("cpuset_cpus", "cpus"), ("cpuset_mems", "mems")):
        value = getattr(patch, name)
        if value is not None:
            check_cpu_list(f"{prefix}.{name}", value, kind, online)
    if patch.unified is not None:
        check_unified(f"{prefix}.unified", patch.unified)


def check_cpu_list(field: str, value: object, kind: str, online: Callable[[str], frozenset[int]]) -> None:
    if not isinstance(value, str):
        raise PatchError(field, value, "expected a CPU list string")
    if not value:
        return  # "not set"
    if len(value) > MAX_CPU_LIST:
        raise PatchError(field, value, f"longer than {MAX_CPU_LIST} characters")
    try:
        cpus = parse_cpu_list(value)
        if not cpus:
            raise CpuListError(f"invalid CPU list {value!r}: blank")
        check_on_node(cpus, online(kind), value)
    except CpuListError as exc:
        raise PatchError(field, value, str(exc)) from exc


def check_unified(field: str, unified: Mapping[str, str]) -> None:
    for key, value in unified.items():
        where = f"{field}[{shown(key)}]"
        if not isinstance(key, str) or len(key) > MAX_NAME or not _UNIFIED_KEY.fullmatch(key):
            raise PatchError(where, key, "not a cgroup v2 file name like memory.high")
        if key.startswith("cgroup."):
            raise PatchError(where, key, "cgroup.* files are the hierarchy's, not a resource")
        if not isinstance(value, str) or len(value) > MAX_UNIFIED_VALUE or _CONTROL.search(value):
            raise PatchError(where, value, f"expected one line of at most {MAX_UNIFIED_VALUE} characters")


# --- maps --------------------------------------------------------------------------


def check_key(field: str, key: object) -> None:
    """A Kubernetes qualified name: ``[dns-subdomain/]name``."""
    where = f"{field}[{shown(key)}]"
    if not isinstance(key, str):
        raise PatchError(where, key, "expected a string key")
    prefix, slash, name = key.rpartition("/")
    if slash and (len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        raise PatchError(where, key, "the key's prefix must be a DNS subdomain of at most 253 characters")
    if len(name) > 63 or not _QUALIFIED_NAME.fullmatch(name):
        raise PatchError(where, key, "not a Kubernetes qualified name (at most 63 of [-A-Za-z0-9_.])")


def check_labels(field: str, labels: Mapping[str, str]) -> None:
    for key, value in labels.items():
        check_key(field, key)
        if not isinstance(value, str) or len(value) > MAX_LABEL_VALUE or (
            value and not _QUALIFIED_NAME.fullmatch(value)
        ):
            raise PatchError(f"{field}[{shown(key)}]", value, "not a label value (at most 63 of [-A-Za-z0-9_.])")


def _size(items: Mapping[str, str]) -> int:
    return sum(len(k.encode("utf-8", "surrogatepass")) + len(v.encode("utf-8", "surrogatepass"))
               for k, v in items.items())


def check_annotations(field: str, annotations: Mapping[str, str]) -> None:
    for key, value in annotations.items():
        check_key(field, key)
        if not isinstance(value, str):
            raise PatchError(f"{field}[{shown(key)}]", value, "expected a string value")
    if _size(annotations) > MAX_ANNOTATIONS_BYTES:
        raise PatchError(field, f"{len(annotations)} entries, {_size(annotations)} bytes",
                         f"more than {MAX_ANNOTATIONS_BYTES} bytes of keys and values")


def check_envs(field: str, envs: Mapping[str, str]) -> None:
    for name, value in envs.items():
        where = f"{field}[{shown(name)}]"
        if not isinstance(name, str) or len(name) > MAX_ENV_NAME or not _ENV_NAME.fullmatch(name):
            raise PatchError(where, name, "an environment variable name must be a C identifier")
        if name == "PATH" or name.startswith("LD_"):
            raise PatchError(where, value, "hooks may not set PATH or the dynamic loader's LD_* variables")
        if not isinstance(value, str) or "\x00" in value:
            raise PatchError(where, value, "an environment value must be a string without NUL")
        if len(value.encode("utf-8", "surrogatepass")) > MAX_ENV_VALUE:
            raise PatchError(where, value, f"longer than {MAX_ENV_VALUE} bytes")
    if _size(envs) > MAX_ENVS_BYTES:
        raise PatchError(field, f"{len(envs)} entries, {_size(envs)} bytes",
                         f"more than {MAX_ENVS_BYTES} bytes of names and values")


# --- cgroup parent -----------------------------------------------------------------


def _path_parts(field: str, value: str) -> list[str]:
    parts = value.split("/")[1:]
    for part in parts:
        if part in ("", ".", ".."):
            raise PatchError(field, value, f"contains an empty, '.' or '..' component ({part!r})")
        if len(part) > MAX_NAME:
            raise PatchError(field, value, f"a component is longer than {MAX_NAME} characters")
    return parts


def _slice_words(field: str, value: str) -> list[str]:
    if len(value) > MAX_NAME or not _SLICE.fullmatch(value):
        raise PatchError(field, value, "not a systemd slice name like kubepods-burstable-pod<uid>.slice")
    return value.removesuffix(".slice").split("-")


def _kind(value: str) -> str:
    return "cgroupfs" if value.startswith("/") else "systemd"


def check_cgroup_parent(field: str, value: object, current: str) -> None:
    """``value`` well formed and confined under the kubelet pod root named by ``current``
    (the request's parent): see the module docstring."""
    if not isinstance(value, str):
        raise PatchError(field, value, "expected a string")
    if not value:
        return  # "no change"
    if len(value) > MAX_PATH or _CONTROL.search(value):
        raise PatchError(field, value, f"control characters or longer than {MAX_PATH}")
    if "/" in value and not value.startswith("/"):
        raise PatchError(field, value, "a cgroupfs parent must be an absolute path")
    if not current:
        raise PatchError(field, value, "the request has no cgroup parent to confine a new one under")
    if _kind(value) != _kind(current):
        raise PatchError(field, value, f"{_kind(current)} parent {current!r} cannot become a {_kind(value)} one")
    if _kind(value) == "cgroupfs":
        parts, now = _path_parts(field, value), [p for p in current.split("/") if p]
        root = now[: now.index(_KUBEPODS) + 1] if _KUBEPODS in now else now[:1]
        if not root or parts[: len(root)] != root:  # a parent of "/" confines nothing: refuse
            raise PatchError(field, value, f"outside the pod root /{'/'.join(root)} of {current!r}")
        return
    words, now_words = _slice_words(field, value), current.removesuffix(".slice").split("-")
    if words[:1] != now_words[:1]:
        raise PatchError(field, value, f"outside the pod root {now_words[0]}.slice of {current!r}")


# --- patches -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PatchValidator:
    """Checks hook patches; ``online_cpus`` / ``online_mems`` are the node's (injected
    for tests; read on every check that needs them, since CPUs come and go)."""

    online_cpus: Callable[[], frozenset[int]]
    online_mems: Callable[[], frozenset[int]]

    @classmethod
    def for_host(cls, host: HostRoots) -> PatchValidator:
        return cls(online_cpus=lambda: read_online_cpus(host.sys), online_mems=lambda: read_online_mems(host.sys))

    def _online(self, kind: str) -> frozenset[int]:
        return self.online_cpus() if kind == "cpus" else self.online_mems()

    def check(self, ctx: PodContext | ContainerContext, patch: PodPatch | ContainerPatch) -> None:
        """Raise ``PatchError`` naming the first bad field of ``patch``."""
        if isinstance(patch, PodPatch):
            if patch.labels is not None:
                check_labels("pod.labels", patch.labels)
            if patch.annotations is not None:
                check_annotations("pod.annotations", patch.annotations)
            if patch.cgroup_parent is not None:
                check_cgroup_parent("pod.cgroup_parent", patch.cgroup_parent, ctx.pod.cgroup_parent)
            if patch.resources is not None:
                check_resources("pod.resources", patch.resources, self._online)
            if patch.overhead is not None:
                check_resources("pod.overhead", patch.overhead, self._online)
            return
        if patch.annotations is not None:
            check_annotations("container.annotations", patch.annotations)
        if patch.envs is not None:
            check_envs("container.envs", patch.envs)
        if patch.resources is not None:
            check_resources("container.resources", patch.resources, self._online)
        if patch.pod_cgroup_parent is not None:
            check_cgroup_parent("pod.cgroup_parent", patch.pod_cgroup_parent, ctx.pod.cgroup_parent)
