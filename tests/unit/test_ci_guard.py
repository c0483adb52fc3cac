"""Under CI the integration suite must run or the run fails (issue 14): the real
tests/integration/conftest.py, copied beside tiny test files in a temp dir, run by a
pytest subprocess with and without ``CI=true``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFTEST = REPO / "tests" / "integration" / "conftest.py"
BINARIES = ("containerd", "containerd-shim-runc-v2", "runc", "ctr")

needs_a_runnable_host = pytest.mark.skipif(
    os.geteuid() != 0 or any(shutil.which(b) is None for b in BINARIES) or not Path("/bin/busybox").is_file(),
    reason="the copied conftest runs its tests only where the real integration suite can run",
)


def _suite(tmp_path: Path, files: dict[str, str]) -> Path:
    """``tmp_path/integration`` with the real conftest and ``files``; a sibling
    ``unit`` dir holds a skipping test that CI must not mind. The conftest watches
    ``tmp_path/tmproot`` instead of /tmp, which other runs on this machine share."""
    root = tmp_path / "integration"
    root.mkdir()
    (tmp_path / "tmproot").mkdir()
    text = CONFTEST.read_text()
    assert text.count('_TMP = Path("/tmp")') == 1
    (root / "conftest.py").write_text(text.replace('_TMP = Path("/tmp")', f'_TMP = Path("{tmp_path}/tmproot")'))
    for name, body in files.items():
        (root / name).write_text(textwrap.dedent(body))
    unit = tmp_path / "unit"
    unit.mkdir()
    (unit / "test_elsewhere.py").write_text("import pytest\n\ndef test_other():\n    pytest.skip('not here')\n")
    return root


def _pytest(tmp_path: Path, *, ci: bool, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = str(REPO)
    if ci:
        env["CI"] = "true"
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "integration", "unit"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )


PASSING = "def test_runs():\n    assert 1 + 1 == 2\n"


@needs_a_runnable_host
def test_an_integration_test_that_skips_fails_the_run_under_ci_only(tmp_path: Path) -> None:
    _suite(tmp_path, {"test_a.py": PASSING + "\nimport pytest\n\ndef test_skips():\n    pytest.skip('no reason')\n"})
    out = _pytest(tmp_path, ci=True)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "integration tests skipped under CI" in out.stdout
    assert "integration/test_a.py::test_skips: no reason" in out.stdout
    assert "test_other" not in out.stdout.split("integration tests skipped under CI")[1]  # unit skips are fine
    local = _pytest(tmp_path, ci=False)
    assert local.returncode == 0, local.stdout + local.stderr
    assert "SKIPPED" in local.stdout and "no reason" in local.stdout  # -rs lists them


@needs_a_runnable_host
def test_a_module_that_skips_itself_fails_the_run_under_ci(tmp_path: Path) -> None:
    _suite(tmp_path, {"test_a.py": PASSING,
                      "test_b.py": "import pytest\n\npytest.skip('module gone', allow_module_level=True)\n"})
    out = _pytest(tmp_path, ci=True)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "integration/test_b.py: module gone" in out.stdout


@needs_a_runnable_host
def test_a_skipif_marker_fails_the_run_under_ci(tmp_path: Path) -> None:
    _suite(tmp_path, {"test_a.py": PASSING + "\nimport pytest\n\n@pytest.mark.skipif(True, reason='no PMU')\n"
                                             "def test_marked():\n    pass\n"})
    out = _pytest(tmp_path, ci=True)
    assert out.returncode == 1 and "test_marked: no PMU" in out.stdout, out.stdout + out.stderr


@needs_a_runnable_host
def test_an_allowed_hardware_skip_passes_but_only_for_its_reason(tmp_path: Path) -> None:
    body = ("import pytest\n\ndef test_ebpf_latency_rises_under_contention():\n"
            "    pytest.skip('{reason}')\n")
    _suite(tmp_path, {"test_a.py": PASSING,
                      "test_schedlat_real.py": body.format(reason="eBPF source unavailable: no BTF")})
    out = _pytest(tmp_path, ci=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "eBPF source unavailable" in out.stdout  # still reported by -rs
    (tmp_path / "integration" / "test_schedlat_real.py").write_text(body.format(reason="something else"))
    out = _pytest(tmp_path, ci=True)
    assert out.returncode == 1 and "something else" in out.stdout, out.stdout + out.stderr


def test_a_host_that_cannot_run_the_suite_is_an_error_under_ci(tmp_path: Path) -> None:
    """No containerd on PATH (or not root): skipped locally, a failed run under CI."""
    _suite(tmp_path, {"test_a.py": PASSING})
    empty = tmp_path / "bin"
    empty.mkdir()
    out = _pytest(tmp_path, ci=True, path=str(empty))
    assert out.returncode == pytest.ExitCode.USAGE_ERROR, out.stdout + out.stderr
    assert "CI=true but the integration suite (1 tests in" in out.stderr
    assert "cannot run here: integration tests need" in out.stderr
    local = _pytest(tmp_path, ci=False, path=str(empty))
    assert local.returncode == 0, local.stdout + local.stderr
    assert "integration tests need" in local.stdout and "2 skipped" in local.stdout


@needs_a_runnable_host
def test_a_dir_left_in_tmp_fails_the_run_under_ci(tmp_path: Path) -> None:
    """Only this session's ``krpt<session>-`` entries count: another run's, made while
    this one runs (a clone-alone suite beside CI), is not this run's leftover."""
    root = tmp_path / "tmproot"
    leak = ("from pathlib import Path\n\nfrom tests import tmpnames\n\n"
            f"ROOT = Path('{root}')\n\n"
            "def test_leaks():\n    (ROOT / (tmpnames.PREFIX + 'leak-1')).mkdir()\n\n"
            "def test_tidy():\n    (ROOT / (tmpnames.PREFIX + 'tidy')).mkdir()\n"
            "    (ROOT / (tmpnames.PREFIX + 'tidy')).rmdir()\n\n"
            "def test_another_run_beside():\n    (ROOT / 'krpt0a0b0c-theirs').mkdir(exist_ok=True)\n")
    _suite(tmp_path, {"test_a.py": leak})
    left = re.compile(r"1 /tmp/krpt([0-9a-f]{6})-\* entries left after the run"
                      r" \(the run fails under CI\): krpt\1-leak-1$", re.MULTILINE)
    out = _pytest(tmp_path, ci=True)
    assert out.returncode == 1, out.stdout + out.stderr
    assert left.search(out.stdout) and "theirs" not in out.stdout, out.stdout
    for entry in root.glob("krpt*-leak-1"):
        entry.rmdir()
    local = _pytest(tmp_path, ci=False)
    assert local.returncode == 0 and "-leak-1" in local.stdout and "fails under CI" not in local.stdout, local.stdout
    for entry in root.glob("krpt*-leak-1"):
        entry.rmdir()
    (tmp_path / "integration" / "test_a.py").write_text(leak.replace("def test_leaks():", "def _leaks():"))
    tidy = _pytest(tmp_path, ci=True)
    assert tidy.returncode == 0 and "left in /tmp" not in tidy.stdout, tidy.stdout
    assert (root / "krpt0a0b0c-theirs").is_dir()
