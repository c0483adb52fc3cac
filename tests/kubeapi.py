"""A local stand-in for kube-apiserver, shared by the tests (product code never imports it).

It serves what the node agent talks to: Nodes, Pods (eviction), NodeSLO, NodeMetric
(with its ``status`` subresource), NodeResourceTopology and Events, with list (and
``fieldSelector=metadata.name=``), get, create, JSON merge patch, delete and watch
(list-then-watch from a resourceVersion, bookmarks not sent). Every created or patched
custom object is VALIDATED against the real CRD's ``openAPIV3Schema`` from
``../shared/reference/crds`` (next to the repository) with ``jsonschema``; an invalid one
is answered 422 with the schema errors, as the API server does with
``fieldValidation=Strict`` (unknown fields are errors, not silently pruned: a typo in a
field name must fail a test).

RBAC, when a test sets ``role`` (``tests/kuberbac.Role``, e.g. parsed from the shipped
``deploy/`` ClusterRole): every request is authorized as kube-apiserver's RBAC
authorizer would for a user bound to that role alone, anything else answered 403
Forbidden with the API server's Status body; every decision is kept (``decisions``).
``token``: requests without that bearer token are answered 401.

Not a cluster: no admission, no server-side apply, no resourceVersion
conflicts, no garbage collection. Every request is recorded (``requests``/``seen``).

Two ways for a test to steer it, which can be mixed:

* the object store: ``put``/``get``/``delete``/``objects`` (changes reach open watches);
* scripted answers, checked first: ``routes[(method, path)] = (status, body)`` or a
  callable of the request (not for watches), and ``watch_scripts[path]``: per watch request, a list of
  events to stream, ending in ``HOLD`` to keep the stream open until ``release`` is set.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import ssl
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import jsonschema
import yaml

from tests.kuberbac import Attributes, Role, attributes, forbidden
from tests.reference import reference

REPO = Path(__file__).resolve().parents[1]
HOLD = "hold"  # a watch script ending in HOLD keeps the stream open until ``release`` is set

SLO = "slo.koordinator.sh/v1alpha1"
NRT = "topology.node.k8s.io/v1alpha1"


@dataclass(frozen=True)
class Resource:
    plural: str
    api_version: str
    kind: str
    namespaced: bool
    crd_file: str | None = None
    status_subresource: bool = False

    @property
    def prefix(self) -> str:
        return "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"


RESOURCES = {r.plural: r for r in (
    Resource("nodes", "v1", "Node", False, status_subresource=True),
    Resource("pods", "v1", "Pod", True, status_subresource=True),
    Resource("events", "v1", "Event", True),
    Resource("nodeslos", SLO, "NodeSLO", False, "slo.koordinator.sh_nodeslos.yaml", True),
    Resource("nodemetrics", SLO, "NodeMetric", False, "slo.koordinator.sh_nodemetrics.yaml", True),
    Resource("noderesourcetopologies", NRT, "NodeResourceTopology", False,
             "topology.node.k8s.io_noderesourcetopologies.yaml"),
)}

_PATH = re.compile(
    r"^(?:/api/v1|/apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[a-z]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>status|eviction))?$"
)


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


Answer = tuple[int, object]


def status(code: int, message: str, reason: str = "") -> Answer:
    return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                  "reason": reason, "message": message}


def _strict(schema: Any) -> Any:
    """The CRD's structural schema as JSON Schema: OpenAPI ``nullable`` as a null type, and
    objects with declared properties closed (``additionalProperties: false``) unless they
    preserve unknown fields."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items() if k != "nullable"}
    if schema.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if ("properties" in out and "additionalProperties" not in out
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@cache
def crd_validator(crd_file: str, version: str) -> jsonschema.protocols.Validator:
    """A validator of ``version`` of the CRD in ``shared/reference/crds/<crd_file>``."""
    path = reference("crds", crd_file)
    doc = yaml.safe_load(path.read_text())
    for v in doc["spec"]["versions"]:
        if v["name"] == version:
            schema = _strict(v["schema"]["openAPIV3Schema"])
            cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
            validator: jsonschema.protocols.Validator = cls(schema)
            return validator
    raise KeyError(f"{crd_file} has no version {version}")


def schema_errors(plural: str, obj: Mapping[str, Any]) -> list[str]:
    """What is wrong with ``obj`` by its CRD (empty: valid; non-CRD kinds are not checked)."""
    res = RESOURCES[plural]
    if res.crd_file is None:
        return []
    validator = crd_validator(res.crd_file, res.api_version.split("/")[1])
    return sorted(f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
                  for e in validator.iter_errors(obj))


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up mid-request (a stopped agent) is not an error of the server."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class KubeApiServer:
    """See the module docstring. ``url`` is where it listens (loopback, a free port)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        """``tls``: serve HTTPS with this server-side context (e.g. requiring client certificates)."""
        reference("crds")  # here, in the test's thread: skipped (failed under CI) before any request
        self.routes: dict[tuple[str, str], Answer | Callable[[Request], Answer]] = {}
        self.watch_scripts: dict[str, list[list[object]]] = {}
        self.requests: list[Request] = []
        self.release = threading.Event()
        #: When set to an Event, a watch's response waits for it (a request in flight).
        self.before_watch: threading.Event | None = None
        #: Pods (``namespace/name``) whose eviction a disruption budget refuses (429).
        self.pdb_blocked: set[str] = set()
        #: Resources (plurals) whose CRD is not installed: every request answers 404.
        self.missing: set[str] = set()
        #: RBAC (see the module docstring): None allows everything.
        self.role: Role | None = None
        #: The bearer token every request must carry (None: any or none).
        self.token: str | None = None
        self.decisions: list[tuple[Attributes, bool]] = []
        self._store: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._log: list[tuple[int, str, str, dict[str, Any]]] = []  # (rv, type, plural, object)
        self._rv = itertools.count(1)
        self._last_rv = 0
        self._changed = threading.Condition()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                url = urlsplit(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                req = Request(self.command, url.path, parse_qs(url.query), headers, body)
                server.requests.append(req)
                denied = server._authenticate_and_authorize(req)
                if denied is None and req.query.get("watch", [""])[0].lower() == "true":
                    server._watch(self, req)
                    return
                route = server.routes.get((req.method, req.path))
                if denied is not None:
                    code, doc = denied
                elif route is None:
                    code, doc = server._serve(req)
                else:
                    code, doc = route(req) if callable(route) else route
                data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = do_POST = do_PUT = do_DELETE = _handle

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True,
                                        name="kubeapi")
        self._thread.start()

    # --- the store, for tests -------------------------------------------------------
    def put(self, plural: str, obj: Mapping[str, Any], *, validate: bool = True) -> dict[str, Any]:
        """Create or replace an object (as a controller would); ADDED/MODIFIED reach watches."""
        doc = copy.deepcopy(dict(obj))
        res = RESOURCES[plural]
        doc.setdefault("apiVersion", res.api_version)
        doc.setdefault("kind", res.kind)
        if validate and (errors := schema_errors(plural, doc)):
            raise ValueError(f"{res.kind} is invalid: {errors}")
        meta = doc.setdefault("metadata", {})
        key = (plural, meta.get("namespace", "") if res.namespaced else "", meta["name"])
        with self._changed:
            existed = key in self._store
            self._commit(key, doc, "MODIFIED" if existed else "ADDED")
        return copy.deepcopy(doc)

    def get(self, plural: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        with self._changed:
            obj = self._store.get((plural, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def objects(self, plural: str) -> list[dict[str, Any]]:
        with self._changed:
            return [copy.deepcopy(o) for (p, _ns, _n), o in sorted(self._store.items()) if p == plural]

    def delete(self, plural: str, name: str, namespace: str = "") -> bool:
        with self._changed:
            obj = self._store.pop((plural, namespace, name), None)
            if obj is not None:
                self._event("DELETED", plural, obj)
            return obj is not None

    def seen(self, method: str, path: str) -> list[Request]:
        return [r for r in self.requests if r.method == method and r.path == path]

    def close(self) -> None:
        self.release.set()
        with self._changed:
            self._changed.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    def granted_and_used(self) -> tuple[set[tuple[str, str, str]], set[tuple[str, str, str]]]:
        """(what ``role`` grants, what was asked for and allowed) as (group, resource, verb)."""
        granted = self.role.grants() if self.role is not None else set()
        return granted, {a.grant for a, allowed in self.decisions if allowed}

    def denied(self) -> list[Attributes]:
        return [a for a, allowed in self.decisions if not allowed]

    # --- internals ------------------------------------------------------------------
    def _authenticate_and_authorize(self, req: Request) -> Answer | None:
        """None when the request may go on, else the 401/403 answer."""
        if self.token is not None and req.headers.get("authorization") != f"Bearer {self.token}":
            return status(401, "Unauthorized", "Unauthorized")
        m = _PATH.match(req.path)
        if self.role is None or m is None or m["plural"] not in RESOURCES:
            return None  # unknown paths: 404 from _serve, as discovery would say
        attrs = attributes(req.method, m["group"] or "", m["plural"], m["sub"],
                           unquote(m["name"]) if m["name"] else None, unquote(m["ns"] or ""), req.query)
        allowed = self.role.allows(attrs)
        self.decisions.append((attrs, allowed))
        return None if allowed else (403, forbidden(attrs, self.role.user))

    def _commit(self, key: tuple[str, str, str], doc: dict[str, Any], etype: str) -> None:
        """Under ``_changed``: store with a new resourceVersion and log the event."""
        meta = doc.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        self._last_rv = next(self._rv)
        meta["resourceVersion"] = str(self._last_rv)
        self._store[key] = doc
        self._event(etype, key[0], doc)

    def _event(self, etype: str, plural: str, obj: dict[str, Any]) -> None:
        if etype == "DELETED":
            self._last_rv = next(self._rv)
        self._log.append((self._last_rv, etype, plural, copy.deepcopy(obj)))
        self._changed.notify_all()

    def _serve(self, req: Request) -> Answer:
        m = _PATH.match(req.path)
        res = RESOURCES.get(m["plural"]) if m else None
        if m is None or res is None or not req.path.startswith(res.prefix + "/") or res.plural in self.missing:
            return status(404, f"the server could not find the requested resource ({req.path})", "NotFound")
        ns = unquote(m["ns"] or "")
        name = unquote(m["name"]) if m["name"] else None
        if res.namespaced == (not ns) and not (res.namespaced and req.method == "GET" and name is None):
            return status(404, f"{res.plural} is {'' if res.namespaced else 'not '}namespaced", "NotFound")
        sub = m["sub"]
        with self._changed:
            if name is None:
                if req.method == "GET":
                    return 200, self._list(res, ns, req)
                if req.method == "POST":
                    return self._create(res, ns, req)
                return status(405, f"{req.method} on a collection", "MethodNotAllowed")
            key = (res.plural, ns, name)
            if sub == "eviction":
                return self._evict(ns, name, req)
            current = self._store.get(key)
            if current is None:
                return status(404, f'{res.plural} "{name}" not found', "NotFound")
            if req.method == "GET":
                return 200, copy.deepcopy(current)
            if req.method == "PATCH":
                return self._patch(res, key, current, sub, req)
            if req.method == "DELETE":
                del self._store[key]
                self._event("DELETED", res.plural, current)
                return 200, current
            return status(405, f"{req.method} on {res.plural}", "MethodNotAllowed")

    def _list(self, res: Resource, ns: str, req: Request) -> dict[str, Any]:
        wanted = _field_name(req)
        items = [copy.deepcopy(o) for (p, n, name), o in sorted(self._store.items())
                 if p == res.plural and (not ns or n == ns) and (wanted is None or name == wanted)]
        return {"apiVersion": res.api_version, "kind": f"{res.kind}List",
                "metadata": {"resourceVersion": str(self._last_rv)}, "items": items}

    def _body(self, req: Request) -> Any:
        try:
            return json.loads(req.body)
        except ValueError:
            return None

    def _create(self, res: Resource, ns: str, req: Request) -> Answer:
        doc = self._body(req)
        if not isinstance(doc, dict):
            return status(400, "the body is not a JSON object", "BadRequest")
        meta = doc.setdefault("metadata", {})
        if not isinstance(meta, dict):
            return status(400, "metadata is not an object", "BadRequest")
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
        if not isinstance(meta.get("name"), str) or not meta["name"]:
            return status(422, "metadata.name: Required value", "Invalid")
        if res.namespaced:
            if meta.setdefault("namespace", ns) != ns:
                return status(400, "the namespace of the object does not match the namespace of the request",
                              "BadRequest")
        if (doc.get("apiVersion"), doc.get("kind")) != (res.api_version, res.kind):
            return status(400, f"apiVersion/kind {doc.get('apiVersion')}/{doc.get('kind')} is not "
                               f"{res.api_version}/{res.kind}", "BadRequest")
        if res.plural == "events" and (problem := _event_problem(doc)):
            return status(422, problem, "Invalid")
        if errors := schema_errors(res.plural, doc):
            return status(422, f"{res.kind} {meta['name']!r} is invalid: {'; '.join(errors)}", "Invalid")
        key = (res.plural, ns, meta["name"])
        if key in self._store:
            return status(409, f'{res.plural} "{meta["name"]}" already exists', "AlreadyExists")
        if res.status_subresource:
            doc.pop("status", None)
        self._commit(key, doc, "ADDED")
        return 201, copy.deepcopy(doc)

    def _patch(self, res: Resource, key: tuple[str, str, str], current: dict[str, Any], sub: str | None,
               req: Request) -> Answer:
        if req.headers.get("content-type", "").split(";")[0] != "application/merge-patch+json":
            return status(415, f"unsupported patch type {req.headers.get('content-type')!r}", "UnsupportedMediaType")
        patch = self._body(req)
        if not isinstance(patch, dict):
            return status(400, "the patch is not a JSON object", "BadRequest")
        merged = merge_patch(current, patch)
        if res.status_subresource:
            # /status changes only status; the main resource everything but status.
            if sub == "status":
                merged = {**current, "status": merged.get("status")} if "status" in merged else dict(current)
            else:
                merged["status"] = current.get("status")
                if merged["status"] is None:
                    del merged["status"]
        elif sub == "status":
            return status(404, f"{res.plural} has no status subresource", "NotFound")
        merged.setdefault("metadata", {})["name"] = key[2]
        if errors := schema_errors(res.plural, merged):
            return status(422, f"{res.kind} {key[2]!r} is invalid: {'; '.join(errors)}", "Invalid")
        self._commit(key, merged, "MODIFIED")
        return 200, copy.deepcopy(merged)

    def _evict(self, ns: str, name: str, req: Request) -> Answer:
        if req.method != "POST":
            return status(405, "eviction is POST only", "MethodNotAllowed")
        pod = self._store.get(("pods", ns, name))
        if pod is None:
            return status(404, f'pods "{name}" not found', "NotFound")
        body = self._body(req) or {}
        uid = (((body.get("deleteOptions") or {}).get("preconditions") or {}).get("uid")
               if isinstance(body, dict) else None)
        if uid is not None and uid != pod["metadata"].get("uid"):
            return status(409, f"Precondition failed: UID in precondition: {uid}, UID in object meta: "
                               f"{pod['metadata'].get('uid')}", "Conflict")
        if f"{ns}/{name}" in self.pdb_blocked:
            return status(429, "Cannot evict pod as it would violate the pod's disruption budget.",
                          "TooManyRequests")
        del self._store[("pods", ns, name)]
        self._event("DELETED", "pods", pod)
        return 201, {"kind": "Status", "apiVersion": "v1", "status": "Success"}

    # --- watch ----------------------------------------------------------------------
    def _watch(self, handler: BaseHTTPRequestHandler, req: Request) -> None:
        scripts = self.watch_scripts.get(req.path)
        script = scripts.pop(0) if scripts else None
        if self.before_watch is not None:
            self.before_watch.wait(10)
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()

        def send(event: object) -> None:
            line = json.dumps(event).encode() + b"\n"
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            handler.wfile.flush()

        try:
            if script is not None:
                for event in script:
                    if event == HOLD:
                        self.release.wait(10)
                        break
                    send(event)
            else:
                self._stream_store(req, send)
            handler.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass  # the client hung up

    def _stream_store(self, req: Request, send: Callable[[object], None]) -> None:
        """Events of the store after the request's resourceVersion, until timeoutSeconds,
        ``release`` or ``close``."""
        m = _PATH.match(req.path)
        if m is None or m["plural"] not in RESOURCES or m["plural"] in self.missing:
            send({"type": "ERROR", "object": status(404, f"no resource at {req.path}", "NotFound")[1]})
            return
        plural, ns, wanted = m["plural"], unquote(m["ns"] or ""), _field_name(req)
        try:
            since = int(req.query.get("resourceVersion", ["0"])[0] or 0)
        except ValueError:
            since = 0
        seconds = float(req.query.get("timeoutSeconds", ["1800"])[0])
        deadline = time.monotonic() + min(seconds, 60)
        if self._log and since and since < self._log[0][0] - 1:
            send({"type": "ERROR", "object": status(410, "too old resource version", "Expired")[1]})
            return
        sent = since
        while not self.release.is_set() and time.monotonic() < deadline:
            with self._changed:
                pending = [e for e in self._log if e[0] > sent]
                if not pending:
                    self._changed.wait(0.1)
                    continue
            for rv, etype, p, obj in pending:
                sent = rv
                meta = obj.get("metadata", {})
                if p == plural and (not ns or meta.get("namespace") == ns) and wanted in (None, meta.get("name")):
                    send({"type": etype, "object": obj})

    def expire_history(self) -> None:
        """Forget the event log: a watch from an older resourceVersion gets 410 Gone."""
        with self._changed:
            self._log = [(self._last_rv, "BOOKMARK", "", {})]


def _field_name(req: Request) -> str | None:
    for selector in req.query.get("fieldSelector", []):
        if selector.startswith("metadata.name="):
            return selector.split("=", 1)[1]
    return None


def _event_problem(doc: Mapping[str, Any]) -> str:
    """The API server's required fields of a core/v1 Event."""
    involved = doc.get("involvedObject")
    if not isinstance(involved, Mapping) or not involved.get("kind") or not involved.get("name"):
        return "involvedObject.kind and involvedObject.name: Required value"
    for key in ("reason", "message", "type"):
        if not isinstance(doc.get(key), str) or not doc.get(key):
            return f"{key}: Required value"
    if doc["type"] not in ("Normal", "Warning"):
        return f"type: Unsupported value: {doc['type']!r}"
    source = doc.get("source")
    if not isinstance(source, Mapping) and not doc.get("reportingComponent"):
        return "source or reportingComponent: Required value"
    return ""
