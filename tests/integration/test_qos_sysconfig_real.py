"""system-config on this host's real /proc/sys: watermark_scale_factor set to its
current value +1 through the real manager, then restored when the NodeSLO section
goes away (and by the test in any case)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from hooks.cgroups import CgroupLayout
from hooks.executor import CgroupExecutor
from hooks.rules import Rules, parse_rules
from metrics.qos.evict import CriEvictor
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.qos.strategy import StrategyInit
from metrics.qos.sysconfig import STATE_FILE, system_config
from metrics.store.tsdb import TSDB
from runtimeproxy.hookapi import HostRoots

WSF = Path("/proc/sys/vm/watermark_scale_factor")
MIN_FREE = Path("/proc/sys/vm/min_free_kbytes")


def read(path: Path) -> str:
    return path.read_text().strip()


async def _no_runtime(method: str, payload: bytes, timeout: float) -> bytes:
    return b""


@pytest.fixture
def original() -> Iterator[int]:
    if os.geteuid() != 0:
        pytest.skip("writing /proc/sys needs root")
    before = int(read(WSF))
    try:
        yield before
    finally:
        WSF.write_text(f"{before}\n")


@pytest.mark.asyncio
async def test_watermark_scale_factor_is_set_and_restored(original: int, tmp_path: Path) -> None:
    wanted = original + 1 if original < 400 else original - 1  # koordlet's range [10, 400]
    min_free_before = read(MIN_FREE)
    executor = CgroupExecutor(CgroupLayout(Path("/sys/fs/cgroup")))
    config = ManagerConfig()
    init = StrategyInit(name="system-config", args={}, key_path="strategies", config=config, topology=[],
                        executor=executor, host=HostRoots(), state_dir=tmp_path / "state")
    strategy = system_config(init)
    rules: list[Rules] = [parse_rules({"systemStrategy": {"watermarkScaleFactor": wanted}})]
    store = TSDB(tmp_path / "m.db")
    try:
        manager = QoSManager(reader=store, pods=lambda: [], topology=[], executor=executor,
                             evictor=CriEvictor(_no_runtime), rules=lambda: rules[0], config=config,
                             strategies=[strategy])
        await manager.run_once()
        assert int(read(WSF)) == wanted
        saved = json.loads(read(tmp_path / "state" / STATE_FILE))
        assert saved == {"proc:sys/vm/watermark_scale_factor": str(original)}
        assert read(MIN_FREE) == min_free_before  # unset: untouched
        rules[0] = parse_rules({})
        await manager.run_once()
        assert int(read(WSF)) == original
        assert json.loads(read(tmp_path / "state" / STATE_FILE)) == {}
    finally:
        store.close()
