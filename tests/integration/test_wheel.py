"""The built wheel works alone (issue 30, item 1).

The project is built into a wheel from a copy of its packaged sources and installed
into a fresh venv (no system site packages, not this test run's venv) with its
declared dependencies only, fetched by pip as configured on this machine (pip's own
download cache keeps a repeat run fast). Then, from outside the source tree:

- every module the wheel ships imports, and every module of the source tree is in it,
  with its package data (the shipped config, the type markers);
- ``check-config`` accepts the shipped config;
- ``run`` with the shipped config (hooks, metrics, QoS, interference tasks) serves CRI
  from a private containerd and stays up until SIGTERM, which stops it cleanly.

A dependency missing from ``install_requires`` fails the import step, naming it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo.embedded import EmbeddedContainerd
from tests import tmpnames
from tests.integration.conftest import ProxyLauncher, ProxyProcess

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("runtimeproxy", "hooks", "metrics", "criapi")
#: What a build reads besides the packages.
BUILD_FILES = ("setup.cfg", "pyproject.toml", "README.md")
PIP_TIMEOUT = 300


def _copy_sources(dest: Path) -> None:
    """Only what a clean checkout has: no caches, no egg-info, no venv."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, dest / package, ignore=ignore)
    for name in BUILD_FILES:
        shutil.copy2(ROOT / name, dest / name)


def _clean_env() -> dict[str, str]:
    """No PYTHONPATH or venv of this run leaks into the venv under test."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    return env


def _run(argv: list[str], *, cwd: Path, timeout: float = PIP_TIMEOUT) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(argv, cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                         timeout=timeout, check=False)
    assert out.returncode == 0, f"{argv} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def wheel_venv() -> Iterator[tuple[Path, Path]]:
    """(the wheel, the venv it is installed in); both removed after the module."""
    base = tmpnames.mkdtemp("wheel-")
    try:
        src, dist, venv = base / "src", base / "dist", base / "venv"
        _copy_sources(src)
        # The build backend of this run's venv (setuptools), not a fresh isolated one:
        # what is tested is the wheel's contents and metadata, not the build tooling.
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
              "-w", str(dist), str(src)], cwd=base)
        wheel = next(dist.glob("koord_runtime_proxy-*.whl"))
        # The base interpreter, not this venv's: a venv of a venv would still be clean,
        # but --without-scm-ignore-files etc. differ; sys._base_executable is the real one.
        python = getattr(sys, "_base_executable", sys.executable)
        _run([python, "-m", "venv", str(venv)], cwd=base)
        _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)], cwd=base)
        yield wheel, venv
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _source_modules() -> set[str]:
    modules = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            modules.add(".".join(parts))
    return modules


def _wheel_modules(wheel: Path) -> tuple[set[str], set[str]]:
    """(modules, other files) the wheel ships, outside its .dist-info."""
    modules, data = set(), set()
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if ".dist-info/" in name:
                continue
            if name.endswith(".py"):
                rel = Path(name).with_suffix("")
                parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
                modules.add(".".join(parts))
            else:
                data.add(name)
    return modules, data


_IMPORT_ALL = """
import importlib, json, sys
failed = {}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except Exception as exc:  # every failure, not the first
        failed[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps({"failed": failed, "site": [p for p in sys.path if p]}))
"""


def test_wheel_ships_every_module_and_each_imports_with_declared_deps_only(
    wheel_venv: tuple[Path, Path], tmp_path: Path
) -> None:
    wheel, venv = wheel_venv
    modules, data = _wheel_modules(wheel)
    missing = _source_modules() - modules
    assert not missing, f"modules in the source tree but not in the wheel: {sorted(missing)}"
    for needed in ("runtimeproxy/default-config.yaml", "runtimeproxy/py.typed", "criapi/py.typed"):
        assert needed in data, f"{needed} is not in the wheel: {sorted(data)}"

    out = _run([str(venv / "bin" / "python"), "-c", _IMPORT_ALL, json.dumps(sorted(modules))], cwd=tmp_path)
    result: dict[str, Any] = json.loads(out.stdout)
    assert not any(str(ROOT) == p or p.startswith(str(ROOT / ".venv")) for p in result["site"]), result["site"]
    assert result["failed"] == {}, f"modules of the wheel that do not import in a clean venv: {result['failed']}"


def _shipped_config(workdir: Path, backend: Path) -> dict[str, Any]:
    """The shipped default config, with this test's paths (socket, store, state) and a
    free metrics port. Everything else, hooks and tasks included, as shipped."""
    doc: dict[str, Any] = yaml.safe_load((ROOT / "runtimeproxy" / "default-config.yaml").read_text())
    doc.update({
        "listen": str(workdir / "proxy.sock"), "backend": {**doc["backend"], "runtime_endpoint": str(backend)},
        "metrics": {**doc["metrics"], "listen": "127.0.0.1:0"}, "hookserver_dir": "",
        "state_dir": str(workdir / "state"), "log": {"level": "info", "format": "json"},
        "data_plane": "grpc",
    })
    doc["tasks"]["metrics"]["db"] = str(workdir / "metrics.db")
    return doc


def test_wheel_check_config_accepts_the_shipped_config(
    wheel_venv: tuple[Path, Path], tmp_path: Path
) -> None:
    _, venv = wheel_venv
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(_shipped_config(tmp_path, tmp_path / "containerd.sock"), sort_keys=False))
    out = _run([str(venv / "bin" / "koord-runtime-proxy"), "check-config", "--config", str(config)], cwd=tmp_path)
    assert out.stdout.startswith("config ok:"), out.stdout
    for task in ("metrics", "qos-manager", "interference"):
        assert task in out.stdout, out.stdout


def test_wheel_run_serves_cri_and_stays_up_until_sigterm(
    wheel_venv: tuple[Path, Path], containerd: EmbeddedContainerd
) -> None:
    _, venv = wheel_venv
    launcher = ProxyLauncher(containerd.socket)
    try:
        workdir = launcher.mkdtemp()
        config = workdir / "config.yaml"
        config.write_text(yaml.safe_dump(_shipped_config(workdir, containerd.socket), sort_keys=False))
        proxy = ProxyProcess(workdir=workdir, socket_path=workdir / "proxy.sock", config_path=config,
                             env=dict(_clean_env(), PYTHONUNBUFFERED="1"),
                             command=(str(venv / "bin" / "koord-runtime-proxy"),))
        launcher.started.append(proxy)
        proxy.wait_healthy()
        version = proxy.runtime().Version(cri.VersionRequest(), timeout=10)
        assert version.runtime_name == "containerd"
        # The QoS manager (the last shipped task, built on the metrics task's store)
        # loaded its strategies: the process is up with every task, not just listening.
        proxy.wait_event("qos_strategies", timeout=30)
        assert proxy.running and proxy.healthz() == 200
        assert not proxy.events("task_crashed") and not proxy.events("task_exited"), proxy.log()
    finally:
        problems = launcher.cleanup()
    assert not problems, "\n".join(problems)
