"""The embedded time-series store: one SQLite file in WAL mode, no server.

Writes are batched. ``write()`` only appends to an in-memory batch; ``flush()`` writes
the batch in one transaction. The owner calls ``flush()`` about every second, and
``write()`` flushes by itself once the batch holds ``max_batch`` rows, so memory stays
bounded when the owner is late. Queries (``aggregate``, ``aggregate_all``, ``points``,
``series``) see flushed data only. ``last()`` also sees the newest unflushed sample of
each series, because the QoS manager needs values younger than the flush period.
Flushed rows land in a time-ordered table that is packed into per-series chunks every
``compact_rows`` rows (see ``metrics.tsdbquery`` for why and how); both are always read.

Two tiers: raw samples younger than ``raw_retention`` (35 min), and per-series
buckets (count, sum, min, max, last) of 60 s, 5 min past 2 h, kept until ``retention``
(12 h). Queries reaching into the rolled-up past combine both; what stays exact and
what is approximated (percentiles) is in ``metrics.tsdbrollup``. Windows within the
raw tier are exact.

Threads: collectors write from worker threads while the QoS manager, reporters and
``top`` read from others. One writer connection is guarded by a lock. Each reading
thread has its own read-only connection, so a read never waits for the writer (WAL):
every query runs in one read transaction, so it sees one committed state, never a torn
flush, compaction or fold.

Retention: the owner calls ``gc()`` periodically (default every 5 min). It folds raw
samples older than ``raw_retention`` into buckets, deletes what is older than
``retention`` and series left empty. Then, while the file (db + wal) is larger than
``max_bytes``, it drops the oldest tenth of the rollups' time range, and once there are
none, of the raw tier's. Freed pages go back to the filesystem
(``auto_vacuum=INCREMENTAL``) and the WAL is checkpointed and truncated. The cap is
enforced at GC, so between two GCs the file may grow past it by one interval's worth.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

import structlog

from metrics import tsdbquery as q
from metrics import tsdbrollup as r
from metrics.model import Aggregate, Labels, Sample
from metrics.tsdbquery import CorruptStore, TSDBError, wrap

__all__ = ["TSDB", "CorruptStore", "GCResult", "TSDBError"]

log = structlog.get_logger("metrics.tsdb")

DEFAULT_RETENTION: Final = 12 * 3600.0
#: Longer than the longest NodeMetric window (30 min), which needs every sample.
DEFAULT_RAW_RETENTION: Final = 35 * 60.0
DEFAULT_ROLLUP_STEP: Final = 60.0
DEFAULT_COARSE_STEP: Final = 300.0
DEFAULT_COARSE_AFTER: Final = 2 * 3600.0
DEFAULT_MAX_BYTES: Final = 100 * 2**20
#: About five seconds of the agent's full write rate (110 pods x 3 containers x 6 metrics).
DEFAULT_MAX_BATCH: Final = 10_000
#: Rows flushed before they are packed into chunks: about a minute at the agent's rate.
#: It bounds what a one-series read scans in the time-ordered table.
DEFAULT_COMPACT_ROWS: Final = 150_000
_BUSY_TIMEOUT: Final = 5.0
_CANON_MAX: Final = 100_000
_WAL_LIMIT: Final = 4 * 2**20

SeriesKey = tuple[str, Labels]


@dataclass(frozen=True)
class GCResult:
    #: Raw samples dropped (past the retention, or to honour ``max_bytes``).
    points_deleted: int
    series_deleted: int
    size_before: int
    size_after: int
    #: True when data younger than the retention was dropped to honour ``max_bytes``.
    capped: bool
    #: Raw samples folded into buckets.
    points_folded: int
    #: Buckets dropped (past the retention, or to honour ``max_bytes``).
    buckets_deleted: int


def _rows(batch: list[tuple[SeriesKey, int, float]], ids: Mapping[SeriesKey, int]) -> list[tuple[int, int, float]]:
    """The ``recent`` rows of a batch; KeyError for a series without an id."""
    return [(ms, ids[key], value) for key, ms, value in batch]


class TSDB:
    """Implements ``MetricReader`` and ``MetricWriter`` (``metrics.model``)."""

    def __init__(
        self,
        path: Path,
        *,
        retention: float = DEFAULT_RETENTION,
        raw_retention: float = DEFAULT_RAW_RETENTION,
        rollup_step: float = DEFAULT_ROLLUP_STEP,
        coarse_step: float = DEFAULT_COARSE_STEP,
        coarse_after: float = DEFAULT_COARSE_AFTER,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_batch: int = DEFAULT_MAX_BATCH,
        compact_rows: int = DEFAULT_COMPACT_ROWS,
        clock: Callable[[], float] = time.time,
        readonly: bool = False,
    ) -> None:
        """``coarse_step`` is a multiple of ``rollup_step`` (equal: no coarse buckets);
        ``raw_retention >= retention`` keeps every sample raw (no rollup tier)."""
        self.path = Path(path)
        self.retention = retention
        self.raw_retention = raw_retention
        self.rollup_step = rollup_step
        self.coarse_step = coarse_step
        self.coarse_after = coarse_after
        self._tiers()  # refuse bad settings before touching the file
        self.max_bytes = max_bytes
        self.readonly = readonly
        self._max_batch = max_batch
        self._compact_rows = compact_rows
        self._recent_rows = 0
        self._clock = clock
        self._write_lock = threading.Lock()
        self._batch_lock = threading.Lock()
        self._batch: list[tuple[SeriesKey, int, float]] = []
        #: Newest sample written per series (flushed or not), for ``last()``.
        self._latest: dict[SeriesKey, tuple[int, float]] = {}
        #: Labels as given -> canonical: collectors hand the same tuples every tick,
        #: so sorting each sample's labels again is avoidable work on the hot path.
        self._canon: dict[Labels, Labels] = {}
        #: Series ids known to the writer; only touched under ``_write_lock``.
        self._ids: dict[SeriesKey, int] = {}
        #: Buckets before this (ms) are coarse already; 0: look at all of them once.
        self._coarsened = 0
        self._skipped: set[str] = set()
        self._readers = q.ReaderConnections(self.path, _BUSY_TIMEOUT)
        self._closed = False
        self._writer: sqlite3.Connection | None = None
        if readonly:
            if not self.path.is_file():
                raise TSDBError(self.path, "no such file")
            try:
                q.schema_version(self.path, self._reader(), readonly=True)
            except TSDBError:
                self._readers.close_all()
                raise
        else:
            self._writer, self._recent_rows = q.open_writer(self.path, _BUSY_TIMEOUT, _WAL_LIMIT)

    def _tiers(self) -> r.Tiers:
        step, coarse = q.to_ms(self.rollup_step), q.to_ms(self.coarse_step)
        if step < 1 or coarse < step or coarse % step or self.raw_retention <= 0:
            raise ValueError(
                f"bad tiers: raw_retention={self.raw_retention} (> 0), rollup_step={self.rollup_step}"
                f" (>= 0.001 s), coarse_step={self.coarse_step} (a multiple of rollup_step)"
            )
        return r.Tiers(q.to_ms(self.retention), q.to_ms(self.raw_retention), step, coarse,
                       q.to_ms(self.coarse_after))

    # --- opening ------------------------------------------------------------------

    @classmethod
    def open_readonly(cls, path: Path) -> Self:
        """Read-only access (``top``): never creates the file, never writes to it."""
        return cls(path, readonly=True)

    @classmethod
    def open_or_reset(cls, path: Path, **options: Any) -> Self:
        """Open ``path`` with the constructor's keyword ``options``; a corrupt or foreign
        file is renamed to ``<path>.corrupt-<ts>`` (with its -wal/-shm) and a fresh
        store is started in its place."""
        open_ = functools.partial(cls, path, **options)
        try:
            return open_()
        except CorruptStore as exc:
            aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
            for suffix in ("", "-wal", "-shm"):
                src = Path(f"{path}{suffix}")
                if src.exists():
                    os.replace(src, f"{aside}{suffix}")
            log.warning("tsdb.reset_corrupt", path=str(path), moved_to=str(aside), error=str(exc))
            return open_()

    def _reader(self) -> sqlite3.Connection:
        if self._closed:
            raise TSDBError(self.path, "closed")
        try:
            return self._readers.connection()
        except sqlite3.Error as exc:
            raise wrap(self.path, "cannot open for reading", exc) from exc

    def _read(self, sql: str, params: Sequence[object]) -> list[Any]:
        try:
            return self._reader().execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise wrap(self.path, "query failed", exc) from exc

    @contextmanager
    def _snapshot(self) -> Iterator[sqlite3.Connection]:
        """A read transaction: its statements all see the same committed state."""
        conn = self._reader()
        try:
            conn.execute("BEGIN")
            yield conn
        except sqlite3.Error as exc:
            raise wrap(self.path, "query failed", exc) from exc
        except q.DamagedChunk as exc:
            raise CorruptStore(self.path, f"query failed: {exc}") from exc
        finally:
            if conn.in_transaction:
                conn.execute("COMMIT")

    def _writable(self) -> sqlite3.Connection:
        if self._closed:
            raise TSDBError(self.path, "closed")
        if self._writer is None:
            raise TSDBError(self.path, "opened read-only")
        return self._writer

    # --- writing ------------------------------------------------------------------

    def write(self, samples: Sequence[Sample], now: float | None = None) -> None:
        """Append to the batch (``ts == 0`` is stamped ``now``, default the clock).
        Non-finite values are skipped, logged once per metric: a NaN stored would
        become a wrong number."""
        self._writable()
        default_ms = q.to_ms(self._clock() if now is None else now)
        canon = self._canon
        if len(canon) > _CANON_MAX:  # label sets of pods long gone
            canon.clear()
        rows: list[tuple[SeriesKey, int, float]] = []
        append, isfinite = rows.append, math.isfinite
        for metric, value, lbl, ts in samples:
            if not isfinite(value):
                self._skip_once(metric, value)
                continue
            sorted_lbl = canon.get(lbl)
            if sorted_lbl is None:
                sorted_lbl = canon[lbl] = q.canonical(lbl)
            append(((metric, sorted_lbl), q.to_ms(ts) if ts else default_ms, float(value)))
        with self._batch_lock:
            self._batch.extend(rows)
            for key, ms, value in rows:
                newest = self._latest.get(key)
                if newest is None or ms >= newest[0]:
                    self._latest[key] = (ms, value)
            full = len(self._batch) >= self._max_batch
        if full:
            self.flush()

    def _skip_once(self, metric: str, value: float) -> None:
        if metric not in self._skipped:
            self._skipped.add(metric)
            log.warning("tsdb.sample_skipped", metric=metric, value=str(value), reason="not a finite number")

    def flush(self) -> int:
        """Write the batch in one transaction; returns the number of rows written.
        On failure the batch is dropped (bounded memory) and TSDBError says how many.
        Compacts afterwards once enough rows have accumulated."""
        with self._write_lock:
            conn = self._writable()
            with self._batch_lock:
                batch, self._batch = self._batch, []
            if not batch:
                return 0
            known = self._ids
            try:
                conn.execute("BEGIN IMMEDIATE")
                new_ids: dict[SeriesKey, int] = {}
                try:
                    rows = _rows(batch, known)
                except KeyError:  # a series new to this writer: find or make its id
                    new_ids = self._resolve_ids(conn, {key for key, _, _ in batch if key not in known})
                    rows = _rows(batch, known | new_ids)
                conn.executemany(q.INSERT_RECENT, rows)
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise wrap(self.path, f"flush of {len(batch)} samples failed, samples dropped", exc) from exc
            # Only after COMMIT: ids from a rolled-back transaction would point nowhere.
            self._ids.update(new_ids)
            self._recent_rows += len(batch)
            if self._recent_rows >= self._compact_rows:
                self._compact(conn)
            return len(batch)

    def compact(self) -> None:
        """Pack flushed rows into chunks now (GC and ``flush`` do it too)."""
        with self._write_lock:
            self._compact(self._writable())

    def _compact(self, conn: sqlite3.Connection) -> None:
        try:
            q.in_transaction(conn, lambda: q.compact(conn))
        except sqlite3.Error as exc:
            raise wrap(self.path, "compaction failed (flushed samples kept)", exc) from exc
        except q.DamagedChunk as exc:
            raise CorruptStore(self.path, f"compaction failed (flushed samples kept): {exc}") from exc
        self._recent_rows = 0

    def _resolve_ids(self, conn: sqlite3.Connection, keys: set[SeriesKey]) -> dict[SeriesKey, int]:
        out: dict[SeriesKey, int] = {}
        for key in keys:
            metric, labels = key
            encoded = q.encode_labels(labels)
            conn.execute(q.INSERT_SERIES, (metric, encoded))
            out[key] = conn.execute(q.SELECT_SERIES_ID, (metric, encoded)).fetchone()[0]
        return out

    def put_kv(self, key: str, value: object) -> None:
        """Replace a static record (written at once, not batched)."""
        try:
            text = json.dumps(value, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"kv record {key!r} is not JSON-encodable: {exc}") from exc
        with self._write_lock:
            conn = self._writable()
            try:
                conn.execute(q.PUT_KV, (key, text, self._clock()))
            except sqlite3.Error as exc:
                raise wrap(self.path, f"put_kv {key!r} failed", exc) from exc

    # --- reading ------------------------------------------------------------------

    def get_kv(self, key: str) -> object | None:
        rows = self._read(q.GET_KV, (key,))
        if not rows:
            return None
        try:
            value: object = json.loads(str(rows[0][0]))
            return value
        except ValueError as exc:
            raise TSDBError(self.path, f"kv record {key!r} is not valid JSON: {exc}") from exc

    @staticmethod
    def _series_id(conn: sqlite3.Connection, metric: str, labels: Labels) -> int | None:
        row = conn.execute(q.SELECT_SERIES_ID, (metric, q.encode_labels(q.canonical(labels)))).fetchone()
        return None if row is None else int(row[0])

    def _window(self, metric: str, labels: Labels, start: float, end: float) -> tuple[list[q.Point], list[r.Bucket]]:
        """One series' raw samples and buckets in ``[start, end]``, from one snapshot."""
        lo, hi = q.to_ms(start), q.to_ms(end)
        with self._snapshot() as conn:
            series_id = self._series_id(conn, metric, labels)
            if series_id is None:
                return [], []
            return q.raw_window(conn, series_id, lo, hi), r.buckets_window(conn, series_id, lo, hi)

    def aggregate(self, metric: str, labels: Labels, start: float, end: float) -> Aggregate | None:
        """The series over ``[start, end]`` (flushed samples); None without samples.
        Rolled-up buckets count when wholly inside the window; percentiles over them
        are approximated (``metrics.tsdbrollup``)."""
        return r.combine(*self._window(metric, labels, start, end))

    def aggregate_all(self, metric: str, start: float, end: float) -> Mapping[Labels, Aggregate]:
        """Every series of ``metric`` with flushed samples in ``[start, end]``."""
        lo, hi = q.to_ms(start), q.to_ms(end)
        with self._snapshot() as conn:
            raw = q.raw_window_all(conn, metric, lo, hi)
            buckets = r.buckets_window_all(conn, metric, lo, hi)
        return r.combine_all(raw, buckets)

    def aggregate_many(self, series: Iterable[tuple[str, Labels]], start: float, end: float
                       ) -> dict[tuple[str, Labels], Aggregate]:
        """Several series over ``[start, end]`` from one snapshot and one scan of the
        newest rows; series without samples are absent. Keys are as given."""
        lo, hi = q.to_ms(start), q.to_ms(end)
        wanted = list(dict.fromkeys(series))
        out: dict[tuple[str, Labels], Aggregate] = {}
        with self._snapshot() as conn:
            ids = {key: self._series_id(conn, key[0], key[1]) for key in wanted}
            known = [i for i in ids.values() if i is not None]
            raw = q.raw_window_many(conn, known, lo, hi)
            buckets = {i: r.buckets_window(conn, i, lo, hi) for i in known}
        for key, series_id in ids.items():
            if series_id is not None:
                agg = r.combine(raw[series_id], buckets[series_id])
                if agg is not None:
                    out[key] = agg
        return out

    def last(self, metric: str, labels: Labels, max_age: float, now: float) -> Sample | None:
        """Newest sample in ``[now - max_age, now]``, flushed, still in the batch, or
        the last one of a bucket (a bucket straddling ``now`` is not looked into)."""
        canon = q.canonical(labels)
        lo, hi = q.to_ms(now - max_age), q.to_ms(now)
        candidates: list[q.Point] = []
        with self._batch_lock:
            pending = self._latest.get((metric, canon))
        if pending is not None and pending[0] <= hi:
            # The newest sample this writer has written for the series: nothing in the
            # file is newer (unless the clock went back across a restart), so no query
            # (per-series reads of the time-ordered rows scan every series).
            return Sample(metric, pending[1], canon, q.from_ms(pending[0])) if lo <= pending[0] else None
        with self._snapshot() as conn:
            series_id = self._series_id(conn, metric, canon)
            if series_id is not None:
                candidates += q.raw_last(conn, series_id, lo, hi)
                bucket = (series_id, lo, hi, q.to_ms(self.coarse_step))
                candidates += ((int(t), float(v)) for t, v in conn.execute(r.LAST_BUCKET, bucket))
        if not candidates:
            return None
        ms, value = max(candidates)
        return Sample(metric, value, canon, q.from_ms(ms))

    def series(self, metric: str) -> list[Labels]:
        """Label sets of the flushed series of ``metric``, sorted."""
        return [q.decode_labels(str(text)) for (text,) in self._read(q.SERIES_OF, (metric,))]

    def points(self, metric: str, labels: Labels, start: float, end: float) -> list[tuple[float, float]]:
        """``(ts, value)`` of one series over ``[start, end]``, ascending; a bucket
        wholly inside the window is one point: ``(its start, its mean)``."""
        rows, buckets = self._window(metric, labels, start, end)
        rows += ((b.start_ms, b.mean) for b in buckets)
        return [(q.from_ms(ms), v) for ms, v in sorted(rows)]

    def rollups(self, metric: str, labels: Labels, start: float, end: float) -> list[r.Bucket]:
        """The buckets of one series wholly inside ``[start, end]``, ascending."""
        return self._window(metric, labels, start, end)[1]

    def latest_ts(self, metric: str) -> float | None:
        """Time of the newest flushed sample of any series of ``metric``."""
        rows = self._read(q.LATEST_TS, (metric,))
        return None if not rows or rows[0][0] is None else q.from_ms(int(rows[0][0]))

    def size_bytes(self) -> int:
        """The database file plus its write-ahead log."""
        total = 0
        for suffix in ("", "-wal"):
            try:
                total += os.stat(f"{self.path}{suffix}").st_size
            except FileNotFoundError:
                pass
        return total

    # --- retention ----------------------------------------------------------------

    def gc(self, now: float | None = None) -> GCResult:
        """Fold raw samples past ``raw_retention``, apply the retention and the size cap,
        give freed space back, truncate the WAL."""
        now = self._clock() if now is None else now
        tiers, now_ms = self._tiers(), q.to_ms(now)
        with self._write_lock:
            conn = self._writable()
            before = self.size_bytes()
            self._compact(conn)
            try:
                counts = r.collect_garbage(conn, tiers, now_ms, self.max_bytes, self.size_bytes, self._coarsened)
            except sqlite3.Error as exc:
                raise wrap(self.path, "gc failed", exc) from exc
            except q.DamagedChunk as exc:
                raise CorruptStore(self.path, f"gc failed: {exc}") from exc
            finally:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                # Dropped series must get fresh ids if their metric comes back.
                self._ids.clear()
            self._coarsened = max(self._coarsened, tiers.cuts(now_ms)[2])
            result = GCResult(counts.points_deleted, counts.series_deleted, before, self.size_bytes(),
                              counts.capped, counts.points_folded, counts.buckets_deleted)
        cutoff = now_ms - tiers.retention
        with self._batch_lock:
            self._latest = {k: v for k, v in self._latest.items() if v[0] >= cutoff}
        log.info("tsdb.gc", path=str(self.path), points_deleted=result.points_deleted,
                 points_folded=result.points_folded, buckets_deleted=result.buckets_deleted,
                 series_deleted=result.series_deleted, size_before=result.size_before,
                 size_after=result.size_after, capped=result.capped)
        return result

    # --- closing ------------------------------------------------------------------

    def close(self) -> None:
        """Flush the batch, then close every connection. Idempotent."""
        if self._closed:
            return
        try:
            if self._writer is not None:
                self.flush()
        finally:
            self._closed = True
            # Readers first: the writer closing last checkpoints and removes the WAL.
            self._readers.close_all()
            with self._write_lock:
                if self._writer is not None:
                    self._writer.close()
                    self._writer = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
