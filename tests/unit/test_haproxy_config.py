"""The HAProxy configuration generated from Settings (runtimeproxy.dataplane.haproxy)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest
import structlog.testing

from runtimeproxy.app import choose_data_plane
from runtimeproxy.chain import plugins
from runtimeproxy.chain.hookchain import HookChain, HookPools
from runtimeproxy.config.confignet import find_haproxy
from runtimeproxy.config.settings import ConfigError, Settings, builtin_default, from_mapping
from runtimeproxy.dataplane import haproxy
from runtimeproxy.transport.grpcserver import known_methods


def _ALL() -> tuple[str, ...]:
    return haproxy.LIFECYCLE_METHODS


def _settings(tmp_path: Path, **doc: object) -> Settings:
    base: dict[str, object] = {"listen": str(tmp_path / "k.sock"),
                               "backend": {"runtime_endpoint": "/run/c.sock", "image_endpoint": "/run/i.sock"}}
    return from_mapping({**base, **doc})


def _lines(text: str, start: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith(start)]


def test_lifecycle_methods_are_routed_by_exact_path_everything_else_of_cri_to_containerd(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    layout = haproxy.Layout.for_listen(Path(s.listen))
    text = haproxy.render(s, layout)
    [acl] = _lines(text, "acl lifecycle")
    assert acl.split()[:3] == ["acl", "lifecycle", "path"]  # exact match, not path_beg
    assert set(acl.split()[3:]) == set(haproxy.LIFECYCLE_METHODS)
    assert len(haproxy.LIFECYCLE_METHODS) == 8
    assert all(m in known_methods() for m in haproxy.LIFECYCLE_METHODS)
    assert _lines(text, "use_backend intercept") == ["use_backend intercept if lifecycle"]
    # HTTP/2 to Python's grpc.aio server, as to containerd; Python's own calls do not come back through HAProxy.
    assert _lines(text, "server python") == [f'server python "unix@{layout.intercept_socket}" proto h2']
    assert text.count('server containerd "unix@/run/c.sock" proto h2') == 1
    assert text.count('server containerd "unix@/run/i.sock" proto h2') == 1
    assert f'bind "unix@{s.listen}" mode 660 proto h2' in text
    [ret] = _lines(text, "http-request return")
    assert ret.endswith("unless cri") and str(layout.not_cri_reply) in ret


#: The Pre/Post hooks of the shipped chain (systemd/config.yaml): no hook at StopContainer or RemoveContainer.
#: The calls with a Pre hook in the shipped chain (batch-resource, cpuset, group-identity, blkio,
#: cpu-normalization); StartContainer, Stop- and RemovePodSandbox have only Post hooks.
SHIPPED_PRE_CALLS = frozenset({"RunPodSandbox", "CreateContainer", "UpdateContainerResources"})
RUNTIME = "/runtime.v1.RuntimeService/"


def test_the_shipped_chain_intercepts_only_the_calls_it_has_pre_hooks_for() -> None:
    chain = plugins.build_chain(from_mapping(builtin_default()), pools=HookPools())
    assert chain.pre_calls == SHIPPED_PRE_CALLS
    assert HookChain([]).pre_calls == frozenset()


def test_only_the_chains_pre_hooked_calls_and_the_store_calls_go_to_python(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    layout = haproxy.Layout.for_listen(Path(s.listen))
    text = haproxy.render(s, layout, haproxy.intercepted_paths(SHIPPED_PRE_CALLS))
    [acl] = _lines(text, "acl lifecycle")
    routed = {p.removeprefix(RUNTIME) for p in acl.split()[3:]}
    assert routed == SHIPPED_PRE_CALLS | {"StartContainer"}
    known = {p for line in _lines(text, "acl known path") for p in line.split()[3:]}
    # Stop/Remove are pass-through: counted per method by HAProxy like any other known method.
    assert {RUNTIME + m for m in ("StopContainer", "RemoveContainer", "StopPodSandbox", "RemovePodSandbox")} <= known
    assert not known & set(acl.split()[3:])


def test_without_hooks_python_still_gets_the_calls_that_bring_objects_into_the_store() -> None:
    assert haproxy.intercepted_paths(frozenset()) == tuple(
        RUNTIME + m for m in ("RunPodSandbox", "CreateContainer", "StartContainer", "UpdateContainerResources"))
    assert RUNTIME + "StopContainer" in haproxy.intercepted_paths(frozenset({"StopContainer"}))


def test_no_ring_and_no_log_lines_whatever_is_intercepted(tmp_path: Path) -> None:
    """What follows a stop or a removal is found by the re-sync: HAProxy tells Python nothing."""
    s = _settings(tmp_path)
    for intercepted in (haproxy.LIFECYCLE_METHODS, haproxy.intercepted_paths(frozenset()), ()):
        text = haproxy.render(s, haproxy.Layout.for_listen(Path(s.listen)), intercepted)
        words = {line.split()[0] for line in text.splitlines() if line.strip() and not line.startswith("#")}
        assert {"global", "defaults", "frontend", "backend"} <= words
        assert not {"ring", "log", "log-format"} & words
        assert "notice" not in text


def test_an_empty_interception_set_renders_an_acl_that_matches_nothing(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    text = haproxy.render(s, haproxy.Layout.for_listen(Path(s.listen)), ())
    assert _lines(text, "acl lifecycle") == ["acl lifecycle always_false"]
    known = {p for line in _lines(text, "acl known path") for p in line.split()[3:]}
    assert set(haproxy.LIFECYCLE_METHODS) <= known
    with pytest.raises(ValueError, match="not lifecycle methods"):
        haproxy.render(s, haproxy.Layout.for_listen(Path(s.listen)), ("/runtime.v1.RuntimeService/Version",))


def test_unix_sockets_only(tmp_path: Path) -> None:
    """No TCP anywhere: kubelet's socket is the only listener, the stats and master
    sockets are unix sockets, every server is a unix socket."""
    s = _settings(tmp_path)
    layout = haproxy.Layout.for_listen(Path(s.listen))
    text = haproxy.render(s, layout)
    assert _lines(text, "bind ") == [f'bind "unix@{s.listen}" mode 660 proto h2']
    assert [line.split()[2] for line in _lines(text, "stats socket")] == [f'"unix@{layout.stats_socket}"']
    servers = _lines(text, "server ")
    assert len(servers) == 3 and all(line.split()[2].startswith('"unix@') for line in servers), servers
    assert not _lines(text, "listen ") and not _lines(text, "peers")
    assert haproxy.command("/usr/sbin/haproxy", layout)[-1] == f"{layout.master_socket},mode,600"


def test_image_backend_defaults_to_the_runtime_endpoint(tmp_path: Path) -> None:
    s = _settings(tmp_path, backend={"runtime_endpoint": "/run/c.sock"})
    text = haproxy.render(s, haproxy.Layout.for_listen(Path(s.listen)))
    assert text.count('server containerd "unix@/run/c.sock" proto h2') == 2


def _section(text: str, header: str) -> list[str]:
    """The lines of one section (``header`` up to the next blank line)."""
    lines = [*text.splitlines(), ""]
    start = lines.index(header)
    end = lines.index("", start)
    return [line.strip() for line in lines[start + 1:end]]


def test_the_interception_backend_is_h2_to_python_without_the_h1_workarounds(tmp_path: Path) -> None:
    """One interception server (grpc.aio, HTTP/2): no connection-reuse override, no header
    surgery on its replies, one defaults section, no listener for Python's own calls."""
    s = _settings(tmp_path)
    layout = haproxy.Layout.for_listen(Path(s.listen))
    text = haproxy.render(s, layout)
    assert _section(text, "backend intercept") == [
        "retry-on conn-failure empty-response",
        "http-request set-header host localhost unless { req.hdr(host) -m found }",
        f'server python "unix@{layout.intercept_socket}" proto h2']
    for gone in ("http-reuse", "del-header", "abortonclose", "upstream"):
        assert gone not in text, gone
    assert [line for line in text.splitlines() if line.startswith("defaults")] == ["defaults"]


def test_routing_reads_the_path_the_client_sent_whatever_its_authority(tmp_path: Path) -> None:
    """The URI is put back into origin form before any rule reads ``path`` (HAProxy makes
    it absolute from ``:authority``); the servers get that path too."""
    s = _settings(tmp_path)
    lines = [line.strip() for line in _section(haproxy.render(s, haproxy.Layout.for_listen(Path(s.listen))),
                                                "frontend cri")]
    rules = [line for line in lines if line.startswith("http-request ")]
    assert rules[:3] == [line.strip() for line in haproxy.NORMALIZE_URI]
    assert "tune.http.maxhdr 101" in haproxy.render(s, haproxy.Layout.for_listen(Path(s.listen)))


def test_measured_settings_and_idle_timeouts(tmp_path: Path) -> None:
    s = _settings(tmp_path, data_plane_idle_timeout="2h", socket_mode="0640")
    text = haproxy.render(s, haproxy.Layout.for_listen(Path(s.listen)))
    assert "tune.bufsize 131072" in text and "tune.h2.max-concurrent-streams 1000" in text
    for side in ("client", "server", "tunnel", "http-request", "http-keep-alive"):
        assert f"timeout {side} 7200000ms" in text
    assert " mode 640 proto h2" in text


def test_the_not_cri_reply_is_trailers_only_unimplemented() -> None:
    head, _, body = haproxy.NOT_CRI_REPLY.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 200 OK" and body == b""
    assert {"content-type: application/grpc", "grpc-status: 12", "content-length: 0"} <= set(lines)


def test_a_path_haproxy_cannot_take_is_refused() -> None:
    with pytest.raises(ValueError):
        haproxy._quote("a\nb")


def test_data_plane_keys_are_validated() -> None:
    assert from_mapping({}).data_plane == "haproxy"
    assert from_mapping({"data_plane": "HAProxy"}).data_plane == "haproxy"
    with pytest.raises(ConfigError, match="data_plane"):
        from_mapping({"data_plane": "nginx"})
    with pytest.raises(ConfigError, match="data_plane_idle_timeout"):
        from_mapping({"data_plane_idle_timeout": "30d"})
    assert from_mapping({"data_plane_idle_timeout": "90m"}).data_plane_idle_timeout == 5400.0


def test_data_plane_unit_is_a_service_name_or_empty_and_the_orphan_grace_is_ignored_with_a_warning() -> None:
    assert from_mapping({}).data_plane_unit == ""
    unit = "koord-runtime-proxy-haproxy.service"
    assert from_mapping({"data_plane_unit": unit}).data_plane_unit == unit
    for bad in ("-H.service", "haproxy", "a b.service", "x.service\n", 7, True, "x/y.service"):
        with pytest.raises(ConfigError, match=f"data_plane_unit: .*{re.escape(repr(bad))}"):
            from_mapping({"data_plane_unit": bad})
    # An upgraded node's old config.yaml still starts; the removed keys are named at start.
    old = from_mapping({"data_plane_orphan_grace": "30s", "data_plane_survives_restart": True})
    assert [d.split(":")[0] for d in old.deprecated] == ["data_plane_orphan_grace", "data_plane_survives_restart"]
    assert from_mapping({}).deprecated == ()


def test_missing_haproxy_is_a_config_error_never_a_fallback(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    """``data_plane: haproxy`` (the default) without the binary: refused where the
    configuration is parsed (run, check-config and reload all parse it), naming the key and
    the binary; ``data_plane: grpc`` is a choice that needs nothing."""
    monkeypatch.setattr("runtimeproxy.config.confignet.find_haproxy", lambda: None)
    for doc in ({}, {"data_plane": "haproxy"}, {"data_plane": "HAProxy"}):
        with pytest.raises(ConfigError, match=r"^data_plane: the haproxy binary is not installed.*apt install haproxy"):
            from_mapping(doc)
    assert from_mapping({"data_plane": "grpc"}).data_plane == "grpc"
    # Removed after the parse: the App refuses to start (exit 2), it does not switch planes.
    settings = dataclasses.replace(from_mapping({"data_plane": "grpc", "listen": str(tmp_path / "k.sock")}),
                                   data_plane="haproxy")
    monkeypatch.setattr("runtimeproxy.app.find_haproxy", lambda: None)
    with structlog.testing.capture_logs() as logs, pytest.raises(ConfigError, match=r"^data_plane: "):
        choose_data_plane(settings, _ALL)
    assert not logs
    assert choose_data_plane(dataclasses.replace(settings, data_plane="grpc"), _ALL) is None


def test_run_and_check_config_exit_2_without_haproxy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from runtimeproxy import cli

    path = tmp_path / "c.yaml"
    path.write_text(f"listen: {tmp_path}/k.sock\nhookserver_dir: ''\nstate_dir: ''\n")
    path.chmod(0o600)
    monkeypatch.setattr("runtimeproxy.config.confignet.find_haproxy", lambda: None)
    for command in ("check-config", "run"):
        assert cli.main([command, "--config", str(path)]) == 2, command
        err = capsys.readouterr().err
        assert "data_plane: the haproxy binary is not installed" in err, err
    assert not (tmp_path / "k.sock").exists()


@pytest.mark.skipif(find_haproxy() is None, reason="haproxy not installed")
@pytest.mark.parametrize("intercepted", [haproxy.LIFECYCLE_METHODS, haproxy.intercepted_paths(SHIPPED_PRE_CALLS),
                                         haproxy.intercepted_paths(frozenset()), ()],
                         ids=["all", "shipped", "no-hooks", "empty"])
def test_haproxy_accepts_the_generated_configuration_without_warnings(
    tmp_path: Path, intercepted: tuple[str, ...]
) -> None:
    s = dataclasses.replace(_settings(tmp_path), shutdown_grace=5.0)
    layout = haproxy.Layout.for_listen(Path(s.listen))
    layout.run_dir.mkdir()
    layout.not_cri_reply.write_bytes(haproxy.NOT_CRI_REPLY)
    layout.config_file.write_text(haproxy.render(s, layout, intercepted))
    binary = find_haproxy()
    assert binary is not None
    out = subprocess.run([binary, "-c", "-f", str(layout.config_file)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "WARNING" not in out.stdout + out.stderr, out.stdout + out.stderr


def test_check_config_reports_the_data_plane(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from runtimeproxy import cli

    path = tmp_path / "c.yaml"
    path.write_text(f"listen: {tmp_path}/k.sock\nhookserver_dir: ''\ndata_plane: haproxy\nstate_dir: ''\n")
    path.chmod(0o600)
    if find_haproxy() is not None:
        assert cli.main(["check-config", "--config", str(path)]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert "data_plane=haproxy (/" in first and "; a child: stops with the proxy)" in first, first
        unit = "koord-runtime-proxy-haproxy.service"
        assert cli.main(["check-config", "--config", str(path), "--data-plane-unit", unit]) == 0
        assert f"; run by systemd: {unit})" in capsys.readouterr().out.splitlines()[0]
        # A configuration HAProxy refuses is exit 2 naming data_plane.
        monkeypatch.setattr(haproxy, "render", lambda s, layout: "global\n    no-such-keyword 1\n")
        assert cli.main(["check-config", "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert "data_plane" in err and "no-such-keyword" in err  # HAProxy's reason
        monkeypatch.undo()
    monkeypatch.setattr("runtimeproxy.dataplane.process.find_haproxy", lambda: None)
    assert cli.main(["check-config", "--config", str(path)]) == 2  # removed after the parse: no fallback either
    assert "data_plane: the haproxy binary is not installed" in capsys.readouterr().err


def test_the_shipped_units_leave_haproxy_to_systemd() -> None:
    """The product's unit runs HAProxy through its own unit (--data-plane-unit), stops it only on
    a stop job of its own (PartOf/BindsTo would cut pass-through at every restart, PropagatesStopTo
    at every crash: test_systemd_units) and uses the default KillMode; HAProxy's unit is
    master-worker with notify, restarted always."""
    systemd = Path(__file__).resolve().parents[2] / "systemd"
    unit = (systemd / "koord-runtime-proxy.service").read_text()
    directives = [line.split("=", 1)[0] for line in unit.splitlines() if "=" in line and not line.startswith("#")]
    assert "KillMode" not in directives and "PartOf" not in directives and "BindsTo" not in directives
    assert "PropagatesStopTo" not in directives  # it also stops HAProxy when this unit fails (crash, watchdog)
    assert "exec systemctl stop --no-block koord-runtime-proxy-haproxy.service" in unit
    assert "After=koord-runtime-proxy-haproxy.service" in unit.splitlines()
    assert "--data-plane-unit koord-runtime-proxy-haproxy.service" in unit
    haproxy_unit = (systemd / "koord-runtime-proxy-haproxy.service").read_text().splitlines()
    for line in ("Type=notify", "Restart=always", "ExecReload=/bin/kill -USR2 $MAINPID"):
        assert line in haproxy_unit
    start = next(line for line in haproxy_unit if line.startswith("ExecStart="))
    assert " -Ws " in start
    # Its paths are the data plane's layout for the shipped listen.
    env = next(line for line in haproxy_unit if line.startswith("Environment="))
    listen = Path(from_mapping(builtin_default()).listen)
    run_dir = haproxy.Layout.for_listen(listen).run_dir
    assert f'"DIR={run_dir}"' in env and f'"SOCKET={listen}"' in env
    assert f"ConditionPathExists={run_dir / 'haproxy.cfg'}" in haproxy_unit
    assert from_mapping(builtin_default()).data_plane_unit == ""  # `run` in a terminal: a child


def test_a_deprecated_key_is_named_at_start_and_by_check_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from runtimeproxy import cli
    from runtimeproxy.app import announce

    settings = from_mapping({"data_plane_orphan_grace": "30s"})
    with structlog.testing.capture_logs() as logs:
        announce(settings)
    warned = [e for e in logs if e["event"] == "config_key_deprecated"]
    assert len(warned) == 1 and warned[0]["key"].startswith("data_plane_orphan_grace: ignored")
    assert warned[0]["log_level"] == "warning"
    path = tmp_path / "c.yaml"
    path.write_text(f"listen: {tmp_path}/k.sock\nhookserver_dir: ''\ndata_plane: grpc\nstate_dir: ''\n"
                    "data_plane_survives_restart: true\n")
    path.chmod(0o600)
    assert cli.main(["check-config", "--config", str(path)]) == 0
    assert "deprecated, ignored: data_plane_survives_restart: ignored" in capsys.readouterr().out
