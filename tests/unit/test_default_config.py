"""The shipped systemd/config.yaml: valid, and its chain order is the YAML order."""

from __future__ import annotations

from pathlib import Path

from runtimeproxy import config, plugins

SHIPPED = Path(__file__).resolve().parents[2] / "systemd" / "config.yaml"


def test_shipped_config_validates_and_keeps_yaml_order() -> None:
    settings = config.load(SHIPPED, {"hookserver_dir": ""})
    hooks = plugins.build_hooks(settings)
    assert [h.name for h in hooks] == ["batch-resource", "cpuset", "cpu-normalization", "group-identity", "resctrl"]
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
    assert [h.name for h in hooks] == ["resctrl", "group-identity", "cpu-normalization", "cpuset", "batch-resource"]
