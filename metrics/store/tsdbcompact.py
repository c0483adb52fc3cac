"""Packing frames (``tsdbframes``) into chunks: ``compact``.

The frames of one id array ("unit": a layout's frames, split by their id array, which
is one unless the layout is an older CRC-32 or two arrays' hashes collide) are read a
slice of series at a time: SQLite cuts each frame's values (and times, if it has its
own) down to the slice's positions (``substr`` of the blob), and the slice's series are
taken out of the concatenated values as ``[j::m]``, in C. What a compaction holds is
then one slice's samples (``SLICE_SAMPLES``) and its chunks, not a layout's frames,
their decoded copy and every series' chunks: at 110 pods the PSI layout's 5 minutes
(5600 series x 28 frames) were the GC's peak, 3.4 MiB of Python objects (issue 29).
Reading a frame again per slice is C work on pages already cached: a few ms per GC.

A series in several units (the collector's set of series changed: a pod came or went)
is merged sample by sample at the end, ordered by frame id: of two samples at one time,
the later write wins, as a rewritten sample always did.
"""

from __future__ import annotations

import array
import operator
import sqlite3
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Final, NamedTuple

from metrics.store import tsdbquery as q
from metrics.store.tsdbframes import floats, ints

#: Samples (and their times) decoded at once: a unit is read in slices of this many
#: samples' worth of series (at least one series).
SLICE_SAMPLES: Final = 1 << 14
#: Frame ids are below this: "every frame".
ALL_FRAMES: Final = 1 << 62

LAYOUTS_BY_AGE: Final = "SELECT layout FROM frames GROUP BY layout ORDER BY min(id)"
# ?1 layout, ?2 frames: the last id of the layout's oldest ?2 frames.
LAST_OF_OLDEST: Final = "SELECT max(id) FROM (SELECT id FROM frames WHERE layout = ?1 ORDER BY id LIMIT ?2)"
# ?1 layout, ?2 last frame id. A DISTINCT keeps each array once (a GROUP BY would sort them all).
UNIT_IDS: Final = "SELECT DISTINCT ids FROM frames WHERE layout = ?1 AND id <= ?2"
UNIT_FRAMES: Final = "SELECT count(*) FROM frames WHERE layout = ?1 AND id <= ?2 AND ids = ?3"
# ?4 first byte (from 1), ?5 bytes: the slice of each frame's values and own times.
UNIT_SLICE: Final = ("SELECT id, lo, n, length(vals), substr(vals, ?4, ?5), length(ts), substr(ts, ?4, ?5) "
                     "FROM frames WHERE layout = ?1 AND id <= ?2 AND ids = ?3 ORDER BY id")
DELETE_UNIT: Final = "DELETE FROM frames WHERE layout = ?1 AND id <= ?2"
DELETE_FRAMES: Final = "DELETE FROM frames"


class _Unit(NamedTuple):
    """The frames of ``layout`` up to id ``last`` whose id array is ``ids``."""

    layout: int
    last: int
    ids: bytes


class _Piece(NamedTuple):
    """Samples of one series from one unit: times, values, and the frame ids (write
    order) when the series needs a merge."""

    ts: Sequence[int]
    vals: Sequence[float]
    order: Sequence[int]


class _Slice:
    """Some series of one unit: the values (and times, once a frame has its own) of
    every frame end to end, and the frame ids in order."""

    __slots__ = ("ids", "los", "order", "stamps", "vals")

    def __init__(self, ids: array.array[int]) -> None:
        self.ids = ids
        self.vals: array.array[float] = array.array("d")
        self.los: list[int] = []
        self.order: list[int] = []
        #: Each sample's time: None while every frame so far has one time for all (``lo``).
        self.stamps: array.array[int] | None = None

    def add(self, frame_id: int, lo: int, vals: array.array[float], ts: array.array[int] | None) -> None:
        m = len(self.ids)
        if ts is not None and self.stamps is None:
            self.stamps = array.array("q")
            for earlier in self.los:
                self.stamps += array.array("q", [earlier]) * m
        self.vals += vals
        self.los.append(lo)
        self.order.append(frame_id)
        if self.stamps is not None:
            self.stamps += ts if ts is not None else array.array("q", [lo]) * m

    def pieces(self) -> Iterator[tuple[int, _Piece]]:
        m = len(self.ids)
        for j, sid in enumerate(self.ids):
            times = self.los if self.stamps is None else self.stamps[j::m]
            yield sid, _Piece(times, self.vals[j::m], self.order)


def _slices(conn: sqlite3.Connection, unit: _Unit) -> Iterator[_Slice]:
    """``unit``'s series, a slice at a time; each frame is checked against the id array."""
    if len(unit.ids) % 8:
        raise q.DamagedChunk(f"damaged frame id array of {len(unit.ids)} bytes")
    series, n = ints(unit.ids), len(unit.ids) // 8
    frames = int(conn.execute(UNIT_FRAMES, unit).fetchone()[0])
    step = max(1, SLICE_SAMPLES // max(1, frames))
    for a in range(0, n, step):
        part = _Slice(series[a:a + step])
        width = 8 * len(part.ids)
        for fid, lo, count, vals_len, vals, ts_len, ts in conn.execute(UNIT_SLICE, (*unit, 8 * a + 1, width)):
            if count != n or vals_len != 8 * n or ts_len not in (None, 8 * n):
                raise q.DamagedChunk(f"damaged frame {fid}: {vals_len} bytes of values, {ts_len} of times "
                                     f"for {count} samples of {n} series")
            part.add(fid, lo, floats(vals), None if ts is None else ints(ts))
        yield part


def _ascending(ts: Sequence[int]) -> bool:
    return all(map(operator.lt, ts, ts[1:]))


def _merged(pieces: list[_Piece]) -> tuple[list[int], list[float]]:
    """Samples of several pieces in time order; for a time written twice, the later write."""
    triples = sorted((t, fid, v) for p in pieces for t, fid, v in zip(p.ts, p.order, p.vals, strict=True))
    merged = {t: v for t, _, v in triples}
    return list(merged), list(merged.values())


_Samples = Iterator[tuple[int, Sequence[int], Sequence[float]]]


def _single(part: _Slice, several: set[int], held: dict[int, list[_Piece]]) -> _Samples:
    """``(series id, strictly ascending ms, values)`` of ``part``'s series found in one
    unit only; the pieces of the others (``several``) are added to ``held``."""
    for sid, piece in part.pieces():
        if sid in several:
            held.setdefault(sid, []).append(piece)
        elif _ascending(piece.ts):
            yield sid, piece.ts, piece.vals
        else:
            yield sid, *_merged([piece])


def _in_several(arrays: Iterable[bytes]) -> set[int]:
    """Series ids found more than once in ``arrays`` (in two, or twice in one: a write
    of one time twice); the set of all is let go here, before any frame is decoded."""
    seen: set[int] = set()
    several: set[int] = set()
    for sid in (sid for raw in arrays for sid in ints(raw)):
        if sid in seen:
            several.add(sid)
        else:
            seen.add(sid)
    return several


def _units(conn: sqlite3.Connection, cuts: Iterable[tuple[int, int]]) -> list[_Unit]:
    """The units of each ``(layout, last frame id)``, in that order."""
    return [_Unit(layout, last, ids) for layout, last in cuts
            for (ids,) in conn.execute(UNIT_IDS, (layout, last)).fetchall()]


def _store(conn: sqlite3.Connection, units: Sequence[_Unit], chunk_hi: q.ChunkBounds | None) -> int:
    several = _in_several(unit.ids for unit in units)
    held: dict[int, list[_Piece]] = {}
    moved = 0
    for unit in units:
        for part in _slices(conn, unit):
            moved += q.store_series(conn, _single(part, several, held), chunk_hi)
    merged = ((sid, *_merged(pieces)) for sid, pieces in held.items())
    return moved + q.store_series(conn, merged, chunk_hi)


def compact(conn: sqlite3.Connection, chunk_hi: q.ChunkBounds | None, only: Mapping[int, int] | None = None) -> int:
    """Move frames into ``chunks`` (the caller's transaction): all of them (oldest layout
    first), or ``only`` the oldest ``count`` frames of each ``layout: count``. Returns
    the samples moved. ``chunk_hi``: see ``tsdbquery.store_series``."""
    if only is None:
        cuts = [(int(layout), ALL_FRAMES) for (layout,) in conn.execute(LAYOUTS_BY_AGE).fetchall()]
    else:
        cuts = [(layout, int(last)) for layout, count in only.items()
                if (last := conn.execute(LAST_OF_OLDEST, (layout, count)).fetchone()[0]) is not None]
    moved = _store(conn, _units(conn, cuts), chunk_hi)
    if only is None:
        conn.execute(DELETE_FRAMES)
    else:
        conn.executemany(DELETE_UNIT, cuts)
    return moved
