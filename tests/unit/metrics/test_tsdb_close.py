"""Closing the store leaves the database file alone: no -wal beside it, whoever else
still has it open (``top`` in another process), and the metrics task closes it when
it is stopped. A full disk under the store is tested on a real small filesystem in
tests/integration/test_metrics_store_full.py."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from pathlib import Path

import pytest

from metrics import model as m
from metrics.agent import MetricsAgent, metrics_task
from metrics.model import Sample
from metrics.store.tsdb import TSDB
from runtimeproxy.hookapi import HostRoots, TaskInit


def _wal(db: Path) -> int:
    """Size of the -wal beside ``db``; 0 when there is none."""
    try:
        return Path(f"{db}-wal").stat().st_size
    except FileNotFoundError:
        return 0


def _fill(db: TSDB, rows: int = 40) -> None:
    for i in range(rows):
        db.write([Sample("m", float(j), (("k", str(j)),), 1000.0 + i) for j in range(500)], 1000.0 + i)
        db.flush()


def test_close_truncates_the_wal_while_another_connection_still_reads(tmp_path: Path) -> None:
    """SQLite removes the WAL when the last connection closes; with a reader left open
    elsewhere (``top``), only the truncating checkpoint at close empties it."""
    path = tmp_path / "m.db"
    db = TSDB(path, clock=lambda: 1040.0)
    _fill(db)
    # A reader in another thread (the per-thread connections close with the store)...
    seen: list[int] = []
    worker = threading.Thread(target=lambda: seen.append(len(db.series("m"))))
    worker.start()
    worker.join()
    assert seen == [500]
    assert _wal(path) > 100_000, "the test needs a WAL worth truncating"
    # ...and one the store does not know, as another process would hold.
    outsider = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        assert outsider.execute("SELECT count(*) FROM series").fetchone()[0] == 500
        db.close()
        assert _wal(path) == 0
    finally:
        outsider.close()
    with contextlib.closing(TSDB.open_readonly(path)) as again:
        assert len(again.series("m")) == 500


def test_close_closes_every_readers_connection(tmp_path: Path) -> None:
    path = tmp_path / "m.db"
    db = TSDB(path, clock=lambda: 1040.0)
    _fill(db, rows=2)
    conns: list[sqlite3.Connection] = []

    def read() -> None:
        db.series("m")
        conns.append(db._readers.connection())  # this thread's own, as the read used

    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    db.close()
    assert len({id(c) for c in conns}) == 3
    for conn in conns:
        with pytest.raises(sqlite3.ProgrammingError, match="closed"):
            conn.execute("SELECT 1")
    assert not Path(f"{path}-wal").exists() and not Path(f"{path}-shm").exists()


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.asyncio
async def test_stopping_the_metrics_task_closes_the_store(tmp_path: Path) -> None:
    """SIGTERM cancels the task: the store is flushed, checkpointed and closed, so no
    -wal (3.5 MB on a node before this) is left beside the file."""
    host = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys", resctrl=tmp_path / "r")
    _write(host.proc / "stat", "cpu  100 0 50 800 0 0 0 0 0 0\ncpu0 100 0 50 800 0 0 0 0 0 0\n")
    _write(host.proc / "meminfo", "MemTotal:        8000 kB\nMemFree:         1000 kB\nMemAvailable:    3000 kB\n")
    _write(host.sys / "devices/system/cpu/online", "0\n")
    for controller in ("cpu", "cpuacct", "memory", "cpuset"):
        (host.cgroup / controller).mkdir(parents=True)
    db = tmp_path / "m.db"
    provided: list[object] = []  # what the task hands the tasks built on it: its agent
    init = TaskInit(name="metrics", key_path="tasks.metrics", provide=provided.append,
                    snapshot=lambda: ({}, {}), host=host,
                    add_route=lambda _path, _route: None, add_explainer=lambda _name, _explainer: None,
                    args={"db": str(db), "schedlat_source": "off", "cpi": False, "flush_interval": "100ms",
                          "intervals": {"node": "100ms", "pods": "100ms", "psi": "300ms", "topology": "1h"}})
    run = metrics_task(init)
    agent = provided[0]
    assert isinstance(agent, MetricsAgent)
    task = asyncio.create_task(run())
    async with asyncio.timeout(20):
        while agent.ticks["node"] < 3 or _wal(db) == 0:
            await asyncio.sleep(0.05)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert _wal(db) == 0
    with contextlib.closing(TSDB.open_readonly(db)) as after:
        assert after.series(m.NODE_MEMORY_USED) == [m.NO_LABELS]
