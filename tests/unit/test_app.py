"""The process as a whole: reload keeps or swaps the chain, health follows the
backend, and /debug/explain shows what hooks changed for a pod."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from criapi import cri_v1_pb2 as cri

RT = "/runtime.v1.RuntimeService/"
RUN = RT + "RunPodSandbox"
CREATE = RT + "CreateContainer"


def pod_config() -> cri.PodSandboxConfig:
    cfg = cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="web-0", namespace="prod", uid="uid-1"))
    cfg.linux.cgroup_parent = "/kubepods/burstable/poduid-1"
    return cfg


def create_request() -> bytes:
    config = cri.ContainerConfig(metadata=cri.ContainerMetadata(name="app"))
    config.linux.resources.cpu_shares = 1024
    return cri.CreateContainerRequest(
        pod_sandbox_id="sb-1", config=config, sandbox_config=pod_config()
    ).SerializeToString()


def run_request() -> bytes:
    return cri.RunPodSandboxRequest(config=pod_config()).SerializeToString()


def patcher(hook_module: Any, shares: int) -> dict[str, Any]:
    return {"name": "tuner", "plugin": hook_module.plugin("Patcher"), "args": {"cpu_shares": shares}}


def rewrite(path: Path, update: dict[str, Any]) -> None:
    data = yaml.safe_load(path.read_text())
    data.update(update)
    path.write_text(yaml.safe_dump(data))


async def created_shares(proxy: Any) -> int:
    await proxy.call(CREATE, create_request())
    shares: int = proxy.fake.requests(CREATE, cri.CreateContainerRequest)[-1].config.linux.resources.cpu_shares
    return shares


def reloads(proxy: Any, result: str) -> float:
    return proxy.sample("koord_runtime_proxy_config_reloads_total", {"result": result})


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "broken",
    [
        "hooks: [\n  - name: x\n",  # YAML syntax
        yaml.safe_dump({"hooks": [{"name": "tuner"}]}),  # neither plugin nor remote
        "{plugin_of_mod}",  # a plugin whose args it rejects
        yaml.safe_dump({"hooks": [{"name": "tuner", "plugin": "no_such_module_krp:X"}]}),
    ],
    ids=["yaml-syntax", "schema", "plugin-args", "plugin-import"],
)
async def test_invalid_reload_keeps_the_running_config(
    fake_runtime, start_proxy, hook_module, broken: str
) -> None:
    proxy = await start_proxy(fake_runtime, hooks=[patcher(hook_module, 700)], config_file=True)
    assert proxy.config_path is not None
    old_chain, old_settings = proxy.app.chain, proxy.app.settings
    if broken == "{plugin_of_mod}":
        rewrite(proxy.config_path, {"hooks": [{"name": "tuner", "plugin": hook_module.plugin("Patcher"),
                                               "args": {"cpu_sharez": 1}}]})
    else:
        proxy.config_path.write_text(broken)

    assert await proxy.app.reload("test") is False

    assert proxy.app.chain is old_chain
    assert proxy.app.settings is old_settings
    assert reloads(proxy, "error") == 1
    assert reloads(proxy, "ok") == 0
    assert await created_shares(proxy) == 700  # the old hook still runs


@pytest.mark.asyncio
async def test_valid_reload_swaps_the_chain(fake_runtime, start_proxy, hook_module) -> None:
    proxy = await start_proxy(fake_runtime, hooks=[patcher(hook_module, 700)], config_file=True)
    assert proxy.config_path is not None
    old_chain = proxy.app.chain
    assert await created_shares(proxy) == 700

    rewrite(proxy.config_path, {"hooks": [patcher(hook_module, 300), {"name": "tag", "plugin": hook_module.plugin(
        "Tagger")}]})
    assert await proxy.app.reload("test") is True

    assert proxy.app.chain is not old_chain
    assert [h.name for h in proxy.app.chain.hooks] == ["tuner", "tag"]
    assert dict(proxy.app.settings.hooks[0].args) == {"cpu_shares": 300}
    assert reloads(proxy, "ok") == 1
    assert await created_shares(proxy) == 300
    assert proxy.fake.requests(CREATE, cri.CreateContainerRequest)[-1].config.annotations["order"] == "tag"


@pytest.mark.asyncio
async def test_config_file_change_is_picked_up_by_polling(fake_runtime, start_proxy, hook_module, wait_until) -> None:
    proxy = await start_proxy(
        fake_runtime, hooks=[patcher(hook_module, 700)], config_file=True, reload_poll_interval="50ms"
    )
    assert proxy.config_path is not None
    old_chain = proxy.app.chain
    rewrite(proxy.config_path, {"hooks": [patcher(hook_module, 4444)]})  # new size too
    await wait_until(lambda: proxy.app.chain is not old_chain, 5.0, "the config watcher to reload")
    assert await created_shares(proxy) == 4444


@pytest.mark.asyncio
async def test_hookserver_dir_change_is_picked_up_by_polling(
    fake_runtime, start_proxy, short_dir: Path, registration_json, wait_until
) -> None:
    hookdir = short_dir / "hookserver.d"
    hookdir.mkdir()
    proxy = await start_proxy(fake_runtime, config_file=True, reload_poll_interval="50ms", hookserver_dir=str(hookdir))
    assert proxy.app.chain.hooks == ()
    (hookdir / "koordlet.json").write_text(registration_json(short_dir / "k.sock", ["PreCreateContainer"]))
    await wait_until(lambda: len(proxy.app.chain.hooks) == 1, 5.0, "the registration to be loaded")
    assert proxy.app.chain.hooks[0].name == "hookserver.d/koordlet"


@pytest.mark.asyncio
async def test_health_follows_the_backend(idle_runtime, start_proxy, short_dir: Path, wait_until) -> None:
    backend = short_dir / "late.sock"
    proxy = await start_proxy(idle_runtime, backend_path=backend, wait_ready=False)

    status, body = await proxy.http_get("/healthz")
    assert (status, body) == (503, b"unhealthy: starting: waiting for the backend to answer Version\n")
    assert proxy.sample("koord_runtime_proxy_up", {}) == 0

    await idle_runtime.start(backend)
    await wait_until(lambda: proxy.app.ready, 10.0, "the proxy to become ready")
    assert await proxy.http_get("/healthz") == (200, b"ok\n")
    assert proxy.sample("koord_runtime_proxy_up", {}) == 1
    status, metrics = await proxy.http_get("/metrics")
    assert status == 200
    assert b"koord_runtime_proxy_cri_calls_total" in metrics


@pytest.mark.asyncio
async def test_socket_is_created_with_the_configured_mode(fake_runtime, start_proxy) -> None:
    proxy = await start_proxy(fake_runtime, socket_mode="0600")
    mode = proxy.socket.stat().st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600


@pytest.mark.asyncio
async def test_explain_shows_recorded_changes(fake_runtime, start_proxy, hook_module) -> None:
    hooks = [
        {"name": "tuner", "plugin": hook_module.plugin("Patcher"),
         "args": {"cpu_shares": 2, "annotations": {"qos": "BE"}, "cgroup_parent": "/kubepods/besteffort/poduid-1",
                  "reason": "best effort"}},
    ]
    proxy = await start_proxy(fake_runtime, hooks=hooks)

    status, _ = await proxy.http_get("/debug/explain?pod=prod/web-0")
    assert status == 404

    await proxy.call(RUN, run_request())
    await proxy.call(CREATE, create_request())

    status, body = await proxy.http_get("/debug/explain?pod=prod%2Fweb-0")
    assert status == 200
    explained = json.loads(body)
    assert explained["pod"] == "prod/web-0"
    assert explained["uid"] == "uid-1"
    assert explained["sandbox_id"] == "sb-1"
    assert explained["cgroup_parent"] == "/kubepods/besteffort/poduid-1"
    changes = [(c["hook"], c["stage"], c["target"], c["old"], c["new"], c["reason"]) for c in explained["changes"]]
    assert changes == [
        ("tuner", "PreRunPodSandbox", "pod.annotations[qos]", "", "BE", "best effort"),
        ("tuner", "PreRunPodSandbox", "pod.cgroup_parent", "/kubepods/burstable/poduid-1",
         "/kubepods/besteffort/poduid-1", "best effort"),
        ("tuner", "PreCreateContainer", "container.annotations[qos]", "", "BE", "best effort"),
        ("tuner", "PreCreateContainer", "container.resources.cpu_shares", "1024", "2", "best effort"),
    ]

    status, _ = await proxy.http_get("/debug/explain?pod=prod/other")
    assert status == 404
