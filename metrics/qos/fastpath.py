"""The suppress fast path (beyond koordlet): react to an LS burst within 100 ms.

Koordlet re-plans BE suppression once a second from samples up to 2 s old, so an
LS pod that suddenly needs the CPU competes with BE pods for a second or two.
This sampler reads only what the suppress formula needs every 80 ms, turns
the deltas into ``NodeInputs``, and when the headroom drops (the new suppress
target is below the BE limit in force by more than the dead band) asks the
manager for an immediate re-plan of the suppress strategy, which goes through
the same arbitration and executor as a regular round. Growing the BE limit back
is left to the regular round (it is capped per round anyway).

What it reads, cheapest first:

* the node: the root cgroup's cumulative CPU counter (``cpuacct.usage`` /
  ``cpu.stat``), in nanoseconds. Not ``/proc/stat``: it counts in 10 ms jiffies,
  so over 100 ms on 2 CPUs it moves in steps of 0.1 core — noise as large as the
  drops the fast path must see, which made it re-plan on nothing. (The root
  counter leaves out IRQ time, which the regular round's /proc/stat includes.)
* **tier mode** — plus two counters, the kubepods tier and the besteffort tier
  (the kernel charges every descendant to them), so a tick costs three reads
  whatever the pod count. Used while the tiers tell BE from non-BE exactly: every
  pod lives under kubepods, and a pod is under besteffort exactly when it is BE.
* **pod mode** — otherwise (e.g. a pod labelled BE but placed in the burstable
  tier, or a pod outside kubepods): the root counter plus each pod's.

Over 100 ms, real usage still wobbles (a kubelet housekeeping burst is 0.05 core
for a moment), so a drop must exceed ``noise_cores`` as well as the dead band.

A re-plan whose write fails (the kernel refusing a quota) doubles the least gap
between re-plans, up to ``max_backoff``; a successful one resets it, so a refused
write is neither retried ten times a second nor logged at that rate (the manager
warns once per target and cause, and says when it recovers).

With nothing to protect against (no BE pod on the node, or the BE threshold rule
off) a tick could never re-plan, yet each costs ~0.1-0.2 ms of CPU on a VM, nearly all of
it the wake-up (issue 29): the fast path then ticks every ``idle_interval`` (the
regular round's interval) instead, and is back at ``interval`` within one idle tick
of a BE pod appearing or the rule turning on; the regular round covers the gap, as it
does without a fast path. Likewise while the BE pods use less than ``be_active_cores``
(measured over the last tick, whatever its length) and their tier was not throttled in
a look of at least 1.5 CFS periods (BE held at a small quota uses little because it may
not use more: that is BE to watch, not idle BE): there is no CPU to take back from them
at once. The trade-off: BE starting to burn during an LS burst competes with it until
the next idle tick sees BE busy or the regular round lowers its limit (at most about
one regular interval, as in koordlet), instead of one tick. All of it is read from
state at every tick, not from events.

A burst that begins mid-tick is seen in part: a re-plan that went through, or a tick
where what BE competes with in the formula (the non-BE pods' use plus the system's
above its reservation) rose by more than the dead band while the BE limit is above the
lowest target a burst could give, is followed by a tick ``followup`` (20 ms) later,
which sees it whole. Whether the rise would lower the limit is not judged from the
partial tick: the part it saw says nothing of the burst's size (a burst begun 15 ms
before an 80 ms tick reads as a fifth of itself), so judging it kept the slowest
reactions at a whole interval more (bench_qos_reaction: 92-113 ms, docs/benchmarks.md).
The system's use counts because a new container's start-up (runc, the shim) is system
use just before its burst. A follow-up that sees the rise go on calls another (a burst
that ramps up: bench_qos_reaction saw a burner at 0.8 of its 2 cores 47 ms after it
started, and waiting a whole interval from there took 134 ms); one that sees no fresh
rise of more than the band ends the chain. So a chain is at most capacity / band long,
and a noisy node's swings end one at their first fall.

A tick is shorter than the CFS period (100 ms), so BE's use over it is not bounded by
its limit: the tier gets a period's runtime at once, at each period's start and at a
quota write (which refills it to the new quota and unthrottles: the kernel's
``tg_set_cfs_bandwidth``), and two spinning BE threads burn 22 ms of it in 11 ms. Over
a 20 ms follow-up that holds such a refill, a 0.22-core quota read as 0.85-0.93 cores,
and the LS pods got that much less than they wanted: from those rates the limit looked
right and the burst waited a whole interval more (bench_qos_reaction: 123 and 159 ms).
So in tier mode, when the node was full (its use within the band of capacity: someone
waited for the CPU BE took), BE's use above its limit in force counts as the non-BE
pods'. On a node with room, BE's refill took from no one and counts as BE's.

The mode is re-derived whenever the pod list changes and logged when it does.
Paths are computed once per pod list and the counter files stay open
(``OpenFiles``: one ``pread`` each a tick; after ``rmdir`` the read fails, ENODEV,
as a missing file does); no parsing beyond one int per file. The reads stay on the
event loop: they are memory-backed kernel files answering in microseconds, less than
a thread hop. A tick that comes too late (the loop stalled) resets the baseline:
deltas over an unknown span would be a guess, so no decision is made from them.

What a tick costs is mostly coming back from sleep (issue 29: cold caches; measured in
docs/benchmarks.md), so ``run`` ticks from a plain timer callback (no task, no future
per tick: one loop callback instead of three) and a task exists only while a re-plan
runs; opening three cgroup files per tick cost more, cold, than reading them.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Final

import structlog

from hooks.rules import Rules
from metrics.collect.base import ReadError
from metrics.collect.cgroupfs import CgroupReader, parse_cpu_usage_ns, parse_throttling
from metrics.collect.openfiles import OpenFiles, default_limit
from metrics.model import PodView
from metrics.qos.inputs import NodeInputs, TierUsage
from metrics.qos.manager import QoSManager
from metrics.qos.suppress import MIN_CPUSET, MIN_QUOTA, is_be, ls_headroom, suppress_cores
from metrics.qos.suppress import NAME as SUPPRESS_NAME

log = structlog.get_logger("metrics.qos.fastpath")

NS: Final = 1e9
#: Counter keys in tier mode (pod uids never look like this).
_PODS, _BE = "tier:kubepods", "tier:besteffort"
#: Counter files kept open (pod mode reads one per pod; beyond this, or a quarter of the
#: descriptor limit, opened per read), as ``pathcache.MAX_OPEN``.
_MAX_OPEN: Final = 512


@dataclass(frozen=True, slots=True)
class FastPathConfig:
    #: Seconds between ticks: a burst is seen at the first tick after it starts (one
    #: interval at most), wholly at the follow-up when it began mid-tick. 80 ms keeps the
    #: reaction under 100 ms with the loop's jitter (bench_qos_reaction: at 100 ms the
    #: slowest of 40 was 126 ms, at 80 ms 88 ms).
    interval: float = 0.08
    #: Seconds between ticks while no tick could re-plan (no BE pod, the rule off): the
    #: regular round's interval. The first tick after such a gap only takes a baseline.
    idle_interval: float = 1.0
    #: A tick later than this many intervals after the last is a stall: no decision.
    stale_after: float = 3.0
    #: Dead band, as a share of capacity: smaller drops wait for the regular round.
    dead_band: float = 0.01
    #: ... and in cores: a 100 ms sample of an idle node wobbles by this much.
    noise_cores: float = 0.1
    #: BE using less than this (cores, over the last tick), its tier not throttled, has
    #: nothing to take back at once: the fast path ticks at ``idle_interval`` until it
    #: uses more or is throttled.
    be_active_cores: float = 0.1
    #: After a re-plan that went through, or a tick that saw the non-BE pods' and
    #: the system's use rise by more than the dead band with something left to take
    #: (the BE limit above the lowest target), the next tick comes this soon: a burst
    #: that began mid-tick (a partial rate) is completed from a short window wholly
    #: inside it, not one whole interval later. ns counters make a 20 ms rate exact;
    #: only a lower target re-plans, so a short window cannot raise BE.
    followup: float = 0.02
    #: Least time between two fast re-plans (the follow-up's); a failing write doubles it
    #: (below), so a refused write is retried at most at the tick rate, then less.
    min_gap: float = 0.02
    #: A re-plan whose write failed doubles the gap, up to this (seconds); a successful
    #: one resets it. A write the kernel keeps refusing is then retried every few seconds
    #: (the regular round still runs every second), not ten times a second.
    max_backoff: float = 5.0


@dataclass(frozen=True, slots=True)
class _Tick:
    ts: float
    #: The root cgroup's cumulative CPU (ns).
    node: int
    #: Cumulative CPU (ns) by pod uid, or by tier key in tier mode.
    counters: Mapping[str, int]


class FastPath:
    def __init__(
        self,
        manager: QoSManager,
        *,
        cgroups: CgroupReader,
        rules: Callable[[], Rules],
        config: FastPathConfig = FastPathConfig(),
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = config
        self._manager = manager
        self._cgroups = cgroups
        self._root = cgroups.cpu_usage_file("")
        self._files = OpenFiles(limit=min(_MAX_OPEN, default_limit() // 4))
        self._rules = rules
        self._clock = clock
        self._wall = wall
        self._prev: _Tick | None = None
        self._pods: tuple[PodView, ...] = ()
        #: Whether ``_pods`` holds a BE pod (derived with the paths, once per pod list).
        self._any_be = False
        #: The counter keys whose sum is the BE pods' CPU (the tier, or the BE pods' uids).
        self._be_keys: tuple[str, ...] = ()
        #: The besteffort tier's ``cpu.stat``, and when the open look at its throttling began
        #: and its nr_throttled then (None: none open, BE used ``be_active_cores`` or more).
        self._be_stat = ""
        self._be_throttled: tuple[float, int] | None = None
        #: The BE pods used at least ``be_active_cores`` over the last measured tick (True
        #: until one is measured: a new fast path ticks at ``interval`` first).
        self._be_active = True
        #: Counter file by pod uid, or by tier key in tier mode.
        self._paths: dict[str, str] = {}
        self._last_trigger = -math.inf
        #: What BE competed with (non-BE pods and system, cores) at the last decision, and
        #: whether the next tick is to be a follow-up to a rise.
        self._others = math.inf
        self._confirm = False
        self._gap = config.min_gap
        #: While ``run`` runs: its loop, the armed timer, the re-plan in flight, and the
        #: future that carries a tick's exception to ``run``.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._replanning: asyncio.Task[None] | None = None
        self._failed: asyncio.Future[None] | None = None
        self._warned: set[str] = set()
        self.triggers = 0
        #: "tier" or "pods" (see the module doc); "" before the first tick.
        self.mode = ""

    def wake(self) -> None:
        """Sample now (a PSI trigger fired); nothing while a re-plan runs (the next tick follows it)."""
        if self._timer is not None and self._loop is not None:
            self._timer.cancel()
            self._timer = self._loop.call_later(0, self._on_timer)

    async def run(self) -> None:
        """Tick until cancelled; raises what a tick raised. Each tick is a timer callback
        that samples and decides; only a re-plan (rare) runs as a task, and the next
        tick is armed when it ends, so ticks never overlap."""
        loop = self._loop = asyncio.get_running_loop()
        self._failed = failed = loop.create_future()
        self._arm()
        try:
            await failed
        finally:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop = self._failed = None
            replan, self._replanning = self._replanning, None
            if replan is not None and not replan.done():
                replan.cancel()
            self._files.close()

    def _arm(self, followup: bool = False) -> None:
        if self._loop is not None:
            self._timer = self._loop.call_later(self.cfg.followup if followup else self.next_wait(), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        loop = self._loop
        if loop is None:  # run() has ended
            return
        try:
            inputs = self.sample()
            why = None if inputs is None else self.decide(inputs)
            if inputs is None or why is None:
                confirm, self._confirm = self._confirm, False
                self._arm(followup=confirm)
                return
        except Exception as exc:  # noqa: BLE001 - handed to run(), which raises it to its supervisor
            self._fail(exc)
            return
        self._replanning = loop.create_task(self._replan_then_arm(inputs, why), name="qos:fastpath-replan")

    async def _replan_then_arm(self, inputs: NodeInputs, why: str) -> None:
        try:
            went_through = await self._replan(inputs, why)
            self._arm(followup=went_through)
        except Exception as exc:  # noqa: BLE001 - handed to run(), as a tick's
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        if self._failed is not None and not self._failed.done():
            self._failed.set_exception(exc)

    def next_wait(self) -> float:
        """Seconds to the next tick: ``interval`` while a tick could re-plan (some BE pod
        under an enabled BE threshold rule), else ``idle_interval``."""
        self._refresh_paths()
        if self._any_be and self._be_active and self._rules().resource_used_threshold_with_be.enable:
            return self.cfg.interval
        return max(self.cfg.idle_interval, self.cfg.interval)

    async def tick(self) -> bool:
        """One sample; True when it triggered a re-plan (``run`` does the same from its timer,
        and arms the next tick ``followup`` after a re-plan that went through)."""
        inputs = self.sample()
        if inputs is None:
            return False
        why = self.decide(inputs)
        if why is None:
            return False
        await self._replan(inputs, why)
        return True

    async def _replan(self, inputs: NodeInputs, why: str) -> bool:
        """Re-plan suppress now; whether its writes went through."""
        self._last_trigger = self._clock()
        self.triggers += 1
        result = await self._manager.replan_suppress(inputs, why)
        failed = any(o.result.startswith("failed") for o in result.outcomes.get(SUPPRESS_NAME, ()))
        gap = min(self._gap * 2, self.cfg.max_backoff) if failed else self.cfg.min_gap
        if failed and self._gap == self.cfg.min_gap:
            log.info("fastpath_backoff", reason="suppress write failed", max_gap_seconds=self.cfg.max_backoff)
        elif not failed and self._gap > self.cfg.min_gap:
            log.info("fastpath_backoff_reset", reason="suppress write succeeded")
        self._gap = gap
        return not failed

    # --- sampling -----------------------------------------------------------------------

    def _refresh_paths(self) -> None:
        pods = self._manager.pods
        if pods is self._pods:
            return
        self._pods = pods
        self._any_be = any(is_be(p) for p in pods)
        if self._warned:  # warned-once keys of pods that are gone go with them
            self._warned &= {p.uid for p in pods} | {"root", _PODS, _BE}
        tier, reason = self._tier_mode(pods)
        mode = "tier" if tier else "pods"
        if mode != self.mode:
            log.info("fastpath_mode", mode=mode, reason=reason, pods=len(pods))
            self.mode = mode
        counter = self._cgroups.cpu_usage_file
        be_dir = self._manager.cfg.suppress.besteffort_dir
        self._be_stat = self._cgroups.cpu_stat_file(str(be_dir))
        if tier:
            self._paths = {_PODS: counter(str(be_dir.parent)), _BE: counter(str(be_dir))}
            self._be_keys = (_BE,)
        else:
            self._be_keys = tuple(p.uid for p in pods if is_be(p))
            # The list is rebuilt whenever any container comes or goes (e.g. the very LS
            # container whose burst we must see): pods that stay keep their baseline, so
            # only new pods lack a rate for one tick.
            self._paths = {p.uid: counter(p.cgroup_dir) for p in pods}
        self._files.retain([self._root, self._be_stat, *self._paths.values()])

    def _tier_mode(self, pods: tuple[PodView, ...]) -> tuple[bool, str]:
        """Whether the two tier counters give Σ pods and Σ BE exactly, and why not."""
        be_dir = self._manager.cfg.suppress.besteffort_dir
        kube_dir = be_dir.parent
        if not kube_dir.parts:
            return False, f"besteffort_dir {str(be_dir)!r} has no parent tier"
        for pod in pods:
            where = PurePosixPath(pod.cgroup_dir)
            if not where.is_relative_to(kube_dir):
                return False, f"pod {pod.key} is outside {kube_dir}"
            if where.is_relative_to(be_dir) != is_be(pod):
                kind = "BE" if is_be(pod) else "not BE"
                return False, f"pod {pod.key} (qos {pod.qos.value}) is {kind} but lives in {where.parent}"
        return True, f"all pods under {kube_dir}, BE exactly under {be_dir}"

    def _read(self) -> _Tick | None:
        version, read = self._cgroups.version, self._files.read
        try:
            node = parse_cpu_usage_ns(read(self._root), self._root, version)
        except ReadError as exc:
            self._warn("root", "fastpath_sample_failed", str(exc))
            return None
        counters: dict[str, int] = {}
        for key, path in self._paths.items():
            try:
                counters[key] = parse_cpu_usage_ns(read(path), path, version)
            except ReadError as exc:
                # A vanished pod simply drops out; a tier must be there, and anything
                # else is unknown.
                if not exc.gone or self.mode == "tier":
                    self._warn(key, "fastpath_sample_failed", str(exc))
                    return None
        return _Tick(self._clock(), node, counters)

    def _warn(self, key: str, event: str, reason: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(event, reason=reason)

    def sample(self) -> NodeInputs | None:
        """Read one tick; inputs from the deltas to the previous tick, or None when
        there is no valid previous tick (first tick, stall, reset, mode change)."""
        self._refresh_paths()
        tick = self._read()
        prev, self._prev = self._prev, tick
        if tick is None or prev is None:
            return None
        dt = tick.ts - prev.ts
        if dt > 0:
            self._measure_be(prev, tick, dt)
        if dt <= 0 or dt > self.cfg.stale_after * self.cfg.interval or tick.node < prev.node:
            return None
        rates: dict[str, float] = {}
        for key, ns in tick.counters.items():
            before = prev.counters.get(key)
            if before is None or ns < before:
                continue  # new or reset counter: no rate this tick
            rates[key] = (ns - before) / NS / dt
        node_used = (tick.node - prev.node) / NS / dt
        # One construction per tick, ten a second: no ``replace`` of a first draft.
        manager = self._manager
        if _PODS in tick.counters:
            if _PODS not in rates or _BE not in rates:
                return None
            tiers = TierUsage(rates[_PODS], self._within_limit(rates[_BE], node_used))
            return NodeInputs(self._wall(), manager.capacity, manager.cfg.reserved_cores, self._pods, node_used,
                              source="fastpath", tiers=tiers)
        live = tuple(p for p in self._pods if p.uid in tick.counters)  # vanished pods use no CPU
        missing = tuple(f"pod_cpu{{{p.key}}}" for p in live if p.uid not in rates)
        return NodeInputs(self._wall(), manager.capacity, manager.cfg.reserved_cores, live, node_used,
                          pod_cpu_used=rates, missing=missing, source="fastpath")

    def _within_limit(self, be: float, node_used: float) -> float:
        """BE's use over a tick, at most its limit in force when the node was full: what
        a runtime refill let it burn above that came from pods that waited (module doc)."""
        manager, capacity = self._manager, self._manager.capacity
        state = manager.be_state
        if state is None or node_used < capacity - self._band(capacity):
            return be
        policy = self._rules().resource_used_threshold_with_be.cpu_suppress_policy
        limit = state.limit_cores(policy, capacity, manager.cfg.suppress.cfs_period_us)
        return be if limit is None else min(be, limit)

    def _band(self, capacity: float) -> float:
        """The dead band in cores: a share of capacity, at least the sampling noise."""
        return max(capacity * self.cfg.dead_band, self.cfg.noise_cores)

    def _measure_be(self, prev: _Tick, tick: _Tick, dt: float) -> None:
        """Whether the BE pods used ``be_active_cores`` between the two ticks; over an idle
        tick's gap too (too long for a decision, enough for this). A counter that went
        back (reset) or is missing from either tick leaves the last verdict as it was."""
        used = 0
        for key in self._be_keys:
            now, before = tick.counters.get(key), prev.counters.get(key)
            if now is None or before is None or now < before:
                return
            used += now - before
        cores = used / NS / dt
        if cores >= self.cfg.be_active_cores:
            active, self._be_throttled = True, None
        else:
            active = self._be_held()
        if active != self._be_active:
            log.debug("fastpath_cadence", be_active=active, be_cores=round(cores, 3))
            self._be_active = active

    def _be_held(self) -> bool:
        """Whether the besteffort tier was throttled in a look of at least one and a half
        CFS periods: BE held by its quota (suppressed to the floor, say) uses little
        because it may not use more, and over a tick a 2 ms quota can read as nothing at
        all, so what it used says nothing about what it wants. A shorter look may hold no
        period end (no throttling to see): it stays open. Unknown (a look still open, an
        unreadable ``cpu.stat``) counts as held: the fast path stays at its interval."""
        try:
            throttled = parse_throttling(self._files.read(self._be_stat), self._be_stat)[1]
        except ReadError:
            self._be_throttled = None
            return True
        now, start = self._clock(), self._be_throttled
        if start is None or now - start[0] < 1.5 * self._manager.cfg.suppress.cfs_period_us / 1e6:
            if start is None:
                self._be_throttled = (now, throttled)
            return True
        self._be_throttled = (now, throttled)
        return throttled > start[1]

    # --- deciding -----------------------------------------------------------------------

    def decide(self, inputs: NodeInputs) -> str | None:
        """Why to re-plan now, or None (disabled, unknown state, within the dead band)."""
        threshold = self._rules().resource_used_threshold_with_be
        state = self._manager.be_state
        if not threshold.enable or state is None or inputs.missing:
            return None
        capacity, period = inputs.capacity_cores, self._manager.cfg.suppress.cfs_period_us
        current = state.limit_cores(threshold.cpu_suppress_policy, capacity, period)
        if current is None:
            return None
        formula = suppress_cores(inputs, threshold)
        value, ls_value = formula.suppress, ls_headroom(formula, inputs)
        floor = formula.floor or 0.0
        if threshold.cpu_suppress_policy == "cpuset":
            wanted, ls_value = float(math.ceil(value)), float(math.ceil(ls_value))
            target = max(wanted, float(MIN_CPUSET))
            lowest = max(float(math.ceil(floor)), float(MIN_CPUSET))
        else:
            wanted = value
            target = max(value * period, MIN_QUOTA) / period
            lowest = max(floor * period, MIN_QUOTA) / period
        # The drop is judged on the headroom itself, not on the target floored at the
        # minimum: a limit already small (a busy node) within the band of the floor must
        # still go to the floor at once when LS takes everything, not a round later.
        band = self._band(capacity)
        lower = wanted < current - band
        others = formula.non_be_used + formula.system_used
        rose, self._others = others - self._others >= band, others
        strategy = self._manager.suppress
        if lower and ls_value < current - band and strategy is not None:
            # The non-BE pods want the limit lower than it is (a burst, even at the floor):
            # the loop's growth waits (``SuppressStrategy.hold``), so a burst every second
            # keeps BE down instead of a drop here and a growth there each second.
            strategy.hold(inputs.now)
        if self._clock() - self._last_trigger < self._gap:
            return None
        if target < current and lower:
            return f"headroom dropped: BE target {target:.2f} < limit {current:.2f} cores"
        # What BE competes with rose by more than the band (a burst begun during this
        # tick's window, seen in part, or a container starting): look again ``followup``
        # later, not a whole interval, if a burst could still take something (module
        # doc). A follow-up's own rise calls the next one: the chain ends at the first
        # tick without a fresh rise.
        self._confirm = rose and current - band > lowest
        return None


