"""NodeInputs from the real TSDB: last fresh sample, stale = missing, pods without a view."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hooks.qos import QoSClass
from metrics import model
from metrics.model import ContainerView, PodView, Sample, labels
from metrics.qos.inputs import build_be_cpu_window, build_node_inputs
from metrics.store.tsdb import TSDB

NOW = 1_000.0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TSDB]:
    db = TSDB(tmp_path / "metrics.db", clock=lambda: NOW)
    yield db
    db.close()


def pod(uid: str, qos: QoSClass = QoSClass.LS) -> PodView:
    return PodView(uid=uid, namespace="ns", name=uid, sandbox_id=uid, qos=qos, priority=0, priority_class="",
                   cgroup_dir=f"kubepods/pod{uid}", containers=(ContainerView(f"{uid}-c", "main", "x"),))


def test_last_sample_within_twice_the_interval(store: TSDB) -> None:
    store.write([
        Sample(model.NODE_CPU_USAGE, 3.0, ts=NOW - 5), Sample(model.NODE_CPU_USAGE, 4.0, ts=NOW - 1.5),
        Sample(model.NODE_MEMORY_USED, 600.0, ts=NOW - 1), Sample(model.NODE_MEMORY_TOTAL, 1000.0, ts=NOW - 1),
        Sample(model.POD_CPU_USAGE, 1.5, labels(pod_uid="a"), NOW - 0.5),
        Sample(model.POD_CPU_USAGE, 9.0, labels(pod_uid="b"), NOW - 3),  # stale
        Sample(model.POD_CPU_USAGE, 0.4, labels(pod_uid="ghost"), NOW - 1),  # no PodView
        Sample(model.CONTAINER_CPU_THROTTLED, 0.2, labels(pod_uid="a", container_id="a-c"), NOW - 1),
    ])
    store.flush()
    got = build_node_inputs(store, [pod("a"), pod("b")], now=NOW, capacity_cores=8, reserved_cores=0.5)
    assert got.node_cpu_used == 4.0
    assert (got.node_memory_used, got.node_memory_total) == (600.0, 1000.0)
    assert dict(got.pod_cpu_used) == {"a": 1.5, "ghost": 0.4}
    assert dict(got.container_throttled) == {"a-c": 0.2}
    assert got.missing == ("pod_cpu_usage_cores{ns/b}",)
    assert got.node_cpu_avg == pytest.approx(3.5)  # both node samples are in the 5 s window


def test_unflushed_samples_count_and_a_stale_node_is_missing(store: TSDB) -> None:
    store.write([Sample(model.NODE_CPU_USAGE, 4.0, ts=NOW - 2.5),
                 Sample(model.POD_CPU_USAGE, 1.0, labels(pod_uid="a"), NOW - 0.2)])  # not flushed
    got = build_node_inputs(store, [pod("a")], now=NOW, capacity_cores=8, reserved_cores=0)
    assert got.node_cpu_used is None and "node_cpu_usage_cores" in got.missing
    assert got.pod_cpu_used == {"a": 1.0}


def test_be_window(store: TSDB) -> None:
    store.write([Sample(m, v + i, ts=NOW - 9 + i) for i in range(10)
                 for m, v in ((model.BE_CPU_USAGE, 1.0), (model.BE_CPU_REQUEST, 10.0), (model.BE_CPU_LIMIT, 2.0))])
    store.flush()
    win = build_be_cpu_window(store, now=NOW, window=10)
    assert win is not None
    assert (win.count, win.usage_avg, win.request_last, win.limit_last) == (10, 5.5, 19.0, 11.0)
    assert build_be_cpu_window(store, now=NOW + 100, window=10) is None
