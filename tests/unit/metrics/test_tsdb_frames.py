"""The raw tier's frames (one row per ``write()``): reads before and after compaction,
layouts that change between ticks, rewrites and out-of-order samples, older schemas,
damaged frames."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from metrics.model import Labels, Sample, labels
from metrics.store.tsdb import TSDB, CorruptStore

CPU = "pod_cpu_usage_cores"
MEM = "pod_memory_used_bytes"
T0 = 1_700_000_000.0
PODS = [labels(pod_uid=f"p{i}") for i in range(6)]


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _frames(path: Path) -> int:
    return int(sqlite3.connect(path).execute("SELECT count(*) FROM frames").fetchone()[0])


def _tick(db: TSDB, now: float, pods: list[Labels], expected: dict[tuple[str, Labels], list[tuple[float, float]]],
          rng: random.Random) -> None:
    """One collector tick: every pod's CPU and memory at ``now`` (ts 0: stamped ``now``)."""
    samples = []
    for lb in pods:
        for metric in (CPU, MEM):
            value = rng.random() if metric == CPU else float(rng.randrange(1 << 30))
            samples.append(Sample(metric, value, lb, 0.0))
            expected.setdefault((metric, lb), []).append((now, value))
    db.write(samples, now)
    db.flush()


def test_changing_layouts_read_the_same_before_and_after_compaction(tmp_path: Path) -> None:
    """Pods come and go between ticks, so frames have several layouts; every series
    reads back exactly, from frames, then from chunks."""
    rng = random.Random(7)
    expected: dict[tuple[str, Labels], list[tuple[float, float]]] = {}
    path = tmp_path / "m.db"
    with TSDB(path, clock=Clock(), compact_rows=10**9) as db:
        for t in range(40):
            pods = PODS[:4] if t < 15 else PODS[2:] if t < 30 else PODS  # three layouts
            if t % 7 == 3:
                pods = pods[::-1]  # same series, another order: a fourth layout
            _tick(db, T0 + t, pods, expected, rng)
        assert _frames(path) == 40
        before = {key: db.points(*key, T0, T0 + 100) for key in expected}
        many = db.aggregate_many(list(expected), T0 + 5, T0 + 35)
        every = db.aggregate_all(CPU, T0 + 5, T0 + 35)
        last = db.last(CPU, PODS[0], 100, T0 + 100)
        latest = db.latest_ts(MEM)
        db.compact()
        assert _frames(path) == 0
        for key, points in expected.items():
            assert before[key] == points
            assert db.points(*key, T0, T0 + 100) == points
        assert db.aggregate_many(list(expected), T0 + 5, T0 + 35) == many
        assert db.aggregate_all(CPU, T0 + 5, T0 + 35) == every
        assert every[PODS[5]].count == 21 and every[PODS[0]].count == 16  # t 15..35; 5..14 and 30..35
        assert db.last(CPU, PODS[0], 100, T0 + 100) == last == Sample(CPU, expected[(CPU, PODS[0])][-1][1], PODS[0],
                                                                        T0 + 39)
        assert db.latest_ts(MEM) == latest == T0 + 39


def test_a_fresh_reader_sees_frames_of_another_process(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    with TSDB(path, clock=Clock()) as db:
        db.write([Sample(CPU, 0.5, PODS[0], T0), Sample(CPU, 0.25, PODS[1], T0 + 0.5)])
        db.flush()
        reader = TSDB.open_readonly(path)
        assert reader.points(CPU, PODS[1], T0, T0 + 1) == [(T0 + 0.5, 0.25)]  # per-sample times kept
        assert reader.latest_ts(CPU) == T0 + 0.5
        reader.close()


def test_a_rewrite_and_an_older_sample_compact_at_once_and_the_later_write_wins(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    with TSDB(path, clock=Clock(), compact_rows=10**9) as db:
        db.write([Sample(CPU, float(i), PODS[0], T0 + i) for i in range(10)])
        db.flush()
        assert _frames(path) == 1  # in order: stays a frame
        db.write([Sample(CPU, 50.0, PODS[0], T0 + 4), Sample(CPU, 0.5, PODS[0], T0 - 1)])
        db.flush()
        assert _frames(path) == 0, "out of order: compacted in the flush's transaction"
        want = [(T0 - 1, 0.5)] + [(T0 + i, 50.0 if i == 4 else float(i)) for i in range(10)]
        assert db.points(CPU, PODS[0], T0 - 10, T0 + 10) == want
        # The same time twice in one write: the second value.
        db.write([Sample(CPU, 1.0, PODS[1], T0), Sample(CPU, 2.0, PODS[1], T0)])
        db.flush()
        assert db.points(CPU, PODS[1], T0 - 10, T0 + 10) == [(T0, 2.0)]
        # Past the newest chunk again: merged with it, nothing lost.
        db.write([Sample(CPU, 11.0, PODS[0], T0 + 11)])
        db.flush()
        db.compact()
        assert db.points(CPU, PODS[0], T0 - 10, T0 + 20) == [*want, (T0 + 11, 11.0)]


def test_a_restarted_writer_merges_frames_overlapping_older_chunks(tmp_path: Path) -> None:
    """A new writer knows nothing of the chunks' times: it must look (clock went back)."""
    path = tmp_path / "m.db"
    with TSDB(path, clock=Clock()) as db:
        db.write([Sample(CPU, float(i), PODS[0], T0 + i) for i in range(10)])
        db.flush()
        db.compact()
    with TSDB(path, clock=Clock()) as db:
        db.write([Sample(CPU, 99.0, PODS[0], T0 + 5), Sample(CPU, 98.0, PODS[0], T0 + 20)])
        db.flush()
        assert _frames(path) == 1, "in order as far as this writer knows"
        db.compact()
        db.write([Sample(CPU, 77.0, PODS[0], T0 + 7)])  # inside the merged chunk's span
        db.flush()
        got = db.points(CPU, PODS[0], T0, T0 + 30)
    assert got == [(T0 + i, {5: 99.0, 7: 77.0}.get(i, float(i))) for i in range(10)] + [(T0 + 20, 98.0)]


def test_schema_2_files_are_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE series (id INTEGER PRIMARY KEY AUTOINCREMENT, metric TEXT NOT NULL, labels TEXT NOT NULL,"
        " UNIQUE (metric, labels));"
        "CREATE TABLE recent (ts INTEGER NOT NULL, series_id INTEGER NOT NULL, value REAL NOT NULL,"
        " PRIMARY KEY (ts, series_id)) WITHOUT ROWID;"
        "CREATE TABLE chunks (id INTEGER PRIMARY KEY, series_id INTEGER NOT NULL, lo INTEGER NOT NULL,"
        " hi INTEGER NOT NULL, n INTEGER NOT NULL, data BLOB NOT NULL);"
        "CREATE INDEX chunks_by_series ON chunks (series_id, lo, hi);"
        "CREATE TABLE rollups (series_id INTEGER NOT NULL, start INTEGER NOT NULL, n INTEGER NOT NULL,"
        " total REAL NOT NULL, vmin REAL NOT NULL, vmax REAL NOT NULL, last REAL NOT NULL,"
        " first_off INTEGER NOT NULL, last_off INTEGER NOT NULL, PRIMARY KEY (series_id, start)) WITHOUT ROWID;"
        "CREATE TABLE kv (key TEXT PRIMARY KEY, value TEXT NOT NULL, updated REAL NOT NULL);"
        """INSERT INTO series (metric, labels) VALUES ('pod_cpu_usage_cores', '{"pod_uid":"p0"}');"""
        "PRAGMA user_version = 2;"
    )
    conn.executemany("INSERT INTO recent VALUES (?, 1, ?)", [(int(T0 * 1000) + 1000 * i, i / 8) for i in range(30)])
    conn.commit()
    conn.close()
    with pytest.raises(Exception, match="schema 2: the agent upgrades it"):
        TSDB.open_readonly(path)
    with TSDB(path, clock=Clock()) as db:
        assert db.points(CPU, PODS[0], T0, T0 + 60) == [(T0 + i, i / 8) for i in range(30)]
        db.write([Sample(CPU, 7.0, PODS[0], T0 + 30)])
    check = sqlite3.connect(path)
    assert check.execute("PRAGMA user_version").fetchone()[0] == 3
    assert check.execute("SELECT count(*) FROM sqlite_master WHERE name = 'recent'").fetchone()[0] == 0
    with TSDB.open_readonly(path) as db:
        assert db.points(CPU, PODS[0], T0 + 29, T0 + 60) == [(T0 + 29, 29 / 8), (T0 + 30, 7.0)]


def test_a_damaged_frame_is_a_clear_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    with TSDB(path, clock=Clock()) as db:
        db.write([Sample(CPU, 1.0, lb, T0) for lb in PODS])
        db.flush()
        conn = sqlite3.connect(path)
        conn.execute("UPDATE frames SET vals = substr(vals, 1, 20)")
        conn.commit()
        with pytest.raises(CorruptStore, match=f"{path}.*damaged frame"):
            db.points(CPU, PODS[0], T0, T0 + 1)
        with pytest.raises(CorruptStore, match=f"{path}.*compaction failed.*damaged frame"):
            db.compact()


def test_a_layout_is_packed_once_it_fills_chunks_and_slower_ones_wait_for_the_gc(tmp_path: Path) -> None:
    """Every second three series, every ten seconds two others: at 120 frames the fast
    layout becomes full 120-sample chunks; the slow one stays in frames until the GC."""
    rng = random.Random(3)
    expected: dict[tuple[str, Labels], list[tuple[float, float]]] = {}
    path = tmp_path / "m.db"
    clock = Clock()
    with TSDB(path, clock=clock, compact_rows=10**9, raw_retention=3600, retention=7200) as db:
        for t in range(130):
            clock.now = T0 + t
            _tick(db, T0 + t, PODS[:1], expected, rng)  # 2 series: CPU and memory of pod 0
            if t % 10 == 0:
                _tick(db, T0 + t + 0.5, PODS[4:], expected, rng)  # 4 series, every 10 s
        conn = sqlite3.connect(path)
        chunks = conn.execute("SELECT n, count(*) FROM chunks GROUP BY n").fetchall()
        assert chunks == [(120, 2)], "the fast layout's first 120 frames, as full chunks"
        assert _frames(path) == 10 + 13  # the fast layout's last 10, the slow one's 13
        for key, points in expected.items():
            assert db.points(*key, T0, T0 + 200) == points
        db.gc(now=T0 + 130)
        assert _frames(path) == 0
        assert conn.execute("SELECT sum(n) FROM chunks").fetchone()[0] == 2 * 130 + 4 * 13
        for key, points in expected.items():
            assert db.points(*key, T0, T0 + 200) == points


def test_a_query_fetches_only_the_frames_of_layouts_holding_its_series(tmp_path: Path) -> None:
    """Two collectors write frames of two layouts; a window query for one's series
    fetches only that layout's frames (one frame's ids tell: ``layout`` is a 62-bit hash
    of the id array), and a frame whose layout is an older CRC-32 is always fetched
    (two id arrays may share one). Every read still sees every sample."""
    import zlib

    from metrics.store import tsdbframes as f

    path = tmp_path / "m.db"
    db = TSDB(path, clock=Clock())
    node = labels()
    for t in range(5):
        db.write([Sample(CPU, float(t), lb, T0 + t) for lb in PODS], T0 + t)
        db.write([Sample("node_cpu_usage_cores", 10.0 + t, node, T0 + t)], T0 + t)
    db.flush()
    conn = sqlite3.connect(path)
    ids = {str(text): int(i) for i, text in conn.execute("SELECT id, labels FROM series WHERE metric = ?", (CPU,))}
    pod_ids = set(ids.values())
    node_id = int(conn.execute("SELECT id FROM series WHERE metric = 'node_cpu_usage_cores'").fetchone()[0])
    layouts = {int(layout) for (layout,) in conn.execute("SELECT layout FROM frames")}
    assert len(layouts) == 2 and all(layout >= f.HASHED_LAYOUT for layout in layouts)
    window = (int(T0 * 1000), int((T0 + 10) * 1000))
    assert len(list(f._frames_in(conn, *window, {node_id}))) == 5, "the node collector's frames only"
    assert len(list(f._frames_in(conn, *window, pod_ids))) == 5
    assert len(list(f._frames_in(conn, *window, pod_ids | {node_id}))) == 10
    assert list(f._frames_in(conn, *window, {max(pod_ids | {node_id}) + 100})) == []
    # A frame as the code before wrote it: CRC-32 layout, fetched whatever it holds.
    raw = f.frame_row([node_id], [window[0] + 7000], [99.0])
    conn.execute(f.INSERT_FRAME, (zlib.crc32(raw[4]), *raw[1:]))
    conn.commit()
    assert len(list(f._frames_in(conn, *window, pod_ids))) == 6
    conn.close()
    assert f.layout_of(b"\x01" * 8) == f.layout_of(b"\x01" * 8) != f.layout_of(b"\x02" * 8)
    assert [v for _, v in db.points("node_cpu_usage_cores", node, T0, T0 + 10)] == [10, 11, 12, 13, 14, 99]
    assert db.aggregate(CPU, PODS[0], T0, T0 + 10).count == 5  # type: ignore[union-attr]
    db.close()


def test_a_window_read_holds_one_frame_at_a_time(tmp_path: Path) -> None:
    """A window's frames are streamed from the cursor, not fetched into a list: reading
    one series over the frames left of 200 writes of 1000 series each (the older ones are
    compacted into chunks; ~16 KB of values and ids a frame) stays well under their size
    (the list held them all, and every NodeMetric build's peak with them)."""
    import tracemalloc

    from metrics.store import tsdbframes as f

    path = tmp_path / "m.db"
    db = TSDB(path, clock=Clock())
    many = [labels(pod_uid=f"u{i}") for i in range(1000)]
    for t in range(200):
        db.write([Sample(CPU, float(t + i), lb, T0 + t) for i, lb in enumerate(many)], T0 + t)
    db.flush()
    db.close()
    conn = sqlite3.connect(path)
    try:
        (frames, blob_bytes), = conn.execute("SELECT count(*), sum(length(vals) + length(ids)) FROM frames")
        assert frames >= 50, "most samples are still in frames (the rest in chunks)"
        sid = int(conn.execute("SELECT id FROM series WHERE labels LIKE '%u7\"%'").fetchone()[0])
        window = (int(T0 * 1000), int((T0 + 300) * 1000))
        tracemalloc.start()
        try:
            got = f.raw_window_many(conn, [sid], *window)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    finally:
        conn.close()
    assert list(got[sid].vals)[:3] == [7.0, 8.0, 9.0] and len(got[sid]) == 200
    assert peak < blob_bytes / 4, f"peak {peak} B while reading frames of {blob_bytes} B"


def _one_layout(path: Path, series: int, ticks: int) -> list[Labels]:
    """``ticks`` frames of one layout (``series`` pods' CPU, value ``t + i``), below a
    chunk's 120 samples: nothing is compacted yet. Returns the pods' labels."""
    db = TSDB(path, clock=Clock())
    many = [labels(pod_uid=f"u{i}") for i in range(series)]
    for t in range(ticks):
        db.write([Sample(CPU, float(t + i), lb, T0 + t) for i, lb in enumerate(many)], T0 + t)
    db.flush()
    db.close()
    return many


def _traced_compaction(path: Path) -> tuple[int, int, int, int]:
    """``tsdbcompact.compact`` of every frame of the file at ``path``, traced:
    ``(frames, their blobs' bytes, samples moved, peak traced bytes)``."""
    import tracemalloc

    from metrics.store import tsdbcompact as c

    conn = sqlite3.connect(path)
    try:
        (frames, blob_bytes), = conn.execute(
            "SELECT count(*), sum(length(vals) + length(ids) + coalesce(length(ts), 0)) FROM frames")
        conn.execute("BEGIN")
        tracemalloc.start()
        try:
            moved = c.compact(conn, None)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        conn.commit()
        assert conn.execute("SELECT count(*) FROM frames").fetchone()[0] == 0
    finally:
        conn.close()
    return frames, blob_bytes, moved, peak


def test_a_compaction_decodes_frames_as_they_stream(tmp_path: Path) -> None:
    """Compacting 110 frames of 1000 series holds less than the frames' own size at its
    peak: each frame is decoded as it comes, and a series is sliced out when it is stored
    (before: the frames as a list, their decoded copy and every series' slice at once,
    2.2 times the frames' size). The samples all arrive, in order."""
    path = tmp_path / "m.db"
    _one_layout(path, 1000, 110)
    frames, blob_bytes, moved, peak = _traced_compaction(path)
    assert frames == 110 and moved == 110 * 1000
    assert peak < blob_bytes, f"peak {peak} B while compacting frames of {blob_bytes} B"
    reopened = TSDB(path, clock=Clock())
    try:
        got = reopened.points(CPU, labels(pod_uid="u7"), T0, T0 + 200)
    finally:
        reopened.close()
    assert [v for _, v in got] == [float(t + 7) for t in range(110)]


def test_a_full_compaction_holds_one_layouts_frames_at_a_time(tmp_path: Path) -> None:
    """Two collectors' layouts (their own series): the full compaction before a GC
    decodes and stores one layout, then the other, so its peak is about one layout's,
    not both (all of them together were the GC's peak RSS: 5 MiB at 110 pods)."""
    path = tmp_path / "m.db"
    db = TSDB(path, clock=Clock())
    first = [labels(pod_uid=f"u{i}") for i in range(1000)]
    second = [labels(pod_uid=f"v{i}") for i in range(1000)]
    for t in range(100):  # below a chunk's 120 samples: nothing is compacted yet
        db.write([Sample(CPU, float(t + i), lb, T0 + t) for i, lb in enumerate(first)], T0 + t)
        db.write([Sample(MEM, float(t * i), lb, T0 + t) for i, lb in enumerate(second)], T0 + t)
    db.flush()
    db.close()
    frames, blob_bytes, moved, peak = _traced_compaction(path)
    assert frames == 2 * 100 and moved == 2 * 100 * 1000
    # One layout's decoded values and chunks at a time: 1.65 MB here; both at once 2.73.
    assert peak < 0.6 * blob_bytes, f"peak {peak} B while compacting two layouts of {blob_bytes} B"
    reopened = TSDB(path, clock=Clock())
    try:
        assert reopened.points(CPU, first[7], T0, T0 + 200)[-1] == (T0 + 99, 106.0)
        assert reopened.points(MEM, second[3], T0, T0 + 200)[:2] == [(T0, 0.0), (T0 + 1, 3.0)]
    finally:
        reopened.close()


def test_a_compaction_holds_a_slice_of_a_layouts_series_not_the_layout(tmp_path: Path) -> None:
    """One layout of 3000 series x 100 frames (PSI's at 110 pods is 5600 x 28): its
    frames are read a slice of series at a time, so the compaction's peak is a small part
    of the layout (the layout decoded at once and every series' chunks built before one
    was inserted: 0.76 of its frames' size; a slice at a time: 0.09), and every sample arrives."""
    path = tmp_path / "m.db"
    many = _one_layout(path, 3000, 100)
    frames, blob_bytes, moved, peak = _traced_compaction(path)
    assert frames == 100 and moved == 100 * 3000
    assert peak < 0.2 * blob_bytes, f"peak {peak} B while compacting a layout of {blob_bytes} B"
    reopened = TSDB(path, clock=Clock())
    try:
        for i in (0, 1234, 2999):
            assert reopened.points(CPU, many[i], T0, T0 + 200) == [(T0 + t, float(t + i)) for t in range(100)]
    finally:
        reopened.close()


def test_two_id_arrays_of_one_older_layout_compact_apart_and_the_later_write_wins(tmp_path: Path) -> None:
    """An older file's CRC-32 layout can hold two id arrays: each is compacted as its
    own, and a series in both, written twice for one time, keeps the later write
    (a frame of the other array in between)."""
    from metrics.store import tsdbframes as f

    path = tmp_path / "m.db"
    db = TSDB(path, clock=Clock())
    for lb in PODS[:3]:  # one at a time: their ids ascend in this order
        db.write([Sample(CPU, 0.0, lb, T0)], T0)
        db.flush()
    conn = sqlite3.connect(path)
    ids = [int(i) for (i,) in conn.execute("SELECT id FROM series ORDER BY id")]
    conn.execute("DELETE FROM frames")
    t0 = int(T0 * 1000)
    rows = [f.frame_row(ids[:2], [t0 + 1000] * 2, [1.0, 2.0]),  # series 0 and 1 at t0 + 1 s
            f.frame_row(ids[1:], [t0 + 1000] * 2, [20.0, 30.0]),  # series 1 again (later), and 2
            f.frame_row(ids[:2], [t0 + 2000] * 2, [3.0, 4.0])]
    for row in rows:
        conn.execute(f.INSERT_FRAME, (7, *row[1:]))  # one old-style layout for all
    conn.commit()
    conn.close()
    db.compact()
    assert _frames(path) == 0
    assert db.points(CPU, PODS[0], T0 + 0.5, T0 + 5) == [(T0 + 1, 1.0), (T0 + 2, 3.0)]
    assert db.points(CPU, PODS[1], T0 + 0.5, T0 + 5) == [(T0 + 1, 20.0), (T0 + 2, 4.0)]
    assert db.points(CPU, PODS[2], T0 + 0.5, T0 + 5) == [(T0 + 1, 30.0)]
    db.close()


def test_the_writers_sqlite_memory_during_a_compaction_stays_near_its_page_cache(tmp_path: Path) -> None:
    """SQLite's own memory (not Python's: its page cache stays resident once filled)
    from opening the writer to the end of a compaction of 110 frames of 2000 series
    (~2.4 MB of blobs) in one transaction: the compaction stores a slice of series at a
    time, so a 512 KiB cache holds its pages; with the 1 MiB cache before, SQLite's
    memory grew by 1.15 MiB."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("sqlite3")
    if name is None:
        pytest.skip("no shared libsqlite3 to ask")
    lib = ctypes.CDLL(name)
    lib.sqlite3_memory_used.restype = ctypes.c_int64
    lib.sqlite3_memory_highwater.restype = ctypes.c_int64
    lib.sqlite3_memory_highwater.argtypes = [ctypes.c_int]
    path = tmp_path / "m.db"
    _one_layout(path, 2000, 110)
    probe = sqlite3.connect(":memory:")  # counted if that library is the one Python's sqlite3 uses
    counted = lib.sqlite3_memory_used() > 0
    probe.close()
    if not counted:
        pytest.skip(f"{name} is not the library Python's sqlite3 uses (no memory counted)")
    before = lib.sqlite3_memory_used()
    lib.sqlite3_memory_highwater(1)  # reset the high-water mark to what is in use now
    db = TSDB(path, clock=Clock())  # its open counts the frames' samples: a full scan
    try:
        db.compact()
        grew = lib.sqlite3_memory_highwater(0) - before
    finally:
        db.close()
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT count(*) FROM frames").fetchone()[0] == 0
        assert conn.execute("SELECT sum(n) FROM chunks").fetchone()[0] == 2000 * 110
    finally:
        conn.close()
    assert grew < 900 * 1024, f"SQLite memory grew by {grew / 1024:.0f} KiB (650 with a 512 KiB cache)"


def test_chunk_bounds_answer_as_a_dict_would_in_a_third_of_its_table() -> None:
    """The writer's bound of every series' chunks (kept between compactions): the same
    answers as the dict it replaced, for ids set in any order, at 16 bytes a series
    (6300 series at 110 pods: the dict's table alone held 0.29 MiB, its int objects
    read from SQLite another ~0.36)."""
    import tracemalloc

    from metrics.store import tsdbquery as q

    rng = random.Random(7)
    pairs = [(sid, 1_700_000_000_000 + rng.randrange(10**6)) for sid in rng.sample(range(1, 9000), 6300)]
    tracemalloc.start()
    try:
        bounds = q.ChunkBounds(iter(pairs))
        compact, _ = tracemalloc.get_traced_memory()
        base = compact
        as_dict = dict(pairs)
        as_dict_size = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(bounds) == 6300 and compact < as_dict_size / 2.5, (compact, as_dict_size)
    for sid in [*rng.sample(range(0, 9100), 500), 9000, 0, -5]:
        assert bounds.get(sid) == as_dict.get(sid, q.NO_CHUNKS)
    for sid in [*rng.sample(range(0, 9100), 300), 10**12]:  # updates and new ids, interleaved
        hi = rng.randrange(10**13)
        bounds[sid] = as_dict[sid] = hi
    assert len(bounds) == len(as_dict)
    assert all(bounds.get(sid) == hi for sid, hi in as_dict.items())
    assert list(bounds._ids) == sorted(as_dict)
