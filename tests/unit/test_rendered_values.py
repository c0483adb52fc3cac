"""Issue 27 item 3: a value that reaches HAProxy's generated configuration or its
command line (socket paths: listen, backend endpoints) is validated where the config is
parsed, by the one validator ``run``, ``check-config`` and a reload share: exit 2 (or a
rejected reload) naming the key, never a traceback or a crash-looping data plane."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from structlog.testing import capture_logs

from runtimeproxy import cli

BAD = [
    ("backend.runtime_endpoint", {"backend": {"runtime_endpoint": "/run/containerd/containerd.sock\nbind :1"}}),
    ("backend.image_endpoint", {"backend": {"image_endpoint": "/run/image\r.sock"}}),
    ("listen", {"listen": "{tmp}/proxy\t.sock"}),
]


def _config(tmp_path: Path, change: dict[str, Any], data_plane: str) -> Path:
    doc = {"listen": str(tmp_path / "proxy.sock"), "hookserver_dir": "", "metrics": {"listen": "127.0.0.1:0"},
           "state_dir": "", "data_plane": data_plane, **change}
    doc["listen"] = doc["listen"].replace("{tmp}", str(tmp_path))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize(("key", "change"), BAD, ids=[k for k, _ in BAD])
def test_check_config_refuses_a_control_character_in_a_socket_path_naming_the_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, change: dict[str, Any]) -> None:
    config = _config(tmp_path, change, "haproxy")  # the configuration check-config renders for HAProxy
    assert cli.main(["check-config", "--config", str(config)]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith(f"koord-runtime-proxy: invalid configuration: {key}: "), err
    assert "control characters" in err and "Traceback" not in err


@pytest.mark.parametrize(("key", "change"), BAD, ids=[k for k, _ in BAD])
def test_run_refuses_a_control_character_in_a_socket_path_before_it_listens(
        tmp_path: Path, key: str, change: dict[str, Any]) -> None:
    # A process of its own (a run that does not refuse would serve until the timeout kills it).
    config = _config(tmp_path, change, "grpc")
    out = subprocess.run([sys.executable, "-m", "runtimeproxy.cli", "run", "--config", str(config)],
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == cli.EXIT_CONFIG, out.stderr
    assert out.stderr.startswith(f"koord-runtime-proxy: invalid configuration: {key}: "), out.stderr
    assert not [p for p in tmp_path.iterdir() if p.is_socket()]


@pytest.mark.asyncio
async def test_a_reload_with_such_a_value_is_rejected_and_the_running_config_kept(
        fake_runtime: Any, start_proxy: Any) -> None:
    proxy = await start_proxy(fake_runtime, config_file=True)
    running = proxy.app.settings
    data = yaml.safe_load(proxy.config_path.read_text())
    data["backend"]["runtime_endpoint"] += "\n    server evil unix@/tmp/evil.sock"
    proxy.config_path.write_text(yaml.safe_dump(data))
    with capture_logs() as logs:
        assert await proxy.app.reload("test") is False
    assert proxy.app.settings is running
    rejected = [e for e in logs if e["event"] == "config_reload_rejected"]
    assert len(rejected) == 1 and rejected[0]["error"].startswith("backend.runtime_endpoint: "), logs
