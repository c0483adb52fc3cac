"""Read (and empty) a BPF hash map through the ``bpf()`` system call, without bcc.

The eBPF schedule-latency program is compiled by bcc in a short-lived child process
(``metrics.collect.ebpfload``): LLVM takes over 100 MiB that a long-running agent
must not keep. The child hands over the map file descriptors and exits; this module
is all the agent needs to drain those maps afterwards: plain ``ctypes`` and two
commands (a batched lookup-and-delete, with a key-by-key fallback for kernels older
than 5.6).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from dataclasses import dataclass
from typing import Final

from runtimeproxy.errors import HostError

#: ``__NR_bpf`` per machine; elsewhere the eBPF source says it is unavailable.
SYSCALL_NR: Final = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351}

_MAP_LOOKUP_ELEM: Final = 1
_MAP_DELETE_ELEM: Final = 3
_MAP_GET_NEXT_KEY: Final = 4
_MAP_LOOKUP_AND_DELETE_BATCH: Final = 25
_ENOTSUPP: Final = 524  # the kernel's internal "not supported", seen by user space as is
#: Entries fetched per batched call. Buffers for a map's ``max_entries`` (16384 histogram
#: keys) were 1.1 MiB resident for the two programs' maps and a drain copied them whole;
#: a hash map's batch stops at a bucket that no longer fits, and a bucket holds a few
#: entries, so this only means more calls for a larger map (issue 29).
BATCH: Final = 512


class BpfError(HostError):
    def __init__(self, what: str, err: int) -> None:
        super().__init__(f"{what}: {os.strerror(err)} (errno {err})")
        self.errno = err


class _ElemAttr(ctypes.Structure):
    _fields_ = [("map_fd", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("key", ctypes.c_uint64),
                ("value", ctypes.c_uint64), ("flags", ctypes.c_uint64)]


class _BatchAttr(ctypes.Structure):
    _fields_ = [("in_batch", ctypes.c_uint64), ("out_batch", ctypes.c_uint64), ("keys", ctypes.c_uint64),
                ("values", ctypes.c_uint64), ("count", ctypes.c_uint32), ("map_fd", ctypes.c_uint32),
                ("elem_flags", ctypes.c_uint64), ("flags", ctypes.c_uint64)]


def syscall_number() -> int | None:
    return SYSCALL_NR.get(platform.machine())


_libc = ctypes.CDLL(None, use_errno=True)


def _bpf(cmd: int, attr: ctypes.Structure) -> tuple[int, int]:
    nr = syscall_number()
    if nr is None:
        return -1, errno.ENOSYS
    ret = _libc.syscall(ctypes.c_long(nr), ctypes.c_int(cmd), ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr)))
    return ret, (ctypes.get_errno() if ret < 0 else 0)


@dataclass
class BpfMap:
    """A hash map by file descriptor; buffers are sized once, for ``BATCH`` entries at most."""

    fd: int
    key_size: int
    value_size: int
    max_entries: int
    #: False after the kernel refused the batched command (then key by key).
    batch: bool = True

    def __post_init__(self) -> None:
        self._capacity = max(min(self.max_entries, BATCH), 1)
        self._keys = ctypes.create_string_buffer(self.key_size * self._capacity)
        self._values = ctypes.create_string_buffer(self.value_size * self._capacity)
        self._cursor = ctypes.create_string_buffer(8)  # a hash map's batch token is a u32 bucket
        self._next = ctypes.create_string_buffer(8)

    def drain(self) -> list[tuple[bytes, bytes]]:
        """Every entry, each removed as it is read (so no interval is counted twice)."""
        if self.batch:
            try:
                return self._drain_batch()
            except BpfError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOSYS, _ENOTSUPP, errno.EOPNOTSUPP):
                    raise
                self.batch = False
        return self._drain_each()

    def _drain_batch(self) -> list[tuple[bytes, bytes]]:
        out: list[tuple[bytes, bytes]] = []
        attr = _BatchAttr(keys=ctypes.addressof(self._keys), values=ctypes.addressof(self._values), map_fd=self.fd)
        first = True
        while True:
            attr.in_batch = 0 if first else ctypes.addressof(self._cursor)
            attr.out_batch = ctypes.addressof(self._next)
            attr.count = self._capacity
            ret, err = _bpf(_MAP_LOOKUP_AND_DELETE_BATCH, attr)
            if ret < 0 and err == errno.ENOSPC:
                # A bucket holds more entries than a batch (this call took nothing): the
                # rest key by key, keeping what earlier calls took out of the map.
                return out + self._drain_each()
            if ret < 0 and err != errno.ENOENT:
                raise BpfError("BPF_MAP_LOOKUP_AND_DELETE_BATCH", err)
            out += self._entries(attr.count)
            if ret < 0:  # ENOENT: the map has been walked to its end
                return out
            ctypes.memmove(self._cursor, self._next, 8)
            first = False

    def _entries(self, n: int) -> list[tuple[bytes, bytes]]:
        ks, vs = self.key_size, self.value_size
        keys = ctypes.string_at(self._keys, n * ks)  # only what this batch filled
        values = ctypes.string_at(self._values, n * vs)
        return [(keys[i * ks:(i + 1) * ks], values[i * vs:(i + 1) * vs]) for i in range(n)]

    def _drain_each(self) -> list[tuple[bytes, bytes]]:
        """Keys first, then lookup + delete each: an event landing between the two is lost."""
        keys: list[bytes] = []
        key = ctypes.create_string_buffer(self.key_size)
        prev: ctypes.Array[ctypes.c_char] | None = None  # NULL: start at the first key
        while True:
            attr = _ElemAttr(map_fd=self.fd, key=0 if prev is None else ctypes.addressof(prev),
                             value=ctypes.addressof(key))
            ret, err = _bpf(_MAP_GET_NEXT_KEY, attr)
            if ret < 0:
                if err == errno.ENOENT:
                    break
                raise BpfError("BPF_MAP_GET_NEXT_KEY", err)
            keys.append(key.raw)
            prev = ctypes.create_string_buffer(key.raw, self.key_size)
        out: list[tuple[bytes, bytes]] = []
        value = ctypes.create_string_buffer(self.value_size)
        for raw in keys:
            kbuf = ctypes.create_string_buffer(raw, self.key_size)
            look = _ElemAttr(map_fd=self.fd, key=ctypes.addressof(kbuf), value=ctypes.addressof(value))
            ret, err = _bpf(_MAP_LOOKUP_ELEM, look)
            if ret == 0:
                out.append((raw, value.raw))
                _bpf(_MAP_DELETE_ELEM, _ElemAttr(map_fd=self.fd, key=ctypes.addressof(kbuf)))
            elif err != errno.ENOENT:
                raise BpfError("BPF_MAP_LOOKUP_ELEM", err)
        return out

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
