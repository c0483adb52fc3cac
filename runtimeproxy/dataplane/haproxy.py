"""HAProxy as the data plane: its configuration, generated from our Settings.

With ``data_plane: haproxy`` kubelet's socket belongs to HAProxy (Debian's 2.6), not to
Python. Pass-through CRI calls (every ``runtime.v1.RuntimeService`` and
``runtime.v1.ImageService`` method except the 8 lifecycle methods) go from HAProxy
straight to containerd over HTTP/2: no Python work per call. The lifecycle methods that
have a Pre hook in the running chain (``HookChain.pre_calls``: a hook may change or refuse
the request), and the calls the store needs to see (``STORE_CALLS``), go by exact
path to our interception server on a private socket (mode 0600): the same grpc.aio server
as the ``grpc`` data plane's (``runtimeproxy.transport.grpcserver``), over HTTP/2, serving
only those methods; the lifecycle's own calls go from Python straight to containerd over
gRPC (``runtimeproxy.transport.grpcbackend``).

Routing depends on ``:path`` alone. For an HTTP/2 request with an ``:authority`` HAProxy
builds an absolute URI, ``scheme://authority/path``, and its ``path`` fetch then cuts the
authority at its first ``/``: kubelet 1.26 (grpc-go 1.49) sends its socket path
(``/run/…/runtimeproxy.sock``) as ``:authority``, so ``path`` read
``/run/…/runtimeproxy.sock/runtime.v1.RuntimeService/Version`` (no CRI method: UNIMPLEMENTED
from HAProxy) and a server behind it would have got that ``:path`` too. The first rule of
the frontend (``NORMALIZE_URI``) turns such a URI back into the origin form, the ``:path``
the client sent, by removing the scheme and exactly the authority (HAProxy keeps it as the
``host`` header); every rule after it, and the servers, see that path.

The other lifecycle methods (Stop/Remove)
are plain pass-through: what follows a stop or a removal is found by the store's
re-sync with containerd, level-triggered (``runtimeproxy.lifecycle.owed``), not told
by HAProxy. Any other
path (containerd's native API behind the same backend socket, say) is answered
UNIMPLEMENTED by HAProxy itself and never reaches containerd.

The settings that matter were measured (see docs/architecture.md, "Data plane"):
``tune.bufsize`` bounds one message's headers (a long ``grpc-message`` of containerd's
above 16 000 characters otherwise turns into UNAVAILABLE), 100 concurrent streams per
kubelet connection queue calls, and HAProxy's timeouts are inactivity timeouts that
must not cut a ``GetContainerEvents`` stream that stays quiet for hours.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from runtimeproxy.config.settings import Settings
from runtimeproxy.dataplane.haproxystats import NOT_CRI_KEY, TABLE
from runtimeproxy.transport.grpcserver import known_methods

RUNTIME_SERVICE: Final = "/runtime.v1.RuntimeService/"
#: The methods the interception server can handle (hooks run there); matched exactly.
LIFECYCLE_METHODS: Final = tuple(
    RUNTIME_SERVICE + name for name in (
        "RunPodSandbox", "StopPodSandbox", "RemovePodSandbox", "CreateContainer", "StartContainer",
        "StopContainer", "RemoveContainer", "UpdateContainerResources",
    )
)


#: Always through Python, hooks or not: the calls that bring a pod or container into the
#: store, which is the agent's view of the node (metrics, QoS and eviction act on a new pod
#: at once), whose request (the whole config) and reply (the new id) are needed; and
#: StartContainer, whose Post stages place the container's tasks (resctrl, oom_score_adj,
#: core scheduling, memory QoS) once it runs; and UpdateContainerResources, which changes
#: the resources the store holds for a running container (what QoS and metrics read) and has
#: Post stages (a rare call: kubelet's CPU manager, an in-place resize). Stop/Remove need no
#: call: the re-sync finds them.
STORE_CALLS: Final = frozenset({"RunPodSandbox", "CreateContainer", "StartContainer", "UpdateContainerResources"})


def intercepted_paths(pre_calls: frozenset[str]) -> tuple[str, ...]:
    """The lifecycle method paths to send to Python for a chain's ``pre_calls`` plus
    ``STORE_CALLS`` (in a fixed order: the rendered text decides whether HAProxy reloads)."""
    wanted = pre_calls | STORE_CALLS
    return tuple(path for path in LIFECYCLE_METHODS if path.removeprefix(RUNTIME_SERVICE) in wanted)



#: A CRI method of either service (one path segment after the service), as grpcserver.cri_service.
_CRI_PATH: Final = r"^/runtime\.v1\.(RuntimeService|ImageService)/[^/]+$"
NOT_CRI_MESSAGE: Final = (
    "koord-runtime-proxy relays only the CRI services runtime.v1.RuntimeService and runtime.v1.ImageService"
)
#: One header block (grpc-message included) must fit a buffer: 128 KiB allows ~100 KB of
#: error text. Costs up to two buffers per active connection.
BUFSIZE: Final = 131072
#: grpc-go servers advertise no limit; HAProxy's default 100 queues kubelet's parallel calls.
MAX_CONCURRENT_STREAMS: Final = 1000
#: HAProxy's timers are 32-bit milliseconds.
MAX_TIMEOUT_SECONDS: Final = 2_147_483
#: An absolute URI back to the client's ``:path``: ``x`` + the authority (the ``host``
#: header, which HAProxy sets from ``:authority``) + `` `` + ``url``, and a backreference
#: that removes ``scheme://`` and exactly that authority, whatever it holds (``/``s
#: included). The authority first, so the regex is linear in the URI's length (the other
#: order backtracks over every split of the path). Only for an absolute URI (a request
#: without ``:authority`` is in origin form already) and an authority of at most
#: ``MAX_AUTHORITY`` bytes; a longer one keeps HAProxy's own split, which then decides
#: both the route and the ``:path`` a server gets (they never differ).
MAX_AUTHORITY: Final = 1024
NORMALIZE_URI: Final = (
    "    http-request set-var(txn.authority) req.fhdr(host) unless { url_beg / }",
    "    http-request set-var(txn.url) url unless { url_beg / }",
    "    http-request set-uri \"%[str(x),concat(,txn.authority,' '),concat(,txn.url,),"
    "regsub('^x(.*) [a-zA-Z][a-zA-Z0-9+.-]*://\\1(/.*)\\$','\\2')]\""
    f" unless {{ url_beg / }} || {{ var(txn.authority),length gt {MAX_AUTHORITY} }}",
)
#: Headers one message may carry (HAProxy's default, written out because the private
#: interception server relies on it; kubelet sends ~10): more is refused by HAProxy
#: before any server sees the call. ``tune.bufsize`` bounds their size.
MAX_HEADERS: Final = 101


@dataclass(frozen=True)
class Layout:
    """Where the data plane's private files live: one directory, mode 0700."""

    run_dir: Path

    @classmethod
    def for_listen(cls, listen: Path) -> Layout:
        # Next to kubelet's socket (a directory we own already), short enough for sun_path.
        return cls(listen.parent / f".{listen.name}.dataplane")

    @property
    def intercept_socket(self) -> Path:
        """The Python interception server's socket (mode 0600)."""
        return self.run_dir / "intercept.sock"

    @property
    def stats_socket(self) -> Path:
        return self.run_dir / "stats.sock"

    @property
    def master_socket(self) -> Path:
        return self.run_dir / "master.sock"

    @property
    def config_file(self) -> Path:
        return self.run_dir / "haproxy.cfg"

    @property
    def not_cri_reply(self) -> Path:
        """The raw response HAProxy sends for a path that is no CRI method."""
        return self.run_dir / "not-cri.http"


#: gRPC trailers-only UNIMPLEMENTED: status 200 and grpc-status in the only header block.
#: A raw message (``errorfile``): ``http-request return`` drops content-type without a body,
#: and grpc-go clients (kubelet) refuse a response without ``application/grpc``.
NOT_CRI_REPLY: Final = (
    "HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ngrpc-status: 12\r\n"
    f"grpc-message: {NOT_CRI_MESSAGE}\r\ncontent-length: 0\r\n\r\n"
).encode()


#: gRPC status codes counted per method (1..16; the stick table's gpc1..gpc16).
_GRPC_CODES: Final = range(1, 17)


def _counting(lifecycle: tuple[str, ...]) -> list[str]:
    """Per-method counters in HAProxy's stick table (read at scrape time by
    runtimeproxy.dataplane.haproxystats): the key is the method path for a method of our protos,
    ``<service>/*`` for another method of a CRI service, ``*`` for any other path, so
    the table (and the label set) stays bounded whatever a client calls."""
    known = sorted(set(known_methods()) - set(lifecycle))
    lines = [f"    acl known path {' '.join(known[i:i + 8])}" for i in range(0, len(known), 8)]
    table = f"table {TABLE}"
    lines += [
        f"    http-request track-sc0 path {table} if known",
        f"    http-request track-sc0 str(/runtime.v1.ImageService/*) {table} if cri image !known",
        f"    http-request track-sc0 str(/runtime.v1.RuntimeService/*) {table} if cri !image !known !lifecycle",
        f"    http-request track-sc0 str({NOT_CRI_KEY}) {table} unless cri",
        # Only responses from a backend run these (not HAProxy's own 503 or not-CRI reply):
        # gpc0 counts answered calls; an error before any reply message is trailers-only,
        # its grpc-status in the response headers.
        "    http-response sc-inc-gpc(0,0)",
        "    http-response set-var(txn.grpc_status) res.hdr(grpc-status)",
    ]
    lines += [f"    http-response sc-inc-gpc({code},0) if {{ var(txn.grpc_status) -m str {code} }}"
              for code in _GRPC_CODES]
    return lines


def _ms(seconds: float) -> str:
    return f"{max(1, min(int(seconds * 1000), MAX_TIMEOUT_SECONDS * 1000))}ms"


def _quote(text: str) -> str:
    """A double-quoted HAProxy word (paths and messages we generate; no newlines)."""
    if any(c in text for c in "\n\r\0"):
        raise ValueError(f"cannot put {text!r} into the HAProxy configuration")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace("%", "%%") + '"'


def _server(name: str, socket: str) -> str:
    return f"    server {name} {_quote('unix@' + socket)} proto h2"


def render(settings: Settings, layout: Layout, intercepted: tuple[str, ...] = LIFECYCLE_METHODS) -> str:
    """The whole HAProxy configuration for these settings (deterministic text: a reload
    happens only when this changes). ``intercepted``: the lifecycle paths the Python
    server gets (``intercepted_paths``); every other CRI method goes to containerd."""
    if not set(intercepted) <= set(LIFECYCLE_METHODS):
        raise ValueError(f"not lifecycle methods: {sorted(set(intercepted) - set(LIFECYCLE_METHODS))}")
    # Nothing for Python (not what ``intercepted_paths`` gives, but a valid configuration):
    # ``always_false``, as an empty pattern list is no valid acl.
    lifecycle = "path " + " ".join(intercepted) if intercepted else "always_false"
    idle = _ms(settings.data_plane_idle_timeout)
    runtime = settings.backend.runtime_endpoint
    image = settings.backend.image_endpoint or runtime
    defaults = [
        "    mode http",
        "    timeout connect 5s",
        # Inactivity timeouts, not call deadlines: kubelet's grpc-timeout ends unary calls
        # (containerd sees it), so these only reap dead peers. A GetContainerEvents stream
        # is quiet for as long as nothing happens on the node: the same long value for both
        # sides, the idle HTTP/2 connection of a kubelet included.
        f"    timeout client {idle}",
        f"    timeout server {idle}",
        f"    timeout tunnel {idle}",
        f"    timeout client-fin {idle}",
        f"    timeout server-fin {idle}",
        # Unset, these two fall back to timeout client; set so that no default can ever be shorter:
        # waiting for a request's headers and for the next request on an idle kubelet connection.
        f"    timeout http-request {idle}",
        f"    timeout http-keep-alive {idle}",
        # A lifecycle call while the Python server restarts: fail fast (UNAVAILABLE, kubelet
        # retries) instead of queueing behind connect retries.
        "    retries 1",
    ]
    lines: list[str] = [
        "# Generated by koord-runtime-proxy from its configuration; do not edit (rewritten at start and reload).",
        "global",
        # One thread: a kubelet makes a few calls a second; a second thread costs memory, not speed.
        "    nbthread 1",
        f"    tune.bufsize {BUFSIZE}",
        f"    tune.http.maxhdr {MAX_HEADERS}",
        f"    tune.h2.max-concurrent-streams {MAX_CONCURRENT_STREAMS}",
        # Runtime API: per-method counters are read from it at scrape time, the interception server is
        # taken out (maint) before Python drains; private to root like the run dir.
        f"    stats socket {_quote('unix@' + str(layout.stats_socket))} mode 600 level admin expose-fd listeners",
        # An old worker still serving a stream after a reload is stopped after this long.
        f"    hard-stop-after {_ms(max(settings.shutdown_grace, 60.0))}",
        "",
        "defaults",
        *defaults,
        "",
        "frontend cri",
        f"    bind {_quote('unix@' + settings.listen)} mode {settings.socket_mode:03o} proto h2",
        *NORMALIZE_URI,
        f"    acl lifecycle {lifecycle}",
        f"    acl cri path_reg {_CRI_PATH}",
        "    acl image path_beg /runtime.v1.ImageService/",
        *_counting(intercepted),
        f"    http-request return status 200 errorfile {_quote(str(layout.not_cri_reply))} unless cri",
        "    use_backend intercept if lifecycle",
        "    use_backend image if image",
        "    default_backend runtime",
        "",
        "backend intercept",
        # A lifecycle call the Python server never answered (the connection failed or closed with
        # no reply, as when it drains): tried once more, on a fresh connection (HAProxy 2.6 has
        # no refused-stream retry).
        "    retry-on conn-failure empty-response",
        # grpc core refuses a request with neither :authority nor host (a reset stream, no
        # status); HAProxy sends the host header as :authority. containerd gets what came.
        "    http-request set-header host localhost unless { req.hdr(host) -m found }",
        # HTTP/2 to Python's grpc.aio server (runtimeproxy.transport.grpcserver), as to containerd.
        _server("python", str(layout.intercept_socket)),
        "",
        "backend runtime",
        _server("containerd", runtime),
        "",
        "backend image",
        _server("containerd", image),
        "",
        f"backend {TABLE}",
        # No expiry: the keys are bounded (see _counting); the counters live as long as HAProxy.
        f"    stick-table type string len 96 size 128 store http_req_cnt,conn_cur,gpc({_GRPC_CODES.stop})",
        "",
    ]
    return "\n".join(lines)


def command(binary: str, layout: Layout) -> list[str]:
    """Master-worker in the foreground: the master (our child) re-executes itself on
    SIGUSR2 with the new configuration and hands the listeners to the new worker, so a
    reload neither closes kubelet's socket nor the calls in flight on the old worker."""
    return [binary, "-W", "-db", "-f", str(layout.config_file), "-S", f"{layout.master_socket},mode,600"]


def check_command(binary: str, config: Path) -> list[str]:
    # Not -q: on a refusal its ALERT lines are the reason we report.
    return [binary, "-c", "-f", str(config)]

