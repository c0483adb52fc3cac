"""The suppress fast path (beyond koordlet): react to an LS burst within ~250 ms.

Koordlet re-plans BE suppression once a second from samples up to 2 s old, so an
LS pod that suddenly needs the CPU competes with BE pods for a second or two.
This sampler reads only what the suppress formula needs every 100-200 ms, turns
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
(measured over the last tick, whatever its length) and less than half the limit in
force: there is no CPU to take back from them at once. The trade-off: BE starting to
burn during an LS burst competes with it until the next idle tick sees BE busy or the
regular round lowers its limit (at most about one regular interval, as in koordlet),
instead of one tick. All of it is read from state at every tick, not from events.

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
from metrics.collect.cgroupfs import CgroupReader, parse_cpu_usage_ns
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
    #: Seconds between ticks: a burst that starts mid-tick is fully seen one tick
    #: later, so the reaction is about two ticks plus the write.
    interval: float = 0.1
    #: Seconds between ticks while no tick could re-plan (no BE pod, the rule off): the
    #: regular round's interval. The first tick after such a gap only takes a baseline.
    idle_interval: float = 1.0
    #: A tick later than this many intervals after the last is a stall: no decision.
    stale_after: float = 3.0
    #: Dead band, as a share of capacity: smaller drops wait for the regular round.
    dead_band: float = 0.01
    #: ... and in cores: a 100 ms sample of an idle node wobbles by this much.
    noise_cores: float = 0.1
    #: BE using less than this (cores, over the last tick), and less than half its limit,
    #: has nothing to take back at once: the fast path ticks at ``idle_interval`` until
    #: it uses more.
    be_active_cores: float = 0.1
    #: Least time between two fast re-plans: one tick, so a re-plan made from a
    #: partial burst (the load began mid-tick) is completed at the next tick; a
    #: failing write is retried at most at the tick rate.
    min_gap: float = 0.1
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
        #: The BE pods used at least ``be_active_cores`` over the last measured tick (True
        #: until one is measured: a new fast path ticks at ``interval`` first).
        self._be_active = True
        #: Counter file by pod uid, or by tier key in tier mode.
        self._paths: dict[str, str] = {}
        self._last_trigger = -math.inf
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

    def _arm(self) -> None:
        if self._loop is not None:
            self._timer = self._loop.call_later(self.next_wait(), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        loop = self._loop
        if loop is None:  # run() has ended
            return
        try:
            inputs = self.sample()
            why = None if inputs is None else self.decide(inputs)
            if inputs is None or why is None:
                self._arm()
                return
        except Exception as exc:  # noqa: BLE001 - handed to run(), which raises it to its supervisor
            self._fail(exc)
            return
        self._replanning = loop.create_task(self._replan_then_arm(inputs, why), name="qos:fastpath-replan")

    async def _replan_then_arm(self, inputs: NodeInputs, why: str) -> None:
        try:
            await self._replan(inputs, why)
            self._arm()
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
        """One sample; True when it triggered a re-plan (``run`` does the same from its timer)."""
        inputs = self.sample()
        if inputs is None:
            return False
        why = self.decide(inputs)
        if why is None:
            return False
        await self._replan(inputs, why)
        return True

    async def _replan(self, inputs: NodeInputs, why: str) -> None:
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
        if tier:
            be_dir = self._manager.cfg.suppress.besteffort_dir
            self._paths = {_PODS: counter(str(be_dir.parent)), _BE: counter(str(be_dir))}
            self._be_keys = (_BE,)
        else:
            self._be_keys = tuple(p.uid for p in pods if is_be(p))
            # The list is rebuilt whenever any container comes or goes (e.g. the very LS
            # container whose burst we must see): pods that stay keep their baseline, so
            # only new pods lack a rate for one tick.
            self._paths = {p.uid: counter(p.cgroup_dir) for p in pods}
        self._files.retain([self._root, *self._paths.values()])

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
            return NodeInputs(self._wall(), manager.capacity, manager.cfg.reserved_cores, self._pods, node_used,
                              source="fastpath", tiers=TierUsage(rates[_PODS], rates[_BE]))
        live = tuple(p for p in self._pods if p.uid in tick.counters)  # vanished pods use no CPU
        missing = tuple(f"pod_cpu{{{p.key}}}" for p in live if p.uid not in rates)
        return NodeInputs(self._wall(), manager.capacity, manager.cfg.reserved_cores, live, node_used,
                          pod_cpu_used=rates, missing=missing, source="fastpath")

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
        # BE held near a small limit (suppressed to the floor, say) uses little because it
        # may not use more: it counts as busy from half its limit, so the fast path keeps
        # holding the loop's growth through LS bursts there (no flap).
        limit = self._be_limit()
        active = cores >= (self.cfg.be_active_cores if limit is None else min(self.cfg.be_active_cores, limit / 2))
        if active != self._be_active:
            log.debug("fastpath_cadence", be_active=active, be_cores=round(cores, 3), be_limit_cores=limit)
            self._be_active = active

    def _be_limit(self) -> float | None:
        """The BE CPU limit in force (cores), None when unknown."""
        state = self._manager.be_state
        if state is None:
            return None
        return state.limit_cores(self._rules().resource_used_threshold_with_be.cpu_suppress_policy,
                                 self._manager.capacity, self._manager.cfg.suppress.cfs_period_us)

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
        if threshold.cpu_suppress_policy == "cpuset":
            wanted, ls_value = float(math.ceil(value)), float(math.ceil(ls_value))
            target = max(wanted, float(MIN_CPUSET))
        else:
            wanted = value
            target = max(value * period, MIN_QUOTA) / period
        # The drop is judged on the headroom itself, not on the target floored at the
        # minimum: a limit already small (a busy node) within the band of the floor must
        # still go to the floor at once when LS takes everything, not a round later.
        band = max(capacity * self.cfg.dead_band, self.cfg.noise_cores)
        lower = wanted < current - band
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
        return None


