"""Cgroup layout detection, pod/container paths from untrusted input, v1/v2 value mapping."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest

from hooks.cgroups import (
    CPU_BVT_WARP_NS,
    CPU_CFS_PERIOD,
    CPU_CFS_QUOTA,
    CPU_IDLE,
    CPU_SHARES,
    CPUSET_CPUS,
    MEMORY_LIMIT,
    RESOURCES,
    CgroupError,
    CgroupLayout,
    NotSupportedError,
    PathEscapeError,
    Resource,
    container_cgroup_dir,
    pod_cgroup_dir,
    shares_to_weight,
)

UID = "6c8e5d2a-1b3f-4e7a-9c0d-112233445566"
CID = "0123456789abcdef" * 4


def test_detect_v2(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    layout = CgroupLayout(tmp_path)
    assert layout.version == 2 and layout.driver == "cgroupfs"
    assert "version=2" in repr(layout)


def test_detect_v1_and_hybrid(tmp_path: Path) -> None:
    for controller in ("cpu", "memory", "cpuset"):
        (tmp_path / controller).mkdir()
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified" / "cgroup.controllers").write_text("")  # hybrid: controller-less v2 tree
    assert CgroupLayout(tmp_path).version == 1


def test_detect_errors(tmp_path: Path) -> None:
    with pytest.raises(CgroupError, match="directory missing"):
        CgroupLayout(tmp_path / "nope")
    with pytest.raises(CgroupError, match=r"neither cgroup\.controllers"):
        CgroupLayout(tmp_path)


def test_explicit_version_and_bad_arguments(tmp_path: Path) -> None:
    assert CgroupLayout(tmp_path, 2, "systemd").version == 2
    with pytest.raises(CgroupError, match="unknown cgroup driver"):
        CgroupLayout(tmp_path, 1, "runit")  # type: ignore[arg-type]
    with pytest.raises(CgroupError, match="unknown cgroup version"):
        CgroupLayout(tmp_path, 3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("parent", "driver", "expected"),
    [
        (f"/kubepods/besteffort/pod{UID}", "cgroupfs", f"kubepods/besteffort/pod{UID}"),
        (f"/kubepods/pod{UID}", "cgroupfs", f"kubepods/pod{UID}"),
        (
            "kubepods-burstable-pod6c8e5d2a_1b3f.slice",
            "systemd",
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod6c8e5d2a_1b3f.slice",
        ),
        ("kubepods-pod1_2.slice", "systemd", "kubepods.slice/kubepods-pod1_2.slice"),
        (
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice",
            "systemd",
            "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice",
        ),
        ("//kubepods//pod1/", "cgroupfs", "kubepods/pod1"),
    ],
)
def test_pod_dir(parent: str, driver: str, expected: str) -> None:
    assert pod_cgroup_dir(parent, driver) == PurePosixPath(expected)  # type: ignore[arg-type]


def test_container_dir() -> None:
    assert container_cgroup_dir("/kubepods/besteffort/pod1", CID, "cgroupfs") == PurePosixPath(
        f"kubepods/besteffort/pod1/{CID}"
    )
    assert container_cgroup_dir("kubepods-besteffort-pod1.slice", CID, "systemd") == PurePosixPath(
        f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice/cri-containerd-{CID}.scope"
    )


@pytest.mark.parametrize(
    ("parent", "fragment"),
    [
        ("/kubepods/../../etc", "contains a '..' component"),
        ("../x", "contains a '..' component"),
        ("/kubepods/./pod1", "contains a '.' component"),
        ("/kubepods/pod1\n", "control characters"),
        ("/kubepods/pod\x001", "control characters"),
        ("", "empty"),
        ("///", "empty"),
    ],
)
def test_bad_cgroup_parent_named(parent: str, fragment: str) -> None:
    with pytest.raises(PathEscapeError, match=fragment) as info:
        pod_cgroup_dir(parent, "cgroupfs")
    assert f"cgroup_parent {parent!r}" in str(info.value)


@pytest.mark.parametrize("parent", ["-kubepods.slice", "kubepods-.slice", "kubepods--pod.slice", ".slice"])
def test_bad_slice_names(parent: str) -> None:
    with pytest.raises(PathEscapeError, match="not a valid systemd slice name"):
        pod_cgroup_dir(parent, "systemd")


@pytest.mark.parametrize("cid", ["", "../x", "a/b", "..", "a..b", "-x", "x" * 200])
def test_bad_container_ids(cid: str) -> None:
    with pytest.raises(PathEscapeError, match="not a valid container id"):
        container_cgroup_dir("/kubepods/pod1", cid, "cgroupfs")


@pytest.mark.parametrize(("shares", "weight"), [(2, 1), (1024, 39), (262144, 10000), (512, 20), (0, 1)])
def test_shares_to_weight(shares: int, weight: int) -> None:
    assert shares_to_weight(shares) == weight


@pytest.mark.parametrize(
    ("resource", "value", "v1", "v2", "current"),
    [
        (CPU_SHARES, 1024, "1024", "39", None),
        (CPU_CFS_QUOTA, 50000, "50000", "50000 100000", "max 100000"),
        (CPU_CFS_QUOTA, -1, "-1", "max 20000", "10000 20000"),
        (CPU_CFS_PERIOD, 20000, "20000", "max 20000", "max 100000"),
        (MEMORY_LIMIT, -1, "-1", "max", None),
        (MEMORY_LIMIT, 2**30, str(2**30), str(2**30), None),
        (CPUSET_CPUS, "0-1", "0-1", "0-1", None),
        (CPU_BVT_WARP_NS, -1, "-1", "-1", None),
        (CPU_IDLE, 1, "1", "1", None),
    ],
)
def test_render(resource: Resource, value: int | str, v1: str, v2: str, current: str | None) -> None:
    checked = resource.check(value)
    assert resource.render(checked, 1, current) == v1
    assert resource.render(checked, 2, current) == v2


def test_files_per_version() -> None:
    assert CPU_SHARES.file(1) == ("cpu", "cpu.shares")
    assert CPU_SHARES.file(2) == (None, "cpu.weight")
    assert CPU_CFS_QUOTA.file(2) == (None, "cpu.max") == CPU_CFS_PERIOD.file(2)
    assert MEMORY_LIMIT.file(1) == ("memory", "memory.limit_in_bytes")
    assert MEMORY_LIMIT.file(2) == (None, "memory.max")
    assert set(RESOURCES) >= {"cpu.shares", "cpuset.cpus", "cpu.idle", "cpu.bvt_warp_ns"}
    v1_only = Resource("x", ("cpu", "x"), None, CPU_IDLE.check, CPU_IDLE.render, CPU_IDLE.parse)
    with pytest.raises(NotSupportedError, match="no cgroup v2 equivalent"):
        v1_only.file(2)


@pytest.mark.parametrize(
    ("resource", "value", "fragment"),
    [
        (CPU_SHARES, 1, r"outside \[2, 262144\]"),
        (CPU_SHARES, 300000, "outside"),
        (CPU_SHARES, "1024", "expected an integer"),
        (CPU_SHARES, True, "expected an integer"),
        (CPU_CFS_QUOTA, 500, "below the kernel minimum"),
        (CPU_CFS_QUOTA, -2, "outside"),
        (CPU_CFS_PERIOD, 999, "outside"),
        (MEMORY_LIMIT, -5, "outside"),
        (CPUSET_CPUS, "3-1", "reversed"),
        (CPUSET_CPUS, 3, "expected a CPU list"),
        (CPU_BVT_WARP_NS, 3, "outside"),
        (CPU_IDLE, 2, "outside"),
    ],
)
def test_values_validated(resource: Resource, value: int | str, fragment: str) -> None:
    with pytest.raises(CgroupError, match=fragment):
        resource.check(value)


def test_memory_limit_normalised() -> None:
    assert MEMORY_LIMIT.check(0) == -1
    assert MEMORY_LIMIT.check(1_000_000) == 999_424  # page aligned, as the kernel stores it
    assert MEMORY_LIMIT.parse("9223372036854771712", 1) == -1
    assert MEMORY_LIMIT.parse("max", 2) == -1
    assert CPU_CFS_QUOTA.parse("max 100000", 2) == -1
    assert CPU_CFS_PERIOD.parse("max 50000", 2) == 50000
