"""The suppress fast path on fixture /proc/stat and cpuacct counters, through the real manager."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

import pytest

from hooks.cgroups import CPU_CFS_QUOTA, CgroupError, CgroupLayout
from hooks.executor import CgroupExecutor, Update, Write
from hooks.qos import QoSClass
from hooks.rules import Rules, parse_rules
from metrics import model
from metrics.collect.cgroupfs import CgroupReader
from metrics.collect.topology import CPUInfo
from metrics.model import ContainerView, PodView, Sample, labels
from metrics.qos.evict import CriEvictor
from metrics.qos.fastpath import FastPath, FastPathConfig
from metrics.qos.inputs import NodeInputs, TierUsage
from metrics.qos.manager import ManagerConfig, QoSManager
from metrics.qos.suppress import MIN_QUOTA, BEState, suppress_cores
from metrics.store.tsdb import TSDB

NOW = 5_000.0
TOPOLOGY = [CPUInfo(cpu=i, core=i % 4, socket=0, numa=0 if i % 4 < 2 else 1) for i in range(8)]
BE_DIR = "kubepods/besteffort"
RULES = parse_rules({"resourceUsedThresholdWithBE": {"enable": True}})


def make_pod(uid: str, qos: QoSClass, kube: str) -> PodView:
    d = f"kubepods/{kube}/pod{uid}"
    return PodView(uid=uid, namespace="ns", name=uid, sandbox_id=uid, qos=qos, priority=0, priority_class="",
                   cgroup_dir=d, kube_qos=kube, containers=(ContainerView(f"c{uid}", "main", f"{d}/c{uid}"),))


LS, BE = make_pod("a", QoSClass.LS, "burstable"), make_pod("c", QoSClass.BE, "besteffort")


async def _no_runtime(method: str, payload: bytes, timeout: float) -> bytes:
    raise AssertionError("the fast path never evicts")


class Host:
    """Fixture /proc and cgroup v1 roots whose counters the test advances."""

    def __init__(self, tmp_path: Path) -> None:
        self.proc, self.cgroup = tmp_path / "proc", tmp_path / "cgroup"
        self.proc.mkdir()
        for d in ["", "kubepods", BE_DIR, "kubepods/burstable", LS.cgroup_dir, BE.cgroup_dir,
                  LS.containers[0].cgroup_dir, BE.containers[0].cgroup_dir]:
            (self.cgroup / "cpu" / d).mkdir(parents=True, exist_ok=True)
            (self.cgroup / "cpu" / d / "cpu.cfs_quota_us").write_text("-1\n")
            (self.cgroup / "cpuset" / d).mkdir(parents=True, exist_ok=True)
            (self.cgroup / "cpuset" / d / "cpuset.cpus").write_text("0-7\n")
            (self.cgroup / "cpuacct" / d).mkdir(parents=True, exist_ok=True)
        self.node_ns, self.ns = 0, {"a": 0, "c": 0}
        self.tier_extra = 0
        #: The besteffort tier's CFS periods in which its quota held it back.
        self.be_throttled = 0
        self.write()

    def advance(self, seconds: float, node: float, ls: float, be: float) -> None:
        """Move the counters as if the node used ``node`` cores for ``seconds``."""
        self.node_ns += round(node * seconds * 1e9)
        self.ns["a"] += round(ls * seconds * 1e9)
        self.ns["c"] += round(be * seconds * 1e9)
        self.write()

    def write(self) -> None:
        (self.cgroup / "cpuacct" / "cpuacct.usage").write_text(f"{self.node_ns}\n")
        for pod in (LS, BE):
            (self.cgroup / "cpuacct" / pod.cgroup_dir / "cpuacct.usage").write_text(f"{self.ns[pod.uid]}\n")
        # As the kernel does: a tier's counter includes every descendant (plus a
        # little of its own, which the fast path must count as pods, not system).
        tiers = {"kubepods": self.ns["a"] + self.ns["c"] + self.tier_extra, BE_DIR: self.ns["c"]}
        for d, ns in tiers.items():
            (self.cgroup / "cpuacct" / d / "cpuacct.usage").write_text(f"{ns}\n")
        (self.cgroup / "cpu" / BE_DIR / "cpu.stat").write_text(
            f"nr_periods {self.be_throttled + 100}\nnr_throttled {self.be_throttled}\nthrottled_time 0\n")


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TSDB]:
    db = TSDB(tmp_path / "m.db", clock=lambda: NOW)
    db.write([Sample(model.NODE_CPU_USAGE, 4.0, ts=NOW - 0.5),
              Sample(model.POD_CPU_USAGE, 2.0, labels(pod_uid="a"), NOW - 0.5),
              Sample(model.POD_CPU_USAGE, 1.0, labels(pod_uid="c"), NOW - 0.5)])
    yield db
    db.close()


async def setup(host: Host, store: TSDB, pods: tuple[PodView, ...] = (LS, BE), rules: Rules = RULES
                ) -> tuple[QoSManager, FastPath, list[float]]:
    manager = QoSManager(reader=store, pods=lambda: list(pods), topology=TOPOLOGY,
                         executor=CgroupExecutor(CgroupLayout(host.cgroup)), evictor=CriEvictor(_no_runtime),
                         rules=lambda: rules, config=ManagerConfig(reserved_cores=0.5), clock=lambda: NOW)
    await manager.run_once()  # the regular round: BE gets 3 CPUs, or 2.2 cores of quota
    if rules is RULES:
        assert (host.cgroup / "cpuset" / BE_DIR / "cpuset.cpus").read_text().strip() == "0,2,4"
    clock = [0.0]
    fast = FastPath(manager, cgroups=CgroupReader(host.cgroup), rules=lambda: rules,
                    config=FastPathConfig(interval=0.2), clock=lambda: clock[0], wall=lambda: NOW)
    return manager, fast, clock


@pytest.mark.asyncio
async def test_an_ls_burst_shrinks_be_within_a_tick(host: Host, store: TSDB) -> None:
    manager, fast, clock = await setup(host, store)
    assert not await fast.tick()  # first tick: baseline only
    host.advance(0.2, node=7.0, ls=6.0, be=0.5)
    clock[0] = 0.2
    inputs = fast.sample()
    assert inputs is not None
    assert fast.mode == "tier" and inputs.tiers is not None
    assert inputs.node_cpu_used == pytest.approx(7.0)
    assert (inputs.tiers.pods, inputs.tiers.be) == (pytest.approx(6.5), pytest.approx(0.5))
    # 5.2 - 6.0 - max(7.0 - 6.5, 0.5) = -1.3 -> 2 CPUs < 3 in force: re-plan now
    assert "headroom dropped" in (fast.decide(inputs) or "")
    host.advance(0.2, node=7.0, ls=6.0, be=0.5)
    clock[0] = 0.4
    assert await fast.tick()
    assert (host.cgroup / "cpuset" / BE_DIR / "cpuset.cpus").read_text().strip() == "0,4"
    assert manager.explain()["strategies"]["cpu_suppress"]["plan"]["inputs"]["source"] == "fastpath"


@pytest.mark.asyncio
async def test_no_trigger_inside_the_dead_band(host: Host, store: TSDB) -> None:
    _, fast, clock = await setup(host, store)
    await fast.tick()
    host.advance(0.2, node=4.0, ls=2.0, be=1.0)  # 2.2 cores -> 3 CPUs, as in force
    clock[0] = 0.2
    assert not await fast.tick() and fast.triggers == 0


@pytest.mark.asyncio
async def test_stall_and_counter_reset_make_no_decision(host: Host, store: TSDB) -> None:
    _, fast, clock = await setup(host, store)
    await fast.tick()
    host.advance(1.0, node=7.0, ls=6.0, be=0.5)
    clock[0] = 1.0  # 5 intervals later: the sampler stalled
    assert fast.sample() is None
    host.advance(0.2, node=7.0, ls=6.0, be=0.5)
    host.ns["a"] = 0  # the kubepods counter goes back (tier recreated)
    host.write()
    clock[0] = 1.2
    assert fast.sample() is None
    host.advance(0.2, node=7.0, ls=6.0, be=0.5)
    clock[0] = 1.4
    assert fast.sample() is not None  # the next tick has a baseline again


@pytest.mark.asyncio
async def test_tier_mode_counts_the_tier_s_own_time_as_pods(host: Host, store: TSDB) -> None:
    _, fast, clock = await setup(host, store)
    await fast.tick()
    host.tier_extra += round(0.5 * 0.2 * 1e9)  # 0.5 cores charged to kubepods itself
    host.advance(0.2, node=4.0, ls=2.0, be=1.0)
    clock[0] = 0.2
    inputs = fast.sample()
    assert inputs is not None and inputs.tiers is not None
    assert inputs.tiers.pods == pytest.approx(3.5) and inputs.tiers.be == pytest.approx(1.0)
    formula = suppress_cores(inputs, RULES.resource_used_threshold_with_be)
    # non-BE = 3.5 - 1.0; system = max(4.0 - 3.5, reserved 0.5)
    assert (formula.non_be_used, formula.system_used) == (pytest.approx(2.5), pytest.approx(0.5))


MISPLACED_BE = make_pod("d", QoSClass.BE, "burstable")  # koord BE label, burstable tier


@pytest.mark.asyncio
async def test_pod_mode_when_a_tier_mixes_be_and_ls(host: Host, store: TSDB,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    for d in (MISPLACED_BE.cgroup_dir, MISPLACED_BE.containers[0].cgroup_dir):
        for ctl in ("cpu", "cpuset", "cpuacct"):
            (host.cgroup / ctl / d).mkdir(parents=True, exist_ok=True)
        (host.cgroup / "cpuset" / d / "cpuset.cpus").write_text("0-7\n")
    (host.cgroup / "cpuacct" / MISPLACED_BE.cgroup_dir / "cpuacct.usage").write_text("0\n")
    _, fast, clock = await setup(host, store, pods=(LS, BE, MISPLACED_BE))
    await fast.tick()
    out = capsys.readouterr().out
    assert fast.mode == "pods" and "fastpath_mode" in out and "ns/d" in out
    host.advance(0.2, node=7.0, ls=6.0, be=0.5)
    (host.cgroup / "cpuacct" / MISPLACED_BE.cgroup_dir / "cpuacct.usage").write_text(f"{round(0.3 * 0.2e9)}\n")
    clock[0] = 0.2
    inputs = fast.sample()
    assert inputs is not None and inputs.tiers is None
    assert inputs.pod_cpu_used == {"a": pytest.approx(6.0), "c": pytest.approx(0.5), "d": pytest.approx(0.3)}
    # the misplaced BE pod's 0.3 cores count as BE, not as LS usage
    assert suppress_cores(inputs, RULES.resource_used_threshold_with_be).non_be_used == pytest.approx(6.0)
    host.advance(0.2, node=7.0, ls=6.0, be=0.5)
    host.ns["a"] = 0  # the LS pod's counter went back (cgroup recreated)
    host.write()
    clock[0] = 0.4
    inputs = fast.sample()
    assert inputs is not None and inputs.missing == ("pod_cpu{ns/a}",)
    assert fast.decide(inputs) is None


@pytest.mark.asyncio
async def test_missing_tier_counter_is_no_decision(host: Host, store: TSDB,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The fast path keeps its counters open; a removed cgroup's descriptor then reads
    ENODEV (``test_openfiles``), the same "gone" as a file that is not there, which a
    plain directory can only show by the file missing before the first read."""
    _, fast, clock = await setup(host, store)
    (host.cgroup / "cpuacct" / BE_DIR / "cpuacct.usage").unlink()
    for i in range(4):
        host.advance(0.2, node=7.0, ls=6.0, be=0.5)
        (host.cgroup / "cpuacct" / BE_DIR / "cpuacct.usage").unlink()
        clock[0] = 0.2 * i
        assert fast.sample() is None
    assert capsys.readouterr().out.count("fastpath_sample_failed") == 1


@pytest.mark.asyncio
async def test_garbled_root_counter_is_skipped_with_one_warning(host: Host, store: TSDB,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    _, fast, clock = await setup(host, store)
    (host.cgroup / "cpuacct" / "cpuacct.usage").write_text("garbage\n")
    for i in range(3):
        clock[0] = 0.2 * i
        assert fast.sample() is None
    assert capsys.readouterr().out.count("fastpath_sample_failed") == 1


QUOTA_RULES = parse_rules({"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressPolicy": "cfsQuota"}})


@pytest.mark.asyncio
async def test_a_drop_within_the_sampling_noise_waits_for_the_regular_round(host: Host, store: TSDB) -> None:
    _, fast, clock = await setup(host, store, rules=QUOTA_RULES)
    assert (host.cgroup / "cpu" / BE_DIR / "cpu.cfs_quota_us").read_text().strip() == "220000"  # 2.2 cores
    await fast.tick()
    # 5.2 - 2.09 - 1.0 = 2.11 cores: 0.09 below the limit, past the 1 % dead band (0.08)
    # but within the 0.1-core noise of a 100 ms sample: no re-plan.
    host.advance(0.2, node=4.09, ls=2.09, be=1.0)
    clock[0] = 0.2
    assert not await fast.tick()
    host.advance(0.2, node=4.3, ls=2.3, be=1.0)  # 1.9 cores: a real drop
    clock[0] = 0.4
    assert await fast.tick()
    assert (host.cgroup / "cpu" / BE_DIR / "cpu.cfs_quota_us").read_text().strip() == "190000"




@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("policy", "be_state", "ls_cores", "replan"),
    [
        # cpuset: 4 CPUs in force, margin 1.0: a target of 3 CPUs is exactly at the edge (kept), 2 is below
        # (4.0 - 1.0 - 0.5 = 2.5 -> 3 CPUs; 4.0 - 2.0 - 0.5 = 1.5 -> 2 CPUs)
        ("cpuset", BEState(frozenset(range(4)), None), 1.0, False),
        ("cpuset", BEState(frozenset(range(4)), None), 2.0, True),
        # cfsQuota: 2.5 cores in force (250000 / 100000), target 4.0 - 2.0 - 0.5 = 1.5 = 2.5 - 1.0: kept
        ("cfsQuota", BEState(None, 250_000), 2.0, False),
        ("cfsQuota", BEState(None, 250_000), 2.25, True),
    ],
)
async def test_a_drop_of_exactly_the_dead_band_does_not_replan(host: Host, store: TSDB, policy: str,
                                                                be_state: BEState, ls_cores: float,
                                                                replan: bool) -> None:
    """The band's edge belongs to the band (``<``, not ``<=``): binary-exact numbers, so
    the comparison is decided by the operator alone."""
    rules = parse_rules({"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": 50,
                                                         "cpuSuppressPolicy": policy}})
    manager, _, _ = await setup(host, store, rules=rules)
    fast = FastPath(manager, cgroups=CgroupReader(host.cgroup), rules=lambda: rules,
                    config=FastPathConfig(interval=0.2, dead_band=0.125, noise_cores=0.5), clock=lambda: 10.0)
    manager.be_state = be_state
    # capacity 8 x 50% = 4.0; non-BE = ls_cores; system = max(node - pods, reserved 0.5) = 0.5
    inputs = NodeInputs(now=NOW, capacity_cores=8.0, reserved_cores=0.5, pods=(LS, BE),
                        node_cpu_used=ls_cores + 0.5, tiers=TierUsage(pods=ls_cores + 0.5, be=0.5), source="fastpath")
    why = fast.decide(inputs)
    assert (why is not None) == replan, why


@pytest.mark.asyncio
@pytest.mark.parametrize(("quota", "replan"), [(12_000, True), (MIN_QUOTA, False)])
async def test_a_small_limit_goes_to_the_floor_at_once_when_ls_takes_everything(host: Host, store: TSDB,
                                                                                quota: int, replan: bool) -> None:
    """A busy node had left BE 0.12 cores; an LS burst then wants 2.5 cores less than there
    is. The target, floored at the minimum quota (0.02), is within the noise of 0.12, and
    the fast path left it to the regular round (a miss of the reaction bench when that
    round had no fresh samples). The headroom itself dropped far beyond the band: re-plan.
    At the floor already: nothing to do, no re-plan every tick."""
    rules = parse_rules({"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": 50,
                                                         "cpuSuppressPolicy": "cfsQuota"}})
    manager, _, _ = await setup(host, store, rules=rules)
    fast = FastPath(manager, cgroups=CgroupReader(host.cgroup), rules=lambda: rules,
                    config=FastPathConfig(interval=0.2, dead_band=0.01, noise_cores=0.1), clock=lambda: 10.0)
    manager.be_state = BEState(None, quota)
    # capacity 8 x 50% = 4.0; non-BE 6.0; system 0.5: the headroom is 4.0 - 6.0 - 0.5 = -2.5 cores
    inputs = NodeInputs(now=NOW, capacity_cores=8.0, reserved_cores=0.5, pods=(LS, BE),
                        node_cpu_used=6.5, tiers=TierUsage(pods=6.5, be=0.5), source="fastpath")
    why = fast.decide(inputs)
    assert (why is not None) == replan, why


class RefusingExecutor(CgroupExecutor):
    """The kernel refusing the besteffort tier's quota (as cgroup v1 did below a child's)."""

    refuse = True

    def leveled_update(self, levels: Sequence[Sequence[Update]]) -> list[Write]:
        self._check([u for level in levels for u in level])
        return super().leveled_update(levels)

    def apply(self, updates: Sequence[Update]) -> list[Write]:
        self._check(updates)
        return super().apply(updates)

    def _check(self, updates: Sequence[Update]) -> None:
        for u in updates:
            if self.refuse and str(u.cgroup) == BE_DIR and u.resource is CPU_CFS_QUOTA and u.value != -1:
                raise CgroupError(f"{BE_DIR}: writing '{u.value}' to cpu.cfs_quota_us refused: Invalid argument")


@pytest.mark.asyncio
async def test_a_refused_write_backs_off_and_warns_once(host: Host, store: TSDB,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 14, item 11: the fast path retried a refused tier quota every tick with
    several warnings a second. Now one warning per cause, and re-plans back off."""
    rules = parse_rules({"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressPolicy": "cfsQuota"}})
    executor = RefusingExecutor(CgroupLayout(host.cgroup))
    failed: list[tuple[str, str, str]] = []  # the qos task turns these into Node events
    manager = QoSManager(reader=store, pods=lambda: [LS, BE], topology=TOPOLOGY, executor=executor,
                         evictor=CriEvictor(_no_runtime), rules=lambda: rules,
                         config=ManagerConfig(reserved_cores=0.5), clock=lambda: NOW,
                         on_write_failed=lambda *args: failed.append(args))
    await manager.run_once()
    clock = [0.0]
    fast = FastPath(manager, cgroups=CgroupReader(host.cgroup), rules=lambda: rules,
                    config=FastPathConfig(interval=0.1, min_gap=0.1, max_backoff=1.6),
                    clock=lambda: clock[0], wall=lambda: NOW)
    await fast.tick()
    for _ in range(40):  # 4 s of an LS burst the suppress write cannot follow
        host.advance(0.1, node=7.0, ls=6.0, be=0.5)
        clock[0] += 0.1
        await fast.tick()
    out = capsys.readouterr().out
    # gaps 0.2, 0.4, 0.8, 1.6, 1.6: a handful of re-plans instead of one per tick
    assert 3 <= fast.triggers <= 7, fast.triggers
    assert out.count("qos_write_failed") == 1 and out.count("fastpath_backoff ") == 1
    [(strategy, target, cause)] = failed
    assert strategy == "cpu_suppress" and "cpu.cfs_quota_us" in target and "Invalid argument" in cause
    executor.refuse = False  # the write goes through again: back to the tick rate
    for _ in range(20):
        host.advance(0.1, node=7.0, ls=6.0, be=0.5)
        clock[0] += 0.1
        await fast.tick()
    out = capsys.readouterr().out
    assert "qos_write_recovered" in out and "fastpath_backoff_reset" in out
    assert int((host.cgroup / "cpu" / BE_DIR / "cpu.cfs_quota_us").read_text()) == 2000


# --- the idle cadence: nothing to protect, no tick every 100 ms ----------------------------

async def _changing(host: Host, store: TSDB, config: FastPathConfig
                    ) -> tuple[list[PodView], list[Rules], QoSManager, FastPath]:
    """An LS pod alone, the BE rule on; the test changes the pod list (seen at the next
    round) and the rules through the returned lists."""
    pods, rules = [LS], [RULES]
    manager = QoSManager(reader=store, pods=lambda: list(pods), topology=TOPOLOGY,
                         executor=CgroupExecutor(CgroupLayout(host.cgroup)), evictor=CriEvictor(_no_runtime),
                         rules=lambda: rules[0], config=ManagerConfig(reserved_cores=0.5), clock=lambda: NOW)
    await manager.run_once()
    return pods, rules, manager, FastPath(manager, cgroups=CgroupReader(host.cgroup), rules=lambda: rules[0],
                                          config=config)


@pytest.mark.asyncio
async def test_nothing_to_protect_waits_the_regular_round_s_interval(host: Host, store: TSDB) -> None:
    """No BE pod, or the BE threshold rule off: no tick could re-plan, so none every 100 ms."""
    pods, rules, manager, fast = await _changing(host, store, FastPathConfig(interval=0.1, idle_interval=1.0))
    assert fast.next_wait() == 1.0  # an LS pod alone
    pods.append(BE)
    await manager.run_once()  # the pod list the fast path reads is the round's
    assert fast.next_wait() == 0.1
    rules[0] = parse_rules({"resourceUsedThresholdWithBE": {"enable": False}})
    assert fast.next_wait() == 1.0
    rules[0] = RULES
    assert fast.next_wait() == 0.1
    # An idle interval below the tick interval never makes the fast path faster.
    assert FastPath(manager, cgroups=CgroupReader(host.cgroup), rules=lambda: RULES,
                    config=FastPathConfig(interval=0.5, idle_interval=0.1)).next_wait() == 0.5


@pytest.mark.asyncio
async def test_run_idles_until_a_be_pod_appears(host: Host, store: TSDB) -> None:
    pods, _rules, manager, fast = await _changing(host, store, FastPathConfig(interval=0.01, idle_interval=3600))
    ticked, ticks = asyncio.Event(), [0]
    original = fast.sample

    def counted() -> NodeInputs | None:
        ticks[0] += 1
        ticked.set()
        host.advance(0.01, node=2.0, ls=0.5, be=1.0)  # a BE pod that runs: something to protect
        return original()

    fast.sample = counted  # type: ignore[method-assign]
    task = asyncio.create_task(fast.run())
    await asyncio.sleep(0.2)  # twenty tick intervals: none is taken while idle
    assert ticks[0] == 0
    pods.append(BE)
    await manager.run_once()
    fast.wake()  # as a PSI trigger would; else the idle hour runs out first
    for _ in range(3):  # then ticks at the tick interval
        ticked.clear()
        await asyncio.wait_for(ticked.wait(), 10)
    assert ticks[0] >= 3
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.asyncio
async def test_idle_be_pods_wait_the_regular_round_s_interval(host: Host, store: TSDB) -> None:
    """BE pods that use (next to) nothing, their tier not throttled, have no CPU to take
    back at once: the fast path ticks at the idle interval, measured over that long tick
    too, and is back at the tick interval as soon as one tick sees BE busy or held back
    by its quota. A counter going back changes nothing."""
    manager, fast, clock = await setup(host, store)
    fast.cfg = FastPathConfig(interval=0.1, idle_interval=1.0)
    assert fast.next_wait() == 0.1  # not measured yet
    fast.sample()  # the baseline

    def tick(seconds: float, be: float, throttled: int = 0) -> float:
        host.be_throttled += throttled
        host.advance(seconds, node=2.5, ls=2.0, be=be)
        clock[0] += seconds
        fast.sample()
        return fast.next_wait()

    assert tick(0.1, be=0.05) == 0.1  # BE at 0.05 core: a look at the tier's throttling opens
    assert tick(0.1, be=0.05) == 0.1  # ... shorter than 1.5 CFS periods, it stays open
    assert tick(0.1, be=0.05) == 1.0  # ... and no throttling in it
    host.advance(1.0, node=2.5, ls=2.0, be=0.5)
    clock[0] += 1.0
    assert fast.sample() is None  # a second since the last tick: no decision from it...
    assert fast.next_wait() == 0.1  # ...but BE was busy in it
    host.ns["c"] -= 10**9  # a reset of the BE counters: no verdict from it
    host.write()
    clock[0] += 0.1
    fast.sample()
    assert fast.next_wait() == 0.1
    assert tick(0.1, be=0.0) == 0.1  # a new look
    assert tick(0.2, be=0.0) == 1.0
    # Held at the floor: a 2 ms quota can read as nothing over a tick, but the tier was
    # throttled, so BE wants CPU and is watched (bench_qos_reaction: idle ticks there
    # made LS bursts wait up to a second).
    assert tick(1.0, be=0.0, throttled=3) == 0.1
    assert tick(0.1, be=0.0, throttled=1) == 0.1  # a look still open
    assert tick(0.1, be=0.0) == 0.1  # throttled in it
    assert tick(0.2, be=0.0) == 1.0  # not in the next
    host.advance(1.0, node=2.5, ls=2.0, be=0.0)
    clock[0] += 1.0
    (host.cgroup / "cpu" / BE_DIR / "cpu.stat").write_text("usage_usec 1\n")  # unknown counts as held
    fast.sample()
    assert fast.next_wait() == 0.1
    assert manager.be_state is not None


# --- run(): ticks from a timer callback, a task only while a re-plan runs ------------------

@pytest.mark.asyncio
async def test_run_replans_from_its_timer_and_ticks_on_after_it(host: Host, store: TSDB) -> None:
    manager, _, clock = await setup(host, store)
    fast = FastPath(manager, cgroups=CgroupReader(host.cgroup), rules=lambda: RULES,
                    config=FastPathConfig(interval=0.01, min_gap=0.01), clock=lambda: clock[0], wall=lambda: NOW)
    original, samples, overlapped = fast.sample, [0], []
    enough = asyncio.Event()

    def burst() -> NodeInputs | None:  # each tick sees one interval of an LS burst (manual clock)
        overlapped.append(fast._replanning is not None and not fast._replanning.done())
        host.advance(0.01, node=7.0, ls=6.0, be=0.5)
        clock[0] += 0.01
        samples[0] += 1
        if samples[0] >= 5:
            enough.set()
        return original()

    fast.sample = burst  # type: ignore[method-assign]
    task = asyncio.create_task(fast.run())
    await asyncio.wait_for(enough.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The second tick re-planned (2 CPUs for BE); the ones after it found the limit in force.
    assert fast.triggers == 1
    assert (host.cgroup / "cpuset" / BE_DIR / "cpuset.cpus").read_text().strip() == "0,4"
    assert not any(overlapped)  # no tick while the re-plan ran


@pytest.mark.asyncio
async def test_a_tick_that_raises_ends_run_with_its_error(host: Host, store: TSDB) -> None:
    """run() is supervised: what a tick raises (in its timer callback) must reach it."""
    _, fast, _ = await setup(host, store)
    fast.cfg = FastPathConfig(interval=0.01)

    def broken() -> NodeInputs | None:
        raise RuntimeError("sampler broke")

    fast.sample = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="sampler broke"):
        await asyncio.wait_for(fast.run(), 10)


@pytest.mark.asyncio
async def test_a_rules_lookup_that_raises_after_a_tick_ends_run(host: Host, store: TSDB) -> None:
    """The next tick is armed from the timer callback (its wait reads the rules): a
    failure there must reach run() too, not stop the ticks silently."""
    manager, _, clock = await setup(host, store)
    calls = [0]

    def rules() -> Rules:
        calls[0] += 1
        if calls[0] > 3:
            raise RuntimeError("rules broke")
        return RULES

    fast = FastPath(manager, cgroups=CgroupReader(host.cgroup), rules=rules,
                    config=FastPathConfig(interval=0.01), clock=lambda: clock[0], wall=lambda: NOW)
    with pytest.raises(RuntimeError, match="rules broke"):
        await asyncio.wait_for(fast.run(), 10)


_Advance = tuple[float, float, float, float]  # seconds, node, LS and BE cores


async def _ticks(host: Host, store: TSDB, steps: Sequence[Sequence[_Advance]], woken: int,
                 linger: float = 0.0, limit: int | None = None) -> tuple[list[int], FastPath]:
    """Run the fast path (cfsQuota policy, 30 s interval, 10 ms follow-up) through one tick
    per step, the counters advanced by the step's parts before the tick; the first
    ``woken`` ticks are woken (the interval would take 30 s), the rest must come by
    themselves. ``linger``: seconds it runs on after the last step (ticks then repeat
    the last step); ``limit``: the BE quota in force as the fast path sees it. The BE
    tier's quota as each tick sampled, and once more at the end; and the fast path."""
    rules = parse_rules({"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressPolicy": "cfsQuota"}})
    manager, _, clock = await setup(host, store, rules=rules)
    if limit is not None:
        manager.be_state = BEState(None, limit)
    fast = FastPath(manager, cgroups=CgroupReader(host.cgroup), rules=lambda: rules,
                    config=FastPathConfig(interval=30.0, idle_interval=30.0, followup=0.01, min_gap=0.01),
                    clock=lambda: clock[0], wall=lambda: NOW)
    quota = host.cgroup / "cpu" / BE_DIR / "cpu.cfs_quota_us"
    original, seen = fast.sample, []
    done = asyncio.Event()

    def tick() -> NodeInputs | None:
        seen.append(int(quota.read_text()))
        for seconds, node, ls, be in steps[min(len(seen), len(steps)) - 1]:
            host.advance(seconds, node=node, ls=ls, be=be)
            clock[0] += seconds
        if len(seen) == len(steps):
            done.set()
        return original()

    fast.sample = tick  # type: ignore[method-assign]
    task = asyncio.create_task(fast.run())
    for _ in range(woken):
        await asyncio.sleep(0)
        fast.wake()
        await asyncio.sleep(0.001)
    await asyncio.wait_for(done.wait(), 10)  # well before a second 30 s interval
    await asyncio.sleep(linger)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    seen.append(int(quota.read_text()))
    return seen, fast


BURST: Final = (7.0, 6.0, 0.5)
#: 0.1 s: LS at 0.2 cores; then LS up by 0.5 (the band is 0.1), the headroom 5.2 - 0.7 -
#: 0.5 = 4.0 cores, far above the 2.2 in force: a burst's first 15 ms of an 80 ms tick
#: read as a fifth of itself.
IDLE: Final = (0.1, 1.0, 0.2, 0.5)
RISE: Final = (0.1, 1.5, 0.7, 0.5)


@pytest.mark.asyncio
async def test_a_burst_begun_mid_tick_is_completed_at_the_follow_up(host: Host, store: TSDB) -> None:
    """A tick that saw the last half of a burst re-plans from that partial rate; the next
    tick comes ``followup`` later (not a whole interval), from a window wholly inside the
    burst, and takes BE the rest of the way down. (The manual clock moves a little more
    than the follow-up.)"""
    half = [(0.05, 1.0, 0.2, 0.5), (0.05, *BURST)]
    seen, fast = await _ticks(host, store, [[], half, [(0.02, *BURST)], [(0.02, *BURST)]], woken=2)
    # in force before, after the partial re-plan (5.2 - 3.1 - 0.5 = 1.6 cores), after the follow-up
    assert seen[1] > 160_000 and 2 * MIN_QUOTA < seen[2] < seen[1], seen
    assert seen[3] == seen[4] == MIN_QUOTA and fast.triggers == 2, seen


@pytest.mark.asyncio
async def test_a_rise_the_dead_band_kept_is_looked_at_again_at_the_follow_up(host: Host, store: TSDB) -> None:
    """The non-BE pods' use rose by more than the band but the headroom is still within it
    of the limit (a burst seen in part, near the limit): no re-plan, but the next tick
    comes ``followup`` later, sees the whole burst and re-plans."""
    # idle, then 5.2 - 2.5 - 0.5 = 2.2 cores of headroom against 2.2 in force (LS up 2.3
    # cores), then the whole burst
    steps = [[], [(0.1, 1.0, 0.2, 0.5)], [(0.1, 3.5, 2.5, 0.5)], [(0.02, *BURST)], [(0.02, *BURST)]]
    seen, fast = await _ticks(host, store, steps, woken=3)
    assert seen[:4] == [220_000] * 4 and fast.triggers == 1, seen  # no re-plan from the partial tick
    assert seen[4] == seen[5] == MIN_QUOTA, seen


@pytest.mark.asyncio
@pytest.mark.parametrize("rise", [RISE, (0.1, 2.0, 0.2, 0.5)], ids=["ls", "system"])
async def test_a_rise_far_above_the_limit_is_looked_at_again_at_the_follow_up(host: Host, store: TSDB,
                                                                              rise: _Advance) -> None:
    """A burst begun late in a tick is a small part of that tick's window: the headroom it
    leaves is far above the limit, yet the rise of what BE competes with (more than the
    band) is a burst seen in part: the LS pods' use (0.2 -> 0.7 cores), or the system's
    above its reservation (0.5 -> 1.3: a container starting, its burst still to come).
    The next tick comes ``followup`` later, sees the burst whole and re-plans (the
    reaction bench's slowest runs waited a whole interval for it)."""
    steps = [[], [IDLE], [rise], [(0.02, *BURST)], [(0.02, *BURST)]]
    seen, fast = await _ticks(host, store, steps, woken=3)
    assert seen[:4] == [220_000] * 4 and fast.triggers == 1, seen
    assert seen[4] == seen[5] == MIN_QUOTA, seen


@pytest.mark.asyncio
async def test_a_follow_up_that_sees_the_rise_go_on_calls_another(host: Host, store: TSDB) -> None:
    """A burst that ramps up (its threads starting one by one): the first follow-up sees
    LS rise again, by 1.0 core, still short of lowering the limit (5.2 - 1.7 - 0.5 = 3.0
    against 2.2); the next follow-up sees it whole and re-plans."""
    steps = [[], [IDLE], [RISE], [(0.02, 2.5, 1.7, 0.5)], [(0.02, *BURST)], [(0.02, *BURST)]]
    seen, fast = await _ticks(host, store, steps, woken=3)
    assert seen[:5] == [220_000] * 5 and fast.triggers == 1, seen
    assert seen[5] == seen[6] == MIN_QUOTA, seen


@pytest.mark.asyncio
@pytest.mark.parametrize(("steps", "limit"), [
    # the follow-up sees LS at the rate the rise left it: no fresh rise
    ([[], [IDLE], [RISE], [(0.02, *RISE[1:])]], None),
    # BE at the floor already: a burst has nothing left to take
    ([[], [IDLE], [RISE]], MIN_QUOTA),
], ids=["no-fresh-rise", "at-the-floor"])
async def test_no_follow_up_without_a_fresh_rise_or_at_the_floor(host: Host, store: TSDB,
                                                                steps: list[list[_Advance]], limit: int | None) -> None:
    """A follow-up without a fresh rise ends the chain (a noisy node's swings end one at
    their first fall), and a rise with BE at the floor waits the interval: 0.3 s is 30
    follow-ups, a 30 s interval is far off, so any tick past the steps would be a
    follow-up."""
    seen, fast = await _ticks(host, store, steps, woken=3, linger=0.3, limit=limit)
    assert len(seen) == len(steps) + 1 and fast.triggers == 0, seen


@pytest.mark.asyncio
@pytest.mark.parametrize(("follow_up", "replans"), [((8.0, 3.0, 4.5), True), ((5.5, 3.0, 2.0), False)],
                         ids=["node-full", "node-with-room"])
async def test_be_s_use_above_its_limit_counts_as_the_non_be_pods_on_a_full_node(
        host: Host, store: TSDB, follow_up: tuple[float, float, float], replans: bool) -> None:
    """BE's tier gets a period's runtime at once (at each period's start, and at a quota
    write: here the partial re-plan's), so over a 20 ms follow-up it burns far more than
    its limit (4.5 cores against 1.6) and LS gets that much less (3.0 of the 6.0 it
    wants): from those rates the headroom, 5.2 - 3.0 - 0.5 = 1.7, is above the limit. On
    a full node what BE used above its limit was taken from pods that waited: counted as
    theirs (non-BE 7.5 - 1.6 = 5.9), the follow-up takes BE to the floor. On a node with
    room (BE at 2.0) the refill took from no one: no re-plan, and no fresh rise (3.6 ->
    3.5 cores with the system's reservation): no further follow-up."""
    half = [(0.05, 1.0, 0.2, 0.5), (0.05, *BURST)]
    steps = [[], half, [(0.02, *follow_up)], [(0.02, *BURST)]]
    seen, fast = await _ticks(host, store, steps if replans else steps[:3], woken=2, linger=0.0 if replans else 0.3)
    assert seen[1] > 160_000 and 2 * MIN_QUOTA < seen[2] < seen[1], seen  # the partial re-plan: 1.6 cores
    if replans:
        assert seen[3] == seen[4] == MIN_QUOTA and fast.triggers == 2, seen
    else:
        assert seen[3] == seen[2] and len(seen) == 4 and fast.triggers == 1, seen
