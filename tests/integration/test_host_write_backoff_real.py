"""On this host's real v1 cpu cgroup: a child quota above its parent's is refused
by the kernel with EINVAL; the executor backs off (same value, same cause) and
warns once, and the write goes through as soon as the parent allows it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest
from structlog.testing import capture_logs

from hooks.cgroups import CPU_CFS_QUOTA, CgroupError, CgroupLayout
from hooks.executor import CgroupExecutor, Update, WriteBackedOffError
from runtimeproxy.services import FailureCounter, WriteBackoff

ROOT = Path("/sys/fs/cgroup")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def parent_child(cgroup_prefix: str) -> Iterator[tuple[PurePosixPath, PurePosixPath]]:
    if not (ROOT / "cpu" / "cpu.cfs_quota_us").is_file():
        pytest.skip("no cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    parent = PurePosixPath(cgroup_prefix.strip("/"), "backoff")
    child = parent / "child"
    (ROOT / "cpu" / child).mkdir(parents=True)
    try:
        yield parent, child
    finally:
        (ROOT / "cpu" / child).rmdir()
        (ROOT / "cpu" / parent).rmdir()


def test_einval_from_the_kernel_is_backed_off_and_warned_once(
        parent_child: tuple[PurePosixPath, PurePosixPath]) -> None:
    parent, child = parent_child
    clock, counter = Clock(), FailureCounter()
    ex = CgroupExecutor(CgroupLayout(ROOT, 1), backoff=WriteBackoff(clock=clock, counter=counter))
    ex.apply([Update(parent, CPU_CFS_QUOTA, 50000, "parent limit")])
    errors: list[CgroupError] = []
    with capture_logs() as logs:
        for _ in range(50):  # every 100 ms for 5 s
            with pytest.raises(CgroupError) as info:
                ex.apply([Update(child, CPU_CFS_QUOTA, 100000, "child above its parent")])
            errors.append(info.value)
            clock.now += 0.1
        assert counter.counts() == {"EINVAL": 3}  # the kernel was asked at t = 0, 1, 3 s only
        assert sum(isinstance(e, WriteBackedOffError) for e in errors) == 47
        assert "Invalid argument" in str(errors[0]) and not errors[0].repeat
        assert all(e.repeat for e in errors[1:])
        ex.apply([Update(parent, CPU_CFS_QUOTA, 200000, "parent grows")])
        clock.now += 10
        ex.apply([Update(child, CPU_CFS_QUOTA, 100000, "child fits now")])
    assert [(e["event"], e.get("cause")) for e in logs if e["event"].startswith("host_write")] == [
        ("host_write_failed", "EINVAL"), ("host_write_recovered", "EINVAL")
    ]
    assert (ROOT / "cpu" / child / "cpu.cfs_quota_us").read_text().strip() == "100000"
