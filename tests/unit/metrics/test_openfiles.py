"""Files kept open and re-read with pread: fresh content every read, a removed cgroup
is "gone", the descriptor cap holds, and descriptors of departed targets are closed."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from metrics.collect.base import ReadError
from metrics.collect.openfiles import OpenFiles

MEMORY = Path("/sys/fs/cgroup/memory")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_each_read_sees_the_current_content_through_one_descriptor(tmp_path: Path) -> None:
    f = tmp_path / "cpuacct.usage"
    f.write_text("100\n")
    files = OpenFiles(limit=10)
    before = _fds()
    assert files.read(str(f)) == b"100\n"
    f.write_text("250\n")  # rewritten in place, as the kernel regenerates a seq file
    assert files.read(str(f)) == b"250\n"
    assert len(files) == 1 and _fds() == before + 1
    files.close()
    assert len(files) == 0 and _fds() == before


def test_the_cap_falls_back_to_open_per_read_and_retain_closes_the_rest(tmp_path: Path) -> None:
    paths = []
    for i in range(5):
        (tmp_path / f"f{i}").write_text(f"{i}\n")
        paths.append(str(tmp_path / f"f{i}"))
    files = OpenFiles(limit=3)
    assert [files.read(p) for p in paths] == [f"{i}\n".encode() for i in range(5)]
    assert len(files) == 3
    files.retain(paths[1:2])
    assert len(files) == 1
    with pytest.raises(ReadError) as info:
        files.read(str(tmp_path / "missing"))
    assert info.value.gone


@pytest.mark.skipif(os.geteuid() != 0 or not MEMORY.is_dir(), reason="needs root and the v1 memory hierarchy")
def test_a_removed_cgroup_reads_as_gone_and_its_descriptor_is_dropped() -> None:
    d = MEMORY / f"koord-test-{uuid.uuid4().hex[:12]}"
    d.mkdir()
    try:
        files = OpenFiles(limit=10)
        assert b"cache " in files.read(str(d / "memory.stat"))
        d.rmdir()  # an open descriptor does not keep the cgroup
        with pytest.raises(ReadError) as info:
            files.read(str(d / "memory.stat"))
        assert info.value.gone and len(files) == 0
    finally:
        if d.exists():
            d.rmdir()
