"""Draining a real kernel BPF hash map with plain bpf() calls (no bcc), both ways.

The map is created here with BPF_MAP_CREATE (needs root / CAP_BPF); where the kernel
refuses, the tests skip naming the errno.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from collections.abc import Iterator

import pytest

from metrics.collect import bpfmap
from metrics.collect.bpfmap import BpfMap

_MAP_CREATE = 0
_MAP_UPDATE_ELEM = 2
_HASH = 1
KEY, VALUE = struct.Struct("=QQ"), struct.Struct("=Q")


class _CreateAttr(ctypes.Structure):
    _fields_ = [("map_type", ctypes.c_uint32), ("key_size", ctypes.c_uint32), ("value_size", ctypes.c_uint32),
                ("max_entries", ctypes.c_uint32), ("map_flags", ctypes.c_uint32)]


def _create(max_entries: int) -> int:
    ret, err = bpfmap._bpf(_MAP_CREATE, _CreateAttr(_HASH, KEY.size, VALUE.size, max_entries, 0))
    if ret < 0:
        pytest.skip(f"the kernel refused BPF_MAP_CREATE here: {os.strerror(err)}")
    return ret


def _put(fd: int, key: bytes, value: bytes) -> None:
    k, v = ctypes.create_string_buffer(key, len(key)), ctypes.create_string_buffer(value, len(value))
    attr = bpfmap._ElemAttr(map_fd=fd, key=ctypes.addressof(k), value=ctypes.addressof(v), flags=0)
    ret, err = bpfmap._bpf(_MAP_UPDATE_ELEM, attr)
    assert ret == 0, os.strerror(err)


@pytest.fixture
def filled() -> Iterator[tuple[BpfMap, dict[bytes, bytes]]]:
    if bpfmap.syscall_number() is None:
        pytest.skip("no bpf() syscall number for this machine")
    fd = _create(4096)
    entries = {KEY.pack(1000 + i // 7, i % 7): VALUE.pack(i * 3) for i in range(3000)}
    for k, v in entries.items():
        _put(fd, k, v)
    bmap = BpfMap(fd, KEY.size, VALUE.size, 4096)
    yield bmap, entries
    bmap.close()


def test_batched_drain_returns_every_entry_once_and_empties_the_map(filled: tuple[BpfMap, dict[bytes, bytes]]) -> None:
    bmap, entries = filled
    got = bmap.drain()
    assert bmap.batch, "this kernel (>= 5.6) has the batched command"
    assert len(got) == len(entries) and dict(got) == entries
    assert bmap.drain() == []
    _put(bmap.fd, KEY.pack(1, 2), VALUE.pack(5))  # new events after a drain come in the next one
    assert bmap.drain() == [(KEY.pack(1, 2), VALUE.pack(5))]


def test_key_by_key_fallback_gives_the_same(filled: tuple[BpfMap, dict[bytes, bytes]]) -> None:
    bmap, entries = filled
    bmap.batch = False  # as on a kernel without BPF_MAP_LOOKUP_AND_DELETE_BATCH
    got = bmap.drain()
    assert len(got) == len(entries) and dict(got) == entries
    assert bmap.drain() == []


def test_a_bad_descriptor_is_an_error_naming_the_command() -> None:
    if bpfmap.syscall_number() is None:
        pytest.skip("no bpf() syscall number for this machine")
    bmap = BpfMap(_create(16), KEY.size, VALUE.size, 16)
    bmap.close()
    assert bmap.fd == -1
    with pytest.raises(bpfmap.BpfError) as info:
        BpfMap(10**6, KEY.size, VALUE.size, 16).drain()  # far above any descriptor in use
    assert info.value.errno == errno.EBADF and "BPF_MAP_LOOKUP_AND_DELETE_BATCH" in str(info.value)


def test_buffers_hold_one_batch_not_the_whole_map_and_small_batches_drain_it_all(
    filled: tuple[BpfMap, dict[bytes, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    bmap, entries = filled
    # A 16384-entry histogram map's buffers were sized for all of it: resident for nothing.
    assert ctypes.sizeof(bmap._keys) == KEY.size * bpfmap.BATCH < KEY.size * bmap.max_entries
    assert ctypes.sizeof(bmap._values) == VALUE.size * bpfmap.BATCH
    monkeypatch.setattr(bpfmap, "BATCH", 64)
    small = BpfMap(bmap.fd, KEY.size, VALUE.size, bmap.max_entries)  # 3000 entries: ~47 calls
    got = small.drain()
    assert small.batch and len(got) == len(entries) and dict(got) == entries
    assert small.drain() == []


def test_a_bucket_larger_than_a_batch_leaves_the_rest_to_the_key_by_key_drain(
    filled: tuple[BpfMap, dict[bytes, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One entry a batch: a bucket holding two (3000 entries in 4096 buckets: many do)
    makes the kernel answer ENOSPC, after earlier calls took entries out of the map or
    at the first; what was taken is kept and the rest is drained key by key, so nothing
    is lost (an error there lost every entry the drain had taken)."""
    bmap, entries = filled
    monkeypatch.setattr(bpfmap, "BATCH", 1)
    one = BpfMap(bmap.fd, KEY.size, VALUE.size, bmap.max_entries)
    calls: list[int] = []
    real = bpfmap._bpf

    def counted(cmd: int, attr: ctypes.Structure) -> tuple[int, int]:
        ret, err = real(cmd, attr)
        if cmd == bpfmap._MAP_LOOKUP_AND_DELETE_BATCH:
            calls.append(err if ret < 0 else 0)
        return ret, err

    monkeypatch.setattr(bpfmap, "_bpf", counted)
    got = one.drain()
    assert errno.ENOSPC in calls, calls[:10]
    assert len(got) == len(entries) and dict(got) == entries
    assert one.drain() == []
