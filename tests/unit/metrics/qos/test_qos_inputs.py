"""NodeInputs from the real TSDB: last fresh sample, stale = missing, pods without a view."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hooks.qos import QoSClass
from metrics import model
from metrics.model import ContainerView, PodView, Sample, labels
from metrics.qos.inputs import KeptWindows, NodeInputs, build_be_cpu_window, build_node_inputs
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


def test_the_be_window_kept_between_rounds_reads_only_what_is_new(store: TSDB) -> None:
    """Issue 29: the round read 300 s of the BE series every second; kept, the next
    round reads only past what the last one read (the store's view, ``tsdbwindow``)."""
    series = ((model.BE_CPU_USAGE, 1.0), (model.BE_CPU_REQUEST, 10.0), (model.BE_CPU_LIMIT, 2.0))
    kept, plain = KeptWindows(store), KeptWindows(_QueriesOnly(store))
    for i in range(20):
        store.write([Sample(m, v + i, ts=NOW - 19 + i) for m, v in series])
        store.flush()
        now = NOW - 19 + i + 0.5
        assert build_be_cpu_window(store, now=now, window=10, kept=kept) == \
            build_be_cpu_window(store, now=now, window=10) == build_be_cpu_window(store, now=now, window=10,
                                                                                  kept=plain)
    (view,) = kept._views.values()
    assert view is not None and (view.full_reads, view.partial_reads) == (1, 19)  # type: ignore[attr-defined]
    assert plain._views == {((model.BE_CPU_USAGE, model.NO_LABELS), (model.BE_CPU_REQUEST, model.NO_LABELS),
                              (model.BE_CPU_LIMIT, model.NO_LABELS)): None}  # a reader without views: read whole


class _QueriesOnly:
    """The same store seen only through ``MetricReader``: the per-series queries."""

    def __init__(self, db: TSDB) -> None:
        self.aggregate, self.aggregate_all, self.aggregate_many = db.aggregate, db.aggregate_all, db.aggregate_many
        self.last, self.get_kv = db.last, db.get_kv


def test_the_in_memory_view_gives_what_the_queries_give(store: TSDB, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29: a round's inputs from the store's newest values (no query per pod) are
    the inputs the per-series queries gave, flushed or not, fresh or stale, known or not."""
    pods = [pod(u) for u in "abcd"]
    store.write([Sample(model.NODE_CPU_USAGE, 4.0, ts=NOW - 4), Sample(model.NODE_CPU_USAGE, 5.0, ts=NOW - 1)]
                + [Sample(model.POD_CPU_USAGE, v, labels(pod_uid=u), NOW - t)
                   for u, v, t in (("a", 1.0, 3), ("a", 1.5, 0.5), ("b", 2.0, 1), ("c", 9.0, 3), ("ghost", 0.4, 1))]
                + [Sample(model.POD_MEMORY_USED, 1e6, labels(pod_uid="a"), NOW - 1)]
                + [Sample(model.CONTAINER_CPU_USAGE, 0.3, labels(pod_uid="b", container_id="b-c"), NOW - 1),
                   Sample(model.CONTAINER_CPU_THROTTLED, 0.2, labels(pod_uid="a", container_id="a-c"), NOW - 1)])
    store.flush()
    store.write([Sample(model.POD_CPU_USAGE, 0.7, labels(pod_uid="d"), NOW - 0.2)])  # not flushed yet
    queried = build_node_inputs(_QueriesOnly(store), pods, now=NOW, capacity_cores=8, reserved_cores=0.5)
    asked: list[str] = []
    last, aggregate_all = store.last, store.aggregate_all
    monkeypatch.setattr(store, "last", lambda metric, *a: asked.append(metric) or last(metric, *a))
    monkeypatch.setattr(store, "aggregate_all", lambda metric, *a: asked.append(metric) or aggregate_all(metric, *a))
    viewed = build_node_inputs(store, pods, now=NOW, capacity_cores=8, reserved_cores=0.5)
    # node series only: nothing asked per pod or container, no window query over all pods
    assert set(asked) <= {model.NODE_CPU_USAGE, model.NODE_MEMORY_USED, model.NODE_MEMORY_TOTAL}, asked
    assert dict(viewed.pod_cpu_used) == {"a": 1.5, "b": 2.0, "d": 0.7, "ghost": 0.4}
    assert dict(viewed.pod_cpu_used) == dict(queried.pod_cpu_used)
    assert dict(viewed.pod_memory_used) == dict(queried.pod_memory_used)
    assert dict(viewed.container_cpu_used) == dict(queried.container_cpu_used) == {"b-c": 0.3}
    assert dict(viewed.container_throttled) == dict(queried.container_throttled) == {"a-c": 0.2}
    assert viewed.pod_cpu_avg == pytest.approx(queried.pod_cpu_avg)
    assert viewed.pod_cpu_avg["a"] == pytest.approx(1.25)
    assert viewed.missing == queried.missing
    assert "pod_cpu_usage_cores{ns/c}" in viewed.missing


def test_cpu_burst_reads_the_share_pool_only_while_some_pod_bursts_its_quota(
        store: TSDB, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The share-pool averages (two window queries of the store) are CPU burst's alone:
    not part of NODE, and read by burst only when a pod's policy (the node's, or its
    annotation) bursts the CFS quota; then they are the values NODE used to carry."""
    import json

    from hooks.cgroups import CgroupLayout
    from hooks.executor import CgroupExecutor
    from hooks.rules import parse_rules
    from metrics.qos.builtin import CPUBurst
    from metrics.qos.config import ManagerConfig
    from metrics.qos.strategy import NODE, RoundContext, read_inputs

    store.write([Sample(model.NODE_CPU_USAGE, 3.0, ts=NOW - 3), Sample(model.NODE_CPU_USAGE, 4.0, ts=NOW - 1),
                 Sample(model.POD_CPU_USAGE, 1.0, labels(pod_uid="a"), NOW - 3),
                 Sample(model.POD_CPU_USAGE, 1.5, labels(pod_uid="a"), NOW - 1)])
    store.flush()
    asked: list[str] = []
    aggregate, average = store.aggregate, store.average_by_label
    monkeypatch.setattr(store, "aggregate", lambda metric, *a: asked.append(metric) or aggregate(metric, *a))
    monkeypatch.setattr(store, "average_by_label", lambda metric, *a: asked.append(metric) or average(metric, *a))
    burst = CPUBurst()
    (tmp_path / "cgroup" / "cpu").mkdir(parents=True)  # a v1 tree (no quota files: none are read here)

    def inputs(policy: str, *pods: PodView) -> tuple[NodeInputs, object]:
        rules = parse_rules({"cpuBurstStrategy": {"policy": policy}})
        ctx = RoundContext(now=NOW, rules=rules, pods=pods, reader=store,
                           executor=CgroupExecutor(CgroupLayout(tmp_path / "cgroup")), config=ManagerConfig(),
                           capacity_cores=8)
        got = read_inputs(ctx, burst.reads)
        return got[NODE], got[burst.share_pool]

    node, pool = inputs("none", pod("a"))
    assert pool is None and asked == []  # nobody bursts: no window query at all
    assert node.node_cpu_avg is None and dict(node.pod_cpu_avg) == {}  # NODE never carries them
    annotated = PodView(uid="a", namespace="ns", name="a", sandbox_id="a", qos=QoSClass.LS, priority=0,
                        priority_class="", cgroup_dir="kubepods/poda", containers=pod("a").containers,
                        annotations={"koordinator.sh/cpuBurst": json.dumps({"policy": "cfsQuotaBurstOnly"})})
    for policy, who in (("auto", pod("a")), ("none", annotated)):
        asked.clear()
        _node, pool = inputs(policy, who)
        assert asked == [model.NODE_CPU_USAGE, model.POD_CPU_USAGE], policy
        assert pool == (pytest.approx(3.5), {"a": pytest.approx(1.25)})
