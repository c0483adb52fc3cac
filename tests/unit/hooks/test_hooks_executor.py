"""The executor on fixture cgroup v1 and v2 trees: confinement, idempotence,
validate-before-write, clear errors, and leveled cpuset updates."""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path, PurePosixPath

import pytest

from hooks.cgroups import (
    CPU_CFS_PERIOD,
    CPU_CFS_QUOTA,
    CPU_IDLE,
    CPU_SHARES,
    CPUSET_CPUS,
    MEMORY_LIMIT,
    CgroupError,
    CgroupGoneError,
    CgroupLayout,
    NotSupportedError,
    PathEscapeError,
    pod_cgroup_dir,
)
from hooks.cpusets import parse_cpu_list
from hooks.executor import CgroupExecutor, Update, Write, confine

POD = PurePosixPath("kubepods/besteffort/pod1")
V1_FILES = {
    "cpu": {"cpu.shares": "1024", "cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"},
    "memory": {"memory.limit_in_bytes": "9223372036854771712"},
    "cpuset": {"cpuset.cpus": "0-3", "cpuset.mems": "0"},
}
V2_FILES = {"cpu.weight": "100", "cpu.max": "max 100000", "memory.max": "max", "cpuset.cpus": "", "cpu.idle": "0"}


def make_v1(root: Path, cgroups: list[PurePosixPath]) -> CgroupExecutor:
    for controller, files in V1_FILES.items():
        for cgroup in [PurePosixPath(), *cgroups]:
            directory = root / controller / cgroup
            directory.mkdir(parents=True, exist_ok=True)
            for name, value in files.items():
                (directory / name).write_text(value + "\n")
    (root / "unified").mkdir(exist_ok=True)
    return CgroupExecutor(CgroupLayout(root))


def make_v2(root: Path, cgroups: list[PurePosixPath]) -> CgroupExecutor:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for cgroup in cgroups:
        (root / cgroup).mkdir(parents=True, exist_ok=True)
        for name, value in V2_FILES.items():
            (root / cgroup / name).write_text(value + "\n")
    return CgroupExecutor(CgroupLayout(root))


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_v1_writes_and_records(tmp_path: Path) -> None:
    ex = make_v1(tmp_path / "cg", [POD])
    writes = ex.apply(
        [
            Update(POD, CPU_SHARES, 512, "r1"),
            Update(POD, CPU_CFS_QUOTA, 200000, "r2"),
            Update(POD, MEMORY_LIMIT, 2**30, "r3"),
        ]
    )
    pod = tmp_path / "cg"
    assert (pod / "cpu" / POD / "cpu.shares").read_text() == "512"
    assert (pod / "cpu" / POD / "cpu.cfs_quota_us").read_text() == "200000"
    assert (pod / "memory" / POD / "memory.limit_in_bytes").read_text() == str(2**30)
    assert writes[0] == Write((pod / "cpu" / POD / "cpu.shares").resolve(), "1024", "512", "r1")
    assert [w.changed for w in writes] == [True, True, True]
    assert writes[2].old == "9223372036854771712"


def test_v2_mapping(tmp_path: Path) -> None:
    ex = make_v2(tmp_path / "cg", [POD])
    ex.apply(
        [
            Update(POD, CPU_SHARES, 1024, "s"),
            Update(POD, CPU_CFS_QUOTA, 50000, "q"),
            Update(POD, MEMORY_LIMIT, 2**30, "m"),
            Update(POD, CPUSET_CPUS, "0,1", "c"),
            Update(POD, CPU_IDLE, 1, "i"),
        ]
    )
    d = tmp_path / "cg" / POD
    assert (d / "cpu.weight").read_text() == "39"
    assert (d / "cpu.max").read_text() == "50000 100000"
    assert (d / "memory.max").read_text() == str(2**30)
    assert (d / "cpuset.cpus").read_text() == "0-1"
    assert (d / "cpu.idle").read_text() == "1"
    ex.apply([Update(POD, CPU_CFS_QUOTA, -1, "q"), Update(POD, MEMORY_LIMIT, -1, "m")])
    assert (d / "cpu.max").read_text() == "max 100000"
    assert (d / "memory.max").read_text() == "max"
    ex.apply([Update(POD, CPU_CFS_PERIOD, 50000, "p")])
    assert (d / "cpu.max").read_text() == "max 50000"


@pytest.mark.parametrize("make", [make_v1, make_v2])
def test_unchanged_values_are_not_rewritten(tmp_path: Path, make: object) -> None:
    ex = make(tmp_path / "cg", [POD])  # type: ignore[operator]
    updates = [
        Update(POD, CPU_SHARES, 512, "s"),
        Update(POD, CPU_CFS_QUOTA, -1, "q"),
        Update(POD, MEMORY_LIMIT, 1_000_000, "m"),
        Update(POD, CPUSET_CPUS, "0,1,2", "c"),
    ]
    first = ex.apply(updates)
    paths = [w.target_path for w in first]
    for path in paths:
        os.utime(path, ns=(0, 0))
    second = ex.apply(updates)
    assert [w.changed for w in second] == [False] * 4
    assert all(path.stat().st_mtime_ns == 0 for path in paths)
    assert second[2].new == "999424" and second[2].old == "999424"


def test_v1_unlimited_memory_is_already_unlimited(tmp_path: Path) -> None:
    ex = make_v1(tmp_path / "cg", [POD])
    (write,) = ex.apply([Update(POD, MEMORY_LIMIT, -1, "m")])
    assert not write.changed and write.old == "9223372036854771712"


def test_bad_value_writes_nothing(tmp_path: Path) -> None:
    ex = make_v1(tmp_path / "cg", [POD])
    before = snapshot(tmp_path)
    with pytest.raises(CgroupError, match=r"pod x: cpu.cfs_quota_us: 10 is below the kernel minimum"):
        ex.apply([Update(POD, CPU_SHARES, 512, "s", "pod x"), Update(POD, CPU_CFS_QUOTA, 10, "q", "pod x")])
    assert snapshot(tmp_path) == before


def test_missing_dir_is_cgroup_gone(tmp_path: Path) -> None:
    ex = make_v2(tmp_path / "cg", [POD])
    with pytest.raises(CgroupGoneError, match="does not exist"):
        ex.apply([Update(PurePosixPath("kubepods/besteffort/pod2"), CPU_SHARES, 512, "s")])


def test_missing_file_is_not_supported_and_nothing_written(tmp_path: Path) -> None:
    ex = make_v2(tmp_path / "cg", [POD])
    (tmp_path / "cg" / POD / "cpu.idle").unlink()
    before = snapshot(tmp_path)
    with pytest.raises(NotSupportedError, match=r"cpu.idle is not supported here"):
        ex.apply([Update(POD, CPU_SHARES, 512, "s"), Update(POD, CPU_IDLE, 1, "i")])
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "cg" / POD / "cpu.idle").exists()  # never created


def test_read(tmp_path: Path) -> None:
    ex = make_v1(tmp_path / "cg", [POD])
    assert ex.read(POD, CPU_CFS_PERIOD) == "100000"
    with pytest.raises(CgroupGoneError):
        ex.read(PurePosixPath("kubepods/gone"), CPU_SHARES)


def test_dotdot_rejected_with_source(tmp_path: Path) -> None:
    ex = make_v1(tmp_path / "cg", [POD])
    with pytest.raises(PathEscapeError, match=re.escape("cgroup_parent '/x/../..'")):
        ex.apply([Update(PurePosixPath("x/../../.."), CPU_SHARES, 512, "s", "cgroup_parent '/x/../..'")])
    with pytest.raises(PathEscapeError):
        confine(tmp_path, PurePosixPath("/etc"), "abs")


def test_symlink_escape_rejected(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "cpu.weight").write_text("100")
    ex = make_v2(tmp_path / "cg", [POD])
    (tmp_path / "cg" / "kubepods" / "evil").symlink_to(outside)
    with pytest.raises(PathEscapeError, match=r"annotation 'x': resolves to .*outside the root"):
        ex.apply([Update(PurePosixPath("kubepods/evil"), CPU_SHARES, 512, "s", "annotation 'x'")])
    assert (outside / "cpu.weight").read_text() == "100"


def test_a_symlink_above_the_cgroup_is_resolved_by_the_kernel_and_refused(tmp_path: Path) -> None:
    # kubepods/evil -> outside, and the update names a directory *below* the link:
    # the O_PATH resolution must follow the link in the middle of the path too.
    outside = tmp_path / "outside"
    (outside / "pod1").mkdir(parents=True)
    (outside / "pod1" / "cpu.weight").write_text("100")
    ex = make_v2(tmp_path / "cg", [POD])
    (tmp_path / "cg" / "kubepods" / "evil").symlink_to(outside)
    with pytest.raises(PathEscapeError, match=r"resolves to .*outside/pod1, outside the root"):
        ex.apply([Update(PurePosixPath("kubepods/evil/pod1"), CPU_SHARES, 512, "s", "annotation 'x'")])
    assert (outside / "pod1" / "cpu.weight").read_text() == "100"


def test_a_file_updated_twice_in_one_batch_is_read_again_before_its_second_write(tmp_path: Path) -> None:
    ex = make_v1(tmp_path / "cg", [POD])
    writes = ex.apply([Update(POD, CPU_SHARES, 512, "first"), Update(POD, CPU_SHARES, 512, "again"),
                       Update(POD, CPU_CFS_QUOTA, 200000, "quota")])
    assert [(w.old, w.new, w.changed) for w in writes] == [
        ("1024", "512", True), ("512", "512", False), ("-1", "200000", True)]


def test_symlinked_file_refused(tmp_path: Path) -> None:
    ex = make_v2(tmp_path / "cg", [POD])
    target = tmp_path / "cg" / POD / "cpu.weight"
    target.unlink()
    (tmp_path / "elsewhere").write_text("100")
    target.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PathEscapeError, match="symlink"):
        ex.apply([Update(POD, CPU_SHARES, 512, "s")])
    assert (tmp_path / "elsewhere").read_text() == "100"


def test_symlink_inside_root_is_followed(tmp_path: Path) -> None:
    # real v1 hosts: /sys/fs/cgroup/cpu -> cpu,cpuacct
    root = tmp_path / "cg"
    make_v1(root, [POD])
    (root / "cpu").rename(root / "cpu,cpuacct")
    (root / "cpu").symlink_to("cpu,cpuacct")
    ex = CgroupExecutor(CgroupLayout(root))
    ex.apply([Update(POD, CPU_SHARES, 256, "s")])
    assert (root / "cpu,cpuacct" / POD / "cpu.shares").read_text() == "256"


def test_systemd_paths_on_v2(tmp_path: Path) -> None:
    cgroup = pod_cgroup_dir("kubepods-besteffort-pod1_2.slice", "systemd")
    ex = make_v2(tmp_path / "cg", [cgroup])
    ex.apply([Update(cgroup, CPU_SHARES, 2, "s")])
    assert (tmp_path / "cg/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1_2.slice/cpu.weight")\
        .read_text() == "1"


def test_kernel_refusal_is_a_clear_error(tmp_path: Path) -> None:
    ex = make_v2(tmp_path / "cg", [POD])
    path = tmp_path / "cg" / POD / "cpu.weight"
    path.unlink()
    path.mkdir()  # writing to a directory fails like a kernel refusal would
    with pytest.raises(CgroupError, match=r"cpu\.weight"):
        ex.apply([Update(POD, CPU_SHARES, 512, "s")])


def _cpuset_levels(root: Path) -> tuple[CgroupExecutor, list[PurePosixPath]]:
    qos = PurePosixPath("kubepods/besteffort")
    pod = qos / "pod1"
    ctr = pod / "c1"
    ex = make_v1(root, [PurePosixPath("kubepods"), qos, pod, ctr])
    for cg in (qos, pod, ctr):
        (root / "cpuset" / cg / "cpuset.cpus").write_text("0-1\n")
    return ex, [qos, pod, ctr]


def test_leveled_cpuset_widens_parents_first(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    ex, levels = _cpuset_levels(root)
    writes = ex.leveled_update([[Update(cg, CPUSET_CPUS, "2-3", "move")] for cg in levels])
    # replay: a child's cpuset must always be a subset of its parent's (kernel rule)
    state = {cg: {0, 1} for cg in levels}
    by_path = {(root / "cpuset" / cg / "cpuset.cpus").resolve(): cg for cg in levels}
    for write in writes:
        if write.changed:
            state[by_path[write.target_path]] = set(parse_cpu_list(write.new))
            for parent, child in itertools.pairwise(levels):
                assert state[child] <= state[parent], write
    assert all((root / "cpuset" / cg / "cpuset.cpus").read_text() == "2-3" for cg in levels)
    assert "widened first" in writes[0].reason and writes[0].new == "0-3"


def test_leveled_narrowing_needs_no_widening(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    ex, levels = _cpuset_levels(root)
    writes = ex.leveled_update([[Update(cg, CPUSET_CPUS, "1", "narrow")] for cg in levels])
    assert [w.target_path.parent.name for w in writes] == ["c1", "pod1", "besteffort"]  # bottom-up


def test_leveled_quota_raises_parent_first(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    qos, pod = PurePosixPath("kubepods/besteffort"), POD
    ex = make_v1(root, [qos, pod])
    (root / "cpu" / qos / "cpu.cfs_quota_us").write_text("100000")
    (root / "cpu" / pod / "cpu.cfs_quota_us").write_text("100000")
    writes = ex.leveled_update([[Update(qos, CPU_CFS_QUOTA, 200000, "q")], [Update(pod, CPU_CFS_QUOTA, 200000, "q")]])
    assert [w.new for w in writes if w.changed] == ["200000", "200000"]
    assert "widened first" in writes[0].reason
