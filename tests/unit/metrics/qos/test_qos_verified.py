"""Issue 29: cgroup writes found in place are not re-checked every round (koordlet's
executor cache), and everything that could make that wrong is checked at once."""

from __future__ import annotations

import asyncio
from pathlib import Path, PurePosixPath

import pytest

from hooks.cgroups import CPU_CFS_QUOTA, CPUSET_CPUS, CgroupLayout
from hooks.executor import CgroupExecutor
from metrics.qos.burst import CPU_CFS_BURST
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.qos.plan import LeveledWrite, SetCgroup
from metrics.qos.verified import VerifiedWrites

TIER, POD = PurePosixPath("kubepods/besteffort"), PurePosixPath("kubepods/besteffort/podu1")


def test_a_value_found_in_place_is_not_checked_again_until_it_is_old_or_differs() -> None:
    clock = [0.0]
    seen = VerifiedWrites(60.0, clock=lambda: clock[0])
    cpus = LeveledWrite(((SetCgroup(TIER, CPUSET_CPUS, "0-7", "r"),), (SetCgroup(POD, CPUSET_CPUS, "0-7", "r", "u1"),)),
                        "r")
    assert not seen.fresh(cpus)
    seen.done(cpus)
    clock[0] = 59.0
    assert seen.fresh(cpus)
    # another value for one of its targets (the tier): checked and written at once
    assert not seen.fresh(SetCgroup(TIER, CPUSET_CPUS, "0-3", "r"))
    seen.done(SetCgroup(TIER, CPUSET_CPUS, "0-3", "r"))
    assert not seen.fresh(cpus)  # the tier holds 0-3 now: the old write is not in place
    seen.done(cpus)
    clock[0] = 130.0
    assert not seen.fresh(cpus)  # 60 s on: checked against the files again
    seen.done(cpus)
    seen.forget(SetCgroup(POD, CPUSET_CPUS, "0-7", "r", "u1"))  # it failed or was gone
    assert not seen.fresh(cpus)
    seen.done(cpus)
    seen.keep_pods(set())  # the pod left
    assert len(seen) == 1 and not seen.fresh(cpus)


def test_cfs_quotas_are_never_remembered() -> None:
    seen = VerifiedWrites(60.0, clock=lambda: 0.0)
    for action in (SetCgroup(TIER, CPU_CFS_QUOTA, 40_000, "r"),
                   LeveledWrite(((SetCgroup(TIER, CPU_CFS_QUOTA, 40_000, "r"),),
                                 (SetCgroup(POD, CPUSET_CPUS, "0-7", "r", "u1"),)), "r")):
        seen.done(action)
        assert not seen.fresh(action)
    burst = SetCgroup(POD, CPU_CFS_BURST, 5000, "r", "u1")
    seen.done(burst)
    assert seen.fresh(burst)


@pytest.mark.asyncio
async def test_the_manager_finds_a_changed_file_within_verified_for(tmp_path: Path) -> None:
    (tmp_path / "cpuset" / TIER).mkdir(parents=True)
    (tmp_path / "cpuset" / TIER / "cpuset.cpus").write_text("0-7\n")
    (tmp_path / "cpu").mkdir()
    manager = QoSManager(reader=None, pods=list, topology=[], executor=CgroupExecutor(CgroupLayout(tmp_path)),  # type: ignore[arg-type]
                         evictor=None, rules=None, config=ManagerConfig(verified_for=0.2), strategies=[])  # type: ignore[arg-type]
    action = SetCgroup(TIER, CPUSET_CPUS, "0-3", "r")
    assert manager._write("cpu-suppress", action).result == "written"
    (tmp_path / "cpuset" / TIER / "cpuset.cpus").write_text("0-7\n")  # someone else
    assert manager._write("cpu-suppress", action).result == "unchanged"  # remembered: not looked at
    await asyncio.sleep(0.25)
    assert manager._write("cpu-suppress", action).result == "written"
    assert (tmp_path / "cpuset" / TIER / "cpuset.cpus").read_text().strip() == "0-3"
