"""system-config on a fake /proc and /sys tree through the real manager: koordlet's
formula, ranges, originals saved in state_dir and restored, dry-run, explain, and the
memcg reaper detected once."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from hooks.cgroups import CgroupLayout
from hooks.executor import CgroupExecutor
from hooks.rules import Rules, parse_rules
from metrics.qos.evict import CriEvictor
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.qos.strategy import StrategyInit
from metrics.qos.sysconfig import MEM_TOTAL_TTL, STATE_FILE, SystemConfig, min_free_kbytes, system_config
from metrics.store.tsdb import TSDB
from runtimeproxy.hookapi import HostRoots

NOW = 5_000.0
MEM_KB = 16_384_000  # 16 GB node
MIN_FREE = "sys/vm/min_free_kbytes"
WSF = "sys/vm/watermark_scale_factor"
REAP = "kernel/mm/memcg_reaper/reap_background"


async def _no_runtime(method: str, payload: bytes, timeout: float) -> bytes:
    return b""


class Env:
    def __init__(self, tmp: Path, *, reaper: bool = False, dry_run: bool = False) -> None:
        self.proc, self.sys, self.state = tmp / "proc", tmp / "sys", tmp / "state"
        self.now = NOW
        (self.proc / "sys" / "vm").mkdir(parents=True, exist_ok=True)
        if not (self.proc / "meminfo").exists():
            (self.proc / "meminfo").write_text(f"MemTotal:       {MEM_KB} kB\nMemFree:         1000 kB\n")
            (self.proc / MIN_FREE).write_text("67584\n")
            (self.proc / WSF).write_text("10\n")
        if reaper:
            (self.sys / REAP).parent.mkdir(parents=True, exist_ok=True)
            (self.sys / REAP).write_text("0\n")
        (tmp / "cgroup" / "cpu").mkdir(parents=True, exist_ok=True)
        self.rules: Rules = parse_rules({})
        self.store = TSDB(tmp / "m.db", clock=lambda: NOW)
        executor = CgroupExecutor(CgroupLayout(tmp / "cgroup", version=1))
        config = ManagerConfig(dry_run=dry_run)
        init = StrategyInit(name="system-config", args={}, key_path="strategies", config=config, topology=[],
                            executor=executor, host=HostRoots(cgroup=tmp / "cgroup", proc=self.proc, sys=self.sys),
                            state_dir=self.state)
        self.strategy = system_config(init)
        self.manager = QoSManager(reader=self.store, pods=lambda: [], topology=[], executor=executor,
                                  evictor=CriEvictor(_no_runtime), rules=lambda: self.rules, config=config,
                                  clock=lambda: self.now, strategies=[self.strategy])

    def read(self, root: Path, path: str) -> str:
        return (root / path).read_text().strip()

    def saved(self) -> Any:
        path = self.state / STATE_FILE
        return json.loads(path.read_text()) if path.exists() else None


@pytest.fixture
def envs(tmp_path: Path, closing: Callable[[Env], Env]) -> Callable[..., Env]:
    return lambda **kw: closing(Env(tmp_path, **kw))


ON = {"systemStrategy": {"minFreeKbytesFactor": 100, "watermarkScaleFactor": 150}}


def test_koordlets_formula() -> None:
    # 16 384 000 kB x 100 / 10000 = 163 840 kB (1 % of memory)
    assert min_free_kbytes(MEM_KB, 100) == 163_840
    assert min_free_kbytes(1_000_003, 7) == 700  # integer division, as koordlet's int64 arithmetic


@pytest.mark.asyncio
async def test_tuned_then_restored_when_the_section_goes_away(envs: Any) -> None:
    env = envs()
    env.rules = parse_rules(ON)
    await env.manager.run_once()
    assert env.read(env.proc, MIN_FREE) == "163840" and env.read(env.proc, WSF) == "150"
    assert env.saved() == {f"proc:{MIN_FREE}": "67584", f"proc:{WSF}": "10"}
    entry = env.manager.explain()["strategies"]["system_config"]
    assert {a["result"] for a in entry["applied"]} == {"written"}
    assert entry["plan"]["inputs"]["mem_total_kb"] == MEM_KB and entry["plan"]["priority"] == "system"
    assert env.manager.explain()["inputs"]["system_files"][f"proc:{WSF}"] == "10"  # as read before the round
    assert set(env.manager.explain()["inputs"]) == {"system_files"}  # the store is not queried for it
    await env.manager.run_once()  # in place: nothing changes, originals kept
    assert {a["result"] for a in env.manager.explain()["strategies"]["system_config"]["applied"]} == {"unchanged"}
    assert env.saved() == {f"proc:{MIN_FREE}": "67584", f"proc:{WSF}": "10"}
    env.rules = parse_rules({"systemStrategy": {"watermarkScaleFactor": 150}})  # one field unset
    await env.manager.run_once()
    assert env.read(env.proc, MIN_FREE) == "67584" and env.read(env.proc, WSF) == "150"
    assert env.saved() == {f"proc:{WSF}": "10"}
    env.rules = parse_rules({})  # the section is gone
    await env.manager.run_once()
    assert env.read(env.proc, WSF) == "10" and env.saved() == {}
    await env.manager.run_once()
    assert env.manager.explain()["strategies"]["system_config"]["applied"] == []


@pytest.mark.asyncio
async def test_a_restart_after_a_crash_restores_the_true_original(envs: Any) -> None:
    first = envs()
    first.rules = parse_rules(ON)
    await first.manager.run_once()
    assert first.read(first.proc, WSF) == "150"
    second = envs()  # a new process, same state_dir; the files still hold the tuned values
    second.rules = parse_rules(ON)
    await second.manager.run_once()
    assert second.saved() == {f"proc:{MIN_FREE}": "67584", f"proc:{WSF}": "10"}  # not 163840 / 150
    second.rules = parse_rules({})
    await second.manager.run_once()
    assert second.read(second.proc, MIN_FREE) == "67584" and second.read(second.proc, WSF) == "10"


@pytest.mark.asyncio
async def test_release_restores_on_stop_and_for_a_disabled_listing(envs: Any) -> None:
    env = envs()
    env.rules = parse_rules(ON)
    await env.manager.run_once()
    outcomes = env.manager.release()
    assert [o.result for o in outcomes] == ["written", "written"]
    assert env.read(env.proc, MIN_FREE) == "67584" and env.read(env.proc, WSF) == "10" and env.saved() == {}
    # a process that left tuned values behind, then a start with the strategy listed disabled
    await env.manager.run_once()
    later = envs()
    assert [o.result for o in later.manager.release([later.strategy])] == ["written", "written"]
    assert later.read(later.proc, WSF) == "10"


@pytest.mark.asyncio
async def test_a_computed_value_out_of_range_writes_nothing_and_says_why(envs: Any) -> None:
    env = envs()
    # 16 384 000 x 10000 / 10000 = 16 384 000 kB > 10 485 760: that knob is left alone
    env.rules = parse_rules({"systemStrategy": {"minFreeKbytesFactor": 10000, "watermarkScaleFactor": 150}})
    await env.manager.run_once()
    assert env.read(env.proc, MIN_FREE) == "67584" and env.read(env.proc, WSF) == "150"
    reason = env.manager.explain()["strategies"]["system_config"]["plan"]["reason"]
    assert "systemStrategy.minFreeKbytesFactor=10000" in reason and "16384000 outside [10240, 10485760]" in reason
    assert env.saved() == {f"proc:{WSF}": "10"}


@pytest.mark.asyncio
async def test_dry_run_plans_and_explains_but_writes_and_saves_nothing(envs: Any) -> None:
    env = envs(dry_run=True)
    env.rules = parse_rules(ON)
    await env.manager.run_once()
    assert env.read(env.proc, MIN_FREE) == "67584" and env.read(env.proc, WSF) == "10" and env.saved() is None
    applied = env.manager.explain()["strategies"]["system_config"]["applied"]
    assert [(a["value"], a["result"]) for a in applied] == [("163840", "dry-run"), ("150", "dry-run")]
    assert env.manager.release() == []


@pytest.mark.asyncio
async def test_the_memcg_reaper_is_detected_once(envs: Any) -> None:
    with capture_logs() as logs:
        env = envs()
    assert [e["event"] for e in logs if e["event"] == "memcg_reaper_unsupported"] == ["memcg_reaper_unsupported"]
    env.rules = parse_rules({"systemStrategy": {"memcgReapBackGround": 1}})
    await env.manager.run_once()
    assert not (env.sys / REAP).exists()
    assert "not on this kernel" in env.manager.explain()["strategies"]["system_config"]["plan"]["reason"]


@pytest.mark.asyncio
async def test_the_memcg_reaper_is_written_where_the_kernel_has_it(envs: Any) -> None:
    env = envs(reaper=True)
    assert isinstance(env.strategy, SystemConfig) and env.strategy.reap_supported
    env.rules = parse_rules({"systemStrategy": {"memcgReapBackGround": 1}})
    await env.manager.run_once()
    assert env.read(env.sys, REAP) == "1" and env.saved() == {f"sys:{REAP}": "0"}


@pytest.mark.asyncio
async def test_a_symlinked_knob_is_refused_not_followed(envs: Any, tmp_path: Path) -> None:
    env = envs()
    outside = tmp_path / "outside"
    outside.write_text("10\n")
    (env.proc / WSF).unlink()
    (env.proc / WSF).symlink_to(outside)
    env.rules = parse_rules({"systemStrategy": {"watermarkScaleFactor": 150}})
    await env.manager.run_once()
    assert outside.read_text() == "10\n"
    assert "not readable" in env.manager.explain()["strategies"]["system_config"]["plan"]["reason"]


@pytest.mark.asyncio
async def test_no_write_without_the_original_saved(envs: Any) -> None:
    env = envs()
    env.state.write_text("not a directory")  # state_dir unusable: the original cannot be kept
    env.rules = parse_rules({"systemStrategy": {"watermarkScaleFactor": 150}})
    for _ in range(2):  # and not on the next round either
        await env.manager.run_once()
        assert env.read(env.proc, WSF) == "10"
        applied = env.manager.explain()["strategies"]["system_config"]["applied"]
        assert applied[0]["result"].startswith("failed") and "cannot save the original" in applied[0]["result"]


@pytest.mark.asyncio
async def test_memtotal_is_read_once_a_minute_not_every_round(envs: Any) -> None:
    """Issue 29: /proc/meminfo every round for a figure only memory hot-plug changes."""
    env = envs()
    env.rules = parse_rules(ON)
    await env.manager.run_once()
    assert env.read(env.proc, MIN_FREE) == "163840"
    (env.proc / "meminfo").write_text(f"MemTotal:       {2 * MEM_KB} kB\n")  # hot-plugged
    env.now += MEM_TOTAL_TTL - 1
    await env.manager.run_once()
    assert env.read(env.proc, MIN_FREE) == "163840"  # the figure read a round ago still holds
    env.now += 1
    await env.manager.run_once()
    assert env.read(env.proc, MIN_FREE) == "327680"  # a minute on: read again
    assert env.manager.explain()["strategies"]["system_config"]["plan"]["inputs"]["mem_total_kb"] == 2 * MEM_KB
