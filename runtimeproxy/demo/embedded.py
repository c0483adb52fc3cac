"""A private, throw-away containerd for demos and integration tests.

The machine's real containerd (if any) and its cgroup tree are shared with
other users, so everything here lives under one base directory: root, state,
sockets, CNI config and the runc state root.  Images are built offline from
the host's static busybox, because no registry is reachable (``runtimeproxy.demo.embeddedimage``;
cgroup helpers for tests are in ``runtimeproxy.demo.embeddedcgroup``).

Gotchas this module encodes (all found the hard way):

* Without ``CAP_SYS_RESOURCE`` runc cannot lower ``oom_score_adj`` and every
  sandbox dies with "can't get final child's PID from pipe"; the CRI option
  ``restrict_oom_score_adj = true`` makes containerd clamp the value instead.
* The pause image's entrypoint is a busybox ``sleep``; it is PID 1 in its pid
  namespace, so it ignores SIGTERM and must be stopped with SIGKILL (which is
  what containerd's StopPodSandbox does).
* The CNI config is loopback-only by default (``cni_conflist`` gives another): CRI reports the network as ready and
  host-network pods work, but pods in their own network namespace fail
  because no interface gets an IP.  This keeps the shared host free of
  bridges and iptables rules.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import grpc

from criapi import cri_v1_pb2, cri_v1_pb2_grpc
from runtimeproxy.demo.embeddedimage import DEFAULT_PATH, PAUSE_IMAGE

CRI_NAMESPACE = "k8s.io"
#: containerd 1.7.24 (NRI v0.6.1), unpacked from Debian 13's package by scripts/setup-host.sh.
CONTAINERD_17 = Path("/var/cache/koord-runtime-proxy/containerd-1.7/usr/bin/containerd")
GRPC_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_RUNC_BIN = "runc"
_UNIX_SOCKET_MAX = 107
_MNT_DETACH = 2


# --------------------------------------------------------------------------
# gRPC helpers
# --------------------------------------------------------------------------


def unix_channel(socket: Path | str) -> grpc.Channel:
    """Open an insecure gRPC channel to a unix socket with 16 MiB message limits.

    Kubelet uses 16 MiB too; the grpc default of 4 MiB is too small for
    ListContainers on busy nodes.
    """
    return grpc.insecure_channel(
        f"unix://{socket}",
        options=[("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
                 ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES)],
    )


# --------------------------------------------------------------------------
# process / mount helpers
# --------------------------------------------------------------------------


def _proc_cmdline(pid: int) -> list[str]:
    """argv of a process, empty if it is gone or unreadable."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _proc_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time), None if the pid is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _all_pids() -> Iterator[int]:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield int(entry)


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal one pid, ignoring processes that already went away."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _flag(argv: Sequence[str], name: str) -> str:
    """Value following a ``-flag`` in argv, or "" when absent."""
    try:
        return argv[argv.index(name) + 1]
    except (ValueError, IndexError):
        return ""


def _shim_socket(address: str, namespace: str, task_id: str) -> Path:
    """Where containerd 1.6 (shim.SocketAddress) puts a task's shim socket."""
    digest = hashlib.sha256(os.path.join(address, namespace, task_id).encode()).hexdigest()
    return Path("/run/containerd/s") / digest


def _unescape_mountinfo(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def mounts_under(base: Path) -> list[Path]:
    """Mount points below base in this mount namespace, deepest first."""
    prefix = str(base.resolve()).rstrip("/") + "/"
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = _unescape_mountinfo(line.split()[4])
        if point.startswith(prefix):
            found.append(Path(point))
    return sorted(set(found), key=lambda p: (len(p.parts), str(p)), reverse=True)


def remove_workdir(base: Path) -> bool:
    """Delete a private work dir (containerd root, image tarballs, sockets) once nothing
    is mounted below it; False when it was kept. ``rmtree`` would descend into a mount
    left behind (a container's rootfs) and delete what belongs to it, so it never runs then."""
    if not base.exists():
        return True
    if mounts_under(base):
        return False
    shutil.rmtree(base, ignore_errors=True)
    return not base.exists()


def _lazy_umount(path: Path) -> None:
    """umount -l: detach even if something still holds the mount busy."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(os.fsencode(path), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (2, 22):  # ENOENT / EINVAL: already gone
            raise OSError(err, os.strerror(err), str(path))


# --------------------------------------------------------------------------
# containerd
# --------------------------------------------------------------------------


def _toml_str(value: str | Path) -> str:
    """TOML basic string (json escaping is a valid subset)."""
    return json.dumps(str(value))


class EmbeddedContainerd:
    """One private containerd process with the CRI plugin, rooted in base_dir.

    Use as a context manager, or call start()/stop().  stop() is idempotent
    and safe after a partial start, so fixtures can always call it.
    """

    def __init__(self, base_dir: Path, sandbox_image: str = PAUSE_IMAGE, *, binary: Path | None = None,
                 nri_socket: Path | None = None, cni_conflist: dict[str, Any] | None = None) -> None:
        self.base_dir = base_dir.resolve()
        self.sandbox_image = sandbox_image
        #: Another containerd (e.g. 1.7.24 from CONTAINERD_17); its directory goes first on PATH so
        #: containerd starts its own shim. None: the one on PATH.
        self.binary = binary
        #: NRI on, its socket here (containerd >= 1.7); None: NRI off.
        self.nri_socket = nri_socket
        #: The CNI network (a conflist document, plugins from /usr/lib/cni); None: loopback only.
        self.cni_conflist = cni_conflist
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: io.BufferedWriter | None = None
        if len(str(self.socket)) + len(".ttrpc") > _UNIX_SOCKET_MAX:
            raise ValueError(f"base_dir too long for a unix socket path: {self.base_dir}")

    # -- paths ------------------------------------------------------------

    @property
    def socket(self) -> Path:
        """The CRI/containerd gRPC socket (also used by ctr -a)."""
        return self.base_dir / "containerd.sock"

    @property
    def config_path(self) -> Path:
        return self.base_dir / "config.toml"

    @property
    def log_path(self) -> Path:
        return self.base_dir / "containerd.log"

    @property
    def runc_root(self) -> Path:
        """Private runc state root, so leftovers can be found and killed."""
        return self.base_dir / "runc"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -- config -----------------------------------------------------------

    def render_config(self) -> str:
        """containerd 1.6 config (version 2) keeping every path private."""
        b = self.base_dir
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        runc = f'{cri}.containerd.runtimes.runc'
        return f"""version = 2
root = {_toml_str(b / "root")}
state = {_toml_str(b / "state")}
oom_score = 0
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = {_toml_str(self.socket)}
  max_recv_message_size = {GRPC_MAX_MESSAGE_BYTES}
  max_send_message_size = {GRPC_MAX_MESSAGE_BYTES}

[ttrpc]
  address = {_toml_str(str(self.socket) + ".ttrpc")}

[debug]
  address = ""
  level = "info"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = {_toml_str(b / "opt")}

[{cri}]
  sandbox_image = {_toml_str(self.sandbox_image)}
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  disable_apparmor = true
  max_container_log_line_size = 16384
  netns_mounts_under_state_dir = true

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{runc}]
  runtime_type = "io.containerd.runc.v2"

[{runc}.options]
  SystemdCgroup = false
  BinaryName = {_toml_str(shutil.which(_RUNC_BIN) or _RUNC_BIN)}
  Root = {_toml_str(self.runc_root)}

[{cri}.cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = {_toml_str(b / "cni" / "net.d")}
  max_conf_num = 1
""" + self._nri_config()

    def _nri_config(self) -> str:
        """NRI (containerd 1.7: off unless asked), every path private."""
        if self.nri_socket is None:
            return ""
        b = self.base_dir
        return f"""
[plugins."io.containerd.nri.v1.nri"]
  disable = false
  socket_path = {_toml_str(self.nri_socket)}
  plugin_path = {_toml_str(b / "nri" / "plugins")}
  plugin_config_path = {_toml_str(b / "nri" / "conf.d")}
"""

    def _write_cni_config(self) -> None:
        """Loopback-only network: CRI says NetworkReady without touching the host (unless
        ``cni_conflist`` names another network; its caller cleans up what it creates)."""
        conf_dir = self.base_dir / "cni" / "net.d"
        conf_dir.mkdir(parents=True, exist_ok=True)
        conf = {"cniVersion": "0.4.0", "name": "koord-loopback", "plugins": [{"type": "loopback"}]}
        conf = self.cni_conflist or conf
        (conf_dir / f"10-{conf['name']}.conflist").write_text(json.dumps(conf, indent=2))

    # -- lifecycle --------------------------------------------------------

    def start(self, timeout: float = 30.0) -> None:
        """Launch containerd and block until CRI answers Version."""
        if self._proc is not None:
            raise RuntimeError("containerd already started")
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.render_config())
        self._write_cni_config()
        self.socket.unlink(missing_ok=True)
        self._log = open(self.log_path, "ab")
        env = self._env()
        # own session: a ^C in the terminal must not kill containerd before
        # stop() had the chance to tear pods down through CRI.
        self._proc = subprocess.Popen(
            [str(self.binary or "containerd"), "--config", str(self.config_path)],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True,
        )
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def restart(self, timeout: float = 30.0) -> None:
        """Stop containerd alone (its pods keep running under their shims) and start it
        again on the same root: what a package upgrade or a crash does."""
        if self._proc is not None and self._proc.poll() is None:
            self._terminate_containerd()
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        self.start(timeout)

    def _env(self) -> dict[str, str]:
        """containerd's and ctr's environment: what they make in TMPDIR (mount points
        of an image unpack, volume copies) stays under base_dir, so it goes with it
        even when a process is killed halfway."""
        tmp = self.base_dir / "tmp"
        tmp.mkdir(mode=0o700, exist_ok=True)
        path = os.environ.get("PATH", "") + ":" + DEFAULT_PATH
        if self.binary is not None:
            path = f"{self.binary.parent}:{path}"
        return dict(os.environ, PATH=path, TMPDIR=str(tmp))

    def _wait_ready(self, timeout: float) -> None:
        """Poll until the socket exists and the CRI plugin is loaded."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"containerd exited early ({self._proc.returncode}):\n{self.log_tail()}")
            if self.socket.exists():
                try:
                    self.version()
                    return
                except grpc.RpcError as exc:
                    last = exc
            time.sleep(0.05)
        raise TimeoutError(f"containerd not ready after {timeout}s ({last}):\n{self.log_tail()}")

    def version(self) -> cri_v1_pb2.VersionResponse:
        """CRI Version; used as the readiness probe."""
        with unix_channel(self.socket) as ch:
            resp: cri_v1_pb2.VersionResponse = runtime_stub(ch).Version(
                cri_v1_pb2.VersionRequest(), timeout=2)
            return resp

    def log_tail(self, lines: int = 40) -> str:
        """Last lines of containerd.log, for error messages."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def import_image(self, tar: Path) -> None:
        """Import (and unpack) an image archive into the CRI namespace."""
        proc = subprocess.run(
            ["ctr", "-a", str(self.socket), "-n", CRI_NAMESPACE, "images", "import", str(tar)],
            check=False, capture_output=True, text=True, timeout=120, env=self._env(),
        )
        if proc.returncode != 0:
            raise RuntimeError(f"ctr import {tar} failed: {proc.stderr.strip()}")

    def stop(self) -> None:
        """Tear everything down; never raises for things already gone."""
        if self._proc is not None and self._proc.poll() is None:
            self._remove_pods_via_cri()
            self._terminate_containerd()
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        self._kill_leftover_containers()
        self._kill_leftover_shims()
        for mount in mounts_under(self.base_dir):
            _lazy_umount(mount)

    def _remove_pods_via_cri(self) -> None:
        """Stop and remove all containers and sandboxes so shims exit cleanly."""
        try:
            with unix_channel(self.socket) as ch:
                stub = runtime_stub(ch)
                for c in stub.ListContainers(cri_v1_pb2.ListContainersRequest(), timeout=10).containers:
                    _remove_container(stub, c.id)
                for s in stub.ListPodSandbox(cri_v1_pb2.ListPodSandboxRequest(), timeout=10).items:
                    _remove_sandbox(stub, s.id)
        except grpc.RpcError:
            pass  # containerd is broken; the pid-based fallback in stop() cleans up

    def _terminate_containerd(self, grace: float = 10.0) -> None:
        """SIGTERM our containerd, SIGKILL it if it does not exit in time."""
        assert self._proc is not None
        self._proc.terminate()
        try:
            self._proc.wait(grace)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _kill_leftover_containers(self) -> None:
        """Kill container init processes recorded in our private runc root.

        The recorded start time is compared with /proc so that a recycled
        pid belonging to someone else is never hit.
        """
        for state_file in self.runc_root.glob("*/*/state.json"):
            try:
                state = json.loads(state_file.read_text())
                pid, start = int(state["init_process_pid"]), int(state["init_process_start"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if pid > 0 and _proc_start_ticks(pid) == start:
                _kill(pid)

    def _kill_leftover_shims(self) -> None:
        """Kill containerd shims whose argv names our socket, and only those.

        A killed shim cannot remove its socket, which containerd 1.6 always
        puts in /run/containerd/s, so remove it for the shim.
        """
        ours = str(self.socket)
        for pid in _all_pids():
            argv = _proc_cmdline(pid)
            if argv and "containerd-shim" in Path(argv[0]).name and ours in argv:
                _kill(pid)
                _shim_socket(ours, _flag(argv, "-namespace"), _flag(argv, "-id")).unlink(missing_ok=True)

    # -- context manager -------------------------------------------------

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def runtime_stub(channel: grpc.Channel) -> Any:
    """CRI RuntimeServiceStub, typed Any: the generated grpc module is untyped."""
    factory: Callable[[grpc.Channel], Any] = cri_v1_pb2_grpc.RuntimeServiceStub
    return factory(channel)


def _best_effort(call: Callable[[], object]) -> None:
    """Run a cleanup RPC; one failing must not prevent the others."""
    try:
        call()
    except grpc.RpcError:
        pass


def _remove_container(stub: Any, cid: str) -> None:
    """timeout=0 means SIGKILL right away: we are tearing down, not draining."""
    _best_effort(lambda: stub.StopContainer(
        cri_v1_pb2.StopContainerRequest(container_id=cid, timeout=0), timeout=30))
    _best_effort(lambda: stub.RemoveContainer(
        cri_v1_pb2.RemoveContainerRequest(container_id=cid), timeout=30))


def _remove_sandbox(stub: Any, sid: str) -> None:
    """Stopping the sandbox also tears down its network and shm mount."""
    _best_effort(lambda: stub.StopPodSandbox(
        cri_v1_pb2.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=30))
    _best_effort(lambda: stub.RemovePodSandbox(
        cri_v1_pb2.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=30))
