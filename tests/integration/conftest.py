"""Session fixtures: one private containerd (CRI) for the integration tests.

Everything runs against a containerd rooted in a pytest tmp dir, with its own
socket, so the machine's real runtime is never touched.  Test pods live under
a unique top-level cgroup parent that is removed at session end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from criapi import cri_v1_pb2
from runtimeproxy.config.confignet import find_haproxy
from runtimeproxy.demo.devpods import QoSClass, container_config, kube_cgroup_parent, sandbox_config
from runtimeproxy.demo.embedded import EmbeddedContainerd, runtime_stub, unix_channel
from runtimeproxy.demo.embeddedcgroup import remove_cgroup_tree, unique_test_parent
from runtimeproxy.demo.embeddedimage import BUSYBOX_IMAGE, build_busybox_image, build_pause_image
from tests import tmpnames

_HERE = Path(__file__).parent
_REQUIRED_BINARIES = ("containerd", "containerd-shim-runc-v2", "runc", "ctr")


def _skip_reason() -> str | None:
    """Why this machine cannot run a real containerd, or None if it can."""
    if os.geteuid() != 0:
        return "integration tests need root (they run a private containerd)"
    missing = [b for b in _REQUIRED_BINARIES if shutil.which(b) is None]
    if missing:
        return f"integration tests need {', '.join(missing)} on PATH"
    if not Path("/bin/busybox").is_file():
        return "integration tests need a static /bin/busybox (apt install busybox-static)"
    return None


# --------------------------------------------------------------------------
# Under CI the integration suite runs or the run fails: never a silent skip
# --------------------------------------------------------------------------

#: Skips of single integration tests that CI accepts: (test id within this directory,
#: regular expression the skip reason must match, why it is acceptable). A hardware
#: or kernel feature the CI host may lack; anything else skipped under CI fails it.
ALLOWED_SKIPS: tuple[tuple[str, str, str], ...] = (
    ("test_schedlat_real.py::test_ebpf_latency_rises_under_contention", r"^eBPF source unavailable",
     "the eBPF source is optional (kernel without BPF/BTF or bcc); schedstat is measured by its own test"),
    ("test_memory_numa_stat_real.py::", r"numa_stat has no hierarchical totals",
     "kernels before hierarchical numa_stat totals: the collector falls back to memory.stat, unit-tested"),
)

_SKIPS_KEY = pytest.StashKey[list[tuple[str, str]]]()


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _ours(path: Path) -> bool:
    return _HERE in path.parents


def _allowed(test_id: str, reason: str) -> bool:
    return any(test_id.startswith(prefix) and re.search(pattern, reason)
               for prefix, pattern, _why in ALLOWED_SKIPS)


def _skip_text(longrepr: object) -> str:
    # A skip's longrepr is (file, line, "Skipped: reason").
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


#: Every dir the tests and fixtures make in /tmp starts ``krpt<session>-``
#: (tests/tmpnames.py): the run must leave none of its own behind. Entries without
#: this session's tag belong to another run sharing the machine (a clone-alone run
#: beside CI) and are not this run's to count. What the code under test makes there
#: (the demo's ``krp-`` root) is checked by the test that runs it.
_TMP = Path("/tmp")
_TMP_LEFT_KEY = pytest.StashKey[list[str]]()


def _our_tmp_entries() -> set[str]:
    try:
        return {name for name in os.listdir(_TMP) if name.startswith(tmpnames.PREFIX)}
    except OSError:
        return set()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_SKIPS_KEY] = []
    config.stash[_TMP_LEFT_KEY] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every test in this directory with a clear reason when unsupported; under
    CI (``CI=true``) that is an error: the run fails before any test runs."""
    reason = _skip_reason()
    if reason is None:
        return
    ours = [item for item in items if _ours(item.path)]
    if not ours:
        return
    if _under_ci():
        raise pytest.UsageError(
            f"CI=true but the integration suite ({len(ours)} tests in {_HERE}) cannot run here: {reason}. "
            "Under CI it must run or the run fails; run as root with containerd, runc and busybox-static installed."
        )
    marker = pytest.mark.skip(reason=reason)
    for item in ours:
        item.add_marker(marker)


def _note_skip(config: pytest.Config, path: Path, report: pytest.TestReport | pytest.CollectReport) -> None:
    """Remember a skip in this directory that ``ALLOWED_SKIPS`` does not accept."""
    if not report.skipped or hasattr(report, "wasxfail") or not _ours(path):
        return
    test_id = path.relative_to(_HERE).as_posix()
    if "::" in report.nodeid:
        test_id += "::" + report.nodeid.split("::", 1)[1]
    reason = _skip_text(report.longrepr)
    if not _allowed(test_id, reason):
        config.stash[_SKIPS_KEY].append((report.nodeid, reason))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome: Any = yield
    _note_skip(item.config, item.path, outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome: Any = yield  # a module that skips itself (``allow_module_level``)
    _note_skip(collector.config, collector.path, outcome.get_result())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under CI, a skip in this directory that ``ALLOWED_SKIPS`` does not list fails the
    run, and so does a ``/tmp/krpt<session>-*`` entry this run made and left (every
    fixture has torn down by now); outside CI it is only shown."""
    left = sorted(_our_tmp_entries())
    session.config.stash[_TMP_LEFT_KEY] = left
    if _under_ci() and (session.config.stash[_SKIPS_KEY] or left) and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    left = config.stash[_TMP_LEFT_KEY]
    if left:
        terminalreporter.section("left in /tmp", sep="=", red=_under_ci(), bold=True)
        terminalreporter.line(f"{len(left)} /tmp/{tmpnames.PREFIX}* entries left after the run"
                              f"{' (the run fails under CI)' if _under_ci() else ''}: "
                              + ", ".join(left[:20]))
    skipped = config.stash[_SKIPS_KEY]
    if not skipped or not _under_ci():
        return
    terminalreporter.section("integration tests skipped under CI", sep="=", red=True, bold=True)
    for nodeid, reason in skipped:
        terminalreporter.line(f"SKIPPED {nodeid}: {reason}")
    terminalreporter.line(f"CI=true: {len(skipped)} integration test(s) skipped without being listed in "
                          f"ALLOWED_SKIPS ({_HERE / 'conftest.py'}); the run fails.", red=True)


@pytest.fixture(scope="session")
def busybox_image() -> str:
    """Ref of the offline busybox image imported into the containerd fixture."""
    return BUSYBOX_IMAGE


@pytest.fixture(scope="session")
def containerd(
    tmp_path_factory: pytest.TempPathFactory, cgroup_prefix: str
) -> Iterator[EmbeddedContainerd]:
    """A started private containerd with the busybox and pause images imported.

    Depends on cgroup_prefix only for teardown order: containerd must have
    removed its pods before the cgroup tree can be deleted.
    """
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    base = tmp_path_factory.mktemp("containerd")
    images = build_busybox_image(base / "images"), build_pause_image(base / "images")
    ctrd = EmbeddedContainerd(base / "run")
    try:
        ctrd.start()
        for tar in images:
            ctrd.import_image(tar)
        yield ctrd
    finally:
        ctrd.stop()


@pytest.fixture(scope="module")
def db_dir(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A private (0700) directory for the module's metrics store, removed after its last
    test: ``/tmp/krpt<session>-<module>-<hex>``, made when first asked for (not at import, so a
    module collected but not run leaves nothing behind)."""
    name = request.module.__name__.rpartition(".")[2].removeprefix("test_")
    path = tmpnames.unique(name)
    path.mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def cgroup_prefix() -> Iterator[str]:
    """A unique cgroup parent (``/koord-test-<hex>``), removed at session end."""
    prefix = unique_test_parent()
    yield prefix
    remove_cgroup_tree(prefix)


@pytest.fixture(scope="session")
def cri_channel_factory() -> Iterator[Callable[[Path | str], grpc.Channel]]:
    """Open gRPC channels to unix sockets (16 MiB limits); closed at session end."""
    channels: list[grpc.Channel] = []

    def factory(socket: Path | str) -> grpc.Channel:
        channel = unix_channel(socket)
        channels.append(channel)
        return channel

    yield factory
    for channel in channels:
        channel.close()


# --------------------------------------------------------------------------
# The real proxy as a subprocess, and kubelet-like pods
# --------------------------------------------------------------------------

PROXY_READY_TIMEOUT = 30.0
CGROUP_ROOT = Path("/sys/fs/cgroup")


def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """GET on the proxy's metrics endpoint; (0, b"") when nothing answers."""
    url = f"http://127.0.0.1:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # loopback only
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()
    except OSError:
        return 0, b""


def proxy_config_doc(
    *, listen: Path, backend: Path | str, metrics_port: int, hooks: Sequence[Mapping[str, Any]] = (),
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The YAML document a test proxy runs with (JSON logs, no hookserver.d); metrics_port 0
    lets the proxy pick a free port (see ``ProxyProcess.metrics_port``)."""
    doc: dict[str, Any] = {
        "listen": str(listen),
        "backend": {"runtime_endpoint": str(backend)},
        "metrics": {"listen": f"127.0.0.1:{metrics_port}"},
        "hookserver_dir": "",
        "log": {"level": "info", "format": "json"},
        "hooks": [dict(h) for h in hooks],
    }
    doc.update(extra or {})
    return doc


class ProxyProcess:
    """One ``koord-runtime-proxy run`` subprocess, its files and its channels.

    The metrics endpoint listens on port 0 (a port picked in advance could be taken by
    anything on the machine before the proxy binds it); the port it got is read from
    the proxy's ``http_listening`` log line.
    """

    def __init__(
        self, *, workdir: Path, socket_path: Path, config_path: Path, env: Mapping[str, str],
        command: Sequence[str] = (sys.executable, "-m", "runtimeproxy.cli"),
    ) -> None:
        self.workdir = workdir
        self.socket = socket_path
        self._metrics_port: int | None = None
        self.config_path = config_path
        self.log_path = workdir / "proxy.log"
        self.exit_code: int | None = None
        self._channels: list[grpc.Channel] = []
        self._log_file = open(self.log_path, "wb")  # closed in wait_exit()
        self.proc = subprocess.Popen(
            [*command, "run", "--config", str(config_path)],
            stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=workdir, env=dict(env),
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    @property
    def metrics_port(self) -> int:
        """The port the metrics endpoint bound (AssertionError before it has)."""
        if self._metrics_port is None:
            listening = self.events("http_listening")
            if not listening:
                raise AssertionError(f"proxy {self.pid} has not logged http_listening yet:\n{self.log()}")
            self._metrics_port = int(listening[-1]["port"])
        return self._metrics_port

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.metrics_port}"

    def cri_calls(self, method: str, path: str = "intercepted") -> float:
        """``koord_runtime_proxy_cri_calls_total`` of a RuntimeService method on ``path``
        (intercepted: counted by Python as the call arrives; passthrough: HAProxy's)."""
        status, body = http_get(self.metrics_port, "/metrics", timeout=5)
        assert status == 200, body
        labels = {"method": f"/runtime.v1.RuntimeService/{method}", "path": path}
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                if sample.name == "koord_runtime_proxy_cri_calls_total" and sample.labels == labels:
                    return float(sample.value)
        return 0.0

    # -- logs --------------------------------------------------------------

    def log(self) -> str:
        """Everything the proxy wrote to stdout/stderr so far."""
        return self.log_path.read_text(errors="replace")

    def events(self, event: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """Parsed JSON log lines, optionally filtered by event name and field values."""
        out = []
        for line in self.log().splitlines():
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if event is not None and rec.get("event") != event:
                continue
            if all(rec.get(k) == v for k, v in match.items()):
                out.append(rec)
        return out

    def wait_event(self, event: str, timeout: float = 10.0, *, count: int = 1, **match: Any) -> dict[str, Any]:
        """Wait until the log has ``count`` matching events; return the last one."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.events(event, **match)
            if len(found) >= count:
                return found[count - 1]
            if time.monotonic() > deadline:
                raise AssertionError(f"no {event!r} {match} in the proxy log after {timeout}s:\n{self.log()}")
            time.sleep(0.05)

    # -- health ------------------------------------------------------------

    def healthz(self) -> int:
        """The /healthz status; 0 while nothing answers (not listening yet, or gone)."""
        if self._metrics_port is None and not self.events("http_listening"):
            return 0
        return http_get(self.metrics_port, "/healthz")[0]

    def wait_healthy(self, timeout: float = PROXY_READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while self.healthz() != 200:
            if not self.running:
                raise AssertionError(f"proxy exited ({self.proc.returncode}) before ready:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"proxy not healthy after {timeout}s:\n{self.log()}")
            time.sleep(0.05)

    # -- gRPC --------------------------------------------------------------

    def channel(self) -> grpc.Channel:
        """A new channel to the proxy socket, closed when the proxy is stopped."""
        channel = unix_channel(self.socket)
        self._channels.append(channel)
        return channel

    def runtime(self) -> Any:
        return runtime_stub(self.channel())

    # -- config / signals / exit --------------------------------------------

    def write_config(self, doc: Mapping[str, Any]) -> None:
        """Replace the config file atomically (as editors and config managers do)."""
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(dict(doc), sort_keys=False))
        os.replace(tmp, self.config_path)

    def config(self) -> dict[str, Any]:
        data: dict[str, Any] = yaml.safe_load(self.config_path.read_text())
        return data

    def send(self, sig: int) -> None:
        """Signal this proxy, by pid, only while it is still our running child."""
        if self.running:
            os.kill(self.pid, sig)

    def wait_exit(self, timeout: float = 30.0) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"proxy {self.pid} did not exit within {timeout}s:\n{self.log()}") from None
        self.exit_code = code
        self._close()
        return code

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM by pid and wait; returns the exit status."""
        self.send(signal.SIGTERM)
        return self.wait_exit(timeout)

    def _close(self) -> None:
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        if not self._log_file.closed:
            self._log_file.close()


class ProxyLauncher:
    """Starts proxies against the fixture containerd and stops whatever is left."""

    def __init__(self, backend: Path) -> None:
        self.backend = backend
        self.started: list[ProxyProcess] = []
        self._dirs: list[Path] = []

    def mkdtemp(self) -> Path:
        """A short private dir in /tmp (unix socket paths must stay under 108 bytes)."""
        path = tmpnames.mkdtemp()
        self._dirs.append(path)
        return path

    def start(
        self,
        hooks: Sequence[Mapping[str, Any]] = (),
        *,
        socket_path: Path | None = None,
        backend: Path | str | None = None,
        extra: Mapping[str, Any] | None = None,
        pythonpath: Sequence[Path] = (),
        wait_ready: bool = True,
    ) -> ProxyProcess:
        workdir = self.mkdtemp()
        listen = socket_path or workdir / "proxy.sock"
        config_path = workdir / "config.yaml"
        doc = proxy_config_doc(listen=listen, backend=backend or self.backend, metrics_port=0,
                               hooks=hooks, extra={"state_dir": str(workdir / "state"), **(extra or {})})
        config_path.write_text(yaml.safe_dump(doc, sort_keys=False))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if pythonpath:
            env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), env.get("PYTHONPATH", "")]).rstrip(":")
        proxy = ProxyProcess(workdir=workdir, socket_path=listen, config_path=config_path, env=env)
        self.started.append(proxy)
        if wait_ready:
            proxy.wait_healthy()
        return proxy

    def cleanup(self) -> list[str]:
        """Stop running proxies (SIGTERM by pid); return complaints about unclean exits."""
        problems = []
        for proxy in self.started:
            if proxy.exit_code is None:
                code = proxy.terminate()
                if code != 0:
                    problems.append(f"proxy {proxy.pid} exited {code}:\n{proxy.log()[-4000:]}")
        for path in self._dirs:
            shutil.rmtree(path, ignore_errors=True)
        return problems


@pytest.fixture
def proxy_factory(containerd: EmbeddedContainerd) -> Iterator[ProxyLauncher]:
    """Start extra proxies inside one test; all are SIGTERMed (exit 0 expected) after it."""
    launcher = ProxyLauncher(containerd.socket)
    yield launcher
    problems = launcher.cleanup()
    assert not problems, "\n".join(problems)


#: Both data planes run the parity suites: a module's ``proxy_config`` asks for the
#: ``data_plane`` fixture (parametrized over these) and includes it.
DATA_PLANES = ("grpc", "haproxy")


def data_plane_config(name: str) -> dict[str, Any]:
    """The proxy settings selecting this data plane. A missing haproxy skips, except
    under CI (scripts/setup-host.sh installs it): there it fails the test."""
    if name == "haproxy" and find_haproxy() is None:
        if _under_ci():
            pytest.fail("haproxy is not installed; scripts/setup-host.sh installs it (apt install haproxy)")
        pytest.skip("haproxy is not installed (apt install haproxy)")
    return {"data_plane": name}


@pytest.fixture(scope="module", params=DATA_PLANES)
def data_plane(request: pytest.FixtureRequest) -> dict[str, Any]:
    """``{"data_plane": name}`` for each data plane in turn (module scope: one proxy each)."""
    return data_plane_config(str(request.param))


@pytest.fixture
def haproxy_data_plane() -> dict[str, Any]:
    """``{"data_plane": "haproxy"}`` (skips without haproxy; fails under CI)."""
    return data_plane_config("haproxy")


@pytest.fixture(scope="module")
def proxy_config() -> dict[str, Any]:
    """Per-module proxy settings (``hooks`` plus any top-level keys); override in a test module."""
    return {}


@pytest.fixture(scope="module")
def proxy(containerd: EmbeddedContainerd, proxy_config: dict[str, Any]) -> Iterator[ProxyProcess]:
    """The real proxy (``python -m runtimeproxy.cli run``) in front of the fixture containerd.

    Ready means /healthz answers 200: containerd answered Version and the store was
    rebuilt. Teardown sends SIGTERM by pid and requires exit status 0.
    """
    launcher = ProxyLauncher(containerd.socket)
    extra = {k: v for k, v in proxy_config.items() if k != "hooks"}
    try:
        yield launcher.start(proxy_config.get("hooks", ()), extra=extra)
    finally:
        problems = launcher.cleanup()
    assert not problems, "\n".join(problems)


class PodKit:
    """Kubelet-shaped pods under the test cgroup prefix, removed after the test.

    Pods and containers may be created through any stub (proxy or direct); cleanup
    always goes straight to containerd so it works even when the proxy is gone.
    """

    def __init__(self, direct: Any, prefix: str, log_root: Path, busybox: str) -> None:
        self.direct = direct
        self.prefix = prefix
        self.log_root = log_root
        self.busybox = busybox
        self._sandboxes: list[str] = []
        self._containers: list[str] = []
        self._pod_parents: list[str] = []

    def sandbox(
        self, name: str, *, qos: QoSClass = "burstable", namespace: str = "krp-test", uid: str | None = None,
        labels: Mapping[str, str] | None = None, annotations: Mapping[str, str] | None = None,
    ) -> cri_v1_pb2.PodSandboxConfig:
        uid = uid or str(uuid.uuid4())
        return sandbox_config(
            name=name, namespace=namespace, uid=uid, cgroup_parent=kube_cgroup_parent(self.prefix, qos, uid),
            log_dir=str(self.log_root / uid), labels=labels, annotations=annotations,
        )

    def container(
        self, name: str = "app", *, command: Sequence[str] = ("sleep", "3600"),
        resources: cri_v1_pb2.LinuxContainerResources | None = None, envs: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> cri_v1_pb2.ContainerConfig:
        return container_config(name=name, image=self.busybox, command=list(command), resources=resources,
                                envs=envs, annotations=annotations)

    def run(self, rt: Any, pod: cri_v1_pb2.PodSandboxConfig) -> str:
        self._pod_parents.append(pod.linux.cgroup_parent)
        sid: str = rt.RunPodSandbox(cri_v1_pb2.RunPodSandboxRequest(config=pod), timeout=60).pod_sandbox_id
        self._sandboxes.append(sid)
        return sid

    def create(self, rt: Any, sid: str, pod: cri_v1_pb2.PodSandboxConfig, cfg: cri_v1_pb2.ContainerConfig) -> str:
        req = cri_v1_pb2.CreateContainerRequest(pod_sandbox_id=sid, config=cfg, sandbox_config=pod)
        cid: str = rt.CreateContainer(req, timeout=60).container_id
        self._containers.append(cid)
        return cid

    def start(self, rt: Any, cid: str) -> None:
        rt.StartContainer(cri_v1_pb2.StartContainerRequest(container_id=cid), timeout=60)

    def pod_dir(self, pod: cri_v1_pb2.PodSandboxConfig, controller: str) -> Path:
        """The pod's own cgroup dir in one v1 controller, checked to stay under it."""
        path = CGROUP_ROOT / controller / pod.linux.cgroup_parent.lstrip("/")
        assert path.is_relative_to(CGROUP_ROOT / controller), path
        return path

    def cgroup_value(self, pod: cri_v1_pb2.PodSandboxConfig, cid: str, controller: str, name: str) -> str:
        rel = pod.linux.cgroup_parent.lstrip("/")
        return (CGROUP_ROOT / controller / rel / cid / name).read_text().strip()

    def cpu_shares(self, pod: cri_v1_pb2.PodSandboxConfig, cid: str) -> int:
        return int(self.cgroup_value(pod, cid, "cpu", "cpu.shares"))

    def cleanup(self) -> None:
        for cid in reversed(self._containers):
            _quietly(lambda c=cid: self.direct.StopContainer(
                cri_v1_pb2.StopContainerRequest(container_id=c, timeout=0), timeout=30))
            _quietly(lambda c=cid: self.direct.RemoveContainer(
                cri_v1_pb2.RemoveContainerRequest(container_id=c), timeout=30))
        for sid in reversed(self._sandboxes):
            _quietly(lambda s=sid: self.direct.StopPodSandbox(
                cri_v1_pb2.StopPodSandboxRequest(pod_sandbox_id=s), timeout=60))
            _quietly(lambda s=sid: self.direct.RemovePodSandbox(
                cri_v1_pb2.RemovePodSandboxRequest(pod_sandbox_id=s), timeout=60))
        # kubelet removes a pod's cgroup once the pod is gone; do the same, so a stale pod
        # dir (with its CFS quota) does not constrain later tests' parent cgroups.
        for parent in reversed(self._pod_parents):
            if parent.strip("/"):
                try:
                    remove_cgroup_tree(parent, timeout=2.0)
                except (OSError, ValueError):
                    pass
        shutil.rmtree(self.log_root, ignore_errors=True)


def _quietly(call: Callable[[], object]) -> None:
    try:
        call()
    except grpc.RpcError:
        pass


@pytest.fixture
def direct_runtime(
    containerd: EmbeddedContainerd, cri_channel_factory: Callable[[Path | str], grpc.Channel]
) -> Any:
    """RuntimeService stub straight to the fixture containerd (no proxy)."""
    return runtime_stub(cri_channel_factory(containerd.socket))


def _pod_kit(containerd: EmbeddedContainerd, cgroup_prefix: str, busybox_image: str) -> Iterator[PodKit]:
    channel = unix_channel(containerd.socket)
    kit = PodKit(runtime_stub(channel), cgroup_prefix, tmpnames.mkdtemp("logs-"),
                 busybox_image)
    try:
        yield kit
    finally:
        kit.cleanup()
        channel.close()


@pytest.fixture
def pods(containerd: EmbeddedContainerd, cgroup_prefix: str, busybox_image: str) -> Iterator[PodKit]:
    """Pod/container builders; everything created is stopped and removed after the test."""
    yield from _pod_kit(containerd, cgroup_prefix, busybox_image)


@pytest.fixture(scope="module")
def module_pods(containerd: EmbeddedContainerd, cgroup_prefix: str, busybox_image: str) -> Iterator[PodKit]:
    """Like ``pods``, for objects shared by the tests of one module."""
    yield from _pod_kit(containerd, cgroup_prefix, busybox_image)


# --------------------------------------------------------------------------
# containerd 1.7.24 with NRI on (the NRI ingress's tests; issue 31)
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nri_containerd(tmp_path_factory: pytest.TempPathFactory, cgroup_prefix: str) -> Iterator[EmbeddedContainerd]:
    """A private containerd 1.7.24 (scripts/setup-host.sh unpacks it) with NRI on and its
    socket in a short private dir; module scope, so a test may restart it."""
    from runtimeproxy.demo.embedded import CONTAINERD_17

    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    if not CONTAINERD_17.is_file():
        message = f"containerd 1.7 missing at {CONTAINERD_17} (scripts/setup-host.sh fetches it)"
        if _under_ci():
            pytest.fail(message)
        pytest.skip(message)
    base = tmp_path_factory.mktemp("containerd17")
    sockets = tmpnames.mkdtemp("nri-")
    images = build_busybox_image(base / "images"), build_pause_image(base / "images")
    ctrd = EmbeddedContainerd(base / "run", binary=CONTAINERD_17, nri_socket=sockets / "nri.sock")
    try:
        ctrd.start()
        for tar in images:
            ctrd.import_image(tar)
        yield ctrd
    finally:
        ctrd.stop()
        shutil.rmtree(sockets, ignore_errors=True)


@pytest.fixture
def nri_pods(nri_containerd: EmbeddedContainerd, cgroup_prefix: str, busybox_image: str) -> Iterator[PodKit]:
    """``pods`` on the containerd 1.7 fixture."""
    yield from _pod_kit(nri_containerd, cgroup_prefix, busybox_image)
