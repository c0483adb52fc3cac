"""Benchmark: what one store re-sync costs, to size ``resync_interval`` against an event stream.

Post stages after a stop or a removal are level-triggered from the re-sync
(runtimeproxy.lifecycle.owed): a removed pod's cleanup waits for at most one
``resync_interval``. Subscribing to containerd's event stream would make it prompt at
~0 idle cost, but adds a long-lived stream, its proto and its reconnects; a shorter
interval costs a re-sync per interval. This measures that cost.

Run by hand as root: ``.venv/bin/python bench/bench_resync.py [--pods N] [--passes K]``.
Against one private containerd with N running pods (one container each), it builds the
store and the ledger as the proxy does at start, then runs K re-syncs plus the owed
computation back to back and prints, per pass: wall time (median, p99), the proxy's
CPU (this process) and containerd's CPU (from /proc), and what that is in % of a core
at 1 s, 5 s and 60 s intervals.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

from benchlib import BenchNode, cpu_seconds, percentile

from criapi import cri_v1_pb2 as cri
from runtimeproxy.config.settings import BackendSettings
from runtimeproxy.demo import devpods, embeddedimage
from runtimeproxy.lifecycle import owed
from runtimeproxy.state.ledger import ObjectLedger
from runtimeproxy.state.store import Store, resync
from runtimeproxy.transport.grpcbackend import GrpcBackend


def _pods(node: BenchNode, count: int) -> None:
    rt = node.runtime()
    for i in range(count):
        uid = str(uuid.uuid4())
        sb = devpods.sandbox_config(name=f"rs-{i}", namespace="bench", uid=uid, log_dir=str(node.base / "logs"),
                                    cgroup_parent=devpods.kube_cgroup_parent(node.prefix, "burstable", uid))
        sid = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sb), timeout=60).pod_sandbox_id
        cc = devpods.container_config(name="c", image=embeddedimage.BUSYBOX_IMAGE, command=["sleep", "3600"])
        cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sid, config=cc, sandbox_config=sb),
                                 timeout=60).container_id
        rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=60)


async def _measure(node: BenchNode, passes: int) -> tuple[list[float], float, float]:
    backend = GrpcBackend(BackendSettings(runtime_endpoint=str(node.ctd.socket)), max_message_bytes=16 << 20)
    ledger = ObjectLedger(None)
    store = Store(None, ledger)
    await resync(store, backend)  # the start-up rebuild: verbose status per object, not measured
    walls: list[float] = []
    ctd_pid = node.ctd.pid
    assert ctd_pid is not None
    cpu0, ctd0 = time.process_time(), cpu_seconds(ctd_pid)
    for _ in range(passes):
        start = time.perf_counter()
        result = await resync(store, backend)
        owed.compute(ledger, store, result)
        walls.append(time.perf_counter() - start)
    cpu, ctd = (time.process_time() - cpu0) / passes, (cpu_seconds(ctd_pid) - ctd0) / passes
    await backend.close()
    return walls, cpu, ctd


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", type=int, default=100, help="running pods (one container each)")
    ap.add_argument("--passes", type=int, default=200, help="re-syncs measured")
    args = ap.parse_args()
    with BenchNode("r") as node:
        _pods(node, args.pods)
        walls, cpu, ctd = asyncio.run(_measure(node, args.passes))
    per_pass = cpu + ctd
    print(f"| pods | re-sync wall p50 / p99 | proxy CPU / pass | containerd CPU / pass | "
          f"% of a core at 1 s / 5 s / 60 s |\n|---|---|---|---|---|\n"
          f"| {args.pods} | {statistics.median(walls) * 1000:.1f} / {percentile(walls, 0.99) * 1000:.1f} ms | "
          f"{cpu * 1000:.2f} ms | {ctd * 1000:.2f} ms | "
          f"{per_pass * 100:.2f} / {per_pass * 20:.3f} / {per_pass * 100 / 60:.4f} % |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
