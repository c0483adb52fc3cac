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

* **tier mode** — the aggregate line of ``/proc/stat`` and two cumulative
  counters, the kubepods tier and the besteffort tier (the kernel charges every
  descendant to them), so a tick costs three reads whatever the pod count. Used
  while the tiers tell BE from non-BE exactly: every pod lives under kubepods,
  and a pod is under besteffort exactly when it is BE.
* **pod mode** — otherwise (e.g. a pod labelled BE but placed in the burstable
  tier, or a pod outside kubepods): ``/proc/stat`` plus each pod's counter.

The mode is re-derived whenever the pod list changes and logged when it does.
Paths are computed once per pod list; no parsing beyond one int per file. The
reads stay on the event loop: they are memory-backed kernel files answering in
microseconds, less than a thread hop. A tick that comes too late (the loop
stalled) resets the baseline: deltas over an unknown span would be a guess, so
no decision is made from them.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Final

import structlog

from hooks.rules import Rules
from metrics.collect.base import ReadError
from metrics.collect.cgroupfs import CgroupReader, read_cpu_usage_ns
from metrics.collect.procfs import read_cpu_ticks
from metrics.model import PodView
from metrics.qos.inputs import NodeInputs, TierUsage
from metrics.qos.manager import QoSManager
from metrics.qos.suppress import MIN_CPUSET, MIN_QUOTA, is_be, suppress_cores

log = structlog.get_logger("metrics.qos.fastpath")

NS: Final = 1e9
#: Counter keys in tier mode (pod uids never look like this).
_PODS, _BE = "tier:kubepods", "tier:besteffort"


@dataclass(frozen=True, slots=True)
class FastPathConfig:
    #: Seconds between ticks: a burst that starts mid-tick is fully seen one tick
    #: later, so the reaction is about two ticks plus the write.
    interval: float = 0.1
    #: A tick later than this many intervals after the last is a stall: no decision.
    stale_after: float = 3.0
    #: Dead band, as a share of capacity: smaller drops wait for the regular round.
    dead_band: float = 0.01
    #: Least time between two fast re-plans: one tick, so a re-plan made from a
    #: partial burst (the load began mid-tick) is completed at the next tick; a
    #: failing write is retried at most at the tick rate.
    min_gap: float = 0.1


@dataclass(frozen=True, slots=True)
class _Tick:
    ts: float
    used: int
    total: int
    pods: Mapping[str, int]


class FastPath:
    def __init__(
        self,
        manager: QoSManager,
        *,
        proc_root: Path,
        cgroups: CgroupReader,
        rules: Callable[[], Rules],
        config: FastPathConfig = FastPathConfig(),
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = config
        self._manager = manager
        self._proc = proc_root
        self._cgroups = cgroups
        self._rules = rules
        self._clock = clock
        self._wall = wall
        self._ncpus = len(manager.suppress.topology) or 1
        self._prev: _Tick | None = None
        self._pods: tuple[PodView, ...] = ()
        self._paths: dict[str, Path] = {}
        self._last_trigger = -math.inf
        self._wake = asyncio.Event()
        self._warned: set[str] = set()
        self.triggers = 0
        #: "tier" or "pods" (see the module doc); "" before the first tick.
        self.mode = ""

    def wake(self) -> None:
        """Sample now (a PSI trigger fired)."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.cfg.interval)
            except TimeoutError:
                pass
            self._wake.clear()
            await self.tick()

    async def tick(self) -> bool:
        """One sample; True when it triggered a re-plan."""
        inputs = self.sample()
        if inputs is None:
            return False
        why = self.decide(inputs)
        if why is None:
            return False
        self._last_trigger = self._clock()
        self.triggers += 1
        await self._manager.replan_suppress(inputs, why)
        return True

    # --- sampling -----------------------------------------------------------------------

    def _refresh_paths(self) -> None:
        pods = self._manager.pods
        if pods is self._pods:
            return
        self._pods = pods
        tier, reason = self._tier_mode(pods)
        mode = "tier" if tier else "pods"
        if mode != self.mode:
            log.info("fastpath_mode", mode=mode, reason=reason, pods=len(pods))
            self.mode = mode
        if tier:
            be_dir = self._manager.cfg.suppress.besteffort_dir
            self._paths = {_PODS: self._cgroups.cpuacct_dir(str(be_dir.parent)),
                           _BE: self._cgroups.cpuacct_dir(str(be_dir))}
            return
        # The list is rebuilt whenever any container comes or goes (e.g. the very LS
        # container whose burst we must see): pods that stay keep their baseline, so
        # only new pods lack a rate for one tick.
        self._paths = {p.uid: self._cgroups.cpuacct_dir(p.cgroup_dir) for p in pods}

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
        try:
            used, total = read_cpu_ticks(self._proc)
        except ReadError as exc:
            self._warn("proc_stat", "fastpath_sample_failed", str(exc))
            return None
        counters: dict[str, int] = {}
        for key, path in self._paths.items():
            try:
                counters[key] = read_cpu_usage_ns(path, self._cgroups.version)
            except ReadError as exc:
                # A vanished pod simply drops out; a tier must be there, and anything
                # else is unknown.
                if not exc.gone or self.mode == "tier":
                    self._warn(key, "fastpath_sample_failed", str(exc))
                    return None
        return _Tick(self._clock(), used, total, counters)

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
        dt, d_total = tick.ts - prev.ts, tick.total - prev.total
        if dt <= 0 or dt > self.cfg.stale_after * self.cfg.interval or d_total <= 0 or tick.used < prev.used:
            return None
        rates: dict[str, float] = {}
        for key, ns in tick.pods.items():
            before = prev.pods.get(key)
            if before is None or ns < before:
                continue  # new or reset counter: no rate this tick
            rates[key] = (ns - before) / NS / dt
        node_used = (tick.used - prev.used) / d_total * self._ncpus
        base = NodeInputs(now=self._wall(), capacity_cores=self._manager.capacity,
                          reserved_cores=self._manager.cfg.reserved_cores, pods=self._pods,
                          node_cpu_used=node_used, source="fastpath")
        if _PODS in tick.pods:
            if _PODS not in rates or _BE not in rates:
                return None
            return replace(base, tiers=TierUsage(rates[_PODS], rates[_BE]))
        live = tuple(p for p in self._pods if p.uid in tick.pods)  # vanished pods use no CPU
        missing = tuple(f"pod_cpu{{{p.key}}}" for p in live if p.uid not in rates)
        return replace(base, pods=live, pod_cpu_used=rates, missing=missing)

    # --- deciding -----------------------------------------------------------------------

    def decide(self, inputs: NodeInputs) -> str | None:
        """Why to re-plan now, or None (disabled, unknown state, within the dead band)."""
        threshold = self._rules().resource_used_threshold_with_be
        state = self._manager.be_state
        if not threshold.enable or state is None or inputs.missing:
            return None
        if self._clock() - self._last_trigger < self.cfg.min_gap:
            return None
        capacity, period = inputs.capacity_cores, self._manager.cfg.suppress.cfs_period_us
        current = state.limit_cores(threshold.cpu_suppress_policy, capacity, period)
        if current is None:
            return None
        value = suppress_cores(inputs, threshold).suppress
        if threshold.cpu_suppress_policy == "cpuset":
            target = float(max(math.ceil(value), MIN_CPUSET))
        else:
            target = max(value * period, MIN_QUOTA) / period
        if target < current - capacity * self.cfg.dead_band:
            return f"headroom dropped: BE target {target:.2f} < limit {current:.2f} cores"
        return None
