"""Issue 27 item 9: reference data missing beside the repository is a skip naming the
path outside CI, a failure under CI=true (the helper every such test goes through)."""

from __future__ import annotations

import pytest

from tests.reference import REFERENCE, reference


def test_missing_reference_data_skips_with_the_path_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=str(REFERENCE / "crds" / "no-such.yaml")):
        reference("crds", "no-such.yaml")


def test_missing_reference_data_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="under CI=true it must be"):
        reference("crds", "no-such.yaml")


def test_present_reference_data_is_its_path() -> None:
    assert reference() == REFERENCE  # beside the repository (a clone alone: skipped by the helper itself)
