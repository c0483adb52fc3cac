"""Raw samples of one series as two arrays, for the aggregating reads.

A window read for the NodeMetric report holds about 70 000 samples (224 pod and node
series over 5 minutes) before they are summarized. As ``(ts, value)`` tuples that is
three Python objects a sample, ~8 MB in pymalloc's small-object arenas; freed at the
end of the read, but the report's surviving objects, allocated in between, kept
arenas alive: +4 MiB RSS after a few reports, never returned (``malloc_trim`` cannot
return an arena with one live block). As arrays it is 16 bytes a sample in a few
buffers from the C heap, which a trim does return; the per-series lists made while
summarizing are freed before the next series, so they reuse the same pools.
"""

from __future__ import annotations

import array
import bisect
import operator
import sqlite3
from collections.abc import Sequence

from metrics.model import Aggregate
from metrics.store import tsdbquery as q


class Columns:
    """Timestamps (ms) and values, appended in any order; ``ordered()`` sorts them."""

    __slots__ = ("ts", "vals")

    def __init__(self) -> None:
        self.ts: array.array[int] = array.array("q")
        self.vals: array.array[float] = array.array("d")

    @classmethod
    def of(cls, rows: Sequence[q.Point]) -> Columns:
        cols = cls()
        for t, v in rows:
            cols.append(t, v)
        return cols

    def __len__(self) -> int:
        return len(self.vals)

    def append(self, t: int, value: float) -> None:
        self.ts.append(t)
        self.vals.append(value)

    def extend(self, other: Columns) -> None:
        self.ts += other.ts
        self.vals += other.vals

    def add_chunk(self, lo: int, hi: int, n: int, data: bytes, start: int, end: int) -> None:
        """The chunk's samples within ``[start, end]``."""
        ts, vals = q.decode_chunk_arrays(lo, n, data)
        if start <= lo and hi <= end:
            self.ts += ts
            self.vals += vals
            return
        i, j = bisect.bisect_left(ts, start), bisect.bisect_right(ts, end)
        self.ts += ts[i:j]
        self.vals += vals[i:j]

    def ordered(self) -> Columns:
        """Sorted by time, then value (as sorting ``(ts, value)`` pairs would); chunks
        then frames are already in order, so this is usually a check."""
        ts = self.ts
        if all(map(operator.lt, ts, ts[1:])):
            return self
        out = Columns()
        for t, v in sorted(zip(ts, self.vals, strict=True)):
            out.append(t, v)
        return out


class Sums:
    """A series' samples in a window as a running count, sum, first and last time (ms)."""

    __slots__ = ("count", "first", "last", "total")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.first = 1 << 62
        self.last = -(1 << 62)

    def append(self, t: int, value: float) -> None:
        self.count += 1
        self.total += value
        if t < self.first:
            self.first = t
        if t > self.last:
            self.last = t

    def add_columns(self, cols: Columns) -> None:
        # Left to right, as ``sum`` over the columns would: the same float as the mean
        # ``summarize`` takes of the same samples in the same order.
        for t, v in zip(cols.ts, cols.vals, strict=True):
            self.append(t, v)


def chunks_columns(conn: sqlite3.Connection, series_id: int, start: int, end: int) -> Columns:
    """One series' chunked samples in ``[start, end]`` (ms)."""
    cols = Columns()
    for lo, hi, n, data in conn.execute(q.CHUNKS_ONE, (series_id, start, end)):
        cols.add_chunk(lo, hi, n, data, start, end)
    return cols


def summarize(cols: Columns) -> Aggregate | None:
    """One series' samples as an Aggregate (koordlet's percentiles)."""
    if not cols:
        return None
    cols = cols.ordered()
    values = cols.vals
    ascending = sorted(values)
    p50, p90, p95, p99 = (q.percentile(ascending, p) for p in q.PERCENTILES)
    return Aggregate(
        count=len(values),
        avg=sum(values) / len(values),
        p50=p50,
        p90=p90,
        p95=p95,
        p99=p99,
        last=values[-1],
        first_ts=q.from_ms(cols.ts[0]),
        last_ts=q.from_ms(cols.ts[-1]),
    )


def chunks_columns_all(conn: sqlite3.Connection, metric: str, start: int, end: int) -> dict[str, Columns]:
    """Chunked samples in ``[start, end]`` of every series of ``metric``, by labels JSON."""
    out: dict[str, Columns] = {}
    for text, lo, hi, n, data in conn.execute(q.CHUNKS_ALL, (metric, start, end)):
        cols = out.get(text)
        if cols is None:
            cols = out[text] = Columns()
        cols.add_chunk(lo, hi, n, data, start, end)
    return out
