"""The proxy exports the process-wide count of refused host writes by cause."""

from __future__ import annotations

from typing import Any

import pytest

from runtimeproxy.hostwrites import HOST_WRITE_FAILURES


@pytest.mark.asyncio
async def test_host_write_failures_are_on_metrics(fake_runtime: Any, start_proxy: Any) -> None:
    proxy = await start_proxy(fake_runtime)
    before = HOST_WRITE_FAILURES.counts().get("EXDEV", 0)
    HOST_WRITE_FAILURES.inc("EXDEV")
    assert proxy.sample("koord_runtime_proxy_host_write_failures_total", {"cause": "EXDEV"}) == before + 1
