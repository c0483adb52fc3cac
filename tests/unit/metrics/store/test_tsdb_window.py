"""A window view (``metrics.store.tsdbwindow``) answers as ``aggregate_many`` does,
while reading only what can have changed since its last read (issue 29: the QoS round's
BE window decoded 300 s of samples every second to learn about one new one)."""

from __future__ import annotations

import errno
import random
from pathlib import Path

from metrics.model import NO_LABELS, Labels, Sample, WindowViews, labels
from metrics.store.tsdb import TSDB
from metrics.store.tsdbwindow import ChangeLog

SERIES: list[tuple[str, Labels]] = [("be_cpu", NO_LABELS), ("be_request", NO_LABELS),
                                    ("pod_cpu", labels(pod_uid="a")), ("never_written", NO_LABELS)]
T0 = 1_800_000_000.0


def _check(store: TSDB, view: object, start: float, end: float) -> None:
    assert isinstance(store, WindowViews) and view is not None
    want = dict(store.aggregate_many(SERIES, start, end))
    assert view.aggregate(start, end) == want  # type: ignore[attr-defined]


def test_the_view_matches_aggregate_many_through_late_flushes_compaction_gc_and_a_full_disk(tmp_path: Path) -> None:
    clock = [T0]
    # A retention shorter than the window: each GC drops samples the view had read.
    store = TSDB(tmp_path / "m.db", clock=lambda: clock[0], compact_rows=400, retention=50.0, raw_retention=50.0)
    view = store.window_view(SERIES)
    assert view is not None
    rng = random.Random(29)
    window = 60.0
    degraded_steps = 0
    for step in range(600):
        clock[0] += 1.0
        now = clock[0]
        # Each tick's samples, some series missing now and then (layouts change), some late.
        batch = [Sample(m, rng.random(), lbl, now - rng.choice((0.0, 0.0, 0.25)))
                 for m, lbl in SERIES[:3] if rng.random() > 0.1]
        if rng.random() < 0.1:  # a sample stamped up to 20 s ago (late, out of order)
            batch.append(Sample("be_cpu", rng.random(), NO_LABELS, now - rng.uniform(1, 20)))
        if batch:
            store.write(batch)
        if step % 2 == 0 or rng.random() < 0.3:
            store.flush()
        if step % 157 == 156:
            store.gc(now)
        if step in (250, 400):  # the disk fills: writes stay in memory, reads add them
            store._degrade(OSError(errno.ENOSPC, "full"), now)
            degraded_steps += 1
        end = now - (5.0 if step == 300 else 0.0)  # once, the end goes back (a clock step)
        _check(store, view, end - window, end)
        if rng.random() < 0.05:  # a read of a shorter window (its start moves forward)
            _check(store, view, end - window / 2, end)
    assert degraded_steps == 2 and not store.degraded  # each degradation recovered at a later flush
    stats = view.full_reads, view.partial_reads  # type: ignore[attr-defined]
    assert stats[1] > 10 * stats[0] > 0, stats  # mostly the part that can have changed


def test_without_a_flush_since_the_view_reads_nothing(tmp_path: Path) -> None:
    clock = [T0]
    store = TSDB(tmp_path / "m.db", clock=lambda: clock[0])
    store.write([Sample("be_cpu", 1.0, NO_LABELS, T0 - 1)])
    store.flush()
    view = store.window_view(SERIES)
    assert view is not None
    reads: list[tuple[int, int]] = []
    raw = view._raw  # type: ignore[attr-defined]
    view._raw = lambda series, lo, hi: reads.append((lo, hi)) or raw(series, lo, hi)  # type: ignore[attr-defined]
    first = view.aggregate(T0 - 60, T0)
    assert first[("be_cpu", NO_LABELS)].count == 1 and reads == [(int((T0 - 60) * 1000), int(T0 * 1000))]
    store.write([Sample("be_cpu", 3.0, NO_LABELS, T0 + 0.5)])  # in the batch, not flushed: not readable
    assert view.aggregate(T0 - 59, T0 + 1) == first
    assert reads[-1] == (int(T0 * 1000) + 1, int((T0 + 1) * 1000))  # only past the last read's end
    store.flush()
    second = view.aggregate(T0 - 58, T0 + 2)
    assert second[("be_cpu", NO_LABELS)].count == 2 and second[("be_cpu", NO_LABELS)].avg == 2.0
    assert reads[-1] == (int((T0 + 0.5) * 1000), int((T0 + 2) * 1000))  # from the flushed sample's time


def test_the_change_log_says_when_it_no_longer_reaches_back() -> None:
    log = ChangeLog(kept=3)
    seq = log.seq
    assert log.oldest_since(seq) is not None and log.oldest_since(seq) > 10**15  # nothing since
    log.note(500)
    log.note(300)
    assert log.oldest_since(seq) == 300 and log.oldest_since(log.seq - 1) == 300
    log.note(900)
    log.note(950)
    assert log.oldest_since(seq) is None  # the first change fell out: read everything
    assert log.oldest_since(log.seq - 2) == 900


def test_a_read_only_store_keeps_no_view(tmp_path: Path) -> None:
    TSDB(tmp_path / "m.db").close()
    store = TSDB(tmp_path / "m.db", readonly=True)
    try:
        assert store.window_view(SERIES) is None
    finally:
        store.close()
