"""The shipped systemd/config.yaml: valid, and its chain order is the YAML order."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from runtimeproxy import cli
from runtimeproxy.chain import plugins
from runtimeproxy.config import settings as config
from runtimeproxy.config.settings import Settings

SHIPPED = Path(__file__).resolve().parents[2] / "systemd" / "config.yaml"


def test_shipped_config_validates_and_keeps_yaml_order() -> None:
    settings = config.load(SHIPPED, {"hookserver_dir": ""})
    hooks = plugins.build_hooks(settings)
    assert [h.name for h in hooks] == ["batch-resource", "cpuset", "cpu-normalization", "group-identity", "resctrl",
                                          "memory-qos", "blkio", "oom-score-adj", "core-sched"]
    assert all(h.policy is config.FailurePolicy.IGNORE for h in hooks)
    assert settings.listen == "/var/run/koord-runtimeproxy/runtimeproxy.sock"
    assert settings.metrics_listen == "127.0.0.1:9316"


def test_reversed_yaml_gives_reversed_chain(tmp_path: Path) -> None:
    import yaml

    doc = yaml.safe_load(SHIPPED.read_text())
    doc["hooks"].reverse()
    doc["hookserver_dir"] = ""
    path = tmp_path / "reversed.yaml"
    path.write_text(yaml.safe_dump(doc))
    hooks = plugins.build_hooks(config.load(path))
    assert [h.name for h in hooks] == ["core-sched", "oom-score-adj", "blkio", "memory-qos", "resctrl",
                                          "group-identity", "cpu-normalization", "cpuset", "batch-resource"]


# --- one source: the built-in default is the shipped file (issue 14, item 8) ----------


def test_systemd_config_is_a_copy_of_the_built_in_default() -> None:
    assert SHIPPED.read_text(encoding="utf-8") == config.builtin_default_text()
    assert "the values below are the built-in defaults" not in SHIPPED.read_text()


def _no_default_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(config, "DEFAULT_CONFIG_PATH", tmp_path / "absent" / "config.yaml")


def test_no_file_runs_the_shipped_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _no_default_file(monkeypatch, tmp_path)
    builtin = config.load(None, {"hookserver_dir": ""})
    shipped = config.load(SHIPPED, {"hookserver_dir": ""})
    assert builtin == shipped
    assert builtin.source.startswith("built-in default") and shipped.source == str(SHIPPED)
    # Same chain: names, order, policies, stages, timeouts.
    hooks, tasks = plugins.validate(builtin)
    chain = [(h.name, h.policy, h.stages, h.timeout) for h in hooks]
    assert chain == [(h.name, h.policy, h.stages, h.timeout) for h in plugins.validate(shipped)[0]]
    assert tasks == plugins.validate(shipped)[1] == ["metrics", "interference", "qos-manager"]
    assert [name for name, *_ in chain] == ["batch-resource", "cpuset", "cpu-normalization", "group-identity",
                                             "resctrl", "memory-qos", "blkio", "oom-score-adj", "core-sched"]
    # Same tasks, valid as shipped: the whole agent, not a bare pass-through.
    assert dict(builtin.tasks) == dict(shipped.tasks)
    assert list(builtin.tasks) == ["metrics", "interference", "qos-manager"]
    assert builtin.rules == shipped.rules and builtin.rules


def test_check_config_without_a_file_checks_the_built_in_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_default_file(monkeypatch, tmp_path)
    assert cli.main(["check-config", "--hookserver-dir", ""]) == 0
    builtin = capsys.readouterr().out.splitlines()
    assert cli.main(["check-config", "--hookserver-dir", "", "--config", str(SHIPPED)]) == 0
    shipped = capsys.readouterr().out.splitlines()
    assert builtin[0].endswith(f"source=built-in default ({config.DEFAULT_CONFIG_PATH} absent)")
    assert builtin[0].rpartition(" source=")[0] == shipped[0].rpartition(" source=")[0]
    # the nine shipped hooks, the tasks, then each task's plan (tests/unit/test_check_plan.py)
    assert builtin[1:] == shipped[1:] and "tasks: metrics, interference, qos-manager" in builtin


def test_an_existing_default_file_wins_over_the_built_in(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("hooks: []\nhookserver_dir: ''\n")
    monkeypatch.setattr(config, "DEFAULT_CONFIG_PATH", path)
    settings = config.load(None)
    assert settings.hooks == () and dict(settings.tasks) == {} and settings.source == str(path)


def test_the_values_shown_are_the_defaults_of_a_file_that_omits_them() -> None:
    """A file of one's own replaces the default as a whole; a setting it omits takes the
    value the shipped file shows (only hooks, rules and tasks become empty)."""
    doc = config.builtin_default()
    for section in ("hooks", "rules", "tasks"):
        doc.pop(section)
    assert config.from_mapping(doc) == Settings()


def test_start_logs_where_its_config_came_from(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from runtimeproxy import app

    _no_default_file(monkeypatch, tmp_path)
    with structlog.testing.capture_logs() as logs:
        app.announce(config.load(None))
    assert logs == [{"event": "config_loaded", "log_level": "info",
                     "source": f"built-in default ({config.DEFAULT_CONFIG_PATH} absent)"}]
