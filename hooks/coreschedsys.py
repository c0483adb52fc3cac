"""The kernel boundary of core scheduling: ``prctl(PR_SCHED_CORE, ...)``.

Core scheduling (Linux >= 5.14, ``CONFIG_SCHED_CORE``) lets only tasks that share
a *cookie* run at the same time on the SMT siblings of a core, so a BE task never
runs next to an LS task of another group (no cross-HT interference, no side
channel). Cookies are set with prctl; every sub-command acts relative to the
*calling thread* (``Documentation/admin-guide/hw-vuln/core-scheduling.rst``):

* ``GET pid`` — the cookie of thread ``pid`` (0 = the default: no cookie);
* ``CREATE pid scope`` — a new unique cookie for ``pid``'s thread / thread group;
* ``SHARE_TO pid scope`` — push the calling thread's cookie to ``pid`` (a calling
  thread with cookie 0 thereby *clears* the target);
* ``SHARE_FROM pid`` — the calling thread takes ``pid``'s cookie.

``CoreSchedSys`` is that interface, typed and small, so the hook's logic is tested
with a fake that records calls; ``LibcCoreSched`` is the real one (ctypes
``libc.prctl``). ``CookieOps`` builds koordlet's operations on it (``Create``,
``Assign`` = SHARE_FROM the source then SHARE_TO each target, ``Clear``) and runs
the sharing in a short-lived thread of its own: the cookie it picks up dies with
it, so no thread of this process keeps a pod's cookie (koordlet locks an OS
thread and resets it instead). ``detect`` asks the kernel once whether any of it
works: on a kernel without core scheduling prctl answers ``EINVAL``.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, TypeVar

PR_SCHED_CORE: Final = 62
PR_SCHED_CORE_GET: Final = 0
PR_SCHED_CORE_CREATE: Final = 1
PR_SCHED_CORE_SHARE_TO: Final = 2
PR_SCHED_CORE_SHARE_FROM: Final = 3
DEFAULT_COOKIE: Final = 0

T = TypeVar("T")


class Scope(enum.IntEnum):
    """``pid_type`` of the prctl: one thread, its thread group (process), its process group."""

    THREAD = 0
    THREAD_GROUP = 1
    PROCESS_GROUP = 2


class CoreSchedSys(Protocol):
    """``prctl(PR_SCHED_CORE, ...)``; every method raises ``OSError`` (with errno) on failure."""

    def get(self, pid: int) -> int:
        """The cookie of thread ``pid`` (0: the calling thread)."""

    def create(self, pid: int, scope: Scope) -> None:
        """A new cookie for ``pid`` (its thread group with ``Scope.THREAD_GROUP``)."""

    def share_to(self, pid: int, scope: Scope) -> None:
        """The calling thread's cookie to ``pid`` (0 clears it)."""

    def share_from(self, pid: int) -> None:
        """The calling thread takes thread ``pid``'s cookie."""


class LibcCoreSched:
    """The real boundary: ``prctl`` from the C library, through ctypes."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._prctl = libc.prctl
        self._prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        self._prctl.restype = ctypes.c_int

    def _call(self, command: int, pid: int, scope: int, arg5: int = 0) -> None:
        if self._prctl(PR_SCHED_CORE, command, pid, scope, arg5) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"prctl(PR_SCHED_CORE, {command}, {pid}, {scope}): {os.strerror(code)}")

    def get(self, pid: int) -> int:
        cookie = ctypes.c_ulong(0)
        self._call(PR_SCHED_CORE_GET, pid, Scope.THREAD, ctypes.addressof(cookie))
        return int(cookie.value)

    def create(self, pid: int, scope: Scope) -> None:
        self._call(PR_SCHED_CORE_CREATE, pid, scope)

    def share_to(self, pid: int, scope: Scope) -> None:
        self._call(PR_SCHED_CORE_SHARE_TO, pid, scope)

    def share_from(self, pid: int) -> None:
        self._call(PR_SCHED_CORE_SHARE_FROM, pid, Scope.THREAD)


@dataclass(frozen=True, slots=True)
class Support:
    supported: bool
    detail: str


def detect(sys: CoreSchedSys) -> Support:
    """Whether this kernel does core scheduling: one ``GET`` of the calling thread."""
    try:
        own = sys.get(0)
    except OSError as exc:
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        if exc.errno == errno.EINVAL:
            why = "no core scheduling in this kernel (needs Linux >= 5.14 with CONFIG_SCHED_CORE)"
        elif exc.errno == errno.ENODEV:
            why = "SMT is off or absent: core scheduling has no sibling to isolate"
        else:
            why = "core scheduling is not usable here"
        return Support(False, f"prctl(PR_SCHED_CORE, GET) answered {name}: {why}")
    if own != DEFAULT_COOKIE:
        return Support(True, f"prctl(PR_SCHED_CORE) works; note: this agent's thread has cookie {own:#x}, "
                             "not the default (run it outside any core-sched group)")
    return Support(True, "prctl(PR_SCHED_CORE) works")


def _in_fresh_thread(work: Callable[[], T]) -> T:
    """Run ``work`` in a new thread and wait: whatever cookie it takes ends with it."""
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(work())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)

    thread = threading.Thread(target=run, name="core-sched-share", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


def _gone(exc: OSError) -> bool:
    return exc.errno in (errno.ESRCH, errno.ENOENT)


class CookieOps:
    """koordlet's cookie operations (``CoreSchedExtendedInterface``) on a ``CoreSchedSys``."""

    def __init__(self, sys: CoreSchedSys) -> None:
        self.sys = sys

    def get(self, pid: int) -> int | None:
        """The cookie of ``pid``; None when the process is gone or cannot be read."""
        try:
            return self.sys.get(pid)
        except OSError:
            return None

    def create(self, pid: int) -> int:
        """A new cookie for ``pid``'s thread group; returns it. Raises OSError."""
        self.sys.create(pid, Scope.THREAD_GROUP)
        return self.sys.get(pid)

    def assign(self, source: int, targets: Sequence[int]) -> list[int]:
        """``source``'s cookie to every target's thread group; returns the targets that failed.
        Raises OSError when the cookie of ``source`` cannot be taken."""
        if not targets:
            return []

        def work() -> list[int]:
            self.sys.share_from(source)
            failed: list[int] = []
            for pid in targets:
                try:
                    self.sys.share_to(pid, Scope.THREAD_GROUP)
                except OSError:
                    failed.append(pid)
            return failed

        return _in_fresh_thread(work)

    def clear(self, targets: Sequence[int]) -> list[int]:
        """The default cookie to every target's thread group; returns the targets that failed."""
        if not targets:
            return []

        def work() -> list[int]:
            own = self.sys.get(0)
            if own != DEFAULT_COOKIE:  # inherited from the calling thread: would spread it
                raise OSError(errno.EPERM, f"the clearing thread has cookie {own:#x}, not the default")
            failed: list[int] = []
            for pid in targets:
                try:
                    self.sys.share_to(pid, Scope.THREAD_GROUP)
                except OSError as exc:
                    if not _gone(exc):
                        failed.append(pid)
            return failed

        return _in_fresh_thread(work)
