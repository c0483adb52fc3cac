"""Typed handles on what the metrics family's tasks hand each other.

The metrics task provides its agent (``TaskInit.provide``); a task built on it declares
``needs = ("metrics",)`` and reads it here, as an ``AgentHandle``: the few views it may
use, typed, without importing ``metrics.agent`` (an import-linter contract keeps
``metrics.qos`` and ``metrics.analysis`` off it). The core builds the metrics task
first whatever the order under ``tasks:``; in the validate pass the same name carries
the validated ``MetricsSettings``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, Protocol, runtime_checkable

from hooks.rules import Rules
from metrics.collect.topology import TopologyCollector
from metrics.informer.states import StatesInformer
from metrics.model import PodView
from metrics.report.events import EventRecorder
from metrics.settings import METRICS_TASK, MetricsSettings
from metrics.store.tsdb import TSDB
from runtimeproxy.hookapi import HookConfigError, TaskInit

if TYPE_CHECKING:  # the API client: imported only when configured
    from metrics.informer.kubeclient import KubeClient

#: The interference analyser's name under ``tasks:``.
INTERFERENCE: Final = "interference"


@runtime_checkable
class AgentHandle(Protocol):
    """What a task built on the metrics agent may use of it."""

    @property
    def settings(self) -> MetricsSettings: ...
    @property
    def tsdb(self) -> TSDB: ...
    @property
    def topology(self) -> TopologyCollector: ...
    @property
    def events(self) -> EventRecorder: ...
    @property
    def informer(self) -> StatesInformer | None: ...
    @property
    def kube(self) -> KubeClient | None: ...
    def pods(self) -> list[PodView]: ...
    def rules(self) -> Rules: ...


def metrics_agent(init: TaskInit) -> AgentHandle:
    """The metrics agent of a task that declared ``needs = ("metrics",)``; a config
    error naming the task when there is none."""
    found = init.needed.get(METRICS_TASK)
    if not isinstance(found, AgentHandle):
        raise HookConfigError(init.key_path, init.name, f"needs the metrics task: enable tasks.{METRICS_TASK}")
    return found
