"""The peak predictor (koordlet's model) on synthetic histories whose answers are computed
here by hand from the bucket formula, trained from a real store; checkpoints."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from hooks.qos import QoSClass
from metrics.analysis.histogram import BucketOptions, DecayingHistogram
from metrics.analysis.prediction import (
    ALL_PODS,
    CPU_HALF_LIFE,
    NODE,
    SYSTEM,
    Model,
    PeakPredictor,
    PodDemand,
    PredictionSettings,
    class_key,
    pod_key,
    prod_reclaimable,
)
from metrics.model import NODE_CPU_USAGE, NODE_MEMORY_USED, POD_CPU_USAGE, POD_MEMORY_USED, POD_UID, PodView, Sample
from metrics.model import labels as lbl
from metrics.store.tsdb import TSDB

T0 = 1_700_000_000.0
MIB = 2**20
GIB = 2**30
HOUR = 3600.0
DAY = 24 * HOUR


# Bucket i of the CPU histogram starts at 0.025 * (1.05**i - 1) / 0.05 = 0.5 * (1.05**i - 1) cores,
# of the memory one at 5 MiB * (1.05**i - 1) / 0.05 = 100 MiB * (1.05**i - 1). A percentile is the
# END of the bucket holding it.
def cpu_end(cores: float) -> float:
    return 0.5 * (1.05 ** (math.floor(math.log(cores / 0.5 + 1, 1.05)) + 1) - 1)


def mem_end(nbytes: float) -> float:
    return 100 * MIB * (1.05 ** (math.floor(math.log(nbytes / (100 * MIB) + 1, 1.05)) + 1) - 1)


def test_bucket_ends_by_hand() -> None:
    # 2 cores: log(2 / 0.5 + 1) / log(1.05) = log(5) / log(1.05) = 32.99 -> bucket 32, ends at 0.5 * (1.05**33 - 1).
    assert cpu_end(2.0) == pytest.approx(0.5 * (1.05**33 - 1))
    assert cpu_end(2.0) == pytest.approx(2.0016, abs=1e-4)


def pod(uid: str, pclass: str = "koord-prod") -> PodView:
    return PodView(uid=uid, namespace="ns", name=uid, sandbox_id="sb-" + uid, qos=QoSClass.LS, priority=9500,
                   priority_class=pclass, cgroup_dir=f"kubepods/pod{uid}")


WEB, BATCH = pod("web"), pod("batch", "koord-batch")


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TSDB]:
    # Every sample raw for the test's span: the predictor reads the last minute's mean.
    clock = Clock()
    db = TSDB(tmp_path / "m.db", retention=3 * DAY, raw_retention=3 * DAY, clock=clock)
    db.test_clock = clock  # type: ignore[attr-defined]
    yield db
    db.close()


def minute(db: TSDB, end: float, node: tuple[float, float], pods: dict[str, tuple[float, float]]) -> None:
    """One minute of 1 s samples ending at ``end`` (constant within the minute)."""
    samples: list[Sample] = []
    for k in range(60):
        ts = end - 59.5 + k
        samples += [Sample(NODE_CPU_USAGE, node[0], (), ts), Sample(NODE_MEMORY_USED, node[1], (), ts)]
        for uid, (cpu, memory) in pods.items():
            samples += [Sample(POD_CPU_USAGE, cpu, lbl(**{POD_UID: uid}), ts),
                        Sample(POD_MEMORY_USED, memory, lbl(**{POD_UID: uid}), ts)]
    db.test_clock.now = end  # type: ignore[attr-defined]
    db.write(samples, end)
    db.flush()


def test_constant_load_trained_from_the_store(store: TSDB) -> None:
    predictor = PeakPredictor(PredictionSettings(), None)
    for i in range(1, 31):
        now = T0 + 60 * i
        minute(store, now, (3.0, 6 * GIB), {"web": (2.0, 1 * GIB), "batch": (0.5, 2 * GIB)})
        predictor.train(store, [WEB, BATCH], now)
    web = predictor.prediction(pod_key("web"))
    assert web is not None
    for name in ("p60", "p90", "p95", "p98", "max"):
        assert web[name] == pytest.approx((cpu_end(2.0), mem_end(1 * GIB)))
    # sums: all pods 2.5 cores / 3 GiB; system = node - pods = 0.5 cores / 3 GiB; classes by their pods.
    assert predictor.prediction(ALL_PODS)["p95"] == pytest.approx((cpu_end(2.5), mem_end(3 * GIB)))  # type: ignore[index]
    assert predictor.prediction(SYSTEM)["p95"] == pytest.approx((cpu_end(0.5), mem_end(3 * GIB)))  # type: ignore[index]
    assert predictor.prediction(NODE)["p98"] == pytest.approx((cpu_end(3.0), mem_end(6 * GIB)))  # type: ignore[index]
    assert predictor.prediction(class_key("koord-batch"))["p95"] == pytest.approx(  # type: ignore[index]
        (cpu_end(0.5), mem_end(2 * GIB)))
    assert predictor.prediction(class_key("koord-prod"))["p95"] == pytest.approx(  # type: ignore[index]
        (cpu_end(2.0), mem_end(1 * GIB)))


def test_a_step_moves_p95_before_p90(store: TSDB) -> None:
    """94 minutes at 1 core then 6 at 3 cores. With a 12 h half-life a sample at minute i weighs
    2**(60 i / 43200): the last 6 minutes carry 6.3 % of the weight (computed below), so p90
    (93.7 % below the step) stays in the 1-core bucket and p95 reaches the 3-core one."""
    predictor = PeakPredictor(PredictionSettings(), None)
    for i in range(1, 101):
        now = T0 + 60 * i
        minute(store, now, (4.0, 4 * GIB), {"web": (1.0 if i <= 94 else 3.0, 1 * GIB)})
        predictor.train(store, [WEB], now)
    weights = [2 ** (60 * i / CPU_HALF_LIFE) for i in range(100)]
    share = sum(weights[94:]) / sum(weights)
    assert 0.05 < share < 0.10
    web = predictor.prediction(pod_key("web"))
    assert web is not None
    assert web["p60"][0] == pytest.approx(cpu_end(1.0))
    assert web["p90"][0] == pytest.approx(cpu_end(1.0))
    assert web["p95"][0] == pytest.approx(cpu_end(3.0))
    assert web["max"][0] == pytest.approx(cpu_end(3.0))


def test_daily_wave() -> None:
    """Two days of 1 core with a 4-core peak from 10:00 to 14:00, one sample a minute. A
    sample at hour t weighs 2**(t / 12) (half-life 12 h), so each day's peak carries
    (2**(14/12) - 2**(10/12)) / (2**(24/12) - 1) = 15.4 % of that day's weight (both days
    alike: the ratio does not depend on the day). So p60 and p80 are the 1-core bucket's end,
    p90, p95 and max the 4-core bucket's: the prediction holds the daily peak through the
    20 quiet hours."""
    share = (2 ** (14 / 12) - 2 ** (10 / 12)) / (2 ** (24 / 12) - 1)
    assert share == pytest.approx(0.1544, abs=1e-4)
    model = Model.new(T0)
    for k in range(2 * 24 * 60):
        hour = (k / 60) % 24
        model.add(4.0 if 10 <= hour < 14 else 1.0, 1 * GIB, T0 + 60 * k)
    got = model.percentiles()
    assert got["p60"][0] == pytest.approx(cpu_end(1.0))
    assert got["p90"][0] == pytest.approx(cpu_end(4.0))
    assert got["p95"][0] == pytest.approx(cpu_end(4.0))
    assert got["max"][0] == pytest.approx(cpu_end(4.0))
    assert model.cpu.percentile(0.80) == pytest.approx(cpu_end(1.0))
    assert model.cpu.percentile(0.86) == pytest.approx(cpu_end(4.0))


def test_vanished_pods_are_dropped(store: TSDB) -> None:
    predictor = PeakPredictor(PredictionSettings(model_ttl=1800), None)
    for i in range(1, 41):
        now = T0 + 60 * i
        pods = {"web": (1.0, GIB)} if i <= 5 else {}
        minute(store, now, (2.0, 2 * GIB), {**pods, "batch": (0.5, GIB)})
        predictor.train(store, [WEB, BATCH] if i <= 5 else [BATCH], now)
        if i == 35:  # 30 min after its last update: still there
            assert predictor.model(pod_key("web")) is not None
    assert predictor.model(pod_key("web")) is None
    assert predictor.model(pod_key("batch")) is not None


def _trained(store: TSDB, settings: PredictionSettings, minutes: int = 30) -> PeakPredictor:
    predictor = PeakPredictor(settings, settings_path(settings))
    for i in range(1, minutes + 1):
        now = T0 + 60 * i
        minute(store, now, (3.0, 6 * GIB), {"web": (2.0, 1 * GIB), "batch": (0.5, 2 * GIB)})
        predictor.train(store, [WEB, BATCH], now)
    return predictor


def settings_path(settings: PredictionSettings) -> Path | None:
    return Path(settings.checkpoint) if settings.checkpoint else None


def test_checkpoint_round_trip(store: TSDB, tmp_path: Path) -> None:
    settings = PredictionSettings(checkpoint=str(tmp_path / "state" / "prediction.json"))
    before = _trained(store, settings)
    before.save(T0 + 1800)
    assert not (tmp_path / "state" / "prediction.json.tmp").exists()  # renamed into place
    after = PeakPredictor(settings, settings_path(settings))
    assert after.restore(T0 + 1800) == len(before.models)
    for key in before.models:
        assert after.prediction(key) == before.prediction(key)
        assert after.model(key).first_seen == before.model(key).first_seen  # type: ignore[union-attr]
    # restored models keep learning where they stopped
    minute(store, T0 + 1860, (3.0, 6 * GIB), {"web": (2.0, 1 * GIB)})
    after.train(store, [WEB], T0 + 1860)
    assert after.prediction(pod_key("web")) == before.prediction(pod_key("web"))


@pytest.mark.parametrize("content", [b"{not json", b'{"version": 1, "models": {"node": {"cpu": 3}}}',
                                     b'{"version": 99, "models": {}}', b"\xff\xfe"])
def test_corrupt_checkpoint_is_one_error_and_a_cold_start(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "prediction.json"
    path.write_bytes(content)
    predictor = PeakPredictor(PredictionSettings(), path)
    with structlog.testing.capture_logs() as logs:
        assert predictor.restore(T0) == 0
    assert [e["event"] for e in logs] == ["prediction_checkpoint_unreadable"]
    assert logs[0]["log_level"] == "error" and logs[0]["path"] == str(path)
    assert predictor.models == {}


def test_restore_drops_models_past_their_ttl(store: TSDB, tmp_path: Path) -> None:
    settings = PredictionSettings(checkpoint=str(tmp_path / "p.json"))
    _trained(store, settings).save(T0 + 1800)
    after = PeakPredictor(settings, settings_path(settings))
    assert after.restore(T0 + 1800 + 1801) == 0  # down for longer than the TTL: nothing is current


# --- Prod reclaimable ----------------------------------------------------------------
def _model(cpu: float, memory: float, first_seen: float) -> Model:
    model = Model.new(first_seen)
    for k in range(10):
        model.add(cpu, memory, first_seen + 60 * k)
    return model


def test_prod_reclaimable_by_hand_with_a_young_pod_in_cold_start() -> None:
    now = T0 + 3 * DAY
    models = {
        SYSTEM: _model(0.5, 1 * GIB, T0),
        pod_key("old"): _model(1.0, 2 * GIB, T0),
        pod_key("young"): _model(0.2, 256 * MIB, now - HOUR),
        class_key("koord-prod"): _model(1.2, 2 * GIB + 256 * MIB, T0),
        pod_key("be"): _model(3.0, 4 * GIB, T0),
    }
    pods = [
        PodDemand("old", "koord-prod", 4.0, 8 * GIB, created=T0),
        PodDemand("young", "koord-prod", 1.0, 1 * GIB, created=now - HOUR),  # cold: 1 h < 24 h
        PodDemand("be", "koord-batch", 2.0, 4 * GIB, created=T0),  # not Prod: ignored
    ]
    capacity = (8.0, 32 * GIB)

    def predict(key: str) -> dict[str, tuple[float, float]] | None:
        return models[key].percentiles() if key in models else None

    result = prod_reclaimable(predict, lambda k: models[k].first_seen if k in models else None, pods, capacity, now,
                              PredictionSettings())
    assert result is not None
    m = 1.1
    old_peak = (cpu_end(1.0) * m, mem_end(2 * GIB) * m)
    # pod predictor: only "old" is predicted; "young" adds its request to unpredicted.
    by_pod = (min(8 - old_peak[0], 4 - old_peak[0]), min(32 * GIB - old_peak[1], 8 * GIB - old_peak[1]))
    # priority predictor: (sys + prod class) x 1.1 against the Prod requests (both pods: 5 cores, 9 GiB).
    unrec = ((cpu_end(0.5) + cpu_end(1.2)) * m, (mem_end(1 * GIB) + mem_end(2 * GIB + 256 * MIB)) * m)
    by_priority = (min(8 - unrec[0], 5 - unrec[0]), min(32 * GIB - unrec[1], 9 * GIB - unrec[1]))
    assert result.by_predictor["podReclaimablePredictor"] == pytest.approx(by_pod)
    assert result.by_predictor["priorityReclaimablePredictor"] == pytest.approx(by_priority)
    assert result.reclaimable == pytest.approx((min(by_pod[0], by_priority[0]), min(by_pod[1], by_priority[1])))
    assert result.unpredicted == (1.0, 1 * GIB)
    assert result.cold_pods == ("young",)
    # peak: system + predicted Prod pods (with margin) + requests of the cold pod
    assert result.peak == pytest.approx((cpu_end(0.5) * m + old_peak[0] + 1.0,
                                         mem_end(1 * GIB) * m + old_peak[1] + 1 * GIB))

    # a day later the young pod is predicted: its request leaves unpredicted, its peak joins.
    later = prod_reclaimable(predict, lambda k: None, pods, capacity, now + DAY, PredictionSettings())
    assert later is not None and later.cold_pods == () and later.unpredicted == (0.0, 0.0)


def test_no_system_model_means_no_result() -> None:
    assert prod_reclaimable(lambda k: None, lambda k: None, [], (8.0, GIB), T0, PredictionSettings()) is None


def test_pod_age_falls_back_to_its_model() -> None:
    """Without a creation time (no kubelet), the pod's age is its model's."""
    now = T0 + 2 * DAY
    models = {SYSTEM: _model(0.5, GIB, T0), pod_key("a"): _model(1.0, GIB, now - HOUR)}

    def predict(key: str) -> dict[str, tuple[float, float]] | None:
        return models[key].percentiles() if key in models else None

    def first_seen(key: str) -> float | None:
        return models[key].first_seen if key in models else None

    pods = [PodDemand("a", "", 2.0, 2 * GIB)]  # no class: Prod for reclaiming, as koordlet
    young = prod_reclaimable(predict, first_seen, pods, (8.0, 8 * GIB), now, PredictionSettings())
    assert young is not None and young.cold_pods == ("a",)
    models[pod_key("a")].first_seen = now - 2 * DAY
    old = prod_reclaimable(predict, first_seen, pods, (8.0, 8 * GIB), now, PredictionSettings())
    assert old is not None and old.cold_pods == ()


def test_histogram_checkpoint_rejects_out_of_range_buckets() -> None:
    options = BucketOptions(max_value=1.0, first=0.1, ratio=2.0, epsilon=0.1)
    with pytest.raises(ValueError, match="bucket 99"):
        DecayingHistogram.from_dict({"reference": 0, "weights": [[99, 1.0]]}, options, 60.0)


def test_decay_halves_an_old_sample() -> None:
    """Two samples one half-life apart: the newer weighs twice the older, so p50 (1/3 of the
    weight below) is the newer sample's bucket when it is the larger one."""
    h = DecayingHistogram(BucketOptions(max_value=100, first=1, ratio=2, epsilon=0.01), half_life=10)
    h.add(1.5, 1.0, 0.0)  # bucket 1: [1, 3)
    h.add(20.0, 1.0, 10.0)  # bucket 4: [15, 31)
    assert h.weights == {1: 1.0, 4: 2.0}
    assert h.percentile(0.3) == 3.0  # end of bucket 1
    assert h.percentile(0.5) == 31.0
    # far in the future the weights are rescaled instead of overflowing; ratios are kept
    h.add(20.0, 1.0, 10.0 + 10 * 200)
    assert h.reference == 2010.0 and h.percentile(0.5) == 31.0
    assert json.loads(json.dumps(h.to_dict()))["reference"] == 2010.0
