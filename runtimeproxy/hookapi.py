"""The hook API: what a hook plugin sees and what it may give back.

Hooks never touch protobuf messages. They get a frozen, typed context and return a
typed patch; only the core (``runtimeproxy.chain.patching``) turns patches into CRI
messages. This keeps hooks independent of the CRI version and of the transport,
and lets the chain show later hooks exactly what earlier hooks changed.

A hook is any object that has one method per lifecycle stage it implements, named
after the stage (``pre_create_container``, ``post_start_container``, ...). Each
method takes the stage's context and returns the stage's patch type or ``None``.
Methods may be plain functions (run in a worker thread, since they usually touch
cgroupfs) or coroutines (awaited on the loop). See ``hooks/example.py``.
"""

from __future__ import annotations

import enum
import threading
import types
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable

# Re-exported: plugins raise and catch these through the hook API (docs/hooks.md).
from runtimeproxy.errors import ConfigError as ConfigError
from runtimeproxy.errors import HookConfigError as HookConfigError
from runtimeproxy.errors import HookError as HookError
from runtimeproxy.errors import KoordError as KoordError
from runtimeproxy.errors import PeerError
from runtimeproxy.services import NodeServices

EMPTY: Final[Mapping[str, str]] = types.MappingProxyType({})


def frozen_map(values: Mapping[str, str] | None) -> Mapping[str, str]:
    """Return a read-only copy, so a context handed to a hook cannot be mutated."""
    if not values:
        return EMPTY
    return types.MappingProxyType(dict(values))


class Stage(enum.Enum):
    """Lifecycle stages, named as Koordinator names them (so configs and
    hookserver.d registrations use the same words)."""

    PRE_RUN_POD_SANDBOX = "PreRunPodSandbox"
    POST_RUN_POD_SANDBOX = "PostRunPodSandbox"
    PRE_STOP_POD_SANDBOX = "PreStopPodSandbox"
    POST_STOP_POD_SANDBOX = "PostStopPodSandbox"
    PRE_REMOVE_POD_SANDBOX = "PreRemovePodSandbox"
    POST_REMOVE_POD_SANDBOX = "PostRemovePodSandbox"
    PRE_CREATE_CONTAINER = "PreCreateContainer"
    POST_CREATE_CONTAINER = "PostCreateContainer"
    PRE_START_CONTAINER = "PreStartContainer"
    POST_START_CONTAINER = "PostStartContainer"
    PRE_UPDATE_CONTAINER_RESOURCES = "PreUpdateContainerResources"
    POST_UPDATE_CONTAINER_RESOURCES = "PostUpdateContainerResources"
    PRE_STOP_CONTAINER = "PreStopContainer"
    POST_STOP_CONTAINER = "PostStopContainer"
    PRE_REMOVE_CONTAINER = "PreRemoveContainer"
    POST_REMOVE_CONTAINER = "PostRemoveContainer"
    #: Not a CRI call: the reconciler's periodic pass over every known pod / container,
    #: so hooks can repair drift on the host (their patches may carry only ``writes``).
    RECONCILE_POD_SANDBOX = "ReconcilePodSandbox"
    RECONCILE_CONTAINER = "ReconcileContainer"

    @property
    def method_name(self) -> str:
        """The hook method implementing this stage: ``PreCreateContainer`` → ``pre_create_container``."""
        return _METHOD_NAMES[self]

    @property
    def is_pre(self) -> bool:
        return self.value.startswith("Pre")

    @property
    def call(self) -> str | None:
        """The CRI method whose call runs this stage (``PreStopContainer`` →
        ``StopContainer``); None for the reconciler's stages."""
        if self.value.startswith("Reconcile"):
            return None
        return self.value.removeprefix("Pre").removeprefix("Post")

    @property
    def patchable(self) -> bool:
        """Only stages whose CRI request carries a config can be patched; the
        others (stop/remove/start take an id) can observe or veto, not change."""
        return self in _PATCHABLE


def _snake(name: str) -> str:
    out: list[str] = []
    for ch in name:
        if ch.isupper() and out:
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


#: Computed once: the chain asks for a stage's method on every call.
_METHOD_NAMES: Final = {stage: _snake(stage.value) for stage in Stage}

_PATCHABLE: Final = frozenset(
    {Stage.PRE_RUN_POD_SANDBOX, Stage.PRE_CREATE_CONTAINER, Stage.PRE_UPDATE_CONTAINER_RESOURCES}
)


@dataclass(frozen=True, slots=True)
class Resources:
    """Linux resources as CRI carries them (0 / "" mean "not set", as in CRI)."""

    cpu_period: int = 0
    cpu_quota: int = 0
    cpu_shares: int = 0
    memory_limit_in_bytes: int = 0
    oom_score_adj: int = 0
    cpuset_cpus: str = ""
    cpuset_mems: str = ""
    memory_swap_limit_in_bytes: int = 0
    unified: Mapping[str, str] = field(default_factory=lambda: EMPTY)


@dataclass(frozen=True, slots=True)
class ResourcesPatch:
    """What a hook wants changed; ``None`` leaves a field alone. ``unified`` keys are merged."""

    cpu_period: int | None = None
    cpu_quota: int | None = None
    cpu_shares: int | None = None
    memory_limit_in_bytes: int | None = None
    oom_score_adj: int | None = None
    cpuset_cpus: str | None = None
    cpuset_mems: str | None = None
    memory_swap_limit_in_bytes: int | None = None
    unified: Mapping[str, str] | None = None

    def is_empty(self) -> bool:
        return all(getattr(self, name) is None for name in self.__slots__)


@dataclass(frozen=True, slots=True)
class PodMeta:
    name: str
    namespace: str
    uid: str
    attempt: int = 0


@dataclass(frozen=True, slots=True)
class PodInfo:
    """A pod sandbox as the proxy knows it. ``id`` is empty before RunPodSandbox returns."""

    meta: PodMeta
    id: str = ""
    labels: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    annotations: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    runtime_handler: str = ""
    cgroup_parent: str = ""
    resources: Resources = Resources()
    overhead: Resources = Resources()


@dataclass(frozen=True, slots=True)
class ContainerMeta:
    name: str
    attempt: int = 0


@dataclass(frozen=True, slots=True)
class ContainerInfo:
    """A container as the proxy knows it. ``id`` is empty before CreateContainer returns."""

    meta: ContainerMeta
    id: str = ""
    labels: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    annotations: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    resources: Resources = Resources()
    envs: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    image: str = ""


@dataclass(frozen=True, slots=True)
class CallResult:
    """How the backend call ended, for Post stages (``code`` is a gRPC status name)."""

    ok: bool
    code: str = "OK"
    message: str = ""


@dataclass(frozen=True, slots=True)
class PodContext:
    stage: Stage
    pod: PodInfo
    result: CallResult | None = None


@dataclass(frozen=True, slots=True)
class ContainerContext:
    stage: Stage
    pod: PodInfo
    container: ContainerInfo
    result: CallResult | None = None


@dataclass(frozen=True, slots=True)
class HostWrite:
    """A change a hook made on the host itself (a cgroup or resctrl file), reported
    so ``explain`` and the log show it next to the request changes."""

    target: str
    old: str
    new: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PodPatch:
    """Changes to a RunPodSandbox request. Maps are merged key by key.

    At stages whose request cannot change (Post stages, id-only calls) a hook may
    still return a patch carrying only ``writes``."""

    labels: Mapping[str, str] | None = None
    annotations: Mapping[str, str] | None = None
    cgroup_parent: str | None = None
    resources: ResourcesPatch | None = None
    overhead: ResourcesPatch | None = None
    reason: str = ""
    writes: tuple[HostWrite, ...] = ()

    def changes_request(self) -> bool:
        return any(
            v is not None for v in (self.labels, self.annotations, self.cgroup_parent, self.resources, self.overhead)
        )


@dataclass(frozen=True, slots=True)
class ContainerPatch:
    """Changes to a CreateContainer / UpdateContainerResources request."""

    annotations: Mapping[str, str] | None = None
    envs: Mapping[str, str] | None = None
    resources: ResourcesPatch | None = None
    pod_cgroup_parent: str | None = None
    reason: str = ""
    writes: tuple[HostWrite, ...] = ()

    def changes_request(self) -> bool:
        return any(v is not None for v in (self.annotations, self.envs, self.resources, self.pod_cgroup_parent))


Context = PodContext | ContainerContext
Patch = PodPatch | ContainerPatch


@dataclass(frozen=True, slots=True)
class LivePods:
    """The pods that exist now, for ``OrphanSweeper.sweep_orphans``: the uids containerd
    listed in the re-sync just done, those the store holds and those of lifecycle calls in
    flight (a pod whose RunPodSandbox is still running is live)."""

    uids: frozenset[str]


@runtime_checkable
class OrphanSweeper(Protocol):
    """An optional hook method, not a stage: cleanup owed to pods that no longer exist,
    found from the host and from the hook's own saved values rather than from a call.

    The core calls ``sweep_orphans`` on every hook of the chain that has it, at start
    (after the store's rebuild) and after every re-sync with containerd, in a worker
    thread (an ``async def`` is awaited on the loop). A hook removes what it made for a
    pod whose uid is not in ``live`` (a ``koordlet-<uid>`` resctrl group, a saved
    per-pod value) and returns one line per thing removed (a path or a key, with why),
    logged by the core; nothing removed: an empty sequence. It must never remove what
    belongs to a live pod, and must tolerate running while lifecycle stages run. An
    exception is logged (``orphan_sweep_failed``) and retried at the next re-sync.
    """

    def sweep_orphans(self, live: LivePods) -> Sequence[str]: ...


@dataclass(frozen=True, slots=True)
class HostRoots:
    """Host directories, injected so hooks and collectors can run against fixture trees."""

    cgroup: Path = Path("/sys/fs/cgroup")
    proc: Path = Path("/proc")
    sys: Path = Path("/sys")
    resctrl: Path = Path("/sys/fs/resctrl")


@dataclass(frozen=True, slots=True)
class HookInit:
    """What a hook factory is given. ``args`` is the hook's own YAML mapping; the
    hook validates it and raises ``HookConfigError`` naming ``key_path``."""

    name: str
    args: Mapping[str, Any]
    key_path: str
    host: HostRoots = HostRoots()
    rules: Mapping[str, Any] = field(default_factory=dict)
    #: The rules in force now (``RulesProvider.current``: the YAML with the cluster's
    #: NodeSLO merged over it); None: ``rules`` is all there is. Validate ``rules`` at
    #: construction, read this one when deciding (see ``hooks.rules.LiveRules``).
    current_rules: Callable[[], Mapping[str, Any]] | None = None
    #: The process's shared services (the host-write back-off...): build executors with
    #: ``services.write_backoff`` so every writer of the process shares one.
    services: NodeServices = field(default_factory=NodeServices.create)


def merge_rules(base: Mapping[str, Any], over: Mapping[str, Any]) -> Mapping[str, Any]:
    """``over`` merged into ``base`` key by key: nested mappings are merged, any
    other value (a list, a scalar, None) replaces the base's."""
    out = dict(base)
    for key, value in over.items():
        below = out.get(key)
        out[key] = merge_rules(below, value) if isinstance(below, Mapping) and isinstance(value, Mapping) else value
    return out


class RulesProvider:
    """The one source of the rules every hook and task applies: the YAML ``rules:``
    (the base, replaced on reload) with each registered overlay merged over it in name
    order (the metrics task registers ``nodeslo``, the live NodeSLO, while the cluster
    has one; ``None`` withdraws it and the YAML applies again).

    ``current()`` is lock-free and returns the same object until the merge changes, so
    readers cache their parse by identity. Listeners run after every change, in the
    thread that made it (an informer's watch thread included): they must be
    thread-safe (e.g. ``loop.call_soon_threadsafe``)."""

    def __init__(self, base: Mapping[str, Any] | None = None) -> None:
        self._lock = threading.Lock()
        self._base: Mapping[str, Any] = base if base is not None else EMPTY
        self._overlays: dict[str, Mapping[str, Any]] = {}
        self._current: Mapping[str, Any] = self._base
        self._listeners: list[Callable[[], None]] = []

    def current(self) -> Mapping[str, Any]:
        return self._current

    def sources(self) -> list[str]:
        """What the rules in force are made of: ``yaml`` then the overlays."""
        return ["yaml", *sorted(self._overlays)]

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def set_base(self, base: Mapping[str, Any]) -> None:
        with self._lock:
            self._base = base
            changed = self._merge()
        self._notify(changed)

    def set_overlay(self, name: str, overlay: Mapping[str, Any] | None) -> None:
        with self._lock:
            if overlay is None:
                self._overlays.pop(name, None)
            else:
                self._overlays[name] = overlay
            changed = self._merge()
        self._notify(changed)

    def _merge(self) -> bool:
        merged: Mapping[str, Any] = self._base
        for name in sorted(self._overlays):
            merged = merge_rules(merged, self._overlays[name])
        if merged == self._current:
            return False
        self._current = merged if not self._overlays else types.MappingProxyType(dict(merged))
        return True

    def _notify(self, changed: bool) -> None:
        if changed:
            for listener in list(self._listeners):
                listener()


PodSnapshot = Callable[[], tuple[Mapping[str, PodInfo], Mapping[str, tuple[str, ContainerInfo]]]]

#: An HTTP GET handler on the loopback endpoint: query -> (status, content type, body).
Route = Callable[[dict[str, str]], Awaitable[tuple[int, str, bytes]]]
#: Contributes to ``explain``: given a pod (or None for the node view), a JSON-able mapping.
Explainer = Callable[["PodInfo | None"], Mapping[str, Any]]
#: Renders Prometheus text-format lines (HELP/TYPE and samples), appended to ``/metrics``.
Exposition = Callable[[], bytes]
#: A unary CRI call to the runtime behind the proxy: (full method, request bytes, timeout) ->
#: response bytes. Raises ``CriCallError`` when the runtime answers with an error.
CriCall = Callable[[str, bytes, float], Awaitable[bytes]]


class CriCallError(PeerError):
    """The runtime answered a task's CRI call with an error (``code`` is the gRPC status name)."""

    def __init__(self, method: str, code: str, message: str) -> None:
        super().__init__(f"{method}: {code}: {message}")
        self.method = method
        self.code = code
        self.message = message


def _no_rules() -> Mapping[str, Any]:
    return EMPTY


def _no_route(path: str, handler: Route) -> None:
    raise RuntimeError(f"no HTTP endpoint to add {path!r} to")


def _no_explainer(name: str, explainer: Explainer) -> None:
    return None


def _no_exposition(render: Exposition) -> None:
    return None


async def _no_cri(method: str, payload: bytes, timeout: float) -> bytes:
    raise CriCallError(method, "UNAVAILABLE", "no runtime connected")


def _no_overlay(name: str, overlay: Mapping[str, Any] | None) -> None:
    return None


def _always() -> bool:
    return True


def _no_reconcile() -> None:
    return None


def _no_provide(value: object) -> None:
    return None


def _nothing_needed() -> Mapping[str, object]:
    return types.MappingProxyType({})


@dataclass(frozen=True, slots=True)
class TaskInit:
    """What a background-task factory (entry-point group ``koord_runtime_proxy.tasks``)
    is given. The factory returns a zero-argument coroutine function that the
    supervisor runs (and restarts with back-off if it raises).

    - ``args``: its ``tasks.<name>`` mapping (validate it; raise ``HookConfigError``
      naming ``key_path``);
    - ``snapshot``: a read-only view of the proxy's pods (sandbox id -> pod) and
      containers (id -> (sandbox id, container));
    - ``rules`` is the ``rules:`` section at start; ``current_rules()`` the one in force
      now (it changes on reload and with the NodeSLO, without restarting tasks);
    - ``set_rules_overlay(name, mapping | None)``: register (None: withdraw) a source of
      rules merged over the YAML for every hook and task (``RulesProvider.set_overlay``);
      a change triggers a reconciler pass;
    - ``registry``: the Prometheus registry served on ``/metrics`` (None when off);
    - ``add_route``/``add_explainer``: extend the loopback HTTP endpoint and ``explain``;
      only valid inside the factory (the endpoint starts after the tasks are built);
    - ``add_exposition``: text appended to ``/metrics`` after ``registry``'s, for an
      exporter of thousands of series that renders its own text (prometheus_client
      builds and formats an object per sample, ~14 µs each, on the loop). Reserve its names in
      ``registry`` (a collector whose ``describe`` yields them and ``collect`` nothing)
      so a clash is still refused; same validity as ``add_route``;
    - ``cri``: unary calls to the runtime behind the proxy (not through the hook chain);
    - ``needed``: what the tasks this one builds on handed to ``provide``, by task name.
      A factory declares them as data: ``factory.needs`` (a tuple of task names that must
      be enabled, else a config error naming this task) and ``factory.after`` (built
      first when enabled); the core builds each task after them, whatever the order
      under ``tasks:``. Fresh per pass: in ``validate`` it holds what the needed
      tasks' ``validate`` provided (their settings), when built what their factory did;
    - ``provide(value)``: hand ``value`` to the tasks that build on this one (e.g. the
      metrics task provides its agent; the consumers turn it into a typed handle);
    - ``services``: the process's shared services (``NodeServices``: the host-write
      back-off and failure counts), one per app, passed in rather than global;
    - ``state_dir``: the config's ``state_dir`` (None when empty), for what must survive
      a restart;
    - ``pods_known()``: whether ``snapshot`` is complete, i.e. the store was rebuilt from
      the runtime since the start (tasks start before that: an empty snapshot right after
      a restart means "not known yet", not "no pods"; what is published from it waits).
    - ``reconcile_now()``: ask for a reconciler pass at once (thread-safe), e.g. after a
      task lifted a limit that hooks' values under it had to wait for.
    """

    name: str
    args: Mapping[str, Any]
    key_path: str
    snapshot: PodSnapshot
    host: HostRoots = HostRoots()
    rules: Mapping[str, Any] = field(default_factory=dict)
    current_rules: Callable[[], Mapping[str, Any]] = _no_rules
    set_rules_overlay: Callable[[str, Mapping[str, Any] | None], None] = _no_overlay
    registry: Any = None
    add_route: Callable[[str, Route], None] = _no_route
    add_explainer: Callable[[str, Explainer], None] = _no_explainer
    add_exposition: Callable[[Exposition], None] = _no_exposition
    cri: CriCall = _no_cri
    needed: Mapping[str, object] = field(default_factory=_nothing_needed)
    provide: Callable[[object], None] = _no_provide
    services: NodeServices = field(default_factory=NodeServices.create)
    #: The config's ``state_dir`` (None: empty, keep state in memory only): what a task
    #: must remember across restarts (e.g. sysctl values to restore) goes under it.
    state_dir: Path | None = None
    pods_known: Callable[[], bool] = _always
    reconcile_now: Callable[[], None] = _no_reconcile


class TargetGoneError(HookError):
    """What the hook acts on is gone from the host (a pod's or container's cgroup):
    it was torn down while the hook ran. In a reconcile pass that is the object going
    away, not a fault; the next store re-sync drops it."""
