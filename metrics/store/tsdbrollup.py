"""The rollup tier of ``metrics.store.tsdb.TSDB``, and retention.

Raw samples are kept for ``raw_retention`` (35 min: the longest NodeMetric window,
30 min, needs 1 s resolution). GC folds older ones into per-series buckets aligned to
``rollup_step`` (60 s) and, past ``coarse_after`` (2 h), to ``coarse_step`` (5 min),
each holding count, sum, min, max, and the first/last sample time and the last value.
Buckets are kept until ``retention`` (12 h). At 1 Hz that is 60-300 samples in one
~64-byte row. Measured at 2000 series x 1 Hz over 12 h: 30 MiB of raw chunks (35 min)
and 25 MiB of buckets, 56 MiB in all under the 100 MiB default cap.

A fold takes whole chunks: those ending before the raw cut, found in one index scan
and deleted in one statement. The chunk straddling the cut stays raw (at most one per
series, 2-5 minutes of it) and goes at a later fold; its samples are then added to
the buckets that already hold the older part of their interval, as a sample written
after its bucket was folded always is (a sample written twice is then counted twice:
the replace-on-rewrite of the raw tier ends at the fold). Splitting that chunk instead
would decode and re-encode one chunk per series at every fold. Series with fewer than
``SPARSE`` samples per step (PSI every 10 s) fold straight into coarse buckets: a
60 s bucket of 6 samples saves little over the samples, and PSI is most of the series.

Fold, coarsening and retention run in one transaction, so a reader sees every sample
exactly once, raw or folded.

Queries combine the tiers. A bucket is part of a window ``[start, end]`` when all its
samples are (``start <= bucket start`` and ``last sample <= end``): a bucket straddling
an edge is left out whole, so results never include samples from outside the window
but may miss up to one bucket's worth at either edge of its rolled-up part. Counts,
sums (hence averages), first/last times and the last value stay exact. Percentiles are
an approximation: each bucket stands for ``count`` samples all equal to its mean; raw
samples count as themselves. Windows entirely in the raw tier are exact as before.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import operator
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

from metrics.model import Aggregate, Labels, Mean
from metrics.store import tsdbquery as q
from metrics.store.tsdbcols import Columns, Sums, summarize

_COLUMNS: Final = "start, n, total, vmin, vmax, last, first_off, last_off"
# ?1 series id / metric, ?2 first ms, ?3 last ms: buckets wholly inside the window.
BUCKETS_ONE: Final = (
    f"SELECT {_COLUMNS} FROM rollups WHERE series_id = ?1 AND start BETWEEN ?2 AND ?3 AND start + last_off <= ?3"
)
BUCKETS_ALL: Final = (
    "SELECT s.labels, r.start, r.n, r.total, r.vmin, r.vmax, r.last, r.first_off, r.last_off"
    " FROM series s JOIN rollups r ON r.series_id = s.id"
    " WHERE s.metric = ?1 AND r.start BETWEEN ?2 AND ?3 AND r.start + r.last_off <= ?3"
)
# ?4: the longest step, so the scan is bounded below.
LAST_BUCKET: Final = (
    "SELECT start + last_off, last FROM rollups WHERE series_id = ?1 AND start BETWEEN ?2 - ?4 AND ?3"
    " AND start + last_off BETWEEN ?2 AND ?3 ORDER BY start + last_off DESC LIMIT 1"
)
_INSERT: Final = f"INSERT INTO rollups (series_id, {_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
# A late sample's bucket may exist already: merge into it. SET sees the old row's values.
UPSERT: Final = (
    f"{_INSERT} ON CONFLICT (series_id, start) DO UPDATE SET n = n + excluded.n, total = total + excluded.total,"
    " vmin = min(vmin, excluded.vmin), vmax = max(vmax, excluded.vmax),"
    " last = CASE WHEN excluded.last_off >= last_off THEN excluded.last ELSE last END,"
    " first_off = min(first_off, excluded.first_off), last_off = max(last_off, excluded.last_off)"
)
# ?1 first ms, ?2 cut, ?3 coarse step. The step buckets in [?1, ?2) still to merge: any not
# at a coarse boundary, and one at a boundary with another in its coarse window; a lone
# bucket at a boundary is a coarse one already (after a restart, hours of them), left
# in C. In (series, start) order from the primary keys: no sort.
ROLLUPS_TO_COARSEN: Final = (
    "SELECT r.series_id, r.start, r.n, r.total, r.vmin, r.vmax, r.last, r.first_off, r.last_off"
    " FROM series s JOIN rollups r ON r.series_id = s.id AND r.start >= ?1 AND r.start < ?2"
    " WHERE r.start % ?3 != 0 OR EXISTS (SELECT 1 FROM rollups o WHERE o.series_id = r.series_id"
    " AND o.start > r.start AND o.start < r.start + ?3)"
    " ORDER BY s.id, r.start"
)
DELETE_GROUP: Final = "DELETE FROM rollups WHERE series_id = ? AND start >= ? AND start < ?"
# Retention: a bucket goes when its newest sample is past the cut.
DELETE_EXPIRED: Final = "DELETE FROM rollups WHERE series_id = ?1 AND start < ?2 AND start + last_off < ?2"
# The size cap: the buckets that start before the cut.
DELETE_STARTING_BEFORE: Final = "DELETE FROM rollups WHERE series_id = ? AND start < ?"
ALL_SERIES_IDS: Final = "SELECT id FROM series"
# Through the (series_id, lo, hi) index: in series then time order, table rows read
# only for the chunks that match.
CHUNKS_ENDING_BEFORE: Final = "SELECT series_id, lo, n, data FROM chunks WHERE hi < ? ORDER BY series_id, lo"
DELETE_ENDING_BEFORE: Final = "DELETE FROM chunks WHERE hi < ?"
CHUNKS_STRADDLING: Final = "SELECT id, series_id, lo, n, data FROM chunks WHERE lo < ?1 AND hi >= ?1"
COUNT_STARTING_BEFORE: Final = "SELECT coalesce(sum(n), 0) FROM chunks WHERE lo < ?"
DELETE_CHUNKS_STARTING_BEFORE: Final = "DELETE FROM chunks WHERE lo < ?"
# GC compacts first: with ``frames`` empty, the two tiers alone say which series are empty.
DELETE_EMPTY_SERIES: Final = (
    "DELETE FROM series WHERE NOT EXISTS (SELECT 1 FROM chunks WHERE series_id = series.id)"
    " AND NOT EXISTS (SELECT 1 FROM rollups WHERE series_id = series.id)"
)
# Per-series min/max ride the keys; a global min over a tier would scan all of it.
ROLLUP_RANGE: Final = (
    "SELECT min(lo), max(hi) FROM (SELECT (SELECT min(start) FROM rollups WHERE series_id = s.id) AS lo,"
    " (SELECT max(start) FROM rollups WHERE series_id = s.id) AS hi FROM series s)"
)
RAW_RANGE: Final = (
    "SELECT min(lo), max(hi) FROM (SELECT (SELECT min(lo) FROM chunks WHERE series_id = s.id) AS lo,"
    " (SELECT hi FROM chunks WHERE series_id = s.id ORDER BY lo DESC LIMIT 1) AS hi FROM series s)"
)

#: Samples per step below which a series folds straight into coarse buckets.
SPARSE: Final = 10
#: Buckets a fold holds before writing them. All of a GC's (~9000 at 110 pods, with
#: their floats) were its peak once data was old enough to fold (past the raw
#: retention, 35 minutes): 4.9 MiB of Python objects in a copy of a 110-pod store,
#: 1.5 with batches (the compaction's); RSS +6.1 -> +2.2 MiB (issue 29).
FOLD_BATCH: Final = 1024
#: Fraction of a tier's time range dropped per round when the file is over the cap.
CAP_FRACTION: Final = 0.1
_CAP_ROUNDS: Final = 60
_FIRST: Final = operator.itemgetter(0)


@dataclass(frozen=True, slots=True)
class Bucket:
    """Samples of one series folded into one step-aligned interval; times in ms."""

    start_ms: int
    count: int
    total: float
    min: float
    max: float
    last: float
    first_ms: int
    last_ms: int

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Bucket:
        """From ``start, n, total, vmin, vmax, last, first_off, last_off``."""
        start, n, total, vmin, vmax, last, first_off, last_off = row
        return cls(int(start), int(n), float(total), float(vmin), float(vmax), float(last),
                   int(start + first_off), int(start + last_off))

    def row(self) -> tuple[int, int, float, float, float, float, int, int]:
        return (self.start_ms, self.count, self.total, self.min, self.max, self.last,
                self.first_ms - self.start_ms, self.last_ms - self.start_ms)

    @property
    def mean(self) -> float:
        return self.total / self.count

    @property
    def start(self) -> float:
        return q.from_ms(self.start_ms)

    @property
    def first_ts(self) -> float:
        return q.from_ms(self.first_ms)

    @property
    def last_ts(self) -> float:
        return q.from_ms(self.last_ms)

    def merge(self, other: Bucket, start_ms: int) -> Bucket:
        """Both buckets as one starting at ``start_ms``."""
        newer = other if other.last_ms >= self.last_ms else self
        return Bucket(start_ms, self.count + other.count, self.total + other.total, min(self.min, other.min),
                      max(self.max, other.max), newer.last, min(self.first_ms, other.first_ms), newer.last_ms)


@dataclass(frozen=True)
class Tiers:
    """Retention settings in ms; ``coarse`` is a multiple of ``step``."""

    retention: int
    raw: int
    step: int
    coarse: int
    coarse_after: int

    def cuts(self, now: int) -> tuple[int, int, int]:
        """(retention cut, raw cut, coarse cut): samples before the retention cut go;
        raw chunks ending before the raw cut are folded, into coarse buckets before the
        coarse cut."""
        retention = now - self.retention
        raw = max(retention, _align(now - self.raw, self.step))
        return retention, raw, _align(now - self.coarse_after, self.coarse)


def _align(ms: int, step: int) -> int:
    return ms - ms % step


def bucket_rows(series_id: int, ts: Sequence[int], values: Sequence[float], step: int, coarse: int,
                coarse_cut: int) -> Iterator[tuple[int | float, ...]]:
    """Ascending samples of one series as ``rollups`` rows (coarse buckets before
    ``coarse_cut``); tuples rather than ``Bucket``s: a fold makes tens of thousands."""
    # A step bucket of a few samples would save little over the samples themselves.
    sparse = len(ts) > 1 and (len(ts) - 1) * step < SPARSE * (ts[-1] - ts[0])
    i = 0
    while i < len(ts):
        size = coarse if sparse or ts[i] < coarse_cut else step
        start = _align(ts[i], size)
        j = bisect.bisect_left(ts, start + size, i)
        part = values[i:j]
        yield series_id, start, j - i, sum(part), min(part), max(part), part[-1], ts[i] - start, ts[j - 1] - start
        i = j


# --- reading --------------------------------------------------------------------


def buckets_window(conn: sqlite3.Connection, series_id: int, start: int, end: int) -> list[Bucket]:
    return [Bucket.from_row(row) for row in conn.execute(BUCKETS_ONE, (series_id, start, end))]


def buckets_window_all(conn: sqlite3.Connection, metric: str, start: int, end: int) -> dict[str, list[Bucket]]:
    out: dict[str, list[Bucket]] = {}
    for text, *row in conn.execute(BUCKETS_ALL, (metric, start, end)):
        out.setdefault(text, []).append(Bucket.from_row(row))
    return out


def weighted_percentiles(pairs: Sequence[tuple[float, int]], total: int, ps: Sequence[float]) -> list[float]:
    """koordlet's percentiles over ascending ``(value, weight)``: the sample at index
    ``int(total * p) - 1`` (floored at 0) of the list with each value ``weight`` times."""
    targets = sorted((max(int(total * p) - 1, 0), k) for k, p in enumerate(ps))
    out = [pairs[-1][0]] * len(ps)
    seen, t = 0, 0
    for value, weight in pairs:
        seen += weight
        while t < len(targets) and seen > targets[t][0]:
            out[targets[t][1]] = value
            t += 1
        if t == len(targets):
            break
    return out


def combine(raw: Columns, buckets: Sequence[Bucket]) -> Aggregate | None:
    """One series' raw samples and buckets as one Aggregate (see the module docstring
    for what is exact and what is approximated)."""
    if not buckets:
        return summarize(raw)
    raw = raw.ordered()
    vals = raw.vals
    count = len(vals) + sum(b.count for b in buckets)
    pairs = sorted([(v, 1) for v in vals] + [(b.mean, b.count) for b in buckets])
    p50, p90, p95, p99 = weighted_percentiles(pairs, count, q.PERCENTILES)
    newest = max([(b.last_ms, b.last) for b in buckets] + ([(raw.ts[-1], vals[-1])] if vals else []),
                 key=lambda p: p[0])
    return Aggregate(
        count=count,
        avg=(sum(vals) + sum(b.total for b in buckets)) / count,
        p50=p50,
        p90=p90,
        p95=p95,
        p99=p99,
        last=newest[1],
        first_ts=q.from_ms(min([b.first_ms for b in buckets] + raw.ts[:1].tolist())),
        last_ts=q.from_ms(newest[0]),
    )


def combine_mean(raw: Sums, buckets: Sequence[Bucket]) -> Mean | None:
    """``combine``'s count, avg, first and last times from a series' raw sums."""
    count = raw.count + sum(b.count for b in buckets)
    if count == 0:
        return None
    firsts = [b.first_ms for b in buckets] + ([raw.first] if raw.count else [])
    lasts = [b.last_ms for b in buckets] + ([raw.last] if raw.count else [])
    return Mean(count=count, avg=(raw.total + sum(b.total for b in buckets)) / count,
                first_ts=q.from_ms(min(firsts)), last_ts=q.from_ms(max(lasts)))


def combine_all(raw: dict[str, Columns], buckets: dict[str, list[Bucket]]) -> dict[Labels, Aggregate]:
    out: dict[Labels, Aggregate] = {}
    for text in raw.keys() | buckets.keys():
        agg = combine(raw.get(text, Columns()), buckets.get(text, []))
        if agg is not None:
            out[q.decode_labels(text)] = agg
    return out


# --- retention ------------------------------------------------------------------


@dataclass
class GCCounts:
    points_deleted: int = 0
    points_folded: int = 0
    buckets_deleted: int = 0
    series_deleted: int = 0
    capped: bool = False


def take_chunks_before(conn: sqlite3.Connection, cut: int) -> Iterator[tuple[int, list[int], list[float]]]:
    """Yield the samples of the chunks that end before ``cut``, per series in time
    order: ``(series_id, ts, values)``; once exhausted, delete those chunks. The chunk
    straddling the cut stays whole: its older samples go at a later fold."""
    # One scan in C for all series; the delete after it, as a scan's table must not
    # change under it.
    for series_id, group in itertools.groupby(conn.execute(CHUNKS_ENDING_BEFORE, (cut,)), key=_FIRST):
        ts: list[int] = []
        values: list[float] = []
        for _, lo, n, data in group:
            t, v = q.decode_chunk(lo, n, data)
            ts += t
            values += v
        yield series_id, ts, values
    conn.execute(DELETE_ENDING_BEFORE, (cut,))


def trim_chunks(conn: sqlite3.Connection, cut: int) -> int:
    """Drop the samples older than ``cut`` from the chunks straddling it; returns how
    many. Only a retention shorter than the raw one leaves such chunks."""
    rows = conn.execute(CHUNKS_STRADDLING, (cut,)).fetchall()
    dropped = 0
    for chunk_id, series_id, lo, n, data in rows:
        ts, values = q.decode_chunk(lo, n, data)
        k = bisect.bisect_left(ts, cut)
        dropped += k
        conn.executemany(q.INSERT_CHUNK, [(series_id, *c) for c in q.pack(ts[k:], values[k:])])
        conn.execute(q.DELETE_CHUNK, (chunk_id,))
    return dropped


def fold(conn: sqlite3.Connection, tiers: Tiers, now: int, counts: GCCounts) -> None:
    """Retention and folding (one transaction, the caller's)."""
    retention_cut, raw_cut, coarse_cut = tiers.cuts(now)
    upserts: list[tuple[int | float, ...]] = []
    for series_id, ts, values in take_chunks_before(conn, raw_cut):
        k = bisect.bisect_left(ts, retention_cut)
        counts.points_deleted += k
        counts.points_folded += len(ts) - k
        upserts += bucket_rows(series_id, ts[k:], values[k:], tiers.step, tiers.coarse, coarse_cut)
        if len(upserts) >= FOLD_BATCH:  # rollups, not the table being scanned
            conn.executemany(UPSERT, upserts)
            upserts.clear()
    counts.points_deleted += trim_chunks(conn, retention_cut)
    conn.executemany(UPSERT, upserts)
    oldest, _ = conn.execute(ROLLUP_RANGE).fetchone()
    if oldest is not None and oldest < retention_cut:  # else one statement per series for nothing
        counts.buckets_deleted += delete_buckets(conn, DELETE_EXPIRED, retention_cut)


def coarsen(conn: sqlite3.Connection, lo: int, cut: int, coarse: int) -> None:
    """Merge the step buckets in ``[lo, cut)`` into coarse ones (the caller's transaction).
    A lone bucket already at a coarse boundary is a valid coarse bucket as it is. The
    rows stream from the cursor, only those still to merge: after a restart (``lo`` 0)
    every bucket of the file was fetched and held, ~150 MB for 2000 series' 10 hours."""
    merged: list[tuple[int | float, ...]] = []
    deletes: list[tuple[int, int, int]] = []
    rows = conn.execute(ROLLUPS_TO_COARSEN, (lo, cut, coarse))
    for (series_id, start), group in itertools.groupby(rows, key=lambda row: (row[0], _align(row[1], coarse))):
        bs = [Bucket.from_row(row[1:]) for row in group]
        one = functools.reduce(lambda a, b: a.merge(b, start), bs[1:], dataclasses.replace(bs[0], start_ms=start))
        merged.append((series_id, *one.row()))
        deletes.append((series_id, start, start + coarse))
    # After the scan: its table must not change under it.
    conn.executemany(DELETE_GROUP, deletes)
    conn.executemany(_INSERT, merged)


def delete_buckets(conn: sqlite3.Connection, sql: str, cut: int) -> int:
    # One range delete per series rides the primary key.
    ids = conn.execute(ALL_SERIES_IDS).fetchall()
    return sum(conn.execute(sql, (series_id, cut)).rowcount for (series_id,) in ids)


def cap_cutoff(lo: int | None, hi: int | None, fraction: float) -> int | None:
    """The time before which the oldest ``fraction`` of the time range ``[lo, hi]``
    lies; None when there is no range (no data, or all at one instant)."""
    if lo is None or hi is None or hi <= lo:
        return None
    return lo + max(int((hi - lo) * fraction), 1)


def cap_round(conn: sqlite3.Connection, counts: GCCounts) -> bool:
    """Drop the oldest tenth of the rollups, or when there are none, of the raw tier;
    False when there was nothing left to drop."""
    lo, hi = conn.execute(ROLLUP_RANGE).fetchone()
    if lo is not None:
        # Buckets all at one instant are the last tenth there is.
        rollup_cut = cap_cutoff(lo, hi, CAP_FRACTION) or hi + 1

        def drop_buckets() -> None:
            counts.buckets_deleted += delete_buckets(conn, DELETE_STARTING_BEFORE, rollup_cut)

        q.in_transaction(conn, drop_buckets)
        return True
    lo, hi = conn.execute(RAW_RANGE).fetchone()
    raw_cut = cap_cutoff(lo, hi, CAP_FRACTION)
    if raw_cut is None:
        return False
    # Whole chunks starting before the cut: over the cap, a little more is better than
    # nothing (no chunk may end before a cut a tenth into the range).
    dropped: int = conn.execute(COUNT_STARTING_BEFORE, (raw_cut,)).fetchone()[0]
    q.in_transaction(conn, lambda: conn.execute(DELETE_CHUNKS_STARTING_BEFORE, (raw_cut,)))
    counts.points_deleted += dropped
    return dropped > 0


def collect_garbage(
    conn: sqlite3.Connection, tiers: Tiers, now: int, max_bytes: int, size: Callable[[], int], coarse_from: int
) -> GCCounts:
    """Retention, folding, coarsening from ``coarse_from``, then the size cap: oldest
    rollups first, then the oldest raw samples. On a compacted store (``frames`` empty)."""
    counts = GCCounts()

    def retain() -> None:
        fold(conn, tiers, now, counts)
        if tiers.coarse != tiers.step:
            coarsen(conn, coarse_from, tiers.cuts(now)[2], tiers.coarse)

    q.in_transaction(conn, retain)
    counts.series_deleted += conn.execute(DELETE_EMPTY_SERIES).rowcount
    reclaim(conn)
    for _ in range(_CAP_ROUNDS):
        if size() <= max_bytes or not cap_round(conn, counts):
            break
        counts.capped = True
        counts.series_deleted += conn.execute(DELETE_EMPTY_SERIES).rowcount
        reclaim(conn)
    return counts


def reclaim(conn: sqlite3.Connection) -> None:
    """Give free pages back to the filesystem, then checkpoint and truncate the WAL."""
    # incremental_vacuum frees one page per step and returns no columns, so
    # ``execute`` would step it once; ``executescript`` steps it to the end.
    conn.executescript("PRAGMA incremental_vacuum")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
