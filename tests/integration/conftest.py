"""Session fixtures: one private containerd (CRI) for the integration tests.

Everything runs against a containerd rooted in a pytest tmp dir, with its own
socket, so the machine's real runtime is never touched.  Test pods live under
a unique top-level cgroup parent that is removed at session end.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from runtimeproxy.embedded import (
    BUSYBOX_IMAGE,
    EmbeddedContainerd,
    build_busybox_image,
    build_pause_image,
    remove_cgroup_tree,
    unique_test_parent,
    unix_channel,
)

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every test in this directory with a clear reason when unsupported."""
    reason = _skip_reason()
    if reason is None:
        return
    marker = pytest.mark.skip(reason=reason)
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(marker)


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
