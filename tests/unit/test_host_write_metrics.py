"""The proxy exports its own count of refused host writes by cause (its ``NodeServices``)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.mark.asyncio
async def test_host_write_failures_are_on_metrics(fake_runtime: Any, start_proxy: Any) -> None:
    proxy = await start_proxy(fake_runtime)
    failures = proxy.app.services.write_failures
    before = failures.counts().get("EXDEV", 0)
    failures.inc("EXDEV")
    assert proxy.sample("koord_runtime_proxy_host_write_failures_total", {"cause": "EXDEV"}) == before + 1
