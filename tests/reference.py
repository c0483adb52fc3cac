"""Reference material the tests read from beside the repository (``../shared/reference``:
Koordinator's CRD schemas, the CRI and runtime-hook schema listings).

A clone of the repository alone does not have it: there a test that needs it skips,
naming the missing path (``pytest -rs`` lists them). Under ``CI=true`` it fails
instead: CI checks the reference out next to the repository, and a test that silently
stopped running would hide a regression.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

#: ``<repo>/../shared/reference`` (the worktrees and CI's checkout sit next to shared/).
REFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "reference"


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def reference(*parts: str) -> Path:
    """``REFERENCE/<parts>``; skips the calling test when it is missing (fails under CI)."""
    path = REFERENCE.joinpath(*parts)
    if path.exists():
        return path
    why = f"reference data {path} is not here (shared/reference, checked out next to the repository)"
    if under_ci():
        pytest.fail(f"{why}: under CI=true it must be", pytrace=False)
    pytest.skip(why)
