"""core-sched against this machine's kernel: the real ``prctl(PR_SCHED_CORE)``.

This kernel has no core scheduling (prctl answers EINVAL). Detection must say so
once and the hook must touch nothing: checked on the bare boundary, and through
the real proxy in front of containerd with a BE pod under ``cpuPolicy: coreSched``
and ``schedIdle: 1`` (explain shows why nothing was applied; the v1 tier has no
cpu.idle, said once). On a kernel that does core scheduling the first test checks
instead that a real cookie is created and shared between two real processes.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from typing import Any

import pytest

from hooks.coreschedsys import CookieOps, LibcCoreSched, detect
from runtimeproxy.demo.scenario import kubelet_creates_pod_cgroup


@pytest.fixture(scope="module")
def proxy_config() -> dict[str, Any]:
    hooks = [{"name": "core-sched", "plugin": "core-sched", "failure_policy": "Ignore"}]
    rules = {"policies": {"cpuPolicy": "coreSched"},
             "resourceQOSStrategy": {"beClass": {"cpuQOS": {"enable": True, "schedIdle": 1}}}}
    return {"hooks": hooks, "rules": rules, "reconcile_interval": "1s"}


def test_detection_on_this_kernel() -> None:
    sys = LibcCoreSched()
    support = detect(sys)
    children = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    try:
        ops = CookieOps(sys)
        if not support.supported:
            assert "EINVAL" in support.detail or "ENODEV" in support.detail, support.detail
            assert all(ops.get(c.pid) is None for c in children)  # nothing readable, nothing to write
            return
        cookie = ops.create(children[0].pid)
        assert cookie != 0
        assert ops.assign(children[0].pid, [children[1].pid]) == []
        assert ops.get(children[1].pid) == cookie and sys.get(0) == 0  # this thread keeps the default
    finally:
        for child in children:
            child.kill()
            child.wait()


def _wait_for(read: Any, want: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    value = read()
    while value != want and time.monotonic() < deadline:
        time.sleep(0.1)
        value = read()
    return str(value)


def test_unsupported_kernel_through_the_proxy_touches_no_cookie(proxy: Any, pods: Any) -> None:
    if detect(LibcCoreSched()).supported:
        pytest.fail("this kernel does core scheduling: the test expects the EINVAL kernel of this machine")
    rt = proxy.runtime()
    pod = pods.sandbox("core-sched-be", qos="besteffort", labels={"koordinator.sh/qosClass": "BE"})
    kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
    idle = pods.pod_dir(pod, "cpu").parent / "cpu.idle"  # the (test prefix's) besteffort tier
    shares = idle.with_name("cpu.shares")
    if idle.read_text().strip() == "0":
        shares.write_text("2")  # kubelet's BestEffort tier weight
    doc = proxy.config()
    original = json.loads(json.dumps(doc))
    try:
        sid = pods.run(rt, pod)
        cid = pods.create(rt, sid, pod, pods.container("app"))
        pods.start(rt, cid)
        detected = proxy.wait_event("core_sched_detected", timeout=10)
        assert detected["supported"] is False and "EINVAL" in detected["detail"]
        # cpu.idle is a cgroup file this kernel has (>= 5.15, also on v1): schedIdle 1 makes the tier idle.
        assert _wait_for(lambda: idle.read_text().strip(), "1") == "1"
        time.sleep(2.5)  # two more reconcile passes
        assert len(proxy.events("core_sched_detected")) == 1
        explain = f"http://127.0.0.1:{proxy.metrics_port}/debug/explain?pod=krp-test/core-sched-be"
        with urllib.request.urlopen(explain, timeout=5) as resp:
            changes = [c for c in json.loads(resp.read())["changes"] if c["hook"] == "core-sched"]
        notes = [c for c in changes if c["new"] == "not applied"]
        assert len(notes) == 1 and "EINVAL" in notes[0]["reason"], changes
        assert {c["target"] for c in changes} == {notes[0]["target"], f"host:{idle}"}, changes  # nothing else
        failures = [e for e in proxy.events("hook_failed") if e.get("pod_name") == "core-sched-be"]
        assert failures == [], failures
        # The policy goes back to groupIdentity: a reload, a new hook, and the tier is reset.
        doc["rules"]["policies"]["cpuPolicy"] = "groupIdentity"
        proxy.write_config(doc)
        assert _wait_for(lambda: idle.read_text().strip(), "0") == "0"
        # The kernel reset the tier's weight to 1024 when cpu.idle went 1 -> 0: the hook
        # that cleared it wrote kubelet's 2 back in the same step (issue 28 item 5).
        assert _wait_for(lambda: shares.read_text().strip(), "2") == "2"
    finally:
        proxy.write_config(original)
        if idle.exists():
            idle.write_text("0")  # the tier is shared by the session's other tests
