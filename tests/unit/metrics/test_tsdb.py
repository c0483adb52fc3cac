"""The SQLite time-series store: aggregations, windows, batching, threads, retention, files."""

from __future__ import annotations

import random
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from metrics.model import Aggregate, Labels, MetricReader, MetricWriter, Sample, labels
from metrics.store.tsdb import TSDB, CorruptStore, TSDBError
from metrics.store.tsdbquery import canonical

CPU = "pod_cpu_usage_cores"
MEM = "pod_memory_used_bytes"
A = labels(pod_uid="a")
B = labels(pod_uid="b")
T0 = 1_700_000_000.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "store" / "metrics.db"


@pytest.fixture
def db(path: Path) -> Iterator[TSDB]:
    store = TSDB(path, clock=Clock())
    yield store
    store.close()


def _series(metric: str, lb: Labels, values: list[float], start: float = T0, step: float = 1.0) -> list[Sample]:
    return [Sample(metric, v, lb, start + i * step) for i, v in enumerate(values)]


def test_implements_the_reader_and_writer_protocols(db: TSDB) -> None:
    reader: MetricReader = db
    writer: MetricWriter = db
    writer.write([Sample(CPU, 1.0, A, T0)])
    db.flush()
    assert reader.last(CPU, A, 5, T0) == Sample(CPU, 1.0, A, T0)


def test_aggregate_matches_a_hand_computation(db: TSDB) -> None:
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0]
    db.write(_series(CPU, A, values))
    db.flush()
    # sorted: 1 1 2 3 3 4 5 5 6 9; idx = int(10 * p) - 1 -> p50: 4, p90: 8, p95: 8, p99: 8
    assert db.aggregate(CPU, A, T0, T0 + 9) == Aggregate(
        count=10, avg=3.9, p50=3.0, p90=6.0, p95=6.0, p99=6.0, last=3.0, first_ts=T0, last_ts=T0 + 9
    )


def test_percentiles_on_a_hundred_values_written_out_of_order(db: TSDB) -> None:
    values = [float(v) for v in range(1, 101)]
    samples = _series(CPU, A, values)
    random.Random(7).shuffle(samples)
    db.write(samples)
    db.flush()
    agg = db.aggregate(CPU, A, T0, T0 + 99)
    assert agg is not None
    assert (agg.p50, agg.p90, agg.p95, agg.p99) == (50.0, 90.0, 95.0, 99.0)
    assert agg.last == 100.0  # the latest by time, not the last written
    assert agg.span == 99.0
    assert agg.value("count") == 100.0


def test_a_single_sample_floors_the_percentile_index_at_zero(db: TSDB) -> None:
    db.write([Sample(CPU, 0.25, A, T0)])
    db.flush()
    agg = db.aggregate(CPU, A, T0 - 10, T0 + 10)
    assert agg is not None
    assert (agg.count, agg.p50, agg.p99, agg.span) == (1, 0.25, 0.25, 0.0)


def test_windows_are_inclusive_and_exclude_the_rest(db: TSDB) -> None:
    db.write(_series(CPU, A, [1.0, 2.0, 3.0, 4.0, 5.0]))
    db.flush()
    agg = db.aggregate(CPU, A, T0 + 1, T0 + 3)
    assert agg is not None
    assert (agg.count, agg.avg, agg.first_ts, agg.last_ts) == (3, 3.0, T0 + 1, T0 + 3)
    assert db.points(CPU, A, T0 + 3, T0 + 100) == [(T0 + 3, 4.0), (T0 + 4, 5.0)]
    assert db.aggregate(CPU, A, T0 + 10, T0 + 20) is None
    assert db.aggregate(CPU, B, T0, T0 + 4) is None
    assert db.aggregate(MEM, A, T0, T0 + 4) is None


def test_aggregate_all_returns_each_series_with_samples_in_the_window(db: TSDB) -> None:
    db.write(_series(CPU, A, [1.0, 3.0]) + _series(CPU, B, [10.0], start=T0 + 50) + _series(MEM, A, [7.0]))
    db.flush()
    early = db.aggregate_all(CPU, T0, T0 + 10)
    assert set(early) == {A}
    assert early[A].avg == 2.0
    assert set(db.aggregate_all(CPU, T0, T0 + 60)) == {A, B}
    assert db.aggregate_all("no_such_metric", T0, T0 + 60) == {}


def test_labels_are_canonical_whatever_their_order(db: TSDB) -> None:
    unsorted: Labels = (("pod_uid", "a"), ("container_id", "c1"))
    db.write([Sample(CPU, 1.0, unsorted, T0), Sample(CPU, 3.0, labels(container_id="c1", pod_uid="a"), T0 + 1)])
    db.flush()
    canonical = (("container_id", "c1"), ("pod_uid", "a"))
    assert db.series(CPU) == [canonical]
    agg = db.aggregate(CPU, unsorted, T0, T0 + 1)
    assert agg is not None and agg.count == 2
    assert set(db.aggregate_all(CPU, T0, T0 + 1)) == {canonical}
    last = db.last(CPU, unsorted, 10, T0 + 1)
    assert last is not None and last.labels == canonical


def test_canonical_labels_are_kept_as_given_and_others_sorted_once() -> None:
    given = labels(pod_uid="a", container_id="c1")
    assert canonical(given) is given  # the store keeps the collector's tuple, not a copy
    assert canonical((("pod_uid", "a"), ("container_id", "c1"))) == given
    assert canonical((("a", "1"), ("a", "2"))) == (("a", "2"),)  # one value per key: the last


def test_queries_see_flushed_data_but_last_also_sees_the_batch(path: Path) -> None:
    clock = Clock()
    with TSDB(path, clock=clock) as db:
        db.write([Sample(CPU, 2.0, A)])  # ts 0: stamped with the clock
        assert db.aggregate(CPU, A, T0 - 1, T0 + 1) is None
        assert db.series(CPU) == []
        assert db.last(CPU, A, 5, T0) == Sample(CPU, 2.0, A, T0)
        assert db.flush() == 1
        assert db.flush() == 0
        clock.now = T0 + 1
        db.write([Sample(CPU, 4.0, A)])
        assert db.last(CPU, A, 5, T0 + 1) == Sample(CPU, 4.0, A, T0 + 1)
        agg = db.aggregate(CPU, A, T0 - 1, T0 + 1)
        assert agg is not None and agg.count == 1


def test_last_honours_max_age_and_now(db: TSDB) -> None:
    db.write(_series(CPU, A, [1.0, 2.0, 3.0]))
    db.flush()
    assert db.last(CPU, A, 5, T0 + 2) == Sample(CPU, 3.0, A, T0 + 2)
    # ``now`` in the past: samples after it are not "the newest" yet.
    assert db.last(CPU, A, 5, T0 + 1) == Sample(CPU, 2.0, A, T0 + 1)
    assert db.last(CPU, A, 2, T0 + 10) is None
    assert db.last(CPU, B, 100, T0 + 2) is None


def test_the_batch_flushes_itself_when_full(path: Path) -> None:
    with TSDB(path, max_batch=5, clock=Clock()) as db:
        db.write(_series(CPU, A, [1.0, 2.0, 3.0, 4.0]))
        assert db.aggregate(CPU, A, T0, T0 + 10) is None
        db.write(_series(CPU, A, [5.0], start=T0 + 4))
        agg = db.aggregate(CPU, A, T0, T0 + 10)
        assert agg is not None and agg.count == 5


def test_non_finite_values_are_skipped_not_stored(db: TSDB) -> None:
    db.write([Sample(CPU, float("nan"), A, T0), Sample(CPU, float("inf"), A, T0 + 1), Sample(CPU, 1.0, A, T0 + 2)])
    db.flush()
    assert db.points(CPU, A, T0, T0 + 2) == [(T0 + 2, 1.0)]


def test_kv_records_round_trip_and_reject_what_json_cannot_hold(db: TSDB) -> None:
    assert db.get_kv("pod_meta") is None
    db.put_kv("pod_meta", {"u1": {"namespace": "ns", "name": "p", "qos": "LS", "priority": 9000}})
    db.put_kv("pod_meta", {"u2": {"namespace": "ns", "name": "q", "qos": "BE", "priority": 5000}})
    assert db.get_kv("pod_meta") == {"u2": {"namespace": "ns", "name": "q", "qos": "BE", "priority": 5000}}
    with pytest.raises(ValueError, match="pod_meta"):
        db.put_kv("pod_meta", {"x": object()})


def test_concurrent_writer_and_readers_never_see_a_torn_flush(path: Path) -> None:
    """Each flush adds one point to every series in one transaction, so any reader
    snapshot must show the same count (and last value) for all series."""
    pods = [labels(pod_uid=f"p{i}") for i in range(30)]
    ticks = 150
    errors: list[BaseException] = []
    done = threading.Event()
    # A small compaction threshold: rows move between the tables while readers read.
    db = TSDB(path, clock=Clock(), compact_rows=len(pods) * 7)

    def writer() -> None:
        try:
            for t in range(ticks):
                db.write([Sample(CPU, float(t), lb, T0 + t) for lb in pods])
                db.flush()
        except BaseException as exc:  # handed to the main thread
            errors.append(exc)
        finally:
            done.set()

    def reader() -> None:
        try:
            while not done.is_set():
                view = db.aggregate_all(CPU, T0, T0 + ticks)
                counts = {a.count for a in view.values()}
                lasts = {a.last for a in view.values()}
                assert len(counts) <= 1 and len(lasts) <= 1, (counts, lasts)
                if view:
                    assert lasts == {float(counts.pop() - 1)}
                    assert len(view) == len(pods)
                db.last(CPU, pods[0], 1000, T0 + ticks)
        except BaseException as exc:  # handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    try:
        assert not errors, errors
        final = db.aggregate_all(CPU, T0, T0 + ticks)
        assert {a.count for a in final.values()} == {ticks}
    finally:
        db.close()


def test_reads_span_flushed_rows_before_and_after_compaction(path: Path) -> None:
    values = [float(v % 7) for v in range(25)]
    with TSDB(path, clock=Clock(), compact_rows=10) as db:
        for i, sample in enumerate(_series(CPU, A, values)):
            db.write([sample, Sample(MEM, 1.0, B, sample.ts)])
            db.flush()
            # Compaction every 10 rows: a window read always sees both tables.
            agg = db.aggregate(CPU, A, T0, T0 + 100)
            assert agg is not None and agg.count == i + 1 and agg.last == values[i]
        both = db.aggregate(CPU, A, T0 + 3, T0 + 21)
        db.compact()
        assert db.aggregate(CPU, A, T0 + 3, T0 + 21) == both
        assert both is not None and both.avg == sum(values[3:22]) / 19
        assert db.points(CPU, A, T0 + 23, T0 + 30) == [(T0 + 23, values[23]), (T0 + 24, values[24])]
        assert db.last(CPU, A, 100, T0 + 30) == Sample(CPU, values[24], A, T0 + 24)
        assert db.latest_ts(MEM) == T0 + 24


def test_rows_not_yet_compacted_survive_a_restart_and_are_compacted_later(path: Path) -> None:
    with TSDB(path, clock=Clock(), compact_rows=1000) as db:
        db.write(_series(CPU, A, [1.0, 2.0, 3.0]))
    with TSDB(path, clock=Clock(), compact_rows=4) as db:
        assert db.points(CPU, A, T0, T0 + 10) == [(T0, 1.0), (T0 + 1, 2.0), (T0 + 2, 3.0)]
        db.write([Sample(CPU, 4.0, A, T0 + 3)])
        db.flush()  # 3 rows left from before + 1: compacts
        assert db.points(CPU, A, T0, T0 + 10)[-1] == (T0 + 3, 4.0)
        recent = sqlite3.connect(path).execute("SELECT count(*) FROM frames").fetchone()[0]
        assert recent == 0


def _frames(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("SELECT count(*) FROM frames").fetchone()[0])
    finally:
        conn.close()


@pytest.mark.parametrize("series", [10, 100_000])
def test_frames_are_packed_at_an_age_however_many_series_write_them(path: Path, series: int) -> None:
    # A 10 s layout (PSI's) does not fill chunks in a minute; without the GC its frames
    # are packed once the oldest is compact_age old, as many of them as there are
    # series: a count of samples (600 000 before) came sooner the more pods wrote.
    clock = Clock()
    owners = [labels(pod_uid=str(i)) for i in range(series)]
    with TSDB(path, clock=clock, compact_age=60.0) as db:
        for second in range(0, 80, 10):
            clock.now = T0 + second
            db.write([Sample(CPU, float(second), lbl, 0.0) for lbl in owners])
            db.flush()
            assert _frames(path) == (second // 10 + 1 if second < 60 else second // 10 - 6), second
        packed = db.aggregate(CPU, owners[-1], T0, T0 + 80)
        assert packed is not None and (packed.count, packed.avg, packed.last) == (8, 35.0, 70.0)


def _full(db: TSDB) -> bool:
    return db.batch_full  # a call: mypy would take the property for constant after an assert


def test_a_full_batch_is_left_to_the_caller_when_it_asks(path: Path) -> None:
    with TSDB(path, max_batch=3, clock=Clock()) as db:
        db.write(_series(CPU, A, [1.0, 2.0]), flush_full=False)
        assert not _full(db)
        db.write(_series(CPU, A, [3.0], start=T0 + 2), flush_full=False)
        assert _full(db) and _frames(path) == 0  # not flushed by the write
        assert db.flush() == 3 and not _full(db)
        db.write(_series(CPU, A, [4.0, 5.0, 6.0], start=T0 + 3))  # the default flushes it
        assert not _full(db) and _frames(path) == 3


def test_gc_drops_points_past_retention_and_empty_series(path: Path) -> None:
    with TSDB(path, retention=100, clock=Clock()) as db:
        db.write(_series(CPU, A, [1.0] * 10, start=T0, step=20))  # T0 .. T0+180
        db.write(_series(CPU, B, [2.0] * 3, start=T0, step=10))  # T0 .. T0+20
        db.flush()
        result = db.gc(now=T0 + 200)  # keeps ts >= T0 + 100
        assert (result.points_deleted, result.series_deleted, result.capped) == (5 + 3, 1, False)
        assert db.series(CPU) == [A]
        assert [ts for ts, _ in db.points(CPU, A, 0, T0 + 1000)] == [T0 + 100 + 20 * i for i in range(5)]
        # A series GC dropped comes back with a fresh id when written again.
        db.write([Sample(CPU, 5.0, B, T0 + 201)])
        db.flush()
        assert db.points(CPU, B, 0, T0 + 1000) == [(T0 + 201, 5.0)]


def test_a_gc_that_drops_no_series_keeps_the_writers_series_ids(path: Path) -> None:
    """The writer knows each series' id; a GC that deleted no series leaves that as it
    was, so the next flush does not look every series up again (~6300 statements a GC
    at 110 pods); one that drops a series forgets them (test above: a fresh id)."""
    pods = [labels(pod_uid=f"p{i:03d}") for i in range(50)]
    with TSDB(path, retention=1000, clock=Clock()) as db:
        db.write([Sample(CPU, 1.0, lb, T0) for lb in pods])
        db.flush()
        statements: list[str] = []
        writer = db._writer
        assert writer is not None
        writer.set_trace_callback(statements.append)
        assert db.gc(now=T0 + 10).series_deleted == 0
        statements.clear()
        db.write([Sample(CPU, 2.0, lb, T0 + 20) for lb in pods])
        db.flush()
        lookups = [s for s in statements if "INSERT OR IGNORE INTO series" in s or "FROM series" in s]
        assert lookups == [], lookups[:3]
        assert db.points(CPU, pods[7], 0, T0 + 100) == [(T0, 1.0), (T0 + 20, 2.0)]
        assert db.gc(now=T0 + 1015).series_deleted == 0  # the newest sample is still in
        assert db.gc(now=T0 + 1025).series_deleted == 50
        statements.clear()
        db.write([Sample(CPU, 3.0, pods[0], T0 + 1030)])
        db.flush()
        assert any("INSERT OR IGNORE INTO series" in s for s in statements), "a dropped series is looked up again"
        assert db.points(CPU, pods[0], 0, T0 + 2000) == [(T0 + 1030, 3.0)]


def test_gc_size_cap_drops_the_oldest_points_and_shrinks_the_file(path: Path) -> None:
    pods = [labels(pod_uid=f"p{i:03d}") for i in range(50)]
    # All 3000 s raw: this is about the cap on raw samples (rollups: test_tsdb_rollup.py).
    # Noisy values: chunks deflate repetitive ones to ~1 byte, and then the file would
    # be mostly fixed overhead.
    rng = random.Random(3)
    with TSDB(path, clock=Clock(), raw_retention=3600) as db:
        for t in range(0, 3000, 100):
            db.write([Sample(CPU, rng.random(), lb, T0 + t + k) for k in range(100) for lb in pods])
            db.flush()
        uncapped = db.gc(now=T0 + 3000)  # under the default cap: compacts, checkpoints the WAL
        assert (uncapped.points_deleted, uncapped.capped) == (0, False)
        before = db.size_bytes()
        assert before == uncapped.size_after == path.stat().st_size
        cap = before // 2
        db.max_bytes = cap
        result = db.gc(now=T0 + 3000)
        assert result.capped
        assert result.size_before == before
        assert result.size_after <= cap
        assert path.stat().st_size <= cap
        assert db.size_bytes() == result.size_after
        assert not Path(f"{path}-wal").exists() or Path(f"{path}-wal").stat().st_size == 0
        kept = db.points(CPU, pods[0], 0, T0 + 3000)
        assert kept[-1][0] == T0 + 2999  # newest kept, oldest gone
        assert kept[0][0] > T0
        # Freed pages really went back: about half the points still fit under half the size.
        assert len(kept) >= 3000 * 0.35
        assert result.points_deleted == 50 * (3000 - len(kept))


def test_history_survives_a_restart(path: Path) -> None:
    with TSDB(path, clock=Clock()) as db:
        db.write(_series(CPU, A, [1.0, 2.0]))  # not flushed explicitly: close() flushes
        db.put_kv("node_cpu_info", {"cores": 8})
    with TSDB(path, clock=Clock()) as again:
        assert again.points(CPU, A, T0, T0 + 1) == [(T0, 1.0), (T0 + 1, 2.0)]
        assert again.get_kv("node_cpu_info") == {"cores": 8}
        again.write([Sample(CPU, 3.0, A, T0 + 2)])
        again.flush()
        assert again.series(CPU) == [A]
        agg = again.aggregate(CPU, A, T0, T0 + 2)
        assert agg is not None and agg.count == 3


def test_a_garbage_file_is_a_clear_error_naming_it(path: Path) -> None:
    path.parent.mkdir(parents=True)
    path.write_bytes(b"this is not a database, just some bytes " * 200)
    with pytest.raises(CorruptStore, match=str(path)):
        TSDB(path)


def test_another_programs_database_is_refused(path: Path) -> None:
    path.parent.mkdir(parents=True)
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    with pytest.raises(CorruptStore, match="not a metrics store"):
        TSDB(path)


def test_open_or_reset_moves_a_corrupt_file_aside_and_starts_fresh(path: Path) -> None:
    path.parent.mkdir(parents=True)
    garbage = b"garbage " * 1000
    path.write_bytes(garbage)
    with TSDB.open_or_reset(path, clock=Clock()) as db:
        db.write([Sample(CPU, 1.0, A, T0)])
        db.flush()
        assert db.series(CPU) == [A]
    aside = list(path.parent.glob("metrics.db.corrupt-*"))
    assert len(aside) == 1
    assert aside[0].read_bytes() == garbage


def test_open_or_reset_keeps_a_healthy_store(path: Path) -> None:
    with TSDB(path, clock=Clock()) as db:
        db.write([Sample(CPU, 1.0, A, T0)])
    with TSDB.open_or_reset(path) as db:
        assert db.points(CPU, A, T0, T0) == [(T0, 1.0)]
    assert not list(path.parent.glob("*.corrupt-*"))


def test_readonly_open_never_creates_the_file(path: Path) -> None:
    with pytest.raises(TSDBError, match="no such file"):
        TSDB.open_readonly(path)
    assert not path.exists()
    assert not path.parent.exists()


def test_readonly_store_reads_but_refuses_writes(path: Path) -> None:
    with TSDB(path, clock=Clock()) as db:
        db.write([Sample(CPU, 1.0, A, T0)])
        db.flush()
        with TSDB.open_readonly(path) as ro:
            # A reader in another process sees what the running writer flushed.
            assert ro.points(CPU, A, T0, T0) == [(T0, 1.0)]
            with pytest.raises(TSDBError, match="read-only"):
                ro.write([Sample(CPU, 2.0, A, T0 + 1)])
            with pytest.raises(TSDBError, match="read-only"):
                ro.put_kv("k", 1)
    with TSDB.open_readonly(path) as ro:
        assert ro.latest_ts(CPU) == T0
        assert ro.latest_ts(MEM) is None


def test_a_closed_store_says_so(path: Path) -> None:
    db = TSDB(path)
    db.close()
    db.close()
    with pytest.raises(TSDBError, match="closed"):
        db.aggregate(CPU, A, T0, T0)
    with pytest.raises(TSDBError, match="closed"):
        db.write([Sample(CPU, 1.0, A, T0)])


def test_newest_values_are_kept_until_a_series_is_silent_for_latest_keep(path: Path) -> None:
    from metrics.store.tsdb import LATEST_KEEP

    clock = Clock()
    with TSDB(path, clock=clock) as db:
        db.write([Sample(CPU, 1.0, A, T0), Sample(CPU, 2.0, B, T0)])
        db.write([Sample(CPU, 3.0, A, T0 + LATEST_KEEP)])
        assert sorted(db.newest_values()) == [(CPU, A, 3.0), (CPU, B, 2.0)]
        db.flush()
        db.gc(now=T0 + LATEST_KEEP + 1)
        assert db.newest_values() == [(CPU, A, 3.0)]
        assert db.last(CPU, B, LATEST_KEEP * 2, T0 + LATEST_KEEP + 1) == Sample(CPU, 2.0, B, T0), "from the file"


def test_newest_by_handle_is_the_latest_value_view(path: Path) -> None:
    """``newest(series_handle(...))``: the newest sample written, flushed or not, in any
    label order; out-of-order samples do not replace it; forgotten at GC like
    ``newest_values`` (the file still has it for ``last``)."""
    from metrics.store.tsdb import LATEST_KEEP

    clock = Clock()
    with TSDB(path, clock=clock) as db:
        a = db.series_handle(CPU, A)
        both = labels(pod_uid="a", container_id="c")
        assert db.series_handle(CPU, tuple(reversed(both))) == db.series_handle(CPU, both)
        assert db.newest(a) is None
        db.write([Sample(CPU, 1.0, A, T0)])
        assert db.newest(a) == (T0, 1.0)
        db.flush()
        db.write([Sample(CPU, 2.0, A, T0 + 2), Sample(CPU, 9.0, A, T0 + 1)])
        assert db.newest(a) == (T0 + 2, 2.0)
        assert db.newest(db.series_handle(CPU, B)) is None
        db.flush()
        db.gc(now=T0 + 2 + LATEST_KEEP + 1)
        assert db.newest(a) is None


def test_newest_many_is_newest_of_each_handle_in_order(path: Path) -> None:
    """One read of many series (one lock): the same as ``newest`` one by one, in the
    order asked, repeats included: unknown series None, flushed and unflushed samples,
    an out-of-order sample not replacing the newest, a series forgotten at GC None."""
    from metrics.store.tsdb import LATEST_KEEP

    with TSDB(path, clock=Clock()) as db:
        c = labels(pod_uid="c")
        handles = [db.series_handle(CPU, A), db.series_handle(MEM, A), db.series_handle(CPU, B),
                   db.series_handle(CPU, c), db.series_handle(CPU, A)]

        def one_by_one() -> list[tuple[float, float] | None]:
            return [db.newest(h) for h in handles]

        assert db.newest_many([]) == []
        assert db.newest_many(handles) == one_by_one() == [None] * 5
        db.write([Sample(CPU, 1.0, A, T0), Sample(MEM, 5.0, A, T0), Sample(CPU, 2.0, B, T0 + 1)])
        db.flush()
        db.write([Sample(CPU, 3.0, A, T0 + 3), Sample(CPU, 9.0, A, T0 + 2)])  # unflushed, out of order
        db.write([Sample(CPU, 4.0, c, T0 + 3 + LATEST_KEEP)])
        assert db.newest_many(handles) == one_by_one()
        assert db.newest_many(handles) == [(T0 + 3, 3.0), (T0, 5.0), (T0 + 1, 2.0), (T0 + 3 + LATEST_KEEP, 4.0),
                                           (T0 + 3, 3.0)]
        db.flush()
        db.gc(now=T0 + 3 + LATEST_KEEP + 1)
        assert db.newest_many(handles) == one_by_one() == [None, None, None, (T0 + 3 + LATEST_KEEP, 4.0), None]
        db.write([Sample(CPU, 6.0, A, T0 + LATEST_KEEP + 10)])  # a forgotten series written again
        assert db.newest_many(handles[:1]) == [(T0 + LATEST_KEEP + 10, 6.0)]

def test_series_since_lists_the_series_written_at_or_after_a_time(path: Path) -> None:
    """The series ``newest`` can read: canonical labels, each once whatever the label
    order written, sorted; a series whose newest sample is older than ``start`` is left
    out; forgotten at GC with the latest-value view; None on a read-only store."""
    from metrics.store.tsdb import LATEST_KEEP

    both = labels(pod_uid="a", container_id="c")
    with TSDB(path, clock=Clock()) as db:
        assert db.series_since(CPU, T0) == []
        db.write([Sample(CPU, 1.0, B, T0), Sample(CPU, 1.0, both, T0 + 5), Sample(MEM, 1.0, A, T0 + 5)])
        db.flush()
        db.write([Sample(CPU, 2.0, tuple(reversed(both)), T0 + 6)])
        assert db.series_since(CPU, T0) == sorted([canonical(B), canonical(both)])
        assert db.series_since(CPU, T0 + 1) == [canonical(both)]
        assert db.series_since(CPU, T0 + 7) == []
        assert db.series_since(MEM, T0) == [A]
        db.flush()
        db.gc(now=T0 + 5 + LATEST_KEEP + 1)
        assert db.series_since(CPU, T0) == [canonical(both)], "B silent past LATEST_KEEP: forgotten"
    with TSDB(path, readonly=True) as ro:
        assert ro.series_since(CPU, T0) is None


def test_a_gc_with_no_silent_series_keeps_the_newest_values_and_label_index_as_they_are(path: Path) -> None:
    """The newest-value record and the label-set index are replaced (readers go without
    a lock) only when a series is to leave them: a GC where every series is recent
    keeps the very same dicts (their copies were ~1 MiB at 110 pods at every GC); one
    past a series' ``LATEST_KEEP`` replaces them without it."""
    from metrics.store.tsdb import LATEST_KEEP

    with TSDB(path, clock=Clock()) as db:
        db.write([Sample(CPU, 1.0, A, T0), Sample(CPU, 1.0, B, T0 + 100)])
        db.flush()
        latest, keys, names = db._latest, db._keys, db._key_labels
        db.gc(now=T0 + LATEST_KEEP - 1)
        assert db._latest is latest and db._keys is keys and db._key_labels is names
        assert db.state()["series_in_memory"] == 2
        db.gc(now=T0 + LATEST_KEEP + 1)
        assert db._latest is not latest and db._keys is not keys
        assert db.state()["series_in_memory"] == 1 and db.state()["label_sets_cached"] == 1
        assert db.newest_many([db.series_handle(CPU, A), db.series_handle(CPU, B)]) == [None, (T0 + 100, 1.0)]


def test_gc_forgets_the_label_sets_of_series_silent_past_latest_keep(path: Path) -> None:
    """Pod churn: the label-set index of series whose pods are gone (silent past
    ``LATEST_KEEP``) is dropped at GC, not kept until 100 000 label sets pile up
    (memory grew with every pod ever seen); a series that comes back is indexed anew."""
    from metrics.store.tsdb import LATEST_KEEP

    clock = Clock()
    gone = [labels(pod_uid=f"gone-{i}", container="app") for i in range(500)]
    with TSDB(path, clock=clock) as db:
        db.write([Sample(metric, 1.0, lb, T0) for lb in gone for metric in (CPU, MEM)])
        db.write([Sample(CPU, 2.0, A, T0 + LATEST_KEEP)])
        assert db.state()["label_sets_cached"] == 1001 and db.state()["series_in_memory"] == 1001
        db.flush()
        db.gc(now=T0 + LATEST_KEEP + 1)
        assert db.state()["label_sets_cached"] == 1, "only A, written within LATEST_KEEP"
        assert db.state()["series_in_memory"] == 1
        back = labels(container="app", pod_uid="gone-7")  # another order: the same series
        db.write([Sample(CPU, 3.0, back, T0 + LATEST_KEEP + 2)])
        assert sorted(db.newest_values()) == sorted([(CPU, A, 2.0), (CPU, canonical(back), 3.0)])
        db.flush()
        assert db.aggregate(CPU, gone[7], T0, T0 + LATEST_KEEP + 2) == db.aggregate(CPU, back, T0, T0 + LATEST_KEEP + 2)
        assert db.points(CPU, gone[7], T0, T0 + LATEST_KEEP + 2) == [(T0, 1.0), (T0 + LATEST_KEEP + 2, 3.0)]
