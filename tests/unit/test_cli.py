"""The command line as a shell user meets it: ``--help`` lists every command, and a
closed pipe (``check-config | head -1``) ends the command quietly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtimeproxy import cli

SHIPPED = Path(__file__).resolve().parents[2] / "systemd" / "config.yaml"
COMMANDS = ["run", "check-config", "explain", "demo", "top"]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_command_with_one_line(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main([flag])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: koord-runtime-proxy [-h] COMMAND ...")
    listed = out.partition("commands:")[2]
    for command in COMMANDS:
        line = next((ln for ln in listed.splitlines() if ln.strip().startswith(command)), None)
        assert line is not None, f"{command} missing from:\n{out}"
    assert "check-config" in listed and "validate everything run validates" in listed


def test_options_without_a_command_still_mean_run(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--config", "/nonexistent/x.yaml", "--help"])
    assert capsys.readouterr().out.startswith("usage: koord-runtime-proxy run ")


def _with_closed_stdout(*args: str) -> subprocess.CompletedProcess[str]:
    """Like ``cmd | head -0``: the reader is gone before the first write."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "runtimeproxy.cli", *args], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=60, check=False)
    finally:
        os.close(write)


@pytest.mark.parametrize("args", [
    ("check-config", "--config", str(SHIPPED), "--hookserver-dir", ""),
    ("--help",),
], ids=["check-config", "help"])
def test_a_closed_pipe_ends_quietly(args: tuple[str, ...]) -> None:
    done = _with_closed_stdout(*args)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.stderr == ""
    assert done.returncode in (0, 141)  # argparse's own --help exits 0 after its write


# --- the README says what the code does -------------------------------------------------

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_error_sample_is_what_check_config_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sample = next(ln for ln in README.read_text().splitlines()
                  if ln.startswith("koord-runtime-proxy: invalid configuration: "))
    bad = tmp_path / "bad.yaml"
    bad.write_text("hooks:\n  - name: batch-resource\n    plugin: batch-resource\n    timeout: 0s\n")
    assert cli.main(["check-config", "--config", str(bad)]) == cli.EXIT_CONFIG
    assert capsys.readouterr().err.rstrip("\n") == sample


def test_readme_counts_and_names_the_shipped_hooks() -> None:
    from runtimeproxy.config import settings as config

    names = [hook["name"] for hook in config.builtin_default()["hooks"]]
    words = {4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten"}
    text = " ".join(README.read_text().split())
    assert f"({words[len(names)]} hooks: {', '.join(names)};" in text
