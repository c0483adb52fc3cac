"""The kube-QoS tiers' root, from the one configured setting (issue 28 item 9).

kubelet puts its tiers under ``<cgroupRoot>/kubepods`` (``kubepods.slice`` with the
systemd driver); with a ``cgroupRoot`` other than ``/`` that is not ``/kubepods``, and a
``/kubepods`` at the hierarchy root may be another tenant's tree. So no strategy names
``/kubepods`` itself: the root is the parent of the configured BE tier
(``besteffort_dir``, one setting, in ``tasks.metrics``; ``qos-manager`` inherits it), and
the other tiers are found above the pods' own cgroups (``kubepods_root``). The default
``besteffort_dir`` names the cgroupfs tier; with the systemd driver it stands for
``kubepods.slice``.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Final

from runtimeproxy.config.configvalues import ConfigError, string

#: The settings' default BE tier (cgroupfs names).
DEFAULT_BESTEFFORT: Final = PurePosixPath("kubepods/besteffort")
_ROOTS: Final = ("kubepods", "kubepods.slice")


def besteffort_dir(value: object, key_path: str) -> str:
    """The ``besteffort_dir`` setting (``tasks.metrics``, ``tasks.qos-manager``): a cgroup
    path below the hierarchy's root, never above it."""
    text = string(value, key_path).strip("/")
    if not text or any(part in ("", ".", "..") for part in text.split("/")):
        raise ConfigError(key_path, value, "must be a cgroup path below the root, without '.' or '..'")
    return text


def configured_root(besteffort_dir: PurePosixPath, driver: str) -> PurePosixPath:
    """The kube-QoS root the configured BE tier lives in."""
    if driver == "systemd" and besteffort_dir == DEFAULT_BESTEFFORT:
        return PurePosixPath("kubepods.slice")
    return besteffort_dir.parent


def kubepods_root(cgroup: PurePosixPath) -> PurePosixPath | None:
    """The nearest ``kubepods`` (``kubepods.slice``) ancestor of a pod cgroup."""
    for ancestor in cgroup.parents:
        if ancestor.name in _ROOTS:
            return ancestor
    return None
