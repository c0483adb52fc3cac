"""PSI parsing and PSICollector on fixture /proc/pressure and v2 / hybrid cgroup trees."""

from __future__ import annotations

import gc
from collections.abc import Sequence
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hooks.qos import QoSClass
from metrics import model as m
from metrics.collect.base import ReadError
from metrics.collect.psi import PSICollector, parse_pressure
from runtimeproxy.app import GC_YOUNG_THRESHOLD
from runtimeproxy.hookapi import HostRoots

POD_DIR = "kubepods/besteffort/podu1"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def pressure(some: tuple[float, float, float, int], full: tuple[float, float, float, int] | None) -> str:
    lines = [f"some avg10={some[0]:.2f} avg60={some[1]:.2f} avg300={some[2]:.2f} total={some[3]}"]
    if full is not None:
        lines.append(f"full avg10={full[0]:.2f} avg60={full[1]:.2f} avg300={full[2]:.2f} total={full[3]}")
    return "\n".join(lines) + "\n"


def pod() -> m.PodView:
    return m.PodView(uid="u1", namespace="ns", name="p", sandbox_id="sb", qos=QoSClass.BE, priority=0,
                     priority_class="koord-batch", cgroup_dir=POD_DIR,
                     containers=(m.ContainerView(id="c1", name="app", cgroup_dir=POD_DIR + "/c1"),))


def by_key(samples: Sequence[m.Sample]) -> dict[tuple[str, m.Labels], float]:
    out = {(s.metric, s.labels): s.value for s in samples}
    assert len(out) == len(samples)
    return out


def node_host(tmp_path: Path) -> HostRoots:
    host = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys")
    write(host.proc / "pressure/cpu", pressure((2.1, 0.54, 1.32, 143026065), (0, 0, 0, 0)))
    write(host.proc / "pressure/memory", pressure((0.5, 0.25, 0.1, 3_000_000), (0.25, 0.1, 0.05, 1_500_000)))
    write(host.proc / "pressure/io", pressure((1, 2, 3, 4), (5, 6, 7, 8)))
    return host


def test_parse_pressure_with_and_without_full(tmp_path: Path) -> None:
    both = parse_pressure(pressure((1.5, 2.5, 3.5, 10), (0.5, 0.25, 0.0, 5)), tmp_path)
    assert both["some"].avg60 == 2.5 and both["some"].total_us == 10
    assert both["full"].avg10 == 0.5 and both["full"].total_us == 5
    old_kernel_cpu = parse_pressure(pressure((1.5, 2.5, 3.5, 10), None), tmp_path)
    assert set(old_kernel_cpu) == {"some"}


@pytest.mark.parametrize("text", [
    "", "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n", "some avg10=x avg60=0 avg300=0 total=0\n",
    "some avg10=0.00 avg60=0.00 total=0\n", "weird avg10=0.00\n",
])
def test_parse_pressure_rejects_malformed_text(text: str, tmp_path: Path) -> None:
    with pytest.raises(ReadError):
        parse_pressure(text, tmp_path / "cpu.pressure")


def test_node_psi_percentages_and_totals(tmp_path: Path) -> None:
    write(tmp_path / "cgroup/cgroup.controllers", "cpu memory io\n")
    samples = by_key(PSICollector(node_host(tmp_path)).collect(0, []))
    assert samples[(m.NODE_PSI, m.labels(resource="memory", kind="full", window="avg10"))] == 0.25
    assert samples[(m.NODE_PSI, m.labels(resource="cpu", kind="some", window="avg300"))] == 1.32
    assert samples[(m.NODE_PSI_TOTAL, m.labels(resource="memory", kind="some"))] == pytest.approx(3.0)
    assert samples[(m.NODE_PSI_TOTAL, m.labels(resource="cpu", kind="some"))] == pytest.approx(143.026065)
    # node-level cpu "full" is undefined (the kernel prints zeros): not reported
    assert not [k for k in samples if k[1] == m.labels(resource="cpu", kind="full", window="avg10")]
    assert len(samples) == 3 * 4 + 4 + 4  # cpu some; memory and io some + full


def test_node_cpu_without_full_line(tmp_path: Path) -> None:
    write(tmp_path / "cgroup/cgroup.controllers", "cpu\n")
    host = node_host(tmp_path)
    write(host.proc / "pressure/cpu", pressure((3, 2, 1, 7), None))
    samples = by_key(PSICollector(host).collect(0, []))
    assert samples[(m.NODE_PSI, m.labels(resource="cpu", kind="some", window="avg10"))] == 3


def test_v2_pod_and_container_psi(tmp_path: Path) -> None:
    host = node_host(tmp_path)
    write(host.cgroup / "cgroup.controllers", "cpu memory io\n")
    for rel, base in ((POD_DIR, 10.0), (POD_DIR + "/c1", 20.0)):
        write(host.cgroup / rel / "cpu.pressure", pressure((base, base + 1, base + 2, 1_000_000), (base, 0, 0, 0)))
        write(host.cgroup / rel / "memory.pressure", pressure((base, 0, 0, 0), (0, 0, 0, 0)))
        write(host.cgroup / rel / "io.pressure", pressure((0, 0, 0, 0), (0, 0, 0, 2_000_000)))
    samples = by_key(PSICollector(host).collect(0, [pod()]))
    cpu_full = m.labels(pod_uid="u1", resource="cpu", kind="full", window="avg10")
    assert samples[(m.POD_PSI, cpu_full)] == 10.0  # cgroup cpu "full" is meaningful
    container = m.labels(pod_uid="u1", container_id="c1", resource="cpu", kind="some", window="avg60")
    assert samples[(m.CONTAINER_PSI, container)] == 21.0
    io_total = m.labels(pod_uid="u1", container_id="c1", resource="io", kind="full")
    assert samples[(m.CONTAINER_PSI_TOTAL, io_total)] == pytest.approx(2.0)


def test_a_tick_at_250_pods_allocates_under_a_quarter_of_the_young_threshold(tmp_path: Path) -> None:
    """The PSI tick is the largest batch a collector holds (48 samples a pod, alive until
    the store has them). A young collection inside a tick visits and promotes them all;
    the proxy's threshold must leave most ticks without one, or the tick's cost per pod
    grows with the pod count (it did at 10 000: issue 29)."""
    host = node_host(tmp_path)
    write(host.cgroup / "cgroup.controllers", "cpu memory io\n")
    pods = []
    for i in range(250):
        rel = f"kubepods/besteffort/pod{i}"
        for d in (rel, rel + "/c"):
            for res in ("cpu", "memory", "io"):
                write(host.cgroup / d / f"{res}.pressure", pressure((1, 2, 3, 4), (5, 6, 7, 8)))
        pods.append(m.PodView(uid=f"u{i}", namespace="ns", name=f"p{i}", sandbox_id=f"sb{i}", qos=QoSClass.BE,
                              priority=0, priority_class="", cgroup_dir=rel,
                              containers=(m.ContainerView(id=f"c{i}", name="app", cgroup_dir=rel + "/c"),)))
    collector = PSICollector(host)
    collector.collect(0, pods)  # the first tick builds each pod's files and labels, once
    gc.collect()
    gc.disable()  # the count below is net allocations only while no collection resets it
    try:
        before = gc.get_count()[0]
        samples = collector.collect(0, pods)
        held = gc.get_count()[0] - before
    finally:
        gc.enable()
    assert len(samples) == 250 * 48 + 20  # and the node's: cpu some, memory and io some and full
    assert len(samples) <= held < GC_YOUNG_THRESHOLD / 4


def test_label_tuples_are_canonical_and_share_their_pairs(tmp_path: Path) -> None:
    """Each series' labels are what ``labels`` makes (sorted, equal), but built of shared
    (name, value) pairs: one object per pair across a pod's and its containers' series."""
    host = node_host(tmp_path)
    write(host.cgroup / "cgroup.controllers", "cpu memory io\n")
    for rel in (POD_DIR, POD_DIR + "/c1"):
        for r in ("cpu", "memory", "io"):
            write(host.cgroup / rel / f"{r}.pressure", pressure((1, 2, 3, 4), (5, 6, 7, 8)))
    samples = PSICollector(host).collect(0, [pod()])
    assert len(samples) == 20 + 2 * 3 * 8  # node (no cpu full), then the pod's and the container's 24 series each
    pairs: dict[tuple[str, str], set[int]] = {}
    for sample in samples:
        assert sample.labels == m.labels(**dict(sample.labels)), sample
        for pair in sample.labels:
            pairs.setdefault(pair, set()).add(id(pair))
    # The pod's series and the container's each build their own owner pairs (two objects
    # at most); every kind, resource and window pair is one object.
    assert all(len(ids) <= 2 for ids in pairs.values()), {k: len(v) for k, v in pairs.items()}
    assert all(len(pairs[(name, value)]) == 1 for name, value in pairs if name in ("kind", "resource", "window"))


def test_hybrid_reads_the_unified_tree_and_logs_missing_files_once(tmp_path: Path) -> None:
    host = node_host(tmp_path)
    (host.cgroup / "cpu").mkdir(parents=True)
    write(host.cgroup / "unified/cgroup.procs", "")
    unified = host.cgroup / "unified" / POD_DIR
    write(unified / "cpu.pressure", pressure((4, 5, 6, 0), None))
    write(unified / "memory.pressure", "some avg10=garbage\n")
    collector = PSICollector(host)
    with capture_logs() as logs:
        for tick in range(3):
            samples = by_key(collector.collect(tick, [pod()]))
    assert samples[(m.POD_PSI, m.labels(pod_uid="u1", resource="cpu", kind="some", window="avg300"))] == 6
    assert not [k for k in samples if k[0] == m.CONTAINER_PSI]  # container dir vanished
    events = sorted((e["log_level"], Path(e["path"]).name) for e in logs)
    assert events == [("info", "cpu.pressure"), ("info", "io.pressure"), ("info", "io.pressure"),
                      ("info", "memory.pressure"), ("warning", "memory.pressure")]


def test_pure_v1_reports_node_psi_only(tmp_path: Path) -> None:
    host = node_host(tmp_path)
    (host.cgroup / "cpu").mkdir(parents=True)
    samples = PSICollector(host).collect(0, [pod()])
    assert samples and {s.metric for s in samples} == {m.NODE_PSI, m.NODE_PSI_TOTAL}
