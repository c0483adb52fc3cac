"""The agent's modules must not pull heavy libraries into the proxy unless configured."""

from __future__ import annotations

import subprocess
import sys


def test_kubernetes_and_bcc_are_not_imported_by_the_tasks_modules() -> None:
    code = ("import sys\nimport metrics.agent, metrics.qos.task, metrics.topcmd\n"
            "print(sorted(m for m in ('kubernetes', 'bcc', 'requests', 'pydantic') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_kube_client_does_not_import_the_official_client() -> None:
    """``kubernetes`` (its generated models, ~17 MiB of RSS) is no longer used at all."""
    code = ("import sys\nimport metrics.informer.kubeclient\n"
            "print(sorted(m for m in ('kubernetes', 'requests', 'google', 'oauthlib') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
