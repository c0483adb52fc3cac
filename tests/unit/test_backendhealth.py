"""/healthz and the backend-up gauges follow the backend: a short outage inside the
grace changes nothing, a longer one is one warning, 503 with the reason and gauge 0,
and the recovery is one info line. (tests/integration/test_backend_health.py does
the same against a real containerd.)"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import structlog

from criapi import cri_v1_pb2 as cri
from runtimeproxy.backend import CallError, Code, Reply
from runtimeproxy.config import settings as config
from runtimeproxy.config.settings import ConfigError
from runtimeproxy.ops.backendhealth import (
    IMAGE_FS_INFO_METHOD,
    VERSION_METHOD,
    VERSION_PAYLOAD,
    BackendMonitor,
    Probe,
)

VERSION = "/runtime.v1.RuntimeService/Version"


def backend(runtime: Path, image: Path | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"runtime_endpoint": str(runtime), "max_reconnect_backoff": "200ms",
                           "probe_interval": "100ms", "unhealthy_after": "1s"}
    if image is not None:
        doc["image_endpoint"] = str(image)
    return doc


def up(proxy: Any, name: str) -> float:
    return proxy.sample("koord_runtime_proxy_backend_up", {"backend": name})


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


@pytest.mark.asyncio
async def test_backend_loss_and_recovery(fake_runtime, start_proxy, wait_until) -> None:
    path = fake_runtime.path
    with structlog.testing.capture_logs() as logs:
        proxy = await start_proxy(fake_runtime, backend=backend(path))
        await wait_until(lambda: up(proxy, "runtime") == 1, 5.0, "the first probe")
        assert up(proxy, "image") == 1  # one endpoint serves both
        assert proxy.sample("koord_runtime_proxy_up", {}) == 1
        # The probe's hand-made payload is what protobuf makes of VersionRequest(version="v1").
        assert VERSION_PAYLOAD == cri.VersionRequest(version="v1").SerializeToString()
        assert fake_runtime.requests(VERSION, cri.VersionRequest)[-1].version == "v1"

        # Shorter than the grace: nothing to see.
        await fake_runtime.stop()
        await asyncio.sleep(0.5)
        assert await proxy.http_get("/healthz") == (200, b"ok\n")
        await fake_runtime.start(path)
        await asyncio.sleep(0.6)
        assert await proxy.http_get("/healthz") == (200, b"ok\n")
        assert up(proxy, "runtime") == 1 and not events(logs, "backend_lost")

        # Longer: lost once, 503 with the reason, gauges 0.
        loop = asyncio.get_running_loop()
        stopped = loop.time()
        await fake_runtime.stop()
        await wait_until(lambda: up(proxy, "runtime") == 0, 5.0, "the backend to be declared lost")
        assert loop.time() - stopped >= 1.0, "not before the grace"
        status, body = await proxy.http_get("/healthz")
        assert status == 503
        assert body.startswith(f"unhealthy: backend runtime ({path}) unreachable for ".encode()), body
        assert b"UNAVAILABLE" in body
        assert up(proxy, "image") == 0
        assert proxy.sample("koord_runtime_proxy_up", {}) == 1, "the proxy itself still serves"
        await asyncio.sleep(0.5)  # five more failing probes
        (lost,) = events(logs, "backend_lost")
        assert lost["log_level"] == "warning" and lost["backend"] == "runtime" and lost["endpoint"] == str(path)

        await fake_runtime.start(path)
        await wait_until(lambda: up(proxy, "runtime") == 1, 5.0, "the backend to be back")
        assert await proxy.http_get("/healthz") == (200, b"ok\n")
        await asyncio.sleep(0.3)
        (recovered,) = events(logs, "backend_recovered")
        assert recovered["log_level"] == "info" and recovered["down_for"] >= 1.0
        assert len(events(logs, "backend_lost")) == 1


@pytest.mark.asyncio
async def test_a_separate_image_endpoint_is_probed_on_its_own(
    fake_runtime, idle_runtime, start_proxy, short_dir: Path, wait_until
) -> None:
    image = short_dir / "image.sock"
    await idle_runtime.start(image)
    proxy = await start_proxy(fake_runtime, backend=backend(fake_runtime.path, image))
    await wait_until(lambda: up(proxy, "image") == 1 and up(proxy, "runtime") == 1, 5.0, "both probes")
    await idle_runtime.stop()
    await wait_until(lambda: up(proxy, "image") == 0, 5.0, "the image backend to be lost")
    assert up(proxy, "runtime") == 1
    status, body = await proxy.http_get("/healthz")
    assert status == 503 and body.startswith(f"unhealthy: backend image ({image}) unreachable".encode())


def test_probe_settings_are_validated() -> None:
    settings = config.from_mapping({"backend": {"probe_interval": "500ms", "unhealthy_after": "10s"}})
    assert (settings.backend.probe_interval, settings.backend.unhealthy_after) == (0.5, 10.0)
    assert (config.Settings().backend.probe_interval, config.Settings().backend.unhealthy_after) == (5.0, 6.0)
    for key, value in (("probe_interval", "0s"), ("unhealthy_after", "-3s"), ("unhealthy_after", "later")):
        with pytest.raises(ConfigError) as err:
            config.from_mapping({"backend": {key: value}})
        assert err.value.key_path == f"backend.{key}" and err.value.value == value


class _Counting:
    """A backend answering every call, counting them by method; fails while ``down``."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.down = False

    async def unary(self, method: str, payload: bytes, *, timeout: float | None = None,
                    metadata: Any = ()) -> Any:
        self.calls.append(method)
        if self.down:
            raise CallError(Code.UNAVAILABLE, "connection refused")
        return Reply(b"")


@pytest.mark.asyncio
async def test_a_probe_is_skipped_while_the_proxys_own_calls_are_answered() -> None:
    """Issue 29: a probe is one gRPC call (~2.6 ms of CPU); the reconciler's re-syncs
    already asked the same endpoint. A failed call does not count: the probe runs."""
    now = [100.0]
    inner = _Counting()
    seen: list[tuple[str, bool]] = []
    monitor = BackendMonitor(inner, [Probe("runtime", "/run/c.sock", VERSION_METHOD, VERSION_PAYLOAD),
                                     Probe("image", "/run/i.sock", IMAGE_FS_INFO_METHOD)],
                             interval=5.0, unhealthy_after=6.0, set_up=lambda n, u: seen.append((n, u)),
                             clock=lambda: now[0])
    watched = monitor.watching(inner)
    await watched.unary("/runtime.v1.RuntimeService/ListPodSandbox", b"")
    now[0] += 4.9
    await monitor.probe_once()
    assert inner.calls == ["/runtime.v1.RuntimeService/ListPodSandbox", IMAGE_FS_INFO_METHOD]  # runtime: heard
    assert sorted(seen) == [("image", True), ("runtime", True)]
    now[0] += 0.2  # the re-sync's answer is older than an interval now: probe
    await monitor.probe_once()
    assert inner.calls[2:] == [VERSION_METHOD, IMAGE_FS_INFO_METHOD]
    await watched.unary("/runtime.v1.ImageService/ListImages", b"")
    await monitor.probe_once()
    assert inner.calls[5:] == [VERSION_METHOD]  # the image endpoint was heard from instead
    inner.down = True
    with pytest.raises(CallError):
        await watched.unary("/runtime.v1.RuntimeService/ListContainers", b"")
    now[0] += 7.0
    await monitor.probe_once()
    now[0] += 7.0
    await monitor.probe_once()
    assert monitor.problem() is not None and ("runtime", False) in seen  # lost: the failures were not heard
