"""Benchmark: what the agent's cadences cost with no work at all (issue 29's floor).

Run by hand (not part of the test suite): ``.venv/bin/python bench/bench_floor.py``;
prefix ``bash scripts/burn.sh 2 --`` for the issue's busy host.

A skeleton process wakes the way the proxy with everything on does, and does nothing
when it wakes: the asyncio loop; gRPC's aio server with the backend probe (one unary
call every 5 s); the collectors' tick (a loop timer every 1 s handing a no-op to a
worker thread and back); the QoS round (every 1 s: plan and write hand-offs to the
default executor); the analyser (every 2 s: one hand-off); the reconciler (every 10 s:
two unary calls, a hand-off); the suppress fast path (a timer callback every 100 ms).
Each row adds one cadence, and is its own process measured over the window (utime +
stime, as ``bench_metrics.py``), so a row's increase is what that cadence's wake-ups
cost on this host, before any work. The proxy's real parts are in
``bench_metrics.py``'s table; the difference between the two is the work itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from benchlib import cpu_seconds

#: The cadences, in the order rows add them.
LAYERS = ("loop", "grpc+probe", "collect", "qos-round", "analyser", "reconciler", "fastpath")


def _noop(*_args: object) -> None:
    return None


async def _every(seconds: float, step: object) -> None:
    while True:
        await asyncio.sleep(seconds)
        await step()  # type: ignore[operator]


async def _skeleton(layers: set[str]) -> None:
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []
    if "grpc+probe" in layers:
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            "floor.Probe", {"Version": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"")})
        server.add_generic_rpc_handlers((handler,))
        sock = f"unix-abstract:krp-floor-{os.getpid()}"  # nothing on disk to leave behind
        server.add_insecure_port(sock)
        await server.start()
        channel = grpc.aio.insecure_channel(sock)
        call = channel.unary_unary("/floor.Probe/Version", request_serializer=None, response_deserializer=None)

        async def probe() -> None:
            await call(b"", timeout=5)

        tasks.append(asyncio.create_task(_every(5.0, probe), name="probe"))
        if "reconciler" in layers:
            async def reconcile() -> None:
                await call(b"", timeout=5)
                await call(b"", timeout=5)
                await asyncio.to_thread(_noop)

            tasks.append(asyncio.create_task(_every(10.0, reconcile), name="reconciler"))
    if "collect" in layers:
        worker = ThreadPoolExecutor(1, thread_name_prefix="metrics")

        async def collect() -> None:
            await loop.run_in_executor(worker, _noop)

        tasks.append(asyncio.create_task(_every(1.0, collect), name="collect"))
    if "qos-round" in layers:
        async def qos() -> None:
            await asyncio.to_thread(_noop)  # plan
            await asyncio.to_thread(_noop)  # write

        tasks.append(asyncio.create_task(_every(1.0, qos), name="qos"))
    if "analyser" in layers:
        async def analyse() -> None:
            await asyncio.to_thread(_noop)

        tasks.append(asyncio.create_task(_every(2.0, analyse), name="analyser"))
    if "fastpath" in layers:
        def tick() -> None:
            loop.call_later(0.1, tick)

        loop.call_later(0.1, tick)
    await asyncio.Event().wait()


def _wakeups(pid: int) -> int:
    """Voluntary context switches of all the process's threads (each is a sleep that ended)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def _measure(layers: tuple[str, ...], warmup: float, window: float) -> tuple[float, float]:
    """(% of a core, wake-ups per second) of a skeleton with these cadences."""
    child = subprocess.Popen([sys.executable, __file__, "--child", ",".join(layers)])
    try:
        time.sleep(warmup)
        before, woke = cpu_seconds(child.pid), _wakeups(child.pid)
        time.sleep(window)
        return (cpu_seconds(child.pid) - before) / window * 100, (_wakeups(child.pid) - woke) / window
    finally:
        child.terminate()
        child.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--window", type=float, default=60.0)
    args = parser.parse_args()
    if args.child is not None:
        asyncio.run(_skeleton(set(args.child.split(","))))
        return
    print(f"### The cadences' floor: a skeleton that wakes as the proxy does, no work ({args.window:.0f} s windows)\n")
    print("| cadences | % of a core | added | wake-ups /s |")
    print("|---|---:|---:|---:|")
    previous = 0.0
    for n in range(1, len(LAYERS) + 1):
        cost, wakeups = _measure(LAYERS[:n], args.warmup, args.window)
        print(f"| + {LAYERS[n - 1]} | {cost:.2f} | {cost - previous:+.2f} | {wakeups:.0f} |", flush=True)
        previous = cost


if __name__ == "__main__":
    main()
