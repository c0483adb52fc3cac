"""What the benchmarks share: a private containerd with the offline images, proxies
started from a config mapping (stopped with the node), per-process CPU time and
percentiles. The scripts run as ``python bench/<name>.py``, so this module is
imported by its plain name."""

from __future__ import annotations

import compileall
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from runtimeproxy.demo import embedded, embeddedcgroup, embeddedimage
from runtimeproxy.demo.scenario import free_port, wait_healthy

TICK = os.sysconf("SC_CLK_TCK")
REPO = Path(__file__).resolve().parents[1]


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process, or of one of its threads (fields 14 and 15 of
    /proc/<pid>/stat, /proc/<pid>/task/<tid>/stat)."""
    stat = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


class BenchNode:
    """``with BenchNode("q") as node``: a private containerd with busybox and pause
    imported, a unique cgroup parent, and every proxy started through it stopped
    (SIGTERM, by pid) on the way out, containerd last; then its /tmp dir is removed
    (kept with ``KRP_BENCH_KEEP=1``). ``cni_conflist``: containerd's CNI network instead of
    loopback only (the caller removes what its plugins leave on the host, e.g. a bridge)."""

    def __init__(self, tag: str, cni_conflist: dict[str, Any] | None = None) -> None:
        self.base = Path(tempfile.mkdtemp(prefix=f"krp{tag}-", dir="/tmp"))  # short: socket paths
        self.ctd = embedded.EmbeddedContainerd(self.base / "ctd", cni_conflist=cni_conflist)
        self.prefix = embeddedcgroup.unique_test_parent()
        self._procs: list[subprocess.Popen[bytes]] = []
        self._compiled: set[Path] = set()

    def __enter__(self) -> BenchNode:
        self.ctd.start()
        self.ctd.import_image(embeddedimage.build_busybox_image(self.base))
        self.ctd.import_image(embeddedimage.build_pause_image(self.base))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for proc in self._procs:
            self.stop(proc)
        self.ctd.stop()
        embeddedcgroup.remove_cgroup_tree(self.prefix)
        if os.environ.get("KRP_BENCH_KEEP"):  # e.g. to study the metrics store offline
            print(f"kept {self.base}", file=sys.stderr)
        elif not embedded.remove_workdir(self.base):
            print(f"kept {self.base}: something is still mounted under it", file=sys.stderr)

    def runtime(self, socket: Path | None = None) -> Any:
        return embedded.runtime_stub(embedded.unix_channel(socket or self.ctd.socket))

    def proxy(
        self, name: str, doc: dict[str, Any], cwd: Path | None = None, env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen[bytes], Path, int]:
        """Start ``koord-runtime-proxy run`` on ``doc`` (listen, backend, metrics port, no
        hookserver.d and warning logs filled in) and wait until it is healthy. ``cwd``: run
        the code of another checkout (``python -m`` imports from the working directory first);
        ``env``: variables added to this process's environment (e.g. the unit's)."""
        port, sock = free_port(), self.base / f"{name}.sock"
        full = {"listen": str(sock), "backend": {"runtime_endpoint": str(self.ctd.socket)},
                "metrics": {"listen": f"127.0.0.1:{port}"}, "hookserver_dir": "", "log": {"level": "warning"},
                "hooks": [], "state_dir": str(self.base / f"{name}-state"),
                **doc}
        cfg = self.base / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump(full, sort_keys=False))
        self._compile(cwd or REPO)
        proc = subprocess.Popen([sys.executable, "-m", "runtimeproxy.cli", "run", "--config", str(cfg)], cwd=cwd,
                                env={**os.environ, **env} if env else None)
        self._procs.append(proc)
        wait_healthy(port, proc)
        return proc, sock, port

    def _compile(self, root: Path) -> None:
        """The checkout's bytecode, written once before its first proxy starts. The
        package runs from the bytecode pip compiled at install (test_deb_package); a
        source tree run under ``PYTHONDONTWRITEBYTECODE`` (set on some hosts) would
        compile every module at every start, and the compiler's memory at start-up was
        the peak RSS (VmHWM): 110 pods, everything on, 71.6-73.6 MiB against 70.5-71.0
        with bytecode (docs/benchmarks.md, the seventeenth session)."""
        if root in self._compiled:
            return
        for package in (d for d in root.iterdir() if (d / "__init__.py").is_file()):
            if not compileall.compile_dir(package, quiet=1):
                raise RuntimeError(f"cannot compile {package}")
        self._compiled.add(root)

    @staticmethod
    def stop(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
