"""Argument checks and host-write reporting shared by the QoS hooks.

Every hook validates its ``args`` the same way (unknown keys and the cgroup
driver/version are errors naming ``hooks[i].args.<key>``), and every hook turns
the executor's writes into the ``HostWrite`` entries ``explain`` shows (dry-run:
``hooks.dryrun``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, Final, Literal

from hooks.cgroups import CgroupError, CgroupLayout, Driver, Version
from hooks.executor import CgroupExecutor, Write
from hooks.qos import pod_name
from runtimeproxy.hookapi import HookConfigError, HookError, HookInit, HostWrite, PodInfo
from runtimeproxy.services import WriteBackoff


def cgroup_args(init: HookInit, args: Mapping[str, Any]) -> tuple[Driver, Version | Literal["auto"]]:
    driver = args.get("cgroup_driver", "cgroupfs")
    if driver not in ("cgroupfs", "systemd"):
        raise HookConfigError(f"{init.key_path}.cgroup_driver", driver, "must be cgroupfs or systemd")
    version = args.get("cgroup_version", "auto")
    if version not in ("auto", 1, 2):
        raise HookConfigError(f"{init.key_path}.cgroup_version", version, "must be auto, 1 or 2")
    return driver, version


def cgroup_layout(init: HookInit, args: Mapping[str, Any]) -> CgroupLayout:
    """``cgroup_driver`` / ``cgroup_version`` checked and the host's cgroup tree opened
    with them; a tree that does not fit is an error naming ``cgroup_version``."""
    driver, version = cgroup_args(init, args)
    try:
        return CgroupLayout(init.host.cgroup, version, driver)
    except CgroupError as exc:
        raise HookConfigError(f"{init.key_path}.cgroup_version", version, str(exc)) from exc


def open_executor(root: Path, version: Version | Literal["auto"], driver: Driver, pod: PodInfo,
                  backoff: WriteBackoff) -> CgroupExecutor:
    """An executor built on first use (hooks that may run without a cgroup tree);
    a missing or unusable tree is a HookError naming the pod that needed it."""
    try:
        return CgroupExecutor(CgroupLayout(root, version, driver), backoff=backoff)
    except CgroupError as exc:
        raise HookError(f"pod {pod_name(pod)}: {exc}") from exc


def host_writes(writes: Sequence[Write]) -> tuple[HostWrite, ...]:
    """Only files whose value changed: an idempotent re-apply reports nothing."""
    return tuple(HostWrite(str(w.target_path), w.old or "", w.new, w.reason) for w in writes if w.changed)



#: ``host_support()``'s answer (``check-config``'s plan): ("on" | "off" | "unknown", why).
HostSupport = tuple[str, str]
#: Where a hook that detects per pod looks when no pod exists yet.
PROBE_SOURCE: Final = "check-config"


def kubepods_probe(layout: CgroupLayout) -> PurePosixPath:
    """A pod-like path under the kubepods root: per-pod detection (which probes the
    pod's parent) then looks at the root, as it will for the first Guaranteed pod."""
    return PurePosixPath("kubepods.slice" if layout.driver == "systemd" else "kubepods") / "probe"


def unknown_until_a_pod(exc: CgroupError) -> HostSupport:
    return "unknown", f"detected at the first pod: {exc}"
