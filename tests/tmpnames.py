"""Names for what the tests make in /tmp: every one starts ``krpt<session>-``.

Other test runs share this machine's /tmp (a clone-alone run beside CI, a developer's
run), so the integration conftest's check for dirs a run left behind counts only the
entries that carry this session's tag; a name without it is some other run's."""

from __future__ import annotations

import secrets
import tempfile
import uuid
from pathlib import Path
from typing import Final

#: This pytest process's tag (one process: the suite does not run in workers).
SESSION: Final = secrets.token_hex(3)
#: Every test-made entry in /tmp starts with this.
PREFIX: Final = f"krpt{SESSION}-"
TMP: Final = Path("/tmp")  # not $TMPDIR: unix socket paths under it must stay short


def mkdtemp(kind: str = "") -> Path:
    """A new private (0700) dir ``/tmp/krpt<session>-<kind><random>``."""
    return Path(tempfile.mkdtemp(dir=TMP, prefix=PREFIX + kind))


def unique(kind: str) -> Path:
    """A name ``/tmp/krpt<session>-<kind>-<hex>`` for a dir made later (not created here)."""
    return TMP / f"{PREFIX}{kind}-{uuid.uuid4().hex}"
