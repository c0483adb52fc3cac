"""The store while its file cannot be written: disk full, I/O errors, read-only.

A full disk is an outage of the disk, not of the node's measurements: the collectors
keep running, the newest values (``last()``, the exporter) and the window reads
(NodeMetric, the QoS manager) are served from memory, and the flush is retried with
back-off until the file takes writes again. Meanwhile the batch is bounded: past
``max_pending`` samples the oldest frames are dropped, and counted.

The operator hears about it once: one warning when the store degrades, one info line
when it recovers (with how long it lasted and how many samples were dropped), a gauge
and a counter on ``/metrics``, and a ``store`` entry in ``explain``.
"""

from __future__ import annotations

import errno
import sqlite3
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Final

from metrics.store.tsdbcols import Columns

#: SQLite primary result codes of a file that cannot be written now but may be later:
#: the filesystem went read-only, the device errors, the disk (or quota) is full, the
#: WAL or its index cannot be opened or grown.
_UNWRITABLE_CODES: Final = frozenset({
    sqlite3.SQLITE_READONLY, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_FULL, sqlite3.SQLITE_CANTOPEN,
})
#: First retry after this, doubling up to ``RETRY_MAX``.
RETRY_FIRST: Final = 1.0
RETRY_MAX: Final = 30.0
#: Samples kept in memory while degraded: ~100 s of the agent's full write rate at 110
#: pods (``DEFAULT_MAX_BATCH`` is ~5 s of it), many minutes on a small node; about 50
#: bytes a sample, ~10 MiB in all.
DEFAULT_MAX_PENDING: Final = 200_000

#: One ``write()`` call's samples: series keys, times (ms), values.
Frame = tuple[list[str], list[int], list[float]]


#: The same for the OS calls around the file (making its directory).
_UNWRITABLE_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})


def unwritable(exc: BaseException | None) -> bool:
    """True for an error that says the file cannot take writes (for now), as opposed to
    a damaged file or a bug."""
    if isinstance(exc, sqlite3.Error):
        return (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in _UNWRITABLE_CODES
    if isinstance(exc, OSError):
        return exc.errno in _UNWRITABLE_ERRNOS
    return False


@dataclass
class Degradation:
    """Whether the store is degraded, since when, and when to try writing again."""

    #: The error that degraded the store; None while it writes normally.
    reason: str | None = None
    since: float = 0.0
    retry_at: float = 0.0
    delay: float = RETRY_FIRST
    #: Samples dropped to bound memory, ever (a counter for ``/metrics``).
    dropped: int = 0
    #: Samples dropped during the current degradation.
    dropped_now: int = 0

    @property
    def active(self) -> bool:
        return self.reason is not None

    def fail(self, reason: str, now: float) -> bool:
        """Note a failed write at ``now``; True when this starts a degradation."""
        started = self.reason is None
        if started:
            self.since, self.delay, self.dropped_now = now, RETRY_FIRST, 0
        else:
            self.delay = min(self.delay * 2, RETRY_MAX)
        self.reason = reason
        self.retry_at = now + self.delay
        return started

    def due(self, now: float) -> bool:
        """Time to try the file again (also when the clock went back past the delay)."""
        return not self.active or now >= self.retry_at or self.retry_at - now > RETRY_MAX

    def recover(self, now: float) -> float:
        """The store wrote again; returns how long it was degraded."""
        lasted = max(now - self.since, 0.0)
        self.reason = None
        self.delay = RETRY_FIRST
        return lasted


def trim(batch: list[Frame], count: int, limit: int) -> tuple[list[Frame], int, int]:
    """Drop the oldest frames until at most ``limit`` samples are left (the newest frame
    always stays); returns the batch, its sample count and how many were dropped."""
    if count <= limit:
        return batch, count, 0
    drop = 0
    dropped = 0
    while drop < len(batch) - 1 and count - dropped > limit:
        dropped += len(batch[drop][0])
        drop += 1
    return batch[drop:], count - dropped, dropped


def pending_columns(batch: Iterable[Frame], wanted: Collection[str], lo: int, hi: int) -> dict[str, Columns]:
    """The batch's samples in ``[lo, hi]`` (ms) of the ``wanted`` series keys."""
    out: dict[str, Columns] = {}
    for keys, times, values in batch:
        for key, ms, value in zip(keys, times, values, strict=True):
            if lo <= ms <= hi and key in wanted:
                cols = out.get(key)
                if cols is None:
                    cols = out[key] = Columns()
                cols.append(ms, value)
    return out


def pending_of_metric(batch: Iterable[Frame], metric: str, lo: int, hi: int) -> dict[str, Columns]:
    """The batch's samples in ``[lo, hi]`` (ms) of every series of ``metric``, by the
    series' labels JSON (as the file's reads key them)."""
    prefix = metric + "\n"
    out: dict[str, Columns] = {}
    for keys, times, values in batch:
        for key, ms, value in zip(keys, times, values, strict=True):
            if lo <= ms <= hi and key.startswith(prefix):
                text = key[len(prefix):]
                cols = out.get(text)
                if cols is None:
                    cols = out[text] = Columns()
                cols.append(ms, value)
    return out
