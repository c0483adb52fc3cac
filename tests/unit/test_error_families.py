"""Issue 27 item 10: one error root (``KoordError``) with a few families, and one
config-value toolkit for the core, the hooks and the tasks.

The walk imports every module of runtimeproxy, hooks and metrics and checks each
exception class defined there: a stray ``class XError(Exception)`` (or one deriving
from two families) fails it, naming the class."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator

import pytest

from runtimeproxy import errors
from runtimeproxy.config import configvalues
from runtimeproxy.errors import FAMILIES, ConfigError, HookConfigError, KoordError

PACKAGES = ("runtimeproxy", "hooks", "metrics")


def _modules() -> Iterator[str]:
    for name in PACKAGES:
        package = importlib.import_module(name)
        yield name
        for info in pkgutil.walk_packages(package.__path__, f"{name}."):
            yield info.name


def _exception_classes() -> list[type[BaseException]]:
    found: list[type[BaseException]] = []
    for name in _modules():
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == name:
                found.append(obj)
    return found


def family_problem(cls: type[BaseException]) -> str | None:
    """Why ``cls`` breaks the rule (None: it derives from exactly one family)."""
    if cls is KoordError or cls in FAMILIES:
        return None
    if not issubclass(cls, KoordError):
        return "does not derive from KoordError"
    families = [f.__name__ for f in FAMILIES if issubclass(cls, f)]
    if len(families) != 1:
        return f"derives from {len(families)} families {families}, not exactly one"
    return None


def test_the_walk_sees_the_project() -> None:
    names = {f"{c.__module__}.{c.__qualname__}" for c in _exception_classes()}
    # Spot checks from every package: a walk that found nothing would pass vacuously.
    assert {"runtimeproxy.backend.CallError", "hooks.cgroups.CgroupError",
            "metrics.store.tsdbquery.TSDBError", "runtimeproxy.nri.wire.ProtocolError"} <= names
    assert len(names) > 40


def test_every_exception_class_is_in_exactly_one_family() -> None:
    problems = [f"{c.__module__}.{c.__qualname__}: {why}" for c in _exception_classes()
                if (why := family_problem(c)) is not None]
    assert problems == []


def test_the_rule_refuses_a_stray_class_and_a_class_of_two_families() -> None:
    class Stray(Exception):
        pass

    class Twice(errors.HookError, errors.HostError):
        pass

    class Fine(errors.StoreError, ValueError):
        pass

    assert family_problem(Stray) == "does not derive from KoordError"
    assert family_problem(Twice) == "derives from 2 families ['HookError', 'HostError'], not exactly one"
    assert family_problem(Fine) is None


def test_the_families_are_defined_once_with_the_one_root() -> None:
    assert len(set(FAMILIES)) == len(FAMILIES) == 7
    for family in FAMILIES:
        assert family.__bases__ == (KoordError,), family
        assert family.__module__ == "runtimeproxy.errors"


def test_one_config_error_for_the_core_hooks_and_tasks() -> None:
    import runtimeproxy.config.settings
    import runtimeproxy.hookapi

    assert HookConfigError is ConfigError
    assert runtimeproxy.hookapi.HookConfigError is ConfigError
    assert runtimeproxy.hookapi.ConfigError is ConfigError
    assert runtimeproxy.config.settings.ConfigError is ConfigError
    assert configvalues.ConfigError is ConfigError
    exc = ConfigError("hooks[0].args.ratio", "x", "must be a number")
    assert (str(exc), exc.key_path, exc.value, exc.message) == (
        "hooks[0].args.ratio: must be a number (got 'x')", "hooks[0].args.ratio", "x", "must be a number")


def test_the_classes_callers_catch_as_builtins_still_are() -> None:
    import hooks.annotations
    from metrics.collect.cpi import PerfError
    from metrics.informer.kubeconfig import KubeconfigError
    from runtimeproxy.cpusets import CpuListError
    from runtimeproxy.dataplane.systemdunit import SystemctlError
    from runtimeproxy.state.ledger import LedgerError

    for cls in (hooks.annotations.AnnotationError, CpuListError, LedgerError, KubeconfigError):
        assert issubclass(cls, ValueError), cls
    assert issubclass(PerfError, OSError)
    assert issubclass(SystemctlError, RuntimeError)


def test_one_annotation_error() -> None:
    import hooks.annotations
    import hooks.resctrl

    assert hooks.resctrl.AnnotationError is hooks.annotations.AnnotationError


@pytest.mark.parametrize("module", ["hooks.hookargs", "hooks.dryrun", "hooks.blkiorules", "hooks.example",
                                    "metrics.settings", "metrics.store.settings", "metrics.informer.settings",
                                    "metrics.collect.settings", "metrics.qos.settings", "metrics.analysis.prediction",
                                    "metrics.collect.registry", "metrics.collect.advisor",
                                    "runtimeproxy.chain.checkplan", "runtimeproxy.config.ingress"])
def test_no_private_copy_of_the_value_helpers(module: str) -> None:
    mod = importlib.import_module(module)
    toolkit = (configvalues.reject_unknown, configvalues.parse_duration, configvalues.boolean, configvalues.choice,
               configvalues.absolute_path, configvalues.Section)
    for name in ("reject_unknown", "positive_duration", "_duration", "boolean", "choice", "absolute_path", "_Args"):
        found = getattr(mod, name, None)
        assert found is None or found in toolkit, (module, name)


class TestRejectUnknown:
    def test_names_the_key_path_the_value_and_the_known_keys(self) -> None:
        with pytest.raises(ConfigError) as info:
            configvalues.reject_unknown({"ratio": 1, "perod": 2}, frozenset({"ratio", "period"}), "hooks[0].args.")
        assert str(info.value) == "hooks[0].args.perod: unknown key (known: period, ratio) (got 2)"
        assert info.value.key_path == "hooks[0].args.perod"

    def test_quotes_an_odd_key_so_the_path_still_names_it(self) -> None:
        with pytest.raises(ConfigError, match=r"^log\.'a\.b': unknown key"):
            configvalues.reject_unknown({"a.b": 1}, frozenset({"level"}), "log.")
        with pytest.raises(ConfigError, match=r"^''"):
            configvalues.reject_unknown({"": 1}, frozenset({"level"}), "")
        with pytest.raises(ConfigError, match=r"^hooks\[0\]\.args\.1: unknown key"):  # YAML's `1: x`, not a crash
            configvalues.reject_unknown({1: "x"}, frozenset({"level"}), "hooks[0].args.")

    def test_known_keys_pass(self) -> None:
        configvalues.reject_unknown({"level": "info"}, frozenset({"level", "format"}), "log.")

    def test_the_hooks_and_the_tasks_report_it_the_same_way(self) -> None:
        from hooks.cpunormalization import CPUNormalization
        from metrics.settings import parse_metrics
        from runtimeproxy.hookapi import HookInit

        with pytest.raises(ConfigError, match=r"^hooks\[0\]\.args\.perod: unknown key \(known: "):
            CPUNormalization(HookInit(name="n", args={"perod": 1}, key_path="hooks[0].args"))
        with pytest.raises(ConfigError, match=r"^tasks\.metrics\.dbpath: unknown key \(known: "):
            parse_metrics({"dbpath": "/x"}, "tasks.metrics")


class TestDurations:
    @pytest.mark.parametrize(("raw", "seconds"), [(1.5, 1.5), (2, 2.0), ("500ms", 0.5), ("2s", 2.0), ("1m", 60.0),
                                                  (" 1h ", 3600.0)])
    def test_parses(self, raw: object, seconds: float) -> None:
        assert configvalues.parse_duration(raw, "k") == seconds

    @pytest.mark.parametrize(("raw", "message"), [
        ("soon", "must be a duration such as 1s or 500ms"), (True, "must be a duration such as 1s or 500ms"),
        (None, "must be a duration such as 1s or 500ms"), ("0s", "must be a duration > 0"),
        (-1, "must be a duration > 0"), (float("inf"), "must be a finite duration")])
    def test_refuses_naming_key_and_value(self, raw: object, message: str) -> None:
        with pytest.raises(ConfigError) as info:
            configvalues.parse_duration(raw, "tasks.metrics.intervals.psi")
        assert str(info.value) == f"tasks.metrics.intervals.psi: {message} (got {raw!r})"

    def test_a_task_and_a_collector_use_the_same_parser(self) -> None:
        from metrics.collect.registry import parse_collectors
        from metrics.settings import parse_metrics

        with pytest.raises(ConfigError, match=r"^tasks\.metrics\.gc_interval: must be a duration > 0 \(got '0s'\)"):
            parse_metrics({"gc_interval": "0s"}, "tasks.metrics")
        with pytest.raises(ConfigError, match=r"\.psi\.interval: must be a duration such as 1s or 500ms"):
            parse_collectors({"psi": {"interval": "fast"}}, "tasks.metrics.collectors")

    @pytest.mark.parametrize(("seconds", "shown"), [(0.5, "500ms"), (2, "2s"), (1.25, "1.25s"), ("x", "x")])
    def test_formats_as_the_config_writes_it(self, seconds: object, shown: str) -> None:
        assert configvalues.format_duration(seconds) == shown
