"""The test API server's RBAC (tests/kuberbac.py) decides as kube-apiserver's RBAC authorizer:
what the e2e of the shipped role (test_kube_rbac_e2e.py) and docs/cluster-access.md rely on."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from tests.kubeapi import KubeApiServer
from tests.kuberbac import Role, attributes

NODE_SCOPED = Role.parse([
    {"apiGroups": ["slo.koordinator.sh"], "resources": ["nodeslos"], "verbs": ["get", "list", "watch"],
     "resourceNames": ["n1"]},
    {"apiGroups": ["topology.node.k8s.io"], "resources": ["noderesourcetopologies"],
     "verbs": ["create", "patch"], "resourceNames": ["n1"]},
], user="system:serviceaccount:ns:sa")


@pytest.mark.parametrize(("method", "path_name", "selector", "allowed"), [
    ("GET", "n1", None, True),           # get by name
    ("GET", "n2", None, False),          # another node's
    ("GET", None, "n1", True),           # list with the field selector naming it
    ("GET", None, None, False),          # list of all: refused
    ("GET", None, "n2", False),
])
def test_resource_names_narrow_get_and_list_by_field_selector(
    method: str, path_name: str | None, selector: str | None, allowed: bool
) -> None:
    query = {"fieldSelector": [f"metadata.name={selector}"]} if selector else {}
    a = attributes(method, "slo.koordinator.sh", "nodeslos", None, path_name, "", query)
    assert NODE_SCOPED.allows(a) is allowed


def test_resource_names_never_allow_create_but_do_patch() -> None:
    create = attributes("POST", "topology.node.k8s.io", "noderesourcetopologies", None, None, "", {})
    patch = attributes("PATCH", "topology.node.k8s.io", "noderesourcetopologies", None, "n1", "", {})
    assert not NODE_SCOPED.allows(create)
    assert NODE_SCOPED.allows(patch)


@pytest.fixture
def api() -> Iterator[KubeApiServer]:
    server = KubeApiServer()
    server.role = Role.parse([{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]}],
                             user="system:serviceaccount:ns:sa")
    server.token = "t"
    yield server
    server.close()


def _get(url: str, token: str) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_server_answers_403_with_the_api_servers_status_and_401_without_the_token(api: KubeApiServer) -> None:
    assert _get(f"{api.url}/api/v1/nodes", "t")[0] == 200
    code, body = _get(f"{api.url}/api/v1/nodes/n1", "t")
    assert code == 403
    assert body == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Forbidden",
                    "message": 'nodes "n1" is forbidden: User "system:serviceaccount:ns:sa" cannot get resource '
                               '"nodes" in API group "" at the cluster scope',
                    "details": {"group": "", "kind": "nodes", "name": "n1"}, "code": 403}
    assert _get(f"{api.url}/api/v1/nodes", "wrong")[0] == 401
    assert [(a.verb, allowed) for a, allowed in api.decisions] == [("list", True), ("get", False)]
