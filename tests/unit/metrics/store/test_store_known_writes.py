"""TSDB.write's path for a sequence of series written before (resolved once, columns
built in C): what it stores is what the sample-by-sample path stores."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from metrics import model as m
from metrics.store.tsdb import TSDB

A = m.labels(pod_uid="a")
B = m.labels(pod_uid="b")


def tick(value: float, *, ts: float = 0.0) -> list[m.Sample]:
    return [m.Sample("pod_cpu", value, A, ts), m.Sample("pod_cpu", value + 1, B, ts),
            m.Sample("pod_mem", value * 2, A, ts)]


def stored(db: TSDB) -> list[tuple[str, m.Labels, float]]:
    return sorted(db.newest_values())


def replay(tmp_path: Path, name: str, writes: Sequence[tuple[list[m.Sample], float]],
           *, remember: bool) -> TSDB:
    db = TSDB(tmp_path / name, clock=lambda: 0.0)
    if not remember:
        db._remember = lambda samples, keys, resolved_in: None  # type: ignore[method-assign]
    for samples, now in writes:
        db.write(samples, now)
    return db


def same_store(tmp_path: Path, writes: Sequence[tuple[list[m.Sample], float]]) -> tuple[TSDB, bool]:
    """The store of ``writes`` (flushed) and whether its batch was unordered, checked
    against the sample-by-sample path's."""
    fast = replay(tmp_path, "fast.db", writes, remember=True)
    slow = replay(tmp_path, "slow.db", writes, remember=False)
    assert stored(fast) == stored(slow)
    unordered = fast._unordered
    assert unordered == slow._unordered
    assert fast._batch == slow._batch
    fast.flush()
    slow.flush()
    for metric, lbl in (("pod_cpu", A), ("pod_cpu", B), ("pod_mem", A)):
        assert fast.points(metric, lbl, 0.0, 100.0) == slow.points(metric, lbl, 0.0, 100.0)
    slow.close()
    return fast, unordered


def test_a_repeated_sequence_is_stored_as_before(tmp_path: Path) -> None:
    db, unordered = same_store(tmp_path, [(tick(1.0), 10.0), (tick(2.0), 11.0), (tick(3.0), 12.0)])
    assert not unordered
    assert db._known is not None and db._known[3].unique
    assert stored(db) == [("pod_cpu", A, 3.0), ("pod_cpu", B, 4.0), ("pod_mem", A, 6.0)]
    db.close()


def test_an_older_or_equal_time_still_marks_the_batch_unordered(tmp_path: Path) -> None:
    db, unordered = same_store(tmp_path, [(tick(1.0), 10.0), (tick(2.0), 12.0), (tick(3.0), 11.0),
                                          (tick(4.0), 11.0)])
    assert unordered
    assert stored(db)[0] == ("pod_cpu", A, 2.0)  # the newest time wins, not the last write
    db.close()


def test_a_series_twice_in_one_write_is_not_taken_for_new_values(tmp_path: Path) -> None:
    twice = [m.Sample("pod_cpu", 1.0, A), m.Sample("pod_cpu", 2.0, A)]
    db, unordered = same_store(tmp_path, [(twice, 10.0), (twice, 11.0)])
    assert db._known is not None and not db._known[2].unique
    assert unordered  # the second value of one time, as before
    db.close()


def test_non_finite_values_and_own_stamps_leave_the_known_path(tmp_path: Path) -> None:
    nan = [m.Sample("pod_cpu", 1.0, A), m.Sample("pod_cpu", float("nan"), B), m.Sample("pod_mem", 2.0, A)]
    stamped = tick(5.0, ts=9.0)
    db, _unordered = same_store(tmp_path, [(tick(1.0), 10.0), (nan, 11.0), (stamped, 12.0), (tick(2.0), 13.0)])
    db.close()


def test_a_changed_label_set_index_resolves_the_keys_again(tmp_path: Path) -> None:
    db = TSDB(tmp_path / "m.db", clock=lambda: 0.0)
    db.write(tick(1.0), 10.0)
    db._forget_keys({})  # as GC does when the series left: the index is replaced, empty
    db.write(tick(2.0), 11.0)
    assert stored(db) == [("pod_cpu", A, 2.0), ("pod_cpu", B, 3.0), ("pod_mem", A, 4.0)]
    assert db._key_count == 3
    db.close()
