"""Kubernetes Events (issue 16 §4) through the real KubeClient to ``tests.kubeapi``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from typing import Any

import pytest

from hooks.qos import QoSClass
from metrics.informer.kubeclient import KubeClient
from metrics.model import PodView
from metrics.qos.evict import EvictionError
from metrics.qos.evictevents import RecordingEvictor
from metrics.qos.task import _write_failed_event
from metrics.report.events import WARNING, EventRecorder
from tests.kubeapi import KubeApiServer

NODE = "node-a"
POD = PodView(uid="uid-1", namespace="shop", name="batch", sandbox_id="sb", qos=QoSClass.BE, priority=0,
              priority_class="koord-batch", cgroup_dir="kubepods/besteffort/poduid-1")


class Clock:
    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def __call__(self) -> float:
        return self.t


def recorder(sink: Any, clock: Clock, **kw: Any) -> EventRecorder:
    return EventRecorder(sink, NODE, clock=clock, monotonic=clock, **kw)


def test_pod_and_node_events_reach_the_api_server(api: KubeApiServer, kube: KubeClient) -> None:
    clock = Clock()
    events = recorder(kube, clock)
    assert events.record(events.pod("shop", "batch", "uid-1"), WARNING, "evictPodSuccess", "evict Pod:batch")
    assert events.record(events.node(), WARNING, "NodeSLORejected", "x" * 5000)
    assert events.flush()
    events.close()
    pod_event, node_event = sorted(api.objects("events"), key=lambda e: e["involvedObject"]["kind"], reverse=True)
    assert pod_event["metadata"]["namespace"] == "shop"
    assert pod_event["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "name": "batch", "namespace": "shop",
                                           "uid": "uid-1"}
    assert (pod_event["reason"], pod_event["type"], pod_event["count"]) == ("evictPodSuccess", "Warning", 1)
    assert pod_event["source"] == {"component": "koordlet", "host": NODE}
    assert pod_event["firstTimestamp"] == pod_event["lastTimestamp"] == "2023-11-14T22:13:20Z"
    assert node_event["metadata"]["namespace"] == "default"
    assert node_event["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE}
    assert len(node_event["message"]) == 1024
    assert events.explain() == {"enabled": True, "sent": 2, "suppressed": 0, "dropped": 0, "failed": 0,
                                "window_seconds": 600.0}


def test_duplicates_within_the_window_are_counted_into_the_next_event(api: KubeApiServer, kube: KubeClient) -> None:
    clock = Clock()
    events = recorder(kube, clock, window=600)
    ref = events.node()
    assert events.record(ref, WARNING, "QoSWriteFailed", "cannot write")
    clock.t += 10
    assert not events.record(ref, WARNING, "QoSWriteFailed", "cannot write")
    clock.t += 10
    assert not events.record(ref, WARNING, "QoSWriteFailed", "cannot write")
    assert events.record(ref, WARNING, "QoSWriteFailed", "another message")  # a different event
    clock.t += 600
    assert events.record(ref, WARNING, "QoSWriteFailed", "cannot write")
    assert events.flush()
    events.close()
    same = [e for e in api.objects("events") if e["message"] == "cannot write"]
    assert sorted((e["count"], e["firstTimestamp"], e["lastTimestamp"]) for e in same) == [
        (1, "2023-11-14T22:13:20Z", "2023-11-14T22:13:20Z"),
        (3, "2023-11-14T22:13:30Z", "2023-11-14T22:23:40Z"),  # itself + the 2 suppressed, from the first of them
    ]
    assert events.suppressed == 2 and events.sent == 3


def test_rate_limited_and_no_op_without_a_cluster(api: KubeApiServer, kube: KubeClient) -> None:
    clock = Clock()
    events = recorder(kube, clock, qps=0.1, burst=2)
    results = [events.record(events.node(), WARNING, "R", f"m{i}") for i in range(5)]
    clock.t += 10  # one token back
    results.append(events.record(events.node(), WARNING, "R", "m5"))
    assert results == [True, True, False, False, False, True]
    assert events.flush()
    events.close()
    assert sorted(e["message"] for e in api.objects("events")) == ["m0", "m1", "m5"]
    assert events.dropped == 3
    offline = recorder(None, clock)
    assert not offline.record(offline.node(), WARNING, "R", "m") and offline.explain()["sent"] == 0


class FailingSink:
    def __init__(self) -> None:
        self.calls = 0
        self.called = threading.Event()

    def create_event(self, event: Mapping[str, Any]) -> None:
        self.calls += 1
        self.called.set()
        raise OSError("connection refused")


def test_a_failing_api_is_counted_not_raised() -> None:
    sink = FailingSink()
    events = recorder(sink, Clock())
    assert events.record(events.node(), WARNING, "R", "m")
    assert events.flush()
    events.close()
    assert (sink.calls, events.failed, events.sent) == (1, 1, 0)


class Inner:
    def __init__(self, error: str = "") -> None:
        self.error = error
        self.evicted: list[str] = []

    async def evict(self, pod: PodView, reason: str) -> None:
        if self.error:
            raise EvictionError(self.error)
        self.evicted.append(pod.uid)


@pytest.mark.asyncio
async def test_evictions_become_pod_events(api: KubeApiServer, kube: KubeClient) -> None:
    events = recorder(kube, Clock())
    await RecordingEvictor(Inner(), events).evict(POD, "BE memory usage 91% > 80%")
    with pytest.raises(EvictionError):
        await RecordingEvictor(Inner("refused by a disruption budget"), events).evict(POD, "BE CPU starved")
    await asyncio.to_thread(events.flush)
    events.close()
    got = sorted((e["reason"], e["message"], e["involvedObject"]["uid"]) for e in api.objects("events"))
    assert got == [
        ("evictPodFail", "evict Pod:batch, reason: BE CPU starved, failed: refused by a disruption budget", "uid-1"),
        ("evictPodSuccess", "evict Pod:batch, reason: BE memory usage 91% > 80%", "uid-1"),
    ]


def test_a_qos_write_that_cannot_be_applied_is_a_node_event(api: KubeApiServer, kube: KubeClient) -> None:
    events = recorder(kube, Clock())
    _write_failed_event(events, "cpu_suppress", "kubepods/besteffort/cpu.cfs_quota_us",
                        "CgroupError: Invalid argument")
    assert events.flush()
    events.close()
    [event] = api.objects("events")
    assert (event["involvedObject"]["kind"], event["reason"]) == ("Node", "QoSWriteFailed")
    assert event["message"] == "cpu_suppress: cannot write kubepods/besteffort/cpu.cfs_quota_us: " \
                               "CgroupError: Invalid argument"
