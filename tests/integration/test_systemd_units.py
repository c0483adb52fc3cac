"""The shipped units under a real systemd (252, Debian bookworm): HAProxy supervised by its own
unit, the proxy's unit tied to it (systemd/koord-runtime-proxy*.service).

A Debian root built once by scripts/setup-host.sh (/var/cache/koord-runtime-proxy/systemd-root)
is booted as an overlay (the cache is never written) with ``systemd-nspawn -b``; the project's
wheel is installed into the root's venv from a local wheelhouse (no network inside), the shipped
units and config are installed as a package would. The fixture's private containerd answers on
/run/containerd/containerd.sock inside (a symlink to its socket, bound in), and kubelet's socket
directory is bound out, so the calls below come from this (host) process, as kubelet's would.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtimeproxy.demo.embedded import EmbeddedContainerd
from tests import tmpnames
from tests.integration.sdmachine import (
    CALL_TIMEOUT,
    HAPROXY,
    PROXY,
    ROOT_CACHE,
    Clients,
    Machine,
)
from tests.integration.sdmachine import answers as _answers
from tests.integration.sdmachine import wait as _wait


@pytest.fixture(scope="module")
def machine(containerd: EmbeddedContainerd) -> Iterator[Machine]:
    missing = [b for b in ("systemd-nspawn", "nsenter") if shutil.which(b) is None]
    if missing or not (ROOT_CACHE / "lib" / "systemd" / "systemd").exists():
        pytest.skip(f"no bootable root ({ROOT_CACHE}) or {missing}: run scripts/setup-host.sh")
    base = tmpnames.unique("sd")
    base.mkdir(mode=0o700)
    m = Machine(base, Path(containerd.socket))
    try:
        m.prepare()
        m.boot()
        yield m
    finally:
        if m.pid:  # shown with a failure (pytest prints a failed test's captured output)
            for unit in (PROXY, HAPROXY):
                print(f"--- journal of {unit}:\n{m.journal(unit)[-6000:]}")
        m.shutdown()


def test_ready_only_when_containerd_answers_through_haproxy_and_the_watchdog_is_systemds(machine: Machine) -> None:
    """Booted without containerd: the proxy's unit stays activating (no READY=1) while HAProxy's
    unit is already active (started by the proxy); once containerd answers, READY=1 comes and a
    call through kubelet's socket answers at that moment. Pings reach systemd's watchdog; a
    proxy that stops pinging (SIGSTOP) is killed and restarted by systemd, HAProxy untouched."""
    _wait(lambda: machine.show(HAPROXY, "ActiveState") == "active", 60, "haproxy's unit active")
    # Not READY for a while: the proxy polls containerd every <= 2 s; two polls' worth.
    time.sleep(4)
    assert machine.show(PROXY, "ActiveState") == "activating"
    assert not _answers(machine.socket)  # HAProxy listens; containerd does not answer behind it
    machine.connect_containerd()
    _wait(lambda: machine.show(PROXY, "ActiveState") == "active", 30, "the proxy READY")
    assert _answers(machine.socket)
    haproxy_pid = machine.main_pid(HAPROXY)
    # The watchdog: pings arrive (the timestamp moves), and stopping them gets the proxy restarted.
    first = machine.show(PROXY, "WatchdogTimestampMonotonic")
    _wait(lambda: machine.show(PROXY, "WatchdogTimestampMonotonic") != first, 5, "a watchdog ping")
    restarts = int(machine.show(PROXY, "NRestarts"))
    proxy_pid = machine.main_pid(PROXY)
    with Clients(machine.socket) as clients:
        clients.more(100)
        os.kill(machine.host_pid(proxy_pid), signal.SIGSTOP)
        _wait(lambda: int(machine.show(PROXY, "NRestarts")) > restarts, 20, "restarted by systemd's watchdog")
        _wait(lambda: machine.show(PROXY, "ActiveState") == "active", 30, "the proxy READY again")
        clients.more(100)
    assert machine.main_pid(PROXY) != proxy_pid
    assert "Watchdog timeout" in machine.journal(PROXY)
    assert set(clients.outcomes) == {"OK"}, clients.outcomes
    assert machine.main_pid(HAPROXY) == haproxy_pid


def test_five_restarts_and_a_kill_9_of_the_proxy_fail_no_pass_through_call(machine: Machine) -> None:
    machine.ready()
    haproxy_pid = machine.main_pid(HAPROXY)
    with Clients(machine.socket) as clients:
        clients.more(200)
        for _ in range(5):
            before = machine.main_pid(PROXY)
            machine.systemctl("restart", PROXY)  # returns once the new process sent READY=1
            assert machine.main_pid(PROXY) != before
            clients.more(200)
        # A crash: systemd restarts the proxy (RestartSec=2), HAProxy is not stopped meanwhile.
        crashed, restarts = machine.main_pid(PROXY), int(machine.show(PROXY, "NRestarts"))
        os.kill(machine.host_pid(crashed), signal.SIGKILL)
        _wait(lambda: int(machine.show(PROXY, "NRestarts")) > restarts, 20, "restarted after the crash")
        _wait(lambda: machine.show(PROXY, "ActiveState") == "active", 30, "the proxy READY again")
        clients.more(200)
    print(f"5 restarts and a kill -9: {dict(clients.outcomes)}, slowest call {clients.slowest:.3f}s")
    assert set(clients.outcomes) == {"OK"}, clients.outcomes
    assert clients.slowest < CALL_TIMEOUT
    assert machine.main_pid(HAPROXY) == haproxy_pid  # the same master, never restarted
    # HAProxy's own messages are in the journal, under its unit.
    assert "Loading success" in machine.journal(HAPROXY)


def test_haproxy_package_upgraded_by_dpkg_then_a_proxy_restart_and_a_reload_fail_no_call(machine: Machine) -> None:
    """dpkg installs HAProxy's package again (its .deb from the root's apt cache: dpkg writes the
    new binary next to the old one and renames it over, as in an upgrade). Then the case of issue
    26 problem 1, a proxy restart with the running binary deleted, and ``systemctl reload``: the
    master re-executes the new file. No call fails."""
    machine.ready()
    debs = sorted((machine.merged / "var" / "cache" / "apt" / "archives").glob("haproxy_*.deb"))
    assert debs, "the cached root keeps haproxy's .deb (scripts/setup-host.sh)"
    master = machine.main_pid(HAPROXY)
    host_master = machine.host_pid(master)
    old_inode = os.stat(f"/proc/{host_master}/exe").st_ino
    with Clients(machine.socket) as clients:
        clients.more(200)
        machine.run(["dpkg", "-i", f"/var/cache/apt/archives/{debs[-1].name}"], timeout=120)
        assert os.readlink(f"/proc/{host_master}/exe").endswith("(deleted)")
        machine.systemctl("restart", PROXY)
        clients.more(200)
        machine.systemctl("reload", HAPROXY)
        _wait(lambda: not os.readlink(f"/proc/{host_master}/exe").endswith("(deleted)"), 10,
              "the master re-executed the new binary")
        clients.more(500)
    print(f"haproxy package upgrade + proxy restart + reload: {dict(clients.outcomes)}")
    assert os.stat(f"/proc/{host_master}/exe").st_ino != old_inode
    assert machine.main_pid(HAPROXY) == master  # a reload, not a restart
    assert set(clients.outcomes) == {"OK"}, clients.outcomes
    # Debian's own haproxy.service (disabled) was not started by the package's scripts.
    assert machine.show("haproxy.service", "ActiveState") == "inactive"


def test_haproxy_killed_is_back_via_systemd_within_2s(machine: Machine) -> None:
    machine.ready()
    master = machine.main_pid(HAPROXY)
    os.kill(machine.host_pid(master), signal.SIGKILL)
    killed = time.monotonic()
    _wait(lambda: _answers(machine.socket), 10, "kubelet's socket answering again")
    back = time.monotonic() - killed
    print(f"haproxy killed -9: answering again after {back:.3f}s")
    assert back < 2.0, f"back after {back:.2f}s (loaded host: see the console log)"
    assert machine.main_pid(HAPROXY) != master
    assert machine.show(PROXY, "ActiveState") == "active"


def test_stop_of_the_proxy_stops_haproxy_and_removes_kubelets_socket(machine: Machine) -> None:
    machine.ready()
    assert machine.socket.exists()
    machine.systemctl("stop", PROXY)
    assert machine.show(PROXY, "ActiveState") == "inactive"
    # HAProxy's stop job was queued --no-block by the proxy's ExecStopPost, after it (After=).
    _wait(lambda: machine.show(HAPROXY, "ActiveState") == "inactive", 30, "haproxy's unit stopped")
    assert machine.show(HAPROXY, "MainPID") == "0"
    assert machine.processes("haproxy") == []
    assert not machine.socket.exists()
    # Drained first, stopped last: the proxy's stop ended before HAProxy's began (After=).
    proxy_stopped = int(machine.show(PROXY, "InactiveEnterTimestampMonotonic"))
    haproxy_stopping = int(machine.show(HAPROXY, "ActiveExitTimestampMonotonic"))
    assert 0 < proxy_stopped <= haproxy_stopping
    # And a start brings both back, as at boot.
    machine.systemctl("start", PROXY)
    assert machine.show(HAPROXY, "ActiveState") == "active" and _answers(machine.socket)

