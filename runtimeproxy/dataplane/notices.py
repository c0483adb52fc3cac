"""Noticed calls: the lifecycle calls HAProxy sends straight to containerd, told to us after.

A lifecycle call with no Pre hook (say StartContainer, StopPodSandbox with the shipped
chain) need not wait for Python: nothing may change or refuse its request. HAProxy relays
it to containerd and, once the reply is done, logs one line about it into a ring that it
forwards over a unix stream socket to this server (``runtimeproxy.dataplane.haproxy``): method, HTTP
status, the grpc-status of a trailers-only reply, termination state and the request body
in hex. ``Lifecycle.notice`` then updates the store and runs the call's Post hooks, as it
does after an intercepted call; a Post hook cannot change a reply in either case.

The lines are read on the event loop (``add_reader``, non-blocking): a few per pod
lifecycle. ``catch_up()`` reads whatever has arrived, synchronously, so a Pre stage sees
the Post stages of the calls answered before it (the line of an earlier call is written
before the reply reaches kubelet, so before kubelet's next call can reach us).
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc
import structlog

from runtimeproxy.hookapi import CallResult
from runtimeproxy.ops.logsetup import Throttle

log = structlog.get_logger("runtimeproxy.notices")

#: A line longer than this (HAProxy's ring holds at most 64 KiB a line) is dropped.
MAX_LINE: Final = 1 << 17
_CODES: Final = {code.value[0]: code.name for code in grpc.StatusCode}


class NoticeError(ValueError):
    """A line that is not a noticed call; the message names the field and value."""


@dataclass(frozen=True, slots=True)
class Notice:
    """One answered call: its full method path, the request message, how it ended."""

    method: str
    payload: bytes
    result: CallResult


def parse(line: bytes, methods: frozenset[str]) -> Notice:
    """A notice from one line (without its newline); ``methods``: the paths we act on."""
    fields = line.decode("ascii", "replace").split(" ")
    if len(fields) != 5:
        raise NoticeError(f"expected 5 space-separated fields, got {len(fields)}: {_clip(line)!r}")
    method, http_status, grpc_status, ended, body = fields
    if method not in methods:
        raise NoticeError(f"method: not a lifecycle method: {method[:120]!r}")
    return Notice(method, _message(body), _result(http_status, grpc_status, ended))


def _result(http_status: str, grpc_status: str, ended: str) -> CallResult:
    if grpc_status not in ("-", "", "0"):
        if not grpc_status.isdigit() or int(grpc_status) not in _CODES:
            raise NoticeError(f"grpc-status: not a gRPC status code: {grpc_status[:40]!r}")
        return CallResult(False, _CODES[int(grpc_status)], "")
    if http_status != "200":
        # HAProxy's own answer (no server, a timeout): the call may not have reached containerd.
        return CallResult(False, "UNAVAILABLE", f"HTTP status {http_status[:20]} from the data plane")
    if ended != "--":
        # Aborted (kubelet's deadline, a connection lost): containerd may or may not have done it.
        return CallResult(False, "UNKNOWN", f"the call's stream ended abnormally (HAProxy state {ended[:20]})")
    return CallResult(True)


def _message(body: str) -> bytes:
    """The protobuf message of a gRPC-framed request body in hex (one uncompressed message)."""
    try:
        framed = bytes.fromhex(body)
    except ValueError:
        raise NoticeError(f"body: not hex: {body[:40]!r}") from None
    if len(framed) < 5 or framed[0] != 0:
        raise NoticeError(f"body: not one uncompressed gRPC message: {framed[:8].hex()!r}")
    size = int.from_bytes(framed[1:5], "big")
    if size != len(framed) - 5:
        raise NoticeError(f"body: gRPC frame of {size} bytes, {len(framed) - 5} received (cut short?)")
    return framed[5:]


def _clip(line: bytes) -> bytes:
    return line[:120]


class NoticeServer:
    """Listens on ``path`` (mode 0600, in the data plane's private directory) and hands
    every complete line to ``handle`` in the order received."""

    def __init__(self, path: Path, methods: frozenset[str], handle: Callable[[Notice], None]) -> None:
        self.path = path
        self._methods = methods
        self._handle = handle
        self._listener: socket.socket | None = None
        self._conns: dict[int, tuple[socket.socket, bytearray]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._throttle = Throttle(60.0)
        self.received = 0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                self.path.unlink()  # our own, left by a previous run
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
            os.chmod(self.path, 0o600)
            listener.listen(8)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._loop.add_reader(listener.fileno(), self._accept)

    def _accept(self) -> None:
        assert self._listener is not None and self._loop is not None
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(False)
        self._conns[conn.fileno()] = (conn, bytearray())
        self._loop.add_reader(conn.fileno(), self._read, conn.fileno())

    def catch_up(self) -> None:
        """Read and handle every line already received (before a Pre stage runs)."""
        for fd in list(self._conns):
            self._read(fd)

    def _read(self, fd: int) -> None:
        entry = self._conns.get(fd)
        if entry is None:
            return
        conn, buf = entry
        while True:
            try:
                chunk = conn.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                self._close(fd)  # HAProxy reconnects (a reload's new worker, a restart)
                break
            buf += chunk
        self._lines(buf)

    def _lines(self, buf: bytearray) -> None:
        while (end := buf.find(b"\n")) >= 0:
            line = bytes(buf[:end])
            del buf[: end + 1]
            self._one(line)
        if len(buf) > MAX_LINE:
            self._rejected(f"a line over {MAX_LINE} bytes, dropped")
            buf.clear()

    def _one(self, line: bytes) -> None:
        if not line:
            return
        try:
            notice = parse(line, self._methods)
        except NoticeError as exc:
            self._rejected(str(exc))
            return
        self.received += 1
        try:
            contextvars.copy_context().run(self._handle, notice)  # its log bindings stay its own
        except Exception:
            log.exception("notice_failed", method=notice.method)

    def _rejected(self, reason: str) -> None:
        # Only HAProxy writes here; a bad line is a bug or a version skew: say so, once a minute.
        held = self._throttle.allow("rejected")
        if held is not None:
            log.warning("notice_rejected", reason=reason, repeats_suppressed=held)

    def _close(self, fd: int) -> None:
        entry = self._conns.pop(fd, None)
        if entry is None:
            return
        if self._loop is not None:
            self._loop.remove_reader(fd)
        entry[0].close()

    def close(self) -> None:
        """Handle what has arrived, then stop listening (HAProxy's ring keeps the rest)."""
        self.catch_up()
        for fd in list(self._conns):
            self._close(fd)
        if self._listener is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            self.path.unlink(missing_ok=True)
