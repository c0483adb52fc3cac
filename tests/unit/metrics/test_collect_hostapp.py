"""Host applications (NodeSLO hostApplications): parsing, confinement, the collector on
fixture cgroup trees, and the system usage without them."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from metrics import model as m
from metrics.collect.be import BEAggregate
from metrics.collect.cgroupfs import PodUsage
from metrics.collect.hostapp import (
    HostApp,
    HostAppCollector,
    HostAppError,
    HostAppUsage,
    parse_host_app,
    parse_host_apps,
)
from metrics.collect.procfs import NodeUsage
from runtimeproxy.hookapi import HostRoots


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2(tmp_path: Path) -> HostRoots:
    roots = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys")
    write(roots.cgroup / "cgroup.controllers", "cpuset cpu memory\n")
    return roots


NGINX = {"name": "nginx", "priority": "koord-prod", "qos": "LS",
         "cgroupPath": {"base": "CgroupRoot", "parentDir": "host-latency-sensitive/", "relativePath": "nginx/"}}


def test_parse_the_crd_shape() -> None:
    assert parse_host_app(NGINX, "hostApplications[0]") == HostApp("nginx", "koord-prod", "LS",
                                                                     "host-latency-sensitive/nginx")
    be = {"name": "logs", "cgroupPath": {"base": "KubepodsBesteffort", "relativePath": "/logagent"}}
    assert parse_host_app(be, "x").cgroup_dir == "kubepods/besteffort/logagent"
    assert parse_host_app(be, "x", "systemd").cgroup_dir == "kubepods.slice/kubepods-besteffort.slice/logagent"
    assert parse_host_app({"name": "a", "cgroupPath": {"relativePath": "system.slice/a.service"}}, "x").cgroup_dir \
        == "system.slice/a.service"


@pytest.mark.parametrize(("item", "message"), [
    ({**NGINX, "cgroupPath": {"parentDir": "../../etc", "relativePath": "x"}},
     "hostApplications[0].cgroupPath.parentDir: escapes the cgroup root (got '../../etc')"),
    ({**NGINX, "cgroupPath": {"relativePath": "a/../../b"}},
     "hostApplications[0].cgroupPath.relativePath: escapes the cgroup root (got 'a/../../b')"),
    ({**NGINX, "cgroupPath": {"base": "Elsewhere", "relativePath": "a"}},
     "hostApplications[0].cgroupPath.base: unknown (got 'Elsewhere'"),
    ({**NGINX, "cgroupPath": None}, "hostApplications[0].cgroupPath: required"),
    ({**NGINX, "name": ""}, "hostApplications[0].name: required (got '')"),
    ({**NGINX, "qos": 3}, "hostApplications[0].qos: must be a string (got 3)"),
    ({**NGINX, "cgroupPath": {"relativePath": "/"}}, "hostApplications[0].cgroupPath: names the cgroup root itself"),
])
def test_bad_items_are_refused_naming_field_and_value(item: dict[str, object], message: str) -> None:
    with pytest.raises(HostAppError) as exc:
        parse_host_app(item, "hostApplications[0]")
    assert str(exc.value).startswith(message)


def test_a_bad_item_does_not_drop_the_others() -> None:
    bad = {**NGINX, "name": "evil", "cgroupPath": {"relativePath": "../x"}}
    apps, problems = parse_host_apps([bad, NGINX, NGINX])
    assert [a.name for a in apps] == ["nginx"]
    assert problems == ["hostApplications[0].cgroupPath.relativePath: escapes the cgroup root (got '../x')",
                        "hostApplications[2].name: duplicate (got 'nginx')"]
    assert parse_host_apps(None) == ((), [])
    assert parse_host_apps({"a": 1})[1] == ["hostApplications: must be a list (got {'a': 1})"]


def test_collector_reads_cpu_and_memory_under_the_root(tmp_path: Path) -> None:
    roots = v2(tmp_path)
    app_dir = roots.cgroup / "host-latency-sensitive" / "nginx"
    write(app_dir / "cpu.stat", "usage_usec 1000000\n")
    write(app_dir / "memory.stat", "anon 300\nfile 1000\nunevictable 20\n")
    clock = Clock()
    collector = HostAppCollector(roots, clock=clock)
    apps, _ = parse_host_apps([NGINX])
    collector.set_apps(apps)
    first = collector.collect(0, [])
    assert [(s.metric, s.value) for s in first] == [(m.HOST_APP_MEMORY_USED, 320.0)]  # cpu needs a delta
    write(app_dir / "cpu.stat", "usage_usec 2500000\n")
    clock.t += 2.0
    samples = collector.collect(0, [])
    lbl = m.labels(host_app_name="nginx", priority_class="koord-prod", qos="LS")
    assert {(s.metric, s.labels): s.value for s in samples} == {
        (m.HOST_APP_CPU_USAGE, lbl): pytest.approx(0.75), (m.HOST_APP_MEMORY_USED, lbl): 320.0}
    assert collector.latest() == HostAppUsage({"nginx": pytest.approx(0.75)}, {"nginx": 320.0})


def test_a_missing_cgroup_costs_its_samples_and_one_log_line(tmp_path: Path) -> None:
    collector = HostAppCollector(v2(tmp_path))
    collector.set_apps(parse_host_apps([NGINX])[0])
    with capture_logs() as logs:
        for _ in range(3):
            assert collector.collect(0, []) == []
    assert len(logs) == 2  # cpu.stat and memory.stat, once each
    assert {e["owner"] for e in logs} == {"nginx"} and all(e["log_level"] == "info" for e in logs)


def test_system_usage_excludes_host_applications(tmp_path: Path) -> None:
    roots = v2(tmp_path)
    agg = BEAggregate(roots)
    pods = PodUsage({}, {}, cpu_complete=True, memory_complete=True)
    node = NodeUsage(cpu=3.0, memory=4e9, capacity=4)
    apps = HostAppUsage({"nginx": 0.75, "db": 1.0}, {"nginx": 1e9})
    samples = {s.metric: s.value for s in agg.samples(node, pods, [], apps)}
    assert samples[m.SYSTEM_CPU_USAGE] == pytest.approx(1.25)
    assert samples[m.SYSTEM_MEMORY_USED] == pytest.approx(3e9)
    floor = {s.metric: s.value for s in agg.samples(node, pods, [], HostAppUsage({"x": 9.0}, {"x": 9e9}))}
    assert floor[m.SYSTEM_CPU_USAGE] == 0.0 and floor[m.SYSTEM_MEMORY_USED] == 0.0


def test_exported_under_koordlets_name_and_labels() -> None:
    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families

    from metrics.report.promexport import LatestValues, register_exporter

    latest = LatestValues(clock=lambda: 1000.0)
    registry = CollectorRegistry()
    exporter = register_exporter(registry, latest, lambda: [], "node-a")
    lbl = m.labels(host_app_name="nginx", priority_class="koord-prod", qos="LS")
    latest.update([m.Sample(m.HOST_APP_CPU_USAGE, 0.75, lbl, 10), m.Sample(m.HOST_APP_MEMORY_USED, 320.0, lbl, 10)])
    got = [(dict(s.labels), s.value) for f in text_string_to_metric_families(exporter.render().decode())
           for s in f.samples if s.name == "koordlet_host_application_resource_usage"]
    common = {"node": "node-a", "host_application_name": "nginx", "priority_class": "koord-prod", "qos": "LS"}
    assert sorted(got, key=lambda g: g[0]["resource"]) == [({**common, "resource": "cpu"}, 0.75),
                                                            ({**common, "resource": "memory"}, 320.0)]
