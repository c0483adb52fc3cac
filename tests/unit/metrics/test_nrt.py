"""The NodeResourceTopology builder against fixture /sys, /proc and kubelet trees: a
2-socket, 2-NUMA-node SMT host, the expected object written out by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from structlog.testing import capture_logs

from hooks.qos import QoSClass
from metrics.collect.topology import CPUTopology, TopologyCollector
from metrics.model import PodView
from metrics.report.nrt import build_nrt, format_binary, format_cpu, take_by_topology, topology_policy
from metrics.report.nrtsources import parse_kubelet_config
from metrics.report.nrtsync import NRTSources
from runtimeproxy.hookapi import HostRoots
from tests.unit.metrics.crdschema import validate_nrt

RESOURCE_STATUS = "scheduling.koordinator.sh/resource-status"
# cpu -> (core_id, package_id): 2 sockets x 2 cores x 2 threads; socket s = NUMA node s
EIGHT = {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1), 4: (0, 0), 5: (1, 0), 6: (0, 1), 7: (1, 1)}
GiB_KB = 1024 * 1024


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def host_tree(tmp_path: Path) -> HostRoots:
    roots = HostRoots(cgroup=tmp_path / "cgroup", proc=tmp_path / "proc", sys=tmp_path / "sys",
                      resctrl=tmp_path / "resctrl")
    base = roots.sys / "devices/system/cpu"
    for cpu, (core, socket) in EIGHT.items():
        write(base / f"cpu{cpu}/topology/core_id", f"{core}\n")
        write(base / f"cpu{cpu}/topology/physical_package_id", f"{socket}\n")
    write(base / "online", "0-7\n")
    write(base / "intel_pstate/no_turbo", "0\n")
    nodes = roots.sys / "devices/system/node"
    write(nodes / "node0/cpulist", "0-1,4-5\n")
    write(nodes / "node1/cpulist", "2-3,6-7\n")
    write(nodes / "node0/meminfo", f"Node 0 MemTotal:       {16 * GiB_KB} kB\nNode 0 MemFree:  1000 kB\n")
    write(nodes / "node1/meminfo", f"Node 1 MemTotal:       {16 * GiB_KB} kB\nNode 1 MemFree:  1000 kB\n")
    write(nodes / "node0/hugepages/hugepages-2048kB/nr_hugepages", "512\n")  # 1 GiB of 2 MiB pages
    write(nodes / "node0/hugepages/hugepages-1048576kB/nr_hugepages", "0\n")
    write(roots.proc / "cpuinfo", "processor\t: 0\nvendor_id\t: GenuineIntel\n"
                                  "model name\t: Intel(R) Xeon(R) Platinum 8269CY CPU @ 2.50GHz\n\n")
    write(roots.resctrl / "info/L3/cbm_mask", "7ff\n")
    return roots


def pod(uid: str, qos: QoSClass, cpuset: str | None = None, name: str = "") -> PodView:
    annotations = {RESOURCE_STATUS: json.dumps({"cpuset": cpuset})} if cpuset is not None else {}
    return PodView(uid=uid, namespace="default", name=name or uid, sandbox_id=f"sb-{uid}", qos=qos, priority=0,
                   priority_class="", cgroup_dir="", annotations=annotations)


def sources(roots: HostRoots, tmp_path: Path, pods: list[PodView], node: dict[str, Any] | None = None) -> NRTSources:
    return NRTSources("node-a", roots, TopologyCollector(roots).latest, lambda: pods, lambda: node,
                      cpu_manager_state=tmp_path / "kubelet/cpu_manager_state",
                      kubelet_config=tmp_path / "kubelet/config.yaml")


def zone(numa: int, memory: str, huge2m: str) -> dict[str, Any]:
    def res(name: str, value: str) -> dict[str, str]:
        return {"name": name, "capacity": value, "allocatable": value, "available": value}

    return {"name": f"node-{numa}", "type": "Node",
            "resources": [res("cpu", "4"), res("hugepages-1Gi", "0"), res("hugepages-2Mi", huge2m),
                          res("memory", memory)]}


def test_two_numa_smt_static_kubelet_and_bound_pods(tmp_path: Path) -> None:
    roots = host_tree(tmp_path)
    write(tmp_path / "kubelet/config.yaml",
          "kind: KubeletConfiguration\ncpuManagerPolicy: static\n"
          "cpuManagerPolicyOptions:\n  full-pcpus-only: \"true\"\n"
          "reservedSystemCPUs: \"0\"\ntopologyManagerPolicy: single-numa-node\ntopologyManagerScope: pod\n")
    # u-kube: a Guaranteed pod of the kubelet's static policy; u-ls's entry is skipped (an LS pod).
    write(tmp_path / "kubelet/cpu_manager_state", json.dumps({
        "policyName": "static", "defaultCpuSet": "0-5,7",
        "entries": {"u-kube": {"app": "6"}, "u-ls": {"c": "7"}}, "checksum": 1}))
    pods = [pod("u-lsr", QoSClass.LSR, "1,5"), pod("u-lse", QoSClass.LSE, "2-3"), pod("u-ls", QoSClass.LS),
            pod("u-kube", QoSClass.NONE, name="kube-guaranteed")]
    node = {"metadata": {"name": "node-a", "uid": "n-1",
                         "annotations": {"node.koordinator.sh/reservation": '{"reservedCPUs": "4"}'}}}

    build = build_nrt(sources(roots, tmp_path, pods, node).read())

    assert build.problems == ()
    assert build.doc == {
        "apiVersion": "topology.node.k8s.io/v1alpha1",
        "kind": "NodeResourceTopology",
        "metadata": {"name": "node-a", "annotations": {
            "node.koordinator.sh/cpu-basic-info":
                '{"cpuModel":"Intel(R) Xeon(R) Platinum 8269CY CPU @ 2.50GHz","hyperThreadEnabled":true,'
                '"turboEnabled":true,"catL3CbmMask":"7ff","vendorID":"GenuineIntel"}',
            "node.koordinator.sh/cpu-topology":
                '{"detail":[{"id":0,"core":0,"socket":0,"node":0},{"id":1,"core":1,"socket":0,"node":0},'
                '{"id":2,"core":0,"socket":1,"node":1},{"id":3,"core":1,"socket":1,"node":1},'
                '{"id":4,"core":0,"socket":0,"node":0},{"id":5,"core":1,"socket":0,"node":0},'
                '{"id":6,"core":0,"socket":1,"node":1},{"id":7,"core":1,"socket":1,"node":1}]}',
            # all 0-7 - kubelet static 6 - resource-status 1-3,5 - node reservation 4
            "node.koordinator.sh/cpu-shared-pools":
                '[{"socket":0,"node":0,"cpuset":"0"},{"socket":1,"node":1,"cpuset":"7"}]',
            # all 0-7 - kubelet static 6 - LSE 2-3 - node reservation 4
            "node.koordinator.sh/be-cpu-shared-pools":
                '[{"socket":0,"node":0,"cpuset":"0-1,5"},{"socket":1,"node":1,"cpuset":"7"}]',
            "kubelet.koordinator.sh/cpu-manager-policy":
                '{"policy":"static","options":{"full-pcpus-only":"true"},"reservedCPUs":"0"}',
            "node.koordinator.sh/pod-cpu-allocs":
                '[{"namespace":"default","name":"u-lse","uid":"u-lse","cpuset":"2-3","managedByKubelet":false},'
                '{"namespace":"default","name":"u-lsr","uid":"u-lsr","cpuset":"1,5","managedByKubelet":false},'
                '{"namespace":"default","name":"kube-guaranteed","uid":"u-kube","cpuset":"6",'
                '"managedByKubelet":true}]',
            "node.koordinator.sh/reservation": '{"reservedCPUs":"4"}',
        }},
        "topologyPolicies": ["SingleNUMANodePodLevel"],
        "zones": [zone(0, "15Gi", "1Gi"), zone(1, "16Gi", "0")],
    }
    validate_nrt(build.doc)


def test_defaults_without_kubelet_files_or_pods(tmp_path: Path) -> None:
    """No config file, no checkpoint: kubelet's defaults (none / None), every CPU shared."""
    build = build_nrt(sources(host_tree(tmp_path), tmp_path, []).read())
    annotations = build.doc["metadata"]["annotations"]
    assert build.doc["topologyPolicies"] == ["None"]
    assert annotations["kubelet.koordinator.sh/cpu-manager-policy"] == '{"policy":"none"}'
    assert annotations["node.koordinator.sh/pod-cpu-allocs"] == "null"  # koordlet marshals an empty list so
    assert json.loads(annotations["node.koordinator.sh/cpu-shared-pools"]) == [
        {"socket": 0, "node": 0, "cpuset": "0-1,4-5"}, {"socket": 1, "node": 1, "cpuset": "2-3,6-7"}]
    assert annotations["node.koordinator.sh/be-cpu-shared-pools"] == annotations["node.koordinator.sh/cpu-shared-pools"]
    assert annotations["node.koordinator.sh/reservation"] == "{}"
    assert "node.koordinator.sh/system-qos-resource" not in annotations
    validate_nrt(build.doc)


def test_checkpoint_of_the_none_policy_adds_no_kubelet_allocations(tmp_path: Path) -> None:
    roots = host_tree(tmp_path)
    write(tmp_path / "kubelet/cpu_manager_state", '{"policyName":"none","defaultCpuSet":"","checksum":3242152201}')
    # an LS pod the scheduler bound anyway: the cpuset hook pins it, so it is listed too
    build = build_nrt(sources(roots, tmp_path, [pod("u-lsr", QoSClass.LSR, "1"), pod("u-ls", QoSClass.LS, "3")]).read())
    annotations = build.doc["metadata"]["annotations"]
    assert json.loads(annotations["node.koordinator.sh/pod-cpu-allocs"]) == [
        {"namespace": "default", "name": "u-ls", "uid": "u-ls", "cpuset": "3", "managedByKubelet": False},
        {"namespace": "default", "name": "u-lsr", "uid": "u-lsr", "cpuset": "1", "managedByKubelet": False}]
    assert annotations["kubelet.koordinator.sh/cpu-manager-policy"] == '{"policy":"none"}'


def test_static_checkpoint_without_config_file_is_reported_from_its_policy_name(tmp_path: Path) -> None:
    roots = host_tree(tmp_path)
    write(tmp_path / "kubelet/cpu_manager_state",
          '{"policyName":"static","defaultCpuSet":"0-6","entries":{"gone-pod":{"c":"7"}},"checksum":1}')
    annotations = build_nrt(sources(roots, tmp_path, []).read()).doc["metadata"]["annotations"]
    assert json.loads(annotations["node.koordinator.sh/pod-cpu-allocs"]) == [
        {"namespace": "", "name": "", "uid": "gone-pod", "cpuset": "7", "managedByKubelet": True}]
    assert "7" not in annotations["node.koordinator.sh/cpu-shared-pools"]


def test_garbage_checkpoint_is_one_logged_error_and_no_allocations(tmp_path: Path) -> None:
    roots = host_tree(tmp_path)
    write(tmp_path / "kubelet/config.yaml", "cpuManagerPolicy: static\nreservedSystemCPUs: \"0\"\n")
    write(tmp_path / "kubelet/cpu_manager_state", '{"policyName":"static","entries":{"u1":{"c":"6"')
    src = sources(roots, tmp_path, [])
    with capture_logs() as logs:
        first = build_nrt(src.read())
        build_nrt(src.read())
    errors = [e for e in logs if e["event"] == "nrt_source_invalid"]
    assert len(errors) == 1 and errors[0]["log_level"] == "error"
    assert errors[0]["path"].endswith("cpu_manager_state") and "not JSON" in errors[0]["reason"]
    annotations = first.doc["metadata"]["annotations"]
    assert annotations["node.koordinator.sh/pod-cpu-allocs"] == "null"
    assert json.loads(annotations["node.koordinator.sh/cpu-shared-pools"])[0]["cpuset"] == "0-1,4-5"
    validate_nrt(first.doc)


@pytest.mark.parametrize("state", [
    '{"policyName":"static","entries":{"u1":{"c":"7-6"}}}',  # reversed range
    '{"policyName":"static","entries":{"u1":"6"}}',
    '["static"]',
    '{"policyName":3}',
])
def test_malformed_checkpoints_name_the_field(tmp_path: Path, state: str) -> None:
    write(tmp_path / "kubelet/cpu_manager_state", state)
    with capture_logs() as logs:
        build = build_nrt(sources(host_tree(tmp_path), tmp_path, []).read())
    (error,) = [e for e in logs if e["event"] == "nrt_source_invalid"]
    assert any(word in error["reason"] for word in ("entries.u1", "not a JSON object", "policyName"))
    assert build.doc["metadata"]["annotations"]["node.koordinator.sh/pod-cpu-allocs"] == "null"


def test_bad_pod_and_node_annotations_are_left_out_and_reported(tmp_path: Path) -> None:
    bad = PodView(uid="u-bad", namespace="default", name="bad", sandbox_id="sb", qos=QoSClass.LSR, priority=0,
                  priority_class="", cgroup_dir="", annotations={RESOURCE_STATUS: '{"cpuset": "3-1"}'})
    system_qos = '{"cpuset":"0","cpusetExclusive":1}'
    node = {"metadata": {"annotations": {"node.koordinator.sh/reservation": "not json",
                                         "node.koordinator.sh/system-qos-resource": system_qos}}}
    build = build_nrt(sources(host_tree(tmp_path), tmp_path, [bad], node).read())
    assert len(build.problems) == 3
    assert any("pod default/bad" in p and "3-1" in p for p in build.problems)
    assert build.doc["metadata"]["annotations"]["node.koordinator.sh/pod-cpu-allocs"] == "null"
    validate_nrt(build.doc)


def test_a_reservation_given_as_a_cpu_quantity_takes_cpus_by_topology(tmp_path: Path) -> None:
    node = {"metadata": {"annotations": {"node.koordinator.sh/reservation": '{"resources": {"cpu": "1500m"}}'}}}
    annotations = build_nrt(sources(host_tree(tmp_path), tmp_path, [], node).read()).doc["metadata"]["annotations"]
    assert annotations["node.koordinator.sh/reservation"] == '{"resources":{"cpu":"1500m"},"reservedCPUs":"0,4"}'
    assert json.loads(annotations["node.koordinator.sh/cpu-shared-pools"])[0]["cpuset"] == "1,5"


def test_exclusive_system_qos_cpus_leave_both_pools_and_are_copied(tmp_path: Path) -> None:
    node = {"metadata": {"annotations": {"node.koordinator.sh/system-qos-resource": '{"cpuset":"0-1"}'}}}
    annotations = build_nrt(sources(host_tree(tmp_path), tmp_path, [], node).read()).doc["metadata"]["annotations"]
    assert annotations["node.koordinator.sh/system-qos-resource"] == '{"cpuset":"0-1"}'
    for key in ("node.koordinator.sh/cpu-shared-pools", "node.koordinator.sh/be-cpu-shared-pools"):
        assert json.loads(annotations[key])[0]["cpuset"] == "4-5"
    shared = {"metadata": {"annotations": {"node.koordinator.sh/system-qos-resource":
                                           '{"cpuset":"0-1","cpusetExclusive":false}'}}}
    annotations = build_nrt(sources(host_tree(tmp_path), tmp_path, [], shared).read()).doc["metadata"]["annotations"]
    assert json.loads(annotations["node.koordinator.sh/cpu-shared-pools"])[0]["cpuset"] == "0-1,4-5"


def test_numa_reservation_label_takes_kubelet_reserved_from_each_zone(tmp_path: Path) -> None:
    node = {"metadata": {"labels": {"node.koordinator.sh/enable-numa-reservation": "true"}},
            "status": {"capacity": {"cpu": "8", "memory": "32Gi"},
                       "allocatable": {"cpu": "7", "memory": f"{32 * 1024 - 1}Mi"}}}
    build = build_nrt(sources(host_tree(tmp_path), tmp_path, [], node).read())
    assert build.doc["metadata"]["labels"] == {"node.koordinator.sh/enable-numa-reservation": "true"}
    cpu0, *_, mem0 = build.doc["zones"][0]["resources"]
    assert (cpu0["capacity"], cpu0["allocatable"], cpu0["available"]) == ("4", "3500m", "3500m")
    # 15Gi - ceil(1Mi / 2) = 15Gi - 512Ki
    assert (mem0["capacity"], mem0["allocatable"]) == ("15Gi", f"{15 * 1024 * 1024 - 512}Ki")
    validate_nrt(build.doc)


def test_a_host_without_numa_sysfs_is_one_zone_with_meminfo_total(tmp_path: Path) -> None:
    roots = HostRoots(cgroup=tmp_path / "c", proc=tmp_path / "proc", sys=tmp_path / "sys", resctrl=tmp_path / "r")
    for cpu in (0, 1):
        write(roots.sys / f"devices/system/cpu/cpu{cpu}/topology/core_id", f"{cpu}\n")
        write(roots.sys / f"devices/system/cpu/cpu{cpu}/topology/physical_package_id", "0\n")
    write(roots.proc / "meminfo", "MemTotal:        8000 kB\n")
    build = build_nrt(sources(roots, tmp_path, []).read())
    (only,) = build.doc["zones"]
    assert only["name"] == "node-0"
    assert {r["name"]: r["capacity"] for r in only["resources"]} == {
        "cpu": "2", "memory": "8000Ki", "hugepages-1Gi": "0", "hugepages-2Mi": "0"}
    basic = json.loads(build.doc["metadata"]["annotations"]["node.koordinator.sh/cpu-basic-info"])
    assert basic["hyperThreadEnabled"] is False and basic["turboEnabled"] is False
    validate_nrt(build.doc)


def test_reserved_cpus_from_kube_and_system_reserved_take_whole_cores(tmp_path: Path) -> None:
    topology = TopologyCollector(host_tree(tmp_path)).latest()
    assert take_by_topology(topology, 2) == {0, 4}  # socket 0, core 0: both threads
    assert take_by_topology(topology, 3) == {0, 4, 1}
    # cpu 5 offline: core (0,1) has one thread left; one CPU is taken from it, not from a whole core
    partial = CPUTopology(tuple(c for c in topology.cpus if c.cpu != 5))
    assert take_by_topology(partial, 1) == {1}
    assert take_by_topology(partial, 3) == {0, 4, 1}
    config = parse_kubelet_config("cpuManagerPolicy: static\nkubeReserved: {cpu: 500m}\nsystemReserved: {cpu: \"1\"}\n")
    assert config.reserved_cpu_cores == 1.5
    write(tmp_path / "kubelet/config.yaml", "cpuManagerPolicy: static\nkubeReserved: {cpu: 500m}\n"
                                            "systemReserved: {cpu: \"1\"}\n")
    build = build_nrt(sources(host_tree(tmp_path), tmp_path, []).read())
    policy = build.doc["metadata"]["annotations"]["kubelet.koordinator.sh/cpu-manager-policy"]
    assert policy == '{"policy":"static","reservedCPUs":"0,4"}'


def test_a_malformed_kubelet_config_is_logged_and_the_checkpoint_policy_used(tmp_path: Path) -> None:
    write(tmp_path / "kubelet/config.yaml", "cpuManagerPolicy: [static\n")
    write(tmp_path / "kubelet/cpu_manager_state", '{"policyName":"static","entries":{"u9":{"c":"3"}}}')
    with capture_logs() as logs:
        build = build_nrt(sources(host_tree(tmp_path), tmp_path, []).read())
    (error,) = [e for e in logs if e["event"] == "nrt_source_invalid"]
    assert error["path"].endswith("config.yaml") and "not YAML" in error["reason"]
    annotations = build.doc["metadata"]["annotations"]
    assert annotations["kubelet.koordinator.sh/cpu-manager-policy"] == '{"policy":"static"}'
    assert '"uid":"u9"' in annotations["node.koordinator.sh/pod-cpu-allocs"]
    assert build.doc["topologyPolicies"] == ["None"]


@pytest.mark.parametrize(("text", "field"), [
    ("reservedSystemCPUs: 0-x\n", "reservedSystemCPUs"),
    ("cpuManagerPolicyOptions: [a]\n", "cpuManagerPolicyOptions"),
    ("kubeReserved: {cpu: lots}\n", "kubeReserved.cpu"),
    ("cpuManagerPolicy: 3\n", "cpuManagerPolicy"),
    ("- a\n", "not a mapping"),
])
def test_malformed_kubelet_config_names_the_field(text: str, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        parse_kubelet_config(text)


def test_quantities_and_policies_are_formatted_as_kubernetes_does() -> None:
    assert [format_binary(v) for v in (0, 512, 1024, 1536, 2**30, 15 * 2**30, 3 * 2**40)] == [
        "0", "512", "1Ki", "1536", "1Gi", "15Gi", "3Ti"]
    assert [format_cpu(v) for v in (0, 4000, 3500, 250)] == ["0", "4", "3500m", "250m"]
    assert topology_policy("single-numa-node", "container") == "SingleNUMANodeContainerLevel"
    assert topology_policy("best-effort", "pod") == "BestEffortPodLevel"
    assert topology_policy("restricted", "pod") == "RestrictedPodLevel"
    assert topology_policy("none", "pod") == "None"
    assert topology_policy("bogus", "container") == "None"


@pytest.mark.parametrize("breakage", ["no zones", "bad quantity", "zone without type", "resource without available"])
def test_the_schema_check_rejects_broken_documents(tmp_path: Path, breakage: str) -> None:
    """The validation can fail: each of these is refused by the CRD's schema."""
    doc = build_nrt(sources(host_tree(tmp_path), tmp_path, []).read()).doc
    validate_nrt(doc)
    if breakage == "no zones":
        del doc["zones"]
    elif breakage == "bad quantity":
        doc["zones"][0]["resources"][0]["capacity"] = "four"
    elif breakage == "zone without type":
        del doc["zones"][1]["type"]
    else:
        del doc["zones"][0]["resources"][3]["available"]
    with pytest.raises(jsonschema.ValidationError):
        validate_nrt(doc)
