"""Pod requests and creation time from kubelet's /pods (the Prod reclaimable estimate's inputs)."""

from __future__ import annotations

from metrics.informer.states import _pod_of


def test_requests_as_the_scheduler_counts_them() -> None:
    item = {
        "metadata": {"uid": "u1", "name": "web", "namespace": "ns", "creationTimestamp": "2026-11-24T10:00:00Z"},
        "spec": {
            "containers": [{"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}},
                           {"resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "4"}}}, {"name": "bare"}],
            "initContainers": [{"resources": {"requests": {"cpu": "2", "memory": "256Mi"}}}],
            "overhead": {"cpu": "100m", "memory": "64Mi"},
        },
        "status": {"phase": "Running"},
    }
    pod = _pod_of(item)
    assert pod is not None
    # containers 1.5 cores / 1 GiB; the init container's 2 cores win; plus overhead
    assert pod.cpu_request == 2.1
    assert pod.memory_request == 2**30 + 64 * 2**20
    assert pod.created == 1_795_514_400.0  # 2026-11-24T10:00:00Z


def test_bad_or_missing_values_count_zero() -> None:
    item = {"metadata": {"uid": "u2", "creationTimestamp": "yesterday"},
            "spec": {"containers": [{"resources": {"requests": {"cpu": "lots", "memory": ["x"]}}}], "overhead": 3}}
    pod = _pod_of(item)
    assert pod is not None and (pod.cpu_request, pod.memory_request, pod.created) == (0.0, 0.0, None)
