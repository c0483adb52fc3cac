"""Turning ``hooks:`` entries and hookserver.d registrations into a HookChain.

The core never names a concrete hook: plugins are found by entry point (group
``koord_runtime_proxy.hooks``, declared in setup.cfg) or by an explicit
``module:attr``. Every problem is a ConfigError naming the YAML key path, found
once at load time rather than at the first pod.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import types
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, cast

import structlog

from runtimeproxy.chain.hookchain import BoundHook, HookChain, HookObserver, HookPools, implemented_stages
from runtimeproxy.chain.remote import REMOTE_STAGES, Registration, RemoteHook, load_registrations
from runtimeproxy.chain.validate import PatchValidator
from runtimeproxy.config.configvalues import boolean
from runtimeproxy.config.filetrust import path_problem
from runtimeproxy.config.settings import ConfigError, FailurePolicy, HookSettings, Settings
from runtimeproxy.hookapi import HookInit, PodSnapshot, Stage, TaskInit
from runtimeproxy.ops.repeats import RepeatFilter
from runtimeproxy.services import NodeServices

log = structlog.get_logger("runtimeproxy.plugins")

HOOK_GROUP: Final = "koord_runtime_proxy.hooks"
TASK_GROUP: Final = "koord_runtime_proxy.tasks"
REGISTRATION_TIMEOUT: Final = 1.0

HookFactory = Callable[..., object]  # takes HookInit (hooks) or TaskInit (tasks)
RulesSource = Callable[[], Mapping[str, Any]]


def available_plugins(group: str = HOOK_GROUP) -> list[str]:
    return sorted(ep.name for ep in importlib.metadata.entry_points(group=group))


def resolve_factory(spec: str, key_path: str, group: str = HOOK_GROUP) -> HookFactory:
    """``module:attr`` or an entry-point name -> the factory callable."""
    try:
        if ":" in spec:
            module_name, _, attr = spec.partition(":")
            target: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                target = getattr(target, part)
        else:
            found = importlib.metadata.entry_points(group=group).select(name=spec)
            if not found:
                raise ConfigError(key_path, spec, f"unknown plugin; installed: {available_plugins(group)}")
            target = next(iter(found)).load()
    except (ImportError, AttributeError) as exc:
        raise ConfigError(key_path, spec, f"cannot load plugin: {exc}") from exc
    if not callable(target):
        raise ConfigError(key_path, spec, "plugin is not callable")
    factory: HookFactory = target
    return factory


def _check_methods(impl: object, stages: frozenset[Stage], key_path: str) -> None:
    for stage in stages:
        method = getattr(impl, stage.method_name)
        try:
            inspect.signature(method).bind(object())
        except TypeError as exc:
            raise ConfigError(key_path, stage.value, f"{stage.method_name} must take one context argument") from exc


def _local_hook(hook: HookSettings, settings: Settings, current_rules: RulesSource | None,
                services: NodeServices) -> BoundHook:
    factory = resolve_factory(hook.plugin, f"{hook.key_path}.plugin")
    init = HookInit(name=hook.name, args=hook.args, key_path=f"{hook.key_path}.args",
                    host=settings.host, rules=settings.rules, current_rules=current_rules, services=services)
    impl = factory(init)  # a plugin's HookConfigError is the core's ConfigError: reported as any other
    implemented = implemented_stages(impl)
    if not implemented:
        raise ConfigError(f"{hook.key_path}.plugin", hook.plugin, "the hook implements no stage")
    stages = hook.stages if hook.stages is not None else implemented
    missing = sorted(s.value for s in stages - implemented)
    if missing:
        have = sorted(s.value for s in implemented)
        message = f"hook {hook.name!r} does not implement it; it has {have}"
        raise ConfigError(f"{hook.key_path}.stages", missing[0], message)
    _check_methods(impl, stages, f"{hook.key_path}.stages")
    return BoundHook(hook.name, impl, stages, hook.failure_policy, hook.timeout)


def dry_run_hook(hook: HookSettings, settings: Settings, current_rules: RulesSource) -> BoundHook | str:
    """A fresh instance of a local hook with ``args.dry_run: true`` deciding from
    ``current_rules`` (a preview), or why there is none: a remote hook, a hook that
    refuses ``dry_run`` or does not say it took it (``impl.dry_run is True``: a hook
    that ignored the key would write for real, so it is never called)."""
    if hook.remote:
        return "a remote hook has no dry run"
    args = {**hook.args, "dry_run": True}
    try:
        bound = _local_hook(dataclasses.replace(hook, args=args), settings, current_rules, NodeServices.create())
    except ConfigError as exc:
        return f"no dry run: {exc}"
    if getattr(bound.impl, "dry_run", None) is not True:
        return "no dry run (the hook does not report dry_run)"
    return bound


def _remote_hook(hook: HookSettings) -> BoundHook:
    stages = hook.stages if hook.stages is not None else REMOTE_STAGES
    unsupported = stages - REMOTE_STAGES
    if unsupported:
        bad = sorted(s.value for s in unsupported)
        raise ConfigError(f"{hook.key_path}.stages", bad, "not in RuntimeHookService v1alpha1")
    impl = RemoteHook(name=hook.name, endpoint=hook.remote, stages=stages)
    return BoundHook(hook.name, impl, stages, hook.failure_policy, hook.timeout)


def _registered_hook(reg: Registration) -> BoundHook:
    return BoundHook(f"hookserver.d/{reg.name}", reg.hook(), reg.stages, FailurePolicy(reg.failure_policy),
                     REGISTRATION_TIMEOUT)


def _check_hookserver_files(settings: Settings) -> None:
    """A registration names a socket that every pod start then talks to: the directory
    and each ``*.json`` must be changeable only by root or us (see filetrust), unless
    ``allow_insecure.file_permissions`` accepts the risk (then warned about each time)."""
    directory = Path(settings.hookserver_dir)
    problems = [(directory, path_problem(directory, "dir"))]
    if problems[0][1] is None:  # else every file in it shares the directory's problem
        try:
            entries = sorted(p for p in directory.iterdir() if p.name.endswith(".json"))
        except OSError:
            entries = []  # missing: no registrations (load_registrations agrees)
        problems = [(path, path_problem(path)) for path in entries]
    for path, problem in problems:
        if problem is None:
            continue
        if "file_permissions" not in settings.allow_insecure:
            raise ConfigError("hookserver_dir", str(path), f"refused: {problem}; fix the ownership/mode, or set "
                              "allow_insecure.file_permissions: true to accept the risk")
        log.warning("insecure_setting_allowed", risk=f"hookserver_dir: {problem}")


def build_hooks(settings: Settings, *, current_rules: RulesSource | None = None,
                services: NodeServices | None = None) -> list[BoundHook]:
    """YAML hooks in list order, then hookserver.d registrations in file-name order
    (Koordinator calls only the first registration that matches; we call all).
    ``current_rules``: the process's ``RulesProvider.current`` (hooks validate
    ``settings.rules`` and decide from the rules in force); ``services``: the process's
    (None: fresh ones for these hooks, e.g. check-config's)."""
    shared = services if services is not None else NodeServices.create()
    hooks = [_remote_hook(h) if h.remote else _local_hook(h, settings, current_rules, shared) for h in settings.hooks]
    if settings.hookserver_dir:
        _check_hookserver_files(settings)
        registrations, errors = load_registrations(Path(settings.hookserver_dir))
        for error in errors:
            # Registration files belong to other agents: a bad one is reported, not fatal.
            log.error("hookserver_registration_invalid", error=error)
        hooks.extend(_registered_hook(r) for r in registrations)
    return hooks


def build_chain(
    settings: Settings, *, pools: HookPools, observer: HookObserver | None = None,
    current_rules: RulesSource | None = None, repeats: RepeatFilter | None = None,
    services: NodeServices | None = None,
) -> HookChain:
    return HookChain(build_hooks(settings, current_rules=current_rules, services=services), pools=pools,
                     observer=observer,
                     validator=PatchValidator.for_host(settings.host), repeats=repeats)


async def close_hooks(hooks: Sequence[BoundHook]) -> None:
    """Let hooks release channels/files when a chain is replaced or at exit."""
    for hook in hooks:
        close = getattr(hook.impl, "close", None)
        if close is None:
            continue
        try:
            result = close()
            if inspect.isawaitable(result):
                await result
        except Exception as exc:  # noqa: BLE001 - closing must not stop the others
            log.warning("hook_close_failed", hook=hook.name, error=str(exc))


TaskFactory = Callable[[], Awaitable[None]]


def _enabled_tasks(settings: Settings) -> list[tuple[str, str, dict[str, Any]]]:
    """``(name, key_path, args)`` of each enabled task, in YAML order."""
    out: list[tuple[str, str, dict[str, Any]]] = []
    for name, raw in settings.tasks.items():
        key_path = f"tasks.{name}"
        if raw is not None and not isinstance(raw, Mapping):
            raise ConfigError(key_path, raw, "must be a mapping of the task's settings")
        args = dict(raw or {})
        if boolean(args.pop("enabled", True), f"{key_path}.enabled"):
            out.append((name, key_path, args))
    return out


def _no_pods() -> tuple[dict[str, Any], dict[str, Any]]:
    return {}, {}


@dataclass(frozen=True, slots=True)
class _Task:
    """An enabled task: its entry point and the tasks it builds on (the factory's
    ``needs``: required; ``after``: built first when enabled), as data."""

    name: str
    key_path: str
    args: dict[str, Any]
    factory: Any
    needs: tuple[str, ...]
    after: tuple[str, ...]


def _names(factory: object, attr: str, key_path: str, name: str) -> tuple[str, ...]:
    found = getattr(factory, attr, ())
    if not isinstance(found, tuple) or not all(isinstance(n, str) for n in found):
        raise ConfigError(key_path, name, f"task factory's {attr} must be a tuple of task names")
    return found


def _tasks_in_order(settings: Settings) -> list[_Task]:
    """The enabled tasks, each after the tasks it builds on (else in YAML order), so the
    order under ``tasks:`` never matters. A needed task that is not enabled, or tasks
    needing each other, are config errors naming the task."""
    enabled: dict[str, _Task] = {}
    for name, key_path, args in _enabled_tasks(settings):
        factory = resolve_factory(name, key_path, TASK_GROUP)
        enabled[name] = _Task(name, key_path, args, factory, _names(factory, "needs", key_path, name),
                              _names(factory, "after", key_path, name))
    out: list[_Task] = []
    placed: set[str] = set()

    def place(task: _Task, chain: tuple[str, ...]) -> None:
        if task.name in placed:
            return
        for dep in (*task.needs, *task.after):
            if dep in chain:
                raise ConfigError(task.key_path, task.name, f"tasks build on each other in a cycle: "
                                  f"{' -> '.join((*chain, task.name, dep))}")
            if dep not in enabled:
                if dep in task.needs:
                    raise ConfigError(task.key_path, task.name, f"needs the {dep} task: enable tasks.{dep}")
                continue
            place(enabled[dep], (*chain, task.name))
        placed.add(task.name)
        out.append(task)

    for task in enabled.values():
        place(task, ())
    return out


def _pass_init(task: _Task, provided: dict[str, object], **fields: Any) -> TaskInit:
    """The init of ``task`` in one pass (validate, plan or build): what the tasks it
    builds on provided in this pass, and its own ``provide``. Fresh per pass, never global."""
    needed = {dep: provided[dep] for dep in (*task.needs, *task.after) if dep in provided}

    def provide(value: object) -> None:
        provided[task.name] = value

    return TaskInit(name=task.name, args=task.args, key_path=task.key_path, needed=types.MappingProxyType(needed),
                    provide=provide, **fields)


def validate_tasks(settings: Settings) -> list[str]:
    """The one check of ``tasks:`` that ``run`` (inside ``build_tasks``), ``check-config``
    and reload share: the mapping, ``enabled``, the entry point, what each task builds
    on (``needs``), then the factory's optional ``validate(init)``, which checks the args
    (and rules across tasks: what a needed task's ``validate`` gave ``init.provide``
    arrives in ``init.needed``) without building anything. The core cannot know a
    task's keys; the task's own validator is the one source of that truth. Returns the
    enabled tasks' names (YAML order)."""
    provided: dict[str, object] = {}
    for task in _tasks_in_order(settings):
        validate = getattr(task.factory, "validate", None)
        if validate is None:
            continue
        init = _pass_init(task, provided, snapshot=_no_pods, host=settings.host, rules=settings.rules)
        validate(init)
    return [name for name, _, _ in _enabled_tasks(settings)]


def plan_tasks(settings: Settings) -> dict[str, Mapping[str, Any]]:
    """What each enabled task would run, for ``check-config``: the factory's optional
    ``plan(init)`` (a JSON-able mapping: its collectors, strategies, intervals, what is
    off on this host and why), called after its ``validate`` in the same pass (so a task
    reads in ``init.needed`` what the tasks it builds on validated); its ``args`` for a
    task without one. It must build nothing that lasts and write nothing."""
    provided: dict[str, object] = {}
    out: dict[str, Mapping[str, Any]] = {}
    for task in _tasks_in_order(settings):
        init = _pass_init(task, provided, snapshot=_no_pods, host=settings.host, rules=settings.rules,
                          state_dir=Path(settings.state_dir) if settings.state_dir else None)
        validate = getattr(task.factory, "validate", None)
        if validate is not None:
            validate(init)
        plan = getattr(task.factory, "plan", None)
        out[task.name] = dict(plan(init)) if plan is not None else {"args": task.args}
    return {name: out[name] for name, _, _ in _enabled_tasks(settings)}


def validate(settings: Settings) -> tuple[list[BoundHook], list[str]]:
    """Everything ``run`` checks before it listens, for ``check-config``: the hooks
    (built, so plugins validate their args) and the tasks; the chain and task names."""
    hooks = build_hooks(settings)
    return hooks, validate_tasks(settings)


def build_tasks(settings: Settings, base: TaskInit) -> list[tuple[str, TaskFactory]]:
    """Background tasks named under ``tasks:`` (``{name: {enabled: bool, ...args}}``),
    found by entry point, each built after the tasks it builds on (``needs``/``after``);
    the supervisor runs them. ``base`` carries the process's services (snapshot,
    registry, routes, ``NodeServices``...); each task gets it with its own name, args,
    ``needed`` and ``provide``. Validated first by ``validate_tasks`` (as check-config and reload do), then
    built, so a bad name or bad args exit 2 like any other config error."""
    validate_tasks(settings)
    provided: dict[str, object] = {}
    out: list[tuple[str, TaskFactory]] = []
    for task in _tasks_in_order(settings):
        own = _pass_init(task, provided, snapshot=base.snapshot)
        init = dataclasses.replace(base, name=task.name, args=task.args, key_path=task.key_path,
                                   host=settings.host, rules=settings.rules, needed=own.needed, provide=own.provide)
        run = task.factory(init)
        if not callable(run):
            raise ConfigError(task.key_path, task.name, "task factory must return a coroutine function")
        out.append((task.name, cast(TaskFactory, run)))
    return out


def task_base(snapshot: PodSnapshot) -> TaskInit:
    """A TaskInit template with only the snapshot set (tests, check-config)."""
    return TaskInit(name="", args={}, key_path="tasks", snapshot=snapshot)
