"""README's main job, ``koord-runtime-proxy demo`` (here with ``--once``): it runs its
private containerd, the proxy and the demo pods, and then leaves nothing behind. Its
/tmp work dir, its cgroup tree and its processes must be gone; the workdir with the
metrics store stays, as documented. Also ``remove_workdir``: it never deletes through
a mount."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtimeproxy.demo.embedded import mounts_under, remove_workdir


def _demo_cgroups(out: str) -> set[Path]:
    """What is left of this demo's own cgroup tree (another run's demo on the machine
    has a tree of its own, named differently)."""
    found = re.search(r"^pods under the cgroup /(koord-demo-[0-9a-f]+) ", out, re.MULTILINE)
    assert found is not None, out
    root = Path("/sys/fs/cgroup")
    return set(root.glob(f"*/{found[1]}")) | set(root.glob(found[1]))


def test_demo_once_runs_the_pods_and_cleans_up(tmp_path: Path) -> None:
    workdir = tmp_path / "wd"
    done = subprocess.run([sys.executable, "-m", "runtimeproxy.cli", "demo", "--once", "--workdir", str(workdir)],
                          capture_output=True, text=True, timeout=240, check=False)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "proxy ready on" in out and out.rstrip().endswith("done")
    root = re.search(r"starting a private containerd \(root (/tmp/krp-[^/]+)/ctd\)", out)
    assert root is not None, out
    base = Path(root[1])
    assert not base.exists(), f"{base} left behind"
    assert "kept " not in done.stderr
    assert _demo_cgroups(out) == set()
    assert (workdir / "metrics.db").is_file()  # the store outlives the demo, for `top`
    # No process of the demo is left: nothing runs with the removed containerd root in argv.
    leftovers = subprocess.run(["pgrep", "-f", str(base)], capture_output=True, text=True, check=False)
    assert leftovers.stdout.strip() == ""


def test_demo_without_workdir_leaves_no_work_dir_behind() -> None:
    """The default work dir (store, pod logs) lives in the private /tmp dir and goes with
    it; nothing is created under /var/tmp (it used to be /var/tmp/koord-runtime-proxy-demo)."""
    var_tmp_before = set(Path("/var/tmp").iterdir())
    done = subprocess.run([sys.executable, "-m", "runtimeproxy.cli", "demo", "--once"],
                          capture_output=True, text=True, timeout=240, check=False)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    work = re.search(r"^work dir (\S+) \(removed at the end\)$", out, re.MULTILINE)
    assert work is not None, out
    assert work[1].startswith("/tmp/krp-") and not Path(work[1]).exists()
    assert "koord-runtime-proxy top" in out  # the store was there while the demo ran
    assert set(Path("/var/tmp").iterdir()) - var_tmp_before == set()


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[Path]:
    base = tmp_path / "work"
    (base / "ctd/rootfs").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(base / "ctd/rootfs")], check=True)
    try:
        yield base
    finally:
        subprocess.run(["umount", str(base / "ctd/rootfs")], check=False)


def test_remove_workdir_keeps_a_dir_with_a_mount_below_it(mounted: Path) -> None:
    (mounted / "ctd/rootfs/owned-by-the-mount").write_text("x")
    (mounted / "image.tar").write_text("x")
    assert mounts_under(mounted) == [mounted / "ctd/rootfs"]
    assert remove_workdir(mounted) is False
    assert (mounted / "ctd/rootfs/owned-by-the-mount").exists() and (mounted / "image.tar").exists()
    subprocess.run(["umount", str(mounted / "ctd/rootfs")], check=True)
    assert remove_workdir(mounted) is True
    assert not mounted.exists()
    assert remove_workdir(mounted) is True  # already gone


def test_demo_ingress_nri_hooks_the_pods_through_nri_and_cleans_up(tmp_path: Path) -> None:
    """``demo --ingress nri``: containerd 1.7.24 calls the agent; the pods are created
    straight at containerd, and the BE pod's container still gets its batch values."""
    from runtimeproxy.demo.embedded import CONTAINERD_17

    if not CONTAINERD_17.is_file():
        pytest.skip(f"containerd 1.7 missing at {CONTAINERD_17} (scripts/setup-host.sh fetches it)")
    done = subprocess.run([sys.executable, "-m", "runtimeproxy.cli", "demo", "--once", "--ingress", "nri",
                           "--workdir", str(tmp_path / "wd")], capture_output=True, text=True, timeout=240, check=False)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "agent ready: ingress nri (NRI plugin 50-koord-runtime-proxy on " in out and "proxy ready" not in out
    batch = out[out.index("pod demo/batch"):]
    assert "container cgroup: cpu.shares=512 cfs_quota_us=100000" in batch
    assert "[PreCreateContainer] batch-resource: container.resources.cpu_shares: 2 -> 512" in batch
    assert "not applied: NRI 0.6.1 has no pod sandbox adjustment" in batch
    root = re.search(r"starting a private containerd \(root (/tmp/krp-[^/]+)/ctd\)", out)
    assert root is not None and not Path(root[1]).exists()
    assert _demo_cgroups(out) == set()
