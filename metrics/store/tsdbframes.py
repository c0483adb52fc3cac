"""The raw tier's newest part: one row per written batch ("frame"), packed into chunks
in bulk (``tsdbcompact``).

A frame is what one ``TSDB.write()`` call handed over, as three little-endian arrays:
series ids (int64), values (float64), and times (int64 ms), the times left out (NULL)
when every sample of the frame has the same one, which is the rule for a collector
tick. A row per sample cost ~1 µs to insert and ~0.9 µs to read back at compaction;
a frame of 2200 samples is one insert of ~35 kB.

A collector writes its series in the same order every tick, so consecutive frames
share a layout (byte-identical id arrays; ``layout`` is a hash of them). Compaction
(``tsdbcompact``) takes series ``j``'s samples out of a layout's frames as the slice
``[j::n]`` of their concatenated values, in C, instead of grouping rows one by one in
Python. What a compaction costs is mostly per series and chunk (encoding, ~20 µs), not
per sample. So the writer compacts a layout once it holds ``CHUNK_MAX`` frames, which
makes full chunks, and leaves slower layouts (PSI every 10 s: thousands of series) to
the full compaction before each GC or once the oldest frame is ``compact_age`` old.

Readers decode frames per query: the positions of the wanted series are looked up
once per layout, then each frame is indexed at those positions. A query fetches only
the frames of layouts holding a wanted series (one frame's ids tell, since ``layout``
is a 62-bit hash of the id array: ``layout_of``); a NodeMetric report's 7 window queries
read every frame of every collector otherwise. Layouts below ``HASHED_LAYOUT`` are CRC-32s
written before (two id arrays can share one): their frames are always fetched.
"""

from __future__ import annotations

import array
import functools
import hashlib
import sqlite3
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Final, NamedTuple

from metrics.store import tsdbquery as q
from metrics.store.tsdbcols import Columns, Sums, chunks_columns, chunks_columns_all

INSERT_FRAME: Final = "INSERT INTO frames (layout, lo, hi, n, ids, vals, ts) VALUES (?, ?, ?, ?, ?, ?, ?)"
LAYOUT_COUNTS: Final = "SELECT layout, count(*) FROM frames GROUP BY layout"
# ?1 first ms, ?2 last ms. Few rows (a couple of minutes of writes): no index needed.
FRAMES_WINDOW: Final = "SELECT id, lo, hi, n, ids, vals, ts FROM frames WHERE hi >= ?1 AND lo <= ?2 ORDER BY id"
LAYOUTS_WINDOW: Final = "SELECT layout, min(id) FROM frames WHERE hi >= ?1 AND lo <= ?2 GROUP BY layout"
FRAME_IDS: Final = "SELECT ids FROM frames WHERE id = ?"
#: Layouts at or above this are ``layout_of`` hashes (bit 62 set); below, older CRC-32s.
HASHED_LAYOUT: Final = 1 << 62
SERIES_IDS_OF: Final = "SELECT id, labels FROM series WHERE metric = ?"


class Frame(NamedTuple):
    id: int
    lo: int
    hi: int
    n: int
    ids: bytes
    vals: bytes
    ts: bytes | None


def ints(raw: bytes) -> array.array[int]:
    a: array.array[int] = array.array("q")
    _load(a, raw)
    return a


def floats(raw: bytes) -> array.array[float]:
    a: array.array[float] = array.array("d")
    _load(a, raw)
    return a


def _load(a: array.array[int] | array.array[float], raw: bytes) -> None:
    try:
        q.from_le(a, raw)
    except (TypeError, ValueError) as exc:  # not a blob, or cut short
        raise q.DamagedChunk(f"damaged frame: {exc}") from exc


def frame_row(ids: Sequence[int], ts: Sequence[int], values: Sequence[float]) -> tuple[int, int, int, int, bytes,
                                                                                       bytes, bytes | None]:
    """The ``frames`` row (for ``INSERT_FRAME``) of one non-empty batch; it starts with
    the layout."""
    lo, hi = min(ts), max(ts)
    times = None if lo == hi else q.le_bytes(array.array("q", ts))
    layout = q.le_bytes(array.array("q", ids))
    return layout_of(layout), lo, hi, len(ids), layout, q.le_bytes(array.array("d", values)), times


def layout_of(ids: bytes) -> int:
    """The ``layout`` of a frame's id array: 62 bits of its BLAKE2b digest, bit 62 set.
    Two arrays sharing one is as likely as a 62-bit hash collision, so readers take one
    frame's ids for its whole layout's (a CRC-32 could not be trusted so)."""
    digest = int.from_bytes(hashlib.blake2b(ids, digest_size=8).digest(), "little")
    return HASHED_LAYOUT | (digest & (HASHED_LAYOUT - 1))


def _decode(frame: Frame) -> tuple[array.array[float], array.array[int] | None]:
    vals = floats(frame.vals)
    ts = None if frame.ts is None else ints(frame.ts)
    if len(vals) != frame.n or (ts is not None and len(ts) != frame.n):
        raise q.DamagedChunk(f"damaged frame {frame.id}: {len(vals)} values for {frame.n} samples")
    return vals, ts


class _Layouts:
    """Positions of the wanted series per layout (id array), computed once each."""

    def __init__(self, wanted: Collection[int] | None) -> None:
        self._wanted = wanted
        self._seen: dict[bytes, list[tuple[int, int]]] = {}

    def positions(self, frame: Frame) -> list[tuple[int, int]]:
        """``(position, series id)`` of the wanted series in ``frame``."""
        found = self._seen.get(frame.ids)
        if found is None:
            ids = ints(frame.ids)
            if len(ids) != frame.n:
                raise q.DamagedChunk(f"damaged frame {frame.id}: {len(ids)} ids for {frame.n} samples")
            wanted = self._wanted
            found = [(j, sid) for j, sid in enumerate(ids) if wanted is None or sid in wanted]
            self._seen[frame.ids] = found
        return found


def _frames_in(conn: sqlite3.Connection, start: int, end: int, wanted: Collection[int]) -> Iterator[Frame]:
    """The frames overlapping ``[start, end]`` that may hold a ``wanted`` series, by id,
    streamed from the cursor: a window's frames together are megabytes (300 s of the pods
    collector's frames at 110 pods: ~5 MiB of blobs), which a list held all at once, and
    every NodeMetric build (each 30-60 s) raised the peak RSS by that much."""
    wanted_set = wanted if isinstance(wanted, (set, frozenset)) else set(wanted)
    layouts = conn.execute(LAYOUTS_WINDOW, (start, end)).fetchall()
    kept: list[int] = []
    for layout, first in layouts:
        if layout >= HASHED_LAYOUT:
            row = conn.execute(FRAME_IDS, (first,)).fetchone()
            if row is not None and wanted_set.isdisjoint(ints(row[0])):
                continue  # no wanted series in this layout
        kept.append(layout)
    if len(kept) == len(layouts):
        return map(Frame._make, conn.execute(FRAMES_WINDOW, (start, end)))
    if not kept:
        return iter(())
    query = FRAMES_WINDOW.replace(" ORDER BY", f" AND layout IN ({','.join('?' * len(kept))}) ORDER BY")
    return map(Frame._make, conn.execute(query, (start, end, *kept)))


def _points(frames: Iterable[Frame], wanted: Collection[int] | None, start: int, end: int,
            out: dict[int, Columns] | None = None) -> dict[int, Columns]:
    """The samples in ``[start, end]`` of the ``wanted`` series (None: all), by id,
    appended to ``out`` (its columns, or new ones)."""
    out = {} if out is None else out
    if wanted is None:
        _visit(frames, wanted, start, end, functools.partial(_columns, out))
        return out
    for sid in wanted:  # then a C lookup per sample finds the columns (a wanted id may stay empty)
        if sid not in out:
            out[sid] = Columns()
    _visit(frames, wanted, start, end, out.__getitem__)
    return out


def _visit(frames: Iterable[Frame], wanted: Collection[int] | None, start: int, end: int,
           into: Callable[[int], Columns | Sums]) -> None:
    """Each sample in ``[start, end]`` of the ``wanted`` series (None: all), appended to
    ``into(series id)``, frame by frame as decoded."""
    layouts = _Layouts(wanted)
    for frame in frames:
        found = layouts.positions(frame)
        if not found:
            continue
        vals, ts = _decode(frame)
        if ts is None:
            if start <= frame.lo <= end:
                t = frame.lo
                for j, sid in found:
                    into(sid).append(t, vals[j])
            continue
        for j, sid in found:
            if start <= ts[j] <= end:
                into(sid).append(ts[j], vals[j])


def _columns(out: dict[int, Columns], sid: int) -> Columns:
    cols = out.get(sid)
    if cols is None:
        cols = out[sid] = Columns()
    return cols


def raw_window(conn: sqlite3.Connection, series_id: int, start: int, end: int) -> Columns:
    """One series' raw samples in ``[start, end]`` (ms): chunks, then frames."""
    out = {series_id: chunks_columns(conn, series_id, start, end)}
    return _points(_frames_in(conn, start, end, (series_id,)), (series_id,), start, end, out)[series_id]


def raw_window_many(conn: sqlite3.Connection, ids: Sequence[int], start: int, end: int) -> dict[int, Columns]:
    """Raw samples in ``[start, end]`` of several series by id (each frame decoded once)."""
    out = {i: chunks_columns(conn, i, start, end) for i in ids}
    wanted = set(ids)
    return _points(_frames_in(conn, start, end, wanted), wanted, start, end, out)


def sums_window_many(conn: sqlite3.Connection, ids: Sequence[int], start: int, end: int) -> dict[int, Sums]:
    """``raw_window_many`` summed as it is decoded: per series id a ``Sums`` of its raw
    samples in ``[start, end]`` (ms); no sample is held (chunks, then frames in order)."""
    out = {i: Sums() for i in ids}
    for i, sums in out.items():
        sums.add_columns(chunks_columns(conn, i, start, end))
    wanted = set(ids)
    _visit(_frames_in(conn, start, end, wanted), wanted, start, end, out.__getitem__)
    return out


def raw_window_all(conn: sqlite3.Connection, metric: str, start: int, end: int) -> dict[str, Columns]:
    """Raw samples in ``[start, end]`` of every series of ``metric``, by labels JSON."""
    out = chunks_columns_all(conn, metric, start, end)
    labels = {int(i): str(text) for i, text in conn.execute(SERIES_IDS_OF, (metric,))}
    for sid, cols in _points(_frames_in(conn, start, end, labels.keys()), labels, start, end).items():
        into = out.get(labels[sid])
        if into is None:
            out[labels[sid]] = cols
        else:
            into.extend(cols)
    return out


def raw_last(conn: sqlite3.Connection, series_id: int, lo: int, hi: int) -> list[q.Point]:
    """Candidates for the newest raw sample in ``[lo, hi]``: at most one per tier part."""
    out = q.chunk_last(conn, series_id, lo, hi)
    found = _points(_frames_in(conn, lo, hi, (series_id,)), (series_id,), lo, hi).get(series_id)
    if found:
        out.append(max(zip(found.ts, found.vals, strict=True)))
    return out


def latest_ms(conn: sqlite3.Connection, metric: str) -> int | None:
    """Time of the newest sample of ``metric`` in the frames."""
    ids = {int(i) for i, _ in conn.execute(SERIES_IDS_OF, (metric,))}
    found = _points(_frames_in(conn, -(2**63), 2**63 - 1, ids), ids, -(2**63), 2**63 - 1)
    return max((max(cols.ts) for cols in found.values() if cols), default=None)


def layout_counts(conn: sqlite3.Connection) -> dict[int, int]:
    """Frames per layout."""
    return {int(layout): int(n) for layout, n in conn.execute(LAYOUT_COUNTS)}
