"""What the rest of the agent needs to know about the Kubernetes API client without
importing it: the kinds watched, the error taxonomy and the connection settings.
``metrics.informer.kubeclient`` (urllib3, the kubeconfig loader) is imported only when
``kube: true`` is configured.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from runtimeproxy.errors import KubeError as KubeError


class Kind(enum.Enum):
    NODE = "Node"
    NODESLO = "NodeSLO"
    NODEMETRIC = "NodeMetric"


class KubeUnavailable(KubeError):
    """No usable configuration, or the API server cannot be reached."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class KubeApiError(KubeError):
    """The API server answered with an error status."""

    def __init__(self, what: str, status: int, message: str) -> None:
        super().__init__(f"{what}: HTTP {status}: {message}")
        self.what = what
        self.status = status
        self.message = message


class EvictionRefused(KubeError):
    """The eviction was refused (429: a PodDisruptionBudget forbids it right now)."""


@dataclass(frozen=True, slots=True)
class KubeSettings:
    node_name: str
    #: A kubeconfig file; None with ``in_cluster=False`` tries in-cluster, then ~/.kube/config.
    kubeconfig: Path | None = None
    in_cluster: bool = False
    #: Client-side rate limit of non-watch calls (koordlet's --kube-api-qps is 20; one node needs few).
    qps: float = 5.0
    #: Per-request timeout in seconds (connect and read) of non-watch calls.
    timeout: float = 10.0
    #: Server-side duration of one watch call; the stream is re-opened after it.
    watch_seconds: int = 300
    backoff_initial: float = 1.0
    backoff_max: float = 30.0

    def __post_init__(self) -> None:
        if not self.node_name:
            raise ValueError("node name is empty")
        if self.kubeconfig is not None and self.in_cluster:
            raise ValueError("kubeconfig and in_cluster are exclusive")
        for name in ("qps", "timeout", "backoff_initial", "backoff_max"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)!r})")
        if self.watch_seconds < 1:
            raise ValueError(f"watch_seconds must be >= 1 (got {self.watch_seconds!r})")
