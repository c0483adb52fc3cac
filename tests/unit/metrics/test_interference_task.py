"""The interference task: store -> analyser -> explain, /metrics, verdict changes."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hooks.qos import QoSClass
from metrics import model
from metrics.analysis.interference import PodRef, Verdict
from metrics.analysis.interference_task import (
    InterferenceSettings,
    InterferenceTask,
    _verdict_event,
    parse_interference,
)
from metrics.model import ContainerView, PodView, Sample
from metrics.report.events import EventRecorder
from metrics.store.tsdb import TSDB
from runtimeproxy.hookapi import HookConfigError


def _view(uid: str, qos: QoSClass) -> PodView:
    return PodView(uid=uid, namespace="ns", name=f"pod-{uid}", sandbox_id=uid, qos=qos, priority=0,
                   priority_class="", cgroup_dir=f"kubepods/{uid}",
                   containers=(ContainerView(f"c-{uid}", "main", f"kubepods/{uid}/c"),))


PODS = [_view("ls", QoSClass.LS), _view("be", QoSClass.BE)]


def _tick(db: TSDB, t: float, p99: float, be_cpu: float) -> None:
    db.write([
        Sample(model.CONTAINER_SCHED_LATENCY_P99, p99, model.labels(pod_uid="ls", container_id="c-ls", source="ebpf"),
               t),
        Sample(model.POD_CPU_USAGE, be_cpu, model.labels(pod_uid="be"), t),
        Sample(model.POD_MEMORY_USED, 1e8, model.labels(pod_uid="be"), t),
    ])


@pytest.fixture
def db(tmp_path: Path) -> Iterator[TSDB]:
    store = TSDB(tmp_path / "metrics.db", clock=lambda: 0.0)
    yield store
    store.close()


def test_store_to_verdict_explain_metrics_and_events(db: TSDB) -> None:
    task = InterferenceTask(InterferenceSettings(min_baseline=5), db, lambda: PODS)
    changes: list[tuple[str, str, int]] = []

    def sink(pod: PodRef, verdict: Verdict) -> None:
        changes.append((pod.name, verdict.resource, int(verdict.level)))
        raise RuntimeError("API down")  # an event that fails is logged, never the analyser's failure

    task.set_event_sink(sink)
    t = 1000.0
    for i in range(30):
        _tick(db, t + i, 0.0004 + 0.00001 * (i % 3), 0.1)
        db.flush()
        task.step(PODS, t + i)
    assert task.verdicts["ls"]["cpu"].level == 0 and "be" not in task.verdicts
    for i in range(30, 40):
        _tick(db, t + i, 0.03, 3.0)
        task.step(PODS, t + i)
    assert changes == [("pod-ls", "cpu", 1), ("pod-ls", "cpu", 2)]
    explained = task.explain_uid("ls")
    cpu = explained["verdict"]["cpu"]
    assert cpu["level"] == "confirmed" and cpu["culprits"][0]["pod"] == "ns/pod-be"
    assert cpu["evidence"][0]["signal"] == "sched_latency_p99" and cpu["evidence"][0]["value"] == 0.03
    assert explained["signals"]["sched_latency_p99"]["baseline"] == pytest.approx(0.00041)
    assert explained["be_pods"] == [{"pod": "ns/pod-be", "cpu": 3.0, "memory": 1e8}]
    assert task.explain_uid("be")["verdict"] is None
    assert task.explain()["verdicts"] == {"ns/pod-ls": {"cpu": "confirmed"}}

    registry = CollectorRegistry()
    registry.register(task.gauges("node-1"))
    text = generate_latest(registry).decode()
    assert ('koordetector_interference{node="node-1",pod_name="pod-ls",pod_namespace="ns",pod_uid="ls",'
            'resource="cpu"} 2.0') in text
    assert 'resource="memory"} 0.0' in text
    assert 'koordetector_signal{container_id="c-ls",container_name="main",node="node-1",pod_name="pod-ls",' \
           'pod_namespace="ns",pod_uid="ls",signal="sched_latency_p99"} 0.03' in text
    assert "koordetector_analysis_seconds_total" in text


def test_per_container_signals_carry_the_seed_labels(db: TSDB) -> None:
    """Every koordetector series names node and pod; a per-container signal also names
    its (worst) container; pod-level signals and the verdict keep the pod labels only."""
    ls = PodView(uid="ls", namespace="ns", name="pod-ls", sandbox_id="ls", qos=QoSClass.LS, priority=0,
                 priority_class="", cgroup_dir="kubepods/ls",
                 containers=(ContainerView("c-app", "app", "kubepods/ls/a"),
                             ContainerView("c-side", "sidecar", "kubepods/ls/s")))
    pods = [ls, _view("be", QoSClass.BE)]
    task = InterferenceTask(InterferenceSettings(min_baseline=5), db, lambda: pods)
    psi = model.labels(pod_uid="ls", resource="cpu", kind="some", window="avg10")
    for i in range(3):
        t = 1000.0 + i
        db.write([
            Sample(model.CONTAINER_SCHED_LATENCY_P99, 0.0004, model.labels(pod_uid="ls", container_id="c-app",
                                                                             source="ebpf"), t),
            Sample(model.CONTAINER_SCHED_LATENCY_P99, 0.0009, model.labels(pod_uid="ls", container_id="c-side",
                                                                             source="ebpf"), t),
            Sample(model.POD_PSI, 3.0, psi, t),
        ])
        db.flush()
        task.step(pods, t)
    registry = CollectorRegistry()
    registry.register(task.gauges("node-1"))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    pod = {"node": "node-1", "pod_namespace": "ns", "pod_name": "pod-ls", "pod_uid": "ls"}
    for name in ("koordetector_signal", "koordetector_signal_baseline"):
        by_signal = {s.labels["signal"]: s.labels for s in families[name].samples}
        assert by_signal["sched_latency_p99"] == {**pod, "container_id": "c-side", "container_name": "sidecar",
                                                  "signal": "sched_latency_p99"}
        assert by_signal["cpu_psi"] == {**pod, "container_id": "", "container_name": "", "signal": "cpu_psi"}
    assert {s.labels["signal"]: s.value for s in families["koordetector_signal"].samples}["sched_latency_p99"] \
        == 0.0009
    assert [s.labels for s in families["koordetector_interference"].samples] == [
        {**pod, "resource": "cpu"}, {**pod, "resource": "memory"}]
    assert task.explain_uid("ls")["signals"]["sched_latency_p99"]["container_name"] == "sidecar"


@pytest.mark.parametrize(("raw", "key", "value"), [
    ({"interval": "soon"}, "tasks.interference.interval", "soon"),
    ({"mad_k": -1}, "tasks.interference.mad_k", "-1"),
    ({"min_baseline": 1.5}, "tasks.interference.min_baseline", "1.5"),
    ({"confirm_after": "1s"}, "tasks.interference.confirm_after", "1s"),
    ({"bogus": 1}, "tasks.interference.bogus", "1"),
])
def test_bad_settings_name_the_key_and_value(raw: dict[str, object], key: str, value: str) -> None:
    with pytest.raises(HookConfigError) as err:
        parse_interference(raw, "tasks.interference")
    assert key in str(err.value) and value in str(err.value)


def test_settings_parse_durations() -> None:
    s = parse_interference({"interval": "500ms", "confirm_after": "6s", "be_cpu_min": 1}, "t")
    assert (s.interval, s.confirm_after, s.be_cpu_min) == (0.5, 6.0, 1.0)


def test_a_confirmed_verdict_is_a_warning_event_on_the_victim_pod(db: TSDB) -> None:
    sent: list[Mapping[str, Any]] = []

    class Api:  # the recorder's sink: KubeClient.create_event's shape
        def create_event(self, event: Mapping[str, Any]) -> None:
            sent.append(event)

    recorder = EventRecorder(Api(), "node-1")
    task = InterferenceTask(InterferenceSettings(min_baseline=5), db, lambda: PODS)
    task.set_event_sink(functools.partial(_verdict_event, recorder))
    t = 1000.0
    for i in range(30):
        _tick(db, t + i, 0.0004 + 0.00001 * (i % 3), 0.1)
        db.flush()
        task.step(PODS, t + i)
    for i in range(30, 40):
        _tick(db, t + i, 0.03, 3.0)
        task.step(PODS, t + i)
    assert recorder.flush()
    recorder.close()
    # suspected is not an Event; confirmed is, once, naming the resource, evidence and culprit
    assert [e["reason"] for e in sent] == ["InterferenceDetected"]
    event = sent[0]
    assert event["type"] == "Warning"
    involved = event["involvedObject"]
    assert (involved["kind"], involved["name"], involved["namespace"], involved["uid"]) == ("Pod", "pod-ls", "ns", "ls")
    message = str(event["message"])
    assert message.startswith("cpu interference confirmed (sched_latency_p99 0.03") and "ns/pod-be" in message


def test_the_memlat_collectors_series_feed_the_memory_signals(db: TSDB) -> None:
    """memlat's stalled share (every tick, 0 when idle) and reclaim p99 (only with
    stalls) are the memory signals: a learnt quiet share, then stalls while a BE pod
    grows, confirm a memory verdict naming the container and the BE pod."""
    task = InterferenceTask(InterferenceSettings(min_baseline=5), db, lambda: PODS)
    stall = {"pod_uid": "ls", "container_id": "c-ls", "source": "ebpf"}
    for i in range(40):
        t = 1000.0 + i
        hot = i >= 25
        samples = [Sample(model.CONTAINER_MEMORY_ALLOC_STALL, 0.4 if hot else 0.0,
                          model.labels(**stall, kind=kind), t) for kind in ("reclaim", "compaction")]
        if hot:
            samples.append(Sample(model.CONTAINER_MEMORY_ALLOC_LATENCY_P99, 0.016,
                                  model.labels(**stall, kind="reclaim"), t))
        samples += [Sample(model.POD_CPU_USAGE, 0.1, model.labels(pod_uid="be"), t),
                    Sample(model.POD_MEMORY_USED, 1e8 + (i - 25) * 2e7 * hot, model.labels(pod_uid="be"), t)]
        db.write(samples)
        db.flush()
        task.step(PODS, t)
    memory = task.verdicts["ls"]["memory"]
    assert memory.level == 2 and memory.culprits[0].pod.name == "pod-be"
    # reclaim_latency has no quiet baseline yet: judged against its floor (1 ms), issue 28 item 11
    assert {e.signal for e in memory.evidence} == {"alloc_stall", "reclaim_latency"}
    signals = task.explain_uid("ls")["signals"]
    assert signals["alloc_stall"]["value"] == 0.4 and signals["alloc_stall"]["container_name"] == "main"
    assert signals["reclaim_latency"]["value"] == 0.016
