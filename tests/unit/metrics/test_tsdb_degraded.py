"""The degraded store's bookkeeping: which errors degrade it, the retry back-off, the
bound on what it holds. The store itself on a real full filesystem is in
tests/integration/test_metrics_store_full.py (it mounts a tmpfs)."""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path

from metrics.store import tsdbdegraded as d


def _error_of(sql: str, path: Path) -> sqlite3.Error:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        conn.execute(sql)
    except sqlite3.Error as exc:
        return exc
    finally:
        conn.close()
    raise AssertionError(f"{sql} did not fail")


def test_only_errors_of_an_unwritable_file_degrade(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    sqlite3.connect(path).close()
    assert d.unwritable(_error_of("CREATE TABLE t (x)", path))  # SQLITE_READONLY
    assert not d.unwritable(_error_of("SELECT * FROM nowhere", path))  # a bug, not the disk
    (tmp_path / "junk.db").write_bytes(b"not a database" * 100)
    assert not d.unwritable(_error_of("SELECT * FROM t", tmp_path / "junk.db"))  # damaged: CorruptStore's job
    assert d.unwritable(OSError(errno.ENOSPC, "full")) and d.unwritable(OSError(errno.EROFS, "ro"))
    assert not d.unwritable(OSError(errno.EACCES, "denied")) and not d.unwritable(None)


def test_retries_back_off_from_one_second_to_thirty() -> None:
    state = d.Degradation()
    assert state.due(0.0) and not state.active
    assert state.fail("full", 100.0) is True
    assert not state.due(100.5) and state.due(101.0)
    delays = []
    now = 101.0
    for _ in range(7):
        assert state.fail("full", now) is False  # still the same degradation: no second warning
        delays.append(state.retry_at - now)
        now = state.retry_at
    assert delays == [2, 4, 8, 16, 30, 30, 30]
    assert state.due(now - 1000)  # the clock went back further than a delay: try now
    assert state.recover(now) == now - 100.0 and not state.active and state.delay == d.RETRY_FIRST


def _frames(*sizes: int) -> list[d.Frame]:
    return [([f"s{i}"] * n, [i] * n, [0.0] * n) for i, n in enumerate(sizes)]


def test_the_bound_drops_the_oldest_frames_and_keeps_the_newest() -> None:
    batch = _frames(3, 3, 3, 3)
    kept, count, dropped = d.trim(batch, 12, 7)
    assert [f[1][0] for f in kept] == [2, 3] and (count, dropped) == (6, 6)
    assert d.trim(batch, 12, 12) == (batch, 12, 0)
    kept, count, dropped = d.trim(_frames(2, 50), 52, 10)  # one frame past the bound stays
    assert [f[1][0] for f in kept] == [1] and (count, dropped) == (50, 2)


def test_pending_samples_are_read_by_series_and_window() -> None:
    batch: list[d.Frame] = [(["m\n[]", "m\n[[\"k\",\"a\"]]", "n\n[]"], [1000, 1000, 1000], [1.0, 2.0, 3.0]),
                            (["m\n[]"], [2000], [4.0])]
    one = d.pending_columns(batch, {"m\n[]"}, 0, 1500)
    assert list(one) == ["m\n[]"] and list(one["m\n[]"].vals) == [1.0]
    by_labels = d.pending_of_metric(batch, "m", 0, 5000)
    assert {k: list(v.vals) for k, v in by_labels.items()} == {"[]": [1.0, 4.0], '[["k","a"]]': [2.0]}
