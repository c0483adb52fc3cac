"""The aggregating reads' columns: window cuts, ordering, and summaries equal to the
definition (koordlet's percentiles over samples sorted by time, then value)."""

from __future__ import annotations

import random
from pathlib import Path

from metrics.model import Aggregate, Sample, labels
from metrics.store.tsdb import TSDB
from metrics.store.tsdbcols import Columns, summarize
from metrics.store.tsdbquery import decode_chunk, pack, percentile
from metrics.store.tsdbrollup import Bucket, combine

CPU = "pod_cpu_usage_cores"
A = labels(pod_uid="a")
T0 = 1_700_000_100.0


def _reference(rows: list[tuple[int, float]]) -> Aggregate:
    rows = sorted(rows)
    values = [v for _, v in rows]
    ascending = sorted(values)
    return Aggregate(count=len(values), avg=sum(values) / len(values), p50=percentile(ascending, 0.5),
                     p90=percentile(ascending, 0.9), p95=percentile(ascending, 0.95),
                     p99=percentile(ascending, 0.99), last=values[-1], first_ts=rows[0][0] / 1000,
                     last_ts=rows[-1][0] / 1000)


def test_ordered_sorts_by_time_then_value_and_leaves_ordered_columns_alone() -> None:
    cols = Columns.of([(30, 1.0), (10, 5.0), (20, 2.0), (10, 4.0)])
    ordered = cols.ordered()
    assert list(ordered.ts) == [10, 10, 20, 30] and list(ordered.vals) == [4.0, 5.0, 2.0, 1.0]
    assert list(cols.ts) == [30, 10, 20, 10]  # the original is not changed
    ascending = Columns.of([(1, 3.0), (2, 1.0)])
    assert ascending.ordered() is ascending


def test_add_chunk_keeps_only_the_samples_inside_the_window() -> None:
    ts = [1000 + 250 * i for i in range(40)]
    values = [float(i * i) for i in range(40)]
    [(lo, hi, n, blob)] = list(pack(ts, values))
    for start, end in ((0, 10**9), (1000, 1000), (1600, 5300), (hi, hi + 5), (hi + 1, hi + 9), (0, 999)):
        cols = Columns()
        cols.add_chunk(lo, hi, n, blob, start, end)
        want = [(t, v) for t, v in zip(*decode_chunk(lo, n, blob), strict=True) if start <= t <= end]
        assert list(zip(cols.ts, cols.vals, strict=True)) == want


def test_summarize_equals_the_definition_over_unordered_rows_with_repeated_times() -> None:
    rng = random.Random(7)
    assert summarize(Columns()) is None
    for size in (1, 2, 3, 10, 99, 300):
        rows = [(rng.randrange(0, 50) * 1000, rng.choice([rng.random(), 0.5, 1e9])) for _ in range(size)]
        assert summarize(Columns.of(rows)) == _reference(rows)
        in_order = sorted(set(rows))
        assert summarize(Columns.of(in_order)) == _reference(in_order)


def test_combine_takes_the_newest_of_raw_and_buckets_whatever_the_raw_order() -> None:
    bucket = Bucket(start_ms=0, count=4, total=8.0, min=1.0, max=3.0, last=3.0, first_ms=1000, last_ms=4000)
    newer_raw = combine(Columns.of([(9000, 7.0), (6000, 5.0)]), [bucket])
    assert newer_raw is not None
    assert (newer_raw.count, newer_raw.last, newer_raw.first_ts, newer_raw.last_ts) == (6, 7.0, 1.0, 9.0)
    assert newer_raw.avg == (8.0 + 12.0) / 6
    older_raw = combine(Columns.of([(500, 9.0)]), [bucket])
    assert older_raw is not None
    assert (older_raw.last, older_raw.first_ts, older_raw.last_ts) == (3.0, 0.5, 4.0)
    only_buckets = combine(Columns(), [bucket])
    assert only_buckets is not None and (only_buckets.count, only_buckets.first_ts) == (4, 1.0)


def test_a_sample_in_the_frames_older_than_the_chunks_is_read_in_time_order(tmp_path: Path) -> None:
    with TSDB(tmp_path / "m.db", clock=lambda: T0 + 60) as db:
        db.write([Sample(CPU, float(i), A, T0 + i) for i in range(10, 20)])
        db.flush()
        db.compact()  # chunks
    # A new writer does not know the series' newest time (e.g. after the clock went
    # back across a restart): the old sample stays a frame, read after the chunks.
    with TSDB(tmp_path / "m.db", clock=lambda: T0 + 60) as db:
        db.write([Sample(CPU, 100.0, A, T0 + 5)])
        db.flush()
        want = _reference([(round((T0 + i) * 1000), float(i)) for i in range(10, 20)]
                          + [(round((T0 + 5) * 1000), 100.0)])
        assert db.aggregate(CPU, A, T0, T0 + 60) == want
        assert db.aggregate_many([(CPU, A)], T0, T0 + 60) == {(CPU, A): want}
        assert db.aggregate_all(CPU, T0, T0 + 60) == {A: want}
        assert want.last == 19.0 and want.first_ts == T0 + 5
