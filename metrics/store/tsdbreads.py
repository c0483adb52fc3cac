"""The read side of ``metrics.store.tsdb.TSDB``: per-thread read-only connections,
read snapshots and the queries (``aggregate*``, ``last``, ``points``, ``series`` ...).

Each reading thread has its own read-only connection, so a read never waits for the
writer (WAL); every query runs in one read transaction. While the store is degraded
(``metrics.store.tsdbdegraded``) reads add the in-memory batch to what the file holds.
The state is set up by ``TSDB.__init__``; this base class only declares it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from metrics.model import Aggregate, Labels, Mean, Sample
from metrics.store import tsdbdegraded as d
from metrics.store import tsdbframes as f
from metrics.store import tsdbquery as q
from metrics.store import tsdbrollup as r
from metrics.store.tsdbcols import Columns, Sums
from metrics.store.tsdbquery import CorruptStore, TSDBError, wrap
from metrics.store.tsdbwindow import ChangeLog, WindowView

#: ``metric + "\n" + labels JSON``: a str caches its hash, so the several dict lookups
#: a sample goes through do not rehash a tuple of label pairs each time.
SeriesKey = str
#: One ``write()`` call's samples: series keys, times (ms), values.
Frame = tuple[list[SeriesKey], list[int], list[float]]
_R = TypeVar("_R")
#: What ``_many`` reads of each series: its raw samples (``Columns``) or their sums (``Sums``).
_Raw = TypeVar("_Raw", Columns, Sums)
#: What ``_combined`` makes of it: an ``Aggregate`` (of ``Columns``) or a ``Mean`` (of ``Sums``).
_Out = TypeVar("_Out", Aggregate, Mean)


def series_key(metric: str, canonical: Labels) -> SeriesKey:
    return f"{metric}\n{q.encode_labels(canonical)}"


class TSDBReads:
    """The queries of ``TSDB`` (``MetricReader``)."""

    path: Path
    coarse_step: float
    _degraded: d.Degradation
    #: kv records not written yet because the store is degraded: key -> (JSON, time).
    _pending_kv: dict[str, tuple[str, float]]
    _batch_lock: threading.Lock
    _batch: list[Frame]
    #: Newest sample written per series (flushed or not), for ``last()``.
    _latest: dict[SeriesKey, tuple[int, float]]
    #: Series key -> (metric, canonical labels), for ``newest_values``.
    _key_labels: dict[SeriesKey, tuple[str, Labels]]
    _readers: q.ReaderConnections
    _closed: bool
    #: Metric -> labels as written -> series key (``tsdbwrites``).
    _keys: dict[str, dict[Labels, SeriesKey]]
    readonly: bool
    #: What each flush and GC made readable (``tsdbwindow``).
    _changes: ChangeLog

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

    def _pending(self) -> list[Frame] | None:
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

    def _window_all(
        self, metric: str, lo: int, hi: int
    ) -> tuple[dict[str, Columns], dict[str, list[r.Bucket]]]:
        """Every series of ``metric`` in ``[lo, hi]`` ms, by label text: raw samples (the
        unflushed ones added while degraded) and the buckets of the older tiers."""

        def read() -> tuple[dict[str, Columns], dict[str, list[r.Bucket]]]:
            with self._snapshot() as conn:
                return f.raw_window_all(conn, metric, lo, hi), r.buckets_window_all(conn, metric, lo, hi)

        nothing: tuple[dict[str, Columns], dict[str, list[r.Bucket]]] = ({}, {})
        raw, buckets = self._from_file(read, nothing)
        pending = self._pending()
        if pending:
            for text, extra in d.pending_of_metric(pending, metric, lo, hi).items():
                raw.setdefault(text, Columns()).extend(extra)
        return raw, buckets

    def aggregate_all(self, metric: str, start: float, end: float) -> Mapping[Labels, Aggregate]:
        """Every series of ``metric`` with flushed samples in ``[start, end]`` (and
        unflushed ones while degraded)."""
        raw, buckets = self._window_all(metric, q.to_ms(start), q.to_ms(end))
        return r.combine_all(raw, buckets)

    def aggregate_many(self, series: Iterable[tuple[str, Labels]], start: float, end: float
                       ) -> dict[tuple[str, Labels], Aggregate]:
        """Several series over ``[start, end]`` from one snapshot and one scan of the
        newest rows; series without samples are absent. Keys are as given."""
        return self._combined(series, start, end, f.raw_window_many, Columns, Columns.extend, r.combine)

    def means_many(self, series: Iterable[tuple[str, Labels]], start: float, end: float
                   ) -> dict[tuple[str, Labels], Mean]:
        """``metrics.model.MeanReads``: ``aggregate_many``'s count, avg, first and last
        times of several series, from sums taken while decoding: a report of every
        pod's mean usage held each pod's window as arrays until the last one was read."""
        return self._combined(series, start, end, f.sums_window_many, Sums, Sums.add_columns, r.combine_mean)

    def _combined(self, series: Iterable[tuple[str, Labels]], start: float, end: float,
                  raw_of: Callable[[sqlite3.Connection, Sequence[int], int, int], dict[int, _Raw]],
                  empty: Callable[[], _Raw], add: Callable[[_Raw, Columns], None],
                  combine: Callable[[_Raw, list[r.Bucket]], _Out | None]) -> dict[tuple[str, Labels], _Out]:
        """``combine`` of each series' raw read (the batch's samples ``add``-ed while
        degraded) and buckets, by series; series without samples are absent."""
        out: dict[tuple[str, Labels], _Out] = {}
        for key, raw, buckets, extra in self._many(series, start, end, raw_of, empty):
            if extra is not None:
                add(raw, extra)
            found = combine(raw, buckets)
            if found is not None:
                out[key] = found
        return out

    def _many(self, series: Iterable[tuple[str, Labels]], start: float, end: float,
              raw_of: Callable[[sqlite3.Connection, Sequence[int], int, int], dict[int, _Raw]],
              empty: Callable[[], _Raw]) -> Iterator[tuple[tuple[str, Labels], _Raw, list[r.Bucket], Columns | None]]:
        """Per series (in the order given, once each): its raw samples as ``raw_of`` reads
        them, its buckets, and the batch's samples to add while degraded; one snapshot."""
        lo, hi = q.to_ms(start), q.to_ms(end)
        wanted = list(dict.fromkeys(series))

        def read() -> tuple[dict[tuple[str, Labels], int | None], dict[int, _Raw], dict[int, list[r.Bucket]]]:
            with self._snapshot() as conn:
                ids = {key: self._series_id(conn, key[0], key[1]) for key in wanted}
                known = [i for i in ids.values() if i is not None]
                return ids, raw_of(conn, known, lo, hi), {i: r.buckets_window(conn, i, lo, hi) for i in known}

        nothing: tuple[dict[tuple[str, Labels], int | None], dict[int, _Raw], dict[int, list[r.Bucket]]] = \
            ({}, {}, {})
        ids, raw, buckets = self._from_file(read, nothing)
        pending = self._pending()
        extra: dict[SeriesKey, Columns] = {}
        keys: dict[tuple[str, Labels], SeriesKey] = {}
        if pending:
            keys = {key: series_key(key[0], q.canonical(key[1])) for key in wanted}
            extra = d.pending_columns(pending, set(keys.values()), lo, hi)
        for key in wanted:
            series_id = ids.get(key)
            yield (key, raw[series_id] if series_id is not None else empty(),
                   buckets[series_id] if series_id is not None else [], extra.get(keys[key]) if extra else None)

    def window_view(self, series: Sequence[tuple[str, Labels]]) -> WindowView | None:
        """``metrics.model.WindowViews``: ``aggregate_many`` of ``series`` kept between
        calls and read incrementally (``tsdbwindow``); None on a read-only store (another
        process writes its file, so this one cannot know what changed)."""
        if self.readonly:
            return None
        return WindowView(series, self._changes, self._raw_since, self.aggregate_many,
                          lambda: self._degraded.active)

    def _raw_since(self, series: Sequence[tuple[str, Labels]], lo: int, hi: int
                   ) -> tuple[dict[tuple[str, Labels], Columns], bool]:
        """The flushed raw samples of ``series`` in ``[lo, hi]`` ms, and whether rolled-up
        buckets overlap it or the batch in memory adds to it (degraded), from one snapshot."""
        raw: dict[tuple[str, Labels], Columns] = {}
        whole = False  # only a whole read answers: buckets, or samples held in memory
        for key, cols, buckets, extra in self._many(series, q.from_ms(lo), q.from_ms(hi), f.raw_window_many, Columns):
            raw[key] = cols
            whole = whole or bool(buckets) or extra is not None
        return raw, whole

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

    def series_handle(self, metric: str, labels: Labels) -> SeriesKey:
        """A handle of one series for ``newest`` (its labels encoded once, read many)."""
        return series_key(metric, q.canonical(labels))

    def newest(self, handle: SeriesKey) -> tuple[float, float] | None:
        """``(ts, value)`` of the newest sample this writer wrote for the series (None:
        none since start, or forgotten at GC): the in-memory latest-value view the write
        path keeps anyway. No label encoding, no query (``newest_many`` of one handle)."""
        return self.newest_many((handle,))[0]

    def newest_many(self, handles: Sequence[SeriesKey]) -> list[tuple[float, float] | None]:
        """``newest`` of each handle, in order, under one acquisition of the lock: the
        interference analyser reads ~440 series a step, and taking the lock that
        collectors' writes contend on once per series cost more than the lookups
        (``last`` per series had cost it twice its own work, most of it encoding labels)."""
        with self._batch_lock:
            found = list(map(self._latest.get, handles))  # C-level: the lock is held briefly
        return [(hit[0] / 1000, hit[1]) if hit is not None else None for hit in found]

    def newest_by_label(self, metric: str, key: str, start: float, end: float) -> dict[str, float] | None:
        """``metrics.model.NewestView``: by label ``key``, the newest value of every series
        of ``metric`` last written in ``[start, end]``, from the in-memory record alone
        (no query, no label decoding: the label sets written are kept by metric). A
        sample in the file but not in memory is older than ``LATEST_KEEP``: not fresh.
        None on a read-only store (it writes nothing, so it keeps no such record)."""
        if self.readonly:
            return None
        lo, hi = q.to_ms(start), q.to_ms(end)
        by_labels = self._keys.get(metric)
        if not by_labels:
            return {}
        pairs = list(by_labels.copy().items())
        out: dict[str, float] = {}
        with self._batch_lock:
            latest = self._latest
            for lbl, series in pairs:
                found = latest.get(series)
                if found is None or not lo <= found[0] <= hi:
                    continue
                for k, v in lbl:
                    if k == key:
                        if v:
                            out[v] = found[1]
                        break
        return out

    def series_since(self, metric: str, start: float) -> list[Labels] | None:
        """The canonical labels, sorted, of every series of ``metric`` this writer wrote a
        sample of at or after ``start``: the series ``newest`` can read, from the
        in-memory record alone (finding them with ``aggregate_all`` read every sample of
        the window from the file: ~10 ms at 110 pods). None on a read-only store."""
        if self.readonly:
            return None
        lo = q.to_ms(start)
        by_labels = self._keys.get(metric)
        if not by_labels:
            return []
        keys = set(by_labels.copy().values())
        names = self._key_labels
        with self._batch_lock:
            latest = self._latest
            recent = [key for key in keys if (found := latest.get(key)) is not None and found[0] >= lo]
        return sorted((names.get(key) or self._decoded(key))[1] for key in recent)

    def average_by_label(self, metric: str, key: str, start: float, end: float) -> dict[str, float] | None:
        """``metrics.model.NewestView``: by label ``key``, the mean of every series of
        ``metric`` over ``[start, end]`` (as ``aggregate_all``'s ``avg``), without the
        percentiles and label decoding ``aggregate_all`` does for every series."""
        raw, buckets = self._window_all(metric, q.to_ms(start), q.to_ms(end))
        names = self._key_labels
        out: dict[str, float] = {}
        for text in raw.keys() | buckets.keys():
            cols, parts = raw.get(text), buckets.get(text, ())
            count = (len(cols.vals) if cols is not None else 0) + sum(b.count for b in parts)
            if count == 0:
                continue
            named = names.get(f"{metric}\n{text}")
            lbl = named[1] if named is not None else q.decode_labels(text)
            value = next((v for k, v in lbl if k == key), "")
            if value:
                total = (sum(cols.vals) if cols is not None else 0.0) + sum(b.total for b in parts)
                out[value] = total / count
        return out

    def newest_values(self) -> list[tuple[str, Labels, float]]:
        """``(metric, labels, value)`` of the newest sample of every series this writer
        wrote (flushed or not; until GC's retention cut), for the Prometheus exporter:
        the write path keeps them anyway, so the exporter needs no copy of its own."""
        with self._batch_lock:
            items = list(self._latest.items())
        names = self._key_labels
        out: list[tuple[str, Labels, float]] = []
        for key, (_ms, value) in items:
            out.append((*(names.get(key) or self._decoded(key)), value))
        return out

    def _decoded(self, key: SeriesKey) -> tuple[str, Labels]:
        """A series key's metric and labels when the key cache forgot it (GC pruned it,
        or the writer started over): decoded once more, and cached again."""
        metric, encoded = key.split("\n", 1)
        named = self._key_labels[key] = (metric, q.decode_labels(encoded))
        return named

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
