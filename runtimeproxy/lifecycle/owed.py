"""Post stages after a stop or a removal, level-triggered: derived from containerd's state.

Stop and removal calls need not pass through Python (with HAProxy in front they go
straight to containerd), and objects stop or go without any call at all (a container's
process exits, an operator removes a pod, anything while the proxy is down). So what
follows them is computed from state after every re-sync with containerd (and at start,
after the store's rebuild), against the ledger of what the store knew
(``runtimeproxy.state.ledger``, kept across restarts):

* a container containerd lists EXITED, or a sandbox it lists NOTREADY, owes its
  PostStopContainer / PostStopPodSandbox stage;
* an object containerd no longer lists owes its PostStop stage (if not done) and then
  its PostRemove stage (PostRemoveContainer / PostRemovePodSandbox).

Each is claimed in the ledger, queued on the pod's Post queue (containers before their
pod, in that order: the stages of one pod run one after another) and marked done once it
ran: exactly once per object and transition, across restarts. A burst (thousands owed
at a start) is handed to the hooks a few at a time (``Lifecycle.run_owed``), so no hook's
budget runs out while it waits its turn. A hook that failed or timed out is owed again
at the next re-sync, that hook alone (``ObjectLedger.ran``), up to ``ATTEMPTS`` runs. When a Stop/Remove call
does reach Python (the ``grpc`` data plane, or a chain with a Pre hook for it), the
call's own Post stage claims the same transition, so the re-sync does not run it again
(and a call arriving after the re-sync ran it does not run it twice).

An object the store wrote after the re-sync's List calls began is judged at the next
re-sync, not by a List that predates it. The owed stages get ``CallResult(ok=True)``:
containerd's state says the transition happened.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import structlog

from criapi import cri_v1_pb2 as cri
from runtimeproxy.hookapi import CallResult, ContainerContext, ContainerInfo, Context, PodContext, PodInfo, Stage
from runtimeproxy.lifecycle.handler import Lifecycle
from runtimeproxy.state.ledger import Entry, ObjectLedger, Transition
from runtimeproxy.state.store import ResyncResult, Store

log = structlog.get_logger("runtimeproxy.owed")

_STAGES: Final[Mapping[tuple[str, Transition], Stage]] = {
    ("pod", "stop"): Stage.POST_STOP_POD_SANDBOX,
    ("pod", "remove"): Stage.POST_REMOVE_POD_SANDBOX,
    ("container", "stop"): Stage.POST_STOP_CONTAINER,
    ("container", "remove"): Stage.POST_REMOVE_CONTAINER,
}
_STOPPED: Final[Mapping[str, int]] = {"pod": cri.SANDBOX_NOTREADY, "container": cri.CONTAINER_EXITED}


@dataclass(frozen=True, slots=True)
class Owed:
    object_id: str
    transition: Transition
    context: Context
    #: Only these hooks (they failed or timed out last time); None: the stage's all.
    hooks: frozenset[str] | None = None


def transitions(entry: Entry, listed: Mapping[str, int], object_id: str) -> tuple[Transition, ...]:
    """What containerd's listing says happened to a known object."""
    state = listed.get(object_id)
    if state is None:
        return ("stop", "remove")
    return ("stop",) if state == _STOPPED[entry.kind] else ()


def compute(ledger: ObjectLedger, store: Store, result: ResyncResult) -> list[Owed]:
    """The Post stages owed now (not done, not queued), containers before pods."""
    containers: list[Owed] = []
    pods: list[Owed] = []
    for object_id, entry in ledger.entries():
        last = store.last_write(object_id)
        if last > result.mark and last not in result.own_writes:
            continue  # the proxy wrote it after the List began: the next re-sync judges it
        listed = result.pod_states if entry.kind == "pod" else result.container_states
        for transition in transitions(entry, listed, object_id):
            if not ledger.owes(object_id, transition):
                continue
            ctx = _context(ledger, store, entry, transition)
            if ctx is None:
                log.warning("owed_post_stage_without_pod", object_id=object_id, pod_id=entry.pod_id,
                            stage=_STAGES[entry.kind, transition].value, effect="not run; marked done")
                ledger.done(object_id, transition)
                continue
            owed = Owed(object_id, transition, ctx, ledger.retry_hooks(object_id, transition))
            (pods if entry.kind == "pod" else containers).append(owed)
    return containers + pods


def _context(ledger: ObjectLedger, store: Store, entry: Entry, transition: Transition) -> Context | None:
    stage = _STAGES[entry.kind, transition]
    ok = CallResult(True)
    if isinstance(entry.info, PodInfo):
        return PodContext(stage, entry.info, ok)
    pod_entry = ledger.get(entry.pod_id)
    pod = pod_entry.info if pod_entry is not None else store.pod(entry.pod_id)
    if not isinstance(pod, PodInfo) or not isinstance(entry.info, ContainerInfo):
        return None
    return ContainerContext(stage, pod, entry.info, ok)


def settle(ledger: ObjectLedger, store: Store, lifecycle: Lifecycle, result: ResyncResult) -> int:
    """Queue every owed Post stage (each claimed, marked done once it ran); returns how many."""
    owed = compute(ledger, store, result)
    for item in owed:
        if ledger.claim(item.object_id, item.transition):
            lifecycle.run_owed(item.context, _marker(ledger, item), hooks=item.hooks)
    if owed:
        stages = collections.Counter(o.context.stage.value for o in owed)
        log.info("owed_post_stages", queued=len(owed), stages=dict(stages))
    return len(owed)


def _marker(ledger: ObjectLedger, item: Owed) -> collections.abc.Callable[[frozenset[str]], None]:
    return lambda failed: ledger.ran(item.object_id, item.transition, failed)
