"""A booted Debian 12 root under systemd-nspawn for the real-systemd tests (test_systemd_units,
test_deb_package): an overlay over the root scripts/setup-host.sh caches
(/var/cache/koord-runtime-proxy/systemd-root; never written), ``systemd-nspawn -b`` started and
stopped by its pid, driven with ``nsenter -t <its systemd> -a``. The fixture's private containerd
answers on /run/containerd/containerd.sock inside (a symlink to its socket, bound in), and
kubelet's socket directory is bound out, so calls come from the host process, as kubelet's would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Final

import grpc

from criapi import cri_v1_pb2 as cri
from runtimeproxy.demo.embedded import unix_channel

REPO: Final = Path(__file__).resolve().parents[2]
ROOT_CACHE: Final = Path("/var/cache/koord-runtime-proxy/systemd-root")
PROXY: Final = "koord-runtime-proxy.service"
HAPROXY: Final = "koord-runtime-proxy-haproxy.service"
VERSION: Final = "/runtime.v1.RuntimeService/Version"
LIST: Final = "/runtime.v1.RuntimeService/ListContainers"
CALL_TIMEOUT: Final = 2.0
#: The test's drop-in: a short watchdog so that its test sees systemd act on it.
WATCHDOG_DROPIN: Final = "[Service]\nWatchdogSec=3s\nTimeoutAbortSec=2s\n"


def wait(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not {what} after {timeout}s")
        time.sleep(0.05)
    return time.monotonic() - start


def answers(sock: Path) -> bool:
    with unix_channel(sock) as channel:
        try:
            channel.unary_unary(VERSION)(cri.VersionRequest(version="v1").SerializeToString(), timeout=1.0)
        except grpc.RpcError:
            return False
    return True


class Machine:
    """One booted container: an overlay over the cached root, systemd-nspawn's pid, its systemd."""

    def __init__(self, base: Path, containerd_socket: Path) -> None:
        self.base = base
        self.name = f"krp-{uuid.uuid4().hex[:10]}"
        self.merged, self.upper, self.work = base / "root", base / "upper", base / "work"
        #: kubelet's socket directory, bound to /run/koord-runtimeproxy inside.
        self.run_dir = base / "krp"
        self.socket = self.run_dir / "runtimeproxy.sock"
        #: /run/containerd inside: empty until ``connect_containerd``.
        self.ctd_dir = base / "ctd"
        self.containerd_socket = containerd_socket
        self.nspawn: subprocess.Popen[bytes] | None = None
        self.pid = 0
        self._mounted = False

    # --- the root ----------------------------------------------------------------

    def mount(self) -> None:
        for d in (self.merged, self.upper, self.work, self.run_dir, self.ctd_dir):
            d.mkdir(mode=0o755)
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={ROOT_CACHE},upperdir={self.upper},workdir={self.work}", str(self.merged)],
                       check=True)
        self._mounted = True

    def prepare(self) -> None:
        """The wheel into the root's venv, the shipped units and config, as README's install steps."""
        self.mount()
        wheels = self.merged / "opt" / "krp-wheels"
        wheels.mkdir()
        # The project's wheel, and its dependencies' (pip's configuration and cache on the host).
        ours = not (REPO / "build").exists()  # setuptools builds in <repo>/build: removed if it made it
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)],
                               capture_output=True, text=True, check=False)
        if ours:
            shutil.rmtree(REPO / "build", ignore_errors=True)
        assert built.returncode == 0, built.stderr[-2000:]
        deps = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "-w", str(wheels),
                               "-r", str(REPO / "requirements.txt")],
                              capture_output=True, text=True, check=False)
        assert deps.returncode == 0, deps.stderr[-2000:]
        shutil.copy(REPO / "requirements.txt", wheels / "requirements.txt")
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
        # As README "Installing on a node": the pinned requirements, then the project.
        install = subprocess.run(
            ["chroot", str(self.merged), "/opt/koord-runtime-proxy/venv/bin/pip", "install", "-q", "--no-index",
             "--find-links", "/opt/krp-wheels", "-r", "/opt/krp-wheels/requirements.txt", "koord-runtime-proxy"],
            env=env, capture_output=True, text=True, check=False)
        assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
        units = self.merged / "etc" / "systemd" / "system"
        for unit in (PROXY, HAPROXY):
            shutil.copy(REPO / "systemd" / unit, units / unit)
        (units / f"{PROXY}.d").mkdir()
        (units / f"{PROXY}.d" / "50-test-watchdog.conf").write_text(WATCHDOG_DROPIN)
        wants = units / "multi-user.target.wants"
        wants.mkdir(exist_ok=True)
        (wants / PROXY).symlink_to(f"/etc/systemd/system/{PROXY}")  # `systemctl enable`
        etc = self.merged / "etc" / "koord-runtime-proxy"
        etc.mkdir(mode=0o755)
        (etc / "config.yaml").write_text((REPO / "systemd" / "config.yaml").read_text())
        (etc / "config.yaml").chmod(0o600)

    def boot(self) -> None:
        log = (self.base / "console.log").open("wb")
        sock_dir = self.containerd_socket.parent
        self.nspawn = subprocess.Popen(
            ["systemd-nspawn", "--register=no", "--keep-unit", "-b", "-q", "-D", str(self.merged),
             f"--machine={self.name}", "--private-network",
             f"--bind={self.run_dir}:/run/koord-runtimeproxy", f"--bind={self.ctd_dir}:/run/containerd",
             f"--bind={sock_dir}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()

        def systemd_pid() -> bool:
            assert self.nspawn is not None and self.nspawn.poll() is None, self.console()
            try:
                children = Path(f"/proc/{self.nspawn.pid}/task/{self.nspawn.pid}/children").read_text().split()
            except OSError:
                return False
            for child in children:
                if Path(f"/proc/{child}/comm").read_text().strip() == "systemd":
                    self.pid = int(child)
                    return True
            return False

        wait(systemd_pid, 30, "systemd started in the container")
        # Its bus socket appears a moment after it starts: until then systemctl cannot connect
        # (and `is-system-running` prints "offline", so that is not the test: a property read is).
        def bus_answers() -> bool:
            out = self.run(["systemctl", "show", "--property=Version", "--value"], check=False)
            return out.returncode == 0 and out.stdout.strip() != ""

        wait(bus_answers, 60, "systemd's bus answering")
        # Not `is-system-running --wait`: boot stays "starting" until the proxy is READY, and the
        # first test connects containerd only after it has seen the proxy wait for it.

    def console(self) -> str:
        return (self.base / "console.log").read_text(errors="replace")[-4000:]

    def shutdown(self) -> None:
        """SIGTERM to the nspawn we started: it powers the container off cleanly."""
        if self.nspawn is not None and self.nspawn.poll() is None:
            self.nspawn.terminate()
            try:
                self.nspawn.wait(60)
            except subprocess.TimeoutExpired:
                self.nspawn.kill()
                self.nspawn.wait(10)
        if self._mounted:
            subprocess.run(["umount", str(self.merged)], check=False)
            self._mounted = False
        shutil.rmtree(self.base, ignore_errors=True)

    # --- inside --------------------------------------------------------------------

    def run(self, argv: list[str], *, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            ["nsenter", "-t", str(self.pid), "-a", "env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", *argv],
            capture_output=True, text=True, timeout=timeout, check=False)
        if check:
            assert out.returncode == 0, f"{argv}: {out.returncode} {out.stdout[-2000:]} {out.stderr[-2000:]}"
        return out

    def systemctl(self, *args: str, check: bool = True) -> str:
        return self.run(["systemctl", *args], check=check).stdout.strip()

    def show(self, unit: str, prop: str) -> str:
        return self.systemctl("show", "--value", f"--property={prop}", unit)

    def main_pid(self, unit: str) -> int:
        return int(self.show(unit, "MainPID"))

    def host_pid(self, pid_in_container: int) -> int:
        """The host's pid of a process of the container (its pid namespace nests in ours)."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ns = [line for line in (entry / "status").read_text().splitlines() if line.startswith("NSpid:")]
            except OSError:
                continue
            pids = ns[0].split()[1:] if ns else []
            if len(pids) >= 2 and int(pids[-1]) == pid_in_container and self._in_container(entry):
                return int(entry.name)
        raise AssertionError(f"no host pid for container pid {pid_in_container}")

    def processes(self, comm: str) -> list[int]:
        """The host pids of the container's processes named ``comm``."""
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and (entry / "comm").read_text().strip() == comm and self._in_container(entry):
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    def _in_container(self, proc: Path) -> bool:
        try:
            return os.readlink(proc / "ns" / "pid") == os.readlink(f"/proc/{self.pid}/ns/pid")
        except OSError:
            return False

    def journal(self, unit: str) -> str:
        return self.run(["journalctl", "-q", "-o", "cat", "--no-pager", "-u", unit], check=False).stdout

    def connect_containerd(self) -> None:
        link = self.ctd_dir / "containerd.sock"
        if not link.is_symlink():
            link.symlink_to(self.containerd_socket)

    def ready(self) -> None:
        """containerd connected, both units active (a test may run alone: ``-k``)."""
        self.connect_containerd()
        for unit in (HAPROXY, PROXY):
            wait(lambda u=unit: self.show(u, "ActiveState") == "active", 60, f"{unit} active")


class Clients:
    """``n`` threads calling ``method`` in a loop through kubelet's socket, each its own channel."""

    def __init__(self, sock: Path, method: str = LIST, n: int = 5) -> None:
        self.outcomes: Counter[str] = Counter()
        self.slowest = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(sock, method), daemon=True) for _ in range(n)]

    def _loop(self, sock: Path, method: str) -> None:
        payload = cri.VersionRequest(version="v1").SerializeToString() if method == VERSION else b""
        with unix_channel(sock) as channel:
            call = channel.unary_unary(method)
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    call(payload, timeout=CALL_TIMEOUT)
                    outcome = "OK"
                except grpc.RpcError as exc:
                    outcome = f"{exc.code().name}: {exc.details()}"
                with self._lock:
                    self.outcomes[outcome] += 1
                    self.slowest = max(self.slowest, time.monotonic() - start)
                if outcome != "OK":
                    time.sleep(0.01)

    def ok(self) -> int:
        with self._lock:
            return self.outcomes["OK"]

    def more(self, n: int, timeout: float = 30) -> None:
        """Until ``n`` more calls succeeded."""
        target = self.ok() + n
        wait(lambda: self.ok() >= target, timeout, f"{n} more calls answered")

    def __enter__(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)
