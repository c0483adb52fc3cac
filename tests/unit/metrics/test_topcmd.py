"""``koord-runtime-proxy top`` through the real CLI, on a store the test fills."""

from __future__ import annotations

from pathlib import Path

import pytest

from hooks.qos import QoSClass
from metrics import model as m
from metrics.store.tsdb import TSDB
from metrics.topcmd import PodMetaRecord, pod_meta_record
from runtimeproxy.cli import main

T0 = 1_700_000_000.0
GIB = 2**30
MIB = 2**20

META: PodMetaRecord = {
    "u-web": {"namespace": "shop", "name": "web-1", "qos": "LS", "priority": 9000},
    "u-db": {"namespace": "shop", "name": "db-0", "qos": "LSR", "priority": 9500},
    "u-batch": {"namespace": "jobs", "name": "spark-7", "qos": "BE", "priority": 5000},
}


def _pod(uid: str) -> m.Labels:
    return m.labels(pod_uid=uid)


def _fill(path: Path) -> None:
    """60 s of samples ending at T0 + 119, plus older ones outside a 60 s window."""
    samples: list[m.Sample] = []
    for t in range(120):
        ts = T0 + t
        recent = t >= 60
        samples += [
            m.Sample(m.NODE_CPU_USAGE, 2.0 if recent else 7.0, m.NO_LABELS, ts),
            m.Sample(m.NODE_CPU_CAPACITY, 8.0, m.NO_LABELS, ts),
            m.Sample(m.NODE_MEMORY_USED, 4 * GIB, m.NO_LABELS, ts),
            m.Sample(m.NODE_MEMORY_TOTAL, 16 * GIB, m.NO_LABELS, ts),
            # web alternates 0.2 / 0.4 (avg 0.3), db a steady 0.5, batch 1.5 then idle.
            m.Sample(m.POD_CPU_USAGE, 0.2 if t % 2 else 0.4, _pod("u-web"), ts),
            m.Sample(m.POD_CPU_USAGE, 0.5, _pod("u-db"), ts),
            m.Sample(m.POD_CPU_USAGE, 1.5 if not recent else 0.1, _pod("u-batch"), ts),
            m.Sample(m.POD_MEMORY_USED, (100 + t) * MIB, _pod("u-web"), ts),
            m.Sample(m.POD_MEMORY_USED, 2048 * MIB, _pod("u-db"), ts),
            m.Sample(m.POD_MEMORY_USED, 512 * MIB, _pod("u-batch"), ts),
            m.Sample(m.POD_MEMORY_CACHE, 999 * MIB, _pod("u-web"), ts),
        ]
    # A pod the agent has no metadata for (yet): shown by uid.
    samples.append(m.Sample(m.POD_CPU_USAGE, 0.05, _pod("u-orphan"), T0 + 119))
    # A pod gone 10 s ago: no longer in the agent's record, its samples stop. Not listed.
    samples += [m.Sample(metric, 0.9, _pod("u-gone"), T0 + t)
                for t in range(100, 110) for metric in (m.POD_CPU_USAGE, m.POD_MEMORY_USED)]
    with TSDB(path) as db:
        db.write(samples)
        db.put_kv(m.KV_POD_META, META)


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "metrics.db"
    _fill(path)
    return path


def _top(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], str]:
    code = main(["top", *args])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def _rows(lines: list[str]) -> list[list[str]]:
    header = next(i for i, line in enumerate(lines) if line.startswith("NAMESPACE"))
    return [line.split() for line in lines[header + 1:]]


def test_node_line_and_pods_sorted_by_cpu(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, err = _top(capsys, "--db", str(store))
    assert (code, err) == (0, "")
    assert "window 60s" in lines[0]
    # Window [T0+59, T0+119]: node avg (7 + 60 * 2) / 61.
    node_cpu = (7.0 + 60 * 2.0) / 61
    assert lines[1] == (
        f"NODE  cpu {node_cpu:.2f}/8.00 cores ({100 * node_cpu / 8:.1f}%)  memory 4096/16384 MiB (25.0%)"
    )
    odd = sum(1 for t in range(59, 120) if t % 2)
    web_cpu = (0.2 * odd + 0.4 * (61 - odd)) / 61
    batch_cpu = (1.5 + 0.1 * 60) / 61
    assert _rows(lines) == [
        ["shop", "db-0", "LSR", "0.500", "2048.0"],
        ["shop", "web-1", "LS", f"{web_cpu:.3f}", "219.0"],
        ["jobs", "spark-7", "BE", f"{batch_cpu:.3f}", "512.0"],
        ["-", "u-orphan", "-", "0.050", "-"],
    ]


def test_sort_by_memory_namespace_filter_and_limit(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, _ = _top(capsys, "--db", str(store), "--sort", "memory")
    assert code == 0
    assert [r[1] for r in _rows(lines)] == ["db-0", "spark-7", "web-1", "u-orphan"]
    code, lines, _ = _top(capsys, "--db", str(store), "--namespace", "shop", "--sort", "memory", "-n", "1")
    assert code == 0
    assert [r[1] for r in _rows(lines)] == ["db-0"]
    code, lines, _ = _top(capsys, "--db", str(store), "--namespace", "kube-system")
    assert code == 0
    assert _rows(lines) == [["(no", "pods", "with", "samples", "in", "the", "window)"]]


def test_a_longer_window_averages_older_samples(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, _ = _top(capsys, "--db", str(store), "--window", "200")
    assert code == 0
    rows = {r[1]: r for r in _rows(lines)}
    assert rows["spark-7"][3] == f"{(1.5 * 60 + 0.1 * 60) / 120:.3f}"
    assert list(rows) == ["spark-7", "db-0", "web-1", "u-orphan"]
    node_cpu = (7.0 * 60 + 2.0 * 60) / 120
    assert lines[1].startswith(f"NODE  cpu {node_cpu:.2f}/8.00 cores")


def test_an_empty_store_prints_unknowns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "empty.db"
    TSDB(path).close()
    code, lines, _ = _top(capsys, "--db", str(path))
    assert code == 0
    assert lines[1] == "NODE  cpu -/- cores (-)  memory -/- MiB (-)"
    assert lines[-1] == "(no pods with samples in the window)"


def test_the_agents_record_of_pod_views_names_the_pods(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pods = [
        m.PodView(uid="u1", namespace="prod", name="api-0", sandbox_id="s1", qos=QoSClass.LSR, priority=9500,
                  priority_class="koord-prod", cgroup_dir="kubepods/podu1"),
        m.PodView(uid="u2", namespace="batch", name="etl-3", sandbox_id="s2", qos=QoSClass.NONE, priority=0,
                  priority_class="", cgroup_dir="kubepods/besteffort/podu2"),
    ]
    record = pod_meta_record(pods)
    assert record == {
        "u1": {"namespace": "prod", "name": "api-0", "qos": "LSR", "priority": 9500},
        "u2": {"namespace": "batch", "name": "etl-3", "qos": "", "priority": 0},
    }
    path = tmp_path / "metrics.db"
    with TSDB(path) as db:
        db.put_kv(m.KV_POD_META, record)
        db.write([m.Sample(m.POD_CPU_USAGE, 0.7, _pod("u1"), T0), m.Sample(m.POD_CPU_USAGE, 0.2, _pod("u2"), T0)])
    code, lines, _ = _top(capsys, "--db", str(path))
    assert code == 0
    assert _rows(lines) == [["prod", "api-0", "LSR", "0.700", "-"], ["batch", "etl-3", "-", "0.200", "-"]]


def test_a_missing_store_is_exit_1_with_a_clear_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "nowhere" / "metrics.db"
    code, lines, err = _top(capsys, "--db", str(path))
    assert (code, lines) == (1, [])
    assert f"no metrics store at {path}" in err
    assert not path.parent.exists()


def test_a_corrupt_store_is_exit_1_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "metrics.db"
    path.write_bytes(b"not sqlite " * 500)
    code, _, err = _top(capsys, "--db", str(path))
    assert code == 1
    assert str(path) in err


def test_bad_window_is_a_usage_error(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["top", "--db", str(store), "--window", "0"])
    assert exc.value.code == 2
    assert "must be a number > 0" in capsys.readouterr().err
