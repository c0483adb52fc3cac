"""Post stages after a stop or a removal are level-triggered, and owed cleanup is found
from the host: the real proxy process in front of the fixture containerd.

* kill -9 of the proxy, then pods stopped and removed straight at containerd (as with
  the HAProxy plane, whose Stop/Remove calls never reach Python), then a start: every
  removed pod's Post stages ran exactly once (a recording hook), no ``koordlet-<uid>``
  resctrl group is left (a fixture resctrl tree under an injected ``host.resctrl_root``),
  explain and containerd agree; another restart runs nothing again.
* orphaned resctrl groups are removed at start and at every re-sync.
* a pod removed while the proxy runs gets its Post stages within the re-sync interval,
  through both data planes (HAProxy: the calls pass Python by; grpc: they go through it,
  and the re-sync must not run them a second time).

``KRP_LEVEL_PODS`` sets how many pods the kill -9 test removes (default below: pods with
no containers, created and removed in parallel; see docs/benchmarks.md for the timing);
``KRP_LEVEL_CONTAINERS=1`` gives each a running container, so each pod is 4 Stop/Remove
calls (``KRP_LEVEL_PODS=750``: issue 26's 3,000 calls with 750 shims, not 1,500).
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import pytest

from criapi import cri_v1_pb2 as cri

PODS: Final = int(os.environ.get("KRP_LEVEL_PODS", "500"))
WITH_CONTAINERS: Final = os.environ.get("KRP_LEVEL_CONTAINERS", "0") == "1"
WORKERS: Final = 8
RESYNC: Final = 1.0

#: Records every Post stage after a stop or a removal, one line each (O_APPEND: whole lines).
RECORDER_MODULE: Final = '''
import os


class Recorder:
    def __init__(self, init):
        self.path = init.args["path"]

    def _write(self, stage, uid, object_id):
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{stage} {uid} {object_id}\\n".encode())
        finally:
            os.close(fd)

    def post_stop_pod_sandbox(self, ctx):
        self._write(ctx.stage.value, ctx.pod.meta.uid, ctx.pod.id)

    def post_remove_pod_sandbox(self, ctx):
        self._write(ctx.stage.value, ctx.pod.meta.uid, ctx.pod.id)

    def post_stop_container(self, ctx):
        self._write(ctx.stage.value, ctx.pod.meta.uid, ctx.container.id)

    def post_remove_container(self, ctx):
        self._write(ctx.stage.value, ctx.pod.meta.uid, ctx.container.id)
'''


class Recorded:
    def __init__(self, path: Path) -> None:
        self.path = path

    def lines(self) -> list[tuple[str, str, str]]:
        if not self.path.exists():
            return []
        return [tuple(line.split(" ")) for line in self.path.read_text().splitlines()]  # type: ignore[misc]

    def counts(self) -> Counter[tuple[str, str, str]]:
        return Counter(self.lines())


def _wait(predicate: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def make_resctrl(root: Path) -> None:
    """A resctrl tree as the kernel shows it, enough for the hook (pod groups are empty
    directories here, so rmdir removes them as the kernel's would)."""
    (root / "info" / "L3").mkdir(parents=True)
    (root / "info" / "L3" / "cbm_mask").write_text("fff\n")
    (root / "info" / "L3" / "min_cbm_bits").write_text("1\n")
    (root / "schemata").write_text("L3:0=fff\n")
    (root / "tasks").write_text("1\n")


def pod_groups(root: Path) -> set[str]:
    return {p.name.removeprefix("koordlet-") for p in root.iterdir() if p.name.startswith("koordlet-")}


@pytest.fixture
def level(proxy_factory: Any) -> dict[str, Any]:
    """The recording hook, the resctrl hook on a fixture tree, a state dir kept across starts."""
    plugin_dir = proxy_factory.mkdtemp()
    (plugin_dir / "krp_recorder.py").write_text(RECORDER_MODULE)
    work = proxy_factory.mkdtemp()
    resctrl = work / "resctrl"
    make_resctrl(resctrl)
    record = work / "posts.log"
    hooks = [{"name": "recorder", "plugin": "krp_recorder:Recorder", "failure_policy": "Ignore",
              "args": {"path": str(record)}},
             {"name": "resctrl", "plugin": "resctrl", "failure_policy": "Ignore"}]
    # Debug: the re-syncs' own lines (store_resynced) are what the tests wait on.
    extra = {"state_dir": str(work / "state"), "host": {"resctrl_root": str(resctrl)},
             "resync_interval": f"{RESYNC}s", "reconcile_interval": "1h",
             "log": {"level": "debug", "format": "json"}}
    return {"hooks": hooks, "extra": extra, "pythonpath": [plugin_dir], "resctrl": resctrl,
            "record": Recorded(record)}


def _start(proxy_factory: Any, level: dict[str, Any], plane: str = "grpc") -> Any:
    return proxy_factory.start(level["hooks"], extra={**level["extra"], "data_plane": plane},
                               pythonpath=level["pythonpath"])


def _store_pods(proxy: Any) -> int:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{proxy.metrics_port}/debug/explain", timeout=5) as resp:
        return int(json.loads(resp.read())["store"]["pods"])


def _explain_status(proxy: Any, name: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(
                f"http://127.0.0.1:{proxy.metrics_port}/debug/explain?pod=krp-test/{name}", timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _remove_directly(direct: Any, sid: str, cid: str | None = None) -> None:
    if cid is not None:
        direct.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0), timeout=60)
        direct.RemoveContainer(cri.RemoveContainerRequest(container_id=cid), timeout=60)
    direct.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=60)
    direct.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=60)


def _removed_stages(uid: str, sid: str, cid: str | None = None) -> set[tuple[str, str, str]]:
    own = {("PostStopContainer", uid, cid), ("PostRemoveContainer", uid, cid)} if cid is not None else set()
    return {("PostStopPodSandbox", uid, sid), ("PostRemovePodSandbox", uid, sid), *own}


def _run_pod(rt: Any, pods: Any, config: Any) -> tuple[str, str | None]:
    sid = pods.run(rt, config)
    if not WITH_CONTAINERS:
        return sid, None
    cid = pods.create(rt, sid, config, pods.container("app", command=["sleep", "3600"]))
    pods.start(rt, cid)
    return sid, cid


def test_pods_removed_while_the_proxy_was_killed_get_their_post_stages_once_at_start(
    proxy_factory: Any, level: dict[str, Any], pods: Any, direct_runtime: Any
) -> None:
    """kill -9, then PODS pods (no containers unless KRP_LEVEL_CONTAINERS=1) stopped and
    removed straight at containerd, plus one pod with a container: at the next start each gets PostStop and PostRemove
    exactly once, its resctrl group is gone, explain and containerd agree; a second
    restart (after a kill -9 again) runs none of them again."""
    proxy = _start(proxy_factory, level)
    rt = proxy.runtime()
    configs = [pods.sandbox(f"lv-{i}") for i in range(PODS)]
    begin = time.monotonic()
    with ThreadPoolExecutor(WORKERS) as pool:
        made = list(pool.map(lambda c: _run_pod(rt, pods, c), configs))
    created = time.monotonic() - begin
    uids = [c.metadata.uid for c in configs]
    big = pods.sandbox("lv-big")
    big_sid = pods.run(rt, big)
    big_cid = pods.create(rt, big_sid, big, pods.container("app", command=["sleep", "3600"]))
    pods.start(rt, big_cid)
    for uid in [*uids, big.metadata.uid]:  # what PostStartContainer of a resctrl pod leaves
        (level["resctrl"] / f"koordlet-{uid}").mkdir()
    ledger = Path(level["extra"]["state_dir"]) / "objects.json"
    _wait(lambda: ledger.exists() and big_cid in ledger.read_text(), "the ledger to hold every object", 10)

    proxy.send(signal.SIGKILL)
    assert proxy.wait_exit() == -9
    begin = time.monotonic()
    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(lambda m: _remove_directly(direct_runtime, *m), made))
    direct_runtime.StopContainer(cri.StopContainerRequest(container_id=big_cid, timeout=0), timeout=30)
    direct_runtime.RemoveContainer(cri.RemoveContainerRequest(container_id=big_cid), timeout=30)
    _remove_directly(direct_runtime, big_sid)
    removed = time.monotonic() - begin
    assert level["record"].lines() == []

    begin = time.monotonic()
    proxy = _start(proxy_factory, level)
    rebuilt = proxy.wait_event("store_rebuilt", timeout=60)
    assert rebuilt["owed_post_stages"] == (4 if WITH_CONTAINERS else 2) * PODS + 4
    want = set().union(*(_removed_stages(u, *m) for u, m in zip(uids, made, strict=True)),
                       _removed_stages(big.metadata.uid, big_sid),
                       {("PostStopContainer", big.metadata.uid, big_cid),
                        ("PostRemoveContainer", big.metadata.uid, big_cid)})
    _wait(lambda: len(level["record"].lines()) >= len(want), "every owed Post stage", 120)
    settled = time.monotonic() - begin
    counts = level["record"].counts()
    assert set(counts) == want and set(counts.values()) == {1}
    # The container's stages ran before its pod's.
    order = [line[0] for line in level["record"].lines() if line[1] == big.metadata.uid]
    assert order.index("PostRemoveContainer") < order.index("PostStopPodSandbox")
    assert not pod_groups(level["resctrl"]) & {*uids, big.metadata.uid}
    listed = direct_runtime.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=30).items
    assert _store_pods(proxy) == len(listed)
    assert _explain_status(proxy, "lv-0") == 404 and _explain_status(proxy, "lv-big") == 404
    calls = (4 if WITH_CONTAINERS else 2) * PODS + 4
    print(f"\n{PODS} pods ({calls} Stop/Remove calls): created through the proxy in {created:.1f}s, "
          f"removed at containerd in {removed:.1f}s, "
          f"all Post stages ran {settled:.1f}s after the start")

    gone = {*(i for m in made for i in m if i is not None), big_sid, big_cid}
    _wait(lambda: not gone & set(json.loads(ledger.read_text())["objects"]), "every done mark on disk", 10)
    proxy.send(signal.SIGKILL)
    assert proxy.wait_exit() == -9
    proxy = _start(proxy_factory, level)
    assert proxy.wait_event("store_rebuilt", timeout=60)["owed_post_stages"] == 0
    proxy.wait_event("store_resynced", timeout=5 * RESYNC + 5, count=2)  # and the re-syncs after it
    assert level["record"].counts() == counts


def test_orphaned_resctrl_groups_go_at_start_and_at_every_resync(
    proxy_factory: Any, level: dict[str, Any], pods: Any
) -> None:
    """A ``koordlet-<uid>`` group no pod has (removed before any ledger knew it): gone at
    start; one made while the proxy runs: gone at the next re-sync. A live pod's stays."""
    gone = str(uuid.uuid4())
    (level["resctrl"] / f"koordlet-{gone}").mkdir()
    proxy = _start(proxy_factory, level)
    first = proxy.wait_event("orphans_removed", timeout=10)
    assert first["hook"] == "resctrl" and gone in first["removed"][0]
    assert gone not in pod_groups(level["resctrl"])

    live = pods.sandbox("lv-live")
    pods.run(proxy.runtime(), live)
    (level["resctrl"] / f"koordlet-{live.metadata.uid}").mkdir()
    later = str(uuid.uuid4())
    (level["resctrl"] / f"koordlet-{later}").mkdir()
    made = time.monotonic()
    second = proxy.wait_event("orphans_removed", timeout=5 * RESYNC + 5, count=2)
    assert later in second["removed"][0] and len(second["removed"]) == 1
    assert time.monotonic() - made < 2 * RESYNC + 5  # a re-sync interval, on a loaded host
    assert pod_groups(level["resctrl"]) == {live.metadata.uid}


@pytest.mark.parametrize("plane", ["haproxy", "grpc"])
def test_a_pod_removed_while_the_proxy_runs_is_cleaned_up_within_the_resync_interval(
    proxy_factory: Any, level: dict[str, Any], pods: Any, plane: str, request: pytest.FixtureRequest
) -> None:
    """kubelet's Stop/Remove calls through the proxy: with HAProxy they pass Python by and
    the re-sync finds the transitions; with the grpc plane they reach Python, whose Post
    stage runs on the call and is not run again by the re-sync."""
    if plane == "haproxy":
        request.getfixturevalue("haproxy_data_plane")
    proxy = _start(proxy_factory, level, plane)
    rt = proxy.runtime()
    config = pods.sandbox("lv-prompt")
    sid = pods.run(rt, config)
    cid = pods.create(rt, sid, config, pods.container("app", command=["sleep", "3600"]))
    pods.start(rt, cid)
    uid = config.metadata.uid
    (level["resctrl"] / f"koordlet-{uid}").mkdir()
    rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0), timeout=30)
    rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid), timeout=30)
    rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=60)
    rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=60)
    removed = time.monotonic()
    want = _removed_stages(uid, sid) | {("PostStopContainer", uid, cid), ("PostRemoveContainer", uid, cid)}
    _wait(lambda: set(level["record"].lines()) == want and uid not in pod_groups(level["resctrl"]),
          "the removed pod's Post stages and its resctrl group's removal", 2 * RESYNC + 5)
    took = time.monotonic() - removed
    # Two more re-syncs see the same state: nothing runs twice.
    resyncs = len(proxy.events("store_resynced"))
    proxy.wait_event("store_resynced", timeout=5 * RESYNC + 5, count=resyncs + 2)
    assert set(level["record"].counts().values()) == {1}
    print(f"\n{plane}: removed pod's Post stages done {took:.2f}s after RemovePodSandbox (re-sync every {RESYNC}s)")



def test_with_containerds_events_a_removed_pod_is_cleaned_up_within_a_second(
    proxy_factory: Any, level: dict[str, Any], pods: Any, direct_runtime: Any
) -> None:
    """The periodic re-sync an hour away: containerd's event stream alone prompts the
    re-sync that finds the removal (straight at containerd, nothing through the proxy)."""
    proxy = proxy_factory.start(level["hooks"], extra={**level["extra"], "resync_interval": "1h",
                                                       "data_plane": "grpc"},
                                pythonpath=level["pythonpath"])
    took = []
    for i in range(3):  # the first event after the subscription, then steady state
        config = pods.sandbox(f"lv-event-{i}")
        sid, uid = pods.run(proxy.runtime(), config), config.metadata.uid
        (level["resctrl"] / f"koordlet-{uid}").mkdir()
        start = time.monotonic()
        _remove_directly(direct_runtime, sid)
        _wait(lambda u=uid, s=sid: _removed_stages(u, s) <= set(level["record"].lines())
              and u not in pod_groups(level["resctrl"]), "the removed pod's Post stages", 10)
        took.append(time.monotonic() - start)
    assert proxy.events("store_resynced", reason="event")
    assert min(took) < 1.0, took  # the target; on a loaded host single runs may take longer
    assert set(level["record"].counts().values()) == {1}
    print(f"\nevent stream: removed pod's Post stages done {', '.join(f'{t:.2f}' for t in took)}s after the removal")
