"""Issue 27 items 2 and 4: one proxy per state_dir, and everything in it private.

Real ``koord-runtime-proxy run`` processes against the fixture containerd.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from runtimeproxy.demo.embedded import EmbeddedContainerd
from tests.integration.conftest import proxy_config_doc

METRICS = {"flush_interval": "500ms", "node_name": "krpt-node", "intervals": {"node": "500ms", "pods": "500ms"},
           "schedlat_source": "off", "memlat_source": "off", "cpi": False}


def test_a_second_proxy_on_the_same_state_dir_exits_2_naming_it_and_the_holder(
        proxy_factory: Any, containerd: EmbeddedContainerd) -> None:
    shared = proxy_factory.mkdtemp() / "state"
    first = proxy_factory.start(extra={"state_dir": str(shared)})
    # Another socket, another port, the same state dir.
    workdir = proxy_factory.mkdtemp()
    config = workdir / "config.yaml"
    config.write_text(yaml.safe_dump(proxy_config_doc(
        listen=workdir / "second.sock", backend=containerd.socket, metrics_port=0, extra={"state_dir": str(shared)})))
    out = subprocess.run([sys.executable, "-m", "runtimeproxy.cli", "run", "--config", str(config)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("koord-runtime-proxy: invalid configuration: state_dir: "), out.stderr
    assert f"pid {first.pid}" in out.stderr and str(shared) in out.stderr, out.stderr
    assert not (workdir / "second.sock").exists(), "refused before it listens"
    assert first.running
    # The holder gone, the directory is free again (the kernel dropped the lock).
    assert first.terminate() == 0
    again = proxy_factory.start(extra={"state_dir": str(shared)})
    assert (shared / "lock").read_text().strip() == str(again.pid)


def test_everything_in_the_state_dir_is_private(proxy_factory: Any) -> None:
    state = proxy_factory.mkdtemp() / "state"
    state.mkdir(mode=0o755)
    (state / "changes.jsonl").write_text("")
    os.chmod(state / "changes.jsonl", 0o644)  # what an older version left: tightened at start
    db = state / "metrics.db"
    proxy = proxy_factory.start(extra={"state_dir": str(state), "tasks": {"metrics": {"db": str(db), **METRICS}}})
    wal = Path(f"{db}-wal")
    deadline = time.monotonic() + 20
    while not (wal.exists() and wal.stat().st_size > 0 and Path(f"{db}-shm").exists()):
        assert time.monotonic() < deadline and proxy.running, proxy.log()[-3000:]
        time.sleep(0.1)  # the first flush: nothing to wait on but the file
    modes = {}
    for root, dirs, files in os.walk(state):
        for name in dirs + files:
            path = Path(root, name)
            modes[str(path.relative_to(state))] = stat.S_IMODE(path.lstat().st_mode)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert {"metrics.db", "metrics.db-wal", "metrics.db-shm", "lock", "changes.jsonl"} <= set(modes), modes
    wide = {name: oct(mode) for name, mode in modes.items() if mode & 0o077}
    assert not wide, wide
