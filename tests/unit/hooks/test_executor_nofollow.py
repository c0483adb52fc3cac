"""The race ``O_NOFOLLOW`` closes: the executor checks a target (confined, not a
symlink) and only then opens it. If the final component is swapped for a symlink
to a file outside the root in between, the open itself must refuse (ELOOP): the
outside file is neither read nor written. The swap is injected between check and
open, so each test fails when ``O_NOFOLLOW`` is dropped from that open."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from hooks import executor as executor_mod
from hooks.cgroups import CPU_SHARES, CgroupLayout, PathEscapeError
from hooks.executor import CgroupExecutor, Update

POD = PurePosixPath("kubepods/besteffort/pod1")
SECRET = "outside-the-root\n"


def _tree(tmp_path: Path) -> tuple[CgroupExecutor, Path, Path]:
    root = tmp_path / "cg"
    (root / POD).mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu\n")
    target = root / POD / "cpu.weight"
    target.write_text("100\n")
    outside = tmp_path / "outside"
    outside.write_text(SECRET)
    return CgroupExecutor(CgroupLayout(root, 2)), target, outside


def _swap(target: Path, outside: Path) -> None:
    target.unlink()
    target.symlink_to(outside)


def test_write_does_not_follow_a_symlink_swapped_in_after_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex, target, outside = _tree(tmp_path)
    real_write = executor_mod._write

    def swap_then_write(path: Path, text: str, source: str) -> None:
        # Every check (confinement, is_symlink, the read of the old value) has passed.
        _swap(path, outside)
        real_write(path, text, source)

    monkeypatch.setattr(executor_mod, "_write", swap_then_write)
    with pytest.raises(PathEscapeError, match="symlink"):
        ex.apply([Update(POD, CPU_SHARES, 512, "s")])
    assert outside.read_text() == SECRET
    assert target.is_symlink()


def test_read_does_not_follow_a_symlink_swapped_in_after_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex, _target, outside = _tree(tmp_path)
    real_path = CgroupExecutor.path

    def checked_then_swapped(self: CgroupExecutor, *args: Any, **kwargs: Any) -> Path:
        path = real_path(self, *args, **kwargs)  # confined and not a symlink: now swap it
        _swap(path, outside)
        return path

    monkeypatch.setattr(CgroupExecutor, "path", checked_then_swapped)
    with pytest.raises(PathEscapeError, match="symlink"):
        ex.read(POD, CPU_SHARES)
    assert outside.read_text() == SECRET
