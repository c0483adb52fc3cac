"""The embedded time-series store: one SQLite file in WAL mode, no server.

Writes are batched. ``write()`` only appends to an in-memory batch; ``flush()`` writes
the batch in one transaction. The owner calls ``flush()`` about every second, and
``write()`` flushes by itself once the batch holds ``max_batch`` rows, so memory stays
bounded when the owner is late. Queries (``aggregate``, ``aggregate_all``, ``points``,
``series``) see flushed data only. ``last()`` also sees the newest unflushed sample of
each series, because the QoS manager needs values younger than the flush period.
Flushed rows land in a time-ordered table that is compacted into the per-series one
every ``compact_rows`` rows (see ``metrics.tsdbquery`` for why); both are always read.

Threads: collectors write from worker threads while the QoS manager, reporters and
``top`` read from others. One writer connection is guarded by a lock. Each reading
thread has its own read-only connection, so a read never waits for the writer (WAL):
it sees the last committed state, and since every query is one statement, never a torn
one.

Retention: the owner calls ``gc()`` periodically (default every 5 min). It deletes
points older than ``retention`` and series left without points. Then, while the file
(db + wal) is larger than ``max_bytes``, it drops the oldest tenth of the stored time
range. Freed pages go back to the filesystem (``auto_vacuum=INCREMENTAL``) and the WAL
is checkpointed and truncated. The cap is enforced at GC, so between two GCs the file
may grow past it by one interval's worth of samples.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

import structlog

from metrics import tsdbquery as q
from metrics.model import Aggregate, Labels, Sample

log = structlog.get_logger("metrics.tsdb")

DEFAULT_RETENTION: Final = 12 * 3600.0
DEFAULT_MAX_BYTES: Final = 100 * 2**20
#: About five seconds of the agent's full write rate (110 pods x 3 containers x 6 metrics).
DEFAULT_MAX_BATCH: Final = 10_000
#: Rows flushed before they are moved to the per-series table: about a minute at the
#: agent's rate. It bounds what a one-series read scans in the time-ordered table.
DEFAULT_COMPACT_ROWS: Final = 150_000
_BUSY_TIMEOUT: Final = 5.0
_WAL_LIMIT: Final = 4 * 2**20
_CORRUPT_CODES: Final = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})

SeriesKey = tuple[str, Labels]


class TSDBError(Exception):
    """The store cannot do what was asked; the message names the file."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"metrics store {path}: {reason}")
        self.path = path


class CorruptStore(TSDBError):
    """The file is not a database, is damaged, or holds a schema this version does not know."""


@dataclass(frozen=True)
class GCResult:
    points_deleted: int
    series_deleted: int
    size_before: int
    size_after: int
    #: True when points younger than the retention were dropped to honour ``max_bytes``.
    capped: bool


def _wrap(path: Path, what: str, exc: sqlite3.Error) -> TSDBError:
    code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
    cls = CorruptStore if code in _CORRUPT_CODES else TSDBError
    return cls(path, f"{what}: {exc}")


class TSDB:
    """Implements ``MetricReader`` and ``MetricWriter`` (``metrics.model``)."""

    def __init__(
        self,
        path: Path,
        *,
        retention: float = DEFAULT_RETENTION,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_batch: int = DEFAULT_MAX_BATCH,
        compact_rows: int = DEFAULT_COMPACT_ROWS,
        clock: Callable[[], float] = time.time,
        readonly: bool = False,
    ) -> None:
        self.path = Path(path)
        self.retention = retention
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
        #: Series ids known to the writer; only touched under ``_write_lock``.
        self._ids: dict[SeriesKey, int] = {}
        self._skipped: set[str] = set()
        self._readers = q.ReaderConnections(self.path, _BUSY_TIMEOUT)
        self._closed = False
        self._writer: sqlite3.Connection | None = None
        if readonly:
            if not self.path.is_file():
                raise TSDBError(self.path, "no such file")
            try:
                self._check_schema(self._reader())
            except TSDBError:
                self._readers.close_all()
                raise
        else:
            self._writer = self._open_writer()

    # --- opening ------------------------------------------------------------------

    @classmethod
    def open_readonly(cls, path: Path) -> Self:
        """Read-only access (``top``): never creates the file, never writes to it."""
        return cls(path, readonly=True)

    @classmethod
    def open_or_reset(
        cls,
        path: Path,
        *,
        retention: float = DEFAULT_RETENTION,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_batch: int = DEFAULT_MAX_BATCH,
        compact_rows: int = DEFAULT_COMPACT_ROWS,
        clock: Callable[[], float] = time.time,
    ) -> Self:
        """Open ``path``; a corrupt or foreign file is renamed to ``<path>.corrupt-<ts>``
        (with its -wal/-shm) and a fresh store is started in its place."""
        try:
            return cls(path, retention=retention, max_bytes=max_bytes, max_batch=max_batch,
                       compact_rows=compact_rows, clock=clock)
        except CorruptStore as exc:
            aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
            for suffix in ("", "-wal", "-shm"):
                src = Path(f"{path}{suffix}")
                if src.exists():
                    os.replace(src, f"{aside}{suffix}")
            log.warning("tsdb.reset_corrupt", path=str(path), moved_to=str(aside), error=str(exc))
            return cls(path, retention=retention, max_bytes=max_bytes, max_batch=max_batch,
                       compact_rows=compact_rows, clock=clock)

    def _open_writer(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TSDBError(self.path, f"cannot create its directory: {exc}") from exc
        try:
            conn = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise _wrap(self.path, "cannot open", exc) from exc
        try:
            # Before anything writes page 1 (journal_mode does), or it has no effect.
            conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
            conn.execute("PRAGMA journal_mode = WAL").fetchone()
            # NORMAL in WAL mode: a power loss may lose the last commits, never corrupt the file.
            conn.execute("PRAGMA synchronous = NORMAL")
            # Room for a compaction's pages, so none is spilled and rewritten mid-transaction.
            conn.execute("PRAGMA cache_size = -32768")
            conn.execute("PRAGMA temp_store = MEMORY")  # the compaction's sort: no temp file
            # Checkpoints keep the WAL from growing, but it keeps its high-water size
            # on disk unless told to shrink back (GC truncates it fully).
            conn.execute(f"PRAGMA journal_size_limit = {_WAL_LIMIT}").fetchone()
            if not self._check_schema(conn):
                self._create_schema(conn)
            self._recent_rows = conn.execute(q.COUNT_RECENT).fetchone()[0]
        except sqlite3.Error as exc:
            conn.close()
            raise _wrap(self.path, "cannot open", exc) from exc
        except TSDBError:
            conn.close()
            raise
        return conn

    def _check_schema(self, conn: sqlite3.Connection) -> bool:
        """True when the file holds our schema, False when it is empty; else CorruptStore."""
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
        except sqlite3.Error as exc:
            raise _wrap(self.path, "cannot read", exc) from exc
        if version == q.SCHEMA_VERSION:
            return True
        if version == 0 and tables == 0 and not self.readonly:
            return False
        raise CorruptStore(self.path, f"not a metrics store of schema {q.SCHEMA_VERSION} (user_version={version})")

    @staticmethod
    def _create_schema(conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")
        for statement in q.CREATE_SCHEMA:
            conn.execute(statement)
        conn.execute("COMMIT")

    def _reader(self) -> sqlite3.Connection:
        if self._closed:
            raise TSDBError(self.path, "closed")
        try:
            return self._readers.connection()
        except sqlite3.Error as exc:
            raise _wrap(self.path, "cannot open for reading", exc) from exc

    def _read(self, sql: str, params: Sequence[object]) -> list[Any]:
        try:
            return self._reader().execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise _wrap(self.path, "query failed", exc) from exc

    def _writable(self) -> sqlite3.Connection:
        if self._closed:
            raise TSDBError(self.path, "closed")
        if self._writer is None:
            raise TSDBError(self.path, "opened read-only")
        return self._writer

    # --- writing ------------------------------------------------------------------

    def write(self, samples: Sequence[Sample]) -> None:
        """Append to the batch (``ts == 0`` is stamped now). Non-finite values are
        skipped, logged once per metric: a NaN stored would become a wrong number."""
        self._writable()
        now = self._clock()
        rows: list[tuple[SeriesKey, int, float]] = []
        for s in samples:
            if not math.isfinite(s.value):
                self._skip_once(s.metric, s.value)
                continue
            rows.append(((s.metric, q.canonical(s.labels)), q.to_ms(s.ts or now), float(s.value)))
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
            try:
                conn.execute("BEGIN IMMEDIATE")
                new_ids = self._resolve_ids(conn, {key for key, _, _ in batch})
                ids = self._ids | new_ids
                conn.executemany(q.INSERT_RECENT, [(ms, ids[key], value) for key, ms, value in batch])
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise _wrap(self.path, f"flush of {len(batch)} samples failed, samples dropped", exc) from exc
            # Only after COMMIT: ids from a rolled-back transaction would point nowhere.
            self._ids.update(new_ids)
            self._recent_rows += len(batch)
            if self._recent_rows >= self._compact_rows:
                self._compact(conn)
            return len(batch)

    def compact(self) -> None:
        """Move flushed rows to the per-series table now (GC and ``flush`` do it too)."""
        with self._write_lock:
            self._compact(self._writable())

    def _compact(self, conn: sqlite3.Connection) -> None:
        try:
            conn.execute("BEGIN IMMEDIATE")
            for statement in q.COMPACT:
                conn.execute(statement)
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise _wrap(self.path, "compaction failed (flushed samples kept)", exc) from exc
        self._recent_rows = 0

    def _resolve_ids(self, conn: sqlite3.Connection, keys: set[SeriesKey]) -> dict[SeriesKey, int]:
        out: dict[SeriesKey, int] = {}
        for key in keys - self._ids.keys():
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
                raise _wrap(self.path, f"put_kv {key!r} failed", exc) from exc

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

    def aggregate(self, metric: str, labels: Labels, start: float, end: float) -> Aggregate | None:
        """The series over ``[start, end]`` (flushed samples); None without samples."""
        params = (metric, q.encode_labels(q.canonical(labels)), q.to_ms(start), q.to_ms(end))
        return q.summarize([(int(ms), float(v)) for ms, v in self._read(q.WINDOW_ONE, params)])

    def aggregate_all(self, metric: str, start: float, end: float) -> Mapping[Labels, Aggregate]:
        """Every series of ``metric`` with flushed samples in ``[start, end]``."""
        rows = self._read(q.WINDOW_ALL, (metric, q.to_ms(start), q.to_ms(end)))
        return q.summarize_all(rows)

    def last(self, metric: str, labels: Labels, max_age: float, now: float) -> Sample | None:
        """Newest sample in ``[now - max_age, now]``, flushed or still in the batch."""
        canon = q.canonical(labels)
        lo, hi = q.to_ms(now - max_age), q.to_ms(now)
        candidates: list[tuple[int, float]] = []
        with self._batch_lock:
            pending = self._latest.get((metric, canon))
        if pending is not None and lo <= pending[0] <= hi:
            candidates.append(pending)
        for ms, value in self._read(q.LAST_ONE, (metric, q.encode_labels(canon), lo, hi)):
            candidates.append((int(ms), float(value)))
        if not candidates:
            return None
        ms, value = max(candidates)
        return Sample(metric, value, canon, q.from_ms(ms))

    def series(self, metric: str) -> list[Labels]:
        """Label sets of the flushed series of ``metric``, sorted."""
        return [q.decode_labels(str(text)) for (text,) in self._read(q.SERIES_OF, (metric,))]

    def points(self, metric: str, labels: Labels, start: float, end: float) -> list[tuple[float, float]]:
        """``(ts, value)`` of one series over ``[start, end]``, ascending."""
        params = (metric, q.encode_labels(q.canonical(labels)), q.to_ms(start), q.to_ms(end))
        return [(q.from_ms(int(ms)), float(v)) for ms, v in sorted(self._read(q.WINDOW_ONE, params))]

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
        """Apply retention and the size cap, give freed space back, truncate the WAL."""
        now = self._clock() if now is None else now
        cutoff = q.to_ms(now - self.retention)
        with self._write_lock:
            conn = self._writable()
            before = self.size_bytes()
            self._compact(conn)
            try:
                points, series, capped = q.collect_garbage(conn, cutoff, self.max_bytes, self.size_bytes)
                result = GCResult(points, series, before, self.size_bytes(), capped)
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise _wrap(self.path, "gc failed", exc) from exc
            finally:
                # Dropped series must get fresh ids if their metric comes back.
                self._ids.clear()
        with self._batch_lock:
            self._latest = {k: v for k, v in self._latest.items() if v[0] >= cutoff}
        log.info("tsdb.gc", path=str(self.path), points_deleted=result.points_deleted,
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
