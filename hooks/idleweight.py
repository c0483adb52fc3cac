"""The CPU weight a cgroup had before ``cpu.idle`` was set, to put back when it is cleared.

Setting ``cpu.idle`` 1 makes the group SCHED_IDLE (weight 3); setting it back to 0 does
not restore the weight the group had: the kernel resets it to the default (cpu.shares
1024, cpu.weight 100). A BestEffort pod that kubelet gave cpu.shares 2 then competes
like a pod requesting a whole CPU. So whoever clears ``cpu.idle`` writes the weight it
replaced in the same step (issue 28 item 5). The weight is derived from the pod, so a
restart in between does not lose it:

* a pod with batch resources: batch-resource's value (its summed ``batch-cpu`` requests);
* a pod in kubelet's BestEffort tier: kubelet's pod weight, ``cpu.shares`` 2;
* otherwise the weight read just before this process set ``cpu.idle`` 1, if it did;
  else it is not known (the caller says so, and leaves the kernel's value).
"""

from __future__ import annotations

from hooks.annotations import BATCH_CPU, extended_resource_spec
from hooks.batchresource import milli_cpu_to_shares
from hooks.cgroups import MIN_SHARES
from hooks.qos import KubeQoS, kube_qos_from_cgroup_parent
from runtimeproxy.hookapi import PodInfo


def tier_weight(kube: KubeQoS | None) -> tuple[int, str] | None:
    """A kube-QoS tier's ``cpu.shares`` as kubelet sets it, when it does not depend on the
    pods: the BestEffort tier's 2 (the Burstable tier and the root follow the requests)."""
    if kube is KubeQoS.BESTEFFORT:
        return MIN_SHARES, "kubelet's BestEffort tier weight"
    return None


def derived_weight(pod: PodInfo) -> tuple[int, str] | None:
    """The pod cgroup's ``cpu.shares`` as its owners set it, and who that is; None when
    the pod does not say (HookError when its extended-resource annotation is malformed)."""
    spec = extended_resource_spec(pod)
    if spec is not None and any(BATCH_CPU in res.requests for res in spec.containers.values()):
        milli = sum(res.requests.get(BATCH_CPU, 0) for res in spec.containers.values())
        return milli_cpu_to_shares(milli), "batch-resource's weight (batch-cpu requests)"
    if kube_qos_from_cgroup_parent(pod.cgroup_parent) is KubeQoS.BESTEFFORT:
        return MIN_SHARES, "kubelet's BestEffort pod weight"
    return None
