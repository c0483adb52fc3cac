"""RBAC for the test API server (``tests/kubeapi.py``): a ClusterRole's rules, enforced.

What kube-apiserver's RBAC authorizer decides for one user bound to one ClusterRole:
a request is turned into its attributes (verb, API group, resource with subresource,
name, namespace) exactly as the API server does (``GET`` on a name is ``get``, on a
collection ``list``, with ``watch=true`` ``watch``; ``POST`` ``create``; ``PATCH``
``patch``; ``PUT`` ``update``; ``DELETE`` ``delete``), and allowed when one rule covers
it. ``resourceNames`` narrows a rule to named objects: ``get``/``patch``/``update``/
``delete`` by the name in the path, ``list``/``watch`` only with a ``metadata.name``
field selector naming it (as since Kubernetes 1.11), and never ``create`` (the name is
not known when it is authorized). Anything else is ``403 Forbidden`` with the API
server's Status body and message.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Attributes:
    """What RBAC sees of one request."""

    verb: str
    group: str
    resource: str  # with its subresource: "nodemetrics/status", "pods/eviction"
    name: str  # "" for a collection
    namespace: str

    @property
    def grant(self) -> tuple[str, str, str]:
        """(group, resource, verb): what a rule must grant."""
        return self.group, self.resource, self.verb


@dataclass(frozen=True)
class PolicyRule:
    api_groups: frozenset[str]
    resources: frozenset[str]
    verbs: frozenset[str]
    resource_names: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, rule: Mapping[str, Any]) -> PolicyRule:
        unknown = set(rule) - {"apiGroups", "resources", "verbs", "resourceNames"}
        if unknown:
            raise ValueError(f"rule fields not supported here: {sorted(unknown)}")
        return cls(frozenset(rule.get("apiGroups") or ()), frozenset(rule.get("resources") or ()),
                   frozenset(rule.get("verbs") or ()), frozenset(rule.get("resourceNames") or ()))

    def grants(self) -> set[tuple[str, str, str]]:
        """Every (group, resource, verb) this rule names (no wildcards in a shipped role)."""
        return {(g, r, v) for g in self.api_groups for r in self.resources for v in self.verbs}

    def allows(self, a: Attributes) -> bool:
        def has(values: frozenset[str], value: str) -> bool:
            return "*" in values or value in values

        if not (has(self.api_groups, a.group) and has(self.resources, a.resource) and has(self.verbs, a.verb)):
            return False
        if not self.resource_names:
            return True
        return a.verb != "create" and a.name in self.resource_names


@dataclass(frozen=True)
class Role:
    """The rules of one ClusterRole, and who is bound to it (for the 403 message)."""

    rules: tuple[PolicyRule, ...]
    user: str = "system:serviceaccount:default:test"

    @classmethod
    def parse(cls, rules: Iterable[Mapping[str, Any]], user: str = "system:serviceaccount:default:test") -> Role:
        return cls(tuple(PolicyRule.parse(r) for r in rules), user)

    def without(self, index: int) -> Role:
        return Role(self.rules[:index] + self.rules[index + 1:], self.user)

    def allows(self, a: Attributes) -> bool:
        return any(rule.allows(a) for rule in self.rules)

    def grants(self) -> set[tuple[str, str, str]]:
        return set().union(*(r.grants() for r in self.rules)) if self.rules else set()


def attributes(method: str, group: str, plural: str, sub: str | None, name: str | None, namespace: str,
               query: Mapping[str, Sequence[str]]) -> Attributes:
    """The request's RBAC attributes (see the module docstring)."""
    if method == "GET":
        if name is not None:
            verb = "get"
        else:
            verb = "watch" if query.get("watch", [""])[0].lower() == "true" else "list"
    else:
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method, method.lower())
    if verb in ("list", "watch"):
        for selector in query.get("fieldSelector", []):
            if selector.startswith("metadata.name="):
                name = selector.split("=", 1)[1]
    resource = f"{plural}/{sub}" if sub else plural
    return Attributes(verb, group, resource, name or "", namespace)


def forbidden(a: Attributes, user: str) -> dict[str, Any]:
    """The API server's 403 Status body, message word for word."""
    group = f'"{a.group}"'
    where = f'in the namespace "{a.namespace}"' if a.namespace else "at the cluster scope"
    qualified = f"{a.resource.split('/')[0]}.{a.group}" if a.group else a.resource.split("/")[0]
    subject = f'{qualified} "{a.name}"' if a.name else qualified
    message = (f'{subject} is forbidden: User "{user}" cannot {a.verb} resource "{a.resource}" '
               f"in API group {group} {where}")
    details: dict[str, Any] = {"group": a.group, "kind": a.resource.split("/")[0]}
    if a.name:
        details["name"] = a.name
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": "Forbidden", "details": details, "code": 403}
