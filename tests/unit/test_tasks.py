"""Background-task plugins: found by name, configured under ``tasks:``, run supervised."""

from __future__ import annotations

import asyncio
import importlib
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from runtimeproxy.chain import plugins
from runtimeproxy.config import settings as config
from runtimeproxy.hookapi import PodInfo, PodMeta
from runtimeproxy.state.store import Store

TASK_MODULE = '''
import asyncio
from pathlib import Path

CALLS = []

def make(init):
    out = Path(init.args["out"])
    if init.args.get("explode_at_build"):
        from runtimeproxy.hookapi import HookConfigError
        raise HookConfigError(init.key_path + ".explode_at_build", True, "refused")

    async def run():
        pods, containers = init.snapshot()
        out.write_text(f"{init.name} pods={sorted(p.meta.name for p in pods.values())}")
        CALLS.append(init.name)
        await asyncio.sleep(3600)

    return run
'''


@pytest.fixture
def task_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"krp_task_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(TASK_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.asyncio
async def test_enabled_task_runs_and_sees_the_store(task_module: str, tmp_path: Path) -> None:
    store = Store()
    store.put_pod(PodInfo(meta=PodMeta(name="web", namespace="ns", uid="u1"), id="sb1"))
    out = tmp_path / "out.txt"
    settings = config.from_mapping({"tasks": {f"{task_module}:make": {"out": str(out)}}})
    tasks = plugins.build_tasks(settings, plugins.task_base(store.snapshot))
    assert [name for name, _ in tasks] == [f"{task_module}:make"]
    runner = asyncio.create_task(tasks[0][1]())
    try:
        async with asyncio.timeout(5):
            while not out.exists():
                await asyncio.sleep(0.01)
    finally:
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
    assert out.read_text() == f"{task_module}:make pods=['web']"


def test_disabled_task_is_not_built(task_module: str, tmp_path: Path) -> None:
    settings = config.from_mapping({"tasks": {f"{task_module}:make": {"enabled": False, "out": "x"}}})
    assert plugins.build_tasks(settings, plugins.task_base(Store().snapshot)) == []


def test_unknown_task_names_the_key() -> None:
    settings = config.from_mapping({"tasks": {"no-such-task": {}}})
    with pytest.raises(config.ConfigError) as err:
        plugins.build_tasks(settings, plugins.task_base(Store().snapshot))
    assert err.value.key_path == "tasks.no-such-task"
    assert "unknown plugin" in str(err.value)


def test_task_arg_errors_name_the_key(task_module: str) -> None:
    settings = config.from_mapping({"tasks": {f"{task_module}:make": {"out": "x", "explode_at_build": True}}})
    with pytest.raises(config.ConfigError) as err:
        plugins.build_tasks(settings, plugins.task_base(Store().snapshot))
    assert err.value.key_path == f"tasks.{task_module}:make.explode_at_build"


def test_bad_enabled_value_names_the_key(task_module: str) -> None:
    settings = config.from_mapping({"tasks": {f"{task_module}:make": {"enabled": "yes"}}})
    with pytest.raises(config.ConfigError) as err:
        plugins.build_tasks(settings, plugins.task_base(Store().snapshot))
    assert err.value.key_path == f"tasks.{task_module}:make.enabled"


LATE_MODULE = '''
import asyncio
import importlib

RESULTS = []

async def page(query):
    return 200, "text/plain", b"early"

def make(init):
    init.add_route("/debug/early", page)
    init.add_exposition(lambda: b"early_metric 1\\n")

    async def run():
        attempts = (lambda: init.add_route("/debug/late", page), lambda: init.add_exposition(lambda: b"late 1\\n"))
        for attempt in attempts:
            try:
                attempt()
                RESULTS.append("accepted")
            except RuntimeError as exc:
                RESULTS.append(str(exc))
        await asyncio.sleep(3600)

    return run
'''


@pytest.mark.asyncio
async def test_routes_and_expositions_are_refused_once_the_endpoint_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_runtime: Any, start_proxy: Any,
) -> None:
    """Added at build time they are served; from a running task they would race the
    endpoint's reads of its tables, so they are refused with a RuntimeError."""
    name = f"krp_late_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(LATE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    proxy = await start_proxy(fake_runtime, tasks={f"{name}:make": {}})
    results = importlib.import_module(name).RESULTS
    async with asyncio.timeout(5):
        while len(results) < 2:
            await asyncio.sleep(0.01)
    assert results == ["route '/debug/late' added after the HTTP endpoint started",
                       "exposition added after the HTTP endpoint started"]
    assert await proxy.http_get("/debug/early") == (200, b"early")
    assert (await proxy.http_get("/debug/late"))[0] == 404
    status, body = await proxy.http_get("/metrics")
    assert status == 200 and b"early_metric 1\n" in body and b"late 1\n" not in body


# --- one validator for run, check-config and reload (issue 14, item 9) ----------------

BAD_TASKS = [
    ({"metrics": {"tiers": {"raw": "0s"}}}, "tasks.metrics.tiers.raw"),  # bad tier
    ({"metrics": {"tiers": {"step": "7m"}}}, "tasks.metrics.tiers.coarse_step"),  # tiers that do not fit
    ({"metrics": {"intervals": {"pods": "1x"}}}, "tasks.metrics.intervals.pods"),  # bad interval
    ({"metrics": {"collectors": {"gpu": {}}}}, "tasks.metrics.collectors.gpu"),  # not installed
    ({"metrics": {"collectors": {"psi": {"interval": "0s"}}}}, "tasks.metrics.collectors.psi.interval"),
    ({"metrics": {"collectors": {"node": {"enabled": False}}}}, "tasks.metrics.collectors.node.enabled"),
    ({"metrics": {"collectors": {"psi": {"every": "1s"}}}}, "tasks.metrics.collectors.psi.every"),
    ({"metrics": {"collectors": {"cpi": {"args": {"window": "5s"}}}}}, "tasks.metrics.collectors.cpi.args.window"),
    ({"metrics": {"intervals": {"psi": "5s"}, "collectors": {"psi": {"interval": "2s"}}}},
     "tasks.metrics.collectors.psi.interval"),  # one interval set two ways
    ({"metrics": {"advisors": [{"name": "ne", "url": "127.0.0.1:9100", "metrics": ["node_load1"]}]}},
     "tasks.metrics.advisors[0].url"),
    ({"metrics": {"dbpath": "/x"}}, "tasks.metrics.dbpath"),  # unknown key
    ({"metrics": {"kube": "yes"}}, "tasks.metrics.kube"),  # wrong type
    ({"metrics": {"enabled": "yes"}}, "tasks.metrics.enabled"),
    ({"metrics": "on"}, "tasks.metrics"),
    ({"no-such-task": {}}, "tasks.no-such-task"),
    ({"qos-manager": {}}, "tasks.qos-manager"),  # needs metrics before it
    ({"metrics": {}, "qos-manager": {"evict_mode": "api"}}, "tasks.qos-manager.evict_mode"),  # needs kube
    ({"metrics": {}, "qos-manager": {"fast_interval": "10ms"}}, "tasks.qos-manager.fast_interval"),
    ({"metrics": {}, "qos-manager": {"cgroup_driver": "cgroup"}}, "tasks.qos-manager.cgroup_driver"),
    ({"metrics": {}, "qos-manager": {"strategies": ["cpu-suppress", "no-such"]}}, "tasks.qos-manager.strategies[1]"),
    ({"metrics": {}, "qos-manager": {"strategies": [{"name": "cpu-suppress", "enabled": "no"}]}},
     "tasks.qos-manager.strategies[0].enabled"),
]


@pytest.mark.parametrize(("tasks", "key"), BAD_TASKS, ids=[k for _, k in BAD_TASKS])
def test_check_config_refuses_what_run_refuses(
    tasks: dict[str, Any], key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from runtimeproxy import cli

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"hookserver_dir": "", "tasks": tasks}))
    assert cli.main(["check-config", "--config", str(path)]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"invalid configuration: {key}:" in err
    # ``run`` refuses the same file with the same key, through the same validator.
    settings = config.load(path)
    with pytest.raises(config.ConfigError) as refused:
        plugins.build_tasks(settings, plugins.task_base(Store().snapshot))
    assert refused.value.key_path == key


def test_check_config_accepts_valid_tasks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from runtimeproxy import cli

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"hookserver_dir": "", "tasks": {
        "metrics": {"kube": True, "tiers": {"raw": "1h"}}, "qos-manager": {"evict_mode": "api"}}}))
    assert cli.main(["check-config", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("config ok:") and "tasks: metrics, qos-manager" in out.splitlines()


@pytest.mark.asyncio
@pytest.mark.parametrize(("tasks", "key"), BAD_TASKS[::3], ids=[k for _, k in BAD_TASKS[::3]])
async def test_reload_refuses_bad_tasks_and_keeps_the_running_config(
    tasks: dict[str, Any], key: str, fake_runtime: Any, start_proxy: Any
) -> None:
    proxy = await start_proxy(fake_runtime, config_file=True)
    old_chain, old_settings = proxy.app.chain, proxy.app.settings
    data = yaml.safe_load(proxy.config_path.read_text())
    data["tasks"] = tasks
    proxy.config_path.write_text(yaml.safe_dump(data))

    assert await proxy.app.reload("test") is False

    assert proxy.app.settings is old_settings and proxy.app.chain is old_chain
    assert proxy.sample("koord_runtime_proxy_config_reloads_total", {"result": "error"}) == 1
    assert proxy.sample("koord_runtime_proxy_config_reloads_total", {"result": "ok"}) == 0


STATE_MODULE = '''
import asyncio
from pathlib import Path

def make(init):
    Path(init.args["out"]).write_text(str(init.state_dir))

    async def run():
        await asyncio.sleep(3600)

    return run
'''


@pytest.mark.asyncio
async def test_tasks_get_the_state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_runtime: Any,
                                       start_proxy: Any) -> None:
    name = f"krp_state_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(STATE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    out, state = tmp_path / "out.txt", tmp_path / "state"
    await start_proxy(fake_runtime, tasks={f"{name}:make": {"out": str(out)}}, state_dir=str(state))
    assert out.read_text() == str(state)
