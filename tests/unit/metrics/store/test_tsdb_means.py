"""``means_many`` gives ``aggregate_many``'s count, mean, first and last times, summed
while decoding (issue 29: the NodeMetric report held every pod's window as samples)."""

from __future__ import annotations

import errno
import random
from pathlib import Path

from metrics.model import NO_LABELS, Labels, Mean, MeanReads, Sample, labels
from metrics.store.tsdb import TSDB

T0 = 1_800_000_000.0
SERIES: list[tuple[str, Labels]] = [("pod_cpu", labels(pod_uid=str(i))) for i in range(4)] + \
    [("node_cpu", NO_LABELS), ("never_written", NO_LABELS)]


def _expected(store: TSDB, start: float, end: float) -> dict[tuple[str, Labels], Mean]:
    return {key: Mean(a.count, a.avg, a.first_ts, a.last_ts)
            for key, a in store.aggregate_many(SERIES, start, end).items()}


def test_means_match_the_aggregates_over_chunks_frames_buckets_and_a_full_disk(tmp_path: Path) -> None:
    clock = [T0]
    # Raw kept 10 minutes: the 30-minute window reads rolled-up buckets too.
    store = TSDB(tmp_path / "m.db", clock=lambda: clock[0], raw_retention=600.0, compact_rows=500)
    assert isinstance(store, MeanReads)
    rng = random.Random(47)
    checked = 0
    for step in range(1500):
        clock[0] += 1.0
        now = clock[0]
        batch = [Sample(metric, rng.random() * 10, lbl, now - rng.choice((0.0, 0.5)))
                 for metric, lbl in SERIES[:5] if rng.random() > 0.2]
        if rng.random() < 0.05:
            batch.append(Sample("pod_cpu", rng.random(), labels(pod_uid="0"), now - rng.uniform(1, 30)))
        store.write(batch)
        if step % 3 == 0:
            store.flush()
        if step % 400 == 399:
            store.gc(now)
        if step == 1200:
            store._degrade(OSError(errno.ENOSPC, "full"), now)  # reads add the batch in memory
        if step % 50 == 49 or step in (1201, 1202):  # and while the batch is only in memory
            for span in (60.0, 300.0, 1800.0):
                assert store.means_many(SERIES, now - span, now) == _expected(store, now - span, now), (step, span)
                checked += 1
    assert checked == 96
    assert ("never_written", NO_LABELS) not in store.means_many(SERIES, T0, clock[0])


def test_a_mean_answers_only_avg_and_count() -> None:
    mean = Mean(count=3, avg=2.0, first_ts=10.0, last_ts=12.5)
    assert (mean.value("avg"), mean.value("count"), mean.span) == (2.0, 3.0, 2.5)
    try:
        mean.value("p90")
    except ValueError as exc:
        assert "p90" in str(exc)
    else:
        raise AssertionError("a percentile of a mean")
