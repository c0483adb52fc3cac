"""A host write that keeps failing the same way is backed off and warned about
once (plus a rate-limited reminder), not on every tick; success clears it; a
different cause warns again. The kernel's refusal is injected at the syscall
boundary (``_write`` raises as it does for an OSError), the clock is a fake."""

from __future__ import annotations

import errno
from collections.abc import Iterator, MutableMapping
from pathlib import Path, PurePosixPath
from typing import Any

import prometheus_client
import pytest
from structlog.testing import capture_logs

from hooks import executor as executor_mod
from hooks.cgroups import CPU_CFS_QUOTA, CPU_SHARES, CgroupError, CgroupLayout
from hooks.executor import CgroupExecutor, Update, WriteBackedOffError
from runtimeproxy.hostwrites import FailureCollector
from runtimeproxy.services import FailureCounter, WriteBackoff

POD = PurePosixPath("kubepods/besteffort/pod1")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Kernel:
    """Stands in for the write syscall: refuses with ``errno`` while set, else writes."""

    def __init__(self) -> None:
        self.errno: int | None = errno.EINVAL
        self.attempts = 0

    def write(self, path: Path, text: str, source: str) -> None:
        self.attempts += 1
        if self.errno is None:
            path.write_text(text)
            return
        os_error = OSError(self.errno, "refused")
        raise CgroupError(f"{source}: writing {text!r} to {path} refused: {os_error.strerror}") from os_error


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[Kernel]:
    k = Kernel()
    monkeypatch.setattr(executor_mod, "_write", k.write)
    yield k


def _setup(tmp_path: Path) -> tuple[CgroupExecutor, Clock, FailureCounter, Path]:
    root = tmp_path / "cg"
    (root / POD).mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu\n")
    (root / POD / "cpu.weight").write_text("100\n")
    clock, counter = Clock(), FailureCounter()
    ex = CgroupExecutor(CgroupLayout(root, 2), backoff=WriteBackoff(clock=clock, counter=counter))
    return ex, clock, counter, root / POD / "cpu.weight"


def _events(logs: list[MutableMapping[str, Any]], prefix: str = "host_write") -> list[tuple[str, str]]:
    return [(e["event"], e["log_level"]) for e in logs if e["event"].startswith(prefix)]


def _try(ex: CgroupExecutor, shares: int = 512) -> CgroupError | None:
    try:
        ex.apply([Update(POD, CPU_SHARES, shares, "be shares")])
    except CgroupError as exc:
        return exc
    return None


def test_einval_100_times_warns_once_and_backs_off(tmp_path: Path, kernel: Kernel) -> None:
    ex, clock, counter, target = _setup(tmp_path)
    errors: list[CgroupError | None] = []
    with capture_logs() as logs:
        for _ in range(100):  # a 100 ms fast path for 10 s
            errors.append(_try(ex))
            clock.now += 0.1
    assert all(e is not None for e in errors)
    assert _events(logs) == [("host_write_failed", "warning")]
    (warning,) = logs
    assert warning["cause"] == "EINVAL" and warning["path"] == str(target.resolve())
    # Tried at t = 0, 1, 3, 7 s (back-off 1, 2, 4, 8 s): 4 attempts, not 100.
    assert kernel.attempts == 4
    assert counter.counts() == {"EINVAL": 4}
    assert errors[0] is not None and not errors[0].repeat
    assert all(e is not None and e.repeat for e in errors[1:])
    assert sum(isinstance(e, WriteBackedOffError) for e in errors) == 96
    assert target.read_text() == "100\n"


def test_backoff_is_capped_and_a_reminder_says_how_often(tmp_path: Path, kernel: Kernel) -> None:
    ex, clock, _, _ = _setup(tmp_path)
    with capture_logs() as logs:
        for _ in range(20):  # one attempt a minute for 20 minutes
            _try(ex)
            clock.now += 60
    # Back-off 1, 2, 4 ... 256, then capped at 300 s: attempts at t = 0, 60 ... 360, 480, 660, 960 s.
    assert kernel.attempts == 10
    events = _events(logs)
    assert events[0] == ("host_write_failed", "warning")
    reminders = [e for e in logs if e["event"] == "host_write_still_failing"]
    assert len(reminders) == 3  # at 300, 660 and 960 s: never more than one per 5 min
    assert (reminders[0]["repeats"], reminders[0]["skipped"]) == (5, 0)
    assert (reminders[1]["repeats"], reminders[1]["skipped"]) == (3, 3)  # tried at 360, 480, 660
    assert reminders[2]["retry_in_seconds"] == 300


def test_success_clears_the_state_and_the_next_failure_warns_again(tmp_path: Path, kernel: Kernel) -> None:
    ex, clock, _, target = _setup(tmp_path)
    with capture_logs() as logs:
        _try(ex)
        assert isinstance(_try(ex), WriteBackedOffError)
        clock.now += 1
        kernel.errno = None
        assert _try(ex) is None
        assert target.read_text() == "20"  # 512 shares as cpu.weight
        kernel.errno = errno.EINVAL
        assert _try(ex, 1024) is not None
    assert _events(logs) == [
        ("host_write_failed", "warning"), ("host_write_recovered", "info"), ("host_write_failed", "warning")
    ]
    assert logs[1]["failures"] == 1


def test_a_different_cause_warns_again_and_a_new_value_waits_only_a_second(tmp_path: Path, kernel: Kernel) -> None:
    ex, clock, counter, _ = _setup(tmp_path)
    with capture_logs() as logs:
        _try(ex, 512)  # t = 0: tried, refused
        clock.now += 0.5
        assert isinstance(_try(ex, 512), WriteBackedOffError)
        assert isinstance(_try(ex, 1024), WriteBackedOffError)  # another value, but within 1 s of the last try
        clock.now += 0.5
        assert not isinstance(_try(ex, 1024), WriteBackedOffError)  # t = 1: tried
        for i in range(8):  # a fast path with a new value every 250 ms: tried at t = 2 and 3 only
            clock.now += 0.25
            _try(ex, 2048 * (i + 2))  # distinct cpu.weight values
        kernel.errno = errno.EBUSY
        clock.now += 1
        _try(ex, 100000)  # t = 4: tried, refused another way
    assert kernel.attempts == 5
    assert _events(logs) == [("host_write_failed", "warning"), ("host_write_failed", "warning")]
    assert logs[1]["cause"] == "EBUSY" and logs[1]["previous_cause"] == "EINVAL"
    assert counter.counts() == {"EINVAL": 4, "EBUSY": 1}


def test_failures_are_exported_by_cause() -> None:
    counter = FailureCounter()
    counter.inc("EINVAL")
    counter.inc("EINVAL")
    registry = prometheus_client.CollectorRegistry()
    registry.register(FailureCollector(counter))
    assert registry.get_sample_value("koord_runtime_proxy_host_write_failures_total", {"cause": "EINVAL"}) == 2


def test_failing_files_are_bounded(tmp_path: Path, kernel: Kernel) -> None:
    backoff = WriteBackoff(clock=Clock(), counter=FailureCounter(), max_entries=3)
    for i in range(10):
        backoff.failed(tmp_path / str(i), "1", "EINVAL", "x")
    assert sorted(backoff.failing()) == [str(tmp_path / str(i)) for i in (7, 8, 9)]


def test_a_leveled_parent_is_retried_at_once_after_its_children_were_narrowed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 14, item 11 (reaction bench misses): a BE tier quota refused (EINVAL: a child
    above it appeared between the scan and the write) was held by the back-off for the
    same value (the floor, every tick of an LS burst) even after the next leveled write
    had clamped that child: 1 s, then 2, 4, 8 s... The kernel is stubbed at the write
    boundary: it refuses the tier's quota while the child's is above it (cgroup v1's rule)."""
    root = tmp_path / "cg"
    tier = PurePosixPath("kubepods/besteffort")
    child = tier / "pod1" / "ctr"
    (root / "cpu" / child).mkdir(parents=True)
    (root / "cpu" / tier / "cpu.cfs_quota_us").write_text("100000\n")
    (root / "cpu" / child / "cpu.cfs_quota_us").write_text("20000\n")
    clock = Clock()
    ex = CgroupExecutor(CgroupLayout(root, 1), backoff=WriteBackoff(clock=clock, counter=FailureCounter()))
    tier_file = (root / "cpu" / tier / "cpu.cfs_quota_us").resolve()
    child_file = (root / "cpu" / child / "cpu.cfs_quota_us").resolve()

    def kernel(path: Path, text: str, source: str) -> None:
        if path == tier_file and int(text) < int(child_file.read_text()):
            os_error = OSError(errno.EINVAL, "Invalid argument")
            raise CgroupError(f"{source}: writing {text!r} to {path} refused: {os_error.strerror}") from os_error
        path.write_text(text)

    monkeypatch.setattr(executor_mod, "_write", kernel)
    with pytest.raises(CgroupError):  # the child was not known to the plan: refused
        ex.apply([Update(tier, CPU_CFS_QUOTA, 2000, "suppress")])
    # At once (the next fast-path tick): the child clamped first, then the same tier value.
    writes = ex.leveled_update([[Update(tier, CPU_CFS_QUOTA, 2000, "suppress")],
                                [Update(child, CPU_CFS_QUOTA, 2000, "clamped to the tier")]])
    assert [w.changed for w in writes] == [True, True]
    assert tier_file.read_text() == "2000"
    assert ex.backoff.failing() == {}
    # Nothing narrowed below (children unchanged): the back-off holds a refused value again.
    (root / "cpu" / child / "cpu.cfs_quota_us").write_text("20000\n")
    with pytest.raises(CgroupError):
        ex.apply([Update(tier, CPU_CFS_QUOTA, 1500, "suppress")])
    with pytest.raises(WriteBackedOffError):
        ex.leveled_update([[Update(tier, CPU_CFS_QUOTA, 1500, "suppress")],
                           [Update(child, CPU_CFS_QUOTA, 20000, "kept")]])
