"""The interference analyser's decisions on synthetic signal histories."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from hooks.qos import QoSClass
from metrics import model
from metrics.analysis.interference import (
    CPU,
    MEMORY,
    Baseline,
    BEUsage,
    InterferenceAnalyser,
    Level,
    Observation,
    PodRef,
    Verdict,
)
from metrics.analysis.interference_signals import SignalReader
from metrics.model import ContainerView, PodView, Sample
from metrics.store.tsdb import TSDB

LS = PodRef("ls-uid", "default", "web", QoSClass.LS)
BE1 = PodRef("be1-uid", "batch", "hog-1", QoSClass.BE)
BE2 = PodRef("be2-uid", "batch", "hog-2", QoSClass.BE)
MiB = 2**20


def obs(now: float, signals: Mapping[str, float], be: tuple[BEUsage, ...] = (), **kw: object) -> Observation:
    return Observation(now, (LS, BE1, BE2), {LS.uid: dict(signals)}, be=be, **kw)  # type: ignore[arg-type]


def quiet_be(_t: float) -> tuple[BEUsage, ...]:
    return (BEUsage(BE1, 0.05, 2000 * MiB), BEUsage(BE2, 0.02, 50 * MiB))


def busy_be(_t: float) -> tuple[BEUsage, ...]:
    return (BEUsage(BE1, 1.5, 2000 * MiB), BEUsage(BE2, 3.0, 50 * MiB))


def run(analyser: InterferenceAnalyser, start: float, seconds: int, signals: Callable[[float], Mapping[str, float]],
        be: Callable[[float], tuple[BEUsage, ...]] = quiet_be) -> list[dict[str, Verdict]]:
    out = []
    for i in range(seconds):
        t = start + i
        out.append(analyser.step(obs(t, signals(t), be(t)))[LS.uid])
    return out


def levels(history: list[dict[str, Verdict]], resource: str = CPU) -> list[Level]:
    return [v[resource].level for v in history]


def noisy(rng: random.Random, base: float = 0.0005, jitter: float = 0.0002) -> Callable[[float], dict[str, float]]:
    """Schedule-latency p99 and CPU PSI with noise and rare outliers, never interference."""
    def signals(_t: float) -> dict[str, float]:
        p99 = max(0.0, rng.gauss(base, jitter))
        if rng.random() < 0.02:  # a lone outlier every ~50 s
            p99 += 0.01
        return {"sched_latency_p99": p99, "cpu_psi": max(0.0, rng.gauss(2.0, 1.0)),
                "cpu_throttled": 0.0, "memory_psi": max(0.0, rng.gauss(0.5, 0.3))}
    return signals


@pytest.fixture
def learnt() -> InterferenceAnalyser:
    """An analyser that has seen 2 quiet minutes of the LS pod."""
    analyser = InterferenceAnalyser()
    run(analyser, 0.0, 120, noisy(random.Random(1)))
    return analyser


def test_noisy_history_with_busy_be_pods_gives_no_verdict() -> None:
    """Ten minutes of noise, lone outliers, and BE pods burning CPU the LS pod does not
    feel: never a verdict on any step."""
    analyser = InterferenceAnalyser()
    history = run(analyser, 0.0, 600, noisy(random.Random(7)), busy_be)
    assert set(levels(history)) == {Level.NONE}
    assert set(levels(history, MEMORY)) == {Level.NONE}


def test_sustained_cpu_interference_is_suspected_then_confirmed_with_ranked_culprits(
        learnt: InterferenceAnalyser) -> None:
    history = run(learnt, 120.0, 8, lambda t: {"sched_latency_p99": 0.02, "cpu_psi": 40.0}, busy_be)
    assert levels(history) == [Level.NONE, Level.NONE, Level.SUSPECTED, Level.SUSPECTED,
                               Level.CONFIRMED, Level.CONFIRMED, Level.CONFIRMED, Level.CONFIRMED]
    verdict = history[-1][CPU]
    assert verdict.since == 120.0
    assert [c.pod.name for c in verdict.culprits] == ["hog-2", "hog-1"]  # by CPU usage
    signals = {e.signal: e for e in verdict.evidence}
    assert set(signals) == {"sched_latency_p99", "cpu_psi"}
    p99 = signals["sched_latency_p99"]
    assert 0.0003 < p99.baseline < 0.0007  # the quiet median it learnt
    assert p99.value == 0.02 and p99.ratio > 5
    assert history[-1][MEMORY].level is Level.NONE


def test_a_spike_shorter_than_the_minimum_duration_is_no_verdict(learnt: InterferenceAnalyser) -> None:
    base = noisy(random.Random(3))

    def spiky(t: float) -> dict[str, float]:
        return {**base(t), "sched_latency_p99": 0.05} if t in (130.0, 150.0, 151.0, 152.0) else base(t)

    history = run(learnt, 120.0, 60, spiky, busy_be)
    assert Level.CONFIRMED not in levels(history)
    # one step: nothing; three steps: suspected at most (never confirmed).
    assert levels(history)[10] is Level.NONE
    assert Level.SUSPECTED in levels(history)[30:33]


def test_without_be_activity_interference_stays_suspected(learnt: InterferenceAnalyser) -> None:
    history = run(learnt, 120.0, 20, lambda t: {"sched_latency_p99": 0.02}, quiet_be)
    assert levels(history)[-1] is Level.SUSPECTED
    assert Level.CONFIRMED not in levels(history)
    assert "no BE activity" in history[-1][CPU].reason


def test_hysteresis_on_the_way_back(learnt: InterferenceAnalyser) -> None:
    run(learnt, 120.0, 6, lambda t: {"sched_latency_p99": 0.02}, busy_be)
    median, enter, leave = learnt.thresholds(LS.uid, "sched_latency_p99")
    assert median < leave < enter
    between = (leave + enter) / 2
    # Between the exit and the entry threshold: still confirmed, however long.
    history = run(learnt, 126.0, 30, lambda t: {"sched_latency_p99": between}, busy_be)
    assert set(levels(history)) == {Level.CONFIRMED}
    # Quiet again: confirmed until clear_after (10 s) has passed, then none.
    history = run(learnt, 156.0, 12, lambda t: {"sched_latency_p99": median}, busy_be)
    assert levels(history)[:9] == [Level.CONFIRMED] * 9
    assert "cleared" in history[9][CPU].reason
    assert set(levels(history)[9:]) == {Level.NONE}


def test_the_baseline_is_the_pods_own(learnt: InterferenceAnalyser) -> None:
    """A pod whose latency is normally 8 ms is not interfered at 12 ms; one at 0.5 ms is."""
    slow = InterferenceAnalyser()
    rng = random.Random(5)
    run(slow, 0.0, 120, lambda t: {"sched_latency_p99": rng.gauss(0.008, 0.0005)})
    assert set(levels(run(slow, 120.0, 20, lambda t: {"sched_latency_p99": 0.012}, busy_be))) == {Level.NONE}
    assert levels(run(learnt, 120.0, 20, lambda t: {"sched_latency_p99": 0.012}, busy_be))[-1] is Level.CONFIRMED


def test_a_slow_signal_read_every_step_counts_once(learnt: InterferenceAnalyser) -> None:
    """PSI collected every 10 s is read at every 1 s step: one sample, no verdict, until
    a second anomalous sample arrives."""
    history = []
    for i in range(10):
        t = 120.0 + i
        stamps = {LS.uid: {"cpu_psi": 119.5}}
        history.append(learnt.step(obs(t, {"cpu_psi": 60.0}, busy_be(t), stamps=stamps))[LS.uid])
    assert set(levels(history)) == {Level.NONE}
    step = learnt.step(obs(130.0, {"cpu_psi": 60.0}, busy_be(130.0), stamps={LS.uid: {"cpu_psi": 129.5}}))
    assert step[LS.uid][CPU].level is Level.CONFIRMED


def test_memory_interference_names_the_growing_be_pod(learnt: InterferenceAnalyser) -> None:
    def growing(t: float) -> tuple[BEUsage, ...]:
        return (BEUsage(BE1, 0.1, 2000 * MiB), BEUsage(BE2, 0.1, (100 + 50 * (t - 120)) * MiB))

    history = run(learnt, 120.0, 8, lambda t: {"memory_psi": 30.0, "sched_latency_p99": 0.0005}, growing)
    assert levels(history, MEMORY)[-1] is Level.CONFIRMED
    assert history[-1][MEMORY].culprits[0].pod.name == "hog-2"  # grew, though hog-1 uses more
    assert levels(history)[-1] is Level.NONE


def test_memory_signal_without_be_growth_or_node_pressure_is_not_confirmed(learnt: InterferenceAnalyser) -> None:
    history = run(learnt, 120.0, 10, lambda t: {"memory_psi": 30.0}, quiet_be)
    assert levels(history, MEMORY)[-1] is Level.SUSPECTED
    high = obs(130.0, {"memory_psi": 30.0}, (BEUsage(BE1, 0.1, 1024 * MiB),), node_memory_used=95.0,
               node_memory_total=100.0)
    assert learnt.step(high)[LS.uid][MEMORY].level is Level.CONFIRMED


def test_pods_gone_are_forgotten_and_be_pods_are_not_judged(learnt: InterferenceAnalyser) -> None:
    out = learnt.step(Observation(200.0, (BE1,), {}, be=(BEUsage(BE1, 1.0, 1.0),)))
    assert out == {}
    fresh = learnt.step(obs(201.0, {"sched_latency_p99": 0.05}, busy_be(201.0)))
    # A new baseline: warming up, judged against the floor (2 ms); BE activity explains
    # the value, so it is not learnt. One step is no verdict yet.
    assert fresh[LS.uid][CPU].level is Level.NONE
    assert [e.threshold for e in fresh[LS.uid][CPU].evidence] == [0.002]
    assert "learning baselines (judged against their floors): sched_latency_p99 0/20" in fresh[LS.uid][CPU].reason
    assert learnt.thresholds(LS.uid, "sched_latency_p99")[0] == 0.0


# --- reading the store -------------------------------------------------------------------

def _view(uid: str, qos: QoSClass, quota: int = 200_000) -> PodView:
    return PodView(uid=uid, namespace="ns", name=uid, sandbox_id=uid, qos=qos, priority=0, priority_class="",
                   cgroup_dir=f"kubepods/{uid}",
                   containers=(ContainerView(f"c-{uid}", "main", f"kubepods/{uid}/c", cpu_quota=quota),))


def test_signal_reader_reads_pod_container_and_node_series(tmp_path: Path) -> None:
    now = 1000.0
    db = TSDB(tmp_path / "metrics.db", clock=lambda: now)
    psi = {model.KIND: "some", model.WINDOW: "avg10"}
    db.write([
        Sample(model.CONTAINER_SCHED_LATENCY_P99, 0.004,
               model.labels(pod_uid="ls", container_id="c-ls", source="ebpf"), now - 1),
        Sample(model.CONTAINER_SCHED_LATENCY, 0.001, model.labels(pod_uid="ls", container_id="c-ls", source="ebpf"),
               now - 1),
        Sample(model.POD_PSI, 12.0, model.labels(pod_uid="ls", resource="cpu", **psi), now - 2),
        Sample(model.NODE_PSI, 3.0, model.labels(resource="memory", **psi), now - 2),
        Sample(model.POD_CPU_THROTTLED, 0.25, model.labels(pod_uid="ls"), now - 1),
        Sample(model.POD_CPU_USAGE, 2.5, model.labels(pod_uid="be"), now - 1),
        Sample(model.POD_MEMORY_USED, 3e8, model.labels(pod_uid="be"), now - 1),
        Sample(model.POD_CPU_USAGE, 9.0, model.labels(pod_uid="old"), now - 100),  # stale
    ])
    db.flush()
    reader = SignalReader(db)
    seen = reader.observe([_view("ls", QoSClass.LS), _view("be", QoSClass.BE), _view("old", QoSClass.BE)], now)
    assert seen.signals["ls"] == {"sched_latency_p99": 0.004, "cpu_psi": 12.0, "memory_psi": 3.0,
                                  "cpu_throttled": 0.25}
    assert seen.sources["ls"]["memory_psi"] == "node" and seen.sources["ls"]["cpu_psi"] == "pod"
    assert seen.stamps["ls"]["cpu_psi"] == now - 2
    assert [(b.pod.uid, b.cpu, b.memory) for b in seen.be] == [("be", 2.5, 3e8), ("old", None, None)]
    unlimited = reader.observe([_view("ls", QoSClass.LS, quota=0)], now)
    assert "cpu_throttled" not in unlimited.signals["ls"]  # no CPU limit: never throttled, not read
    db.close()


def test_signal_reader_reads_the_stores_latest_view_not_queries(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step reads the newest samples from the store's in-memory view: no ``last``
    query per series (what made a 1 s analyser at 110 pods cost 0.46 % of a core)."""
    db = TSDB(tmp_path / "metrics.db", clock=lambda: 0.0)
    lbls = model.labels(pod_uid="ls", resource="cpu", kind="some", window="avg10")

    def query(*_: object) -> None:
        raise AssertionError("a store query per series and step")

    monkeypatch.setattr(db, "last", query)
    reader = SignalReader(db, max_age=5.0)
    pods = [_view("ls", QoSClass.LS, quota=0)]
    for t in range(1000, 1012):
        if t < 1006:
            db.write([Sample(model.POD_PSI, float(t), lbls, float(t))])
        seen = reader.observe(pods, float(t) + 0.5)
        if t < 1006:  # the newest sample at every step, flushed or not
            assert seen.signals["ls"]["cpu_psi"] == float(t) and seen.stamps["ls"]["cpu_psi"] == float(t)
        elif t - 1005 <= 4:
            assert seen.signals["ls"]["cpu_psi"] == 1005.0
        else:  # older than max_age: not a current signal
            assert "cpu_psi" not in seen.signals["ls"]
    assert reader.reads == 0
    db.close()


def test_signal_reader_without_the_view_queries_last(tmp_path: Path) -> None:
    db = TSDB(tmp_path / "metrics.db", clock=lambda: 0.0)

    class Plain:  # a MetricReader without the latest-value view
        def last(self, metric: str, labels: model.Labels, max_age: float, now: float) -> Sample | None:
            return db.last(metric, labels, max_age, now)

        def aggregate_all(self, metric: str, start: float, end: float) -> object:
            return db.aggregate_all(metric, start, end)

    lbls = model.labels(pod_uid="ls", resource="cpu", kind="some", window="avg10")
    db.write([Sample(model.POD_PSI, 7.0, lbls, 1000.0)])
    reader = SignalReader(Plain())  # type: ignore[arg-type]
    assert reader.observe([_view("ls", QoSClass.LS, quota=0)], 1000.5).signals["ls"]["cpu_psi"] == 7.0
    assert reader.reads > 0
    db.close()


class _Counted:
    """Counts a store method's calls (and refuses ``refuse``'s)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, db: TSDB, *names: str, refuse: str = "") -> None:
        self.calls = dict.fromkeys(names, 0)
        for name in names:
            monkeypatch.setattr(db, name, self._wrap(name, getattr(db, name)))
        if refuse:
            def refused(*_: object) -> None:
                raise AssertionError(f"{refuse} per series")

            monkeypatch.setattr(db, refuse, refused)

    def _wrap(self, name: str, method: Callable[..., object]) -> Callable[..., object]:
        def counted(*args: object) -> object:
            self.calls[name] += 1
            return method(*args)

        return counted


def test_signal_reader_reads_a_step_in_one_batched_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: a step reads every series from the store's latest-value view in one
    ``newest_many`` call (one lock), never series by series, with the semantics of the
    reads one by one: the newest sample, flushed or not; one stamped after ``now`` (collected
    while the step started) is the newest; one older than ``max_age`` is no signal; a
    series the store forgot at GC is none (the node's PSI stands in for the pod's)."""
    from metrics.store.tsdb import LATEST_KEEP

    now = 1000.0
    db = TSDB(tmp_path / "metrics.db", clock=lambda: now)
    psi = {model.KIND: "some", model.WINDOW: "avg10"}
    ebpf = model.labels(pod_uid="ls", container_id="c-ls", source="ebpf")
    db.write([Sample(model.POD_PSI, 50.0, model.labels(pod_uid="gone", resource="cpu", **psi), now - LATEST_KEEP - 5)])
    db.flush()
    db.gc(now=now)  # "gone"'s PSI leaves the view (the file keeps it)
    db.write([
        Sample(model.CONTAINER_SCHED_LATENCY_P99, 0.004, ebpf, now - 1),
        Sample(model.CONTAINER_SCHED_LATENCY, 0.001, ebpf, now - 1),
        Sample(model.POD_PSI, 12.0, model.labels(pod_uid="ls", resource="cpu", **psi), now + 0.5),  # future
        Sample(model.POD_PSI, 9.0, model.labels(pod_uid="ls", resource="memory", **psi), now - 30),  # expired
        Sample(model.NODE_PSI, 3.0, model.labels(resource="memory", **psi), now - 2),
        Sample(model.NODE_PSI, 4.0, model.labels(resource="cpu", **psi), now - 2),
        Sample(model.POD_CPU_THROTTLED, 0.25, model.labels(pod_uid="ls"), now - 1),
        Sample(model.POD_CPU_USAGE, 2.5, model.labels(pod_uid="be"), now - 1),
        Sample(model.NODE_MEMORY_TOTAL, 8e9, model.NO_LABELS, now - 1),
    ])
    counted = _Counted(monkeypatch, db, "newest_many", "series_handle", refuse="newest")
    reader = SignalReader(db, max_age=25.0)
    pods = [_view("ls", QoSClass.LS), _view("gone", QoSClass.LS, quota=0), _view("be", QoSClass.BE),
            _view("sys", QoSClass.SYSTEM)]
    seen = reader.observe(pods, now)
    assert counted.calls["newest_many"] == 1
    assert seen.signals == {"ls": {"sched_latency_p99": 0.004, "cpu_psi": 12.0, "memory_psi": 3.0,
                                   "cpu_throttled": 0.25},
                            "gone": {"cpu_psi": 4.0, "memory_psi": 3.0}}
    assert seen.stamps["ls"]["cpu_psi"] == now + 0.5 and seen.sources["ls"]["memory_psi"] == "node"
    assert seen.sources["gone"] == {"cpu_psi": "node", "memory_psi": "node"}
    assert seen.containers == {"ls": {"sched_latency_p99": ("c-ls", "main")}}
    assert [(b.pod.uid, b.cpu, b.memory) for b in seen.be] == [("be", 2.5, None)]
    assert [r.uid for r in seen.pods] == ["ls", "gone", "be", "sys"]
    assert (seen.node_memory_used, seen.node_memory_total) == (None, 8e9)
    assert reader.observe(pods, now + 25).signals["ls"] == {"cpu_psi": 12.0}, "the rest older than max_age"
    assert counted.calls["newest_many"] == 2 and reader.reads == 0
    db.close()


def test_signal_reader_plans_a_step_once_per_pod_list_and_index(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """What a step reads (handles, refs, container names, CPU limits) is built once per
    pod list and index: the same views, or views rebuilt alike, make no handle again; a
    changed pod, a new pod and a new container series (at the next index) are seen."""
    now = 1000.0
    db = TSDB(tmp_path / "metrics.db", clock=lambda: now)
    lbl = model.labels(pod_uid="ls")
    counted = _Counted(monkeypatch, db, "series_handle")
    reader = SignalReader(db, max_age=25.0, index_every=10.0)
    pods = [_view("ls", QoSClass.LS), _view("be", QoSClass.BE)]
    for t in range(5):
        db.write([Sample(model.POD_CPU_THROTTLED, 0.5, lbl, now + t)])
        assert reader.observe(pods, now + t).signals["ls"] == {"cpu_throttled": 0.5}
    made = counted.calls["series_handle"]
    assert made > 0
    reader.observe([_view("ls", QoSClass.LS), _view("be", QoSClass.BE)], now + 5)  # rebuilt alike
    assert counted.calls["series_handle"] == made
    unlimited = reader.observe([_view("ls", QoSClass.LS, quota=0), _view("be", QoSClass.BE)], now + 6)
    assert unlimited.signals["ls"] == {}, "no CPU limit any more: throttling not read"
    grown = reader.observe([*pods, _view("ls2", QoSClass.LSR)], now + 7)
    assert set(grown.signals) == {"ls", "ls2"} and counted.calls["series_handle"] > made
    db.write([Sample(model.CONTAINER_CPI, 1.5, model.labels(pod_uid="ls", container_id="c-ls"), now + 8)])
    assert "cpi" not in reader.observe(pods, now + 8).signals["ls"], "not indexed yet"
    assert reader.observe(pods, now + 10).signals["ls"] == {"cpi": 1.5, "cpu_throttled": 0.5}
    assert reader.observe(pods, now + 10).containers["ls"] == {"cpi": ("c-ls", "main")}
    db.close()


def test_signal_reader_without_the_view_reads_only_what_a_step_uses(tmp_path: Path) -> None:
    """Without the view each value is a ``last`` query, made only for what the step looks
    at: the schedstat mean of a pod with an eBPF p99 is not read; one without a p99 is."""
    now = 1000.0
    db = TSDB(tmp_path / "metrics.db", clock=lambda: now)
    asked: list[tuple[str, str]] = []

    class Plain:  # a MetricReader without the latest-value view
        def last(self, metric: str, labels: model.Labels, max_age: float, at: float) -> Sample | None:
            asked.append((metric, next((v for k, v in labels if k == model.POD_UID), "")))
            return db.last(metric, labels, max_age, at)

        def aggregate_all(self, metric: str, start: float, end: float) -> object:
            return db.aggregate_all(metric, start, end)

    db.write([
        Sample(model.CONTAINER_SCHED_LATENCY_P99, 0.004, model.labels(pod_uid="a", container_id="c-a"), now - 1),
        Sample(model.CONTAINER_SCHED_LATENCY, 0.001, model.labels(pod_uid="a", container_id="c-a"), now - 1),
        Sample(model.CONTAINER_SCHED_LATENCY, 0.002, model.labels(pod_uid="b", container_id="c-b"), now - 1),
    ])
    db.flush()
    reader = SignalReader(Plain())  # type: ignore[arg-type]
    seen = reader.observe([_view("a", QoSClass.LS, quota=0), _view("b", QoSClass.LS, quota=0)], now)
    assert seen.signals == {"a": {"sched_latency_p99": 0.004}, "b": {"sched_latency_mean": 0.002}}
    assert (model.CONTAINER_SCHED_LATENCY, "a") not in asked and (model.CONTAINER_SCHED_LATENCY, "b") in asked
    assert reader.reads == len(asked) == 10  # 2 node PSI, 2 node memory, a's p99, b's mean, 2 x 2 pod PSI
    db.close()

def test_a_new_pod_is_judged_against_the_floors_while_its_baseline_is_learnt() -> None:
    """Issue 28 item 11: PSI every 10 s and min_baseline 20 left a new LS pod unjudged for
    ~200 s; an LS pod alone 60 s, then BE hogs, gets a verdict from the floor (cpu PSI 10)
    within the run lengths, not after 20 samples. Its own quiet samples are learnt; the
    antagonist's are not."""
    analyser = InterferenceAnalyser()
    level, t = Level.NONE, 0

    def stamps(t: int) -> dict[str, dict[str, float]]:
        return {LS.uid: {"cpu_psi": float(t - t % 10)}}

    for t in range(0, 60):  # alone: PSI 2 % (one sample per 10 s)
        analyser.step(obs(float(t), {"cpu_psi": 2.0}, (), stamps=stamps(t)))
    for t in range(60, 150):  # 4 BE hogs: PSI 25.6 % (the figure)
        out = analyser.step(obs(float(t), {"cpu_psi": 25.6}, busy_be(float(t)), stamps=stamps(t)))
        level = out[LS.uid][CPU].level
        if level is Level.CONFIRMED:
            break
    assert level is Level.CONFIRMED and t - 60 <= 20, t
    assert analyser._pods[LS.uid].baselines["cpu_psi"].values() == [2.0] * 6


def test_signal_reader_finds_container_series_in_the_stores_memory(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Which container series exist is looked up in the store's record of what it was
    written (``series_since``), not with a window query of every sample in the file
    (~10 ms every ``index_every`` at 110 pods); the observation is the one a reader
    without that record gets from the file, and a series silent since before the index
    window is not a signal."""
    now = 1000.0
    db = TSDB(tmp_path / "metrics.db", clock=lambda: now)
    ebpf = model.labels(pod_uid="ls", container_id="c-ls", source="ebpf")
    db.write([Sample(model.CONTAINER_SCHED_LATENCY_P99, 0.004, ebpf, now - 1),
              Sample(model.CONTAINER_SCHED_LATENCY_P99, 0.009, model.labels(pod_uid="ls", container_id="gone",
                                                                             source="ebpf"), now - 60),
              Sample(model.CONTAINER_MEMORY_ALLOC_STALL, 0.5, model.labels(pod_uid="ls", container_id="c-ls",
                                                                            kind="direct_reclaim"), now - 1)])
    db.flush()

    class Plain:  # a MetricReader without the latest-value view: the file
        def last(self, metric: str, labels: model.Labels, max_age: float, at: float) -> Sample | None:
            return db.last(metric, labels, max_age, at)

        def aggregate_all(self, metric: str, start: float, end: float) -> object:
            return db.aggregate_all(metric, start, end)

    pods = [_view("ls", QoSClass.LS, quota=0)]
    from_file = SignalReader(Plain(), max_age=60.0).observe(pods, now)  # type: ignore[arg-type]

    def query(*_: object) -> None:
        raise AssertionError("a window query of the file")

    monkeypatch.setattr(db, "aggregate_all", query)
    seen = SignalReader(db, max_age=20.0, index_every=10.0).observe(pods, now)
    assert seen.signals["ls"] == {"sched_latency_p99": 0.004, "alloc_stall": 0.5}
    assert seen.containers["ls"]["sched_latency_p99"] == ("c-ls", "main")
    assert from_file.signals["ls"]["sched_latency_p99"] == 0.009, "the file's window has the stale series"
    assert SignalReader(db, max_age=60.0).observe(pods, now).signals["ls"] == from_file.signals["ls"]
    db.close()


def test_a_baseline_keeps_its_newest_values_and_their_statistics() -> None:
    """The ring of doubles holds the newest ``size`` values, oldest first, and its
    median and MAD are those of exactly those values."""
    rng = random.Random(7)
    values = [rng.random() for _ in range(1000)]
    base = Baseline(600)
    for k, v in enumerate(values, start=1):
        base.add(v)
        if k in (1, 599, 600, 601, 1000):
            kept = values[max(0, k - 600):k]
            assert len(base) == len(kept) and base.values() == kept
    kept = sorted(values[-600:])
    median = kept[300]
    assert base.stats(600) == (median, statistics.median(abs(v - median) for v in kept))
    assert Baseline(10).stats(1) == (0.0, 0.0)
