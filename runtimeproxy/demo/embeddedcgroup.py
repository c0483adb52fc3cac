"""cgroup helpers for tests, demos and benchmarks on the shared host: a fresh
top-level parent per run and a bottom-up removal of it in every hierarchy.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

# --------------------------------------------------------------------------
# cgroups
# --------------------------------------------------------------------------


def unique_test_parent() -> str:
    """A fresh top-level cgroup parent so concurrent runs never share dirs."""
    return f"/koord-test-{secrets.token_hex(4)}"


def _cgroup_hierarchies(cgroup_root: Path) -> list[Path]:
    """Every hierarchy mount under cgroup_root (v1 controllers and unified).

    Co-mounted controllers (``cpu,cpuacct`` with ``cpu`` symlinks) are
    de-duplicated by real path.  A pure v2 host has a single hierarchy.
    """
    if (cgroup_root / "cgroup.controllers").exists():
        return [cgroup_root]
    seen: dict[str, Path] = {}
    for child in sorted(cgroup_root.iterdir()):
        real = child.resolve()
        if real.is_dir() and os.path.ismount(real):
            seen.setdefault(str(real), real)
    return list(seen.values())


def _rmdir_tree(top: Path) -> list[Path]:
    """rmdir every directory under top, deepest first; return the failures."""
    if not top.is_dir():
        return []
    failed: list[Path] = []
    for dirpath, _dirs, _files in os.walk(top, topdown=False):
        try:
            os.rmdir(dirpath)
        except FileNotFoundError:
            pass
        except OSError:
            failed.append(Path(dirpath))
    return failed


def remove_cgroup_tree(
    relative_parent: str, cgroup_root: Path = Path("/sys/fs/cgroup"), timeout: float = 5.0
) -> None:
    """Remove a cgroup subtree in every hierarchy, bottom-up.

    Retries for a while because a cgroup stays busy for a moment after its
    last task exits (memory cgroups go offline asynchronously).  Raises
    OSError listing the directories that could not be removed.
    """
    parts = [p for p in relative_parent.split("/") if p]
    if not parts or ".." in parts or "." in parts:
        raise ValueError(f"refusing unsafe cgroup parent {relative_parent!r}")
    deadline = time.monotonic() + timeout
    while True:
        failed = [f for h in _cgroup_hierarchies(cgroup_root) for f in _rmdir_tree(h.joinpath(*parts))]
        if not failed:
            return
        if time.monotonic() >= deadline:
            raise OSError(f"cgroup dirs still busy: {', '.join(map(str, failed))}")
        time.sleep(0.1)
