"""A kubeconfig for the local test API server (``tests.kubeapi``), shared by the API client tests."""

from __future__ import annotations

import json
from pathlib import Path


def kubeconfig(directory: Path, server: str) -> Path:
    """A kubeconfig in ``directory`` with a token for ``server``."""
    path = directory / "kubeconfig"
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "agent", "user": {"token": "test-token"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "agent"}}],
    }))
    return path
