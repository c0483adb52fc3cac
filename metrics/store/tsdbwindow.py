"""Trailing-window reads kept between calls: a few series read again every second.

The QoS round reads the BE tier's CPU series over the eviction window (300 s by
koordlet's default) every second. Read from the file each time, every sample of the
window was decoded again each round to learn about the one or two that are new (issue
29: a quarter of a round's CPU at 110 pods). A ``WindowView`` keeps the samples it read
and, next time, reads only what can have changed since, so its answer is the one
``aggregate_many`` gives for the same window.

What can have changed is known from the writer, not guessed from clocks: every flush
notes in the store's ``ChangeLog`` the oldest sample time it made readable, and every
GC notes that anything may have changed (it folds, drops and renumbers). A view records
the log's sequence before each read; the next read re-reads, from the file, every
sample at or after the oldest time noted since (and anything after its last read's
end), and keeps its own copy of what lies before. Samples become readable only by a
flush, so nothing else can appear below that time. A view reads everything again when
the log no longer reaches back to its sequence, after a GC, when the window's start
moved back or its end went back (the clock), and serves ``aggregate_many`` unchanged
while the store is degraded (reads then add the in-memory batch) or when the window
holds rolled-up buckets (raw retention shorter than the window).
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from metrics.model import Aggregate, Labels
from metrics.store import tsdbquery as q
from metrics.store.tsdbcols import Columns, summarize

#: Flushes remembered; a view read less often than this many flushes reads everything.
CHANGES_KEPT: Final = 256
#: A change that may touch any time (GC): "everything from the beginning".
EVERYTHING: Final = -(1 << 62)

Series = tuple[str, Labels]
#: ``(columns by series, whether only a whole read answers: buckets, or degraded)``, one snapshot.
RawRead = Callable[[Sequence[Series], int, int], tuple[dict[Series, Columns], bool]]
Aggregates = Callable[[Sequence[Series], float, float], dict[Series, Aggregate]]


class ChangeLog:
    """What became readable in the file, in order: ``(sequence, oldest sample time ms)``."""

    def __init__(self, kept: int = CHANGES_KEPT) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._entries: deque[tuple[int, int]] = deque(maxlen=kept)

    @property
    def seq(self) -> int:
        return self._seq

    def note(self, oldest_ms: int) -> None:
        """A commit made samples as old as ``oldest_ms`` readable (``EVERYTHING``: any)."""
        with self._lock:
            self._seq += 1
            self._entries.append((self._seq, oldest_ms))

    def oldest_since(self, seq: int) -> int | None:
        """The oldest sample time noted after ``seq`` (a time past any sample when nothing was);
        None when the log no longer reaches back to ``seq``."""
        with self._lock:
            if seq == self._seq:
                return _NONE_SINCE
            entries = self._entries
            if not entries or entries[0][0] > seq + 1:
                return None
            return min(oldest for s, oldest in entries if s > seq)


#: ``oldest_since`` when nothing was flushed since: no time to re-read from.
_NONE_SINCE: Final = 1 << 62


class WindowView:
    """``aggregate_many(series, start, end)`` for one fixed list of series, read
    incrementally between calls (one thread at a time: a QoS round)."""

    def __init__(self, series: Sequence[Series], changes: ChangeLog, raw: RawRead, aggregates: Aggregates,
                 degraded: Callable[[], bool]) -> None:
        self.series = tuple(dict.fromkeys(series))
        self._changes = changes
        self._raw = raw
        self._aggregates = aggregates
        self._degraded = degraded
        self._lock = threading.Lock()
        #: What was read: the samples at or after ``_lo`` as of sequence ``_seq``, up to ``_hi``.
        self._cols: dict[Series, Columns] | None = None
        self._lo = self._hi = 0
        self._seq = 0
        #: Reads of the file: whole windows, and the part that could have changed.
        self.full_reads = 0
        self.partial_reads = 0

    def aggregate(self, start: float, end: float) -> dict[Series, Aggregate]:
        """As ``aggregate_many(self.series, start, end)``; series without samples are absent."""
        with self._lock:
            if self._degraded():
                self._cols = None
                return self._aggregates(self.series, start, end)
            lo, hi = q.to_ms(start), q.to_ms(end)
            seq = self._changes.seq  # before the read: a flush meanwhile is re-read next time
            since = self._since(lo, hi)
            read, whole = self._raw(self.series, lo if since is None else since, hi)
            if whole or self._degraded():  # buckets in the window, or degraded meanwhile
                self._cols = None
                return self._aggregates(self.series, start, end)
            if since is None:
                self.full_reads += 1
                self._cols = read
            else:
                self.partial_reads += 1
                self._cols = {s: _joined(self._cols_of(s), lo, since, read.get(s)) for s in self.series}
            self._lo, self._hi, self._seq = lo, hi, seq
            return _summaries(self._cols)

    def _since(self, lo: int, hi: int) -> int | None:
        """Where this read must start in the file; None: the whole window."""
        if self._cols is None or lo < self._lo or hi < self._hi:
            return None
        oldest = self._changes.oldest_since(self._seq)
        if oldest is None or oldest <= EVERYTHING:
            return None
        return max(min(oldest, self._hi + 1), lo)

    def _cols_of(self, series: Series) -> Columns:
        assert self._cols is not None
        return self._cols.get(series) or Columns()


def _joined(kept: Columns, lo: int, since: int, fresh: Columns | None) -> Columns:
    """``kept``'s samples in ``[lo, since)`` followed by ``fresh`` (read from ``since``)."""
    kept = kept.ordered()
    i, j = bisect.bisect_left(kept.ts, lo), bisect.bisect_left(kept.ts, since)
    out = Columns()
    out.ts, out.vals = kept.ts[i:j], kept.vals[i:j]
    if fresh is not None:
        out.extend(fresh.ordered())
    return out


def _summaries(cols: Mapping[Series, Columns]) -> dict[Series, Aggregate]:
    out: dict[Series, Aggregate] = {}
    for series, c in cols.items():
        agg = summarize(c)
        if agg is not None:
            out[series] = agg
    return out
