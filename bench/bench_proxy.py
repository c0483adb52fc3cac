"""Benchmark: what the proxy adds over talking to containerd directly.

Run by hand as root (not part of the test suite): ``.venv/bin/python bench/bench_proxy.py``.
In one run, against one private containerd with ``--idle-pods`` running pods, it measures
  * pass-through latency (Version, ListContainers, ListPodSandbox, ContainerStatus,
    ImageStatus) on four paths: direct, an asyncio byte relay (bench/byterelay.py, the
    floor), the proxy with ``data_plane: grpc`` and with ``data_plane: haproxy``,
    interleaved call by call with the path order shuffled every round;
  * CPU per pass-through call of each path's processes (proxy + haproxy master and
    worker, from /proc), idle CPU and RSS, and % of a core at 10 and 50 calls/s;
  * the pod lifecycle time (Run, Create, Start, Stop, Remove) direct vs both data planes
    with the hook chain on, as a ratio of medians, and per CRI call, with the proxy's CPU
    per lifecycle; the path order shuffled every round and ``--settle`` seconds of idle
    before each lifecycle (kubelet's lifecycle calls come after idle, when the proxy's
    caches and threads are cold; ``--settle 0`` measures back-to-back lifecycles);
    ``--lifecycle-only`` skips the other phases;
  * a fifth path, "haproxy-bare": the proxy with ``data_plane: haproxy``, no hooks, and
    its HAProxy reloaded on a config without the per-method counting rules (track-sc,
    sc-inc-gpc): with "haproxy" in the same interleaved run it gives the counting rules'
    CPU per call, and in the lifecycle what the hooks cost (haproxy - haproxy-bare) apart
    from the interception hop (haproxy-bare - direct). With no hooks HAProxy sends Python
    only RunPodSandbox, CreateContainer and StartContainer (runtimeproxy.dataplane.haproxy.STORE_CALLS);
    with the shipped chain also UpdateContainerResources, StopPodSandbox and RemovePodSandbox.
  * a sixth path in the pass-through phase, "haproxy-minimal", the anchor of issue 26's
    pass-through target: Debian's /usr/sbin/haproxy started by the benchmark itself
    (``-W -db``, a private dir, unix sockets only) on a minimal config -- ``global``
    (``--minimal-global matched``, the default: ``nbthread 1``, ``tune.bufsize`` and
    ``tune.h2.max-concurrent-streams`` as the proxy's; ``none``: HAProxy's defaults),
    ``defaults`` with ``mode http`` and timeouts, ``bind unix@… proto h2`` →
    ``server … unix@<containerd> proto h2``. Interleaved with the other paths; a table of
    haproxy / haproxy-minimal for added p50 and added p99 (added = over direct) per method
    and summed, and for the CPU per call (its master + worker against the shipped data
    plane alone and with the Python process). Stopped by pid before the lifecycles.
The lifecycle phase can be made harder: ``--cni bridge`` gives the pods their own network
namespace on a private bridge (``krpb<pid>``, bridge + host-local IPAM from /usr/lib/cni,
10.244.250.0/24, no gateway address, no masquerading: nothing routed on the host; one pod's
IP is checked first; the bridge is deleted at the end); ``--busy N`` runs N CPU-burning
shell loops during it (``--busy 2``: both cores of a 2-CPU host busy), killed by pid after.
It prints Markdown tables (docs/benchmarks.md keeps the last ones).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from benchlib import BenchNode, cpu_seconds, percentile

from criapi import cri_v1_pb2 as cri
from criapi import cri_v1_pb2_grpc as cri_grpc
from runtimeproxy.dataplane.haproxy import BUFSIZE, MAX_CONCURRENT_STREAMS
from runtimeproxy.demo import devpods, embedded, embeddedimage
from runtimeproxy.demo.scenario import DEFAULT_CONFIG, kubelet_creates_pod_cgroup

BATCH = ('{"containers": {"c": {"requests": {"kubernetes.io/batch-cpu": "500", "kubernetes.io/batch-memory": '
         '"268435456"}, "limits": {"kubernetes.io/batch-cpu": "1000", "kubernetes.io/batch-memory": "268435456"}}}}')


def _chain(hooks: int) -> dict[str, Any]:
    """``hooks`` example hooks, or (-1) the shipped QoS chain and rules of systemd/config.yaml."""
    if hooks < 0:
        shipped = yaml.safe_load(DEFAULT_CONFIG.read_text())
        return {"hooks": shipped["hooks"], "rules": shipped["rules"]}
    return {"hooks": [{"name": f"shares-{i}", "plugin": "example-cpu-shares", "failure_policy": "Ignore",
                       "args": {"cpu_shares": 512 + i}} for i in range(hooks)]}


def _lat(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e6


CALLS: dict[str, Callable[[Any, str], Any]] = {
    "Version": lambda rt, cid: rt.Version(cri.VersionRequest()),
    "ListContainers": lambda rt, cid: rt.ListContainers(cri.ListContainersRequest()),
    "ListPodSandbox": lambda rt, cid: rt.ListPodSandbox(cri.ListPodSandboxRequest()),
    "ContainerStatus": lambda rt, cid: rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)),
    "ImageStatus": lambda rt, cid: rt.image.ImageStatus(cri.ImageStatusRequest(
        image=cri.ImageSpec(image=embeddedimage.BUSYBOX_IMAGE))),
}


def passthrough(stubs: dict[str, Any], cid: str, n: int) -> dict[str, dict[str, list[float]]]:
    """Latencies (µs) per method and path; calls interleaved, the path order shuffled every
    round (seeded): a rotation keeps each path behind the same neighbour (the slow gRPC
    transport's leftover work then lands on the path after it)."""
    names = list(stubs)
    order = random.Random(15)
    out: dict[str, dict[str, list[float]]] = {}
    for method, call in CALLS.items():
        for _ in range(200):  # warm every channel and cache
            for name in names:
                call(stubs[name], cid)
        lat: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(n):
            for name in order.sample(names, len(names)):
                lat[name].append(_lat(lambda: call(stubs[name], cid)))  # noqa: B023 - used immediately
        out[method] = lat
    return out


#: The timed steps of one pod lifecycle (kubelet's cgroup step timed with RunPodSandbox).
STEPS = ("RunPodSandbox", "CreateContainer", "StartContainer", "StopContainer", "RemoveContainer",
         "StopPodSandbox", "RemovePodSandbox")
#: HAProxy configuration lines of the per-method counting (runtimeproxy.dataplane.haproxy._counting).
COUNTING = ("track-sc0", "sc-inc-gpc", "set-var(txn.grpc_status)")


def be_pod(prefix: str, logs: Path, pod_network: bool = False) -> tuple[str, cri.PodSandboxConfig,
                                                                       cri.ContainerConfig]:
    """A new BE pod with batch resources (the lifecycle's): its cgroup parent, sandbox and container
    config. ``pod_network``: in its own network namespace (CNI sets it up), not the host's."""
    uid = str(uuid.uuid4())
    parent = devpods.kube_cgroup_parent(prefix, "besteffort", uid)
    labels = {"koordinator.sh/qosClass": "BE"}
    annotations = {"node.koordinator.sh/extended-resource-spec": BATCH}
    sandbox = devpods.sandbox_config(name="bench", namespace="bench", uid=uid, log_dir=str(logs),
                                     cgroup_parent=parent, labels=labels, annotations=annotations)
    config = devpods.container_config(name="c", image=embeddedimage.BUSYBOX_IMAGE, command=["sleep", "60"],
                                      resources=cri.LinuxContainerResources(cpu_shares=256))
    if pod_network:
        sandbox.linux.security_context.namespace_options.network = cri.POD
        config.linux.security_context.namespace_options.network = cri.POD
    return parent, sandbox, config


def lifecycle(rt: Any, prefix: str, logs: Path, pod_network: bool = False) -> dict[str, float]:
    """Seconds per step and in all ("total") for one pod's lifecycle."""
    parent, sandbox, config = be_pod(prefix, logs, pod_network)
    out: dict[str, float] = {}
    t = start = time.perf_counter()

    def step(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        out[name], t = now - t, now

    kubelet_creates_pod_cgroup(parent)  # kubelet's step, timed on every path
    sid = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sandbox)).pod_sandbox_id
    step("RunPodSandbox")
    cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sid, config=config,
                                                        sandbox_config=sandbox)).container_id
    step("CreateContainer")
    rt.StartContainer(cri.StartContainerRequest(container_id=cid))
    step("StartContainer")
    rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0))
    step("StopContainer")
    rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid))
    step("RemoveContainer")
    rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid))
    step("StopPodSandbox")
    rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sid))
    step("RemovePodSandbox")
    out["total"] = t - start
    return out


def lifecycles(stubs: dict[str, Any], pids: dict[str, list[int]], prefix: str, logs: Path, pods: int,
               settle: float, pod_network: bool = False) -> tuple[dict[str, list[dict[str, float]]], dict[str, float]]:
    """``pods`` lifecycles per path, the path order shuffled every round (seeded). Each
    lifecycle starts ``settle`` seconds after the one before, on any path: the work a
    proxy leaves after its last reply (Post stages of RemovePodSandbox, the store, logs)
    then lands on no other path's lifecycle. A rotation with no pause put the gRPC
    transport's leftovers on the haproxy path's RunPodSandbox in 3 rounds of 4.
    Also the CPU ms per lifecycle of each path's processes (proxy and HAProxy), the
    settle pause included (the work left after the last reply is the proxy's too)."""
    names = ("direct", "grpc", "haproxy", "haproxy-bare")
    for name in names:  # warm each path's hooks, executors and caches
        for _ in range(3):
            lifecycle(stubs[name], prefix, logs, pod_network)
    order = random.Random(15)
    times: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    cpu = dict.fromkeys(names, 0.0)
    for _ in range(pods):
        for name in order.sample(names, len(names)):
            before = _cpu(pids[name])
            time.sleep(settle)
            times[name].append(lifecycle(stubs[name], prefix, logs, pod_network))
            cpu[name] += _cpu(pids[name]) - before
    return times, {name: total / pods * 1000 for name, total in cpu.items()}


def strip_counting(proxy_pid: int, config: Path) -> list[int]:
    """Reload the HAProxy under ``proxy_pid`` on its config without the counting rules
    (the proxy re-renders it only when its own config changes); its new process group."""
    text = config.read_text()
    config.write_text("".join(line for line in text.splitlines(keepends=True)
                              if not any(word in line for word in COUNTING)))
    master, old_worker = _children(proxy_pid)
    os.kill(master, signal.SIGUSR2)
    end = time.monotonic() + 20
    while time.monotonic() < end:
        group = _children(proxy_pid)
        if len(group) == 2 and old_worker not in group:
            return [proxy_pid, *group]
        time.sleep(0.1)
    raise SystemExit(f"haproxy under {proxy_pid} did not reload: {_children(proxy_pid)}")


#: The anchor of issue 26's pass-through target: Debian's HAProxy, the binary the proxy runs.
HAPROXY = "/usr/sbin/haproxy"
#: The bridge network of ``--cni bridge``: only inside the pods' own network namespaces
#: (the bridge gets no address, no gateway, no masquerading: nothing is routed on the host).
BRIDGE_SUBNET = "10.244.250.0/24"


def minimal_config(listen: Path, backend: Path, matched: bool) -> str:
    """A bare HAProxy in front of containerd: h2 in, h2 out, timeouts only. ``matched``:
    also the proxy's three global settings that change the cost of a call (one thread;
    the buffer and stream limits of runtimeproxy.dataplane.haproxy) -- HAProxy's defaults
    are a thread per CPU, 16 KiB buffers and 100 streams."""
    tuned = ["    nbthread 1", f"    tune.bufsize {BUFSIZE}",
             f"    tune.h2.max-concurrent-streams {MAX_CONCURRENT_STREAMS}"] if matched else []
    return "\n".join([
        "global", *tuned, "",
        "defaults", "    mode http", "    timeout connect 5s", "    timeout client 1h", "    timeout server 1h", "",
        "frontend cri", f'    bind "unix@{listen}" proto h2', "    default_backend containerd", "",
        "backend containerd", f'    server containerd "unix@{backend}" proto h2', ""])


def start_minimal(base: Path, backend: Path, matched: bool) -> tuple[subprocess.Popen[bytes], Path, list[int]]:
    """The bare HAProxy, master-worker in the foreground like the proxy's (``-W -db``), in a
    private dir: its master, socket, and [master, worker]."""
    run = base / "hm"
    run.mkdir(mode=0o700)
    sock, cfg = run / "hm.sock", run / "haproxy.cfg"
    cfg.write_text(minimal_config(sock, backend, matched))
    proc = subprocess.Popen([HAPROXY, "-W", "-db", "-f", str(cfg)], stdin=subprocess.DEVNULL)
    end = time.monotonic() + 20
    while time.monotonic() < end and proc.poll() is None:
        workers = _children(proc.pid)
        if sock.exists() and len(workers) == 1:
            return proc, sock, [proc.pid, *workers]
        time.sleep(0.05)
    stop_minimal(proc, [])
    raise SystemExit(f"the bare haproxy did not start (exit {proc.poll()}), config {cfg}")


def stop_minimal(proc: subprocess.Popen[bytes], group: list[int]) -> None:
    """SIGTERM to the master (it stops its worker and waits for it); a worker left behind
    (the master had to be killed) is killed by pid, if that pid is still our worker."""
    if proc.poll() is not None:
        return
    workers = {pid: _started(pid) for pid in group[1:]}
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid, started in workers.items():
        if started is not None and _started(pid) == started:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _started(pid: int) -> int | None:
    """A process's start time (field 22 of /proc/<pid>/stat): with the pid, who it is."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def bridge_conflist() -> tuple[dict[str, Any], str]:
    """A bridge + host-local network (CNI plugins of /usr/lib/cni) on a private bridge, and
    the bridge's name; host-local's ``dataDir`` (its leases) is the caller's to set."""
    bridge = f"krpb{os.getpid()}"[:15]
    if Path(f"/sys/class/net/{bridge}").exists():
        raise SystemExit(f"a link named {bridge} exists already")
    return {"cniVersion": "0.4.0", "name": "krp-bench-bridge",
            "plugins": [{"type": "bridge", "bridge": bridge, "isGateway": False, "isDefaultGateway": False,
                         "ipMasq": False, "hairpinMode": False,
                         "ipam": {"type": "host-local", "ranges": [[{"subnet": BRIDGE_SUBNET}]],
                                  "dataDir": ""}}]}, bridge


def remove_bridge(bridge: str) -> None:
    """Delete the bridge and any interface still attached to it (a pod's veth is gone with its
    network namespace when the sandbox is removed)."""
    if not Path(f"/sys/class/net/{bridge}").exists():
        return
    for link in Path(f"/sys/class/net/{bridge}/brif").iterdir():
        subprocess.run(["ip", "link", "del", link.name], check=False)
    subprocess.run(["ip", "link", "del", bridge], check=True)


def check_pod_network(rt: Any, prefix: str, logs: Path) -> str:
    """Run one pod with its own network and return its IP (it must be from BRIDGE_SUBNET)."""
    parent, sandbox, _ = be_pod(prefix, logs, pod_network=True)
    kubelet_creates_pod_cgroup(parent)
    sid = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sandbox)).pod_sandbox_id
    try:
        ip = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=sid)).status.network.ip
    finally:
        rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid))
        rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sid))
    if not ip.startswith(BRIDGE_SUBNET.rsplit(".", 1)[0] + "."):
        raise SystemExit(f"a pod with its own network got IP {ip!r}, not one of {BRIDGE_SUBNET}")
    return str(ip)


@contextlib.contextmanager
def busy(n: int) -> Iterator[list[int]]:
    """``n`` shell loops burning a CPU each while the block runs; killed by pid after it."""
    procs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(n)]
    try:
        yield [proc.pid for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def at_rate(stub: Any, groups: dict[str, list[int]], cid: str, rate: float, seconds: float) -> dict[str, float]:
    """% of a core each process group uses while ``stub`` makes ``rate`` calls/s (the 5
    methods in turn)."""
    calls = list(CALLS.values())
    before, start = {name: _cpu(group) for name, group in groups.items()}, time.monotonic()
    for i in range(int(rate * seconds)):
        wait = start + i / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        calls[i % len(calls)](stub, cid)
    took = time.monotonic() - start
    return {name: (_cpu(group) - before[name]) / took * 100 for name, group in groups.items()}


class _Stub:
    """RuntimeService stub with the ImageService one of the same channel as ``image``."""

    def __init__(self, socket: Path) -> None:
        channel = embedded.unix_channel(socket)
        self.runtime = embedded.runtime_stub(channel)
        self.image = cri_grpc.ImageServiceStub(channel)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runtime, name)


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (HAProxy's master and worker under the proxy)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


def _rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000, help="pass-through calls per method and path")
    ap.add_argument("--pods", type=int, default=10, help="pod lifecycles per path")
    ap.add_argument("--idle-pods", type=int, default=20, help="running pods while pass-through is measured")
    ap.add_argument("--idle-seconds", type=float, default=20.0, help="window for the idle CPU of each path")
    ap.add_argument("--rate-seconds", type=float, default=10.0, help="window per path and rate (10 and 50 calls/s)")
    ap.add_argument("--settle", type=float, default=0.1,
                    help="pause before each pod lifecycle, so no path's leftover work lands on another's")
    ap.add_argument("--lifecycle-only", action="store_true", help="skip the pass-through, idle and rate phases")
    ap.add_argument("--hooks", type=int, default=-1,
                    help="example hooks in the chain; -1 (default) = the shipped QoS chain of systemd/config.yaml")
    ap.add_argument("--cni", choices=("loopback", "bridge"), default="loopback",
                    help="the lifecycle's pods: host network (loopback-only CNI, the default) or their own "
                         f"network namespace on a private bridge, {BRIDGE_SUBNET} (host-local IPAM)")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="N CPU-burning shell loops during the lifecycle phase (2 = both cores of this host busy)")
    ap.add_argument("--minimal-global", choices=("matched", "none"), default="matched",
                    help="haproxy-minimal's global section: nbthread 1, tune.bufsize and "
                         "tune.h2.max-concurrent-streams as the proxy's (matched), or HAProxy's defaults (none)")
    args = ap.parse_args()
    conflist, bridge = None, ""
    try:
        if args.cni == "bridge":
            conflist, bridge = bridge_conflist()
        node = BenchNode("b", cni_conflist=conflist)
        if conflist is not None:  # host-local's leases in the node's dir (containerd writes the conflist at start)
            conflist["plugins"][0]["ipam"]["dataDir"] = str(node.base / "cni-ipam")
        with node:
            return _run(args, node, bridge)
    finally:
        if bridge:
            remove_bridge(bridge)


def _run(args: argparse.Namespace, node: BenchNode, bridge: str) -> int:
    """Every phase on one node; ``bridge``: the pods' bridge (--cni bridge), else ""."""
    base, prefix = node.base, node.prefix
    chain = _chain(args.hooks)
    grpc_proc, grpc_sock, _ = node.proxy("grpc", {**chain, "data_plane": "grpc"})
    hx_proc, hx_sock, _ = node.proxy("hx", {**chain, "data_plane": "haproxy"})
    bare_proc, bare_sock, _ = node.proxy("bare", {"data_plane": "haproxy"})
    relay_sock = base / "relay.sock"
    relay = subprocess.Popen([sys.executable, str(Path(__file__).with_name("byterelay.py")),
                              str(relay_sock), str(node.ctd.socket)])
    minimal: subprocess.Popen[bytes] | None = None
    minimal_group: list[int] = []
    try:
        while not relay_sock.exists():
            time.sleep(0.02)
        if not args.lifecycle_only:
            minimal, minimal_sock, minimal_group = start_minimal(base, node.ctd.socket,
                                                                 args.minimal_global == "matched")
        pids = {"direct": [], "relay": [relay.pid], "grpc": [grpc_proc.pid],
                "haproxy": [hx_proc.pid, *_children(hx_proc.pid)], "haproxy (data plane only)": []}
        pids["haproxy (data plane only)"] = pids["haproxy"][1:]
        if len(pids["haproxy"]) != 3:
            raise SystemExit(f"expected the proxy, haproxy's master and worker: {pids['haproxy']}")
        bare = strip_counting(bare_proc.pid, bare_sock.parent / f".{bare_sock.name}.dataplane" / "haproxy.cfg")
        pids["haproxy-bare (data plane only)"] = bare[1:]
        stubs = {"direct": _Stub(node.ctd.socket), "relay": _Stub(relay_sock), "grpc": _Stub(grpc_sock),
                 "haproxy": _Stub(hx_sock), "haproxy-bare": _Stub(bare_sock)}
        if minimal is not None:
            stubs["haproxy-minimal"] = _Stub(minimal_sock)
            pids["haproxy-minimal"] = minimal_group
        direct = stubs["direct"]
        cid = ""
        for i in range(args.idle_pods):  # running pods so List* and Status return real data
            uid = str(uuid.uuid4())
            sb = devpods.sandbox_config(name=f"idle-{i}", namespace="bench", uid=uid, log_dir=str(base / "logs"),
                                        cgroup_parent=devpods.kube_cgroup_parent(prefix, "burstable", uid))
            sid = direct.RunPodSandbox(cri.RunPodSandboxRequest(config=sb)).pod_sandbox_id
            cc = devpods.container_config(name="c", image=embeddedimage.BUSYBOX_IMAGE, command=["sleep", "3600"])
            cid = direct.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sid, config=cc,
                                                                    sandbox_config=sb)).container_id
            direct.StartContainer(cri.StartContainerRequest(container_id=cid))
        pids["haproxy-bare"] = [bare_proc.pid, *bare[1:]]
        if args.lifecycle_only:
            times, lc_cpu = _lifecycle_phase(args, stubs, pids, node, bridge)
            _report_lifecycles(args, times, lc_cpu)
            return 0
        idle = {}
        for name, group in pids.items():
            idle[name] = (_cpu(group), _rss_mb(group))
        time.sleep(args.idle_seconds)
        idle = {name: ((_cpu(group) - idle[name][0]) / args.idle_seconds * 100, _rss_mb(group))
                for name, group in pids.items()}
        before = {name: _cpu(group) for name, group in pids.items()}
        lat = passthrough(stubs, cid, args.calls)
        cpu_us = {name: (_cpu(group) - before[name]) / (args.calls * len(CALLS)) * 1e6
                  for name, group in pids.items()}
        rated: dict[tuple[str, float], float] = {}
        for rate in (10.0, 50.0):
            for name in ("relay", "grpc", "haproxy"):
                groups = {name: pids[name]}
                if name == "haproxy":
                    groups["haproxy (data plane only)"] = pids["haproxy (data plane only)"]
                for label, pct in at_rate(stubs[name], groups, cid, rate, args.rate_seconds).items():
                    rated[(label, rate)] = pct
        if minimal is not None:  # not needed for the lifecycles
            stop_minimal(minimal, minimal_group)
        times, lc_cpu = _lifecycle_phase(args, stubs, pids, node, bridge)
    finally:
        if minimal is not None:
            stop_minimal(minimal, minimal_group)
        relay.terminate()
        relay.wait(10)
    _report(args, lat, cpu_us, idle)
    _report_lifecycles(args, times, lc_cpu)
    print(f"\n### Measured at a kubelet-like rate ({args.rate_seconds:.0f} s each, the 5 methods in turn)\n")
    print("| path | % of a core at 10 calls/s | at 50 calls/s |")
    print("|---|---:|---:|")
    for name in ("relay", "grpc", "haproxy", "haproxy (data plane only)"):
        print(f"| {name} | {rated[(name, 10.0)]:.3f} | {rated[(name, 50.0)]:.3f} |")
    return 0


def _lifecycle_phase(args: argparse.Namespace, stubs: dict[str, Any], pids: dict[str, list[int]], node: BenchNode,
                     bridge: str) -> tuple[dict[str, list[dict[str, float]]], dict[str, float]]:
    """The lifecycles, on the bridge network if there is one, with ``--busy`` loops running."""
    logs = node.base / "logs"
    if bridge:
        ip = check_pod_network(stubs["direct"], node.prefix, logs)
        print(f"pods get their own network on bridge {bridge} (a test pod got {ip})", file=sys.stderr)
    with busy(args.busy):
        return lifecycles(stubs, pids, node.prefix, logs, args.pods, args.settle, pod_network=bool(bridge))


def _report(args: argparse.Namespace, lat: dict[str, dict[str, list[float]]], cpu_us: dict[str, float],
            idle: dict[str, tuple[float, float]]) -> None:
    paths = ["relay", "grpc", "haproxy", "haproxy-bare", "haproxy-minimal"]
    print(f"\n### Pass-through, {args.calls} calls per method and path, interleaved, {args.idle_pods} pods "
          "(microseconds)\n")
    print("| method | path | p50 | p99 | added p50 | added p99 | added p50 / relay's |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for method, per in lat.items():
        d50, d99 = percentile(per["direct"], 0.5), percentile(per["direct"], 0.99)
        print(f"| {method} | direct | {d50:.0f} | {d99:.0f} | | | |")
        r50 = percentile(per["relay"], 0.5) - d50
        for name in paths:
            p50, p99 = percentile(per[name], 0.5), percentile(per[name], 0.99)
            ratio = (p50 - d50) / r50 if r50 > 0 else float("nan")
            print(f"| {method} | {name} | {p50:.0f} | {p99:.0f} | {p50 - d50:+.0f} | {p99 - d99:+.0f} | {ratio:.2f} |")
    print("\n### Proxy processes' CPU (from /proc)\n")
    print("| path | CPU µs per pass-through call | computed % of a core at 10 calls/s | at 50 calls/s "
          "| idle % of a core | RSS MB |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in [*paths[:3], "haproxy (data plane only)", "haproxy-bare (data plane only)", "haproxy-minimal"]:
        us = cpu_us[name]
        idle_pct, rss = idle[name]
        print(f"| {name} | {us:.0f} | {us * 10 / 1e4 + idle_pct:.3f} | {us * 50 / 1e4 + idle_pct:.3f} "
              f"| {idle_pct:.3f} | {rss:.0f} |")
    counting = cpu_us["haproxy (data plane only)"] - cpu_us["haproxy-bare (data plane only)"]
    print(f"\nHAProxy's per-method counting rules: {counting:+.1f} µs CPU per pass-through call "
          "(haproxy - haproxy-bare, data plane only, same interleaved run)")
    _report_minimal(args, lat, cpu_us)


def _report_minimal(args: argparse.Namespace, lat: dict[str, dict[str, list[float]]], cpu_us: dict[str, float]) -> None:
    """Issue 26's pass-through target: the shipped plane's added latency and CPU per call
    over a bare HAProxy's (haproxy-minimal) in the same interleaved run, at most 1.15."""
    tuned = ("nbthread 1, tune.bufsize, tune.h2.max-concurrent-streams as ours" if args.minimal_global == "matched"
             else "HAProxy's defaults")
    print(f"\n### haproxy / haproxy-minimal (issue 26: each ≤ 1.15; haproxy-minimal's global: {tuned}; "
          "added = over direct)\n")
    print("| method | added p50 haproxy µs | added p50 haproxy-minimal µs | ratio p50 "
          "| added p99 haproxy µs | added p99 haproxy-minimal µs | ratio p99 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    sums = [0.0, 0.0, 0.0, 0.0]
    for method, per in lat.items():
        d50, d99 = percentile(per["direct"], 0.5), percentile(per["direct"], 0.99)
        h50, m50 = percentile(per["haproxy"], 0.5) - d50, percentile(per["haproxy-minimal"], 0.5) - d50
        h99, m99 = percentile(per["haproxy"], 0.99) - d99, percentile(per["haproxy-minimal"], 0.99) - d99
        for i, value in enumerate((h50, m50, h99, m99)):
            sums[i] += value
        print(f"| {method} | {h50:+.0f} | {m50:+.0f} | {_ratio(h50, m50)} "
              f"| {h99:+.0f} | {m99:+.0f} | {_ratio(h99, m99)} |")
    print(f"| all {len(lat)} methods (sum of added) | {sums[0]:+.0f} | {sums[1]:+.0f} | {_ratio(sums[0], sums[1])} "
          f"| {sums[2]:+.0f} | {sums[3]:+.0f} | {_ratio(sums[2], sums[3])} |")
    m_cpu = cpu_us["haproxy-minimal"]
    print(f"\nCPU per pass-through call: haproxy-minimal {m_cpu:.1f} µs (master + worker); "
          f"haproxy (data plane only) {cpu_us['haproxy (data plane only)']:.1f} µs = "
          f"{_ratio(cpu_us['haproxy (data plane only)'], m_cpu)} x; haproxy (with the Python process) "
          f"{cpu_us['haproxy']:.1f} µs = {_ratio(cpu_us['haproxy'], m_cpu)} x")


def _ratio(value: float, anchor: float) -> str:
    return f"{value / anchor:.2f}" if anchor > 0 else "n/a"


def _report_lifecycles(args: argparse.Namespace, steps: dict[str, list[dict[str, float]]],
                       cpu_ms: dict[str, float]) -> None:
    times = {name: [run["total"] for run in runs] for name, runs in steps.items()}
    dm = statistics.median(times["direct"])
    print(f"\n### Pod lifecycle (Run, Create, Start, Stop, Remove), {args.pods} pods per path, chain: "
          f"{'shipped QoS chain' if args.hooks < 0 else f'{args.hooks} example hooks'} "
          f"(haproxy-bare: no hooks), {args.settle:.2f} s apart, path order shuffled per round, "
          f"{'pod network: bridge ' + BRIDGE_SUBNET if args.cni == 'bridge' else 'host network'}, "
          f"{args.busy} CPU-burning loops\n")
    print("| path | median s | min s | max s | median / direct | 95 % interval of the ratio (bootstrap) "
          "| proxy CPU ms per lifecycle |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for name, values in times.items():
        m = statistics.median(values)
        low, high = _ratio_interval(values, times["direct"])
        print(f"| {name} | {m:.3f} | {min(values):.3f} | {max(values):.3f} | {m / dm:.3f} | {low:.3f} … {high:.3f} "
              f"| {cpu_ms[name]:.2f} |")
    print("\n### Pod lifecycle per CRI call, median ms (added over direct)\n")
    print("| call | " + " | ".join(steps) + " |")
    print("|---|" + "---:|" * len(steps))
    for step in (*STEPS, "total"):
        d = statistics.median(run[step] for run in steps["direct"]) * 1000
        cells = [f"{d:.2f}"] + [f"{statistics.median(run[step] for run in runs) * 1000:.2f} "
                                f"({statistics.median(run[step] for run in runs) * 1000 - d:+.2f})"
                                for name, runs in steps.items() if name != "direct"]
        print(f"| {step} | " + " | ".join(cells) + " |")


def _ratio_interval(values: list[float], direct: list[float], rounds: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval of median(values) / median(direct): how far the lifecycle
    ratio moves with the run-to-run spread of single lifecycles (tens of ms on 0.2 s)."""
    rng = random.Random(1)
    ratios = sorted(statistics.median(rng.choices(values, k=len(values)))
                    / statistics.median(rng.choices(direct, k=len(direct))) for _ in range(rounds))
    return ratios[int(rounds * 0.025)], ratios[int(rounds * 0.975) - 1]


if __name__ == "__main__":
    sys.exit(main())
