"""Issue 28 items 4, 5 and 6 end to end ("How it is shown"): the real proxy (the shipped
hooks and rules, metrics with ``kube: true``, qos-manager with no ``evict_mode``) in front
of the fixture containerd, a NodeSLO served by the test API server (``tests/kubeapi.py``,
which validates each NodeSLO against the real CRD), real BE pods on real cgroup v1 under
this run's unique ``/koord-test-<id>/kubepods``. Over time, on the cgroup files and the
API server's requests:

* identity off (item 5): a NodeSLO turning BE group identity off clears the BE pods'
  ``cpu.idle`` and gives back the weight the kernel reset to 1024 in the same step:
  kubelet's 2 for a plain BestEffort pod, batch-resource's 512 for a batch pod;
* a bad NodeSLO (item 6): one field the agent refuses: a ``NodeSLORejected`` Event, and
  the last good NodeSLO stays in force (BE pods stay at ``cpu.idle`` 0 for several
  reconcile passes) and in ``explain``; persisted (0600) in ``state_dir``, so a restart
  while the cluster's NodeSLO is still bad keeps it too;
* a policy switch (item 4): a NodeSLO enabling BE memory eviction (threshold 1 %): with
  ``kube: true`` and no ``evict_mode`` the pod is evicted through the Eviction API (the
  pod object goes, with an ``evictPodSuccess`` Event), not stopped through the CRI.

The second phase (its own proxy, the same API server fixture) is items 7 and 8 under an
LS load, on the same cgroup files and the agent's log and ``/metrics``:

* no flaps (item 7): an LS pod bursting one CPU (pinned) for 200 ms every second, two
  hungry BE pods, cfsQuota suppression at 100 % with all CPUs but half a core reserved
  (so the others' work on a shared host counts as the reservation while LS bursts): the
  fast path drops the BE tier to the floor on each burst, and the 1 s loop, whose store
  samples are older than the drop, must not raise it back between bursts. Over ten loop
  intervals the tier's ``cpu.cfs_quota_us`` is written at most ``MAX_TIER_WRITES`` times,
  counted from the agent's own ``qos_write`` log lines (every write) and, as a check, from
  the file sampled every 5 ms;
* suppression off (item 8): a NodeSLO turning cfsQuota suppression off while the tier is
  at the floor: the tier is released (-1) and every BE pod's and container's quota is back
  at its full value (batch-resource's 100000, the container's own 50000), with no write
  refused (no ``EINVAL`` in ``koord_runtime_proxy_host_write_failures_total``, no
  ``hook_failed``/``reconcile_failed``/``qos_write_failed`` line).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo.scenario import DEFAULT_CONFIG, kubelet_creates_pod_cgroup
from tests import tmpnames
from tests.integration.conftest import http_get
from tests.kubeapi import KubeApiServer
from tests.unit.metrics.kubehelpers import kubeconfig

NODE = "krp-colo-node"
NS = "krp-test"
SPEC = "node.koordinator.sh/extended-resource-spec"
WORK = tmpnames.unique("colo")
IDENTITY_OFF = {"resourceQOSStrategy": {"beClass": {"cpuQOS": {"enable": True, "groupIdentity": 0}}}}
#: The CRD allows each value; the agent refuses a minimum above the threshold.
BAD = {**IDENTITY_OFF, "resourceUsedThresholdWithBE": {
    "enable": True, "cpuSuppressThresholdPercent": 50, "cpuSuppressMinPercent": 60}}
EVICT = {**IDENTITY_OFF, "resourceUsedThresholdWithBE": {
    "enable": True, "memoryEvictThresholdPercent": 1, "memoryEvictLowerPercent": 0}}


@pytest.fixture
def api() -> Iterator[KubeApiServer]:
    server = KubeApiServer()
    server.put("nodes", {"metadata": {"name": NODE}, "status": {
        "capacity": {"cpu": "2", "memory": "4Gi"}, "allocatable": {"cpu": "2", "memory": "4Gi"}}})
    server.put("nodeslos", {"metadata": {"name": NODE}, "spec": {}})
    yield server
    server.close()


@pytest.fixture
def work() -> Iterator[Path]:
    WORK.mkdir(mode=0o700)
    yield WORK
    shutil.rmtree(WORK, ignore_errors=True)


def _config(api: KubeApiServer, work: Path, prefix: str, state_dir: Path) -> dict[str, Any]:
    shipped = yaml.safe_load(DEFAULT_CONFIG.read_text())
    return {
        "hooks": shipped["hooks"], "rules": shipped["rules"], "reconcile_interval": "1s",
        "state_dir": str(state_dir),
        "tasks": {
            "metrics": {"db": str(work / "m.db"), "schedlat_source": "off", "cpi": False, "memlat_source": "off",
                        "kube": True, "kubeconfig": str(kubeconfig(work, api.url)), "node_name": NODE,
                        "besteffort_dir": f"{prefix.strip('/')}/kubepods/besteffort",
                        "kubelet_cpu_manager_state": str(work / "cpu_manager_state"),
                        "kubelet_config": str(work / "kubelet-config.yaml")},
            "qos-manager": {},  # no evict_mode: api, since metrics has a cluster
        },
    }


def _wait_for(what: str, check: Callable[[], Any], timeout: float, poll: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _hold(what: str, check: Callable[[], bool], seconds: float, poll: float = 0.05) -> None:
    """``check`` true at every poll for ``seconds`` (a reconcile interval is 1 s)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert check(), f"{what} no longer holds"
        time.sleep(poll)


def test_identity_off_a_bad_nodeslo_a_restart_and_a_policy_switch(
    api: KubeApiServer, work: Path, proxy_factory: Any, pods: Any, cgroup_prefix: str
) -> None:
    state_dir = work / "state"
    config = _config(api, work, cgroup_prefix, state_dir)
    extra = {k: v for k, v in config.items() if k != "hooks"}
    proxy = proxy_factory.start(config["hooks"], extra=extra)
    rt = proxy.runtime()

    # --- BE pods as kubelet starts them (pod cgroup, cpu.shares 2), known to the API server ---
    batch = {"containers": {"app": {"requests": {"kubernetes.io/batch-cpu": "500", "kubernetes.io/batch-memory":
                                                 str(64 << 20)}, "limits": {"kubernetes.io/batch-cpu": "1000"}}}}
    made = {}
    for name, notes in (("plain-be", {}), ("batch-be", {SPEC: json.dumps(batch)})):
        uid = str(uuid.uuid4())
        pod = pods.sandbox(name, qos="besteffort", uid=uid, labels={"koordinator.sh/qosClass": "BE"},
                           annotations=notes)
        kubelet_creates_pod_cgroup(pod.linux.cgroup_parent)
        (pods.pod_dir(pod, "cpu") / "cpu.shares").write_text("2")
        api.put("pods", {"metadata": {"name": name, "namespace": NS, "uid": uid}, "spec": {"nodeName": NODE}})
        sid = pods.run(rt, pod)
        pods.start(rt, pods.create(rt, sid, pod, pods.container("app")))
        made[name] = (pod, sid)
    idle = {n: pods.pod_dir(p, "cpu") / "cpu.idle" for n, (p, _) in made.items()}
    shares = {n: pods.pod_dir(p, "cpu") / "cpu.shares" for n, (p, _) in made.items()}

    def values(name: str) -> tuple[str, str]:
        return idle[name].read_text().strip(), shares[name].read_text().strip()

    for name in made:  # the shipped YAML: BE group identity -1, an idle group
        _wait_for(f"{name} cpu.idle 1", lambda name=name: values(name)[0] == "1", timeout=10)

    # --- identity off: cpu.idle 0 and the weight back in the same step (item 5) ---
    repaired = len(proxy.events("reconcile_repaired"))
    api.put("nodeslos", {"metadata": {"name": NODE}, "spec": IDENTITY_OFF})
    want = {"plain-be": "2", "batch-be": "512"}
    seen: dict[str, list[tuple[str, str]]] = {n: [] for n in made}

    def settled() -> bool:
        for name in made:
            seen[name].append(values(name))
        return all(seen[n][-1] == ("0", want[n]) for n in made)

    _wait_for("BE pods at cpu.idle 0 with their weights", settled, timeout=30, poll=0.02)
    for name in made:  # never left at the kernel's 1024: at most one sample between the two writes
        reset = [i for i, v in enumerate(seen[name]) if v == ("0", "1024")]
        assert len(reset) <= 1, seen[name]

    def restored_by_group_identity() -> bool:  # the log line follows the writes
        changes = [c for e in proxy.events("reconcile_repaired")[repaired:] for c in e["changes"]]
        return all(f"group-identity:host:{shares[n]}={want[n]}" in changes for n in made)

    _wait_for("group-identity's weight writes in the log", restored_by_group_identity, timeout=10)

    # --- a bad NodeSLO: rejected, reported, the last good one stays (item 6) ---
    api.put("nodeslos", {"metadata": {"name": NODE}, "spec": BAD})
    event = _wait_for("a NodeSLORejected event", lambda: [
        e for e in api.objects("events") if e.get("reason") == "NodeSLORejected"], timeout=30)[0]
    _hold("BE pods at cpu.idle 0 under the bad NodeSLO",
          lambda: all(values(n) == ("0", want[n]) for n in made), seconds=3.5)
    assert "cpuSuppressMinPercent" in event["message"] and "last good NodeSLO" in event["message"], event
    code, body = http_get(proxy.metrics_port, "/debug/explain")
    nodeslo = json.loads(body)["tasks"]["metrics"]["nodeslo"]
    assert code == 200 and nodeslo["in_force"] == "NodeSLO" and nodeslo["rejected"]["applied"] == "last good NodeSLO"
    saved = state_dir / "nodeslo-last-good.json"
    assert stat.S_IMODE(os.stat(saved).st_mode) == 0o600 and json.loads(saved.read_text()) == IDENTITY_OFF

    # --- a restart while the cluster's NodeSLO is still bad: the persisted one applies ---
    assert proxy.terminate() == 0
    again = proxy_factory.start(config["hooks"], extra=extra)
    again.wait_event("nodeslo_last_good_restored", timeout=10)
    again.wait_event("nodeslo_rejected", timeout=30)
    _hold("BE pods at cpu.idle 0 after the restart", lambda: all(values(n) == ("0", want[n]) for n in made),
          seconds=3.5)

    # --- a policy switch to BE memory eviction: through the Eviction API (item 4) ---
    assert again.events("evict_mode", mode="api")
    evictions = len([r for r in api.requests if r.path.endswith("/eviction")])
    api.put("nodeslos", {"metadata": {"name": NODE}, "spec": EVICT})
    posted = _wait_for("an eviction POST", lambda: [
        r for r in api.requests if r.method == "POST" and r.path.endswith("/eviction")][evictions:], timeout=30)
    victim = posted[0].path.split("/")[-2]
    assert victim in made and api.get("pods", victim, NS) is None  # the pod object was evicted
    _wait_for("an evictPodSuccess event", lambda: [
        e for e in api.objects("events") if e.get("reason") == "evictPodSuccess"
        and e["involvedObject"]["name"] == victim], timeout=10)
    sid = made[victim][1]
    state = again.runtime().PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=sid), timeout=10).status.state
    assert state == cri.SANDBOX_READY  # evicted through the API, not stopped through the CRI
    assert not again.events("pod_eviction_failed")


# --- items 7 and 8: an LS load, cfsQuota suppression, and suppression switched off ---------

CGROUP = Path("/sys/fs/cgroup")
SPIN = ("sh", "-c", "while :; do :; done")
#: One CPU's worth for 200 ms every second: steady on the loop's 1 s scale, a burst to the
#: 100 ms fast path (the shape of issue 28 item 7's node, whose usage barely moved).
BURST = ("sh", "-c", "while :; do (while :; do :; done) & p=$!; sleep 0.2; kill $p; sleep 0.8; done")
#: At 100 % with all CPUs but half a core reserved, BE's room is half a core less LS's use
#: whatever else the host runs (the system share is max(measured, reserved)): a burst
#: takes it to the floor, the loop's 1 s averages (LS 0.2 core) say 0.3 core. Without the
#: reservation, a host the other sessions fill leaves BE no room to grow and nothing
#: could flap, before the fix or after it.
CFS_QUOTA = {"resourceUsedThresholdWithBE": {"enable": True, "cpuSuppressThresholdPercent": 100,
                                             "cpuSuppressPolicy": "cfsQuota"}}
OFF = {"resourceUsedThresholdWithBE": {"enable": False}}
RESERVED_CPU = (os.cpu_count() or 1) - 0.5
LOOP = 1.0  # tasks.qos-manager.interval (and the collectors' 1 s): the flap window is sized from it
FLOOR = 2000  # metrics.qos.suppress.MIN_QUOTA
BATCH_QUOTA, OWN_QUOTA = 100_000, 50_000  # batch-cpu limit 1000; the container's own limit (half a core)
#: Tier writes allowed over ``WINDOW_LOOPS`` loop intervals while the bursts go on: the
#: first drop to the floor may fall inside, and a burst the host delayed past the hold
#: (2 collect intervals) lets one step up and back down. Before the fix (106bd60) each
#: burst dropped the tier and the next loop round raised it: ~2 writes a second.
WINDOW_LOOPS = 10
MAX_TIER_WRITES = 4


def _q(path: Path) -> int:
    return int((path / "cpu.cfs_quota_us").read_text())


def _tier_writes(events: list[dict[str, Any]], tier: str, before: int) -> list[Any]:
    """The values the agent wrote to the tier's ``cpu.cfs_quota_us`` that moved it, from its
    ``qos_write`` lines (one per write that changed a file: a plain set, or a leveled write
    whose tier level may be the value in place while a child moved)."""
    target = f"{tier}:cpu.cfs_quota_us"
    out, last = [], before
    for e in events:
        items = [e] if e.get("kind") == "set" else [i for lv in e.get("levels", []) for i in lv]
        for value in (int(i["value"]) for i in items if i.get("target") == target):
            if value != last:
                out.append(value)
            last = value
    return out


def _metric(port: int, name: str, **labels: str) -> float:
    code, body = http_get(port, "/metrics", timeout=30)  # a host at load 700 was seen to take > 2 s
    assert code == 200, code
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name) and (not want or want in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def priority(cgroup_prefix: str) -> Iterator[None]:
    """This run's cgroup parent at the most ``cpu.shares`` for the phase: the LS bursts and
    the BE pods get their CPU on a host other sessions keep busy (the old weight after)."""
    top = CGROUP / "cpu" / cgroup_prefix.strip("/")
    top.mkdir(parents=True, exist_ok=True)
    before = (top / "cpu.shares").read_text().strip()
    (top / "cpu.shares").write_text("262144")
    try:
        yield
    finally:
        (top / "cpu.shares").write_text(before)


def test_ls_bursts_do_not_flap_the_be_tier_and_suppression_off_releases_it(
    api: KubeApiServer, work: Path, proxy_factory: Any, pods: Any, cgroup_prefix: str, priority: None
) -> None:
    config = _config(api, work, cgroup_prefix, work / "state")
    config["tasks"]["qos-manager"] = {"interval": f"{LOOP:g}s", "reserved_cpu": RESERVED_CPU}
    proxy = proxy_factory.start(config["hooks"], extra={k: v for k, v in config.items() if k != "hooks"})
    rt = proxy.runtime()
    tier_rel = f"{cgroup_prefix.strip('/')}/kubepods/besteffort"
    tier = CGROUP / "cpu" / tier_rel

    def pod(name: str, qos: Any, labels: dict[str, str], notes: dict[str, str]) -> tuple[Any, str]:
        uid = str(uuid.uuid4())
        made = pods.sandbox(name, qos=qos, uid=uid, labels=labels, annotations=notes)
        kubelet_creates_pod_cgroup(made.linux.cgroup_parent)
        api.put("pods", {"metadata": {"name": name, "namespace": NS, "uid": uid}, "spec": {"nodeName": NODE}})
        return made, pods.run(rt, made)

    def container(sid: str, made: Any, name: str, command: tuple[str, ...], **res: Any) -> str:
        cid: str = pods.create(rt, sid, made, pods.container(name, command=command,
                                                             resources=cri.LinuxContainerResources(**res)))
        pods.start(rt, cid)
        return cid

    be = {"koordinator.sh/qosClass": "BE"}
    batch = {"containers": {"be": {"requests": {"kubernetes.io/batch-cpu": "500"},
                                   "limits": {"kubernetes.io/batch-cpu": "1000"}}}}
    batch_pod, batch_sid = pod("batch-be", "besteffort", be, {SPEC: json.dumps(batch)})
    batch_cid = container(batch_sid, batch_pod, "be", SPIN)
    batch_dir = CGROUP / "cpu" / batch_pod.linux.cgroup_parent.strip("/")
    own_pod, own_sid = pod("own-be", "besteffort", be, {})
    own_ctr = CGROUP / "cpu" / own_pod.linux.cgroup_parent.strip("/") / container(
        own_sid, own_pod, "own", SPIN, cpu_period=100_000, cpu_quota=OWN_QUOTA)
    ls_pod, ls_sid = pod("ls-online", "burstable", {"koordinator.sh/qosClass": "LS"}, {})
    pinned = ("taskset", "-c", str((os.cpu_count() or 1) - 1), *BURST)
    ls_ctr = CGROUP / "cpuacct" / ls_pod.linux.cgroup_parent.strip("/") / container(
        ls_sid, ls_pod, "burst", pinned, cpu_shares=10240)
    assert (_q(batch_dir), _q(batch_dir / batch_cid), _q(own_ctr)) == (BATCH_QUOTA, BATCH_QUOTA, OWN_QUOTA)

    # --- cfsQuota suppression under the bursts: the tier at the floor, and kept there (item 7) ---
    api.put("nodeslos", {"metadata": {"name": NODE}, "spec": CFS_QUOTA})
    _wait_for("batch-resource to lift the batch pod's quotas (cfsQuota policy)",
              lambda: _q(batch_dir) == -1 and _q(batch_dir / batch_cid) == -1, timeout=30)
    _wait_for("an LS burst to drop the BE tier to the floor",
              lambda: FLOOR in _tier_writes(proxy.events("qos_write"), tier_rel, -1), timeout=30)
    _wait_for("the tier at the floor", lambda: _q(tier) == FLOOR, timeout=10 * LOOP, poll=0.005)
    seen = len(proxy.events("qos_write"))
    ls_before = int((ls_ctr / "cpuacct.usage").read_text())
    samples: list[int] = []
    end = time.monotonic() + WINDOW_LOOPS * LOOP
    while time.monotonic() < end:
        samples.append(_q(tier))
        time.sleep(0.005)
    ls_cpu = (int((ls_ctr / "cpuacct.usage").read_text()) - ls_before) / 1e9
    writes = _tier_writes(proxy.events("qos_write")[seen:], tier_rel, FLOOR)
    changes = [b for a, b in itertools.pairwise(samples) if b != a]
    detail = json.dumps({"writes": writes, "file_changes": changes, "ls_cpu_seconds": round(ls_cpu, 2),
                         "replans": len(proxy.events("suppress_replanned"))})
    # The load really was there: LS used a good part of its 200 ms a second (pinned, at
    # the highest weight): otherwise nothing here could flap and the count proves nothing.
    assert ls_cpu >= 0.25 * 0.2 * WINDOW_LOOPS * LOOP, detail
    assert len(writes) <= MAX_TIER_WRITES, f"the BE tier flapped: {detail}"
    assert len(changes) <= len(writes) + 1, detail  # the log misses no write (the +1: a write just before)

    # --- suppression off while the tier is at the floor: tier first, then the children (item 8) ---
    api.put("nodeslos", {"metadata": {"name": NODE}, "spec": OFF})
    try:
        _wait_for("the tier released and every BE quota back at its full value", lambda: (
            _q(tier), _q(batch_dir), _q(batch_dir / batch_cid), _q(own_ctr)) == (-1, BATCH_QUOTA, BATCH_QUOTA,
                                                                                  OWN_QUOTA), timeout=60)
    except AssertionError as exc:
        own_rel = str(own_ctr.relative_to(CGROUP / "cpu"))
        now = {"tier": _q(tier), "batch": _q(batch_dir), "batch_ctr": _q(batch_dir / batch_cid),
               "own": _q(own_ctr), "failed": proxy.events("hook_failed")[-3:],
               "write_failed": proxy.events("qos_write_failed")[-3:],
               "own_writes": [e for e in proxy.events("qos_write") if own_rel in json.dumps(e)][-6:]}
        raise AssertionError(f"{exc}: {json.dumps(now, default=str)[:8000]}") from None
    _hold("the full quotas", lambda: (_q(tier), _q(batch_dir / batch_cid), _q(own_ctr)) == (
        -1, BATCH_QUOTA, OWN_QUOTA), seconds=2 * LOOP + 0.5)
    einval = _metric(proxy.metrics_port, "koord_runtime_proxy_host_write_failures_total", cause="EINVAL")
    refused = [e for name in ("hook_failed", "reconcile_failed", "qos_write_failed") for e in proxy.events(name)
               if "cfs_quota" in json.dumps(e)]  # a quota write refused (another hook may not apply on a host)
    assert einval == 0 and not refused, json.dumps({"einval": einval, "refused": refused[:4]}, default=str)[:4000]
    print(f"\nitem 7 window ({WINDOW_LOOPS * LOOP:g} s): {detail}; item 8: released, no write refused")
