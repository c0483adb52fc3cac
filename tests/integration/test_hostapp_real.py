"""Host applications on this machine's real cgroups: a process burning CPU and holding
memory in a cgroup under the test's unique parent shows up through the NodeSLO-shaped
``hostApplications`` item, with its CPU cores and memory."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from metrics import model as m
from metrics.collect.hostapp import HostAppCollector, parse_host_apps
from runtimeproxy.demo.embeddedcgroup import remove_cgroup_tree
from runtimeproxy.hookapi import HostRoots

MIB = 1 << 20
ANON = 32 * MIB
# What the burner holds: more than ANON because memory.stat is flushed lazily (per-CPU
# batches of 64 pages), so a read may trail the truth by a few hundred KiB; CI once saw
# 32 MiB - 104 KiB for exactly 32 MiB held.
HELD = ANON + 8 * MIB
CGROUP_ROOT = Path("/sys/fs/cgroup")

# It allocates only once told it is in the cgroup: on v1 pages charged before a move stay
# with the old cgroup (no move_charge_at_immigrate), so an early allocation was seen
# short of ANON.
_BURNER = f"""
import sys, time
sys.stdin.readline()
held = bytearray(b"a" * {HELD})
print("ready", flush=True)
while True:
    pass
"""


def _dirs(collector: HostAppCollector, rel: str) -> list[Path]:
    reader = collector.reader
    return list(dict.fromkeys([reader.cpuacct_dir(rel), reader.memory_dir(rel)]))


@pytest.fixture
def burner(cgroup_prefix: str) -> Iterator[tuple[HostAppCollector, str]]:
    rel = f"{cgroup_prefix}/hostapp-{uuid.uuid4().hex[:8]}"
    collector = HostAppCollector(HostRoots(cgroup=CGROUP_ROOT))
    dirs = _dirs(collector, rel)
    for directory in dirs:
        directory.mkdir(parents=True)
    child = subprocess.Popen([sys.executable, "-c", _BURNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        for directory in dirs:
            (directory / "cgroup.procs").write_text(f"{child.pid}\n")
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "ready"
        yield collector, rel
    finally:
        child.kill()
        child.wait()
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()
        remove_cgroup_tree(rel, CGROUP_ROOT)


def test_a_real_cgroup_with_a_busy_process_has_usage(burner: tuple[HostAppCollector, str]) -> None:
    collector, rel = burner
    parent, leaf = rel.rsplit("/", 1)
    spec = {"name": "burner", "priority": "koord-prod", "qos": "LS",
            "cgroupPath": {"base": "CgroupRoot", "parentDir": parent, "relativePath": leaf}}
    apps, problems = parse_host_apps([spec])
    assert problems == [] and apps[0].cgroup_dir == rel.strip("/")
    collector.set_apps(apps)
    # What the burner really got, read around the collector's two reads: how much CPU one
    # busy thread gets is the host's to decide (CI runs this beside burners and a second
    # suite, where it got 0.13 core), so the collector is checked against the kernel's
    # own counter over the same second, not against a share it may not get.
    usage = collector.reader.cpu_usage_ns
    start, used = time.monotonic(), usage(rel)
    collector.collect(time.time(), [])
    time.sleep(1.0)
    samples = {s.metric: s for s in collector.collect(time.time(), [])}
    got = (usage(rel) - used) / 1e9 / (time.monotonic() - start)
    cpu, memory = samples[m.HOST_APP_CPU_USAGE], samples[m.HOST_APP_MEMORY_USED]
    assert dict(cpu.labels) == {"host_app_name": "burner", "priority_class": "koord-prod", "qos": "LS"}
    assert got > 0.01, f"the burner got {got:.3f} core in a second: nothing to measure"
    # One thread: at most a core; the collector's second lies within the one read here.
    assert abs(cpu.value - got) <= 0.05 + 0.1 * got and cpu.value < 1.05, (cpu.value, got)
    assert memory.value >= ANON, memory.value
