"""Can anyone but root or us change what a file we read says?

The config file and the hookserver.d registrations decide what runs in kubelet's path
(which hooks, which remote sockets): if another user can rewrite one, replace it, or
redirect a path to a file of their own, that user controls the node. Like OpenSSH's
StrictModes: every component on the way, symlinks followed one by one, must be owned
by root or by this process's user; a directory on the way may be group/world-writable
only with the sticky bit (nobody can then rename our entry in it); the file itself, and
the directory holding it or holding a symlink we follow, must not be group- or
world-writable at all (no sticky-bit exception: be strict where the file lives).

A path that does not exist (or cannot be read) is not judged here: the reader reports
it. ``None`` means trusted; otherwise a sentence saying why not.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Final, Literal

_MAX_SYMLINKS: Final = 40  # the kernel's limit
_OTHERS_WRITE: Final = stat.S_IWGRP | stat.S_IWOTH


def _writable_by_others(mode: int) -> str:
    who = [w for bit, w in ((stat.S_IWGRP, "group"), (stat.S_IWOTH, "world")) if mode & bit]
    return f"{'/'.join(who)}-writable (mode {stat.S_IMODE(mode):04o})"


def _owner_problem(path: Path, st: os.stat_result, what: str) -> str | None:
    uid = os.geteuid()
    if st.st_uid in (0, uid):
        return None
    return f"{what} {path} is owned by uid {st.st_uid}, not root or this process (uid {uid})"


def _walk(path: Path) -> tuple[Path, os.stat_result] | str:
    """Resolve ``path`` component by component, checking each; the real path and its
    stat, or the first problem."""
    pending = list(reversed(Path(os.getcwd(), path).parts))
    current, current_st = Path("/"), os.lstat("/")
    hops = 0
    while pending:
        part = pending.pop()
        if part == "/":
            current, current_st = Path("/"), os.lstat("/")
            continue
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent
            current_st = os.lstat(current)
            continue
        here = current / part
        st = os.lstat(here)
        if stat.S_ISLNK(st.st_mode):
            if current_st.st_mode & _OTHERS_WRITE:
                mode = _writable_by_others(current_st.st_mode)
                return f"reached through symlink {here}, in {current}, which is {mode}"
            if problem := _owner_problem(here, st, "symlink"):
                return f"reached through a {problem}"
            hops += 1
            if hops > _MAX_SYMLINKS:
                return f"too many levels of symlinks at {here}"
            pending.extend(reversed(Path(os.readlink(here)).parts))
            continue
        what = "directory" if stat.S_ISDIR(st.st_mode) else "file"
        if problem := _owner_problem(here, st, what):
            return problem
        if pending and stat.S_ISDIR(st.st_mode) and st.st_mode & _OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
            return f"directory {here} on the way is {_writable_by_others(st.st_mode)} without the sticky bit"
        current, current_st = here, st
    return current, current_st


def path_problem(path: Path, kind: Literal["file", "dir"] = "file") -> str | None:
    """Why someone other than root or this process's user could change what ``path``
    says, or None. ``kind="dir"``: a directory whose entries we read (hookserver.d)."""
    try:
        walked = _walk(path)
        if isinstance(walked, str):
            return walked
        real, st = walked
        if kind == "dir":
            if st.st_mode & _OTHERS_WRITE:
                return f"directory {real} is {_writable_by_others(st.st_mode)}: anyone can add files to it"
            return None
        if st.st_mode & _OTHERS_WRITE:
            return f"file {real} is {_writable_by_others(st.st_mode)}"
        parent_st = os.lstat(real.parent)
    except OSError:
        return None  # missing or unreadable: the reader says so, with the path
    if parent_st.st_mode & _OTHERS_WRITE:
        return f"file {real} lies in {real.parent}, which is {_writable_by_others(parent_st.st_mode)}"
    return None
