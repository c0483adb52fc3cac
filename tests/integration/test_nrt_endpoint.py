"""Issue 16 §1: the proxy serves this host's NodeResourceTopology on its loopback port
(``/apis/noderesourcetopology``) without a cluster, built from the real /sys, valid against
the shipped CRD schema, and explained in ``/debug/explain``."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

from tests.unit.metrics.crdschema import validate_nrt


def _get(port: int, path: str) -> tuple[int, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
        return int(resp.status), resp.read().decode()


def _numa_nodes() -> int:
    base = Path("/sys/devices/system/node")
    found = [p for p in base.iterdir() if re.fullmatch(r"node\d+", p.name)] if base.is_dir() else []
    return max(len(found), 1)


def test_the_proxy_serves_this_hosts_nrt(proxy_factory: Any, tmp_path: Path) -> None:
    proxy = proxy_factory.start(extra={"tasks": {"metrics": {
        "db": str(tmp_path / "metrics.db"), "node_name": "krpt-nrt-node", "schedlat_source": "off",
        "memlat_source": "off",
        "kubelet_cpu_manager_state": str(tmp_path / "cpu_manager_state"),
        "kubelet_config": str(tmp_path / "config.yaml"),
    }}})
    status, body = _get(proxy.metrics_port, "/apis/noderesourcetopology")
    assert status == 200, body[:2000]
    doc = json.loads(body)
    validate_nrt(doc)
    assert doc["metadata"]["name"] == "krpt-nrt-node"
    assert len(doc["zones"]) == _numa_nodes()
    detail = json.loads(doc["metadata"]["annotations"]["node.koordinator.sh/cpu-topology"])["detail"]
    online = Path("/sys/devices/system/cpu/online").read_text().strip()
    assert len(detail) >= 1 and online.startswith(str(detail[0]["id"]))
    status, body = _get(proxy.metrics_port, "/debug/explain")
    view = json.loads(body)["tasks"]["metrics"]["noderesourcetopology"]
    assert view["cluster"] is False and view["inputs"]["cpus"]
