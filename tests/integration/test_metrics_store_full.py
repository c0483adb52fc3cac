"""Issue 14 item 16: a full disk under the metrics store, on a real small filesystem.

Each test mounts its own tmpfs (2 MiB), fills it with a file, and unmounts it after.
The store must keep serving from memory (newest values, window reads, NodeMetric,
explain), say so once (one warning, a gauge), bound what it holds, and write again
once space returns (one info line). Stopping the proxy closes the store: no -wal left.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from metrics import model as m
from metrics.model import Sample
from metrics.store.tsdb import TSDB
from tests.tmpfs import fill, small_tmpfs

SERIES = 200


@pytest.fixture
def small_fs() -> Iterator[Path]:
    """A 2 MiB tmpfs of our own, unmounted (and its mount point removed) afterwards."""
    with small_tmpfs("2m", "fullfs-") as point:
        yield point


def _tick(db: TSDB, t: float) -> None:
    db.write([Sample("m", t + j, (("k", str(j)),), t) for j in range(SERIES)], t)


def test_a_full_disk_degrades_the_store_which_serves_from_memory_and_recovers(small_fs: Path) -> None:
    now = [1000.0]
    db = TSDB(small_fs / "m.db", clock=lambda: now[0], max_batch=1000, max_pending=2000)
    try:
        _tick(db, now[0])
        assert db.flush() == SERIES and db.degraded is None
        filler = fill(small_fs)
        with capture_logs() as logs:
            for _ in range(30):  # 30 ticks of 200 while full: 6000 samples, 2000 may stay
                now[0] += 1
                _tick(db, now[0])
                assert db.flush() == 0
            db.put_kv("meta", {"pods": 3})
            gc = db.gc()  # nothing collected, nothing raised
        assert (gc.points_deleted, gc.points_folded, gc.series_deleted) == (0, 0, 0)
        assert db.degraded is not None and "full" in db.degraded
        assert [e["log_level"] for e in logs if e["event"] == "tsdb.store_degraded"] == ["warning"]
        assert not [e for e in logs if e["event"] not in ("tsdb.store_degraded", "tsdb.gc")], logs
        state = db.state()
        assert state["pending_samples"] == 2000 and state["dropped_samples"] == 4000 == db.dropped_samples
        # Served from memory: the newest value, the kept window (the 10 newest ticks),
        # every read the NodeMetric report and the QoS manager use.
        newest = db.last("m", (("k", "7"),), max_age=5, now=now[0])
        assert newest is not None and newest.value == now[0] + 7
        agg = db.aggregate("m", (("k", "7"),), 1000.0, now[0])
        assert agg is not None and agg.count == 1 + 10 and agg.last == now[0] + 7
        assert len(db.aggregate_all("m", now[0] - 5, now[0])) == SERIES
        many = db.aggregate_many([("m", (("k", "0"),)), ("m", (("k", "1"),))], now[0] - 4.5, now[0])
        assert {a.count for a in many.values()} == {5}
        assert db.get_kv("meta") == {"pods": 3}
        # Space comes back: the next retry writes what memory held, and says so once.
        filler.unlink()
        with capture_logs() as logs:
            now[0] += 60  # past the back-off
            assert db.flush() == 2000
            _tick(db, now[0])
            assert db.flush() == SERIES
        assert [(e["event"], e["log_level"], e["samples_dropped"]) for e in logs] == [
            ("tsdb.store_recovered", "info", 4000)]
        assert db.degraded is None and db.state()["pending_samples"] == 0
        db.gc()
        assert db.degraded is None
    finally:
        db.close()
    with contextlib.closing(TSDB.open_readonly(small_fs / "m.db")) as again:
        agg = again.aggregate("m", (("k", "7"),), 1000.0, now[0])
        assert agg is not None and agg.count == 1 + 10 + 1
        assert again.get_kv("meta") == {"pods": 3}


def test_the_flush_is_retried_with_back_off_not_on_every_tick(small_fs: Path) -> None:
    now = [1000.0]
    db = TSDB(small_fs / "m.db", clock=lambda: now[0])
    try:
        _tick(db, now[0])
        db.flush()
        fill(small_fs)
        attempts: list[float] = []
        original = db._insert_frames

        def counted(*args: Any) -> Any:
            attempts.append(now[0])
            return original(*args)

        db._insert_frames = counted  # type: ignore[method-assign]
        for _ in range(120):  # two minutes of 1 s ticks
            now[0] += 1
            _tick(db, now[0])
            db.flush()
        gaps = [b - a for a, b in itertools.pairwise(attempts)]
        assert 5 <= len(attempts) <= 12, attempts
        assert gaps == sorted(gaps) and max(gaps) <= 30, gaps
    finally:
        db.close()


def test_closing_on_a_full_disk_does_not_raise(small_fs: Path) -> None:
    db = TSDB(small_fs / "m.db", clock=lambda: 1000.0)
    _tick(db, 1000.0)
    db.flush()
    fill(small_fs)
    _tick(db, 1001.0)
    with capture_logs() as logs:
        db.close()
    assert {"tsdb.store_degraded", "tsdb.closed_with_pending"} <= {e["event"] for e in logs}


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def _gauge(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_the_proxy_keeps_measuring_on_a_full_disk_and_closes_the_store_at_sigterm(
    proxy_factory: Any, small_fs: Path,
) -> None:
    db_path = small_fs / "metrics.db"
    proxy = proxy_factory.start(extra={"tasks": {"metrics": {
        "db": str(db_path), "flush_interval": "500ms", "node_name": "krpt-node",
        "intervals": {"node": "500ms", "pods": "500ms", "psi": "2s"}, "schedlat_source": "off", "memlat_source": "off",
    }}})
    port = proxy.metrics_port
    deadline = time.monotonic() + 20
    while not db_path.exists() or Path(f"{db_path}-wal").stat().st_size == 0:
        assert time.monotonic() < deadline, proxy.log()[-3000:]
        time.sleep(0.2)
    filler = fill(small_fs)
    degraded = proxy.wait_event("tsdb.store_degraded", timeout=20)
    assert degraded["level"] == "warning" and "full" in degraded["error"]
    time.sleep(3)  # a few more ticks and retries while full
    status, body = _get(port, "/debug/explain")
    assert status == 200, body
    view = json.loads(body)["tasks"]["metrics"]
    assert view["store"]["degraded"] is not None
    assert view[m.NODE_CPU_USAGE] is not None and view[m.NODE_MEMORY_USED] is not None, view
    status, body = _get(port, "/apis/nodemetric")
    assert status == 200 and "nodeUsage" in body, body[:2000]
    assert _gauge(_get(port, "/metrics")[1], "koord_runtime_proxy_store_degraded") == 1.0
    assert proxy.running and not proxy.events("task_crashed"), proxy.log()[-3000:]
    assert len(proxy.events("tsdb.store_degraded")) == 1
    # Space comes back: recovered once, measured data reaches the file again.
    filler.unlink()
    recovered = proxy.wait_event("tsdb.store_recovered", timeout=40)
    assert recovered["level"] == "info"
    back = time.time()
    time.sleep(1.5)
    assert _gauge(_get(port, "/metrics")[1], "koord_runtime_proxy_store_degraded") == 0.0
    with contextlib.closing(TSDB.open_readonly(db_path)) as store:
        newest = store.latest_ts(m.NODE_CPU_USAGE)
        assert newest is not None and newest >= back - 1, (newest, back)
    assert len(proxy.events("tsdb.store_degraded")) == 1 and not proxy.events("task_crashed")
    proxy.send(signal.SIGTERM)
    assert proxy.wait_exit() == 0
    wal = Path(f"{db_path}-wal")
    assert not wal.exists() or wal.stat().st_size == 0, os.listdir(small_fs)


@pytest.mark.parametrize("existing", [True, False], ids=["existing-db", "new-db"])
def test_a_store_opened_on_a_full_disk_starts_degraded_and_opens_when_space_returns(
    small_fs: Path, existing: bool,
) -> None:
    """Before: TSDBError from the constructor, i.e. a config error (exit 2) at start."""
    now = [1000.0]
    path = small_fs / "m.db"
    if existing:
        with contextlib.closing(TSDB(path, clock=lambda: now[0])) as first:
            _tick(first, now[0])
    filler = fill(small_fs)
    with capture_logs() as logs:
        db = TSDB(path, clock=lambda: now[0])
    try:
        assert db.degraded is not None, "opened on a full disk"
        assert [e["event"] for e in logs] == ["tsdb.store_degraded"]
        now[0] += 1
        _tick(db, now[0])
        db.put_kv("meta", {"pods": 1})
        db.gc()
        db.compact()
        assert db.flush() == 0
        newest = db.last("m", (("k", "3"),), max_age=5, now=now[0])
        assert newest is not None and newest.value == now[0] + 3
        agg = db.aggregate("m", (("k", "3"),), now[0] - 0.5, now[0])
        assert agg is not None and agg.count == 1
        filler.unlink()
        now[0] += 60
        with capture_logs() as logs:
            assert db.flush() == SERIES
        assert [e["event"] for e in logs] == ["tsdb.store_recovered"]
        assert db.get_kv("meta") == {"pods": 1}
    finally:
        db.close()
    with contextlib.closing(TSDB.open_readonly(path)) as again:
        agg = again.aggregate("m", (("k", "3"),), 0, now[0])
        assert agg is not None and agg.count == (2 if existing else 1)
        assert again.get_kv("meta") == {"pods": 1}
