"""The proxy exports its own count of refused host writes by cause (its ``NodeServices``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.mark.asyncio
async def test_host_write_failures_are_on_metrics(fake_runtime: Any, start_proxy: Any) -> None:
    proxy = await start_proxy(fake_runtime)
    failures = proxy.app.services.write_failures
    before = failures.counts().get("EXDEV", 0)
    failures.inc("EXDEV")
    assert proxy.sample("koord_runtime_proxy_host_write_failures_total", {"cause": "EXDEV"}) == before + 1


@pytest.mark.asyncio
async def test_two_apps_in_one_process_count_their_own_failures(fake_runtime: Any, start_proxy: Any,
                                                                 short_dir: Path) -> None:
    """Each app makes its own services: no process-wide counter or back-off between them."""
    one = await start_proxy(fake_runtime)
    other = await start_proxy(fake_runtime, listen=str(short_dir / "other.sock"), state_dir=str(short_dir / "s2"))
    assert one.app.services is not other.app.services
    assert one.app.services.write_backoff is not other.app.services.write_backoff
    one.app.services.write_failures.inc("EBUSY")
    assert one.sample("koord_runtime_proxy_host_write_failures_total", {"cause": "EBUSY"}) == 1
    assert other.sample("koord_runtime_proxy_host_write_failures_total", {"cause": "EBUSY"}) in (None, 0)
