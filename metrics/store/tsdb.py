"""The embedded time-series store: one SQLite file in WAL mode, no server.

Writes are batched. ``write()`` only appends to an in-memory batch; ``flush()`` writes
the batch in one transaction. The owner calls ``flush()`` every ``flush_interval`` (2 s), and
``write()`` flushes by itself once the batch holds ``max_batch`` rows, so memory stays
bounded when the owner is late. Queries (``aggregate``, ``aggregate_all``, ``points``,
``series``) see flushed data only (and the batch while the store is degraded, below).
``last()`` also sees the newest unflushed sample of each series, because the QoS
manager needs values younger than the flush period.
A flush stores each ``write()`` call's samples as one row of arrays (a frame, see
``metrics.store.tsdbframes``); frames are packed into per-series chunks
(``metrics.store.tsdbquery``): a layout's once there are enough for full chunks, all of
them before a GC or once they hold ``compact_rows`` samples. Both are always read.

Two tiers: raw samples younger than ``raw_retention`` (35 min), and per-series
buckets (count, sum, min, max, last) of 60 s, 5 min past 2 h, kept until ``retention``
(12 h). Queries reaching into the rolled-up past combine both; what stays exact and
what is approximated (percentiles) is in ``metrics.store.tsdbrollup``. Windows within the
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

A file that cannot be written (disk full, I/O errors, read-only) degrades the store
instead of failing its owner: the batch stays in memory (bounded), reads add it to
what the file holds, the flush is retried with back-off (``metrics.store.tsdbdegraded``).
``close()`` checkpoints and truncates the WAL and closes every connection, so a
stopped agent leaves the database file alone, without a -wal beside it.
"""

from __future__ import annotations

import contextlib
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
from typing import Any, Final, Self, TypeVar

import structlog

from metrics.model import Aggregate, Labels, Sample
from metrics.store import tsdbdegraded as d
from metrics.store import tsdbframes as f
from metrics.store import tsdbquery as q
from metrics.store import tsdbrollup as r
from metrics.store.tsdbcols import Columns
from metrics.store.tsdbquery import CorruptStore, TSDBError, wrap

__all__ = ["TSDB", "CorruptStore", "GCResult", "TSDBError"]

log = structlog.get_logger("metrics.store.tsdb")

DEFAULT_RETENTION: Final = 12 * 3600.0
#: Longer than the longest NodeMetric window (30 min), which needs every sample.
DEFAULT_RAW_RETENTION: Final = 35 * 60.0
DEFAULT_ROLLUP_STEP: Final = 60.0
DEFAULT_COARSE_STEP: Final = 300.0
DEFAULT_COARSE_AFTER: Final = 2 * 3600.0
DEFAULT_MAX_BYTES: Final = 100 * 2**20
#: About five seconds of the agent's full write rate (110 pods x 3 containers x 6 metrics).
DEFAULT_MAX_BATCH: Final = 10_000
#: Samples in frames that force a full compaction: about eight minutes at the agent's
#: rate, past the GC's five, which compacts everything first. It bounds what a read
#: decodes from the frames when nobody runs the GC.
DEFAULT_COMPACT_ROWS: Final = 600_000
_BUSY_TIMEOUT: Final = 5.0
#: Seconds a series' newest sample stays in memory after it was written (pruned at GC).
LATEST_KEEP: Final = 600.0
_CANON_MAX: Final = 100_000
_WAL_LIMIT: Final = 4 * 2**20

#: ``metric + "\n" + labels JSON``: a str caches its hash, so the several dict lookups
#: a sample goes through do not rehash a tuple of label pairs each time.
SeriesKey = str
#: One ``write()`` call's samples: series keys, times (ms), values.
_Frame = tuple[list[SeriesKey], list[int], list[float]]
_R = TypeVar("_R")
#: ``aggregate_many``'s read of the file: series ids, raw samples and buckets by id.
_ManyRead = tuple[dict[tuple[str, Labels], int | None], dict[int, Columns], dict[int, list[r.Bucket]]]


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


def tier_problem(raw_retention: float, rollup_step: float, coarse_step: float) -> tuple[str, str] | None:
    """What is wrong with these tiers, as ``(setting, why)``; None when they are valid.
    The store refuses them with it, and the config parser names its own key."""
    step, coarse = q.to_ms(rollup_step), q.to_ms(coarse_step)
    if raw_retention <= 0:
        return "raw_retention", "must be positive"
    if step < 1:
        return "rollup_step", "must be at least 1ms"
    if coarse < step or coarse % step:
        return "coarse_step", f"must be a multiple of rollup_step ({rollup_step:g}s; equal: no coarse buckets)"
    return None


def series_key(metric: str, canonical: Labels) -> SeriesKey:
    return f"{metric}\n{q.encode_labels(canonical)}"


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
        max_pending: int = d.DEFAULT_MAX_PENDING,
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
        #: Samples the batch may hold while the file cannot be written (oldest dropped).
        self._max_pending = max(max_pending, max_batch)
        self._degraded = d.Degradation()
        #: kv records not written yet because the store is degraded: key -> (JSON, time).
        self._pending_kv: dict[str, tuple[str, float]] = {}
        self._compact_rows = compact_rows
        self._frame_samples = 0
        self._clock = clock
        self._write_lock = threading.Lock()
        self._batch_lock = threading.Lock()
        self._batch: list[_Frame] = []
        self._batch_len = 0
        #: A sample in the batch is not newer than its series' previous one: the flush
        #: compacts at once, which orders it and lets a rewrite replace the first value.
        self._unordered = False
        #: Series id -> no chunk of it ends later (``tsdbquery.store_series``); None:
        #: read from the file at the next compaction.
        self._chunk_hi: dict[int, int] | None = None
        #: Frames per layout (``tsdbframes``), to compact a layout once it fills chunks.
        self._layouts: dict[int, int] = {}
        #: Newest sample written per series (flushed or not), for ``last()``.
        self._latest: dict[SeriesKey, tuple[int, float]] = {}
        #: Metric -> labels as given -> series key: collectors hand the same tuples every
        #: tick, so sorting and encoding each sample's labels again is avoidable work.
        #: Pruned with ``_latest`` at GC (``_forget_keys``): gone pods' label sets go.
        self._keys: dict[str, dict[Labels, SeriesKey]] = {}
        self._key_count = 0
        #: Series key -> (metric, canonical labels), for ``newest_values``.
        self._key_labels: dict[SeriesKey, tuple[str, Labels]] = {}
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
            try:
                self._open_writer()
            except TSDBError as exc:
                # A full or read-only disk at start: measure from memory, open later.
                if not d.unwritable(exc.__cause__):
                    raise
                self._degrade(exc.__cause__, self._clock())

    def _open_writer(self) -> sqlite3.Connection:
        self._writer, self._frame_samples = q.open_writer(self.path, _BUSY_TIMEOUT, _WAL_LIMIT)
        self._layouts = f.layout_counts(self._writer)
        return self._writer

    def _tiers(self) -> r.Tiers:
        problem = tier_problem(self.raw_retention, self.rollup_step, self.coarse_step)
        if problem is not None:
            raise ValueError(
                f"bad tiers: {problem[0]}: {problem[1]} (raw_retention={self.raw_retention},"
                f" rollup_step={self.rollup_step}, coarse_step={self.coarse_step})"
            )
        return r.Tiers(q.to_ms(self.retention), q.to_ms(self.raw_retention), q.to_ms(self.rollup_step),
                       q.to_ms(self.coarse_step), q.to_ms(self.coarse_after))

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

    def _writable(self) -> sqlite3.Connection | None:
        """The writer; None while the file could not be opened (the store is degraded)."""
        if self._closed:
            raise TSDBError(self.path, "closed")
        if self.readonly:
            raise TSDBError(self.path, "opened read-only")
        return self._writer

    # --- writing ------------------------------------------------------------------

    def write(self, samples: Sequence[Sample], now: float | None = None) -> None:
        """Append to the batch (``ts == 0`` is stamped ``now``, default the clock).
        Non-finite values are skipped, logged once per metric: a NaN stored would
        become a wrong number."""
        self._writable()
        default_ms = q.to_ms(self._clock() if now is None else now)
        if self._key_count > _CANON_MAX:  # no GC for long (it prunes them): start over
            self._keys, self._key_count, self._key_labels = {}, 0, {}
        by_metric = self._keys
        keys: list[SeriesKey] = []
        times: list[int] = []
        values: list[float] = []
        isfinite = math.isfinite
        last_ts, last_ms = 0.0, default_ms
        for metric, value, lbl, ts in samples:
            if not isfinite(value):
                self._skip_once(metric, value)
                continue
            try:
                key = by_metric[metric][lbl]
            except KeyError:
                key = self._new_key(metric, lbl)
            keys.append(key)
            if ts != last_ts:  # a tick stamps its samples alike: convert once
                last_ts, last_ms = ts, q.to_ms(ts) if ts else default_ms
            times.append(last_ms)
            values.append(float(value))
        if not keys:
            return
        with self._batch_lock:
            self._batch.append((keys, times, values))
            self._batch_len += len(keys)
            latest = self._latest
            for key, ms, value in zip(keys, times, values, strict=True):
                newest = latest.get(key)
                if newest is None or ms > newest[0]:
                    latest[key] = (ms, value)
                else:
                    self._unordered = True
                    if ms == newest[0]:
                        latest[key] = (ms, value)
            if self._degraded.active and self._batch_len > self._max_pending:
                self._bound()
            full = self._batch_len >= self._max_batch
        if full:
            self.flush()

    def _new_key(self, metric: str, lbl: Labels) -> SeriesKey:
        canonical = q.canonical(lbl)
        key = series_key(metric, canonical)
        self._keys.setdefault(metric, {})[lbl] = key
        self._key_labels[key] = (metric, canonical)
        self._key_count += 1
        return key

    def _forget_keys(self, live: Mapping[SeriesKey, object]) -> None:
        """Drop the label-set caches (``_keys``, ``_key_labels``) of series that left
        ``_latest`` (silent past its cut: pods gone). They are only an index, rebuilt by
        the next write of a series, so what they hold is bounded by the series written
        in the last ``LATEST_KEEP`` plus one GC interval, not by every pod ever seen.
        Writers and the exporter read these dicts without a lock: new dicts replace the
        old ones (copied first: a C-level copy is not interleaved with another thread's
        insert); an entry added to an old dict meanwhile is only made again later."""
        keys: dict[str, dict[Labels, SeriesKey]] = {}
        for metric, by_labels in self._keys.copy().items():
            kept = {lbl: key for lbl, key in by_labels.copy().items() if key in live}
            if kept:
                keys[metric] = kept
        names = {key: named for key, named in self._key_labels.copy().items() if key in live}
        self._keys, self._key_count, self._key_labels = keys, sum(map(len, keys.values())), names

    def _skip_once(self, metric: str, value: float) -> None:
        if metric not in self._skipped:
            self._skipped.add(metric)
            log.warning("tsdb.sample_skipped", metric=metric, value=str(value), reason="not a finite number")

    def flush(self) -> int:
        """Write the batch in one transaction; returns the number of samples written.
        A file that cannot be written (``tsdbdegraded.unwritable``) keeps the batch in
        memory and degrades the store: later calls return 0 until the back-off is
        over, then try again. Any other failure drops the batch (bounded memory) and
        TSDBError says how many. Compacts afterwards once enough samples have
        accumulated (in the same transaction when the batch holds a sample out of
        time order)."""
        with self._write_lock:
            conn = self._writable()
            now = self._clock()
            if not self._degraded.due(now):
                return 0
            if conn is None:  # could not be opened: try again
                try:
                    conn = self._open_writer()
                except TSDBError as exc:
                    if not d.unwritable(exc.__cause__):
                        raise
                    self._degrade(exc.__cause__, now)
                    return 0
            with self._batch_lock:
                batch, count, unordered = self._batch, self._batch_len, self._unordered
                self._batch, self._batch_len, self._unordered = [], 0, False
            kv = self._pending_kv
            if not batch and not kv:
                return 0
            try:
                conn.execute("BEGIN IMMEDIATE")
                new_ids, layouts = self._insert_frames(conn, batch)
                for key, (text, at) in kv.items():
                    conn.execute(q.PUT_KV, (key, text, at))
                if unordered:
                    f.compact(conn, self._chunk_bounds(conn))
                conn.execute("COMMIT")
            except (sqlite3.Error, q.DamagedChunk) as exc:
                self._rollback(conn)
                self._chunk_hi = None  # may hold chunks of the rolled-back compaction
                if d.unwritable(exc):
                    self._keep(batch, count, unordered)
                    self._degrade(exc, now)
                    return 0
                what = f"flush of {count} samples failed, samples dropped"
                if isinstance(exc, q.DamagedChunk):
                    raise CorruptStore(self.path, f"{what}: {exc}") from exc
                raise wrap(self.path, what, exc) from exc
            # Only after COMMIT: ids from a rolled-back transaction would point nowhere.
            self._ids.update(new_ids)
            self._pending_kv = {}
            if self._degraded.active:
                self._recovered(now)
            if unordered:
                self._frame_samples, self._layouts = 0, {}
            else:
                self._frame_samples += count
                for layout in layouts:
                    self._layouts[layout] = self._layouts.get(layout, 0) + 1
            try:
                if self._frame_samples >= self._compact_rows:
                    self._compact(conn)
                else:
                    ripe = {k: n - n % q.CHUNK_MAX for k, n in self._layouts.items() if n >= q.CHUNK_MAX}
                    if ripe:
                        self._compact(conn, ripe)
            except TSDBError as exc:  # the samples are in the file; packing them waits
                if not d.unwritable(exc.__cause__):
                    raise
                self._degrade(exc.__cause__, now)
            return count

    @staticmethod
    def _rollback(conn: sqlite3.Connection) -> None:
        # SQLite may have rolled back already (a full disk, an I/O error).
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")

    def _keep(self, batch: list[_Frame], count: int, unordered: bool) -> None:
        """Put a batch that could not be written back before what came since, within
        ``max_pending`` samples."""
        with self._batch_lock:
            self._batch = batch + self._batch
            self._batch_len += count
            self._unordered = self._unordered or unordered
            self._bound()

    def _bound(self) -> None:
        """Drop the oldest frames past ``max_pending`` samples (under ``_batch_lock``)."""
        self._batch, self._batch_len, dropped = d.trim(self._batch, self._batch_len, self._max_pending)
        self._degraded.dropped += dropped
        self._degraded.dropped_now += dropped

    def _degrade(self, exc: BaseException | None, now: float) -> None:
        if self._degraded.fail(str(exc), now):
            log.warning("tsdb.store_degraded", path=str(self.path), error=str(exc),
                        pending_samples=self._batch_len, max_pending=self._max_pending,
                        action="serving from memory, retrying with back-off")

    def _recovered(self, now: float) -> None:
        dropped = self._degraded.dropped_now
        lasted = self._degraded.recover(now)
        log.info("tsdb.store_recovered", path=str(self.path), degraded_seconds=round(lasted, 1),
                 samples_dropped=dropped)

    @property
    def degraded(self) -> str | None:
        """Why the file cannot be written now (the store serves from memory); None when it can."""
        return self._degraded.reason

    @property
    def dropped_samples(self) -> int:
        """Samples dropped, ever, to bound memory while the store was degraded."""
        return self._degraded.dropped

    def state(self) -> dict[str, object]:
        """For ``explain``: degraded or not, what waits in memory, how many series it indexes."""
        with self._batch_lock:
            pending = self._batch_len
        return {"degraded": self._degraded.reason, "pending_samples": pending,
                "dropped_samples": self._degraded.dropped,
                # In-memory per-series state, bounded by the series written in the last
                # LATEST_KEEP (pruned at GC): the newest values and the label-set index.
                "series_in_memory": len(self._latest), "label_sets_cached": self._key_count}

    def _insert_frames(self, conn: sqlite3.Connection, batch: list[_Frame]) -> tuple[dict[SeriesKey, int], list[int]]:
        """One ``frames`` row per written batch; returns the ids made for new series and
        the frames' layouts."""
        known = self._ids
        new_ids: dict[SeriesKey, int] = {}
        layouts: list[int] = []
        for keys, times, values in batch:
            try:
                ids = [known[key] for key in keys]
            except KeyError:  # a series new to this writer: find or make its id
                new_ids |= self._resolve_ids(conn, {k for k in keys if k not in known and k not in new_ids})
                ids = [known[key] if key in known else new_ids[key] for key in keys]
            row = f.frame_row(ids, times, values)
            conn.execute(f.INSERT_FRAME, row)
            layouts.append(row[0])
        return new_ids, layouts

    def compact(self) -> None:
        """Pack flushed rows into chunks now (GC and ``flush`` do it too)."""
        with self._write_lock:
            conn = self._writable()
            if conn is not None:
                self._compact(conn)

    def _compact(self, conn: sqlite3.Connection, only: dict[int, int] | None = None) -> None:
        """All frames, or ``only`` the oldest ``count`` of each ``layout: count``."""
        moved = 0

        def work() -> None:
            nonlocal moved
            moved = f.compact(conn, self._chunk_bounds(conn), only)

        try:
            q.in_transaction(conn, work)
        except (sqlite3.Error, q.DamagedChunk) as exc:
            self._chunk_hi = None
            what = "compaction failed (flushed samples kept)"
            if isinstance(exc, q.DamagedChunk):
                raise CorruptStore(self.path, f"{what}: {exc}") from exc
            raise wrap(self.path, what, exc) from exc
        if only is None:
            self._frame_samples, self._layouts = 0, {}
            return
        self._frame_samples = max(self._frame_samples - moved, 0)
        for layout, count in only.items():
            left = self._layouts.get(layout, 0) - count
            if left > 0:
                self._layouts[layout] = left
            else:
                self._layouts.pop(layout, None)

    def _chunk_bounds(self, conn: sqlite3.Connection) -> dict[int, int]:
        if self._chunk_hi is None:
            self._chunk_hi = {int(sid): int(hi) for sid, hi in conn.execute(q.CHUNK_HI)}
        return self._chunk_hi

    def _resolve_ids(self, conn: sqlite3.Connection, keys: set[SeriesKey]) -> dict[SeriesKey, int]:
        out: dict[SeriesKey, int] = {}
        for key in keys:
            metric, encoded = key.split("\n", 1)
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
            now = self._clock()
            if self._degraded.active or conn is None:  # written by the flush that recovers
                self._pending_kv[key] = (text, now)
                return
            try:
                conn.execute(q.PUT_KV, (key, text, now))
            except sqlite3.Error as exc:
                if not d.unwritable(exc):
                    raise wrap(self.path, f"put_kv {key!r} failed", exc) from exc
                self._pending_kv[key] = (text, now)
                self._degrade(exc, now)

    # --- reading ------------------------------------------------------------------

    def get_kv(self, key: str) -> object | None:
        pending = self._pending_kv.get(key)
        rows = [pending] if pending is not None else self._read(q.GET_KV, (key,))
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

    def _pending(self) -> list[_Frame] | None:
        """While degraded, the batch (the frames reads add to the file's); else None.
        Taken after the file was read: a flush that recovers in between moves frames
        the read then misses once, rather than counting them twice."""
        if not self._degraded.active:
            return None
        with self._batch_lock:
            return list(self._batch)

    def _from_file(self, read: Callable[[], _R], empty: _R) -> _R:
        """``read()``; ``empty`` when the file cannot be read while the store is
        degraded (an I/O error: the reads serve what is in memory)."""
        try:
            return read()
        except CorruptStore:
            raise
        except TSDBError:
            if not self._degraded.active:
                raise
            return empty

    def _window(self, metric: str, labels: Labels, start: float, end: float) -> tuple[Columns, list[r.Bucket]]:
        """One series' raw samples and buckets in ``[start, end]``, from one snapshot
        (plus the batch while degraded)."""
        lo, hi = q.to_ms(start), q.to_ms(end)

        def read() -> tuple[Columns, list[r.Bucket]]:
            with self._snapshot() as conn:
                series_id = self._series_id(conn, metric, labels)
                if series_id is None:
                    return Columns(), []
                return f.raw_window(conn, series_id, lo, hi), r.buckets_window(conn, series_id, lo, hi)

        nothing: tuple[Columns, list[r.Bucket]] = (Columns(), [])
        cols, buckets = self._from_file(read, nothing)
        pending = self._pending()
        if pending:
            for extra in d.pending_columns(pending, {series_key(metric, q.canonical(labels))}, lo, hi).values():
                cols.extend(extra)
        return cols, buckets

    def aggregate(self, metric: str, labels: Labels, start: float, end: float) -> Aggregate | None:
        """The series over ``[start, end]`` (flushed samples); None without samples.
        Rolled-up buckets count when wholly inside the window; percentiles over them
        are approximated (``metrics.store.tsdbrollup``)."""
        return r.combine(*self._window(metric, labels, start, end))

    def aggregate_all(self, metric: str, start: float, end: float) -> Mapping[Labels, Aggregate]:
        """Every series of ``metric`` with flushed samples in ``[start, end]`` (and
        unflushed ones while degraded)."""
        lo, hi = q.to_ms(start), q.to_ms(end)

        def read() -> tuple[dict[str, Columns], dict[str, list[r.Bucket]]]:
            with self._snapshot() as conn:
                return f.raw_window_all(conn, metric, lo, hi), r.buckets_window_all(conn, metric, lo, hi)

        nothing: tuple[dict[str, Columns], dict[str, list[r.Bucket]]] = ({}, {})
        raw, buckets = self._from_file(read, nothing)
        pending = self._pending()
        if pending:
            for text, extra in d.pending_of_metric(pending, metric, lo, hi).items():
                raw.setdefault(text, Columns()).extend(extra)
        return r.combine_all(raw, buckets)

    def aggregate_many(self, series: Iterable[tuple[str, Labels]], start: float, end: float
                       ) -> dict[tuple[str, Labels], Aggregate]:
        """Several series over ``[start, end]`` from one snapshot and one scan of the
        newest rows; series without samples are absent. Keys are as given."""
        lo, hi = q.to_ms(start), q.to_ms(end)
        wanted = list(dict.fromkeys(series))
        out: dict[tuple[str, Labels], Aggregate] = {}

        def read() -> _ManyRead:
            with self._snapshot() as conn:
                ids = {key: self._series_id(conn, key[0], key[1]) for key in wanted}
                known = [i for i in ids.values() if i is not None]
                return ids, f.raw_window_many(conn, known, lo, hi), {i: r.buckets_window(conn, i, lo, hi)
                                                                     for i in known}

        nothing: _ManyRead = ({}, {}, {})
        ids, raw, buckets = self._from_file(read, nothing)
        pending = self._pending()
        extra: dict[SeriesKey, Columns] = {}
        keys: dict[tuple[str, Labels], SeriesKey] = {}
        if pending:
            keys = {key: series_key(key[0], q.canonical(key[1])) for key in wanted}
            extra = d.pending_columns(pending, set(keys.values()), lo, hi)
        for key in wanted:
            series_id = ids.get(key)
            cols = raw[series_id] if series_id is not None else Columns()
            if extra:
                cols.extend(extra.get(keys[key], Columns()))
            agg = r.combine(cols, buckets[series_id] if series_id is not None else [])
            if agg is not None:
                out[key] = agg
        return out

    def last(self, metric: str, labels: Labels, max_age: float, now: float) -> Sample | None:
        """Newest sample in ``[now - max_age, now]``, flushed, still in the batch, or
        the last one of a bucket (a bucket straddling ``now`` is not looked into)."""
        canon = q.canonical(labels)
        lo, hi = q.to_ms(now - max_age), q.to_ms(now)
        with self._batch_lock:
            pending = self._latest.get(series_key(metric, canon))
        if pending is not None and pending[0] <= hi:
            # The newest sample this writer has written for the series: nothing in the
            # file is newer (unless the clock went back across a restart), so no query
            # (per-series reads of the time-ordered rows scan every series).
            return Sample(metric, pending[1], canon, q.from_ms(pending[0])) if lo <= pending[0] else None

        def read() -> list[q.Point]:
            with self._snapshot() as conn:
                series_id = self._series_id(conn, metric, canon)
                if series_id is None:
                    return []
                bucket = (series_id, lo, hi, q.to_ms(self.coarse_step))
                return [*f.raw_last(conn, series_id, lo, hi),
                        *((int(t), float(v)) for t, v in conn.execute(r.LAST_BUCKET, bucket))]

        nothing: list[q.Point] = []
        candidates = self._from_file(read, nothing)
        if not candidates:
            return None
        ms, value = max(candidates)
        return Sample(metric, value, canon, q.from_ms(ms))

    def newest_values(self) -> list[tuple[str, Labels, float]]:
        """``(metric, labels, value)`` of the newest sample of every series this writer
        wrote (flushed or not; until GC's retention cut), for the Prometheus exporter:
        the write path keeps them anyway, so the exporter needs no copy of its own."""
        with self._batch_lock:
            items = list(self._latest.items())
        names = self._key_labels
        out: list[tuple[str, Labels, float]] = []
        for key, (_ms, value) in items:
            named = names.get(key)
            if named is None:  # forgotten with the key cache: decode once more
                metric, encoded = key.split("\n", 1)
                named = names[key] = (metric, q.decode_labels(encoded))
            out.append((*named, value))
        return out

    def series(self, metric: str) -> list[Labels]:
        """Label sets of the flushed series of ``metric``, sorted."""
        return [q.decode_labels(str(text)) for (text,) in self._read(q.SERIES_OF, (metric,))]

    def points(self, metric: str, labels: Labels, start: float, end: float) -> list[tuple[float, float]]:
        """``(ts, value)`` of one series over ``[start, end]``, ascending; a bucket
        wholly inside the window is one point: ``(its start, its mean)``."""
        cols, buckets = self._window(metric, labels, start, end)
        rows = list(zip(cols.ts, cols.vals, strict=True)) + [(b.start_ms, b.mean) for b in buckets]
        return [(q.from_ms(ms), v) for ms, v in sorted(rows)]

    def rollups(self, metric: str, labels: Labels, start: float, end: float) -> list[r.Bucket]:
        """The buckets of one series wholly inside ``[start, end]``, ascending."""
        return self._window(metric, labels, start, end)[1]

    def latest_ts(self, metric: str) -> float | None:
        """Time of the newest flushed sample of any series of ``metric``."""
        with self._snapshot() as conn:
            stored = conn.execute(q.LATEST_TS, (metric,)).fetchone()[0]
            pending = f.latest_ms(conn, metric)
        newest = max((int(ms) for ms in (stored, pending) if ms is not None), default=None)
        return None if newest is None else q.from_ms(newest)

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
        give freed space back, truncate the WAL. A file that cannot be written
        degrades the store (see ``flush``) and the GC is a no-op."""
        now = self._clock() if now is None else now
        tiers, now_ms = self._tiers(), q.to_ms(now)
        with self._write_lock:
            conn = self._writable()
            before = self.size_bytes()
            skipped: r.GCCounts | None = None
            try:
                if conn is None:  # could not be opened (degraded): nothing to collect
                    raise TSDBError(self.path, "not open")
                self._compact(conn)
                counts = r.collect_garbage(conn, tiers, now_ms, self.max_bytes, self.size_bytes, self._coarsened)
            except TSDBError as exc:
                if conn is not None and not d.unwritable(exc.__cause__):
                    raise
                if conn is not None:
                    self._degrade(exc.__cause__, self._clock())
                counts = skipped = r.GCCounts()
            except sqlite3.Error as exc:
                if not d.unwritable(exc):
                    raise wrap(self.path, "gc failed", exc) from exc
                self._degrade(exc, self._clock())
                counts = skipped = r.GCCounts()
            except q.DamagedChunk as exc:
                raise CorruptStore(self.path, f"gc failed: {exc}") from exc
            finally:
                if conn is not None:
                    self._rollback(conn)
                # Dropped series must get fresh ids if their metric comes back.
                self._ids.clear()
                self._chunk_hi = None  # re-read at the next compaction: drops dropped series
            if counts is not skipped:  # a skipped GC coarsened nothing
                self._coarsened = max(self._coarsened, tiers.cuts(now_ms)[2])
            result = GCResult(counts.points_deleted, counts.series_deleted, before, self.size_bytes(),
                              counts.capped, counts.points_folded, counts.buckets_deleted)
        # Series silent this long (pods gone) leave the newest-value record: ``last()``
        # then asks the file, and the exporter stops showing them.
        cutoff = now_ms - q.to_ms(min(self.retention, LATEST_KEEP))
        with self._batch_lock:
            self._latest = live = {k: v for k, v in self._latest.items() if v[0] >= cutoff}
        self._forget_keys(live)
        log.info("tsdb.gc", path=str(self.path), points_deleted=result.points_deleted,
                 points_folded=result.points_folded, buckets_deleted=result.buckets_deleted,
                 series_deleted=result.series_deleted, size_before=result.size_before,
                 size_after=result.size_after, capped=result.capped)
        return result

    # --- closing ------------------------------------------------------------------

    def close(self) -> None:
        """Flush the batch (once more, whatever the back-off, when degraded), then
        close every connection: the readers of every thread, then the writer after a
        ``wal_checkpoint(TRUNCATE)``, so no -wal is left beside the file (SQLite
        removes it when the last connection closes; the truncation covers a reader
        it cannot see, e.g. ``top`` in another process). Idempotent."""
        if self._closed:
            return
        try:
            if not self.readonly:
                self._degraded.retry_at = 0.0
                self.flush()
        finally:
            self._closed = True
            self._readers.close_all()
            with self._write_lock:
                if self._batch_len or self._pending_kv:  # still degraded: the file did not take them
                    log.warning("tsdb.closed_with_pending", path=str(self.path), samples_lost=self._batch_len,
                                records_lost=len(self._pending_kv), reason=self._degraded.reason)
                if self._writer is not None:
                    self._close_writer(self._writer)
                    self._writer = None

    def _close_writer(self, conn: sqlite3.Connection) -> None:
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.Error as exc:  # a full disk: the WAL stays, the next open replays it
            log.warning("tsdb.checkpoint_failed", path=str(self.path), error=str(exc))
        finally:
            conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
