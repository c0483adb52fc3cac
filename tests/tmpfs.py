"""A small filesystem of a test's own (a tmpfs it mounts and unmounts), and filling it:
for the full-disk tests (the metrics store, the change history)."""

from __future__ import annotations

import contextlib
import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests import tmpnames


@contextlib.contextmanager
def small_tmpfs(size: str, kind: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's syntax: ``2m``, ``256k``), unmounted (and its mount
    point removed) afterwards; the mount point is ``/tmp/krpt<session>-<kind>…``."""
    point = tmpnames.mkdtemp(kind)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", kind.strip("-"), str(point)],
                       check=True)
        try:
            yield point
        finally:
            if subprocess.run(["umount", str(point)], check=False).returncode != 0:
                subprocess.run(["umount", "-l", str(point)], check=False)
    finally:
        point.rmdir()


def fill(fs: Path) -> Path:
    """Take every free byte of ``fs`` with one file (returned: unlink it to free them)."""
    filler = fs / "filler"
    with open(filler, "wb", buffering=0) as out:
        try:
            while True:
                out.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler
