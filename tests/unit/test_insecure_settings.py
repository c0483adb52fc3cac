"""Risky settings are refused unless allowed (issue 14, item 6): a CRI socket others may
use, a metrics endpoint off loopback, a config file or hookserver.d registration that
someone other than root or us can change (owner, mode, directory, symlink). Refused =
exit 2 naming the key and the reason, a reload rejected; allowed = a warning at every
start. Real files, real chmod/chown (the tests run as root; uid 4242 is "another user")."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml

from runtimeproxy import app, cli
from runtimeproxy.chain import plugins
from runtimeproxy.config import settings as config
from runtimeproxy.config.filetrust import path_problem
from runtimeproxy.config.settings import ConfigError

OTHER_UID = 4242

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


# --- socket_mode and metrics.listen ----------------------------------------------------


@pytest.mark.parametrize("mode", ["0666", "0777", "0664", "0661", "0606"])
def test_socket_mode_for_others_is_refused(mode: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.from_mapping({"socket_mode": mode})
    assert err.value.key_path == "socket_mode" and "allow_insecure.socket_mode" in str(err.value)
    allowed = config.from_mapping({"socket_mode": mode, "allow_insecure": {"socket_mode": True}})
    assert allowed.socket_mode == int(mode, 8) and len(allowed.accepted_risks) == 1
    assert allowed.accepted_risks[0].startswith(f"socket_mode={mode}: ")


@pytest.mark.parametrize("mode", ["0660", "0600", "0640", "0700"])
def test_socket_mode_without_others_is_fine(mode: str) -> None:
    assert config.from_mapping({"socket_mode": mode}).accepted_risks == ()


@pytest.mark.parametrize("listen", ["0.0.0.0:9316", "10.1.2.3:9316", "[::]:9316", "node-1.local:9316",
                                    "[::ffff:10.0.0.1]:1"])
def test_non_loopback_metrics_listen_is_refused(listen: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.from_mapping({"metrics": {"listen": listen}})
    assert err.value.key_path == "metrics.listen" and err.value.value == listen
    assert "/debug/explain" in str(err.value) and "allow_insecure.metrics_listen" in str(err.value)
    allowed = config.from_mapping({"metrics": {"listen": listen}, "allow_insecure": {"metrics_listen": True}})
    assert allowed.metrics_listen == listen and len(allowed.accepted_risks) == 1


@pytest.mark.parametrize("listen", ["127.0.0.1:9316", "127.3.2.1:1", "[::1]:9316", "localhost:9316", ""])
def test_loopback_metrics_listen_is_fine(listen: str) -> None:
    assert config.from_mapping({"metrics": {"listen": listen}}).accepted_risks == ()


@pytest.mark.parametrize(("raw", "key"), [
    ({"socket_mode": "yes"}, "allow_insecure.socket_mode"),
    ({"everything": True}, "allow_insecure.everything"),
    ("all", "allow_insecure"),
])
def test_allow_insecure_is_validated(raw: object, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.from_mapping({"allow_insecure": raw})
    assert err.value.key_path == key


def test_cli_flag_is_checked_like_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path / "c.yaml", {})
    assert cli.main(["check-config", "--config", str(path), "--metrics-listen", "0.0.0.0:9316"]) == cli.EXIT_CONFIG
    assert "invalid configuration: metrics.listen: is not a loopback address" in capsys.readouterr().err


# --- the config file -------------------------------------------------------------------


def _write(path: Path, doc: dict[str, Any], mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"hookserver_dir": "", **doc}))
    path.chmod(mode)
    return path


def _chmod(path: Path, mode: int) -> Path:
    path.chmod(mode)
    return path


def _bad_file(tmp_path: Path, case: str) -> tuple[Path, str]:
    """A config file that someone else could change, and the words the refusal uses."""
    good = tmp_path / "etc" / "config.yaml"
    if case == "owned-by-another-user":
        path = _write(good, {})
        os.chown(path, OTHER_UID, -1)
        return path, f"is owned by uid {OTHER_UID}"
    if case == "group-writable":
        return _write(good, {}, 0o664), "group-writable (mode 0664)"
    if case == "world-writable":
        return _write(good, {}, 0o646), "world-writable (mode 0646)"
    if case == "in-world-writable-dir":
        path = _write(good, {})
        _chmod(path.parent, 0o777)
        return path, f"directory {path.parent} on the way is group/world-writable (mode 0777)"
    if case == "in-sticky-world-writable-dir":  # /tmp-like: strict where the file lives
        path = _write(good, {})
        _chmod(path.parent, 0o1777)
        return path, "which is group/world-writable (mode 1777)"
    if case == "in-group-writable-dir":
        path = _write(good, {})
        _chmod(path.parent, 0o770)
        return path, f"directory {path.parent} on the way is group-writable (mode 0770)"
    if case == "below-world-writable-dir":
        path = _write(tmp_path / "open" / "etc" / "config.yaml", {})
        _chmod(tmp_path / "open", 0o777)
        return path, "on the way is group/world-writable (mode 0777) without the sticky bit"
    if case == "dir-owned-by-another-user":
        path = _write(good, {})
        os.chown(path.parent, OTHER_UID, -1)
        return path, f"directory {path.parent} is owned by uid {OTHER_UID}"
    if case == "symlink-in-world-writable-dir":
        target = _write(good, {})
        link = tmp_path / "drop" / "config.yaml"
        link.parent.mkdir()
        link.symlink_to(target)
        _chmod(link.parent, 0o1777)
        return link, f"reached through symlink {link}"
    if case == "symlink-owned-by-another-user":
        target = _write(good, {})
        link = tmp_path / "config.yaml"
        link.symlink_to(target)
        os.lchown(link, OTHER_UID, -1)
        return link, f"reached through a symlink {link} is owned by uid {OTHER_UID}"
    if case == "symlink-to-a-writable-file":
        target = _write(good, {}, 0o666)
        link = tmp_path / "config.yaml"
        link.symlink_to(target)
        return link, f"file {target} is group/world-writable (mode 0666)"
    if case == "symlinked-dir-to-an-open-dir":
        path = _write(tmp_path / "open" / "config.yaml", {})
        _chmod(path.parent, 0o777)
        (tmp_path / "etc").mkdir()
        (tmp_path / "etc" / "krp").symlink_to("../open")  # relative, resolved component by component
        return tmp_path / "etc" / "krp" / "config.yaml", f"directory {path.parent} on the way is group/world-writable"
    raise AssertionError(case)


BAD_FILES = ["owned-by-another-user", "group-writable", "world-writable", "in-world-writable-dir",
             "in-sticky-world-writable-dir", "in-group-writable-dir", "below-world-writable-dir",
             "dir-owned-by-another-user", "symlink-in-world-writable-dir", "symlink-owned-by-another-user",
             "symlink-to-a-writable-file", "symlinked-dir-to-an-open-dir"]


@pytest.mark.parametrize("case", BAD_FILES)
def test_config_file_others_can_change_is_refused(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, reason = _bad_file(tmp_path, case)
    assert cli.main(["check-config", "--config", str(path)]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "invalid configuration: --config: refused: " in err and reason in err, err
    assert repr(str(path)) in err and "allow_insecure.file_permissions: true" in err
    # ``run`` refuses it the same way, before it listens.
    assert cli.main(["run", "--config", str(path)]) == cli.EXIT_CONFIG


@pytest.mark.parametrize("case", BAD_FILES)
def test_config_file_risk_can_be_accepted(case: str, tmp_path: Path) -> None:
    path, reason = _bad_file(tmp_path, case)
    real = path.resolve()
    mode = real.stat().st_mode
    real.write_text(yaml.safe_dump({"hookserver_dir": "", "allow_insecure": {"file_permissions": True}}))
    real.chmod(mode)  # write_text keeps the mode; be explicit
    settings = config.load(path)
    assert len(settings.accepted_risks) == 1 and reason in settings.accepted_risks[0]


def test_trusted_paths(tmp_path: Path) -> None:
    good = _write(tmp_path / "etc" / "config.yaml", {}, 0o600)
    assert path_problem(good) is None
    link = tmp_path / "config.yaml"
    link.symlink_to(good)
    assert path_problem(link) is None
    # A sticky world-writable directory on the way (like /tmp) is fine when what we
    # reach through it is ours: nobody else can rename it.
    sticky = tmp_path / "sticky"
    _write(sticky / "mine" / "config.yaml", {})
    _chmod(sticky, 0o1777)
    assert path_problem(sticky / "mine" / "config.yaml") is None
    assert path_problem(tmp_path / "missing.yaml") is None  # the reader reports it
    assert config.load(good).accepted_risks == ()


# --- hookserver.d registrations ------------------------------------------------------------


def _hookdir(tmp_path: Path, registration_json: Any) -> Path:
    directory = tmp_path / "hookserver.d"
    directory.mkdir()
    (directory / "10-koordlet.json").write_text(
        registration_json(Path("/run/koordlet.sock"), ["PreRunPodSandbox"], "Ignore"))
    return directory


@pytest.mark.parametrize("case", ["file-owned-by-another-user", "file-world-writable", "dir-world-writable",
                                  "dir-sticky-world-writable", "symlinked-file-owned-by-another-user"])
def test_hookserver_registration_others_can_change_is_refused(
    case: str, tmp_path: Path, registration_json: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _hookdir(tmp_path, registration_json)
    reg = directory / "10-koordlet.json"
    if case == "file-owned-by-another-user":
        os.chown(reg, OTHER_UID, -1)
        bad = reg
    elif case == "file-world-writable":
        bad = _chmod(reg, 0o646)
    elif case == "dir-world-writable":
        bad = _chmod(directory, 0o777)
    elif case == "dir-sticky-world-writable":
        bad = _chmod(directory, 0o1777)
    else:
        elsewhere = tmp_path / "elsewhere.json"
        reg.rename(elsewhere)
        os.chown(elsewhere, OTHER_UID, -1)
        reg.symlink_to(elsewhere)
        bad = reg
    path = _write(tmp_path / "c.yaml", {"hookserver_dir": str(directory)})
    assert cli.main(["check-config", "--config", str(path)]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "invalid configuration: hookserver_dir: refused: " in err and repr(str(bad)) in err, err

    allowed = config.from_mapping({"hookserver_dir": str(directory), "allow_insecure": {"file_permissions": True}})
    with structlog.testing.capture_logs() as logs:
        [hook] = plugins.build_hooks(allowed)
    assert hook.name == "hookserver.d/10-koordlet"
    assert [entry["event"] for entry in logs] == ["insecure_setting_allowed"]
    assert logs[0]["risk"].startswith("hookserver_dir: ")


def test_trusted_hookserver_dir_builds(tmp_path: Path, registration_json: Any) -> None:
    directory = _hookdir(tmp_path, registration_json)
    [hook] = plugins.build_hooks(config.from_mapping({"hookserver_dir": str(directory)}))
    assert hook.name == "hookserver.d/10-koordlet"


# --- start: warned every time; reload: rejected --------------------------------------------


def test_every_accepted_risk_is_one_warning() -> None:
    settings = config.from_mapping({
        "socket_mode": "0666", "metrics": {"listen": "0.0.0.0:9316"},
        "allow_insecure": {"socket_mode": True, "metrics_listen": True, "file_permissions": True},
    })
    with structlog.testing.capture_logs() as logs:
        app.announce(settings)
    warnings = [e for e in logs if e["event"] == "insecure_setting_allowed"]
    assert [w["risk"].partition(":")[0] for w in warnings] == ["socket_mode=0666", "metrics.listen=0.0.0.0"]
    assert all(w["log_level"] == "warning" for w in warnings)


def test_run_warns_about_accepted_risks_at_every_start(short_dir: Path) -> None:
    """The real ``run``: a group/world-writable config file with a 0666 socket, both
    allowed, starts (waiting for a backend that is not there) and says so."""
    path = _write(short_dir / "c.yaml", {
        "listen": str(short_dir / "p.sock"), "backend": {"runtime_endpoint": str(short_dir / "none.sock")},
        "socket_mode": "0666", "metrics": {"listen": ""}, "log": {"format": "json"},
        "allow_insecure": {"socket_mode": True, "file_permissions": True},
    }, 0o666)
    proc = subprocess.Popen([sys.executable, "-m", "runtimeproxy.cli", "run", "--config", str(path)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[dict[str, Any]] = []
    try:
        assert proc.stderr is not None
        for raw in proc.stderr:
            if raw.startswith("{"):
                lines.append(json.loads(raw))
            if lines and lines[-1]["event"] == "backend_unavailable":
                break
        # Listening (the socket is made before the backend is awaited; with the default data
        # plane by HAProxy, a child started meanwhile), as allowed.
        end = time.monotonic() + 10
        while not (short_dir / "p.sock").exists() and time.monotonic() < end:
            time.sleep(0.05)
        assert stat.S_IMODE((short_dir / "p.sock").stat().st_mode) == 0o666
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert proc.stderr is not None
        proc.stderr.close()
    events = [(e["event"], e.get("risk", e.get("source", ""))) for e in lines]
    assert events[0] == ("config_loaded", str(path))
    risks = [risk for event, risk in events if event == "insecure_setting_allowed"]
    assert [r.partition(":")[0] for r in risks] == ["socket_mode=0666", "--config"]
    assert f"file {path} is group/world-writable (mode 0666)" in risks[1]


@pytest.mark.asyncio
@pytest.mark.parametrize("change", ["chmod-0666", "chown", "socket_mode", "metrics_listen", "registration-chown"])
async def test_reload_of_a_risky_config_is_rejected(
    change: str, fake_runtime: Any, start_proxy: Any, short_dir: Path, registration_json: Any
) -> None:
    hookdir = short_dir / "hookserver.d"
    hookdir.mkdir()
    proxy = await start_proxy(fake_runtime, config_file=True, hookserver_dir=str(hookdir))
    path = proxy.config_path  # blocking file calls are fine in a test
    old, old_chain = proxy.app.settings, proxy.app.chain
    if change == "registration-chown":  # what the hookserver.d watcher would reload on
        reg = hookdir / "10-x.json"
        reg.write_text(registration_json(short_dir / "x.sock", ["PreRunPodSandbox"], "Ignore"))
        os.chown(reg, OTHER_UID, -1)
    elif change == "chmod-0666":
        path.chmod(0o666)
    elif change == "chown":
        os.chown(path, OTHER_UID, -1)
    else:
        data = yaml.safe_load(path.read_text())
        data.update({"socket_mode": "0666"} if change == "socket_mode" else {"metrics": {"listen": "0.0.0.0:0"}})
        path.write_text(yaml.safe_dump(data))

    assert await proxy.app.reload("test") is False

    assert proxy.app.settings is old and proxy.app.chain is old_chain
    assert proxy.sample("koord_runtime_proxy_config_reloads_total", {"result": "error"}) == 1
    assert proxy.sample("koord_runtime_proxy_config_reloads_total", {"result": "ok"}) == 0
