"""``koord-runtime-proxy``: the command line.

Koordinator's flag names are accepted as aliases so an existing unit file or
DaemonSet can switch binaries without edits. Flags override the config file.
Exit status: 0 clean stop, 1 runtime failure, 2 bad configuration or usage.
"""

from __future__ import annotations

import sys

# The process entry, before anything imports structlog: structlog imports ``rich``
# whenever it is installed (a dev tool, import-linter, brings it into a dev venv) to
# render tracebacks, which the agent never uses: ~4 MiB resident for nothing. Without
# it, structlog renders them plainly. A process that already has structlog (a test
# run importing this module) is left alone.
if "structlog" not in sys.modules:
    sys.modules.setdefault("rich", None)  # type: ignore[arg-type]  # None: "import rich" raises ImportError

import argparse
import importlib.metadata
import json
import os
import signal
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from runtimeproxy.config import settings as config

EXIT_CONFIG = 2
#: Entry points here are ``register(subparsers)`` callables adding a subcommand that
#: sets ``func`` (taking the parsed args, returning the exit status).
COMMAND_GROUP = "koord_runtime_proxy.commands"


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None,
                   help=f"YAML config (default {config.DEFAULT_CONFIG_PATH}; the built-in default, the shipped"
                        " config, if absent)")
    p.add_argument("--listen", "--koord-runtimeproxy-endpoint", dest="listen",
                   help="unix socket for kubelet")
    p.add_argument("--backend", "--remote-runtime-service-endpoint", dest="backend",
                   help="containerd CRI socket")
    p.add_argument("--image-backend", "--remote-image-service-endpoint", dest="image_backend",
                   help="separate ImageService socket")
    p.add_argument("--metrics-listen", dest="metrics_listen", help="host:port for /metrics ('' disables)")
    p.add_argument("--hookserver-dir", dest="hookserver_dir", help="Koordinator hook-server registrations")
    p.add_argument("--log-level", dest="log_level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", dest="log_format", choices=["auto", "json", "console"])
    p.add_argument("--data-plane-unit", dest="data_plane_unit",
                   help="HAProxy's systemd service (the shipped unit passes it); '' runs HAProxy as a child")


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    mapping = {
        "listen": "listen", "backend": "backend.runtime_endpoint", "image_backend": "backend.image_endpoint",
        "metrics_listen": "metrics.listen", "hookserver_dir": "hookserver_dir",
        "log_level": "log.level", "log_format": "log.format", "data_plane_unit": "data_plane_unit",
    }
    return {key: getattr(args, attr) for attr, key in mapping.items() if getattr(args, attr, None) is not None}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="koord-runtime-proxy", description="CRI proxy with QoS hooks for co-location",
        epilog="Without a command, `run`. `koord-runtime-proxy COMMAND --help` shows a command's options. "
               "Exit status: 0 ok, 1 runtime failure, 2 bad configuration or usage.",
    )
    sub = p.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    run = sub.add_parser("run", help="serve kubelet (the default command)")
    _add_config_flags(run)
    check = sub.add_parser("check-config",
                           help="validate everything run validates (hooks, tasks, files), list the chain")
    _add_config_flags(check)
    check.add_argument("--output", choices=["text", "json"], default="text",
                       help="json: the whole plan (hooks, tasks' collectors and strategies, what is off here) "
                            "as one JSON document")
    explain = sub.add_parser("explain", help="what the hooks and tasks did for a pod (or the node), and why")
    explain.add_argument("pod", nargs="?", default="", help="namespace/name (omit for the node-wide view)")
    explain.add_argument("--endpoint", default="127.0.0.1:9316", help="the proxy's metrics host:port")
    demo = sub.add_parser("demo", help="private containerd + proxy + demo pods; Ctrl-C cleans up")
    demo.add_argument("--workdir", type=Path, default=None,
                      help="keep the metrics store and pod logs here (default: a temporary dir, removed)")
    demo.add_argument("--config", type=Path, default=None, help="proxy config (default: a demo config)")
    demo.add_argument("--once", action="store_true", help="clean up right after printing, no Ctrl-C wait")
    demo.add_argument("--ingress", choices=("cri-proxy", "nri"), default="cri-proxy",
                      help="nri: containerd 1.7.24 (scripts/setup-host.sh fetches it) calls the agent over NRI")
    # Plugin families add their own commands (e.g. ``top``) without the core naming them.
    for ep in sorted(importlib.metadata.entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        ep.load()(sub)
    return p


def _settings(args: argparse.Namespace) -> config.Settings | None:
    try:
        return config.load(args.config, overrides_from(args))
    except config.ConfigError as exc:
        print(f"koord-runtime-proxy: invalid configuration: {exc}", file=sys.stderr)
        return None


def _cmd_run(args: argparse.Namespace) -> int:
    from runtimeproxy import app
    from runtimeproxy.transport import grpcserver

    settings = _settings(args)
    if settings is None:
        return EXIT_CONFIG
    try:
        return app.run(settings, config_path=args.config or _default_path(), overrides=overrides_from(args))
    except config.ConfigError as exc:
        print(f"koord-runtime-proxy: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except grpcserver.SocketInUse as exc:
        print(f"koord-runtime-proxy: {exc}", file=sys.stderr)
        return 1


def _default_path() -> Path | None:
    return config.DEFAULT_CONFIG_PATH if config.DEFAULT_CONFIG_PATH.exists() else None


def _cmd_check(args: argparse.Namespace) -> int:
    from runtimeproxy.chain import checkplan

    settings = _settings(args)
    if settings is None:
        return EXIT_CONFIG
    from runtimeproxy.dataplane import process as dataplane

    try:
        plan = checkplan.build(settings)  # the hooks, tasks and their plans, as run builds them
        plane = dataplane.check(settings)
    except config.ConfigError as exc:
        print(f"koord-runtime-proxy: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.output == "json":
        print(json.dumps({**plan, "data_plane_check": plane}, indent=2, default=str))
    else:
        print("\n".join(checkplan.render_text(plan, plane)))
    return 0


def _fetch_json(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return 0, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        print(f"koord-runtime-proxy: {json.loads(exc.read()).get('error', exc)}", file=sys.stderr)
    except OSError as exc:
        print(f"koord-runtime-proxy: cannot reach {url}: {exc}", file=sys.stderr)
    return 1, None


def _print_tasks(tasks: dict[str, Any]) -> None:
    for name, view in tasks.items():
        print(f"  task {name}:")
        for line in json.dumps(view, indent=2, default=str).splitlines():
            print(f"    {line}")


def _cmd_explain(args: argparse.Namespace) -> int:
    query = urllib.parse.urlencode({"pod": args.pod}) if args.pod else ""
    code, body = _fetch_json(f"http://{args.endpoint}/debug/explain?{query}")
    if code:
        return code
    if body.get("ingress"):
        print(f"ingress: {body['ingress']}")
    if not args.pod:
        print("node")
        _print_tasks(body.get("tasks", {}))
        if not body.get("tasks"):
            print("  no background task explains anything")
        return 0
    print(f"pod {body['pod']} uid={body['uid']} sandbox={body['sandbox_id'][:13]}")
    print(f"  cgroup_parent={body['cgroup_parent']}")
    for c in body["changes"]:
        print(f"  [{c['stage']}] {c['hook']}: {c['target']}: {c['old'] or '-'} -> {c['new']}  ({c['reason']})")
    if not body["changes"]:
        print("  no changes recorded")
    _print_tasks(body.get("tasks", {}))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from runtimeproxy.demo import scenario as demo

    code: int = demo.main(workdir=args.workdir, config_path=args.config, once=args.once, ingress=args.ingress)
    return code


def _quiet_on_closed_pipe(work: Callable[[], int]) -> int:
    """``check-config | head -1``: the reader went away. Stop quietly, like a Unix tool
    killed by SIGPIPE (status 141), without a traceback at exit either."""
    try:
        code = work()
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit flush
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "run")
    parsed: list[argparse.Namespace] = []

    def parse() -> int:  # --help and usage errors write too
        parsed.append(parser().parse_args(argv))
        return 0

    code = _quiet_on_closed_pipe(parse)
    if not parsed:
        return code
    args = parsed[0]
    commands: dict[str, Callable[[argparse.Namespace], int]] = {
        "run": _cmd_run, "check-config": _cmd_check, "explain": _cmd_explain, "demo": _cmd_demo,
    }
    # A plugin command: its register() set ``func`` on its subparser.
    command = commands.get(args.command) or args.func
    if args.command == "run":
        return command(args)  # the daemon: an unexpected BrokenPipeError is a crash to see
    return _quiet_on_closed_pipe(lambda: command(args))


if __name__ == "__main__":
    sys.exit(main())
