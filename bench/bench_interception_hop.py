"""Benchmark: what the interception hop's transport costs, apart from the lifecycle code.

Run by hand as root: ``.venv/bin/python bench/bench_interception_hop.py [--calls N]``.

An intercepted call crosses Python twice (HAProxy -> Python, Python -> containerd). The
proxy did it with grpc.aio's server and client; this measured that transport against an
HTTP/1.1 hop on the asyncio loop itself, with HAProxy converting h2 <-> h1 on both sides
(it keeps trailers and trailers-only replies), and the proxy now uses such a hop
(runtimeproxy.transport.h1server, runtimeproxy.transport.h1backend):

* direct: the client to containerd;
* h1 relay: client --h2--> HAProxy --h1--> Python (asyncio streams) --h1--> HAProxy --h2--> containerd;
* grpc.aio relay: client --h2--> HAProxy --h2--> grpc.aio server -> grpc.aio client --> containerd
  (the proxy's transport with nothing in between);
* proxy: ``koord-runtime-proxy run`` (HAProxy data plane, shipped chain). Its number includes
  the lifecycle code, which for an unknown container also asks containerd for the
  container's status first (two backend calls, not one).

Both relays are measurement scaffolding: they copy bytes and parse nothing (no metadata,
deadlines or cancellation are carried). The call is UpdateContainerResources of a
container containerd does not know (a NotFound, trailers-only reply), interleaved call
by call in a shuffled path order, warm (back to back) and cold (``--settle`` seconds of
idle before each call, as a kubelet's lifecycle call usually comes). CPU is utime+stime
of each path's processes from /proc (the HAProxy shared by both relays is counted in both).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import bench_proxy as bp
import grpc
from benchlib import BenchNode, cpu_seconds

from criapi import cri_v1_pb2 as cri

HAPROXY_CFG = """global
    nbthread 1
defaults
    mode http
    timeout connect 5s
    timeout client 1h
    timeout server 1h
    timeout http-keep-alive 1h
frontend fe_h1
    bind unix@{d}/h1.sock mode 600 proto h2
    default_backend be_h1
backend be_h1
    server py unix@{d}/py-h1.sock
frontend fe_grpc
    bind unix@{d}/grpc.sock mode 600 proto h2
    default_backend be_grpc
backend be_grpc
    server py unix@{d}/py-grpc.sock proto h2
frontend fe_up
    bind unix@{d}/up.sock mode 600
    default_backend be_containerd
backend be_containerd
    server containerd unix@{ctd} proto h2
"""


async def _read_body(reader: asyncio.StreamReader, head: bytes) -> tuple[bytes, bytes]:
    """The body and the trailer block (b"\\r\\n" when none) of a message with ``head``."""
    low = head.lower()
    if b"transfer-encoding: chunked" in low:
        data = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            if size == 0:
                trailers = b""
                while True:
                    line = await reader.readuntil(b"\r\n")
                    trailers += line
                    if line == b"\r\n":
                        return data, trailers
            data += (await reader.readexactly(size + 2))[:-2]
    at = low.find(b"content-length: ")
    length = int(low[at + 16:low.find(b"\r\n", at)]) if at >= 0 else 0
    return (await reader.readexactly(length)) if length else b"", b"\r\n"


async def serve_h1(d: Path) -> None:
    """The h1 relay: one keep-alive connection up (the benchmark makes one call at a time)."""
    up_reader, up_writer = await asyncio.open_unix_connection(str(d / "up.sock"))

    async def conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                target = head.split(b" ", 2)[1]
                body, _ = await _read_body(reader, head)
                up_writer.write(b"POST " + target + b" HTTP/1.1\r\nhost: containerd\r\n"
                                b"content-type: application/grpc\r\nte: trailers\r\n"
                                b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                rhead = await up_reader.readuntil(b"\r\n\r\n")
                data, trailers = await _read_body(up_reader, rhead)
                if b"grpc-status:" in rhead.lower():  # trailers-only: relayed as a bodyless reply
                    kept = [line for line in rhead.split(b"\r\n")[1:]
                            if line.lower().startswith((b"grpc-", b"content-type"))]
                    writer.write(b"HTTP/1.1 200 OK\r\n" + b"\r\n".join(kept) + b"\r\ncontent-length: 0\r\n\r\n")
                    continue
                chunk = f"{len(data):x}\r\n".encode() + data + b"\r\n" if data else b""
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ntransfer-encoding: chunked\r\n\r\n"
                             + chunk + b"0\r\n" + trailers)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_unix_server(conn, str(d / "py-h1.sock"))
    async with server:
        await server.serve_forever()


async def serve_grpc(d: Path, containerd: str) -> None:
    """The grpc.aio relay: a generic handler forwarding raw bytes, as the proxy's transport does."""
    channel = grpc.aio.insecure_channel("unix://" + containerd)

    def same(b: bytes) -> bytes:
        return b

    class Relay(grpc.GenericRpcHandler):
        def service(self, details: Any) -> Any:
            call = channel.unary_unary(details.method, request_serializer=same, response_deserializer=same)

            async def handler(request: bytes, context: Any) -> bytes:
                try:
                    return bytes(await call(request, timeout=context.time_remaining()))
                except grpc.aio.AioRpcError as exc:
                    await context.abort(exc.code(), exc.details())
                    raise

            return grpc.unary_unary_rpc_method_handler(handler, request_deserializer=same, response_serializer=same)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((Relay(),))
    server.add_insecure_port("unix://" + str(d / "py-grpc.sock"))
    await server.start()
    await server.wait_for_termination()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300, help="calls per path and mode")
    ap.add_argument("--settle", type=float, default=0.1, help="idle seconds before each cold call")
    args = ap.parse_args()
    with BenchNode("i") as node:
        d = node.base / "hop"
        d.mkdir()
        (d / "haproxy.cfg").write_text(HAPROXY_CFG.format(d=d, ctd=node.ctd.socket))
        children = [subprocess.Popen(["haproxy", "-W", "-q", "-f", str(d / "haproxy.cfg")]),
                    subprocess.Popen([sys.executable, __file__, "--serve-h1", str(d)]),
                    subprocess.Popen([sys.executable, __file__, "--serve-grpc", str(d), str(node.ctd.socket)])]
        proxy, proxy_sock, _ = node.proxy("hx", {**bp._chain(-1), "data_plane": "haproxy"})
        try:
            while not all((d / name).exists() for name in ("py-h1.sock", "py-grpc.sock", "h1.sock", "grpc.sock")):
                time.sleep(0.05)
            haproxy = [children[0].pid, *bp._children(children[0].pid)]
            stubs = {"direct": bp._Stub(node.ctd.socket), "h1 relay": bp._Stub(d / "h1.sock"),
                     "grpc.aio relay": bp._Stub(d / "grpc.sock"), "proxy": bp._Stub(proxy_sock)}
            pids = {"direct": [], "h1 relay": [children[1].pid, *haproxy],
                    "grpc.aio relay": [children[2].pid, *haproxy], "proxy": [proxy.pid, *bp._children(proxy.pid)]}
            _report(args, stubs, pids)
        finally:
            for child in children:
                child.terminate()
                child.wait(10)
    return 0


def _report(args: argparse.Namespace, stubs: dict[str, Any], pids: dict[str, list[int]]) -> None:
    request = cri.UpdateContainerResourcesRequest(container_id="f" * 64,
                                                  linux=cri.LinuxContainerResources(cpu_shares=2))

    def call(stub: Any) -> None:
        try:
            stub.UpdateContainerResources(request, timeout=10)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise

    version = stubs["direct"].Version(cri.VersionRequest(), timeout=10)
    for name, stub in stubs.items():  # a reply with a body and trailers relays intact; then warm every path
        got = stub.Version(cri.VersionRequest(), timeout=10)
        if got != version:
            raise SystemExit(f"{name}: Version answered {got!r}, containerd {version!r}")
        for _ in range(50):
            call(stub)
    order = random.Random(15)
    print(f"\n### Interception hop, UpdateContainerResources of an unknown container, {args.calls} calls per path\n")
    print("| mode | path | p50 µs | added p50 µs | p90 µs | CPU µs per call |")
    print("|---|---|---:|---:|---:|---:|")
    for mode, settle in (("warm", 0.0), (f"cold ({args.settle:g} s idle)", args.settle)):
        lat: dict[str, list[float]] = {name: [] for name in stubs}
        cpu = dict.fromkeys(stubs, 0.0)
        for _ in range(args.calls):
            for name in order.sample(list(stubs), len(stubs)):
                time.sleep(settle)
                before = sum(cpu_seconds(p) for p in pids[name])
                start = time.perf_counter()
                call(stubs[name])
                lat[name].append((time.perf_counter() - start) * 1e6)
                cpu[name] += sum(cpu_seconds(p) for p in pids[name]) - before
        direct = statistics.median(lat["direct"])
        for name, values in lat.items():
            p50 = statistics.median(values)
            print(f"| {mode} | {name} | {p50:.0f} | {p50 - direct:+.0f} | {bp.percentile(values, 0.9):.0f} "
                  f"| {cpu[name] / args.calls * 1e6:.0f} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-h1"]:
        asyncio.run(serve_h1(Path(sys.argv[2])))
    elif sys.argv[1:2] == ["--serve-grpc"]:
        asyncio.run(serve_grpc(Path(sys.argv[2]), sys.argv[3]))
    else:
        sys.exit(main())
