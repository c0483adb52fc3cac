"""SQL, reader connections, GC steps and the pure functions behind ``metrics.tsdb.TSDB``.

Flushes append to ``recent``, keyed by time first, so a flush of one sample for each
of thousands of series dirties a handful of pages at the end of one b-tree. Keyed by
series first, it would dirty one page per series, and SQLite writes whole pages: about
9 MB of disk writes per flush at the agent's 2200 series. ``recent`` is moved into
``points`` (keyed by series, for cheap window reads) in bulk when it holds enough rows,
so each page of ``points`` is written once per compaction, not once per flush. Reads
take both tables in one statement (one snapshot).

Times are stored as integer milliseconds (smaller rows than REAL seconds and an exact
key); labels as canonical JSON (keys sorted, no spaces), so one series has one key
however its labels were ordered. Aggregations follow koordlet's ``AggregateResult``:
percentiles sort ascending and take index ``int(n * p) - 1`` floored at 0.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Final

from metrics.model import Aggregate, Labels

SCHEMA_VERSION: Final = 1

CREATE_SCHEMA: Final = (
    # AUTOINCREMENT: ids of series dropped by GC are never reused, so an id a reader
    # resolved a moment ago can never point at another series.
    "CREATE TABLE series (id INTEGER PRIMARY KEY AUTOINCREMENT, metric TEXT NOT NULL,"
    " labels TEXT NOT NULL, UNIQUE (metric, labels))",
    # WITHOUT ROWID: the (series, ts) key is the table, so a window read is one range
    # scan and there is no second b-tree for a rowid.
    "CREATE TABLE points (series_id INTEGER NOT NULL, ts INTEGER NOT NULL, value REAL NOT NULL,"
    " PRIMARY KEY (series_id, ts)) WITHOUT ROWID",
    "CREATE TABLE recent (ts INTEGER NOT NULL, series_id INTEGER NOT NULL, value REAL NOT NULL,"
    " PRIMARY KEY (ts, series_id)) WITHOUT ROWID",
    "CREATE TABLE kv (key TEXT PRIMARY KEY, value TEXT NOT NULL, updated REAL NOT NULL)",
    f"PRAGMA user_version = {SCHEMA_VERSION}",
)

SELECT_SERIES_ID: Final = "SELECT id FROM series WHERE metric = ? AND labels = ?"
INSERT_SERIES: Final = "INSERT OR IGNORE INTO series (metric, labels) VALUES (?, ?)"
INSERT_RECENT: Final = "INSERT OR REPLACE INTO recent (ts, series_id, value) VALUES (?, ?, ?)"
COUNT_RECENT: Final = "SELECT count(*) FROM recent"
# Sorted by series so each page of ``points`` is visited once, in order.
COMPACT: Final = (
    "INSERT OR REPLACE INTO points (series_id, ts, value)"
    " SELECT series_id, ts, value FROM recent ORDER BY series_id, ts",
    "DELETE FROM recent",
)
_SERIES_ID: Final = "(SELECT id FROM series WHERE metric = ?1 AND labels = ?2)"
WINDOW_ONE: Final = (
    f"SELECT ts, value FROM points WHERE series_id = {_SERIES_ID} AND ts BETWEEN ?3 AND ?4"
    f" UNION ALL SELECT ts, value FROM recent WHERE ts BETWEEN ?3 AND ?4 AND series_id = {_SERIES_ID}"
)
# CROSS JOIN makes SQLite scan the time range of ``recent`` once; the other join order
# would rescan it for every series of the metric.
WINDOW_ALL: Final = (
    "SELECT s.labels, p.ts, p.value FROM series s JOIN points p ON p.series_id = s.id"
    " WHERE s.metric = ?1 AND p.ts BETWEEN ?2 AND ?3"
    " UNION ALL SELECT s.labels, r.ts, r.value FROM recent r CROSS JOIN series s ON s.id = r.series_id"
    " WHERE r.ts BETWEEN ?2 AND ?3 AND s.metric = ?1"
)
LAST_ONE: Final = (
    f"SELECT * FROM (SELECT ts, value FROM points WHERE series_id = {_SERIES_ID} AND ts BETWEEN ?3 AND ?4"
    " ORDER BY ts DESC LIMIT 1) UNION ALL SELECT * FROM (SELECT ts, value FROM recent"
    f" WHERE ts BETWEEN ?3 AND ?4 AND series_id = {_SERIES_ID} ORDER BY ts DESC LIMIT 1)"
)
SERIES_OF: Final = "SELECT labels FROM series WHERE metric = ? ORDER BY labels"
LATEST_TS: Final = (
    "SELECT max(ts) FROM (SELECT (SELECT max(ts) FROM points WHERE series_id = s.id) AS ts"
    " FROM series s WHERE s.metric = ?1 UNION ALL SELECT max(r.ts) FROM recent r"
    " CROSS JOIN series s ON s.id = r.series_id WHERE s.metric = ?1)"
)
ALL_SERIES_IDS: Final = "SELECT id FROM series"
DELETE_BEFORE: Final = "DELETE FROM points WHERE series_id = ? AND ts < ?"
# GC compacts first: with ``recent`` empty, ``points`` alone says which series are empty.
DELETE_EMPTY_SERIES: Final = (
    "DELETE FROM series WHERE NOT EXISTS (SELECT 1 FROM points WHERE series_id = series.id)"
)
# Per-series min/max use the primary key; a global min(ts) would scan every point.
TIME_RANGE: Final = (
    "SELECT min(lo), max(hi) FROM (SELECT (SELECT min(ts) FROM points WHERE series_id = s.id) AS lo,"
    " (SELECT max(ts) FROM points WHERE series_id = s.id) AS hi FROM series s)"
)
PUT_KV: Final = "INSERT OR REPLACE INTO kv (key, value, updated) VALUES (?, ?, ?)"
GET_KV: Final = "SELECT value FROM kv WHERE key = ?"

PERCENTILES: Final = (0.5, 0.9, 0.95, 0.99)
#: Fraction of the stored time range dropped per round when the file is over the cap.
CAP_FRACTION: Final = 0.1
_CAP_ROUNDS: Final = 40


def canonical(labels: Labels) -> Labels:
    """Sorted by key, one value per key: the form every series key uses."""
    return tuple(sorted(dict(labels).items()))


def encode_labels(labels: Labels) -> str:
    return json.dumps(dict(labels), sort_keys=True, separators=(",", ":"))


def decode_labels(text: str) -> Labels:
    decoded = json.loads(text)
    return tuple(sorted((str(k), str(v)) for k, v in decoded.items()))


def to_ms(ts: float) -> int:
    return round(ts * 1000)


def from_ms(ms: int) -> float:
    return ms / 1000


def percentile(ascending: Sequence[float], p: float) -> float:
    """koordlet's percentile: index ``int(n * p) - 1``, floored at 0."""
    return ascending[max(int(len(ascending) * p) - 1, 0)]


def summarize(rows: list[tuple[int, float]]) -> Aggregate | None:
    """One series' ``(ts_ms, value)`` rows (any order; sorted here) as an Aggregate."""
    if not rows:
        return None
    rows.sort()  # two runs (points, recent): a merge for timsort
    values = [v for _, v in rows]
    ordered = sorted(values)
    p50, p90, p95, p99 = (percentile(ordered, p) for p in PERCENTILES)
    return Aggregate(
        count=len(values),
        avg=sum(values) / len(values),
        p50=p50,
        p90=p90,
        p95=p95,
        p99=p99,
        last=values[-1],
        first_ts=from_ms(rows[0][0]),
        last_ts=from_ms(rows[-1][0]),
    )


def summarize_all(rows: Iterable[tuple[str, int, float]]) -> dict[Labels, Aggregate]:
    """``(labels_json, ts_ms, value)`` rows of many series, in any order."""
    grouped: dict[str, list[tuple[int, float]]] = {}
    for text, ts, value in rows:
        grouped.setdefault(text, []).append((ts, value))
    out: dict[Labels, Aggregate] = {}
    for text, series_rows in grouped.items():
        agg = summarize(series_rows)
        if agg is not None:
            out[decode_labels(text)] = agg
    return out


def cap_cutoff(lo: int | None, hi: int | None, fraction: float) -> int | None:
    """The time before which the oldest ``fraction`` of the stored time range lies;
    None when there is no range left to cut (no points, or all at one instant)."""
    if lo is None or hi is None or hi <= lo:
        return None
    return lo + max(int((hi - lo) * fraction), 1)


def collect_garbage(
    conn: sqlite3.Connection, cutoff: int, max_bytes: int, size: Callable[[], int]
) -> tuple[int, int, bool]:
    """Retention then the size cap, on a compacted store (``recent`` empty).
    Returns (points deleted, series deleted, whether the cap dropped points)."""
    points = delete_before(conn, cutoff)
    series = conn.execute(DELETE_EMPTY_SERIES).rowcount
    reclaim(conn)
    capped = False
    for _ in range(_CAP_ROUNDS):
        if size() <= max_bytes:
            break
        lo, hi = conn.execute(TIME_RANGE).fetchone()
        cut = cap_cutoff(lo, hi, CAP_FRACTION)
        deleted = 0 if cut is None else delete_before(conn, cut)
        if deleted == 0:
            break
        points += deleted
        capped = True
        series += conn.execute(DELETE_EMPTY_SERIES).rowcount
        reclaim(conn)
    return points, series, capped


def delete_before(conn: sqlite3.Connection, cutoff: int) -> int:
    # One range delete per series rides the primary key; a global ``ts < ?`` would
    # need a second index on ts (as large again as the points themselves).
    conn.execute("BEGIN IMMEDIATE")
    deleted = 0
    for (series_id,) in conn.execute(ALL_SERIES_IDS).fetchall():
        deleted += conn.execute(DELETE_BEFORE, (series_id, cutoff)).rowcount
    conn.execute("COMMIT")
    return deleted


def reclaim(conn: sqlite3.Connection) -> None:
    """Give free pages back to the filesystem, then checkpoint and truncate the WAL."""
    # incremental_vacuum frees one page per step and returns no columns, so
    # ``execute`` would step it once; ``executescript`` steps it to the end.
    conn.executescript("PRAGMA incremental_vacuum")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()


class ReaderConnections:
    """One read-only connection per thread, so readers never share a cursor and never
    wait for the writer (WAL). ``mode=ro`` also means a reader never creates the file."""

    def __init__(self, path: Path, busy_timeout: float) -> None:
        self._uri = f"file:{urllib.parse.quote(str(path))}?mode=ro"
        self._timeout = busy_timeout
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: list[tuple[threading.Thread, sqlite3.Connection]] = []

    def connection(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        conn = sqlite3.connect(
            self._uri, uri=True, timeout=self._timeout, isolation_level=None, check_same_thread=False
        )
        self._local.conn = conn
        with self._lock:
            # Threads come and go (executor workers): close what dead threads left behind.
            dead = [c for t, c in self._open if not t.is_alive()]
            self._open = [(t, c) for t, c in self._open if t.is_alive()]
            self._open.append((threading.current_thread(), conn))
        for c in dead:
            c.close()
        return conn

    def close_all(self) -> None:
        with self._lock:
            conns, self._open = self._open, []
        for _, c in conns:
            c.close()
