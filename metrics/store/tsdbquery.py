"""SQL, the raw tier's storage, reader connections and the pure functions behind
``metrics.store.tsdb.TSDB`` (the rollup tier is in ``metrics.store.tsdbrollup``).

Flushes append one row per written batch to ``frames`` (``metrics.store.tsdbframes``), so a
flush of one sample for each of thousands of series writes a handful of pages at the
end of one b-tree. Keyed by series, it would dirty one page per series, and SQLite
writes whole pages: about 9 MB of disk writes per flush at the agent's 2200 series.
``frames`` are packed into ``chunks`` in bulk when they hold enough samples.

A chunk is up to ``CHUNK_MAX`` consecutive samples of one series in one blob: the time
deltas as 16-bit milliseconds, then the values as float64; deflated, with each value
XORed with its predecessor first, when that leaves enough zero bytes to pay and is
shorter (memory bytes, zero ratios and other integral or flat series shrink to 1-3
bytes a sample; noisy fractions stay plain, 10 bytes). A row per sample cost 21-24
bytes; chunks cost about 7.5 per sample on the agent's mix, and the encoding is
lossless, so reads give exactly the stored numbers.
Chunks are appended (rowid order), which packs pages full; ``chunks_by_series`` finds
them. A series' chunks never overlap in time: compaction merges late samples into the
chunks they belong to, a sample written twice replacing the first, as before.

Times are integer milliseconds; labels canonical JSON (keys sorted, no spaces), so one
series has one key however its labels were ordered. Aggregations follow koordlet's
``AggregateResult``: percentiles sort ascending and take index ``int(n * p) - 1``
floored at 0.
"""

from __future__ import annotations

import array
import bisect
import itertools
import json
import operator
import sqlite3
import sys
import threading
import urllib.parse
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Final

import structlog

from metrics.model import Labels
from runtimeproxy.errors import StoreError
from runtimeproxy.ops.privatefiles import private_file

SCHEMA_VERSION: Final = 3
#: SQLite page caches (KiB): resident memory once filled, so sized to the work. Reads
#: are of recent frames the kernel's page cache holds anyway, and each reading thread
#: has its own connection: 2048 / 512 -> 1024 / 128 took 2.5 MiB off the peak at 110 pods
#: with no CPU cost, compaction and GC included (docs/benchmarks.md, issue 29). Since the
#: compaction goes a slice of series at a time, 512 holds its pages: a GC of a 110-pod
#: store's copy peaked 0.76 MiB lower at the same CPU (315 ms).
WRITER_CACHE_KIB: Final = 512
READER_CACHE_KIB: Final = 128

#: Samples per chunk: 2 minutes at 1 Hz; at most ~1.2 kB, so a row never overflows a page.
CHUNK_MAX: Final = 120
#: Longest time a chunk covers, in ms: window reads look this far back for chunks.
CHUNK_SPAN: Final = 300_000
_MAX_DELTA: Final = 0xFFFF  # what a 16-bit delta holds; a longer gap starts a new chunk
_PLAIN, _DEFLATED = 0, 1
#: Deflate a chunk only when at least 1/3 of its XORed value bytes are zero.
_MIN_ZERO_SHARE: Final = 3
_WBITS: Final = -12  # raw deflate, 4 KiB window: a chunk fits, and no header bytes
_SWAP: Final = sys.byteorder == "big"  # blobs are little-endian on every host

CREATE_FRAMES: Final = (
    "CREATE TABLE frames (id INTEGER PRIMARY KEY, layout INTEGER NOT NULL, lo INTEGER NOT NULL,"
    " hi INTEGER NOT NULL, n INTEGER NOT NULL, ids BLOB NOT NULL, vals BLOB NOT NULL, ts BLOB)"
)
COUNT_FRAME_SAMPLES: Final = "SELECT coalesce(sum(n), 0) FROM frames"
_CHUNKS: Final = (
    "CREATE TABLE chunks (id INTEGER PRIMARY KEY, series_id INTEGER NOT NULL, lo INTEGER NOT NULL,"
    " hi INTEGER NOT NULL, n INTEGER NOT NULL, data BLOB NOT NULL)",
    "CREATE INDEX chunks_by_series ON chunks (series_id, lo, hi)",
    # One row per series and step-aligned bucket (ms); first/last sample as offsets from
    # ``start``, which keeps them to 3 bytes. WITHOUT ROWID: a window read is one range scan.
    "CREATE TABLE rollups (series_id INTEGER NOT NULL, start INTEGER NOT NULL, n INTEGER NOT NULL,"
    " total REAL NOT NULL, vmin REAL NOT NULL, vmax REAL NOT NULL, last REAL NOT NULL,"
    " first_off INTEGER NOT NULL, last_off INTEGER NOT NULL, PRIMARY KEY (series_id, start)) WITHOUT ROWID",
)
CREATE_SCHEMA: Final = (
    # AUTOINCREMENT: ids of series dropped by GC are never reused, so an id a reader
    # resolved a moment ago can never point at another series.
    "CREATE TABLE series (id INTEGER PRIMARY KEY AUTOINCREMENT, metric TEXT NOT NULL,"
    " labels TEXT NOT NULL, UNIQUE (metric, labels))",
    CREATE_FRAMES,
    *_CHUNKS,
    "CREATE TABLE kv (key TEXT PRIMARY KEY, value TEXT NOT NULL, updated REAL NOT NULL)",
    f"PRAGMA user_version = {SCHEMA_VERSION}",
)
#: Schema 1 kept one row per sample in ``points (series_id, ts, value)``, schema 2 the
#: newest samples in ``recent (ts, series_id, value)`` (schema 1 had it too): upgrades
#: pack those rows into chunks. Per version: tables to create, the rows, tables to drop.
MIGRATIONS: Final = {
    1: ((*_CHUNKS, CREATE_FRAMES), "SELECT series_id, ts, value FROM points UNION ALL"
        " SELECT series_id, ts, value FROM recent ORDER BY 1, 2", ("points", "recent")),
    2: ((CREATE_FRAMES,), "SELECT series_id, ts, value FROM recent ORDER BY series_id, ts", ("recent",)),
}

SELECT_SERIES_ID: Final = "SELECT id FROM series WHERE metric = ? AND labels = ?"
INSERT_SERIES: Final = "INSERT OR IGNORE INTO series (metric, labels) VALUES (?, ?)"
INSERT_CHUNK: Final = "INSERT INTO chunks (series_id, lo, hi, n, data) VALUES (?, ?, ?, ?, ?)"
DELETE_CHUNK: Final = "DELETE FROM chunks WHERE id = ?"
_OVERLAPS: Final = f"lo BETWEEN ?2 - {CHUNK_SPAN} AND ?3 AND hi >= ?2"
# ?1 series id, ?2 first ms, ?3 last ms.
OVERLAPPING: Final = f"SELECT id, lo, hi, n, data FROM chunks WHERE series_id = ?1 AND {_OVERLAPS}"
CHUNKS_ONE: Final = f"SELECT lo, hi, n, data FROM chunks WHERE series_id = ?1 AND {_OVERLAPS}"
# ?1 metric, ?2 first ms, ?3 last ms.
CHUNKS_ALL: Final = (
    "SELECT s.labels, c.lo, c.hi, c.n, c.data FROM series s JOIN chunks c ON c.series_id = s.id"
    f" WHERE s.metric = ?1 AND c.lo BETWEEN ?2 - {CHUNK_SPAN} AND ?3 AND c.hi >= ?2"
)
# Chunks do not overlap: the newest one starting by ?3 holds the newest sample by ?3.
LAST_CHUNK: Final = (
    "SELECT lo, hi, n, data FROM chunks WHERE series_id = ?1 AND lo <= ?3 AND hi >= ?2 ORDER BY lo DESC LIMIT 1"
)
SERIES_OF: Final = "SELECT labels FROM series WHERE metric = ? ORDER BY labels"
LATEST_TS: Final = (
    "SELECT max(ts) FROM (SELECT (SELECT hi FROM chunks WHERE series_id = s.id ORDER BY lo DESC LIMIT 1) AS ts"
    " FROM series s WHERE s.metric = ?1 UNION ALL SELECT (SELECT start + last_off FROM rollups"
    " WHERE series_id = s.id ORDER BY start DESC LIMIT 1) FROM series s WHERE s.metric = ?1)"
)
PUT_KV: Final = "INSERT OR REPLACE INTO kv (key, value, updated) VALUES (?, ?, ?)"
GET_KV: Final = "SELECT value FROM kv WHERE key = ?"

PERCENTILES: Final = (0.5, 0.9, 0.95, 0.99)

Point = tuple[int, float]  # (ts ms, value)
_CORRUPT_CODES: Final = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})

log = structlog.get_logger("metrics.store.tsdbquery")


class TSDBError(StoreError):
    """The store cannot do what was asked; the message names the file."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"metrics store {path}: {reason}")
        self.path = path


class CorruptStore(TSDBError):
    """The file is not a database, is damaged, or holds a schema this version does not know."""


class DamagedChunk(StoreError, ValueError):
    """A chunk's blob does not decode: the file is damaged."""


def wrap(path: Path, what: str, exc: sqlite3.Error) -> TSDBError:
    code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
    cls = CorruptStore if code in _CORRUPT_CODES else TSDBError
    return cls(path, f"{what}: {exc}")


def in_transaction(conn: sqlite3.Connection, work: Callable[[], object]) -> None:
    """``work`` in one write transaction, rolled back if it raises."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        work()
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


# --- the file ---------------------------------------------------------------------


def open_writer(path: Path, busy_timeout: float, wal_limit: int) -> tuple[sqlite3.Connection, int]:
    """The writer's connection to a file with our schema (created or upgraded here),
    and the number of samples in ``frames``."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise TSDBError(path, f"cannot create its directory: {exc}") from exc
    try:
        # Created 0600 before SQLite opens it: the -wal and -shm files take its mode.
        private_file(path)
    except OSError as exc:
        raise TSDBError(path, f"cannot create it: {exc}") from exc
    try:
        conn = sqlite3.connect(path, timeout=busy_timeout, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as exc:
        raise wrap(path, "cannot open", exc) from exc
    try:
        # Before anything writes page 1 (journal_mode does), or it has no effect.
        conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        conn.execute("PRAGMA journal_mode = WAL").fetchone()
        # NORMAL in WAL mode: a power loss may lose the last commits, never corrupt the file.
        conn.execute("PRAGMA synchronous = NORMAL")
        # Room for a compaction slice's pages, so few are spilled mid-transaction; no
        # more: the cache stays resident.
        conn.execute(f"PRAGMA cache_size = -{WRITER_CACHE_KIB}")
        conn.execute("PRAGMA temp_store = MEMORY")  # the compaction's sort: no temp file
        # Checkpoints keep the WAL from growing, but it keeps its high-water size
        # on disk unless told to shrink back (GC truncates it fully).
        conn.execute(f"PRAGMA journal_size_limit = {wal_limit}").fetchone()
        version = schema_version(path, conn, readonly=False)
        if version == 0:
            in_transaction(conn, lambda: [conn.execute(sql) for sql in CREATE_SCHEMA])
        elif version in MIGRATIONS:
            _migrate(path, conn, version)
        return conn, int(conn.execute(COUNT_FRAME_SAMPLES).fetchone()[0])
    except sqlite3.Error as exc:
        conn.close()
        raise wrap(path, "cannot open", exc) from exc
    except TSDBError:
        conn.close()
        raise


def schema_version(path: Path, conn: sqlite3.Connection, *, readonly: bool) -> int:
    """Ours, an older one (the writer upgrades it) or 0 for an empty file; else CorruptStore."""
    try:
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    except sqlite3.Error as exc:
        raise wrap(path, "cannot read", exc) from exc
    if version == SCHEMA_VERSION or (version in MIGRATIONS and not readonly):
        return version
    if version == 0 and tables == 0 and not readonly:
        return 0
    if version in MIGRATIONS:
        raise TSDBError(path, f"schema {version}: the agent upgrades it when it opens the store")
    raise CorruptStore(path, f"not a metrics store of schema {SCHEMA_VERSION} (user_version={version})")


def _migrate(path: Path, conn: sqlite3.Connection, version: int) -> None:
    """Older schemas kept a row per sample: pack them into chunks, in one transaction."""

    def migrate() -> None:
        create, select, drop = MIGRATIONS[version]
        for sql in create:
            conn.execute(sql)
        moved = store_series(conn, _by_series(conn.execute(select)))
        for table in drop:
            conn.execute(f"DROP TABLE {table}")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        log.info("tsdb.migrated", path=str(path), from_schema=version, to_schema=SCHEMA_VERSION, samples=moved)

    in_transaction(conn, migrate)


# --- values -----------------------------------------------------------------------


def canonical(labels: Labels) -> Labels:
    """Sorted by key, one value per key: the form every series key uses. Labels that
    are canonical already (``model.labels`` makes them so) come back as they are: the
    store keeps one per series, and a copy would double what the collectors hold."""
    if all(a[0] < b[0] for a, b in itertools.pairwise(labels)):
        return labels
    return tuple(sorted(dict(labels).items()))


def encode_labels(labels: Labels) -> str:
    return json.dumps(dict(labels), sort_keys=True, separators=(",", ":"))


def decode_labels(text: str) -> Labels:
    decoded = json.loads(text)
    return tuple(sorted((str(k), str(v)) for k, v in decoded.items()))


def to_ms(ts: float) -> int:
    return round(ts * 1000)


def from_ms(ms: int) -> float:
    return ms / 1000


def percentile(ascending: Sequence[float], p: float) -> float:
    """koordlet's percentile: index ``int(n * p) - 1``, floored at 0."""
    return ascending[max(int(len(ascending) * p) - 1, 0)]


# --- chunks -----------------------------------------------------------------------


def le_bytes(a: array.array[int] | array.array[float]) -> bytes:
    """The array as little-endian bytes (swapped in place on a big-endian host)."""
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def from_le(a: array.array[int] | array.array[float], raw: bytes) -> None:
    """Append little-endian ``raw`` to ``a``; ValueError when its length does not fit."""
    a.frombytes(raw)
    if _SWAP:
        a.byteswap()


def encode_chunk(ts: Sequence[int], values: Sequence[float]) -> bytes:
    """Strictly ascending ``ts`` (gaps up to 65.5 s) and their values as one blob."""
    deltas = le_bytes(array.array("H", map(operator.sub, ts[1:], ts)))
    floats = array.array("d", values)
    bits = array.array("Q", floats.tobytes())  # the same 8 bytes, as integers to XOR
    bits = array.array("Q", map(operator.xor, bits, itertools.chain((0,), bits)))
    plain = bytes((_PLAIN,)) + deltas + le_bytes(floats)
    xored = le_bytes(bits)
    # Deflate pays off through runs of zero bytes (equal neighbours, integral values);
    # a noisy fraction leaves few, and deflating it costs ~40 µs per chunk to save ~20 %.
    if xored.count(0) * _MIN_ZERO_SHARE < len(xored):
        return plain
    packed = bytes((_DEFLATED,)) + zlib.compress(deltas + xored, 1, _WBITS)
    return packed if len(packed) < len(plain) else plain


def decode_chunk(lo: int, n: int, data: bytes) -> tuple[list[int], list[float]]:
    """(timestamps ms, values) of a chunk; DamagedChunk when the blob does not decode."""
    ts, values = decode_chunk_arrays(lo, n, data)
    return ts.tolist(), values.tolist()


def decode_chunk_arrays(lo: int, n: int, data: bytes) -> tuple[array.array[int], array.array[float]]:
    """``decode_chunk`` as arrays (no object per sample); DamagedChunk likewise."""
    try:
        codec, body = data[0], data[1:]
        if codec == _DEFLATED:
            body = zlib.decompress(body, _WBITS)
        elif codec != _PLAIN:
            raise DamagedChunk(f"unknown chunk codec {codec}")
        cut = 2 * (n - 1)
        deltas: array.array[int] = array.array("H")
        from_le(deltas, body[:cut])
        values: array.array[float] = array.array("d")
        if codec == _DEFLATED:
            bits: array.array[int] = array.array("Q")
            from_le(bits, body[cut:])
            values.frombytes(array.array("Q", itertools.accumulate(bits, operator.xor)).tobytes())
        else:
            from_le(values, body[cut:])
    except (IndexError, zlib.error) as exc:
        raise DamagedChunk(f"damaged chunk: {exc}") from exc
    if len(deltas) != n - 1 or len(values) != n:
        raise DamagedChunk(f"damaged chunk: {len(values)} values for {n} samples")
    return array.array("q", itertools.accumulate(deltas, initial=lo)), values


def _chunk_end(ts: Sequence[int], i: int) -> int:
    """End (exclusive) of the chunk starting at ``ts[i]``."""
    end = bisect.bisect_right(ts, ts[i] + CHUNK_SPAN, i, min(i + CHUNK_MAX, len(ts)))
    if max(map(operator.sub, ts[i + 1 : end], ts[i : end - 1]), default=0) <= _MAX_DELTA:
        return end
    return next(k for k in range(i + 1, end) if ts[k] - ts[k - 1] > _MAX_DELTA)


def pack(ts: Sequence[int], values: Sequence[float]) -> Iterator[tuple[int, int, int, bytes]]:
    """``(lo, hi, n, blob)`` chunks of strictly ascending samples of one series."""
    i = 0
    while i < len(ts):
        end = _chunk_end(ts, i)
        yield ts[i], ts[end - 1], end - i, encode_chunk(ts[i:end], values[i:end])
        i = end


def _merge(
    conn: sqlite3.Connection, series_id: int, ts: Sequence[int], values: Sequence[float], after: int | None
) -> Iterator[tuple[int, int, int, int, bytes]]:
    """Chunk rows for ascending samples of one series, merged with the stored chunks
    they overlap (deleted here); a sample at a time already stored replaces it.
    ``after``: no stored chunk of the series reaches past it (None: unknown)."""
    old: list[tuple[int, int, int, int, bytes]] = []
    if after is None or ts[0] <= after:
        old = conn.execute(OVERLAPPING, (series_id, ts[0], ts[-1])).fetchall()
    if old:
        merged: dict[int, float] = {}
        for _, lo, _, n, data in old:
            merged.update(zip(*decode_chunk(lo, n, data), strict=True))
        merged.update(zip(ts, values, strict=True))
        ts = sorted(merged)
        values = [merged[t] for t in ts]
        conn.executemany(DELETE_CHUNK, [(row[0],) for row in old])
    return ((series_id, *chunk) for chunk in pack(ts, values))


NO_CHUNKS: Final = -(2**63)
CHUNK_HI: Final = "SELECT series_id, max(hi) FROM chunks GROUP BY series_id"


class ChunkBounds:
    """Series id -> the end (ms) of its latest chunk, as two sorted 64-bit arrays: the
    writer keeps one for every series between compactions, and a dict of ~6300 int
    objects at 110 pods held ~0.6 MiB where this holds 0.1 (issue 29). New series ids
    are the largest (rowids), so an insertion is an append in practice."""

    __slots__ = ("_his", "_ids")

    def __init__(self, pairs: Iterable[tuple[int, int]]) -> None:
        ordered = sorted(pairs)
        self._ids = array.array("q", (sid for sid, _ in ordered))
        self._his = array.array("q", (hi for _, hi in ordered))

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, series_id: int) -> int:
        """The series' bound; ``NO_CHUNKS`` for a series without chunks."""
        i = bisect.bisect_left(self._ids, series_id)
        return self._his[i] if i < len(self._ids) and self._ids[i] == series_id else NO_CHUNKS

    def __setitem__(self, series_id: int, hi: int) -> None:
        i = bisect.bisect_left(self._ids, series_id)
        if i < len(self._ids) and self._ids[i] == series_id:
            self._his[i] = hi
        else:
            self._ids.insert(i, series_id)
            self._his.insert(i, hi)


def store_series(
    conn: sqlite3.Connection,
    series: Iterable[tuple[int, Sequence[int], Sequence[float]]],
    chunk_hi: ChunkBounds | None = None,
) -> int:
    """``(series_id, strictly ascending ts_ms, values)`` into ``chunks``; returns the
    sample count. ``chunk_hi``, when given, bounds every series' chunks: series id ->
    no chunk ends later (a series missing has none; ``CHUNK_HI`` fills it, this keeps
    it up to date). It spares the overlap query for samples past the bound."""
    count = 0
    chunks: list[tuple[int, int, int, int, bytes]] = []
    for series_id, ts, values in series:
        if chunk_hi is None:
            rows = list(_merge(conn, series_id, ts, values, None))
        else:
            after = chunk_hi.get(series_id)
            rows = list(_merge(conn, series_id, ts, values, after))
            chunk_hi[series_id] = max(after, *(row[2] for row in rows))
        chunks += rows
        count += len(ts)
    # In time order, so rowids follow time and the oldest data fills the first pages:
    # deleting it frees whole pages, even after a compaction of many minutes.
    chunks.sort(key=operator.itemgetter(1))
    conn.executemany(INSERT_CHUNK, chunks)
    return count


def _by_series(rows: Iterable[tuple[int, int, float]]) -> Iterator[tuple[int, list[int], list[float]]]:
    """Rows sorted by series then time, one series at a time (bounded memory); of two
    rows for one time, the second."""
    for series_id, group in itertools.groupby(rows, key=operator.itemgetter(0)):
        ts: list[int] = []
        values: list[float] = []
        for _, t, v in group:
            if ts and ts[-1] == t:
                values[-1] = v
                continue
            ts.append(t)
            values.append(v)
        yield series_id, ts, values


def chunk_points(lo: int, hi: int, n: int, data: bytes, start: int, end: int) -> list[Point]:
    """The chunk's samples within ``[start, end]``."""
    ts, values = decode_chunk(lo, n, data)
    if start <= lo and hi <= end:
        return list(zip(ts, values, strict=True))
    i, j = bisect.bisect_left(ts, start), bisect.bisect_right(ts, end)
    return list(zip(ts[i:j], values[i:j], strict=True))


def chunk_last(conn: sqlite3.Connection, series_id: int, lo: int, hi: int) -> list[Point]:
    """The newest chunked sample in ``[lo, hi]``, if any."""
    out: list[Point] = []
    for c_lo, c_hi, n, data in conn.execute(LAST_CHUNK, (series_id, lo, hi)):
        out += chunk_points(c_lo, c_hi, n, data, lo, hi)[-1:]
    return out


class ReaderConnections:
    """One read-only connection per thread, so readers never share a cursor and never
    wait for the writer (WAL). ``mode=ro`` also means a reader never creates the file."""

    def __init__(self, path: Path, busy_timeout: float) -> None:
        self._uri = f"file:{urllib.parse.quote(str(path))}?mode=ro"
        self._timeout = busy_timeout
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: list[tuple[threading.Thread, sqlite3.Connection]] = []

    def connection(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        conn = sqlite3.connect(
            self._uri, uri=True, timeout=self._timeout, isolation_level=None, check_same_thread=False
        )
        # Readers scan windows once; their pages are in the OS cache anyway, and a
        # 2 MiB cache per worker thread would stay resident for nothing.
        conn.execute(f"PRAGMA cache_size = -{READER_CACHE_KIB}")
        self._local.conn = conn
        with self._lock:
            # Threads come and go (executor workers): close what dead threads left behind.
            dead = [c for t, c in self._open if not t.is_alive()]
            self._open = [(t, c) for t, c in self._open if t.is_alive()]
            self._open.append((threading.current_thread(), conn))
        for c in dead:
            c.close()
        return conn

    def close_all(self) -> None:
        with self._lock:
            conns, self._open = self._open, []
        for _, c in conns:
            c.close()
