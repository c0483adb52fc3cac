"""On this kernel's real v1 memory cgroup: memory.numa_stat gives the same "used" as
memory.stat, and its page cache leaves out shmem (which memory.stat's total_cache
counts although the same pages are on the anon LRU, i.e. in "used" too).

The pod collector reads memory.numa_stat on v1 for its lower cost; this pins that the
switch changes nothing but the double-counted shmem.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from metrics.collect.cgroupfs import CgroupReader

MIB = 1 << 20
SHMEM = 8 * MIB
ANON = 16 * MIB

_CHILD = f"""
import sys
shm = open(sys.argv[1], "wb")
shm.write(b"s" * {SHMEM}); shm.flush()
held = bytearray(b"a" * {ANON})
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def cgroup(cgroup_prefix: str) -> Iterator[tuple[CgroupReader, str]]:
    reader = CgroupReader(Path("/sys/fs/cgroup"))
    if not reader.numa_stat:
        pytest.skip("this kernel's v1 memory.numa_stat has no hierarchical totals (or no v1 memory)")
    rel = f"{cgroup_prefix}/numa-check-{uuid.uuid4().hex[:8]}"
    directory = reader.memory_dir(rel)
    directory.mkdir(parents=True)
    try:
        yield reader, rel
    finally:
        deadline = time.monotonic() + 5
        while True:  # a memory cgroup stays busy for a moment after its last task exits
            try:
                directory.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def _stat_used_and_cache(data: bytes) -> tuple[int, int]:
    fields = dict(line.split() for line in data.decode().splitlines())
    used = sum(int(fields[k]) for k in ("total_inactive_anon", "total_active_anon", "total_unevictable"))
    return used, int(fields["total_cache"])


def test_numa_stat_used_equals_memory_stat_and_its_cache_leaves_out_shmem(
        cgroup: tuple[CgroupReader, str]) -> None:
    reader, rel = cgroup
    directory = reader.memory_dir(rel)
    shm = Path(f"/dev/shm/koord-test-{uuid.uuid4().hex[:8]}")
    with subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(shm)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            preexec_fn=lambda: (directory / "cgroup.procs").write_text(str(os.getpid()))) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
            numa_used, numa_cache, stat_used, stat_cache = _read_both(reader, rel)
        finally:
            child.kill()
            shm.unlink(missing_ok=True)
    assert numa_used == stat_used
    assert numa_used >= SHMEM + ANON, "shmem sits on the anon LRU, so it is in used"
    assert stat_cache - numa_cache == pytest.approx(SHMEM, abs=MIB), \
        "total_cache counts the shmem a second time; the file LRU does not"


def _read_both(reader: CgroupReader, rel: str) -> tuple[int, int, int, int]:
    """(used, cache) from memory.numa_stat, then from memory.stat. The child is idle, but
    rstat flushing may still lag a read, so a pair that agrees on used is taken."""
    numa_file = reader.memory_file(rel)
    assert numa_file.endswith("/memory.numa_stat")
    for _ in range(20):
        numa_used, numa_cache = reader.parse_memory(Path(numa_file).read_bytes(), numa_file)
        stat_used, stat_cache = _stat_used_and_cache((reader.memory_dir(rel) / "memory.stat").read_bytes())
        if numa_used == stat_used:
            break
        time.sleep(0.1)
    return numa_used, numa_cache, stat_used, stat_cache
