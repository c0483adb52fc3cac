"""No process-wide host-write state (issue 27 item 11): the back-off, the failure counts
and the resolved cgroup root belong to the objects the app makes and hands in, so two
executors (or two apps) in one process share them only when handed the same services."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest

from hooks import executor as executor_mod
from hooks.cgroups import CPU_SHARES, CgroupError, CgroupLayout
from hooks.executor import CgroupExecutor, Update, WriteBackedOffError
from runtimeproxy.chain import plugins
from runtimeproxy.config import settings as config
from runtimeproxy.services import NodeServices

POD = PurePosixPath("kubepods/besteffort/pod1")


@pytest.fixture
def refusing(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """The write syscall refuses every write (EINVAL); the paths it was asked to write."""
    asked: list[Path] = []

    def write(path: Path, text: str, source: str) -> None:
        asked.append(path)
        raise CgroupError(f"{source}: writing {text!r} to {path} refused") from OSError(errno.EINVAL, "refused")

    monkeypatch.setattr(executor_mod, "_write", write)
    yield asked


def _tree(tmp_path: Path) -> CgroupLayout:
    root = tmp_path / "cg"
    (root / POD).mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu\n")
    (root / POD / "cpu.weight").write_text("100\n")
    return CgroupLayout(root, 2)


def _try(ex: CgroupExecutor) -> CgroupError:
    with pytest.raises(CgroupError) as err:
        ex.apply([Update(POD, CPU_SHARES, 512, "be shares")])
    return err.value


def test_executors_share_a_back_off_only_when_handed_the_same_services(tmp_path: Path,
                                                                        refusing: list[Path]) -> None:
    layout = _tree(tmp_path)
    one, other = NodeServices.create(), NodeServices.create()
    first = _try(CgroupExecutor(layout, backoff=one.write_backoff))
    assert not isinstance(first, WriteBackedOffError)  # the kernel was asked and refused
    # Another executor of the same services: the file is backed off, the kernel not asked.
    assert isinstance(_try(CgroupExecutor(layout, backoff=one.write_backoff)), WriteBackedOffError)
    # Another process's (or test's) services know nothing of it: the kernel is asked again.
    assert not isinstance(_try(CgroupExecutor(layout, backoff=other.write_backoff)), WriteBackedOffError)
    # ... and so does an executor given no services: it has a back-off of its own.
    assert not isinstance(_try(CgroupExecutor(layout)), WriteBackedOffError)
    assert len(refusing) == 3
    assert one.write_failures.counts() == {"EINVAL": 1}
    assert other.write_failures.counts() == {"EINVAL": 1}


def test_hooks_write_through_the_services_they_are_built_with(tmp_path: Path) -> None:
    _tree(tmp_path)
    settings = config.from_mapping({"host": {"cgroup_root": str(tmp_path / "cg")}, "hookserver_dir": "",
                                    "hooks": [{"name": "memoryqos", "plugin": "memory-qos", "failure_policy": "ignore",
                                               "args": {"cgroup_driver": "cgroupfs"}}]})
    services = NodeServices.create()
    (hook,) = plugins.build_hooks(settings, services=services)
    assert hook.impl.executor.backoff is services.write_backoff
    (again,) = plugins.build_hooks(settings)  # check-config's: services of its own
    assert again.impl.executor.backoff is not services.write_backoff


def test_an_executor_resolves_its_own_root(tmp_path: Path) -> None:
    """The resolved root is the executor's, not a process cache keyed by path: a root
    re-pointed (a remount, a test's tree) is resolved afresh by the next executor."""
    old, new = _tree(tmp_path / "old"), _tree(tmp_path / "new")
    link = tmp_path / "root"
    link.symlink_to(old.root)
    assert CgroupExecutor(CgroupLayout(link, 2)).path(POD, CPU_SHARES).is_relative_to(old.root)
    link.unlink()
    link.symlink_to(new.root)
    assert CgroupExecutor(CgroupLayout(link, 2)).path(POD, CPU_SHARES).is_relative_to(new.root)
