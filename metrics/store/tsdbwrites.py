"""The write side of ``metrics.store.tsdb.TSDB``: the batch, ``flush()``, compaction of
frames into chunks, kv records, and degrading while the file cannot be written.

``write()`` only appends to an in-memory batch; ``flush()`` writes the batch in one
transaction (one ``frames`` row per ``write()`` call, ``metrics.store.tsdbframes``), and
packs frames into per-series chunks (``metrics.store.tsdbquery``) once there are enough.
A file that cannot be written keeps the batch in memory, bounded, and the flush is
retried with back-off (``metrics.store.tsdbdegraded``).
The state is set up by ``TSDB.__init__``; this base class only declares it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import sqlite3
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Final, NamedTuple

import structlog

from metrics.model import Labels, Sample
from metrics.store import tsdbcompact as c
from metrics.store import tsdbdegraded as d
from metrics.store import tsdbframes as f
from metrics.store import tsdbquery as q
from metrics.store.tsdbquery import CorruptStore, TSDBError, wrap
from metrics.store.tsdbreads import Frame, SeriesKey, TSDBReads, series_key

log = structlog.get_logger("metrics.store.tsdb")

BUSY_TIMEOUT: Final = 5.0
CANON_MAX: Final = 100_000
WAL_LIMIT: Final = 4 * 2**20
#: Sample sequences ``_Known`` remembers (one per length: each collector loop writes
#: its own, the same every tick).
KNOWN_MAX: Final = 8


class _Known(NamedTuple):
    """The series keys of a sequence of (metric, labels) written before, valid while the
    label-set index it was resolved in (``_keys``) is the one in use: a writer that
    writes the same series in the same order every tick resolves them once."""

    resolved_in: dict[str, dict[Labels, SeriesKey]]
    metrics: tuple[str, ...]
    labels: tuple[Labels, ...]
    keys: list[SeriesKey]
    unique: bool  # no series twice: a batch at a newer time replaces every newest value


class TSDBWrites(TSDBReads):
    """The write path of ``TSDB`` (``MetricWriter``)."""

    readonly: bool
    _writer: sqlite3.Connection | None
    _max_batch: int
    #: Samples the batch may hold while the file cannot be written (oldest dropped).
    _max_pending: int
    _compact_rows: int | None
    _compact_age: float
    _frame_samples: int
    _frames_since: float | None
    _clock: Callable[[], float]
    _write_lock: threading.Lock
    _batch_len: int
    _unordered: bool
    _chunk_hi: q.ChunkBounds | None
    _layouts: dict[int, int]
    _keys: dict[str, dict[Labels, SeriesKey]]
    _key_count: int
    _ids: dict[SeriesKey, int]
    _coarsened: int
    _skipped: set[str]
    _latest_ms: int
    _known: dict[int, _Known]

    def _open_writer(self) -> sqlite3.Connection:
        self._writer, self._frame_samples = q.open_writer(self.path, BUSY_TIMEOUT, WAL_LIMIT)
        self._layouts = f.layout_counts(self._writer)
        # Frames left by an earlier run are of unknown age: the first flush packs them.
        self._frames_since = -math.inf if self._frame_samples else None
        return self._writer

    def _writable(self) -> sqlite3.Connection | None:
        """The writer; None while the file could not be opened (the store is degraded)."""
        if self._closed:
            raise TSDBError(self.path, "closed")
        if self.readonly:
            raise TSDBError(self.path, "opened read-only")
        return self._writer

    # --- writing ------------------------------------------------------------------

    def write(self, samples: Sequence[Sample], now: float | None = None, *, flush_full: bool = True) -> None:
        """Append to the batch (``ts == 0`` is stamped ``now``, default the clock).
        Non-finite values are skipped, logged once per metric: a NaN stored would
        become a wrong number. A batch this fills to ``max_batch`` is flushed here,
        unless ``flush_full`` is False: then the caller flushes it (``batch_full``),
        e.g. to account the flush's cost as the flush's, not the write's."""
        self._writable()
        default_ms = q.to_ms(self._clock() if now is None else now)
        if self._key_count > CANON_MAX:  # no GC for long (it prunes them): start over
            self._keys, self._key_count, self._key_labels = {}, 0, {}
        known = self._known_of(samples)
        columns = None if known is None else _known_columns(known, samples, default_ms)
        keys, times, values = self._columns(samples, default_ms) if columns is None else columns
        if not keys:
            return
        with self._batch_lock:
            self._batch.append((keys, times, values))
            self._batch_len += len(keys)
            if columns is not None and known is not None and known.unique and default_ms > self._latest_ms:
                # Newer than every newest value, each series once: all are replaced, in C.
                stamped = zip(itertools.repeat(default_ms, len(values)), values, strict=True)
                self._latest.update(zip(keys, stamped, strict=True))
                self._latest_ms = default_ms
            else:
                self._update_latest(keys, times, values)
            if self._degraded.active and self._batch_len > self._max_pending:
                self._bound()
            full = self._batch_len >= self._max_batch
        if full and flush_full:
            self.flush()

    @property
    def batch_full(self) -> bool:
        """The batch holds ``max_batch`` samples or more: flush it."""
        with self._batch_lock:
            return self._batch_len >= self._max_batch

    def _columns(self, samples: Sequence[Sample], default_ms: int) -> tuple[list[SeriesKey], list[int], list[float]]:
        """(keys, times, values) of the finite samples, resolving each series' key; a
        sequence whose samples all made it is remembered for ``_known_columns``."""
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
        if keys and len(keys) == len(samples):
            self._remember(samples, keys, by_metric)
        return keys, times, values

    def _remember(self, samples: Sequence[Sample], keys: list[SeriesKey],
                  resolved_in: dict[str, dict[Labels, SeriesKey]]) -> None:
        """``samples``' keys, as resolved in ``resolved_in`` (the index GC may have
        replaced meanwhile: then they are resolved again, and indexed, next time)."""
        known = self._known if len(self._known) < KNOWN_MAX else {}
        metrics, _values, lbls, _ts = zip(*samples, strict=True)
        known[len(keys)] = _Known(resolved_in, metrics, lbls, list(keys), len(set(keys)) == len(keys))
        self._known = known

    def _known_of(self, samples: Sequence[Sample]) -> _Known | None:
        """The remembered sequence ``samples`` may repeat, if its index is still in use."""
        known = self._known.get(len(samples))
        return known if known is not None and known.resolved_in is self._keys else None

    def _update_latest(self, keys: list[SeriesKey], times: list[int], values: list[float]) -> None:
        """Each series' newest value (under ``_batch_lock``); an older or equal time marks
        the batch unordered."""
        latest = self._latest
        for key, ms, value in zip(keys, times, values, strict=True):
            newest = latest.get(key)
            if newest is None or ms > newest[0]:
                latest[key] = (ms, value)
            else:
                self._unordered = True
                if ms == newest[0]:
                    latest[key] = (ms, value)
        self._latest_ms = max(self._latest_ms, max(times))

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
                    c.compact(conn, self._chunk_bounds(conn))
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
            oldest = min((min(times) for _keys, times, _values in batch if times), default=None)
            if oldest is not None:
                self._changes.note(oldest)
            self._pending_kv = {}
            if self._degraded.active:
                self._recovered(now)
            if unordered:
                self._frame_samples, self._layouts, self._frames_since = 0, {}, None
            else:
                self._frame_samples += count
                self._frames_since = now if self._frames_since is None else self._frames_since
                for layout in layouts:
                    self._layouts[layout] = self._layouts.get(layout, 0) + 1
            try:
                if self._compact_all_due(now):
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

    def _compact_all_due(self, now: float) -> bool:
        """Every frame is to be packed: the oldest is ``compact_age`` old (the GC, which
        packs them first, did not run), or they hold ``compact_rows`` samples."""
        if self._frames_since is not None and now - self._frames_since >= self._compact_age:
            return True
        return self._compact_rows is not None and self._frame_samples >= self._compact_rows

    @staticmethod
    def _rollback(conn: sqlite3.Connection) -> None:
        # SQLite may have rolled back already (a full disk, an I/O error).
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")

    def _keep(self, batch: list[Frame], count: int, unordered: bool) -> None:
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

    def _insert_frames(self, conn: sqlite3.Connection, batch: list[Frame]) -> tuple[dict[SeriesKey, int], list[int]]:
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
            moved = c.compact(conn, self._chunk_bounds(conn), only)

        try:
            q.in_transaction(conn, work)
        except (sqlite3.Error, q.DamagedChunk) as exc:
            self._chunk_hi = None
            what = "compaction failed (flushed samples kept)"
            if isinstance(exc, q.DamagedChunk):
                raise CorruptStore(self.path, f"{what}: {exc}") from exc
            raise wrap(self.path, what, exc) from exc
        if only is None:
            self._frame_samples, self._layouts, self._frames_since = 0, {}, None
            return
        self._frame_samples = max(self._frame_samples - moved, 0)
        for layout, count in only.items():
            left = self._layouts.get(layout, 0) - count
            if left > 0:
                self._layouts[layout] = left
            else:
                self._layouts.pop(layout, None)

    def _chunk_bounds(self, conn: sqlite3.Connection) -> q.ChunkBounds:
        if self._chunk_hi is None:
            self._chunk_hi = q.ChunkBounds(conn.execute(q.CHUNK_HI))
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


def _known_columns(known: _Known, samples: Sequence[Sample],
                   default_ms: int) -> tuple[list[SeriesKey], list[int], list[float]] | None:
    """``TSDBWrites._columns`` in C when ``samples`` are ``known``'s series, in its order,
    all stamped ``default_ms`` (ts 0) and finite; None for anything else."""
    metrics, values, lbls, stamps = zip(*samples, strict=True)
    if metrics != known.metrics or lbls != known.labels or any(stamps):
        return None
    floats = list(map(float, values))
    if not all(map(math.isfinite, floats)):
        return None
    return list(known.keys), [default_ms] * len(floats), floats
