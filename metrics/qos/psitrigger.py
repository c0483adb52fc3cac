"""PSI triggers: let the kernel wake the fast path when CPU pressure builds up.

A trigger is registered by writing ``"<some|full> <stall us> <window us>"`` to a
pressure file opened read-write (``/proc/pressure/cpu``, a v2 cgroup's
``cpu.pressure``); the fd then reports POLLPRI whenever tasks stalled for
``stall`` within a ``window``. Kernel rules (Documentation/accounting/psi.rst):
window 500 ms..10 s, stall <= window, one trigger per fd, and a writer without
CAP_SYS_RESOURCE must use a window that is a multiple of 2 s (EINVAL otherwise).
The string is written with its NUL: the kernel overwrites the last byte written.

Where registration fails (no PSI, a kernel refusing triggers, EINVAL for an
unprivileged writer) the trigger is returned disabled with the reason, logged
once (``psi_trigger_unavailable``); the fast path then just keeps its timer.
On EINVAL the registration is retried once with the window widened to the next
2 s multiple and the stall scaled to keep the same ratio, so an unprivileged
agent still gets its wake-ups (``widen_unprivileged=False`` turns that off).

Waiting costs no thread: the trigger fds sit in one epoll whose own fd is
watched by the event loop (epoll turns POLLPRI into readability).
"""

from __future__ import annotations

import asyncio
import errno
import math
import os
import select
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

import structlog

from runtimeproxy.errors import InputError

log = structlog.get_logger("metrics.qos.psitrigger")

MIN_WINDOW_US: Final = 500_000
MAX_WINDOW_US: Final = 10_000_000
UNPRIVILEGED_STEP_US: Final = 2_000_000


class TriggerSpecError(InputError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class TriggerSpec:
    kind: str = "some"
    stall_us: int = 150_000
    window_us: int = 1_000_000

    def __post_init__(self) -> None:
        if self.kind not in ("some", "full"):
            raise TriggerSpecError(f"PSI trigger kind {self.kind!r}: must be some or full")
        if not MIN_WINDOW_US <= self.window_us <= MAX_WINDOW_US:
            raise TriggerSpecError(f"PSI trigger window {self.window_us} us: must be in "
                                   f"[{MIN_WINDOW_US}, {MAX_WINDOW_US}]")
        if not 0 < self.stall_us <= self.window_us:
            raise TriggerSpecError(f"PSI trigger stall {self.stall_us} us: must be in (0, window {self.window_us}]")

    @classmethod
    def parse(cls, text: str) -> TriggerSpec:
        """``"some 150000 1000000"`` -> TriggerSpec; TriggerSpecError when malformed."""
        fields = text.split()
        if len(fields) != 3 or not fields[1].isdigit() or not fields[2].isdigit():
            raise TriggerSpecError(f"PSI trigger {text!r}: expected '<some|full> <stall us> <window us>'")
        return cls(fields[0], int(fields[1]), int(fields[2]))

    def line(self) -> bytes:
        return f"{self.kind} {self.stall_us} {self.window_us}".encode() + b"\0"

    def widened(self) -> TriggerSpec | None:
        """The same stall ratio on a window an unprivileged writer may use; None if
        the window already qualifies (widening cannot help then)."""
        window = math.ceil(self.window_us / UNPRIVILEGED_STEP_US) * UNPRIVILEGED_STEP_US
        if window == self.window_us or window > MAX_WINDOW_US:
            return None
        return replace(self, window_us=window, stall_us=self.stall_us * window // self.window_us)


@dataclass(frozen=True, slots=True)
class PsiTrigger:
    """A registered trigger (``fd`` set) or a disabled one with the reason."""

    path: Path
    spec: TriggerSpec
    fd: int | None
    reason: str = ""
    errno: int | None = None

    @property
    def enabled(self) -> bool:
        return self.fd is not None


def _register(path: Path, spec: TriggerSpec) -> tuple[int | None, OSError | None]:
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return None, exc
    try:
        os.write(fd, spec.line())
    except OSError as exc:
        os.close(fd)
        return None, exc
    return fd, None


def open_trigger(path: Path, spec: TriggerSpec = TriggerSpec(), *, widen_unprivileged: bool = True) -> PsiTrigger:
    """Register ``spec`` on ``path``; never raises for the host's refusal (see module doc)."""
    fd, error = _register(path, spec)
    if fd is not None:
        return PsiTrigger(path, spec, fd)
    assert error is not None
    wider = spec.widened() if widen_unprivileged and error.errno == errno.EINVAL else None
    if wider is not None:
        fd, _ = _register(path, wider)
        if fd is not None:
            return PsiTrigger(path, wider, fd, reason=f"window widened from {spec.window_us} us (unprivileged)")
    name = errno.errorcode.get(error.errno or 0, str(error.errno))
    return PsiTrigger(path, spec, None, reason=f"{name}: {error.strerror}", errno=error.errno)


class PsiTriggers:
    """The agent's triggers: registers them, reports each unavailable path once,
    and calls ``on_fire`` from the event loop whenever one fires."""

    def __init__(self, spec: TriggerSpec = TriggerSpec(), *, widen_unprivileged: bool = True) -> None:
        self.spec = spec
        self.widen_unprivileged = widen_unprivileged
        self.triggers: list[PsiTrigger] = []
        self._reported: set[Path] = set()
        self._epoll: select.epoll | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.fired = 0

    def register(self, path: Path) -> PsiTrigger:
        trigger = open_trigger(path, self.spec, widen_unprivileged=self.widen_unprivileged)
        if trigger.enabled:
            self.triggers.append(trigger)
            log.info("psi_trigger_registered", path=str(path), trigger=trigger.spec.line()[:-1].decode(),
                     note=trigger.reason or None)
        elif path not in self._reported:
            self._reported.add(path)
            log.info("psi_trigger_unavailable", path=str(path), errno=trigger.errno, reason=trigger.reason)
        return trigger

    def start(self, loop: asyncio.AbstractEventLoop, on_fire: Callable[[], None]) -> bool:
        """Watch the enabled triggers; False when there is none to watch."""
        fds = [t.fd for t in self.triggers if t.fd is not None]
        if not fds:
            return False
        self._epoll = select.epoll()
        for fd in fds:
            self._epoll.register(fd, select.EPOLLPRI)
        self._loop = loop

        def ready() -> None:
            # The loop's own poll of our epoll already consumed the PSI event (a
            # PSI fd's poll resets it), so readability itself is the firing; the
            # inner poll only drains whatever else is pending.
            assert self._epoll is not None
            self._epoll.poll(0)
            self.fired += 1
            on_fire()

        loop.add_reader(self._epoll.fileno(), ready)
        return True

    def close(self) -> None:
        if self._epoll is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._epoll.fileno())
            self._epoll.close()
            self._epoll = None
        for trigger in self.triggers:
            if trigger.fd is not None:
                os.close(trigger.fd)
        self.triggers = []
