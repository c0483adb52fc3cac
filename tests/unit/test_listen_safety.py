"""Issue 14.1: ``listen`` may only ever replace our own stale socket.

``prepare_socket`` directly, then the real CLI process (``python -m runtimeproxy.cli
run``): every refused path is exit 2 naming ``listen`` (or ``metrics.listen``) and its
value, the path is left exactly as it was, and a failed start leaves no socket file.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from runtimeproxy.config.confignet import UNIX_PATH_MAX
from runtimeproxy.config.settings import ConfigError
from runtimeproxy.transport.grpcserver import SocketInUse, prepare_socket


def _bound_socket(path: Path, *, listening: bool) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    if listening:
        sock.listen(1)
    return sock


def _long_path(base: Path) -> Path:
    name = "s" * (UNIX_PATH_MAX + 1 - len(str(base)) - 1)
    path = base / name
    assert len(os.fsencode(str(path))) == UNIX_PATH_MAX + 1
    return path


# --- prepare_socket ----------------------------------------------------------------


def test_regular_file_is_refused_and_kept(short_dir: Path) -> None:
    path = short_dir / "precious.txt"
    path.write_text("not a socket")
    with pytest.raises(ConfigError) as err:
        prepare_socket(path)
    assert err.value.key_path == "listen" and err.value.value == str(path)
    assert "regular file" in str(err.value)
    assert path.read_text() == "not a socket"


def test_directory_is_refused(short_dir: Path) -> None:
    path = short_dir / "adir"
    path.mkdir()
    with pytest.raises(ConfigError, match=r"^listen: is a directory"):
        prepare_socket(path)
    assert path.is_dir()


def test_symlink_is_refused_even_to_a_stale_socket(short_dir: Path) -> None:
    target = short_dir / "stale.sock"
    _bound_socket(target, listening=False).close()  # a socket file nobody listens on
    link = short_dir / "link.sock"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match=r"^listen: is a symbolic link"):
        prepare_socket(link)
    assert link.is_symlink() and target.exists()


def test_dangling_symlink_is_refused(short_dir: Path) -> None:
    link = short_dir / "dangling.sock"
    link.symlink_to(short_dir / "nowhere")
    with pytest.raises(ConfigError, match="symbolic link"):
        prepare_socket(link)
    assert link.is_symlink()


def test_fifo_is_refused(short_dir: Path) -> None:
    path = short_dir / "fifo"
    os.mkfifo(path)
    with pytest.raises(ConfigError, match="FIFO"):
        prepare_socket(path)
    assert path.exists()


def test_stale_socket_is_replaced(short_dir: Path) -> None:
    path = short_dir / "stale.sock"
    _bound_socket(path, listening=False).close()
    prepare_socket(path)
    assert not path.exists()


def test_live_socket_is_refused(short_dir: Path) -> None:
    path = short_dir / "live.sock"
    with _bound_socket(path, listening=True):
        with pytest.raises(SocketInUse):
            prepare_socket(path)
    assert path.exists()


def test_path_over_the_kernel_limit_is_refused(short_dir: Path) -> None:
    path = _long_path(short_dir)
    with pytest.raises(ConfigError, match=rf"^listen: a unix socket path is at most {UNIX_PATH_MAX} bytes"):
        prepare_socket(path)
    prepare_socket(path.with_name(path.name[:-1]))  # one byte less is fine


def test_parent_that_is_a_file_is_a_config_error(short_dir: Path) -> None:
    parent = short_dir / "file"
    parent.write_text("x")
    with pytest.raises(ConfigError, match=r"^listen: cannot use this path"):
        prepare_socket(parent / "p.sock")


def test_missing_parents_are_created(short_dir: Path) -> None:
    prepare_socket(short_dir / "a" / "b" / "p.sock")
    assert (short_dir / "a" / "b").is_dir()


# --- the real CLI process ----------------------------------------------------------


@pytest.fixture
def occupied_port() -> Iterator[int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    try:
        yield int(sock.getsockname()[1])
    finally:
        sock.close()


def _run(
    workdir: Path, listen: Path, metrics: str = "127.0.0.1:0", command: str = "run"
) -> subprocess.CompletedProcess[str]:
    doc: dict[str, Any] = {
        "listen": str(listen), "backend": {"runtime_endpoint": str(workdir / "no-containerd.sock")},
        "metrics": {"listen": metrics}, "hookserver_dir": "", "hooks": [], "log": {"format": "json"},
    }
    config = workdir / "config.yaml"
    config.write_text(yaml.safe_dump(doc))
    return subprocess.run([sys.executable, "-m", "runtimeproxy.cli", command, "--config", str(config)],
                          capture_output=True, text=True, timeout=60, check=False, cwd=workdir)


def _assert_exit_2(out: subprocess.CompletedProcess[str], key: str, value: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    [message] = [line for line in out.stderr.splitlines() if line.startswith("koord-runtime-proxy:")]
    assert message.startswith(f"koord-runtime-proxy: invalid configuration: {key}: "), out.stderr
    assert message.endswith(f"(got {value!r})"), out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def test_cli_refuses_to_delete_a_regular_file(short_dir: Path) -> None:
    victim = short_dir / "important.conf"
    victim.write_text("keep me")
    out = _run(short_dir, victim)
    _assert_exit_2(out, "listen", str(victim))
    assert victim.read_text() == "keep me"
    assert "stale_socket_removed" not in out.stderr


def test_cli_directory_is_exit_2_not_a_traceback(short_dir: Path) -> None:
    target = short_dir / "sockdir"
    target.mkdir()
    out = _run(short_dir, target)
    _assert_exit_2(out, "listen", str(target))
    assert target.is_dir()


def test_cli_path_over_the_kernel_limit_is_exit_2(short_dir: Path) -> None:
    path = _long_path(short_dir)
    out = _run(short_dir, path)
    _assert_exit_2(out, "listen", str(path))
    assert not path.exists()
    _assert_exit_2(_run(short_dir, path, command="check-config"), "listen", str(path))  # the same validator


def test_cli_metrics_port_in_use_is_exit_2_and_leaves_no_socket(short_dir: Path, occupied_port: int) -> None:
    listen = short_dir / "p.sock"
    value = f"127.0.0.1:{occupied_port}"
    out = _run(short_dir, listen, metrics=value)
    _assert_exit_2(out, "metrics.listen", value)
    assert '"event": "listening"' in out.stderr, "the socket was bound first, so the clean-up is what removed it"
    assert not listen.exists(), "a failed start leaves no socket file behind"
