"""A thin, blocking wrapper over the ``kubernetes`` client for what a node agent needs.

The agent reads its own Node, its NodeSLO and NodeMetric (koordinator's CRDs, named
after the node), writes the NodeMetric status and evicts pods. Everything here
blocks: callers on the event loop go through ``asyncio.to_thread`` and watches run
in daemon threads.

Responses are read raw (``_preload_content=False``) and JSON-decoded into plain
dicts instead of the client's generated models: the agent only reads a handful of
fields, the CRDs have no models anyway, and plain dicts keep one representation for
Node and CRs alike.

The Python client has no client-side rate limiter (client-go's QPS), so one is
kept here: a minimum spacing between calls, shared by all threads.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

import structlog
import urllib3
from kubernetes import client as k8s
from kubernetes import config as _k8s_config
from kubernetes.client.exceptions import ApiException

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
# The config helpers are untyped; one Any-typed handle instead of an ignore per call.
k8s_config: Any = _k8s_config

GROUP: Final = "slo.koordinator.sh"
VERSION: Final = "v1alpha1"
NODESLOS: Final = "nodeslos"
NODEMETRICS: Final = "nodemetrics"
MERGE_PATCH: Final = "application/merge-patch+json"

#: ``on_event(type, object)``: type is ADDED / MODIFIED / DELETED from the stream, or
#: SYNC after a (re)list with the object or None when it does not exist.
WatchHandler = Callable[[str, "dict[str, Any] | None"], None]


class _Expired(Exception):
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


def _load_api_client(settings: KubeSettings) -> k8s.ApiClient:
    api: k8s.ApiClient
    if settings.kubeconfig is not None:
        api = k8s_config.new_client_from_config(config_file=str(settings.kubeconfig))
        return api
    cfg = k8s.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=cfg)
        return k8s.ApiClient(cfg)
    except k8s_config.ConfigException:
        if settings.in_cluster:
            raise
    api = k8s_config.new_client_from_config()
    return api


def _error_message(exc: ApiException) -> str:
    body = exc.body
    if body:
        try:
            decoded = json.loads(body)
        except ValueError:
            return body[:200]
        if isinstance(decoded, dict) and isinstance(decoded.get("message"), str):
            return str(decoded["message"])
    return str(exc.reason or "")


def _decode(what: str, resp: Any) -> dict[str, Any]:
    try:
        decoded = json.loads(resp.data)
    except ValueError as exc:
        raise KubeApiError(what, int(resp.status), f"response is not JSON: {exc}") from exc
    if not isinstance(decoded, dict):
        raise KubeApiError(what, int(resp.status), "response is not a JSON object")
    return decoded


def _resource_version(obj: Mapping[str, Any]) -> str | None:
    meta = obj.get("metadata")
    rv = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
    return rv if isinstance(rv, str) and rv else None


def _lines(resp: Any) -> Any:
    """Lines of a chunked watch stream, as they arrive (a chunk may hold part of a line)."""
    buffer = b""
    for chunk in resp.stream(None, decode_content=True):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        yield from (line for line in lines if line.strip())
    if buffer.strip():
        yield buffer


class KubeClient:
    """Blocking calls for one node. Build it with ``connect``."""

    def __init__(self, api: k8s.ApiClient, settings: KubeSettings) -> None:
        self._api = api
        self._core = k8s.CoreV1Api(api)
        self._custom = k8s.CustomObjectsApi(api)
        self.settings = settings
        self._limiter = _RateLimiter(settings.qps)
        self._streams: set[Any] = set()
        self._streams_lock = threading.Lock()
        self._nodemetric_missing = False
        self._watch_errors: dict[Kind, str] = {}

    @classmethod
    def connect(cls, settings: KubeSettings) -> KubeClient:
        """Load the configuration (no request is made). Raises KubeUnavailable."""
        try:
            api = _load_api_client(settings)
        except (k8s_config.ConfigException, OSError, ValueError, TypeError) as exc:
            raise KubeUnavailable(f"no Kubernetes configuration: {exc}") from exc
        log.info("kube_configured", host=api.configuration.host, node=settings.node_name)
        return cls(api, settings)

    @property
    def node_name(self) -> str:
        return self.settings.node_name

    def close(self) -> None:
        self.interrupt_watches()
        closer: Any = self._api.close
        closer()

    # --- requests -------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[..., Any], *args: Any, timeout: Any = None, **kw: Any) -> Any:
        self._limiter.wait()
        try:
            return fn(*args, _preload_content=False, _request_timeout=timeout or self.settings.timeout, **kw)
        except ApiException as exc:
            raise KubeApiError(what, int(exc.status or 0), _error_message(exc)) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeUnavailable(f"{what}: {exc}") from exc

    def _get(self, what: str, fn: Callable[..., Any], *args: Any) -> dict[str, Any] | None:
        try:
            resp = self._call(what, fn, *args)
        except KubeApiError as exc:
            if exc.status == 404:
                return None
            raise
        return _decode(what, resp)

    def get_node(self) -> dict[str, Any]:
        node = self._get("get node", self._core.read_node, self.node_name)
        if node is None:
            raise KubeApiError("get node", 404, f"node {self.node_name!r} not found")
        return node

    def get_nodeslo(self) -> dict[str, Any] | None:
        return self._get(
            "get nodeslo", self._custom.get_cluster_custom_object, GROUP, VERSION, NODESLOS, self.node_name
        )

    def get_nodemetric(self) -> dict[str, Any] | None:
        return self._get(
            "get nodemetric", self._custom.get_cluster_custom_object, GROUP, VERSION, NODEMETRICS, self.node_name
        )

    def update_nodemetric_status(self, status: Mapping[str, Any]) -> bool:
        """Merge-patch the NodeMetric's status subresource. False when the CR does not
        exist: slo-controller creates it, the agent never does (logged once per absence)."""
        try:
            self._call(
                "patch nodemetric status", self._custom.patch_cluster_custom_object_status,
                GROUP, VERSION, NODEMETRICS, self.node_name, {"status": dict(status)}, _content_type=MERGE_PATCH,
            )
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

    def evict(self, namespace: str, name: str, uid: str, reason: str) -> None:
        """policy/v1 Eviction with a UID precondition (a new pod of the same name is never
        evicted). A pod already gone (404, or 409 for a different UID) counts as done.
        Raises EvictionRefused on 429 (a disruption budget forbids it now)."""
        body = k8s.V1Eviction(
            api_version="policy/v1", kind="Eviction",
            metadata=k8s.V1ObjectMeta(name=name, namespace=namespace),
            delete_options=k8s.V1DeleteOptions(preconditions=k8s.V1Preconditions(uid=uid)),
        )
        pod = f"{namespace}/{name}"
        try:
            self._call("evict pod", self._core.create_namespaced_pod_eviction, name, namespace, body)
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
    def _list_fn(self, kind: Kind) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        if kind is Kind.NODE:
            return self._core.list_node, ()
        plural = NODESLOS if kind is Kind.NODESLO else NODEMETRICS
        return self._custom.list_cluster_custom_object, (GROUP, VERSION, plural)

    def _relist(self, kind: Kind, on_event: WatchHandler) -> str | None:
        fn, args = self._list_fn(kind)
        what = f"list {kind.value}"
        listed = _decode(what, self._call(what, fn, *args, field_selector=f"metadata.name={self.node_name}"))
        items = listed.get("items") or []
        item = items[0] if isinstance(items, list) and items and isinstance(items[0], dict) else None
        on_event("SYNC", item)
        return _resource_version(listed)

    def _stream(self, kind: Kind, rv: str | None, on_event: WatchHandler, stop: threading.Event) -> str | None:
        fn, args = self._list_fn(kind)
        what = f"watch {kind.value}"
        seconds = self.settings.watch_seconds
        kwargs: dict[str, Any] = {"watch": True, "allow_watch_bookmarks": True, "timeout_seconds": seconds,
                                  "field_selector": f"metadata.name={self.node_name}"}
        if rv:
            kwargs["resource_version"] = rv
        resp = self._call(what, fn, *args, timeout=(self.settings.timeout, seconds + self.settings.timeout), **kwargs)
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
        except (ValueError, KeyError, TypeError):
            log.warning("watch_event_garbled", kind=kind.value, line=line[:200].decode("utf-8", "replace"))
            return rv
        if not isinstance(obj, dict):
            return rv
        if etype == "ERROR":
            code = int(obj.get("code") or 0)
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
            except (OSError, AttributeError):
                continue
