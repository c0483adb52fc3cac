"""``check-config``'s plan is what ``run`` builds (issue 30 item 4): on the same config
file and host, the collectors the plan says are on are exactly the ones the running
agent ticks (``/debug/explain``), and the strategies it says are on or idle / off in the
list are exactly the ones the QoS manager loaded / released (its ``qos_strategies``
line)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import http_get

pytestmark = pytest.mark.integration


def test_check_config_plan_equals_what_run_built(proxy_factory: Any, tmp_path: Path) -> None:
    db = proxy_factory.mkdtemp() / "m.db"
    extra = {
        "rules": {"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": 60}},
        "tasks": {
            "metrics": {"db": str(db), "schedlat_source": "off", "memlat_source": "off",
                        "collectors": {"psi": {"enabled": False}}},
            "qos-manager": {"strategies": ["cpu-suppress", {"name": "cpu-burst", "enabled": False}, "cpu-evict",
                                           "resctrl", "system-config"]},
        },
    }
    proxy = proxy_factory.start(extra=extra)
    out = subprocess.run([sys.executable, "-m", "runtimeproxy.cli", "check-config", "--config",
                          str(proxy.config_path), "--output", "json"],
                         capture_output=True, text=True, timeout=60, check=True, cwd=tmp_path)
    plan = json.loads(out.stdout)

    collectors = plan["tasks"]["metrics"]["collectors"]
    built = {c["name"] for c in collectors if c["built"]}
    code, body = http_get(proxy.metrics_port, "/debug/explain")
    assert code == 200
    ticking = set(json.loads(body)["tasks"]["metrics"]["ticks"])
    assert built == ticking
    assert {c["name"] for c in collectors if c["state"] == "on"} <= built
    assert {"psi", "schedlat", "memlat"}.isdisjoint(built)

    strategies = plan["tasks"]["qos-manager"]["strategies"]
    loaded = proxy.wait_event("qos_strategies")
    assert [s["name"] for s in strategies if s["state"] in ("on", "idle")] == loaded["enabled"]
    assert [s["name"] for s in strategies if "enabled: false" in s["reason"]] == loaded["disabled"]
