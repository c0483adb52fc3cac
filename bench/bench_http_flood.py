"""Two local clients flood the proxy's HTTP endpoint (issue 14 item 7).

Run by hand as root: ``.venv/bin/python bench/bench_http_flood.py [--seconds 20]
[--nofile 1024] [--code DIR]``. A private containerd, the proxy in front of it with
``RLIMIT_NOFILE`` soft and hard set to ``--nofile`` (as ``ulimit -n 1024`` would),
then two flooding processes for ``--seconds``: each opens connections to the
metrics port as fast as it can and holds them (never sending a byte), 8 000 at most
each, oldest dropped first. Every second: the proxy's descriptors and RSS, one CRI
Version call through the proxy and one /healthz from a third, well-behaved client.
Then the flood stops and the proxy gets 5 s to settle.

``--code DIR`` runs the proxy from another checkout (e.g. ``git archive main | tar
-x -C DIR``) to measure before/after; the config then holds only keys both know.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from benchlib import BenchNode

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo import embedded
from runtimeproxy.demo.scenario import free_port, wait_healthy

FLOODER = textwrap.dedent("""
    import collections, resource, socket, sys, time
    port, seconds = int(sys.argv[1]), float(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (20000, 20000))
    held = collections.deque()
    opened = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        held.append(s)
        opened += 1
        if len(held) > 8000:
            held.popleft().close()
        if opened % 200 == 0:
            time.sleep(0.001)
    print(opened, flush=True)
""")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def healthz(port: int) -> str:
    start = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
            return f"{resp.status} {1000 * (time.monotonic() - start):.0f}ms"
    except urllib.error.HTTPError as exc:
        return f"{exc.code}"
    except OSError as exc:
        return type(exc).__name__


def version(stub: Any) -> str:
    start = time.monotonic()
    try:
        stub.Version(cri.VersionRequest(), timeout=2)
    except Exception as exc:  # a bench reports, it does not stop
        code = getattr(exc, "code", None)
        return code().name if callable(code) else type(exc).__name__
    return f"{1000 * (time.monotonic() - start):.1f}ms"


def log_summary(path: Path) -> dict[str, Any]:
    lines = path.read_text(errors="replace").splitlines()
    plain = [line for line in lines if not line.startswith("{")]
    events: dict[str, int] = {}
    for line in lines:
        if line.startswith("{"):
            try:
                name = str(json.loads(line).get("event"))
            except ValueError:
                continue
            events[name] = events.get(name, 0) + 1
    return {"lines": len(lines), "plain_text_lines": len(plain),
            "tracebacks": sum(1 for line in plain if line.startswith("Traceback")), "events": events}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--nofile", type=int, default=1024)
    ap.add_argument("--code", type=Path, help="run the proxy from this checkout")
    args = ap.parse_args()

    with BenchNode("f") as node:
        port, sock = free_port(), node.base / "proxy.sock"
        doc = {"listen": str(sock), "backend": {"runtime_endpoint": str(node.ctd.socket)},
               "metrics": {"listen": f"127.0.0.1:{port}"}, "hookserver_dir": "",
               "log": {"level": "info", "format": "json"}, "hooks": []}
        cfg = node.base / "proxy.yaml"
        cfg.write_text(yaml.safe_dump(doc, sort_keys=False))
        env = dict(os.environ)
        if args.code:
            env["PYTHONPATH"] = str(args.code.resolve())
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        log_path = node.base / "proxy.log"
        nofile = args.nofile

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        with open(log_path, "wb") as log:
            proxy = subprocess.Popen([sys.executable, "-m", "runtimeproxy.cli", "run", "--config", str(cfg)],
                                     stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=limit,
                                     cwd=args.code or node.base)
        try:
            wait_healthy(port, proxy)  # type: ignore[arg-type]
            stub = embedded.runtime_stub(embedded.unix_channel(sock))
            print(f"proxy pid {proxy.pid}, code {args.code or 'this checkout'}, nofile {nofile}")
            print(f"idle: fds {fds(proxy.pid)}, rss {rss_mib(proxy.pid):.1f} MiB, Version {version(stub)}")
            flooders = [subprocess.Popen([sys.executable, "-c", FLOODER, str(port), str(args.seconds)],
                                         stdout=subprocess.PIPE, text=True) for _ in range(2)]
            print("| t s | proxy fds | RSS MiB | Version via proxy | /healthz (3rd client) |")
            print("|---:|---:|---:|---|---|")
            peak_fds, peak_rss, failed_versions, failed_health = 0, 0.0, 0, 0
            start = time.monotonic()
            t = 0
            while any(f.poll() is None for f in flooders) or t < args.seconds + 5:
                t += 1
                time.sleep(max(0.0, start + t - time.monotonic()))
                if proxy.poll() is not None:
                    print(f"proxy exited with {proxy.returncode}")
                    break
                n, rss, ver, hz = fds(proxy.pid), rss_mib(proxy.pid), version(stub), healthz(port)
                peak_fds, peak_rss = max(peak_fds, n), max(peak_rss, rss)
                failed_versions += not ver.endswith("ms")
                failed_health += not hz.startswith("200")
                phase = "" if t <= args.seconds else " (flood over)"
                print(f"| {t}{phase} | {n} | {rss:.1f} | {ver} | {hz} |")
            opened = [int((f.communicate()[0] or "0").strip() or 0) for f in flooders]
            print(f"connections opened by the flooders: {opened}")
            print(f"peak fds {peak_fds}, peak RSS {peak_rss:.1f} MiB, failed Version calls {failed_versions}, "
                  f"failed /healthz {failed_health}")
        finally:
            node.stop(proxy)  # type: ignore[arg-type]
        summary = log_summary(log_path)
        top = sorted(summary["events"].items(), key=lambda kv: -kv[1])[:8]
        print(f"log: {summary['lines']} lines, {summary['plain_text_lines']} plain-text, "
              f"{summary['tracebacks']} tracebacks; top events {top}")


if __name__ == "__main__":
    main()
