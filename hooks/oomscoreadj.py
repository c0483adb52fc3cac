"""OOM score: which processes the kernel's OOM killer picks first, per container.

Why: under memory pressure the OOM killer ranks processes by usage plus
``/proc/<pid>/oom_score_adj`` (-1000 .. 1000; -1000 = never). kubelet sets one
value per Kubernetes QoS class; an operator who needs another order for some
containers (a cache that should go first, a sidecar that should go last) sets it
per pod with koordlet's ``OOMScoreAdj`` annotations, kept here with their names
and semantics (koordlet ``runtimehooks/hooks/oomscoreadj``):

* ``koordinator.sh/oom-score-adj-spec``: a JSON object ``{"<container name>": int}``;
  a container named there gets its value;
* else ``koordinator.sh/oom-score-adj``: one integer for every container of the pod;
* neither (or an empty value): the hook does nothing for that container.

Every process of the container (``cgroup.procs`` of its cgroup) gets the value in
``/proc/<pid>/oom_score_adj`` under the injected proc root; only a process whose
value differs is written and reported. Stages: ``PostStartContainer`` (at once)
and ``ReconcileContainer`` (as koordlet's reconciler: a process forked later, a
value changed by hand or a changed annotation is set right at the next pass).
The sandbox (pause) container is never touched: the runtime manages its value
(-998), as koordlet notes. Turning the annotation off leaves the values as they
are (koordlet does the same: kubelet's original value is not known).

Bad input is an error naming the annotation and the value (malformed JSON, a
non-integer, a value outside [-1000, 1000]), and nothing is written for that
container; koordlet only logs at verbosity 4 and skips. A repeat of the same
error at later passes is marked ``repeat`` (logged below warning).

args: ``cgroup_driver`` (cgroupfs | systemd), ``cgroup_version`` (auto | 1 | 2),
``dry_run`` (bool, default false: write nothing; each planned write reported once per
planned value, ``(dry-run, not written)`` in ``explain`` and one ``hook_dry_run`` log
line, as every hook's dry-run, ``hooks.dryrun``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Hashable, Mapping
from typing import Any, Final

import structlog

from hooks.cgroups import CgroupError
from hooks.dryrun import DryRunLedger, dry_run_arg, patch_reason
from hooks.hookargs import cgroup_layout
from hooks.proctasks import ProcessGoneError, ProcFile, container_procs
from hooks.qos import pod_name
from runtimeproxy.config.configvalues import reject_unknown
from runtimeproxy.errors import InputError
from runtimeproxy.hookapi import ContainerContext, ContainerPatch, HookError, HookInit, HostWrite, LivePods
from runtimeproxy.ops.repeats import RepeatFilter

OOM_SCORE_ADJ_SPEC: Final = "koordinator.sh/oom-score-adj-spec"
OOM_SCORE_ADJ: Final = "koordinator.sh/oom-score-adj"
OOM_SCORE_ADJ_MIN: Final = -1000
OOM_SCORE_ADJ_MAX: Final = 1000
_ARGS: Final = frozenset({"cgroup_driver", "cgroup_version", "dry_run"})
_INT: Final = re.compile(r"[+-]?[0-9]{1,19}")  # Go's strconv.ParseInt(s, 10, 64) syntax
_SHOWN: Final = 200
_PER_PROCESS: Final = 4  # more changed processes than this are reported as one entry

log = structlog.get_logger("hooks.oomscoreadj")


class OOMAnnotationError(InputError, ValueError):
    """An oom-score-adj annotation is malformed: names the annotation and the value."""

    def __init__(self, key: str, raw: str, reason: str) -> None:
        shown = raw if len(raw) <= _SHOWN else raw[:_SHOWN] + "..."
        super().__init__(f"annotation {key}={shown!r}: {reason}")
        self.key = key
        self.raw = raw


def _check_range(value: int, key: str, raw: str) -> int:
    if not OOM_SCORE_ADJ_MIN <= value <= OOM_SCORE_ADJ_MAX:
        raise OOMAnnotationError(key, raw, f"{value} is outside [{OOM_SCORE_ADJ_MIN}, {OOM_SCORE_ADJ_MAX}]")
    return value


def container_oom_score_adj(annotations: Mapping[str, str], container: str) -> tuple[int, str] | None:
    """The container's oom_score_adj and the annotation that set it; None when neither
    annotation applies. The per-container spec wins; a spec that does not name the
    container falls back to the pod-wide value (koordlet ``getOOMScoreAdjForContainer``).
    Raises ``OOMAnnotationError``."""
    spec = annotations.get(OOM_SCORE_ADJ_SPEC, "")
    if spec:
        try:
            data = json.loads(spec)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise OOMAnnotationError(OOM_SCORE_ADJ_SPEC, spec, f"invalid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise OOMAnnotationError(OOM_SCORE_ADJ_SPEC, spec,
                                     f"expected a JSON object {{\"<container>\": int}}, got {type(data).__name__}")
        for name, value in data.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise OOMAnnotationError(OOM_SCORE_ADJ_SPEC, spec, f"container {name!r}: {value!r} is not an integer")
            _check_range(value, OOM_SCORE_ADJ_SPEC, spec)
        if container in data:
            return int(data[container]), OOM_SCORE_ADJ_SPEC
    raw = annotations.get(OOM_SCORE_ADJ, "")
    if raw:
        if not _INT.fullmatch(raw):
            raise OOMAnnotationError(OOM_SCORE_ADJ, raw, "not an integer")
        return _check_range(int(raw), OOM_SCORE_ADJ, raw), OOM_SCORE_ADJ
    return None


def _summarised(writes: list[HostWrite], pids: list[int]) -> list[HostWrite]:
    """Up to ``_PER_PROCESS`` writes one by one; more as one entry, so a container of
    many processes does not push every other change out of the pod's explain history."""
    if len(writes) <= _PER_PROCESS:
        return writes
    first = writes[0]
    shown = ",".join(w.target.rsplit("/", 2)[-2] for w in writes[:_PER_PROCESS])
    target = first.target.rsplit("/", 2)[0] + f"/{{{shown},...}}/oom_score_adj"
    olds = ",".join(sorted({w.old for w in writes}))
    return [HostWrite(target, olds, first.new, f"{first.reason}: {len(writes)} of {len(pids)} process(es)")]


class OOMScoreAdj:
    """Stages: PostStartContainer, ReconcileContainer."""

    def __init__(self, init: HookInit) -> None:
        args: dict[str, Any] = dict(init.args)
        reject_unknown(args, _ARGS, f"{init.key_path}.")
        self.dry_run = dry_run_arg(init, args)
        self.layout = cgroup_layout(init, args)
        self.proc = ProcFile(init.host.proc, "oom_score_adj")
        self._ledger = DryRunLedger("oom-score-adj")
        #: Per container: the bad annotation or refused write last logged (each logged once, not every pass).
        self._bad = RepeatFilter()
        self._refused = RepeatFilter()

    def _decide(self, ctx: ContainerContext) -> tuple[int, str] | None:
        key = (ctx.pod.meta.uid, ctx.container.id)
        try:
            decided = container_oom_score_adj(ctx.pod.annotations, ctx.container.meta.name)
        except OOMAnnotationError as exc:
            err = HookError(f"pod {pod_name(ctx.pod)} container {ctx.container.meta.name}: {exc}; nothing written")
            err.repeat = not self._bad.failed(key, exc.raw).log
            raise err from exc
        self._bad.cleared(key)
        return decided

    def sweep_orphans(self, live: LivePods) -> list[str]:
        """The bad annotations remembered for containers of pods that no longer exist."""
        def live_pod(key: Hashable) -> bool:
            return isinstance(key, tuple) and key[0] in live.uids

        self._refused.forget(live_pod)
        return [f"oom-score-adj: bad annotation of pod {key[0]} container {key[1]} forgotten (pod no longer exists)"
                for key in self._bad.forget(live_pod) if isinstance(key, tuple)]

    def _apply(self, ctx: ContainerContext) -> ContainerPatch | None:
        decided = self._decide(ctx)
        if decided is None:
            return None
        value, key = decided
        pod, container = ctx.pod, ctx.container
        try:
            pids = container_procs(self.layout, pod, container.id)
        except CgroupError as exc:
            raise HookError(f"pod {pod_name(pod)} container {container.meta.name}: {exc}") from exc
        if not pids:
            return None  # no cgroup (not running) or no process: nothing to set
        reason = f"annotation {key}: oom_score_adj {value} for container {container.meta.name}"
        writes: list[HostWrite] = []
        failed: list[str] = []
        plans: list[HostWrite] = []
        for pid in pids:
            target = str(self.proc.path(pid))
            try:
                old = self.proc.read(pid)
                if old.lstrip("+-").isdigit() and int(old) == value:
                    continue
                if self.dry_run:
                    plans.append(HostWrite(target, old, str(value), reason))
                    continue
                self.proc.write(pid, str(value))
            except ProcessGoneError:
                continue  # exited since the listing
            except HookError as exc:
                failed.append(f"pid {pid}: {exc}")
                continue
            writes.append(HostWrite(target, old, str(value), reason))
        if plans:
            writes = list(self._ledger.report(plans, pod=pod_name(pod), container=container.meta.name))
        changed = len(writes)
        writes = _summarised(writes, pids)
        obj = (pod.meta.uid, container.id)
        if failed:
            # Once per container and cause (the error without its pid), not at every pass.
            verdict = self._refused.failed(obj, f"{value} {failed[0].partition(': ')[2]}")
            emit = log.warning if verdict.log else log.debug
            emit("oom_score_adj_failed", pod=pod_name(pod), container=container.meta.name, value=value,
                 failed=len(failed), of=len(pids), first=failed[0], repeats=verdict.repeats)
            if not writes:
                err = HookError(f"pod {pod_name(pod)} container {container.meta.name}: oom_score_adj {value}: "
                                f"{len(failed)} of {len(pids)} process(es) refused, first: {failed[0]}")
                err.repeat = not verdict.log
                raise err
        elif (repeats := self._refused.cleared(obj)) is not None:
            log.info("oom_score_adj_recovered", pod=pod_name(pod), container=container.meta.name, value=value,
                     repeats=repeats)
        if not writes:
            return None
        if self.dry_run:
            return ContainerPatch(reason=patch_reason(reason), writes=tuple(writes))
        log.info("oom_score_adj_set", pod=pod_name(pod), container=container.meta.name, value=value, annotation=key,
                 processes=changed)
        return ContainerPatch(reason=reason, writes=tuple(writes))

    def post_start_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        if ctx.result is not None and not ctx.result.ok:
            return None
        return self._apply(ctx)

    def reconcile_container(self, ctx: ContainerContext) -> ContainerPatch | None:
        """Processes whose value differs (new ones, hand-changed ones) get it again."""
        return self._apply(ctx)


__all__ = ["OOM_SCORE_ADJ", "OOM_SCORE_ADJ_SPEC", "OOMAnnotationError", "OOMScoreAdj", "container_oom_score_adj"]
