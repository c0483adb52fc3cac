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
them before a GC or once the oldest is ``compact_age`` old. Both are always read.

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

import functools
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

import structlog

from metrics.model import Labels
from metrics.store import tsdbdegraded as d
from metrics.store import tsdbquery as q
from metrics.store import tsdbrollup as r
from metrics.store.tsdbquery import CorruptStore, TSDBError, wrap
from metrics.store.tsdbreads import Frame, SeriesKey
from metrics.store.tsdbwindow import EVERYTHING, ChangeLog
from metrics.store.tsdbwrites import BUSY_TIMEOUT, TSDBWrites, _Known

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
#: Seconds of frames that force a full compaction: past the GC's five minutes, which
#: compacts everything first. It bounds what a read decodes from the frames when nobody
#: runs the GC. An age, not a count of samples (600 000 before): a count is reached
#: sooner the more pods write, and at 250 pods it came before the GC and before the
#: 1 s layouts filled their chunks, so every series was packed in shorter chunks, more
#: often: the compaction's cost per pod grew with the pods (issue 29).
DEFAULT_COMPACT_AGE: Final = 480.0
#: Seconds a series' newest sample stays in memory after it was written (pruned at GC).
LATEST_KEEP: Final = 600.0


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


class TSDB(TSDBWrites):
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
        compact_rows: int | None = None,
        compact_age: float = DEFAULT_COMPACT_AGE,
        clock: Callable[[], float] = time.time,
        readonly: bool = False,
        max_pending: int = d.DEFAULT_MAX_PENDING,
    ) -> None:
        """``coarse_step`` is a multiple of ``rollup_step`` (equal: no coarse buckets);
        ``raw_retention >= retention`` keeps every sample raw (no rollup tier).
        ``compact_rows`` also compacts everything once the frames hold that many samples."""
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
        self._compact_age = compact_age
        self._frame_samples = 0
        #: When the oldest frame not yet compacted was flushed (clock seconds); None: none.
        self._frames_since: float | None = None
        self._clock = clock
        self._write_lock = threading.Lock()
        self._batch_lock = threading.Lock()
        self._batch: list[Frame] = []
        self._batch_len = 0
        self._changes = ChangeLog()
        #: A sample in the batch is not newer than its series' previous one: the flush
        #: compacts at once, which orders it and lets a rewrite replace the first value.
        self._unordered = False
        #: Series id -> no chunk of it ends later (``tsdbquery.store_series``); None:
        #: read from the file at the next compaction.
        self._chunk_hi: q.ChunkBounds | None = None
        #: Frames per layout (``tsdbframes``), to compact a layout once it fills chunks.
        self._layouts: dict[int, int] = {}
        #: Newest sample written per series (flushed or not), for ``last()``.
        self._latest: dict[SeriesKey, tuple[int, float]] = {}
        #: No ``_latest`` entry is at or after this time (ms): every write raises it.
        self._latest_ms = -(1 << 63)
        #: Sample sequences written before, by length (``tsdbwrites._Known``).
        self._known: dict[int, _Known] = {}
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
        self._readers = q.ReaderConnections(self.path, BUSY_TIMEOUT)
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
            dropped = True  # until the counts say no series went
            try:
                if conn is None:  # could not be opened (degraded): nothing to collect
                    raise TSDBError(self.path, "not open")
                self._compact(conn)
                counts = r.collect_garbage(conn, tiers, now_ms, self.max_bytes, self.size_bytes, self._coarsened)
                dropped = counts.series_deleted > 0
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
                if dropped:
                    # Dropped series must get fresh ids if their metric comes back. Kept
                    # otherwise: resolving every series again cost ~6300 statements a GC.
                    self._ids.clear()
                    self._chunk_hi = None  # re-read at the next compaction: drops dropped series
            # Folded, dropped, renumbered: a window view reads its whole window again.
            self._changes.note(EVERYTHING)
            if counts is not skipped:  # a skipped GC coarsened nothing
                self._coarsened = max(self._coarsened, tiers.cuts(now_ms)[2])
            result = GCResult(counts.points_deleted, counts.series_deleted, before, self.size_bytes(),
                              counts.capped, counts.points_folded, counts.buckets_deleted)
        # Series silent this long (pods gone) leave the newest-value record: ``last()``
        # then asks the file, and the exporter stops showing them.
        # Rebuilt only when something is to go: the copies of these dicts (readers go
        # without a lock, so they are replaced, not edited) were ~1 MiB at 110 pods, at
        # every GC, mostly for nothing.
        cutoff = now_ms - q.to_ms(min(self.retention, LATEST_KEEP))
        with self._batch_lock:
            latest = self._latest
            if self._key_count > len(latest) or any(v[0] < cutoff for v in latest.values()):
                self._latest = live = {k: v for k, v in latest.items() if v[0] >= cutoff}
            else:
                live = None
        if live is not None:
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
