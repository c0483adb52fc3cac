"""Issue 27 item 10 (its smallest safe form): one error root, the families under it, and
the duplicated classes and parsers made one."""

from __future__ import annotations

import pytest

import hooks.annotations
import hooks.resctrl
from metrics.collect import advisor, registry
from metrics.informer import kubeconfig, kubetypes
from metrics.store.tsdbquery import TSDBError
from runtimeproxy.backend import CallError
from runtimeproxy.config.configvalues import ConfigError
from runtimeproxy.hookapi import CriCallError, HookConfigError, HookError, KoordError


@pytest.mark.parametrize("family", [ConfigError, HookConfigError, HookError, CallError, CriCallError,
                                    kubetypes.KubeError, TSDBError, kubeconfig.ConfigError,
                                    hooks.annotations.AnnotationError])
def test_every_family_has_the_one_root(family: type[Exception]) -> None:
    assert issubclass(family, KoordError)


def test_the_twins_are_one_class_and_one_parser() -> None:
    assert hooks.resctrl.AnnotationError is hooks.annotations.AnnotationError
    assert issubclass(hooks.annotations.AnnotationError, ValueError), "callers catching ValueError still do"
    assert advisor.positive_duration is registry.positive_duration
    assert registry.positive_duration("500ms", "k") == 0.5
    with pytest.raises(HookConfigError, match=r"^tasks\.x\.interval: must be a duration"):
        registry.positive_duration("soon", "tasks.x.interval")
