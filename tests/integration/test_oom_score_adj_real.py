"""oom-score-adj on a real containerd + runc pod through the real proxy.

The pod carries ``koordinator.sh/oom-score-adj-spec`` for its container: every
process of the container ends up with the value at PostStartContainer; a process
started in the container later (``ExecSync`` leaving a ``sleep`` behind, which runc
gives the container's original value) gets it at a reconcile pass: an object found in
place is looked at again within ``VERIFY_PASSES`` intervals (1 s here), so within ~6 s.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo.scenario import kubelet_creates_pod_cgroup
from runtimeproxy.state.reconcile import VERIFY_PASSES

INTERVAL = 1.0

SPEC = "koordinator.sh/oom-score-adj-spec"
VALUE = "777"


@pytest.fixture(scope="module")
def proxy_config() -> dict[str, Any]:
    hooks = [{"name": "oom-score-adj", "plugin": "oom-score-adj", "failure_policy": "Ignore"}]
    return {"hooks": hooks, "reconcile_interval": f"{INTERVAL:g}s"}


def _procs(path: Path) -> list[int]:
    return sorted(int(p) for p in path.read_text().split())


def _oom(pid: int) -> str:
    return Path(f"/proc/{pid}/oom_score_adj").read_text().strip()


def _wait(check: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return bool(check())


def test_container_processes_get_the_value_and_a_later_one_after_a_pass(proxy: Any, pods: Any) -> None:
    rt = proxy.runtime()
    pod = pods.sandbox("oom-adj", qos="burstable", annotations={SPEC: json.dumps({"app": int(VALUE)})})
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    sid = pods.run(rt, pod)
    cid = pods.create(rt, sid, pod, pods.container("app", command=("sh", "-c", "sleep 3600 & sleep 3600")))
    pods.start(rt, cid)
    procs = pods.pod_dir(pod, "cpu") / cid / "cgroup.procs"
    assert _wait(lambda: len(_procs(procs)) >= 2), procs.read_text()
    first = _procs(procs)
    assert _wait(lambda: all(_oom(p) == VALUE for p in _procs(procs))), {p: _oom(p) for p in _procs(procs)}

    # A process started in the container now: runc gives it the container's own value.
    reply = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", "sleep 3599 >/dev/null 2>&1 &"],
                                            timeout=10), timeout=30)
    assert reply.exit_code == 0, reply.stderr
    assert _wait(lambda: len(_procs(procs)) > len(first)), procs.read_text()
    later = [p for p in _procs(procs) if p not in first]
    assert later
    # Sized from the interval: a container found in place is skipped for VERIFY_PASSES passes.
    window = VERIFY_PASSES * INTERVAL + 10
    assert _wait(lambda: all(_oom(p) == VALUE for p in later), window), {p: _oom(p) for p in later}

    def repaired() -> list[str]:
        return [c for e in proxy.events("reconcile_repaired") for c in e["changes"]]

    # The pass logs its repair just after the write the wait above saw: wait for the line.
    assert _wait(lambda: any(c == f"oom-score-adj:host:/proc/{p}/oom_score_adj={VALUE}"
                             for p in later for c in repaired()), 10), repaired()
    failures = [e for e in proxy.events("hook_failed") if e.get("pod_name") == "oom-adj"]
    assert failures == [], failures
