"""The store's tiers: packed raw chunks, folding into rollup buckets, queries over both,
retention, the size cap, restarts, a concurrent fold, and the size of 12 hours."""

from __future__ import annotations

import random
import sqlite3
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from metrics.model import Labels, Sample, labels
from metrics.store.tsdb import TSDB, CorruptStore
from metrics.store.tsdbquery import decode_chunk, pack, percentile

CPU = "pod_cpu_usage_cores"
MEM = "pod_memory_used_bytes"
A = labels(pod_uid="a")
B = labels(pod_uid="b")
#: Aligned to 5 minutes, so bucket boundaries fall on round offsets from it.
T0 = 1_700_000_100.0
MIN = 60.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "metrics.db"


def _store(path: Path, *, raw_retention: float = 2 * MIN, coarse_step: float = MIN, **kw: Any) -> TSDB:
    """Raw for 2 min, 1 min buckets, no coarse ones unless asked."""
    return TSDB(path, clock=Clock(), raw_retention=raw_retention, rollup_step=MIN, coarse_step=coarse_step, **kw)


@pytest.fixture
def db(path: Path) -> Iterator[TSDB]:
    store = _store(path)
    yield store
    store.close()


def _write(db: TSDB, lb: Labels, values: list[float], start: float = T0, metric: str = CPU) -> None:
    db.write([Sample(metric, v, lb, start + i) for i, v in enumerate(values)])
    db.flush()


def _by_minute(values: list[float]) -> list[list[float]]:
    return [values[i : i + 60] for i in range(0, len(values), 60)]


def test_chunks_round_trip_every_float_and_split_on_gaps_and_size() -> None:
    values = [0.0, -0.0, 1e-300, 1e300, 2.0**53, -7.25, 0.1, 1 / 3, 4096.0 * 1_000_003, 5e-324]
    ts = [1_000 * i for i in range(len(values))]
    [(lo, hi, n, data)] = pack(ts, values)
    assert (lo, hi, n) == (0, ts[-1], len(values))
    got_ts, got = decode_chunk(lo, n, data)
    assert got_ts == ts
    assert [struct.pack("<d", v) for v in got] == [struct.pack("<d", v) for v in values]  # bit-exact, -0.0 too
    gap = [0, 1_000, 1_000 + 70_000, 1_000 + 71_000]  # 70 s: more than a 16-bit delta holds
    assert [c[2] for c in pack(gap, [1.0] * 4)] == [2, 2]
    many = list(range(0, 300_000, 1_000))
    assert [c[2] for c in pack(many, [1.0] * len(many))] == [120, 120, 60]


def test_a_rewritten_sample_replaces_the_stored_one_after_compaction(path: Path) -> None:
    with _store(path, compact_rows=1) as db:
        _write(db, A, [1.0, 2.0, 3.0])
        _write(db, A, [20.0], start=T0 + 1)  # a new chunk overlapping the first one
        assert db.points(CPU, A, T0, T0 + 10) == [(T0, 1.0), (T0 + 1, 20.0), (T0 + 2, 3.0)]


def test_fold_takes_whole_chunks_and_completes_a_bucket_split_between_folds(db: TSDB) -> None:
    values = [float((i * 7) % 11) for i in range(330)]  # T0+30 .. T0+359: chunks of 120, 120, 90
    _write(db, A, values, start=T0 + 30)
    result = db.gc(now=T0 + 300)  # raw cut T0+180: the first chunk (to T0+149) folds
    assert (result.points_folded, result.points_deleted) == (120, 0)
    # The chunk straddling the cut stays raw, whole.
    assert db.points(CPU, A, T0 + 150, T0 + 400) == [(T0 + 150 + i, v) for i, v in enumerate(values[120:])]
    assert sqlite3.connect(db.path).execute("SELECT min(lo) FROM chunks").fetchone()[0] == (T0 + 150) * 1000
    assert [(b.start - T0, b.count) for b in db.rollups(CPU, A, T0, T0 + 400)] == [(0, 30), (60, 60), (120, 30)]
    assert db.gc(now=T0 + 420).points_folded == 120  # cut T0+300: the second chunk
    assert db.gc(now=T0 + 600).points_folded == 90
    by_minute: dict[int, list[float]] = {}
    for i, v in enumerate(values):
        by_minute.setdefault((30 + i) // 60 * 60, []).append(v)
    buckets = db.rollups(CPU, A, T0, T0 + 400)
    assert [int(b.start - T0) for b in buckets] == sorted(by_minute)
    for b in buckets:
        minute = by_minute[int(b.start - T0)]
        first = max(b.start, T0 + 30)
        assert (b.count, b.total, b.min, b.max, b.last) == (len(minute), sum(minute), min(minute), max(minute),
                                                           minute[-1])
        assert (b.first_ts, b.last_ts) == (first, first + len(minute) - 1)
    assert sqlite3.connect(db.path).execute("SELECT count(*) FROM chunks").fetchone()[0] == 0


def test_a_series_with_few_samples_per_step_folds_into_coarse_buckets(path: Path) -> None:
    with _store(path, coarse_step=5 * MIN) as db:
        sparse = [float(i) for i in range(60)]  # every 10 s for 10 minutes: 6 a step
        db.write([Sample(CPU, v, A, T0 + 10 * i) for i, v in enumerate(sparse)])
        _write(db, B, [1.0] * 600)  # every second: 60 a step
        db.gc(now=T0 + 12 * MIN)  # raw cut T0+600: everything folds
        coarse = db.rollups(CPU, A, T0, T0 + 600)
        assert [(b.start - T0, b.count, b.total, b.last) for b in coarse] == [
            (0, 30, sum(sparse[:30]), 29.0), (300, 30, sum(sparse[30:]), 59.0)]
        assert [b.start - T0 for b in db.rollups(CPU, B, T0, T0 + 600)] == [60 * k for k in range(10)]
        agg = db.aggregate(CPU, A, T0, T0 + 599)
        assert agg is not None and (agg.count, agg.avg, agg.last, agg.last_ts) == (60, 29.5, 59.0, T0 + 590)


def test_last_finds_the_newest_sample_when_a_coarse_bucket_overlaps_step_buckets(path: Path) -> None:
    """A series that turns sparse folds into a coarse bucket, which merges into the step
    bucket at the same start: the newest sample is then in a bucket that starts first."""
    with _store(path, coarse_step=5 * MIN) as db:
        _write(db, A, [1.0] * 180)  # dense, T0 .. T0+179
        db.gc(now=T0 + 300)  # raw cut T0+180: step buckets T0, T0+60, T0+120
        db.write([Sample(CPU, 2.0 + i, A, T0 + 180 + 10 * i) for i in range(12)])  # sparse, to T0+290
        db.flush()
        db.gc(now=T0 + 420)  # raw cut T0+300: one coarse bucket, merged into the one at T0
        assert [(b.start - T0, b.count) for b in db.rollups(CPU, A, T0, T0 + 400)] == [(0, 72), (60, 60), (120, 60)]
        agg = db.aggregate(CPU, A, T0, T0 + 400)
        assert agg is not None and (agg.count, agg.last, agg.last_ts) == (192, 13.0, T0 + 290)
    with _store(path) as again:  # nothing in memory: last() reads the buckets
        assert again.last(CPU, A, 600, T0 + 420) == Sample(CPU, 13.0, A, T0 + 290)


def test_queries_over_both_tiers(db: TSDB) -> None:
    values = [float(i % 10) for i in range(300)]
    _write(db, A, values)
    raw_only = db.aggregate(CPU, A, T0 + 250, T0 + 299)
    db.gc(now=T0 + 360)  # raw cut T0+240: the chunks of the first 240 samples fold
    agg = db.aggregate(CPU, A, T0, T0 + 299)
    assert agg is not None
    assert (agg.count, agg.avg, agg.last, agg.first_ts, agg.last_ts) == (300, 4.5, 9.0, T0, T0 + 299)
    # Each bucket stands for 60 samples at its mean (4.5); the 60 raw ones count as themselves.
    weighted = sorted([4.5] * 240 + values[240:])
    assert (agg.p50, agg.p90, agg.p99) == (percentile(weighted, 0.5), percentile(weighted, 0.9), 9.0)
    assert db.aggregate(CPU, A, T0 + 250, T0 + 299) == raw_only  # a raw window is untouched
    # A bucket straddling the window's start is left out whole: [T0+30, ...) starts at the second one.
    part = db.aggregate(CPU, A, T0 + 30, T0 + 299)
    assert part is not None and (part.count, part.first_ts) == (240, T0 + 60)
    everything = db.aggregate_all(CPU, T0, T0 + 299)
    assert everything == {A: agg}
    pts = db.points(CPU, A, T0, T0 + 299)
    assert pts[:4] == [(T0, 4.5), (T0 + 60, 4.5), (T0 + 120, 4.5), (T0 + 180, 4.5)]
    assert pts[4:] == [(T0 + 240 + i, v) for i, v in enumerate(values[240:])]


def test_percentiles_are_exact_when_buckets_are_flat_and_weighted_means_otherwise(db: TSDB) -> None:
    flat = [float(m) for m in (3, 1, 4) for _ in range(60)]
    _write(db, A, flat + [9.0] * 60)
    ramp = [float(i) for i in range(60)] + [100.0] * 60  # bucket mean 29.5, then raw
    _write(db, B, ramp[:60], start=T0 + 60)
    db.compact()  # a chunk of its own, which the cut below takes whole
    _write(db, B, ramp[60:], start=T0 + 120)
    exact = db.aggregate(CPU, A, T0, T0 + 239)
    db.gc(now=T0 + 240)  # folds up to T0 + 120
    agg = db.aggregate(CPU, A, T0, T0 + 239)
    assert agg == exact
    b = db.aggregate(CPU, B, T0, T0 + 239)
    assert b is not None and (b.count, b.avg, b.p50, b.p99) == (120, (sum(range(60)) + 6000) / 120, 29.5, 100.0)


def test_last_reads_the_newest_tier_that_has_the_series(db: TSDB) -> None:
    _write(db, A, [1.0, 2.0, 3.0])  # stopped at T0 + 2
    _write(db, B, [float(i) for i in range(400)])
    db.gc(now=T0 + 400)
    assert db.rollups(CPU, A, T0, T0 + 60)[0].count == 3
    assert db.last(CPU, A, 500, T0 + 400) == Sample(CPU, 3.0, A, T0 + 2)
    assert db.last(CPU, A, 300, T0 + 400) is None
    assert db.last(CPU, B, 5, T0 + 399) == Sample(CPU, 399.0, B, T0 + 399)
    assert db.latest_ts(CPU) == T0 + 399
    db.close()
    # A new process knows nothing in memory: the same answers come from the tiers.
    with _store(db.path) as again:
        assert again.last(CPU, A, 500, T0 + 400) == Sample(CPU, 3.0, A, T0 + 2)
        assert again.last(CPU, A, 300, T0 + 400) is None
        assert again.last(CPU, B, 5, T0 + 399) == Sample(CPU, 399.0, B, T0 + 399)
        assert again.last(CPU, B, 5, T0 + 300) == Sample(CPU, 300.0, B, T0 + 300)


def test_aggregate_many_equals_one_aggregate_per_series_over_every_tier(path: Path) -> None:
    with _store(path, compact_rows=5000) as db:
        many = [labels(pod_uid=f"p{i:03d}", container_id="c") for i in range(600)]  # > one statement's ids
        for t in range(200):
            db.write([Sample(CPU, float((i + t) % 13), lb, T0 + t) for i, lb in enumerate(many[:3])])
            db.write([Sample(MEM, float(i), lb, T0 + t) for i, lb in enumerate(many) if t % 50 == 0])
        db.flush()
        db.gc(now=T0 + 200)  # the first minute folds; some rows are chunks, some still recent
        keys = [(CPU, lb) for lb in many[:3]] + [(MEM, lb) for lb in many] + [(CPU, labels(pod_uid="none"))]
        for start, end in ((T0, T0 + 199), (T0 + 30, T0 + 150), (T0 + 190, T0 + 199)):
            got = db.aggregate_many(keys, start, end)
            want = {k: a for k in keys if (a := db.aggregate(k[0], k[1], start, end)) is not None}
            assert got == want and (CPU, labels(pod_uid="none")) not in got
        assert len(db.aggregate_many(keys, T0, T0 + 199)) == 603
        # Keys come back as given, whatever the label order.
        flipped = (("container_id", "c"), ("pod_uid", "p000"))
        one = db.aggregate(CPU, many[0], T0, T0 + 199)
        assert db.aggregate_many([(CPU, flipped)], T0, T0 + 199) == {(CPU, flipped): one}


def test_coarse_buckets_past_coarse_after_and_late_samples_merge_into_them(path: Path) -> None:
    with _store(path, coarse_step=5 * MIN, coarse_after=10 * MIN) as db:
        values = [float(i % 13) for i in range(1200)]  # 20 minutes
        _write(db, A, values)
        db.gc(now=T0 + 1200)
        starts = [b.start - T0 for b in db.rollups(CPU, A, T0, T0 + 1200)]
        assert starts == [0, 300] + [600 + 60 * k for k in range(8)]  # coarse before T0 + 600
        coarse = db.rollups(CPU, A, T0, T0 + 299)[0]
        assert (coarse.count, coarse.total, coarse.last) == (300, sum(values[:300]), values[299])
        assert (coarse.first_ts, coarse.last_ts) == (T0, T0 + 299)
        db.gc(now=T0 + 1500)  # coarse cut T0 + 900: five minutes merge; the last two fold
        starts = [b.start - T0 for b in db.rollups(CPU, A, T0, T0 + 1200)]
        assert starts == [0, 300, 600] + [900 + 60 * k for k in range(5)]
        db.write([Sample(CPU, 100.0, A, T0 + 10.5)])  # late: lands in the first coarse bucket
        db.flush()
        db.gc(now=T0 + 1500)
        late = db.rollups(CPU, A, T0, T0 + 299)[0]
        assert (late.count, late.total, late.max) == (301, coarse.total + 100.0, 100.0)
        assert late.last == coarse.last and late.last_ts == coarse.last_ts
        total = db.aggregate(CPU, A, T0, T0 + 1200)
        assert total is not None and total.count == 1201


def test_retention_drops_buckets_then_empty_series(path: Path) -> None:
    with _store(path, retention=10 * MIN) as db:
        _write(db, A, [1.0] * 600)
        _write(db, B, [2.0] * 60)
        db.gc(now=T0 + 600)
        assert len(db.rollups(CPU, A, T0, T0 + 600)) == 8
        result = db.gc(now=T0 + 900)  # keeps samples from T0 + 300 on, folds the rest
        assert [b.start - T0 for b in db.rollups(CPU, A, 0, T0 + 900)] == [300, 360, 420, 480, 540]
        assert (result.points_folded, result.buckets_deleted, result.series_deleted) == (120, 5 + 1, 1)
        assert db.series(CPU) == [A]
        result = db.gc(now=T0 + 1300)
        assert db.series(CPU) == []
        assert (result.points_deleted, result.buckets_deleted, result.series_deleted) == (0, 5, 1)


def test_both_tiers_survive_a_restart(path: Path) -> None:
    with _store(path) as db:
        _write(db, A, [float(i % 5) for i in range(300)])
        db.gc(now=T0 + 300)
        before = db.aggregate(CPU, A, T0, T0 + 299)
        buckets = db.rollups(CPU, A, T0, T0 + 299)
    with _store(path) as again:
        assert again.aggregate(CPU, A, T0, T0 + 299) == before
        assert again.rollups(CPU, A, T0, T0 + 299) == buckets and len(buckets) == 2  # the first chunk
    with TSDB.open_readonly(path) as ro:
        assert ro.aggregate(CPU, A, T0, T0 + 299) == before


def test_size_cap_drops_the_oldest_rollups_first_then_raw(path: Path) -> None:
    rng = random.Random(5)
    pods = [labels(pod_uid=f"p{i}") for i in range(20)]
    with _store(path) as db:
        for t in range(0, 3600, 60):
            db.write([Sample(CPU, rng.random(), lb, T0 + t + k) for k in range(60) for lb in pods])
            db.flush()
        db.gc(now=T0 + 3600)
        raw = db.aggregate(CPU, pods[0], T0 + 3480, T0 + 3600)
        db.max_bytes = db.size_bytes() - 8192
        result = db.gc(now=T0 + 3600)
        assert result.capped and result.buckets_deleted > 0 and result.points_deleted == 0
        kept = db.rollups(CPU, pods[0], T0, T0 + 3600)
        assert kept and kept[-1].start == T0 + 3420 and kept[0].start > T0  # the oldest went
        assert db.aggregate(CPU, pods[0], T0 + 3480, T0 + 3600) == raw
        db.max_bytes = db.size_bytes() // 2
        result = db.gc(now=T0 + 3600)
        assert result.points_deleted > 0
        assert db.rollups(CPU, pods[0], T0, T0 + 3600) == []
        assert db.size_bytes() <= db.max_bytes


def test_a_reader_during_folds_sees_every_sample_once(path: Path) -> None:
    """Each tick adds one sample to every series; GC folds and coarsens while readers
    read: any snapshot must show each series with the same count, and a sum and last
    value that match it (no sample counted twice, none missing)."""
    pods = [labels(pod_uid=f"p{i}") for i in range(20)]
    ticks = 900
    clock = Clock()
    db = _store(path, coarse_step=5 * MIN, coarse_after=5 * MIN, compact_rows=len(pods) * 30)
    errors: list[BaseException] = []
    done = threading.Event()

    def writer() -> None:
        try:
            for t in range(ticks):
                db.write([Sample(CPU, float(t), lb, T0 + t) for lb in pods])
                db.flush()
                if t % 60 == 59:
                    db.gc(now=T0 + t)
        except BaseException as exc:  # handed to the main thread
            errors.append(exc)
        finally:
            done.set()

    def reader() -> None:
        try:
            while not done.is_set():
                view = db.aggregate_all(CPU, T0, T0 + ticks)
                assert len({(a.count, a.avg, a.last) for a in view.values()}) <= 1, view
                for a in view.values():
                    assert (a.avg, a.last, a.first_ts) == ((a.count - 1) / 2, a.count - 1, T0)
        except BaseException as exc:  # handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    try:
        assert not errors, errors
        final = db.aggregate_all(CPU, T0, T0 + ticks)
        assert {a.count for a in final.values()} == {ticks} and len(final) == len(pods)
        assert len(db.rollups(CPU, pods[0], T0, T0 + ticks)) > 0
    finally:
        clock.now = T0
        db.close()


def test_twelve_hours_of_a_few_series_stay_within_their_share_of_the_cap(path: Path) -> None:
    """Defaults (35 min raw, 1 min buckets, 5 min past 2 h, 12 h), 4 series of noise at
    1 Hz, GC every 5 min. The share: 100 MiB for 2000 series, ~52 kB a series."""
    rng = random.Random(11)
    pods = [labels(pod_uid=f"p{i}") for i in range(4)]
    with TSDB(path, clock=Clock()) as db:
        for t in range(0, 13 * 3600, 60):
            db.write([Sample(CPU, rng.random(), lb, T0 + t + k) for k in range(60) for lb in pods])
            db.flush()
            if t % 300 == 240:
                db.gc(now=T0 + t + 60)
        end = T0 + 13 * 3600
        buckets = db.rollups(CPU, pods[0], end - 12 * 3600, end)
        fine = [b for b in buckets if b.count == 60]
        assert len(buckets) - len(fine) == pytest.approx(10 * 12, abs=2)  # 5 min buckets, 2 h .. 12 h
        assert len(fine) == pytest.approx(85, abs=6)  # 1 min buckets, 35 min .. 2 h
        raw = db.points(CPU, pods[0], end - 45 * 60, end)
        assert 35 * 60 <= sum(1 for ts, _ in raw if ts > end - 40 * 60)
        agg = db.aggregate(CPU, pods[0], end - 12 * 3600, end)
        assert agg is not None and agg.count == pytest.approx(12 * 3600, abs=600)
        assert db.size_bytes() <= len(pods) * 100 * 2**20 / 2000 + 64 * 1024


def test_schema_1_files_are_upgraded_in_place(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE series (id INTEGER PRIMARY KEY AUTOINCREMENT, metric TEXT NOT NULL, labels TEXT NOT NULL,"
        " UNIQUE (metric, labels));"
        "CREATE TABLE points (series_id INTEGER NOT NULL, ts INTEGER NOT NULL, value REAL NOT NULL,"
        " PRIMARY KEY (series_id, ts)) WITHOUT ROWID;"
        "CREATE TABLE recent (ts INTEGER NOT NULL, series_id INTEGER NOT NULL, value REAL NOT NULL,"
        " PRIMARY KEY (ts, series_id)) WITHOUT ROWID;"
        "CREATE TABLE kv (key TEXT PRIMARY KEY, value TEXT NOT NULL, updated REAL NOT NULL);"
        """INSERT INTO series (metric, labels) VALUES ('pod_cpu_usage_cores', '{"pod_uid":"a"}');"""
        "PRAGMA user_version = 1;"
    )
    conn.executemany("INSERT INTO points VALUES (1, ?, ?)", [(int(T0 * 1000) + 1000 * i, i / 4) for i in range(200)])
    conn.execute("INSERT INTO recent VALUES (?, 1, 50.0)", (int(T0 * 1000) + 200_000,))
    conn.commit()
    conn.close()
    with pytest.raises(Exception, match="upgrades it"):
        TSDB.open_readonly(path)
    with TSDB(path, clock=Clock()) as db:
        assert db.points(CPU, A, T0, T0 + 300) == [(T0 + i, i / 4) for i in range(200)] + [(T0 + 200, 50.0)]
    check = sqlite3.connect(path)
    assert check.execute("PRAGMA user_version").fetchone()[0] == 3
    assert check.execute("SELECT count(*) FROM sqlite_master WHERE name IN ('points', 'recent')").fetchone()[0] == 0


def test_a_damaged_chunk_is_a_clear_error_naming_the_file(db: TSDB) -> None:
    _write(db, A, [1.0, 2.0])
    db.compact()
    conn = sqlite3.connect(db.path)
    conn.execute("UPDATE chunks SET data = x'07'")
    conn.commit()
    conn.close()
    with pytest.raises(CorruptStore, match=str(db.path)):
        db.aggregate(CPU, A, T0, T0 + 1)


@pytest.mark.parametrize(
    "kw", [{"rollup_step": 0.0}, {"coarse_step": 90.0}, {"coarse_step": 30.0}, {"raw_retention": 0.0}]
)
def test_bad_tier_settings_are_refused(path: Path, kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="bad tiers"):
        TSDB(path, **kw)
    assert not path.exists()


def test_a_fold_writes_its_buckets_as_it_goes_not_all_at_the_end(path: Path) -> None:
    """3000 series folded at once (a GC past the raw retention at 110 pods folds ~9000
    buckets): the buckets are written in batches while the chunks are read, so the GC's
    peak is a batch's, not every bucket's (all held: 3.9 MB here; 0.3 now); every sample
    lands in a bucket."""
    import tracemalloc

    many = [labels(pod_uid=f"u{i}") for i in range(3000)]
    db = _store(path)
    for t in range(0, 300, 10):  # 5 minutes of PSI-like samples: 30 a series
        db.write([Sample(CPU, float(i + t), lb, T0 + t) for i, lb in enumerate(many)], T0 + t)
    db.flush()
    db.compact()
    tracemalloc.start()
    try:
        result = db.gc(now=T0 + 20 * MIN)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.points_folded == 3000 * 30
    assert peak < 1_000_000, f"peak {peak} B folding 3000 series"
    got = db.aggregate(CPU, many[1234], T0, T0 + 300)
    assert got is not None and got.count == 30 and got.last == 1234 + 290.0 and got.avg == 1234 + 145.0
    db.close()


def test_the_first_gc_after_a_restart_streams_the_coarse_buckets_it_leaves_alone(path: Path) -> None:
    """A restarted store does not know which buckets are coarse already, so its first GC
    looks at all of them: 500 series' 10 hours of coarse buckets are left in C (held in
    Python they were 41 MB here, ~150 MB for 2000 series), and the step buckets still
    to merge are merged."""
    import tracemalloc

    db = TSDB(path, clock=Clock(), retention=24 * 3600.0)
    many = [labels(pod_uid=f"u{i}") for i in range(500)]
    db.write([Sample(CPU, 1.0, lb, T0) for lb in many], T0)
    db.flush()
    db.close()
    conn = sqlite3.connect(path)
    ids = [int(i) for (i,) in conn.execute("SELECT id FROM series ORDER BY id")]
    t0, coarse = int(T0 * 1000), 300_000
    rows = [(sid, t0 + k * coarse, 30, 30.0, 1.0, 1.0, 1.0, 0, 290_000) for sid in ids for k in range(120)]
    # One series' last coarse window before the cut in 1-minute buckets, as a fold leaves them.
    rows += [(ids[0], t0 + 120 * coarse + m * 60_000, 6, 6.0 * (m + 1), m + 1.0, m + 1.0, m + 1.0, 0, 50_000)
             for m in range(5)]
    conn.executemany("INSERT INTO rollups VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    conn.commit()
    conn.close()
    db = TSDB(path, clock=Clock(), retention=24 * 3600.0)
    tracemalloc.start()
    try:
        db.gc(now=T0 + 12.5 * 3600)  # coarse cut: 2 hours before, past every bucket above
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    db.close()
    assert peak < 2_000_000, f"peak {peak} B for {len(rows)} buckets"
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT count(*) FROM rollups").fetchone()[0] == 500 * 120 + 1
        merged = conn.execute("SELECT n, total, vmin, vmax, last FROM rollups WHERE series_id = ? AND start = ?",
                              (ids[0], t0 + 120 * coarse)).fetchone()
    finally:
        conn.close()
    assert merged == (30, 6.0 * 15, 1.0, 5.0, 5.0)
