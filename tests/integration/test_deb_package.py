"""The Debian package (scripts/build-deb.sh) in a booted Debian 12 under a real systemd: a first
install starts nothing, the enabled unit becomes READY, an upgrade to a package with a new
version restarts the proxy without a failed pass-through call, purge leaves only what the
operator wrote."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest

from runtimeproxy.demo.embedded import EmbeddedContainerd
from tests import tmpnames
from tests.integration.sdmachine import HAPROXY, PROXY, REPO, ROOT_CACHE, Clients, Machine, answers, wait

VERSION = "0.1.0"
UPGRADE = "0.1.0+rebuild1"


def _repack(deb: Path, version: str, out: Path) -> Path:
    """The same package rebuilt with another version (dpkg-deb: unpack, new control, build)."""
    tree = out / f"tree-{version}"
    subprocess.run(["dpkg-deb", "-R", str(deb), str(tree)], check=True)
    control = tree / "DEBIAN" / "control"
    control.write_text("".join(f"Version: {version}\n" if line.startswith("Version:") else line
                               for line in control.read_text().splitlines(keepends=True)))
    new = out / f"koord-runtime-proxy_{version}_amd64.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "-b", str(tree), str(new)],
                   check=True, capture_output=True)
    shutil.rmtree(tree)
    return new


@pytest.fixture(scope="module")
def debs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if not (ROOT_CACHE / "usr" / "bin" / "python3").exists() or shutil.which("dpkg-deb") is None:
        pytest.skip(f"no Debian root ({ROOT_CACHE}) or dpkg-deb: run scripts/setup-host.sh")
    out = tmp_path_factory.mktemp("deb")
    built = subprocess.run(["bash", str(REPO / "scripts" / "build-deb.sh"), VERSION, str(out)],
                           capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    first = Path(built.stdout.strip().splitlines()[-1])
    return first, _repack(first, UPGRADE, out)


@pytest.fixture(scope="module")
def node(containerd: EmbeddedContainerd, debs: tuple[Path, Path]) -> Iterator[Machine]:
    """A fresh Debian 12 node: haproxy installed (the package's dependency), no agent."""
    base = tmpnames.unique("deb")
    base.mkdir(mode=0o700)
    m = Machine(base, Path(containerd.socket))
    try:
        m.mount()
        shutil.rmtree(m.merged / "opt" / "koord-runtime-proxy")  # the cache's empty venv: not on a fresh node
        (m.merged / "opt" / "debs").mkdir()
        for deb in debs:
            shutil.copy(deb, m.merged / "opt" / "debs" / deb.name)
        m.connect_containerd()
        m.boot()
        yield m
    finally:
        if m.pid:
            for unit in (PROXY, HAPROXY):
                print(f"--- journal of {unit}:\n{m.journal(unit)[-6000:]}")
        m.shutdown()


def _ours(root: Path) -> list[str]:
    """Every path of the package's (and what it makes at run time) that exists under ``root``."""
    paths = ["opt/koord-runtime-proxy", "etc/koord-runtime-proxy/config.yaml", "var/lib/koord-runtime-proxy",
             "lib/systemd/system/koord-runtime-proxy.service", "lib/systemd/system/koord-runtime-proxy-haproxy.service",
             "usr/sbin/koord-runtime-proxy", "usr/share/doc/koord-runtime-proxy", "usr/share/koord-runtime-proxy"]
    found = [p for p in paths if (root / p).exists() or (root / p).is_symlink()]
    found += [str(p.relative_to(root)) for p in (root / "etc" / "systemd" / "system").rglob("koord-runtime-proxy*")]
    return found


def test_the_package_carries_the_bytecode_of_every_module(debs: tuple[Path, Path]) -> None:
    """The unit starts from the bytecode pip compiled at build time, ours and the
    libraries': a module without it is compiled at every start, which costs the proxy
    CPU and leaves the compiler's memory in its heap (bench_metrics measures the process
    with bytecode, as shipped)."""
    listing = subprocess.run(["dpkg-deb", "-c", str(debs[0])], capture_output=True, text=True, check=True).stdout
    names = [PurePosixPath(line.split()[-1]) for line in listing.splitlines()]
    sources = [n for n in names if n.suffix == ".py" and "site-packages" in n.parts]
    compiled = {n for n in names if n.suffix == ".pyc"}
    assert any(n.parts[-2:] == ("runtimeproxy", "app.py") for n in sources), [str(n) for n in sources[:5]]
    missing = [str(n) for n in sources if n.parent / "__pycache__" / f"{n.stem}.cpython-311.pyc" not in compiled]
    assert missing == [], missing[:10]


def test_install_enable_upgrade_purge(node: Machine, debs: tuple[Path, Path]) -> None:
    first, second = debs
    node.run(["dpkg", "-i", f"/opt/debs/{first.name}"])
    # Installed, started nothing.
    assert node.systemctl("is-enabled", PROXY, check=False) == "disabled"
    assert node.show(PROXY, "ActiveState") == "inactive" and node.show(HAPROXY, "ActiveState") == "inactive"
    assert node.run(["koord-runtime-proxy", "check-config", "--config", "/etc/koord-runtime-proxy/config.yaml"],
                    ).returncode == 0
    # Enabled and started: READY (systemctl returns once READY=1 came), answering through HAProxy.
    node.systemctl("enable", "--now", PROXY)
    assert node.show(PROXY, "ActiveState") == "active" and node.show(HAPROXY, "ActiveState") == "active"
    assert answers(node.socket)
    proxy_pid, haproxy_pid = node.main_pid(PROXY), node.main_pid(HAPROXY)
    # Upgrade under load: the proxy restarts, HAProxy does not, no pass-through call fails.
    with Clients(node.socket) as clients:
        clients.more(200)
        node.run(["dpkg", "-i", f"/opt/debs/{second.name}"], timeout=180)
        wait(lambda: node.show(PROXY, "ActiveState") == "active", 60, "the upgraded proxy READY")
        clients.more(300)
    print(f"upgrade: {dict(clients.outcomes)}")
    assert set(clients.outcomes) == {"OK"}, clients.outcomes
    assert node.run(["dpkg-query", "-W", "-f=${Version}", "koord-runtime-proxy"]).stdout == UPGRADE
    assert node.main_pid(PROXY) != proxy_pid and node.main_pid(HAPROXY) == haproxy_pid
    # Purge: both stopped, kubelet's socket gone, nothing of ours left but the operator's file.
    operator_file = node.merged / "etc" / "koord-runtime-proxy" / "kubeconfig"
    operator_file.write_text("# written by the operator\n")
    node.run(["dpkg", "--purge", "koord-runtime-proxy"], timeout=120)
    assert node.show(PROXY, "LoadState") == "not-found" and node.show(HAPROXY, "LoadState") == "not-found"
    assert node.processes("haproxy") == [] and not node.socket.exists()
    assert _ours(node.merged) == []
    assert operator_file.read_text() == "# written by the operator\n"
