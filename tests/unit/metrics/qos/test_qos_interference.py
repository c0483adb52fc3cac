"""The interference strategy through the real manager on a fixture cgroup v1 tree, next to
cpu-suppress: the cap wins arbitration while a CPU verdict is confirmed and is given
back when it clears; a memory verdict evicts the top culprit once per cool-down;
dry-run writes nothing but audits."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from hooks.cgroups import CPU_IDLE, CgroupLayout
from hooks.executor import CgroupExecutor
from hooks.qos import QoSClass
from hooks.rules import parse_rules
from metrics import model
from metrics.analysis.interference import Culprit, Evidence, Level, PodRef, Verdict
from metrics.model import Sample, labels
from metrics.qos import builtin
from metrics.qos.evict import CriEvictor
from metrics.qos.interference import Interference, interference
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.qos.strategy import StrategyInit
from metrics.store.tsdb import TSDB
from runtimeproxy.hookapi import HookConfigError
from tests.unit.metrics.qos.test_qos_manager import (
    BE,
    BE_DIR,
    LS,
    NOW,
    TOPOLOGY,
    FakeRuntime,
    add_pause_cgroup,
    build_tree,
)

LS_REF = PodRef(LS.uid, LS.namespace, LS.name, QoSClass.LS)
BE_REF = PodRef(BE.uid, BE.namespace, BE.name, QoSClass.BE)
RULES = {"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressPolicy": "cfsQuota",
                                         "cpuSuppressThresholdPercent": 65}}


def verdicts(cpu: Level = Level.NONE, memory: Level = Level.NONE) -> dict[str, dict[str, Verdict]]:
    def one(resource: str, level: Level, signal: str) -> Verdict:
        if not level:
            return Verdict(LS_REF, resource, Level.NONE, None)
        return Verdict(LS_REF, resource, level, NOW - 5, (Evidence(signal, 0.03, 0.0005, 0.002, 60.0),),
                       (Culprit(BE_REF, 2.0, 2.0, 300.0, 200.0),), "test")
    return {LS.uid: {"cpu": one("cpu", cpu, "sched_latency_p99"), "memory": one("memory", memory, "memory_psi")}}


class Env:
    def __init__(self, tmp: Path, dry_run: bool = False, args: Mapping[str, Any] | None = None) -> None:
        self.root = tmp / "cgroup"
        build_tree(self.root)
        self.store = TSDB(tmp / "m.db", clock=lambda: NOW)
        self.now = NOW
        self.runtime = FakeRuntime()
        self.verdicts: dict[str, dict[str, Verdict]] | None = verdicts()
        env = self
        executor = CgroupExecutor(CgroupLayout(self.root))
        config = ManagerConfig(dry_run=dry_run, reserved_cores=0.5, node_name="n1")
        init = StrategyInit(name="interference", args=args or {}, key_path="strategies[4].args", config=config,
                            topology=TOPOLOGY, executor=executor)
        self.strategy = interference(init)
        self.strategy._verdicts = lambda: env.verdicts  # the task's snapshot, driven by the test
        suppress = builtin.cpu_suppress(init)
        self.manager = QoSManager(reader=self.store, pods=lambda: [LS, BE], topology=TOPOLOGY, executor=executor,
                                  evictor=CriEvictor(self.runtime), rules=lambda: parse_rules(RULES), config=config,
                                  clock=lambda: env.now, strategies=[suppress, self.strategy])

    def usage(self) -> None:
        self.store.write([
            Sample(model.NODE_CPU_USAGE, 3.0, ts=self.now - 0.5), Sample(model.NODE_MEMORY_USED, 100.0,
                                                                         ts=self.now - 0.5),
            Sample(model.NODE_MEMORY_TOTAL, 1000.0, ts=self.now - 0.5),
            Sample(model.POD_CPU_USAGE, 1.0, labels(pod_uid=LS.uid), self.now - 0.5),
            Sample(model.POD_CPU_USAGE, 2.0, labels(pod_uid=BE.uid), self.now - 0.5),
        ])

    def quota(self) -> str:
        return (self.root / "cpu" / BE_DIR / "cpu.cfs_quota_us").read_text().strip()

    async def round(self) -> Any:
        self.usage()
        result = await self.manager.run_once()
        self.now += 1
        return result


@pytest.fixture
def envs(tmp_path: Path, closing: Callable[[Env], Env]) -> Callable[..., Env]:
    made = itertools.count()
    return lambda **kw: closing(Env(tmp_path / str(next(made)), **kw))


@pytest.mark.asyncio
async def test_confirmed_cpu_caps_be_below_suppress_and_clearing_gives_it_back(envs: Any) -> None:
    env = envs(args={"be_cpus": 0})  # quota only
    await env.round()
    suppressed = int(env.quota())
    assert suppressed > 50_000  # usage-based suppression alone: 8 x 65% - 1 - reserved
    env.verdicts = verdicts(cpu=Level.SUSPECTED)
    await env.round()
    assert int(env.quota()) == suppressed  # suspected: no action
    env.verdicts = verdicts(cpu=Level.CONFIRMED)
    with capture_logs() as logs:
        await env.round()
    assert env.quota() == "50000"  # 0.5 core: the cap wins the conflict on the tier quota
    applied = env.manager.explain()["strategies"]["interference"]["applied"]
    assert [(a["value"], a["result"]) for a in applied] == [(50000, "written")]
    audit = [e for e in logs if e["event"] == "interference_action"]
    assert [(a["action"], a["dry_run"], a["victims"], a["culprits"]) for a in audit] == [
        ("cap_be_cpu", False, ["ns/a"], ["ns/c"])]
    env.now += 30  # suppress would now grow BE back (out of its dead band): the cap still wins
    await env.round()
    assert env.quota() == "50000"
    rejected = env.manager.explain()["strategies"]["cpu_suppress"]["rejected"]
    assert rejected and rejected[0]["winner"] == "interference"
    env.verdicts = verdicts()
    await env.round()
    assert env.quota() == "50000"  # held: lifting the cap at once would bring interference back
    env.now += 30
    with capture_logs() as logs:
        await env.round()
    assert int(env.quota()) == suppressed  # the quota found before the cap
    assert [e["action"] for e in logs if e["event"] == "interference_action"] == ["release_be_cpu"]
    await env.round()
    assert int(env.quota()) > 50_000  # suppress alone again


@pytest.mark.asyncio
async def test_memory_verdict_evicts_the_top_culprit_once_per_cool_down(envs: Any) -> None:
    env = envs(args={"memory_cool_down": "30s"})
    env.verdicts = verdicts(memory=Level.CONFIRMED)
    await env.round()
    assert env.runtime.stopped == ["cc"]
    plan = env.manager.explain()["strategies"]["interference"]["plan"]
    assert "evict top culprit ns/c" in plan["reason"]
    await env.round()
    assert env.runtime.stopped == ["cc"]
    assert "cooling down" in env.manager.explain()["strategies"]["interference"]["plan"]["reason"]


@pytest.mark.asyncio
async def test_dry_run_audits_and_writes_nothing(envs: Any) -> None:
    env = envs(dry_run=True)
    env.verdicts = verdicts(cpu=Level.CONFIRMED, memory=Level.CONFIRMED)
    with capture_logs() as logs:
        await env.round()
    assert env.quota() == "-1" and env.runtime.stopped == []
    assert {(e["action"], e["dry_run"]) for e in logs if e["event"] == "interference_action"} == {
        ("cap_be_cpu", True), ("evict_be", True)}


@pytest.mark.asyncio
async def test_without_the_analyser_nothing_is_planned(envs: Any) -> None:
    env = envs()
    env.verdicts = None
    await env.round()
    plan = env.manager.explain()["strategies"]["interference"]["plan"]
    assert plan["actions"] == [] and "list the interference task" in plan["reason"]


@pytest.mark.asyncio
async def test_release_at_stop_lifts_the_cap(envs: Any) -> None:
    env = envs()
    env.verdicts = verdicts(cpu=Level.CONFIRMED)
    await env.round()
    assert env.quota() == "50000"
    env.manager.release()
    assert env.quota() == "-1"


@pytest.mark.parametrize(("args", "key"), [
    ({"be_cpu_cores": 0}, "strategies[4].args.be_cpu_cores"),
    ({"memory_evict": "yes"}, "strategies[4].args.memory_evict"),
    ({"memory_cool_down": "later"}, "strategies[4].args.memory_cool_down"),
    ({"hold": -3}, "strategies[4].args.hold"),
    ({"bogus": 1}, "strategies[4].args.bogus"),
])
def test_bad_args_name_the_key(args: dict[str, Any], key: str) -> None:
    init = StrategyInit(name="interference", args=args, key_path="strategies[4].args", config=ManagerConfig(),
                        topology=[], executor=CgroupExecutor(CgroupLayout(Path("/nonexistent"), version=1)))
    with pytest.raises(HookConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        interference(init)


def test_factory_builds_a_strategy() -> None:
    init = StrategyInit(name="interference", args={}, key_path="s", config=ManagerConfig(), topology=[],
                        executor=CgroupExecutor(CgroupLayout(Path("/nonexistent"), version=1)))
    built = interference(init)
    assert isinstance(built, Interference) and built.be_cpu_cores == 0.5


@pytest.mark.asyncio
async def test_be_cpus_also_confines_be_and_gives_the_cpus_back(envs: Any) -> None:
    env = envs(args={"be_cpus": 2, "hold": "5s"})
    cpus = env.root / "cpuset" / BE_DIR / "cpuset.cpus"
    pod_cpus = env.root / "cpuset" / BE.cgroup_dir / "cpuset.cpus"
    env.verdicts = verdicts(cpu=Level.CONFIRMED)
    await env.round()
    assert cpus.read_text().strip() == "6-7" and pod_cpus.read_text().strip() == "6-7"
    assert env.quota() == "50000"
    env.verdicts = verdicts()
    env.now += 5
    await env.round()
    assert cpus.read_text().strip() == "0-7" and pod_cpus.read_text().strip() == "0-7"


@pytest.mark.asyncio
@pytest.mark.parametrize(("cap", "confined"), [(0.5, "7"), (1.5, "6-7")])
async def test_by_default_be_is_confined_to_the_cap_rounded_up(envs: Any, cap: float, confined: str) -> None:
    """``be_cpus`` unset (auto): BE on ceil(be_cpu_cores) CPUs while capped, explained;
    in dry-run the same plan is audited and nothing is written."""
    for dry in (True, False):
        env = envs(dry_run=dry, args={"be_cpu_cores": cap})
        cpus = env.root / "cpuset" / BE_DIR / "cpuset.cpus"
        env.verdicts = verdicts(cpu=Level.CONFIRMED)
        with capture_logs() as logs:
            await env.round()
        plan = env.manager.explain()["strategies"]["interference"]["plan"]
        assert plan["inputs"]["be_cpus"] == f"{confined.count('-') + 1} (auto: be_cpu_cores {cap:g} rounded up)"
        assert plan["inputs"]["cpuset"] == [int(c) for c in confined.split("-")]
        assert [(a["action"], a["dry_run"]) for a in logs if a["event"] == "interference_action"] == [
            ("cap_be_cpu", dry)]
        assert cpus.read_text().strip() == ("0-7" if dry else confined)
        assert env.quota() == ("-1" if dry else str(int(cap * 100_000)))


@pytest.mark.asyncio
async def test_confinement_narrows_every_cgroup_under_the_tier_first(envs: Any) -> None:
    """v1: a cpuset may not drop CPUs a child still has (EBUSY), so the sandbox's pause
    cgroup, in no pod view, is narrowed too, bottom-up, and widened back after."""
    env = envs(args={"hold": "5s"})
    pause = add_pause_cgroup(env.root)
    env.verdicts = verdicts(cpu=Level.CONFIRMED)
    await env.round()
    assert (env.root / "cpuset" / pause / "cpuset.cpus").read_text().strip() == "7"
    assert (env.root / "cpuset" / BE_DIR / "cpuset.cpus").read_text().strip() == "7"
    env.verdicts = verdicts()
    env.now += 5
    await env.round()
    assert (env.root / "cpuset" / pause / "cpuset.cpus").read_text().strip() == "0-7"


def test_be_cpus_must_be_a_count() -> None:
    init = StrategyInit(name="interference", args={"be_cpus": -1}, key_path="s.args", config=ManagerConfig(),
                        topology=[], executor=CgroupExecutor(CgroupLayout(Path("/nonexistent"), version=1)))
    with pytest.raises(HookConfigError, match=r"s\.args\.be_cpus"):
        interference(init)


@pytest.mark.asyncio
@pytest.mark.parametrize(("dry_run", "be_idle", "expected"),
                         [(False, True, "1"), (True, True, "0"), (False, False, "0")])
async def test_a_confirmed_cpu_verdict_makes_the_be_tier_sched_idle_until_released(
    envs: Any, dry_run: bool, be_idle: bool, expected: str
) -> None:
    """The kernel then preempts BE at once when a victim wakes and places the victim on a
    CPU running only BE (measured: LS probe p99 1.8x alone under 6 BE hogs, 12x without)."""
    env = envs(dry_run=dry_run, args={"be_cpus": 0, "be_idle": be_idle})
    idle = env.root / "cpu" / BE_DIR / "cpu.idle"
    idle.write_text("0\n")
    env.verdicts = verdicts(cpu=Level.CONFIRMED)
    await env.round()
    assert idle.read_text().strip() == expected
    inputs = env.manager.explain()["strategies"]["interference"]["plan"]["inputs"]
    assert inputs.get("be_idle") == (1 if be_idle else None)
    env.verdicts = verdicts()
    env.now += 31  # past the hold
    await env.round()
    assert idle.read_text().strip() == "0"  # given back with the quota
    assert env.strategy.original_idle is None


@pytest.mark.asyncio
async def test_clearing_the_tiers_cpu_idle_gives_back_kubelets_besteffort_weight(envs: Any) -> None:
    """cpu.idle 1 -> 0 resets the kernel's weight to cpu.shares 1024 (issue 28 item 5): the
    release writes kubelet's BestEffort tier weight (2) after cpu.idle, in the same step."""
    env = envs(args={"be_cpus": 0, "be_idle": True})
    tier = env.root / "cpu" / BE_DIR
    (tier / "cpu.idle").write_text("0\n")
    (tier / "cpu.shares").write_text("2\n")
    env.verdicts = verdicts(cpu=Level.CONFIRMED)
    await env.round()
    assert (tier / "cpu.idle").read_text().strip() == "1"
    (tier / "cpu.shares").write_text("1024\n")  # what the kernel leaves once cpu.idle goes back to 0
    env.verdicts = verdicts()
    env.now += 31  # past the hold
    await env.round()
    assert (tier / "cpu.idle").read_text().strip() == "0"
    assert (tier / "cpu.shares").read_text().strip() == "2"


@pytest.mark.asyncio
async def test_without_cpu_idle_the_tier_is_left_alone_and_explain_says_so(envs: Any) -> None:
    env = envs(args={"be_cpus": 0})
    env.verdicts = verdicts(cpu=Level.CONFIRMED)
    await env.round()
    assert env.quota() == "50000"
    assert not (env.root / "cpu" / BE_DIR / "cpu.idle").exists()
    assert "no cpu.idle" in env.manager.explain()["strategies"]["interference"]["plan"]["inputs"]["be_idle"]


def test_be_idle_must_be_a_bool() -> None:
    init = StrategyInit(name="interference", args={"be_idle": "yes"}, key_path="strategies[4].args",
                        config=ManagerConfig(), topology=[],
                        executor=CgroupExecutor(CgroupLayout(Path("/nonexistent"), version=1)))
    with pytest.raises(HookConfigError, match=r"strategies\[4\]\.args\.be_idle"):
        interference(init)


@pytest.mark.asyncio
async def test_the_quotas_under_the_tier_are_read_only_in_rounds_that_cap_or_release(
        envs: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: hundreds of files at 110 pods; most rounds have no verdict and write nothing."""
    from metrics.qos import suppress

    reads: list[int] = []
    inner = suppress.read_children
    monkeypatch.setattr(suppress, "read_children", lambda *a: reads.append(1) or inner(*a))
    env = envs(args={"be_cpus": 0})
    await env.round()  # suppress moves the tier from unlimited (it reads the children for that)
    suppressed, reads[:] = env.quota(), []
    await env.round()
    assert env.quota() == suppressed and reads == []  # no verdict, the tier kept: its knobs only
    env.verdicts = verdicts(cpu=Level.CONFIRMED)
    await env.round()
    assert env.quota() == "50000" and reads  # the cap clamps the children above it first (v1)


@pytest.mark.asyncio
async def test_the_tiers_cpu_idle_is_read_only_in_rounds_that_cap(envs: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: a read a round for nothing (and a failed one where the kernel has no cpu.idle)."""
    env = envs(args={"be_cpus": 0, "be_idle": True})
    (env.root / "cpu" / BE_DIR / "cpu.idle").write_text("0\n")
    reads: list[int] = []
    inner = CgroupExecutor.read

    def counted(self: CgroupExecutor, cgroup: Any, resource: Any, source: str = "") -> str:
        reads.extend([1] if resource is CPU_IDLE else [])
        return inner(self, cgroup, resource, source)

    monkeypatch.setattr(CgroupExecutor, "read", counted)
    await env.round()
    await env.round()
    assert reads == []  # no verdict, no cap: the tier's cpu.idle is not looked at
    env.verdicts = verdicts(cpu=Level.CONFIRMED)
    await env.round()
    assert reads == [1] and (env.root / "cpu" / BE_DIR / "cpu.idle").read_text().strip() == "1"


@pytest.mark.asyncio
async def test_releasing_the_cap_to_a_positive_quota_gives_a_clamped_child_its_own_quota_back_at_once(
        envs: Any) -> None:
    """The BE container's own quota (1.5 cores) is clamped under the cap (0.5 core); when
    the cap is released to the suppress quota found before it (above 1.5 cores), the
    child gets 150000 back in the same round: it used to stay at the cap's value until
    cpu-suppress next moved the tier."""
    env = envs(args={"be_cpus": 0})
    child = env.root / "cpu" / BE.containers[0].cgroup_dir / "cpu.cfs_quota_us"
    child.write_text("150000\n")
    await env.round()
    suppressed = int(env.quota())
    assert suppressed > 150_000
    env.verdicts = verdicts(cpu=Level.CONFIRMED)
    await env.round()
    assert (env.quota(), child.read_text().strip()) == ("50000", "50000")  # clamped under the cap
    env.verdicts = verdicts()
    env.now += 60  # past the hold
    await env.round()
    assert int(env.quota()) == suppressed
    assert child.read_text().strip() == "150000"
