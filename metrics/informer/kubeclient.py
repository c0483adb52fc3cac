"""A thin, blocking client of the Kubernetes API for what a node agent needs.

The agent reads its own Node, its NodeSLO and NodeMetric (koordinator's CRDs, named
after the node), writes the NodeMetric status, keeps its NodeResourceTopology, records
Events and evicts pods. Everything here blocks: callers on the event loop go through
``asyncio.to_thread`` and watches run in daemon threads.

Requests go straight through one ``urllib3`` pool and answers are JSON-decoded into
plain dicts: the agent reads a handful of fields, the CRDs have no models anyway.
The official ``kubernetes`` package was used before; importing it (its generated
models) cost ~17 MiB of RSS for nothing we used (docs/benchmarks.md, "Memory with a
cluster connection"); the configuration is loaded by ``metrics.informer.kubeconfig``.

There is no client-side rate limiter in urllib3 (client-go's QPS), so one is kept
here: a minimum spacing between calls, shared by all threads.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final
from urllib.parse import quote, urlencode

import structlog
import urllib3

from metrics.informer.kubeconfig import ClusterConfig, KubeconfigError, default_kubeconfig, from_kubeconfig, in_cluster
from metrics.informer.kubetypes import (
    EvictionRefused,
    Kind,
    KubeApiError,
    KubeError,
    KubeSettings,
    KubeUnavailable,
)

__all__ = ["EvictionRefused", "Kind", "KubeApiError", "KubeClient", "KubeError", "KubeSettings", "KubeUnavailable"]

log = structlog.get_logger("metrics.informer.kubeclient")

GROUP: Final = "slo.koordinator.sh"
VERSION: Final = "v1alpha1"
NODESLOS: Final = "nodeslos"
NODEMETRICS: Final = "nodemetrics"
SLO_API: Final = f"/apis/{GROUP}/{VERSION}"
NRT_API: Final = "/apis/topology.node.k8s.io/v1alpha1/noderesourcetopologies"
MERGE_PATCH: Final = "application/merge-patch+json"
JSON_TYPE: Final = "application/json"

#: ``on_event(type, object)``: type is ADDED / MODIFIED / DELETED from the stream, or
#: SYNC after a (re)list with the object or None when it does not exist.
WatchHandler = Callable[[str, "dict[str, Any] | None"], None]


class _Expired(KubeError):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class _RateLimiter:
    def __init__(self, qps: float) -> None:
        self._interval = 1.0 / qps
        self._next = 0.0
        self._lock = threading.Lock()

    def wait(self) -> None:
        with self._lock:
            now = time.monotonic()
            delay = self._next - now
            self._next = max(now, self._next) + self._interval
        if delay > 0:
            time.sleep(delay)


def _load_config(settings: KubeSettings) -> ClusterConfig:
    if settings.kubeconfig is not None:
        return from_kubeconfig(settings.kubeconfig)
    try:
        return in_cluster()
    except KubeconfigError:
        if settings.in_cluster:
            raise
    return from_kubeconfig(default_kubeconfig())


def _error_message(data: bytes, reason: str | None) -> str:
    if data:
        try:
            decoded = json.loads(data)
        except ValueError:
            return data[:200].decode("utf-8", "replace")
        if isinstance(decoded, dict) and isinstance(decoded.get("message"), str):
            return str(decoded["message"])
    return reason or ""


def _decode(what: str, resp: Any) -> dict[str, Any]:
    """The JSON object of an answer; garbage (not JSON, not an object) is a KubeApiError
    naming the request, never an exception of another type."""
    try:
        decoded = json.loads(resp.data)
    except (ValueError, RecursionError) as exc:
        raise KubeApiError(what, int(resp.status), f"response is not JSON: {exc}") from exc
    if not isinstance(decoded, dict):
        raise KubeApiError(what, int(resp.status), f"response is not a JSON object but {type(decoded).__name__}")
    return decoded


def _resource_version(obj: Mapping[str, Any]) -> str | None:
    meta = obj.get("metadata")
    rv = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
    return rv if isinstance(rv, str) and rv else None


def _lines(resp: Any) -> Iterator[bytes]:
    """Lines of a chunked watch stream, as they arrive (a chunk may hold part of a line)."""
    buffer = b""
    for chunk in resp.stream(None, decode_content=True):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        yield from (line for line in lines if line.strip())
    if buffer.strip():
        yield buffer


def _name(value: str) -> str:
    return quote(value, safe="")


class KubeClient:
    """Blocking calls for one node. Build it with ``connect``."""

    def __init__(self, config: ClusterConfig, settings: KubeSettings) -> None:
        self.config = config
        self.settings = settings
        # One pool per host: the watch threads and the callers share it (maxsize: 3
        # watches held open plus calls in flight).
        self._pool = urllib3.PoolManager(num_pools=2, maxsize=8, ssl_context=config.ssl_context)
        if config.ssl_context is not None and config.ssl_context.verify_mode == ssl.CERT_NONE:
            # insecure-skip-tls-verify, asked for: said once as a JSON log line, not as
            # urllib3's InsecureRequestWarning on stderr (a non-JSON line, and an exception
            # under warnings-as-errors) for every request.
            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
            log.warning("kube_tls_unverified", host=config.host, reason="insecure-skip-tls-verify")
        self._limiter = _RateLimiter(settings.qps)
        self._streams: set[Any] = set()
        self._streams_lock = threading.Lock()
        self._nodemetric_missing = False
        self._watch_errors: dict[Kind, str] = {}

    @classmethod
    def connect(cls, settings: KubeSettings) -> KubeClient:
        """Load the configuration (no request is made). Raises KubeUnavailable."""
        try:
            config = _load_config(settings)
        except (KubeconfigError, OSError, ValueError) as exc:
            raise KubeUnavailable(f"no Kubernetes configuration: {exc}") from exc
        log.info("kube_configured", host=config.host, node=settings.node_name)
        return cls(config, settings)

    @property
    def node_name(self) -> str:
        return self.settings.node_name

    def close(self) -> None:
        self.interrupt_watches()
        self._pool.clear()

    # --- requests -------------------------------------------------------------------
    def _call(
        self, what: str, method: str, path: str, *, query: Mapping[str, object] | None = None,
        body: object = None, content_type: str = JSON_TYPE, timeout: Any = None, stream: bool = False,
    ) -> Any:
        """One request; an error status raises KubeApiError, no answer KubeUnavailable.
        With ``stream`` the response is returned unread (the caller releases it)."""
        self._limiter.wait()
        headers = {"Accept": JSON_TYPE, "User-Agent": "koord-runtime-proxy"}
        try:
            auth = self.config.authorization()
        except KubeconfigError as exc:
            raise KubeUnavailable(f"{what}: {exc}") from exc
        if auth is not None:
            headers["Authorization"] = auth
        data = None
        if body is not None:
            try:
                data = json.dumps(body, allow_nan=False).encode()
            except (ValueError, TypeError) as exc:  # NaN/inf or a non-JSON value: refused before sending
                raise KubeApiError(what, 0, f"request body is not JSON: {exc}") from exc
            headers["Content-Type"] = content_type
        url = self.config.host + path
        if query:
            url += "?" + urlencode({k: str(v).lower() if isinstance(v, bool) else v for k, v in query.items()})
        t = timeout or self.settings.timeout
        connect, read = t if isinstance(t, tuple) else (t, t)
        try:
            resp = self._pool.request(method, url, body=data, headers=headers, preload_content=not stream,
                                      retries=False, redirect=False,
                                      timeout=urllib3.Timeout(connect=connect, read=read))
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeUnavailable(f"{what}: {exc}") from exc
        if resp.status == 401:
            self.config.invalidate()  # a revoked exec token: fetch a new one for the next call
        if resp.status >= 400:
            try:
                payload = resp.data if stream is False else resp.read()
            except (urllib3.exceptions.HTTPError, OSError):
                payload = b""
            finally:
                if stream:
                    resp.release_conn()
            raise KubeApiError(what, int(resp.status), _error_message(payload, resp.reason))
        return resp

    def _get(self, what: str, path: str) -> dict[str, Any] | None:
        try:
            resp = self._call(what, "GET", path)
        except KubeApiError as exc:
            if exc.status == 404:
                return None
            raise
        return _decode(what, resp)

    def get_node(self) -> dict[str, Any]:
        node = self._get("get node", f"/api/v1/nodes/{_name(self.node_name)}")
        if node is None:
            raise KubeApiError("get node", 404, f"node {self.node_name!r} not found")
        return node

    def get_nodeslo(self) -> dict[str, Any] | None:
        return self._get("get nodeslo", f"{SLO_API}/{NODESLOS}/{_name(self.node_name)}")

    def get_nodemetric(self) -> dict[str, Any] | None:
        return self._get("get nodemetric", f"{SLO_API}/{NODEMETRICS}/{_name(self.node_name)}")

    def update_nodemetric_status(self, status: Mapping[str, Any]) -> bool:
        """Merge-patch the NodeMetric's status subresource. False when the CR does not
        exist: slo-controller creates it, the agent never does (logged once per absence)."""
        try:
            self._call("patch nodemetric status", "PATCH", f"{SLO_API}/{NODEMETRICS}/{_name(self.node_name)}/status",
                       body={"status": dict(status)}, content_type=MERGE_PATCH)
        except KubeApiError as exc:
            if exc.status != 404:
                raise
            if not self._nodemetric_missing:
                self._nodemetric_missing = True
                log.warning("nodemetric_missing", node=self.node_name, hint="created by slo-controller; not reported")
            return False
        if self._nodemetric_missing:
            self._nodemetric_missing = False
            log.info("nodemetric_found", node=self.node_name)
        return True

    # --- NodeResourceTopology (topology.node.k8s.io/v1alpha1, cluster-scoped) ----------
    def get_nrt(self) -> dict[str, Any] | None:
        """The NodeResourceTopology named after the node, None if it does not exist."""
        return self._get("get noderesourcetopology", f"{NRT_API}/{_name(self.node_name)}")

    def create_nrt(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        what = "create noderesourcetopology"
        return _decode(what, self._call(what, "POST", NRT_API, body=dict(doc)))

    def patch_nrt(self, patch: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch of the whole object (metadata.annotations and zones)."""
        what = "patch noderesourcetopology"
        resp = self._call(what, "PATCH", f"{NRT_API}/{_name(self.node_name)}", body=dict(patch),
                          content_type=MERGE_PATCH)
        return _decode(what, resp)

    # --- Events -----------------------------------------------------------------------
    def create_event(self, event: Mapping[str, Any]) -> None:
        """Create a core/v1 Event in the event's ``metadata.namespace`` ("default" if unset)."""
        meta = event.get("metadata")
        namespace = meta.get("namespace") if isinstance(meta, Mapping) else None
        if not isinstance(namespace, str) or not namespace:
            namespace = "default"
        self._call("create event", "POST", f"/api/v1/namespaces/{_name(namespace)}/events", body=dict(event))

    def evict(self, namespace: str, name: str, uid: str, reason: str) -> None:
        """policy/v1 Eviction with a UID precondition (a new pod of the same name is never
        evicted). A pod already gone (404, or 409 for a different UID) counts as done.
        Raises EvictionRefused on 429 (a disruption budget forbids it now)."""
        body = {"apiVersion": "policy/v1", "kind": "Eviction",
                "metadata": {"name": name, "namespace": namespace},
                "deleteOptions": {"preconditions": {"uid": uid}}}
        pod = f"{namespace}/{name}"
        try:
            self._call("evict pod", "POST", f"/api/v1/namespaces/{_name(namespace)}/pods/{_name(name)}/eviction",
                       body=body)
        except KubeApiError as exc:
            if exc.status == 429:
                log.warning("eviction_refused", pod=pod, uid=uid, reason=reason, message=exc.message)
                raise EvictionRefused(f"eviction of {pod} refused: {exc.message}") from exc
            if exc.status in (404, 409):
                log.info("eviction_pod_gone", pod=pod, uid=uid, reason=reason, status=exc.status)
                return
            raise
        log.info("pod_evicted", pod=pod, uid=uid, reason=reason)

    # --- watch ----------------------------------------------------------------------
    def _list_path(self, kind: Kind) -> str:
        if kind is Kind.NODE:
            return "/api/v1/nodes"
        return f"{SLO_API}/{NODESLOS if kind is Kind.NODESLO else NODEMETRICS}"

    def _relist(self, kind: Kind, on_event: WatchHandler) -> str | None:
        what = f"list {kind.value}"
        listed = _decode(what, self._call(what, "GET", self._list_path(kind),
                                          query={"fieldSelector": f"metadata.name={self.node_name}"}))
        items = listed.get("items")
        if items is None:
            items = []
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise KubeApiError(what, 200, f"items is not a list of objects: {str(items)[:200]}")
        on_event("SYNC", items[0] if items else None)
        return _resource_version(listed)

    def _stream(self, kind: Kind, rv: str | None, on_event: WatchHandler, stop: threading.Event) -> str | None:
        what = f"watch {kind.value}"
        seconds = self.settings.watch_seconds
        query: dict[str, object] = {"watch": True, "allowWatchBookmarks": True, "timeoutSeconds": seconds,
                                    "fieldSelector": f"metadata.name={self.node_name}"}
        if rv:
            query["resourceVersion"] = rv
        resp = self._call(what, "GET", self._list_path(kind), query=query, stream=True,
                          timeout=(self.settings.timeout, seconds + self.settings.timeout))
        with self._streams_lock:
            self._streams.add(resp)
        try:
            # Stopped while the request was being made: interrupt_watches may have run
            # before this stream was registered, and nothing would wake the read.
            if stop.is_set():
                return rv
            for line in _lines(resp):
                if stop.is_set():
                    break
                rv = self._handle_line(kind, line, rv, on_event)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            if not stop.is_set():
                raise KubeUnavailable(f"{what}: stream broken: {exc}") from exc
        finally:
            with self._streams_lock:
                self._streams.discard(resp)
            resp.close()
            resp.release_conn()
        return rv

    def _handle_line(self, kind: Kind, line: bytes, rv: str | None, on_event: WatchHandler) -> str | None:
        try:
            event = json.loads(line)
            etype, obj = event["type"], event["object"]
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):
            log.warning("watch_event_garbled", kind=kind.value, line=line[:200].decode("utf-8", "replace"))
            return rv
        if not isinstance(obj, dict):
            return rv
        if etype == "ERROR":
            code = obj.get("code")
            code = code if isinstance(code, int) else 0
            if code == 410:
                raise _Expired()
            raise KubeApiError(f"watch {kind.value}", code, str(obj.get("message", "")))
        rv = _resource_version(obj) or rv
        if etype in ("ADDED", "MODIFIED", "DELETED"):
            on_event(etype, obj)
        return rv

    def watch(self, kind: Kind, on_event: WatchHandler, stop: threading.Event) -> None:
        """List then watch the node's object of ``kind`` until ``stop`` is set; runs in a
        thread. Reconnects with exponential back-off; 410 Gone -> list again."""
        backoff = self.settings.backoff_initial
        rv: str | None = None
        while not stop.is_set():
            try:
                if rv is None:
                    rv = self._relist(kind, on_event)
                rv = self._stream(kind, rv, on_event, stop)
                backoff = self.settings.backoff_initial
                self._watch_errors.pop(kind, None)
            except _Expired:
                log.info("watch_expired_relist", kind=kind.value)
                rv = None
            except KubeError as exc:
                if self._watch_errors.get(kind) != str(exc):
                    self._watch_errors[kind] = str(exc)
                    log.warning("watch_failed", kind=kind.value, error=str(exc), retry_in=backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, self.settings.backoff_max)
        log.debug("watch_stopped", kind=kind.value)

    def interrupt_watches(self) -> None:
        """Unblock watch threads waiting on a stream (their ``stop`` must be set first)."""
        with self._streams_lock:
            streams = list(self._streams)
        for resp in streams:
            try:
                resp.shutdown()
            # The watch thread may close or release the stream between the copy above and
            # this call (urllib3 then raises ValueError / RuntimeError): nothing left to wake.
            except (OSError, AttributeError, ValueError, RuntimeError):
                continue
