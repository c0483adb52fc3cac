"""Settings: defaults, durations, validation errors that name key path and value,
CLI overrides and Koordinator's flag names, plugin resolution errors."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from runtimeproxy import cli
from runtimeproxy.chain import plugins
from runtimeproxy.config import settings as config
from runtimeproxy.config.settings import ConfigError, FailurePolicy, Settings
from runtimeproxy.hookapi import HostRoots, Stage

# --- defaults and durations ---------------------------------------------------------


def test_defaults() -> None:
    settings = config.from_mapping({})
    assert settings == Settings()
    assert settings.listen == "/var/run/koord-runtimeproxy/runtimeproxy.sock"
    assert settings.socket_mode == 0o660
    assert settings.backend.runtime_endpoint == "/run/containerd/containerd.sock"
    assert settings.backend.image_endpoint == ""
    assert settings.hooks == ()
    assert settings.hookserver_dir == "/etc/runtime/hookserver.d"
    assert settings.skip_label_key == "runtimeproxy.koordinator.sh/skip-hookserver"
    assert settings.skip_label_value == "true"
    assert settings.metrics_listen == "127.0.0.1:9316"
    assert settings.max_message_bytes == 16 * 1024 * 1024
    assert settings.shutdown_grace == 10.0
    assert settings.host == HostRoots()


def test_empty_yaml_file_means_defaults(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("# nothing here\n")
    assert config.load(path) == Settings()


def test_hook_defaults() -> None:
    [hook] = config.from_mapping({"hooks": [{"name": "x", "plugin": "m:X"}]}).hooks
    assert hook.failure_policy is FailurePolicy.IGNORE
    assert hook.timeout == 1.0
    assert hook.stages is None
    assert dict(hook.args) == {}
    assert hook.key_path == "hooks[0]"
    assert isinstance(hook.args, types.MappingProxyType)


def test_full_hook_entry() -> None:
    raw = {
        "name": "k", "remote": "unix:///run/koordlet.sock", "failure_policy": "fail", "timeout": "250ms",
        "stages": ["PreCreateContainer", "PreRunPodSandbox"],
    }
    [hook] = config.from_mapping({"hooks": [{"name": "a", "plugin": "m:A"}, raw]}).hooks[1:]
    assert hook.remote == "/run/koordlet.sock"
    assert hook.plugin == ""
    assert hook.failure_policy is FailurePolicy.FAIL
    assert hook.timeout == 0.25
    assert hook.stages == frozenset({Stage.PRE_CREATE_CONTAINER, Stage.PRE_RUN_POD_SANDBOX})
    assert hook.key_path == "hooks[1]"


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [("500ms", 0.5), (2, 2.0), ("1m", 60.0), ("1.5s", 1.5), (" 3 s ", 3.0), ("2h", 7200.0), (0.25, 0.25), ("7", 7.0)],
)
def test_durations(raw: object, seconds: float) -> None:
    assert config.parse_duration(raw, "x.timeout") == pytest.approx(seconds)


@pytest.mark.parametrize("raw", ["-1s", 0, "0ms", True, "1d", "abc", None, [1], "1.5.s"])
def test_bad_durations_name_key_and_value(raw: object) -> None:
    with pytest.raises(ConfigError) as err:
        config.parse_duration(raw, "hooks[3].timeout")
    assert err.value.key_path == "hooks[3].timeout"
    assert err.value.value == raw
    assert str(err.value).startswith("hooks[3].timeout: ")
    assert repr(raw) in str(err.value)


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "[::1]:9316", "node-1.local:65535", ""])
def test_metrics_listen_accepts(listen: str) -> None:
    # A non-loopback address is refused unless allowed: tests/unit/test_insecure_settings.py.
    allow = {"allow_insecure": {"metrics_listen": True}}
    assert config.from_mapping({"metrics": {"listen": listen}, **allow}).metrics_listen == listen


def test_other_settings_parse() -> None:
    settings = config.from_mapping(
        {
            "listen": "unix:///run/krp.sock", "socket_mode": "0600",
            "backend": {"runtime_endpoint": "/run/c.sock", "image_endpoint": "unix:///run/i.sock",
                        "max_reconnect_backoff": "300ms"},
            "skip_label": {"key": "skip", "value": "yes"}, "metrics": {"listen": ""},
            "log": {"level": "DEBUG", "format": "json"}, "shutdown_grace": "30s", "max_message_bytes": 8 << 20,
            "host": {"cgroup_root": "/host/sys/fs/cgroup", "proc": "/host/proc"},
            "rules": {"cpu": {"x": 1}}, "tasks": {"t": {"enabled": False}},
        }
    )
    assert settings.listen == "/run/krp.sock"
    assert settings.socket_mode == 0o600
    assert settings.backend.runtime_endpoint == "/run/c.sock"
    assert settings.backend.image_endpoint == "/run/i.sock"
    assert settings.backend.max_reconnect_backoff == pytest.approx(0.3)
    assert (settings.skip_label_key, settings.skip_label_value) == ("skip", "yes")
    assert settings.metrics_listen == ""
    assert (settings.log_level, settings.log_format) == ("debug", "json")
    assert settings.shutdown_grace == 30.0
    assert settings.max_message_bytes == 8 << 20
    assert settings.host.cgroup == Path("/host/sys/fs/cgroup")
    assert settings.host.proc == Path("/host/proc")
    assert settings.host.sys == Path("/sys")
    assert dict(settings.rules) == {"cpu": {"x": 1}}


# --- validation errors --------------------------------------------------------------

HOOK = {"name": "h", "plugin": "m:H"}

BAD: list[tuple[str, dict[str, Any], str, object]] = [
    ("unknown-top-key", {"hoks": []}, "hoks", []),
    ("hooks-not-list", {"hooks": {"name": "h"}}, "hooks", {"name": "h"}),
    ("hook-not-mapping", {"hooks": ["h"]}, "hooks[0]", "h"),
    ("missing-name", {"hooks": [{"plugin": "m:H"}]}, "hooks[0].name", None),
    ("empty-name", {"hooks": [{"name": "", "plugin": "m:H"}]}, "hooks[0].name", ""),
    ("plugin-and-remote", {"hooks": [{"name": "h", "plugin": "m:H", "remote": "/r.sock"}]}, "hooks[0]",
     {"name": "h", "plugin": "m:H", "remote": "/r.sock"}),
    ("neither-plugin-nor-remote", {"hooks": [HOOK, {"name": "x"}]}, "hooks[1]", {"name": "x"}),
    ("unknown-hook-key", {"hooks": [{**HOOK, "policy": "Fail"}]}, "hooks[0].policy", "Fail"),
    ("bad-policy", {"hooks": [{**HOOK, "failure_policy": "Sometimes"}]}, "hooks[0].failure_policy", "Sometimes"),
    ("bad-stage", {"hooks": [{**HOOK, "stages": ["PreCreateContainer", "PreFly"]}]}, "hooks[0].stages[1]",
     "PreFly"),
    ("empty-stages", {"hooks": [{**HOOK, "stages": []}]}, "hooks[0].stages", []),
    ("bad-timeout", {"hooks": [{**HOOK, "timeout": "-1s"}]}, "hooks[0].timeout", "-1s"),
    ("duplicate-names", {"hooks": [HOOK, {"name": "g", "remote": "/g.sock"}, HOOK]}, "hooks[2].name", "h"),
    ("relative-listen", {"listen": "run/proxy.sock"}, "listen", "run/proxy.sock"),
    ("empty-listen", {"listen": ""}, "listen", ""),
    ("relative-backend", {"backend": {"runtime_endpoint": "containerd.sock"}}, "backend.runtime_endpoint",
     "containerd.sock"),
    ("relative-remote", {"hooks": [{"name": "k", "remote": "koordlet.sock"}]}, "hooks[0].remote", "koordlet.sock"),
    ("unknown-backend-key", {"backend": {"endpoint": "/x"}}, "backend.endpoint", "/x"),
    ("bad-socket-mode", {"socket_mode": "0999"}, "socket_mode", "0999"),
    ("bad-socket-mode-int", {"socket_mode": 0o1777}, "socket_mode", 0o1777),
    ("bad-metrics-listen", {"metrics": {"listen": "localhost"}}, "metrics.listen", "localhost"),
    ("metrics-port-out-of-range", {"metrics": {"listen": "127.0.0.1:99999"}}, "metrics.listen", "127.0.0.1:99999"),
    ("stage-not-a-string", {"hooks": [{**HOOK, "stages": [{"PreCreateContainer": True}]}]}, "hooks[0].stages[0]",
     {"PreCreateContainer": True}),
    ("metrics-listen-url", {"metrics": {"listen": "http://127.0.0.1:9316"}}, "metrics.listen",
     "http://127.0.0.1:9316"),
    ("host-root-dotdot", {"host": {"cgroup_root": "/host/../etc"}}, "host.cgroup_root", "/host/../etc"),
    ("host-root-relative", {"host": {"proc": "proc"}}, "host.proc", "proc"),
    ("bad-log-level", {"log": {"level": "loud"}}, "log.level", "loud"),
    ("small-max-message", {"max_message_bytes": 1024}, "max_message_bytes", 1024),
    ("skip-label-empty-key", {"skip_label": {"key": ""}}, "skip_label.key", ""),
    ("rules-not-mapping", {"rules": [1]}, "rules", [1]),
]


@pytest.mark.parametrize(("data", "key_path", "value"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_validation_error_names_key_path_and_value(data: dict[str, Any], key_path: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        config.from_mapping(data)
    assert err.value.key_path == key_path
    assert err.value.value == value
    message = str(err.value)
    assert message.startswith(f"{key_path}: ")
    assert f"(got {value!r})" in message


def test_yaml_errors_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("listen: /a.sock\nhooks: [\n  - name: x\n")
    with pytest.raises(ConfigError) as err:
        config.load(path)
    assert err.value.key_path == "--config"
    assert str(path) in str(err.value)
    assert "line" in str(err.value)
    with pytest.raises(ConfigError) as missing:
        config.load(tmp_path / "absent.yaml")
    assert missing.value.key_path == "--config"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError) as not_mapping:
        config.load(path)
    assert not_mapping.value.key_path == "<root>"


# --- CLI overrides ------------------------------------------------------------------


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_cli_overrides_win_over_the_file(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "c.yaml",
        {
            "listen": "/file/proxy.sock",
            "backend": {"runtime_endpoint": "/file/containerd.sock", "max_reconnect_backoff": "1s"},
            "metrics": {"listen": "127.0.0.1:1234"},
            "log": {"level": "debug", "format": "json"},
            "hookserver_dir": "/file/hooks.d",
        },
    )
    args = cli.parser().parse_args(
        ["run", "--config", str(path), "--listen", "/cli/proxy.sock", "--backend", "unix:///cli/c.sock",
         "--metrics-listen", "", "--log-level", "warning"]
    )
    overrides = cli.overrides_from(args)
    assert overrides == {
        "listen": "/cli/proxy.sock", "backend.runtime_endpoint": "unix:///cli/c.sock", "metrics.listen": "",
        "log.level": "warning",
    }

    settings = config.load(args.config, overrides)

    assert settings.listen == "/cli/proxy.sock"
    assert settings.backend.runtime_endpoint == "/cli/c.sock"
    assert settings.backend.max_reconnect_backoff == 1.0  # sibling key from the file survives
    assert settings.metrics_listen == ""
    assert settings.log_level == "warning"
    assert settings.log_format == "json"  # not overridden
    assert settings.hookserver_dir == "/file/hooks.d"


def test_merge_overrides_does_not_touch_the_input() -> None:
    data = {"backend": {"runtime_endpoint": "/a.sock"}, "listen": "/l.sock"}
    merged = config.merge_overrides(data, {"backend.image_endpoint": "/i.sock", "hookserver_dir": ""})
    assert merged == {"backend": {"runtime_endpoint": "/a.sock", "image_endpoint": "/i.sock"},
                      "listen": "/l.sock", "hookserver_dir": ""}
    assert data == {"backend": {"runtime_endpoint": "/a.sock"}, "listen": "/l.sock"}


def test_invalid_override_is_reported_like_a_file_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.yaml", {"listen": "/ok.sock"})
    with pytest.raises(ConfigError) as err:
        config.load(path, {"metrics.listen": "nope"})
    assert err.value.key_path == "metrics.listen"


def test_koordinator_alias_flags() -> None:
    args = cli.parser().parse_args(
        [
            "run",
            "--koord-runtimeproxy-endpoint", "/var/run/koord-runtimeproxy/runtimeproxy.sock",
            "--remote-runtime-service-endpoint", "/var/run/containerd/containerd.sock",
            "--remote-image-service-endpoint", "/var/run/containerd/image.sock",
        ]
    )
    assert cli.overrides_from(args) == {
        "listen": "/var/run/koord-runtimeproxy/runtimeproxy.sock",
        "backend.runtime_endpoint": "/var/run/containerd/containerd.sock",
        "backend.image_endpoint": "/var/run/containerd/image.sock",
    }
    settings = config.from_mapping(config.merge_overrides({}, cli.overrides_from(args)))
    assert settings.listen == "/var/run/koord-runtimeproxy/runtimeproxy.sock"
    assert settings.backend.runtime_endpoint == "/var/run/containerd/containerd.sock"
    assert settings.backend.image_endpoint == "/var/run/containerd/image.sock"


def test_check_config_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(
        tmp_path / "good.yaml",
        {"hookserver_dir": "", "hooks": [{"name": "shares", "plugin": "example-cpu-shares", "failure_policy": "Fail",
                                          "timeout": "200ms", "args": {"cpu_shares": 512}}]},
    )
    assert cli.main(["check-config", "--config", str(good)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("config ok: listen=/var/run/koord-runtimeproxy/runtimeproxy.sock")
    assert out.splitlines()[1:] == ["1. shares\tFail\t0.2s\tPreCreateContainer,PreUpdateContainerResources",
                                   "tasks: none"]

    bad = _write(tmp_path / "bad.yaml", {"hooks": [{"name": "shares", "plugin": "example-cpu-shares",
                                                    "args": {"cpu_shares": 1}}]})
    assert cli.main(["check-config", "--config", str(bad), "--hookserver-dir", ""]) == cli.EXIT_CONFIG
    assert "hooks[0].args.cpu_shares" in capsys.readouterr().err


# --- plugin resolution --------------------------------------------------------------


@pytest.mark.parametrize(
    ("hook", "key_path", "value"),
    [
        ({"name": "x", "plugin": "no-such-plugin"}, "hooks[1].plugin", "no-such-plugin"),
        ({"name": "x", "plugin": "no_such_module_krp:Hook"}, "hooks[1].plugin", "no_such_module_krp:Hook"),
        ({"name": "x", "plugin": "{mod}:Missing"}, "hooks[1].plugin", "{mod}:Missing"),
        ({"name": "x", "plugin": "{mod}:NOT_CALLABLE"}, "hooks[1].plugin", "{mod}:NOT_CALLABLE"),
        ({"name": "x", "plugin": "{mod}:NoStages"}, "hooks[1].plugin", "{mod}:NoStages"),
        ({"name": "x", "plugin": "{mod}:Tagger", "stages": ["PreStopContainer"]}, "hooks[1].stages",
         "PreStopContainer"),
        ({"name": "x", "plugin": "{mod}:Patcher", "args": {"cpu_sharez": 2}}, "hooks[1].args.cpu_sharez",
         ["cpu_sharez"]),
        ({"name": "x", "remote": "/k.sock", "stages": ["PostCreateContainer"]}, "hooks[1].stages",
         ["PostCreateContainer"]),
        ({"name": "x", "plugin": "example-cpu-shares", "args": {"cpu_shares": "lots"}},
         "hooks[1].args.cpu_shares", "lots"),
    ],
    ids=["unknown-entry-point", "unknown-module", "missing-attr", "not-callable", "no-stage",
         "unimplemented-stage", "bad-args", "remote-unsupported-stage", "example-bad-args"],
)
def test_build_hooks_errors_name_key_path(hook_module, hook: dict[str, Any], key_path: str, value: object) -> None:
    hook = {k: (v.replace("{mod}", hook_module.name) if isinstance(v, str) else v) for k, v in hook.items()}
    if isinstance(value, str):
        value = value.replace("{mod}", hook_module.name)
    settings = config.from_mapping(
        {"hookserver_dir": "", "hooks": [{"name": "h0", "plugin": hook_module.plugin("Tagger")}, hook]}
    )
    with pytest.raises(ConfigError) as err:
        plugins.build_hooks(settings)
    assert err.value.key_path == key_path
    assert err.value.value == value
    assert str(err.value).startswith(f"{key_path}: ")


def test_build_hooks_binds_settings(hook_module) -> None:
    settings = config.from_mapping(
        {
            "hookserver_dir": "",
            "hooks": [
                {"name": "t", "plugin": hook_module.plugin("Tagger"), "failure_policy": "Fail", "timeout": "2s"},
                {"name": "o", "plugin": hook_module.plugin("Observer"), "stages": ["PostStartContainer"]},
                {"name": "k", "remote": "/k.sock"},
                {"name": "e", "plugin": "example-cpu-shares"},
            ],
        }
    )
    t, o, k, e = plugins.build_hooks(settings)
    assert [h.name for h in (t, o, k, e)] == ["t", "o", "k", "e"]
    assert t.stages == frozenset({Stage.PRE_RUN_POD_SANDBOX, Stage.PRE_CREATE_CONTAINER})
    assert (t.policy, t.timeout) == (FailurePolicy.FAIL, 2.0)
    assert o.stages == frozenset({Stage.POST_START_CONTAINER})
    assert k.policy is FailurePolicy.IGNORE
    assert Stage.PRE_CREATE_CONTAINER in k.stages
    assert e.stages == frozenset({Stage.PRE_CREATE_CONTAINER, Stage.PRE_UPDATE_CONTAINER_RESOURCES})


def test_bad_registration_file_is_skipped_not_fatal(tmp_path: Path, registration_json) -> None:
    (tmp_path / "10-bad.json").write_text("{not json")
    (tmp_path / "20-good.json").write_text(registration_json(Path("/run/good.sock"), ["PreRunPodSandbox"], "Fail"))
    settings = config.from_mapping({"hookserver_dir": str(tmp_path)})
    [hook] = plugins.build_hooks(settings)
    assert hook.name == "hookserver.d/20-good"
    assert hook.policy is FailurePolicy.FAIL
    assert hook.stages == frozenset({Stage.PRE_RUN_POD_SANDBOX})
