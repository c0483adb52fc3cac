"""File descriptors: the process limit and how many are left.

The proxy shares one descriptor table between the CRI path (kubelet's and
containerd's connections), the hooks (cgroup files, remote hook sockets), the
metrics store and the loopback HTTP endpoint. A local client flooding the HTTP
endpoint once used every descriptor under a 1 024 limit: hooks failed with EMFILE
and pods started without their QoS settings. So the soft limit is raised to the
hard one at start, and the HTTP endpoint stops accepting while fewer than a
reserve of descriptors is free (see ``promstats.HttpEndpoint``).
"""

from __future__ import annotations

import os
import resource
from typing import Final

_FD_DIR: Final = "/proc/self/fd"


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return (old soft, new soft).

    Everything here uses epoll (asyncio, grpc core), never select(), so descriptor
    numbers above 1 024 are safe.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, hard


def nofile_limit() -> int:
    """The soft limit: one more than the highest descriptor number that can be opened."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def open_fds() -> int:
    """Descriptors open in this process (one directory read, ~50 µs for a few hundred)."""
    try:
        # listdir itself holds one descriptor on the directory while it reads.
        return len(os.listdir(_FD_DIR)) - 1
    except OSError:  # no /proc, or EMFILE itself: treat as full
        return nofile_limit()


def free_fds() -> int:
    """Descriptors that can still be opened before EMFILE."""
    return nofile_limit() - open_fds()
