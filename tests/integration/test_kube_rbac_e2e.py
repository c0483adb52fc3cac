"""Issue 30 item 3: the shipped least-privilege role (``deploy/rbac.yaml``) is exactly what
the agent needs.

The real proxy process (metrics task with ``kube: true``, the QoS manager with
``evict_mode: api``) in front of the fixture containerd talks to the test API server
(``tests/kubeapi.py``), which enforces the ClusterRole parsed from ``deploy/rbac.yaml``
(bound to the ServiceAccount that file ships) and requires the bearer token; the
kubeconfig is written by ``deploy/kubeconfig.sh`` from that token.

- With the shipped role every feature works (NodeResourceTopology created, then patched
  with the Node's owner reference; NodeMetric status; a refused NodeSLO's Event; a valid
  NodeSLO applied; a BE pod evicted through the Eviction API), nothing is denied, and
  every (group, resource, verb) the role grants was used: no grant is spare.
- Without any one rule, its feature fails with a logged 403 naming the verb and
  resource, only that rule's requests are denied, and the agent keeps serving CRI.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo.scenario import kubelet_creates_pod_cgroup
from tests.kubeapi import KubeApiServer
from tests.kuberbac import Role

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
NODE = "krp-rbac-node"
TOKEN = "rbac-e2e-token"
SPEC = "node.koordinator.sh/extended-resource-spec"
#: A NodeSLO value the agent refuses (the CRD allows each value): a NodeSLORejected Event.
REFUSED = {"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": 50,
                                           "cpuSuppressMinPercent": 60}}
TIMEOUT = 30.0


def shipped_role() -> Role:
    """The ClusterRole of deploy/rbac.yaml, for the subject its ClusterRoleBinding names."""
    docs = [d for d in yaml.safe_load_all((DEPLOY / "rbac.yaml").read_text()) if d]
    roles = [d for d in docs if d["kind"] == "ClusterRole"]
    bindings = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    accounts = [d for d in docs if d["kind"] == "ServiceAccount"]
    assert len(roles) == len(bindings) == len(accounts) == 1, [d["kind"] for d in docs]
    role, binding, account = roles[0], bindings[0], accounts[0]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    subject = {"kind": "ServiceAccount", "name": account["metadata"]["name"],
               "namespace": account["metadata"]["namespace"]}
    assert binding["subjects"] == [subject]
    user = f"system:serviceaccount:{subject['namespace']}:{subject['name']}"
    return Role.parse(role["rules"], user)


def _rule_id(role: Role, index: int) -> str:
    rule = role.rules[index]
    return f"{'+'.join(sorted(rule.resources))}:{'+'.join(sorted(rule.verbs))}"


ROLE = shipped_role()


@pytest.fixture
def api() -> Iterator[KubeApiServer]:
    server = KubeApiServer()
    server.token = TOKEN
    server.put("nodeslos", {"metadata": {"name": NODE}, "spec": REFUSED})
    # slo-controller creates the NodeMetric with its spec; the agent only patches status.
    server.put("nodemetrics", {"metadata": {"name": NODE}, "spec": {"metricCollectPolicy": {
        "aggregateDurationSeconds": 60, "reportIntervalSeconds": 1}}})
    yield server
    server.close()


def _kubeconfig(workdir: Path, api: KubeApiServer) -> Path:
    """What an operator runs (deploy/kubeconfig.sh), with the token the server expects."""
    token = workdir / "token"
    token.write_text(TOKEN + "\n")
    out = workdir / "kubeconfig"
    subprocess.run(["bash", str(DEPLOY / "kubeconfig.sh"), "--server", api.url, "--token-from", f"file:{token}",
                    "--out", str(out)], check=True, timeout=30)
    assert out.stat().st_mode & 0o077 == 0, "the kubeconfig holds a token: 0600"
    return out


def _start(proxy_factory: Any, api: KubeApiServer, role: Role, cgroup_prefix: str) -> Any:
    api.role = role
    workdir = proxy_factory.mkdtemp()
    extra = {
        # Memory eviction of every BE pod (the threshold is below what the node uses).
        "rules": {"resourceUsedThresholdWithBE": {
            "enable": True, "cpuSuppressPolicy": "cfsQuota",
            "memoryEvictThresholdPercent": 1, "memoryEvictLowerPercent": 0}},
        "tasks": {
            "metrics": {
                "db": str(workdir / "m.db"), "schedlat_source": "off", "cpi": False, "memlat_source": "off",
                "kube": True, "kubeconfig": str(_kubeconfig(workdir, api)), "node_name": NODE,
                "nrt_interval": "500ms",
                "kubelet_cpu_manager_state": str(workdir / "cpu_manager_state"),
                "kubelet_config": str(workdir / "kubelet-config.yaml"),
            },
            "qos-manager": {"evict_mode": "api",
                            "besteffort_dir": f"{cgroup_prefix.strip('/')}/kubepods/besteffort"},
        },
    }
    return proxy_factory.start(extra=extra)


def _wait_for(what: str, check: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _put_node(api: KubeApiServer) -> None:
    api.put("nodes", {"metadata": {"name": NODE}, "status": {
        "capacity": {"cpu": "2", "memory": "4Gi"}, "allocatable": {"cpu": "2", "memory": "4Gi"}}})


def _be_pod(api: KubeApiServer, proxy: Any, pods: Any) -> str:
    """A real BE pod, known to the API server under the same namespace/name/uid."""
    uid = str(uuid.uuid4())
    name = f"be-{uid[:8]}"
    api.put("pods", {"metadata": {"name": name, "namespace": "krp-test", "uid": uid}})
    batch = {"containers": {"be": {"requests": {"kubernetes.io/batch-cpu": "500",
                                                "kubernetes.io/batch-memory": str(64 << 20)}}}}
    pod = pods.sandbox(name, qos="besteffort", uid=uid, labels={"koordinator.sh/qosClass": "BE"},
                       annotations={SPEC: json.dumps(batch)})
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    rt = proxy.runtime()
    sid = pods.run(rt, pod)
    try:
        pods.start(rt, pods.create(rt, sid, pod, pods.container("be")))
    except Exception:  # the eviction may take first; in api mode nothing stops it, but be safe
        pass
    return f"krp-test/{name}"


def _still_serving(proxy: Any) -> None:
    assert proxy.running and proxy.healthz() == 200
    assert proxy.runtime().Version(cri.VersionRequest(), timeout=10).runtime_name == "containerd"


def test_the_shipped_role_is_enough_for_every_feature_and_every_grant_is_used(
    proxy_factory: Any, pods: Any, api: KubeApiServer, cgroup_prefix: str
) -> None:
    proxy = _start(proxy_factory, api, ROLE, cgroup_prefix)
    # NRT created before the Node is known (no owner), then patched with its owner.
    _wait_for("the NRT created", lambda: api.get("noderesourcetopologies", NODE))
    _put_node(api)
    node_uid = api.get("nodes", NODE)["metadata"]["uid"]  # type: ignore[index]
    _wait_for("the NRT patched with the Node as owner", lambda: [
        r for r in (api.get("noderesourcetopologies", NODE) or {}).get("metadata", {}).get("ownerReferences", [])
        if r["uid"] == node_uid])
    _wait_for("a NodeMetric status", lambda: (api.get("nodemetrics", NODE) or {}).get("status"))
    event = _wait_for("a NodeSLORejected event", lambda: [
        e for e in api.objects("events") if e.get("reason") == "NodeSLORejected"])[0]
    assert event["involvedObject"]["name"] == NODE
    key = _be_pod(api, proxy, pods)
    proxy.wait_event("pod_evicted", timeout=TIMEOUT, pod=key)
    namespace, name = key.split("/")
    _wait_for("the pod evicted through the API", lambda: api.get("pods", name, namespace) is None)
    changed = len(proxy.events("rules_changed"))
    api.put("nodeslos", {"metadata": {"name": NODE}, "spec": {
        "resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": 42}}})
    _wait_for("the valid NodeSLO applied", lambda: [
        e for e in proxy.events("rules_changed")[changed:] if "nodeslo" in json.dumps(e)])

    assert api.denied() == [], api.denied()
    # "HTTP 403" as the client's errors say it: a bare "403" also matches a timestamp's digits.
    assert not [e for e in proxy.events() if "HTTP 403" in json.dumps(e)], "no request was forbidden"
    granted, used = api.granted_and_used()
    assert granted - used == set(), f"granted but never used (drop them from deploy/rbac.yaml): {granted - used}"
    assert used <= granted
    _still_serving(proxy)


#: Per rule (by resource): the log line of the feature that fails without it, and the
#: field that carries the API server's error.
FAILURES = {
    "nodes": ("watch_failed", "error", {"kind": "Node"}),
    "nodeslos": ("watch_failed", "error", {"kind": "NodeSLO"}),
    "nodemetrics": ("watch_failed", "error", {"kind": "NodeMetric"}),
    "nodemetrics/status": ("nodemetric_report_failed", "reason", {}),
    "noderesourcetopologies": ("nrt_report_failed", "reason", {}),
    "events": ("event_not_recorded", "error", {}),
    "pods/eviction": ("pod_eviction_failed", "error", {}),
}


def test_every_rule_has_its_expected_failure() -> None:
    """The table below covers the shipped role, rule for rule (a new rule needs a row)."""
    resources = sorted(r for rule in ROLE.rules for r in rule.resources)
    assert resources == sorted(FAILURES), resources


@pytest.mark.parametrize("index", range(len(ROLE.rules)), ids=[_rule_id(ROLE, i) for i in range(len(ROLE.rules))])
def test_without_a_rule_its_feature_fails_with_a_logged_403_and_the_agent_keeps_running(
    proxy_factory: Any, pods: Any, api: KubeApiServer, cgroup_prefix: str, index: int
) -> None:
    dropped = ROLE.rules[index]
    (resource,) = dropped.resources
    event, field, match = FAILURES[resource]
    _put_node(api)
    proxy = _start(proxy_factory, api, ROLE.without(index), cgroup_prefix)
    if resource == "pods/eviction":
        _be_pod(api, proxy, pods)
    failed = proxy.wait_event(event, timeout=TIMEOUT, **match)
    verb = next(a.verb for a in api.denied())
    assert "HTTP 403" in failed[field] and "is forbidden" in failed[field], failed
    assert f'cannot {verb} resource "{resource}"' in failed[field], failed
    assert {a.resource for a in api.denied()} == {resource}, "only the dropped rule's requests are denied"
    assert {a.verb for a in api.denied()} <= dropped.verbs
    _still_serving(proxy)
